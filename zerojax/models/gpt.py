"""A small byte-level GPT in Flax NNX, shaped for ZeRO-3.

The blocks are stacked (one leading layer axis per parameter) and applied with `lax.scan` over a
rematerialized body. The body calls `zerojax.gather` on its own layer's parameters, so under ZeRO-3
only one layer is ever whole on a device and each layer's gradient is reduce-scattered inside the
backward scan, rather than the whole model gathered at the top (docs/zero.md has the measured
temp memory). Outside ZeRO-3 `gather` is the identity.

Parameters are kept as a plain nested dict (`nnx.to_pure_dict`), the form optax, orbax and the
plan work with; `apply` merges each layer back into the NNX `Block` to run it.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.core.collectives import gather, gathers_params
from zerojax.config import ActivationCheckpointingConfig, ModelConfig
from zerojax.models import attention as causal_attention
from zerojax.models import lora
from zerojax.models.loss import next_token_loss
from zerojax.planner.settings import remat_policy


def norm_eps(cfg: ModelConfig) -> float:
    """The LayerNorm epsilon (`model.norm_eps`; 1e-6 unless set, GPT-2 checkpoints use 1e-5)."""
    return cfg.norm_eps if cfg.norm_eps is not None else 1e-6


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff or 4 * cfg.d_model
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        self.n_heads = cfg.n_heads
        self.attention_mode, self.attention_block = cfg.attention, cfg.attention_block
        eps = norm_eps(cfg)
        self.ln1 = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.qkv = lora.linear(cfg, "qkv", d, 3 * d, kernel_init=init, rngs=rngs)
        self.proj = lora.linear(cfg, "proj", d, d, kernel_init=out_init, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.fc = lora.linear(cfg, "fc", d, f, kernel_init=init, rngs=rngs)
        self.out = lora.linear(cfg, "out", f, d, kernel_init=out_init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (y.reshape(b, t, h, d // h) for y in (q, k, v))
        att = causal_attention.library_form(q, k, v, self.attention_mode)
        if att is not None:
            att = att.reshape(b, t, d)
        elif causal_attention.uses_blockwise(self.attention_mode, self.attention_block, t):
            att = causal_attention.blockwise(q, k, v, self.attention_block).reshape(b, t, d)
        else:
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
            scores = scores / jnp.sqrt(jnp.float32(d // h))
            mask = jnp.tril(jnp.ones((t, t), jnp.bool_))
            probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(x.dtype)
            att = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


def _embeddings(cfg: ModelConfig, rngs: nnx.Rngs) -> tuple[nnx.Embed, nnx.Param]:
    """Token and learned position embeddings (shared by GPT and its pipeline form, same init order)."""
    init = nnx.initializers.normal(cfg.init_std)
    embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, rngs=rngs)
    return embed, nnx.Param(init(rngs.params(), (cfg.seq_len, cfg.d_model)))


class GPT(nnx.Module):
    """Token + position embeddings, `n_layers` stacked blocks, final norm, LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.embed, self.pos = _embeddings(cfg, rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = stacked(rngs)
        self.ln_f = nnx.LayerNorm(d, epsilon=norm_eps(cfg), rngs=rngs)
        if not cfg.tie_embeddings:  # tied (GPT-2's default): the head is the token embedding, transposed
            self.head = nnx.Linear(d, cfg.vocab_size, use_bias=False,
                                   kernel_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)


def init_params(cfg: ModelConfig, key: jax.Array | int = 0) -> dict[str, Any]:
    """Fresh fp32 parameters as a nested dict of arrays."""
    seed = key if isinstance(key, int) else jax.random.key_data(key)[-1]
    model = GPT(cfg, rngs=nnx.Rngs(params=seed))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def abstract_params(cfg: ModelConfig) -> dict[str, Any]:
    """Shapes and dtypes of `init_params`, without allocating."""
    return jax.eval_shape(lambda: init_params(cfg, 0))


@functools.lru_cache(maxsize=None)
def _block_split(cfg: ModelConfig) -> tuple[Any, nnx.State]:
    """A Block's graph and abstract state, traced once per config (each trace of the model reuses them)."""
    return nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))


def _block(cfg: ModelConfig, layer: dict[str, Any]) -> Block:
    """Rebuild one Block from its parameter dict (trace-time only)."""
    graphdef, abstract = _block_split(cfg)
    state = jax.tree.map(lambda x: x, abstract)  # a fresh State to fill: the cached one stays abstract
    nnx.replace_by_pure_dict(state, layer)
    return nnx.merge(graphdef, state)


