"""A short generation from a run's model (the embedded GPT or the Llama): `zerojax sample RUN_DIR`,
and the end of train.py.

A loss curve says a run learned; a few generated lines show what. When the prompt and the new tokens
fit in the model's `seq_len` window, generation is `zerojax.models.generate`: a KV cache, one compiled
program for the whole text, sampled on the device from a key made from the seed. Longer, the window
slides (the GPT's learned positions stop at seq_len), so the whole window is recomputed for every new
token: one compiled forward pass of [1, seq_len] tokens, with the context left-aligned and the
logits read at its last position, sampled on the host from a seeded numpy generator. Either way the
same seed gives the same text. Text is bytes (UTF-8) for the byte-level corpus, or goes through the
run's `data.tokenizer`.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from zerojax.config import Config, DataConfig, ModelConfig, load_config
from zerojax.core.layout import Plan
from zerojax.core.offload import to_device
from zerojax.errors import ConfigError
from zerojax.models import abstract_params, gpt

#: Prompt when none is given: the corpus is Python source.
DEFAULT_PROMPT = "def "


class Codec:
    """Text <-> token ids the way the run's data was made: UTF-8 bytes, or its tokenizer.json."""

    def __init__(self, data: DataConfig, vocab_size: int, tokenizer: str | None = None):
        self.tokenizer = None
        self.start: list[int] = [10]  # a newline starts an empty byte prompt
        tokenizer = tokenizer or (data.tokenizer if data.source != "tokens" else None)
        if data.source == "tokens" and tokenizer is None:
            raise ConfigError("sample: this run trained on a token file (data.source: tokens), whose ids have no "
                              "text without the tokenizer that made them; pass --tokenizer tokenizer.json")
        if tokenizer:
            from zerojax.runtime.data import EOS_TOKENS, load_tokenizer
            self.tokenizer = load_tokenizer(tokenizer, vocab_size)
            eos = data.eos_id if data.eos_id is not None else next(
                (self.tokenizer.token_to_id(t) for t in EOS_TOKENS if self.tokenizer.token_to_id(t) is not None), 0)
            self.start = [eos]

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            ids = list(text.encode("utf-8"))
        return ids or list(self.start)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(list(ids))
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def generate(cfg: ModelConfig, params: Any, prompt: Sequence[int], n: int, *, temperature: float = 0.8,
             top_k: int | None = 40, seed: int = 0, plan: Plan | None = None) -> list[int]:
    """`n` new token ids after `prompt` (greedy at temperature 0); the context is the last
    seq_len tokens. `params` are whole arrays (numpy or on one device), or laid out by `plan`
    (a run's sharded weights, read where they lie when the text fits the window)."""
    if n <= 0:
        return []
    if not prompt:
        raise ValueError("generate: the prompt needs at least one token")
    window = cfg.seq_len
    from zerojax.models.decode import decoder
    if len(prompt) + n <= window:  # the KV-cache path: one program for the whole text
        from zerojax.models.generate import generate as cached
        if plan is None:
            params = jax.device_put(jax.tree.map(np.asarray, params), jax.devices()[0])
        else:  # laid out by the plan, on the devices: a master copy read back from NVMe comes in host memory
            params = to_device(params)
        out = cached(decoder(cfg), params, [list(prompt)], None, n, temperature=temperature,
                     top_k=top_k if temperature > 0 else None, seed=seed, plan=plan)
        return [int(t) for t in np.asarray(out.tokens)[0]]
    return generate_recompute(cfg, params, prompt, n, temperature=temperature, top_k=top_k, seed=seed)


def generate_recompute(cfg: ModelConfig, params: Any, prompt: Sequence[int], n: int, *, temperature: float = 0.8,
                       top_k: int | None = 40, seed: int = 0) -> list[int]:
    """`generate` without a cache: the whole window of the last seq_len tokens recomputed for every
    new token, sampled on the host (what texts longer than the window use; benchmarks/generate.py
    compares it with the cache)."""
    window = cfg.seq_len
    device = jax.devices()[0]
    params = jax.device_put(jax.tree.map(lambda x: np.asarray(x), params), device)

    logits_at = _logits_at(cfg)
    rng = np.random.default_rng(seed)
    ids, out = list(prompt), []
    for _ in range(n):
        context = ids[-window:]
        buf = np.zeros((1, window), np.int32)
        buf[0, :len(context)] = context
        logits = np.asarray(logits_at(params, buf, np.int32(len(context) - 1)), np.float64)
        if temperature <= 0:
            token = int(np.argmax(logits))
        else:
            logits = logits / temperature
            if top_k is not None and top_k < len(logits):
                logits[logits < np.sort(logits)[-top_k]] = -np.inf
            p = np.exp(logits - logits.max())
            token = int(rng.choice(len(p), p=p / p.sum()))
        ids.append(token)
        out.append(token)
    return out


