"""Low-rank adapters (LoRA, Hu et al. 2021) on the shipped models' projections.

A targeted projection keeps its kernel W [in, out] (frozen) and gains two leaves beside it in the
parameter tree: `lora_a` [in, r] and `lora_b` [r, out], B starting at zero so the model starts as its
base. Its output is x W + (alpha / r) (dropout(x) A) B - PEFT's `LoraLayer`, the dropout
(`lora.lora_dropout`) on the adapter's input only, so PEFT's adapters load unchanged
(A = lora_A.weight^T, B = lora_B.weight^T). Nothing is merged: training,
evaluation and the KV-cache decoder all run the same `LoRALinear`, base and adapter apart, so a ZeRO-3
base stays sharded and no merged copy of a weight is ever made.

The adapters are plain parameters, so what ZeRO, the tensor axis and checkpoints do to them needs no
code here: the planner freezes every other leaf (`is_adapter`), and splits A like its base's input
side and B like its output side over `mesh.tensor` (planner/tensor.py).
"""
from __future__ import annotations

import zlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax.errors import ConfigError
from zerojax.planner.tensor import ADAPTER_LEAVES

# Each family's projections (what `target_modules` may name), and the other names that mean them:
# Hugging Face's (Llama's q_proj ..., GPT-2's c_attn ...), DeepSpeed's default target_mods included.
PROJECTIONS = {"llama": ("q", "k", "v", "o", "gate", "up", "down"), "gpt": ("qkv", "proj", "fc", "out")}
_ALIASES = {
    "llama": {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "gate_proj": ("gate",),
              "up_proj": ("up",), "down_proj": ("down",)},
    "gpt": {"c_attn": ("qkv",), "attn.c_proj": ("proj",), "c_fc": ("fc",), "mlp.c_proj": ("out",),
            "c_proj": ("proj", "out"),
            # DeepSpeed's Llama-named defaults on the GPT's fused projections
            "q_proj": ("qkv",), "k_proj": ("qkv",), "v_proj": ("qkv",), "o_proj": ("proj",),
            "gate_proj": ("fc",), "up_proj": ("fc",), "down_proj": ("out",)},
}


def targets(cfg: Any) -> frozenset[str]:
    """The projections of `cfg`'s model that get adapters (none without `cfg.lora`). A name that is none
    of the family's projections is an error naming them: a typo would otherwise train nothing there."""
    lora = getattr(cfg, "lora", None)
    if lora is None:
        return frozenset()
    family = "llama" if cfg.name == "llama" else "gpt"
    own, aliases = PROJECTIONS[family], _ALIASES[family]
    picked: set[str] = set()
    for name in lora.target_modules:
        hit = own if name == "all-linear" else (name,) if name in own else aliases.get(name, ())
        if not hit:
            known = (f"its projections are {', '.join(own)} (or Hugging Face's "
                     f"{', '.join(a for a in aliases if '.' not in a)}), or all-linear")
            if name in _adapter_targets(lora):  # the name came from the adapter's folder, not the user
                raise ConfigError(f"lora.adapter: {name!r} in the target_modules of {lora.adapter}'s "
                                  f"adapter_config.json is no projection of the {family} model ({known}): the "
                                  f"adapter was trained on another model; give its own base as model.hf_checkpoint")
            raise ConfigError(f"lora.target_modules: {name!r} is no projection of the {family} model; {known}")
        picked.update(hit)
    return frozenset(picked)


def _adapter_targets(lora: Any) -> tuple[str, ...]:
    """The target_modules of `lora.adapter`'s adapter_config.json (none without an adapter)."""
    if getattr(lora, "adapter", None) is None:
        return ()
    from zerojax.config.hf import adapter_keys
    return tuple(adapter_keys(lora.adapter)[0].get("target_modules", ()))


def scale(cfg: Any) -> float:
    """alpha / r: what the adapter's product is multiplied by."""
    return float(cfg.lora.lora_alpha) / cfg.lora.r