def layer_norm(p: dict[str, jax.Array], x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm in float32 over the last axis with `p`'s scale and bias (the model's and the decoder's)."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def apply(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array,
          checkpointing: Optional[ActivationCheckpointingConfig] = None) -> jax.Array:
    """Logits (float32) for `tokens` [batch, time]; params may hold ZeRO-3 `ParamShard`s.

    `checkpointing` (the config's `activation_checkpointing`) picks what each block keeps for the
    backward pass (`zerojax.core.remat`); without it, or with its policy null, `cfg.remat` decides.
    """
    top = gather({k: v for k, v in params.items() if k != "blocks"})
    t = tokens.shape[1]
    x = jnp.take(top["embed"]["embedding"], tokens, axis=0) + top["pos"][:t]

    def body(x: jax.Array, layer: dict[str, Any]) -> tuple[jax.Array, None]:
        return _block(cfg, gather(layer))(x), None

    remat = remat_policy(checkpointing or ActivationCheckpointingConfig(), model_remat=cfg.remat)
    if remat is not None:
        body = remat.wrap(body)
    x, _ = jax.lax.scan(body, x, params["blocks"])
    x = layer_norm(top["ln_f"], x, norm_eps(cfg))
    return logits(top, x)


def logits(params: dict[str, Any], x: jax.Array) -> jax.Array:
    """float32 logits of the final hidden states: the LM head, or the token embedding transposed when
    the embeddings are tied (`model.tie_embeddings`, GPT-2's default)."""
    if "head" in params:
        return jnp.einsum("btd,dv->btv", x, params["head"]["kernel"], preferred_element_type=jnp.float32)
    return jnp.einsum("btd,vd->btv", x, params["embed"]["embedding"], preferred_element_type=jnp.float32)


def make_loss_fn(cfg: ModelConfig, checkpointing: Optional[ActivationCheckpointingConfig] = None) -> Any:
    """Mean next-token cross-entropy; `batch["tokens"]` is [rows, seq_len + 1] int32, and an optional
    `batch["loss_mask"]` [rows, seq_len] weights each prediction (0: not counted, e.g. across a
    document boundary).

    `checkpointing`: the config's `activation_checkpointing` section (train.py passes it); the loss
    places its own gathers and remat, so the step does not rewrite it."""

    @gathers_params
    def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        tokens = batch["tokens"]
        logits = apply(cfg, params, tokens[:, :-1], checkpointing)
        return next_token_loss(logits, batch)

    return loss_fn


# ---------------------------------------------------------------------------------------------
# The same model as a list of pipeline layers (train.py with mesh.stage > 1).

class Embedding(nnx.Module):
    """Token + position embeddings: the first pipeline layer, reading the batch itself."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embed, self.pos = _embeddings(cfg, rngs)

    def __call__(self, batch: dict[str, jax.Array]) -> jax.Array:
        tokens = batch["tokens"][:, :-1]
        return jnp.take(self.embed.embedding[...], tokens, axis=0) + self.pos[...][:tokens.shape[1]]


class Head(nnx.Module):
    """Final layer norm and LM head: the last pipeline layer, giving float32 logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.ln_f = nnx.LayerNorm(cfg.d_model, epsilon=norm_eps(cfg), rngs=rngs)
        self.eps = norm_eps(cfg)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                               kernel_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = layer_norm({"scale": self.ln_f.scale[...], "bias": self.ln_f.bias[...]}, x, self.eps)
        return jnp.einsum("btd,dv->btv", x, self.head.kernel[...], preferred_element_type=jnp.float32)


def pipeline_loss(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of the Head's logits (weighted by `loss_mask` where given)."""
    return next_token_loss(logits, batch)


def pipeline_layers(cfg: ModelConfig) -> list[Any]:
    """The GPT as LayerSpecs: Embedding, n_layers Blocks, Head (what `apply` computes)."""
    from zerojax.pipeline import LayerSpec
    return [LayerSpec(Embedding, cfg), *[LayerSpec(Block, cfg) for _ in range(cfg.n_layers)], LayerSpec(Head, cfg)]


def pipeline_module(cfg: ModelConfig, partition_method: str = "parameters", num_stages: int | None = None,
                    activation_checkpoint_interval: int | None = None) -> Any:
    """A PipelineModule of the GPT with its loss ('best', DeepSpeed's config default, means parameters)."""
    from zerojax.pipeline import PipelineModule
    method = "parameters" if partition_method == "best" else partition_method
    return PipelineModule(pipeline_layers(cfg), num_stages=num_stages, loss_fn=pipeline_loss,
                          partition_method=method, activation_checkpoint_interval=activation_checkpoint_interval)


def pipeline_params(cfg: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
    """`init_params`-shaped parameters -> the pipeline module's logical parameters (same model)."""
    width = max(2, len(str(cfg.n_layers + 1)))
    out = {f"layer_{0:0{width}d}": {"embed": params["embed"], "pos": params["pos"]}}
    for i in range(cfg.n_layers):
        out[f"layer_{i + 1:0{width}d}"] = jax.tree.map(lambda x, i=i: x[i], params["blocks"])
    out[f"layer_{cfg.n_layers + 1:0{width}d}"] = {"ln_f": params["ln_f"], "head": params["head"]}
    return out