def sample_text(config: Config, params: Any, prompt: str | None = None, n: int = 64, *,
                temperature: float = 0.8, seed: int = 0, tokenizer: str | None = None,
                plan: Plan | None = None) -> str:
    """The prompt and its continuation, as text (through `tokenizer`, a tokenizer.json, when given;
    else the run's own `data.tokenizer`, or bytes). `plan`: the one `params` are laid out by, if any."""
    codec = Codec(config.data, config.model.vocab_size, tokenizer)
    prompt = DEFAULT_PROMPT if prompt is None and config.data.source == "stdlib" else (prompt or "")
    ids = codec.encode(prompt)
    new = generate(config.model, params, ids, n, temperature=temperature, seed=seed, plan=plan)
    return codec.decode(ids if prompt else []) + codec.decode(new)


def load_run(run_dir: str | Path, tag: str | None = None) -> tuple[Config, Any, str]:
    """A finished (or running) run's config, the parameters of its checkpoint `tag` (latest) and
    the tag's folder."""
    from zerojax import checkpoint
    run = Path(run_dir)
    cfg_file = run / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"sample: {cfg_file} does not exist; give the folder of a train.py run "
                          f"(its run.output_dir, which holds config.json and checkpoints/)")
    config = load_config(json.loads(cfg_file.read_text()))
    from zerojax.app.run_dirs import checkpoint_folder
    ckpt = checkpoint_folder(run, "sample")
    if checkpoint.latest_tag(ckpt) is None and tag is None:
        raise ConfigError(f"sample: {ckpt} holds no checkpoint yet; wait for the run's first save "
                          f"(run.save_every) or its end")
    params, where = checkpoint.read_params(ckpt, tag)
    want = {k: tuple(v.shape) for k, v in _flat(abstract_params(config.model)).items()}
    got = {k: tuple(v.shape) for k, v in _flat(params).items()}
    if want != got:
        raise ConfigError(f"sample: the checkpoint in {where} does not hold the {config.model.name} model of its "
                          f"config.json (a pipelined or user model); export it and generate with your own code")
    return config, params, where


@functools.lru_cache(maxsize=None)
def _logits_at(cfg: ModelConfig) -> Any:
    """`(params, tokens [1, seq_len], pos) -> logits at pos`, jitted once per model config."""
    apply = _apply(cfg)

    @jax.jit
    def logits_at(params: Any, tokens: jax.Array, pos: jax.Array) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(apply(cfg, params, tokens)[0], pos, keepdims=False)

    return logits_at


def _apply(cfg: ModelConfig) -> Any:
    """`apply(cfg, params, tokens) -> logits` of the model `model.name` names."""
    if cfg.name == "llama":
        from zerojax.models import llama
        return llama.apply
    return gpt.apply


def _flat(tree: Any) -> dict[str, Any]:
    from zerojax.core.names import dotted
    return {dotted(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def samples_at_end(config: Config) -> bool:
    """train.py's end-of-run sample can be made in this process: it is on, the run has one process and
    no pipeline stages, and the model is a shipped one."""
    return (bool(config.run.sample_tokens) and jax.process_count() == 1 and config.mesh.stage == 1
            and config.model.name in ("gpt", "llama"))


def end_of_run_sample(config: Config, params: Any, plan: Plan | None = None) -> str | None:
    """The sample printed at the end of train.py (None when it is off or cannot be made here:
    several processes, a pipelined model, or a text longer than the window from parameters too large
    to gather onto one device). With the run's `plan`, a text that fits the window is generated from
    the sharded weights where they lie (gathered once inside the program, not onto the host)."""
    n = config.run.sample_tokens
    if not samples_at_end(config):
        return None
    if plan is not None and len(_prompt_ids(config)) + n <= config.model.seq_len:
        return sample_text(config, params, None, n, seed=config.run.seed, plan=plan)
    if sum(x.size * 4 for x in jax.tree.leaves(params)) > 2 ** 31:
        return None
    host = jax.device_get(params)
    return sample_text(config, jax.tree.map(lambda x: np.asarray(x, np.float32), host), None, n,
                       seed=config.run.seed)



def _prompt_ids(config: Config) -> list[int]:
    """The end-of-run sample's prompt, as token ids."""
    codec = Codec(config.data, config.model.vocab_size)
    return codec.encode(DEFAULT_PROMPT if config.data.source == "stdlib" else "")