class LoRALinear(nnx.Linear):
    """`nnx.Linear` plus a low-rank adapter: x W (+ b) + scale * (dropout(x) A) B. A is drawn as PEFT
    draws it (Kaiming-uniform, bound 1/sqrt(in)), B is zero. The adapters are `nnx.LoRAParam`s.

    `dropout` > 0 adds an `nnx.Dropout` with its own `dropout` stream, as PEFT's `lora_dropout` module:
    active in training, off in eval mode (`model.eval()`: evaluation, `apply`, the decoder). Its key is
    a placeholder: `zerojax.from_nnx` reseeds every stream from the step's key on each call, so each
    adapter, layer, step, data shard and micro-batch draws its own mask. At 0 no module is added, so the
    model's state is what it was without dropout."""

    def __init__(self, in_features: int, out_features: int, *, rank: int, lora_scale: float,
                 rngs: nnx.Rngs, dropout: float = 0.0, **linear: Any):
        super().__init__(in_features, out_features, rngs=rngs, **linear)
        bound = 1.0 / in_features ** 0.5
        self.lora_a = nnx.LoRAParam(jax.random.uniform(rngs.params(), (in_features, rank), jnp.float32,
                                                       -bound, bound))
        self.lora_b = nnx.LoRAParam(jnp.zeros((rank, out_features), jnp.float32))
        self.lora_scale = lora_scale
        if dropout:
            self.lora_dropout = nnx.Dropout(dropout, rngs=nnx.Rngs(dropout=0))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
        h = self.lora_dropout(x) if hasattr(self, "lora_dropout") else x  # the base path sees x itself
        return y + ((h @ a) @ b * jnp.asarray(self.lora_scale, x.dtype)).astype(y.dtype)


def linear(cfg: Any, name: str, in_features: int, out_features: int, *, rngs: nnx.Rngs,
           **kwargs: Any) -> nnx.Linear:
    """The projection `name` of `cfg`'s model: an `nnx.Linear`, or a `LoRALinear` where `lora` targets it."""
    if name in targets(cfg):
        return LoRALinear(in_features, out_features, rank=cfg.lora.r, lora_scale=scale(cfg), rngs=rngs,
                          dropout=cfg.lora.lora_dropout, **kwargs)
    return nnx.Linear(in_features, out_features, rngs=rngs, **kwargs)


def is_adapter(path: tuple[str, ...] | list[str]) -> bool:
    """A leaf's path names an adapter matrix (its last part `lora_a` or `lora_b`)."""
    return bool(path) and str(path[-1]) in ADAPTER_LEAVES


def initial(path: tuple[str, ...], shape: tuple[int, ...], dtype: Any, seed: int = 0) -> np.ndarray:
    """A fresh adapter leaf on the host (for a base read from a checkpoint, whose adapters are new): B zero,
    A uniform in +-1/sqrt(in) from a stream fixed by the seed and the leaf's path, whatever the mesh."""
    if path[-1] == "lora_b":
        return np.zeros(shape, dtype)
    bound = 1.0 / shape[-2] ** 0.5
    rng = np.random.default_rng([seed, zlib.crc32(".".join(path).encode())])
    return rng.uniform(-bound, bound, shape).astype(dtype)


def merged(cfg: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters with every adapter folded into its kernel (W + scale * A B) and removed: the model
    without adapters (`cfg.lora` None) computes what the adapted one did. For an export, on request."""
    s = scale(cfg)

    def fold(node: Any) -> Any:
        if not isinstance(node, Mapping):
            return node
        out = {k: fold(v) for k, v in node.items() if k not in ADAPTER_LEAVES}
        if "lora_a" in node:
            a, b, w = (np.asarray(node[k], np.float32) for k in ("lora_a", "lora_b", "kernel"))
            out["kernel"] = (w + s * (a @ b)).astype(np.asarray(node["kernel"]).dtype)
        return out

    return fold(params)


def without(cfg: Any) -> Any:
    """`cfg` with no adapters: the base model's config (a merged export, the frozen reference policy)."""
    import dataclasses
    return dataclasses.replace(cfg, lora=None)


def adapter_only(params: Mapping[str, Any]) -> dict[str, Any]:
    """Only the adapter leaves of a parameter tree (nested dicts), the rest dropped."""
    def keep(node: Any) -> Any:
        out = {}
        for k, v in node.items():
            if isinstance(v, Mapping):
                sub = keep(v)
                if sub:
                    out[k] = sub
            elif k in ADAPTER_LEAVES:
                out[k] = v
        return out
    return keep(params)


def disabled(params: Any) -> Any:
    """The same tree with every B zero: the base model's outputs, computed by the adapted model without a
    second copy of the base (the frozen reference policy of an RL run)."""
    def zero(path: Any, x: Any) -> Any:
        names = [str(getattr(k, "key", k)) for k in path]
        return jnp.zeros_like(x) if names and names[-1] == "lora_b" else x
    return jax.tree_util.tree_map_with_path(zero, params)

