"""GRPO for the shipped models: rollouts as a train batch, group advantages, the policy loss, and
reference log-probabilities from a host copy - or, for a LoRA policy, from its own frozen base.

The loop these serve (examples/rlhf.py) trains and generates with one engine: `engine.generate`
samples G completions per prompt from the live (sharded) weights, a reward scores them, and
`engine.train_batch` takes one step on

    batch = {"tokens" [B, T]: prompt then completion, right-padded,
             "mask" [B, T-1]: 1 where the prediction is a generated token (its eos included),
             "old_logp" [B, T-1]: the sampler's log-probabilities of those tokens,
             "ref_logp" [B, T-1]: the frozen reference policy's,
             "advantages" [B]: the completion's reward, normalised within its group}

The loss is PPO's clipped surrogate on the token ratio p/p_old (one update per rollout, so the
ratio starts at 1 and only the sampler-vs-trainer numerics move it) plus `beta` times the k3
estimate of KL(policy || reference), exp(r - l) - (r - l) - 1 per token: non-negative, unbiased, and
needing only the sampled tokens' log-probabilities (no [B, T, vocab] from the reference).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.config import ModelConfig
from zerojax.core.collectives import gathers_params
from zerojax.models import gpt, llama, lora


def rollout_batch(prompts: np.ndarray, prompt_lengths: np.ndarray, tokens: np.ndarray, lengths: np.ndarray,
                  logprobs: np.ndarray) -> dict[str, np.ndarray]:
    """The train batch of a rollout (module docstring), on the host: each row's prompt (its first
    `prompt_lengths` of `prompts` [B, P]) followed by its `lengths` generated `tokens` [B, N], with
    the sampler's `logprobs` [B, N] placed at the predictions that produced them."""
    b, width = prompts.shape
    n = tokens.shape[1]
    seq = np.zeros((b, width + n), np.int32)
    mask = np.zeros((b, width + n - 1), np.float32)
    old = np.zeros((b, width + n - 1), np.float32)
    for r in range(b):
        p, g = int(prompt_lengths[r]), int(lengths[r])
        seq[r, :p] = prompts[r, :p]
        seq[r, p:p + g] = tokens[r, :g]
        mask[r, p - 1:p - 1 + g] = 1.0  # the prediction at position p-1+j is generated token j
        old[r, p - 1:p - 1 + g] = logprobs[r, :g]
    return {"tokens": seq, "mask": mask, "old_logp": old}


def group_advantages(rewards: np.ndarray, group: int, eps: float = 1e-4) -> np.ndarray:
    """GRPO's advantages: each reward less its group's mean, over its group's standard deviation.
    Rows are grouped consecutively (`group` completions of one prompt each); a group whose rewards
    are all equal gets zeros (it says nothing about which completion is better)."""
    r = np.asarray(rewards, np.float32).reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + eps)).reshape(-1)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log p(tokens[:, t+1] | ...) [B, T-1] from float32 `logits` [B, T-1, vocab] of tokens[:, :-1]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def grpo_objective(logp: jax.Array, batch: dict[str, jax.Array], beta: float, clip: float) -> jax.Array:
    """The mean over generated tokens of the clipped surrogate loss plus beta * k3 KL (module docstring)."""
    mask = batch["mask"].astype(jnp.float32)
    ratio = jnp.exp(logp - batch["old_logp"])
    adv = batch["advantages"][:, None].astype(jnp.float32)
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    return jnp.sum((beta * kl_k3(logp, batch["ref_logp"]) - surrogate) * mask) / jnp.maximum(mask.sum(), 1.0)


def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Per-token k3 estimate of KL(policy || reference) from sampled tokens' log-probabilities."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1


def model_apply(cfg: ModelConfig) -> Callable[[Any, jax.Array], jax.Array]:
    """logits = f(params, tokens) of the model `cfg.name` names (both gather their own ZeRO-3 shards)."""
    module = llama if cfg.name == "llama" else gpt
    return lambda params, tokens: module.apply(cfg, params, tokens)


def make_grpo_loss(cfg: ModelConfig, beta: float = 0.04, clip: float = 0.2) -> Callable[[Any, Any], jax.Array]:
    """The engine's loss for GRPO batches (module docstring) of the model `cfg` describes."""
    apply = model_apply(cfg)

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        tokens = batch["tokens"]
        return grpo_objective(token_logprobs(apply(params, tokens[:, :-1]), tokens), batch, beta, clip)

    return gathers_params(loss_fn) if cfg.name != "llama" else loss_fn


class Reference:
    """A frozen policy that holds no device memory between calls: its parameters live in host numpy
    arrays, and `logprobs` puts them onto the devices in `shardings` (a ZeRO-3 policy's: 1/dp of the
    model per device), runs one forward and deletes them before returning."""

    def __init__(self, cfg: ModelConfig, params: Any, shardings: Any):
        self.params = jax.tree.map(np.asarray, jax.device_get(params))
        self.shardings = shardings
        apply = model_apply(cfg)
        self._forward = jax.jit(lambda p, t: token_logprobs(apply(p, t[:, :-1]), t))

    def logprobs(self, tokens: np.ndarray) -> np.ndarray:
        """log p_ref of tokens[:, 1:] given what precedes them, [B, T-1], on the host."""
        placed = jax.device_put(self.params, self.shardings)
        try:
            return np.asarray(self._forward(placed, tokens))
        finally:
            for x in jax.tree.leaves(placed):
                x.delete()


class BaseReference:
    """The reference of a LoRA policy (`lora` section): its own frozen base, i.e. the policy's live
    parameters with every adapter's B taken as zero (`lora.disabled`: only the small B matrices are made
    anew), run where they are, in their ZeRO shards. No second copy of the weights exists, on the host
    or the devices; since the base never trains, this is the starting policy whatever the step."""

    def __init__(self, cfg: ModelConfig, params: Callable[[], Any]):
        if getattr(cfg, "lora", None) is None:
            raise ValueError("rl.BaseReference: the model has no LoRA adapters (lora.enabled is false), so its "
                             "base is the trained policy itself; use rl.Reference, a frozen host copy")
        self.live = params
        apply = model_apply(cfg)
        self._forward = jax.jit(lambda p, t: token_logprobs(apply(lora.disabled(p), t[:, :-1]), t))

    def logprobs(self, tokens: np.ndarray) -> np.ndarray:
        """log p_base of tokens[:, 1:] given what precedes them, [B, T-1], on the host."""
        return np.asarray(self._forward(self.live(), tokens))


def reference(cfg: ModelConfig, engine: Any) -> "Reference | BaseReference":
    """The reference policy of a GRPO run on `engine`: the frozen base of a LoRA policy (nothing copied),
    else a host copy of the starting weights."""
    if getattr(cfg, "lora", None) is not None:
        return BaseReference(cfg, lambda: engine.params)
    # the plan's parameter placement (the state's; between steps the state holds none with offload_param nvme)
    return Reference(cfg, engine.params, engine.plan.param_storage)
