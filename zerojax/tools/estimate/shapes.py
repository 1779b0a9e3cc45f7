"""Models as abstract parameter trees (shapes only): what every estimate counts.

The embedded models come from `jax.eval_shape` of their initialisers, a Hugging Face `config.json`
from its sizes, and a model known only by DeepSpeed's two numbers from synthetic leaves. Nothing is
allocated; `ModelShape.arch` carries the sizes the tensor, expert and sequence rows need.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from zerojax.config import Config
from zerojax.errors import ConfigError

@dataclasses.dataclass(frozen=True)
class Arch:
    """The sizes the tensor, expert and sequence rows depend on, beyond parameter shapes."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated: bool               # Llama's gate/up MLP (three intermediate tensors live) vs GPT's fc


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A model as abstract fp32 parameters (ShapeDtypeStructs), enough for plan-exact counting.

    `layer_axes` is the plan's argument (leading axes that stack layers; None: not known);
    `exact_shapes` is False
    for a model known only by its parameter counts (synthetic leaves of the right sizes);
    `gpt` is the embedded GPT's config when the step itself can be compiled;
    `arch` the sizes tensor-parallel rows need (None: not known, no such rows)."""
    name: str
    abstract_params: Any
    layer_axes: Any = None
    exact_shapes: bool = True
    gpt: Any = None
    arch: Arch | None = None

    @property
    def total_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_params))

    @property
    def largest_leaf_params(self) -> int:
        """Elements of the largest parameter (one layer's slice of a stacked one): what the stage-3
        persistence threshold is compared with."""
        axes = _per_leaf(0 if self.layer_axes is None else self.layer_axes, self.abstract_params)
        return max(math.prod(x.shape[k:]) for x, k in zip(jax.tree.leaves(self.abstract_params),
                                                         jax.tree.leaves(axes)))

    @property
    def largest_layer_params(self) -> int:
        """The most parameters one module holds itself (DeepSpeed's `model_to_params`: a module's
        own parameters, without its children's): leaves are grouped by their parent, and a
        stacked leaf counts one layer's slice."""
        groups: dict[tuple, int] = {}
        axes = _per_leaf(0 if self.layer_axes is None else self.layer_axes, self.abstract_params)
        for (path, x), k in zip(jax.tree_util.tree_leaves_with_path(self.abstract_params), jax.tree.leaves(axes)):
            groups[tuple(path[:-1])] = groups.get(tuple(path[:-1]), 0) + math.prod(x.shape[k:])
        return max(groups.values())


def _per_leaf(layer_axes: Any, tree: Any) -> Any:
    return jax.tree.map(lambda k, sub: jax.tree.map(lambda _: int(k), sub), layer_axes, tree)


def fp32_shape(*shape: int) -> jax.ShapeDtypeStruct:
    """An abstract float32 leaf of `shape` (the estimates' parameter trees are made of them)."""
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), np.float32)


def embedded_model(config: Config) -> ModelShape:
    """The embedded model of `config.model` (GPT or Llama), shapes from `jax.eval_shape` of its
    initializer (nothing allocated); a model from `model.hf_config` is named by its family and file."""
    m = config.model
    source = m.hf_config or m.hf_checkpoint
    if source and m.name == "llama":
        return model_shape(m, f"Hugging Face {m.hf_family or 'llama'} ({source}, {m.n_layers} layers, hidden {m.d_model})")
    return model_shape(m)


def model_shape(m: Any, what: str | None = None) -> ModelShape:
    """`embedded_model` of a ModelConfig; `what` names it in the report (default: the embedded model)."""
    llama = m.name == "llama"
    arch = Arch(m.n_layers, m.d_model, m.n_heads, (m.n_kv_heads or m.n_heads) if llama else m.n_heads,
                (m.head_dim or m.d_model // m.n_heads) if llama else m.d_model // m.n_heads,  # Qwen3: head_dim
                m.d_ff or 4 * m.d_model, m.vocab_size, gated=llama)
    if llama:
        from zerojax.models import abstract_params
        return ModelShape(what or f"embedded Llama (d_model {m.d_model}, {m.n_layers} layers)", abstract_params(m),
                          arch=arch)
    from zerojax.models import gpt
    return ModelShape(f"embedded GPT (d_model {m.d_model}, {m.n_layers} layers)", gpt.abstract_params(m),
                      gpt=m, arch=arch)


def _get(cfg: Mapping[str, Any], path: str, *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is not None:
        return default
    raise ConfigError(f"--hf-config {path}: needs one of {', '.join(names)}")


# The families whose tensors the generic Llama tree below does not have (biases, q/k norms, Gemma's four
# norms, experts): their config.json is read as `model.hf_config` reads it, into the very model trained.
_READ_EXACTLY = ("qwen2", "qwen3", "gemma2", "phi3", "mixtral", "qwen3_moe")


def _as_trained(path: str, kind: str) -> ModelShape:
    """The llama model `model.hf_config: path` builds (its refusals too), as abstract parameters."""
    from zerojax.config import ModelConfig
    from zerojax.config.hf import model_keys
    keys, _ = model_keys(path, key="--hf-config")
    m = dataclasses.replace(ModelConfig(), **keys)
    m = dataclasses.replace(m, n_kv_heads=m.n_kv_heads or m.n_heads)
    return model_shape(m, f"Hugging Face {kind} ({Path(path).parent.name}, {m.n_layers} layers, hidden {m.d_model})")


def hf_model(source: str | os.PathLike[str] | Mapping[str, Any]) -> ModelShape:
    """A Hugging Face `config.json` as abstract parameters: GPT-2 (`model_type: gpt2`) or the
    Llama family (llama, mistral, qwen2 and other gated-MLP decoders with grouped-query attention).

    Llama: embedding V x H; per layer q H x (heads·d), k and v H x (kv_heads·d), o (heads·d) x H
    (biases with `attention_bias`), gate and up H x I, down I x H (biases with `mlp_bias`), two
    RMSNorm scales H; final norm H; lm_head H x V unless `tie_word_embeddings`.
    GPT-2: wte V x H, wpe P x H; per layer two LayerNorms (2H each), c_attn H x 3H + 3H, c_proj
    H x H + H, c_fc H x I + I, c_proj I x H + H (I = n_inner or 4H); ln_f 2H; lm_head tied.
    """
    if isinstance(source, Mapping):
        cfg, path = dict(source), "<dict>"
    else:
        path = str(source)
        try:
            cfg = json.loads(Path(source).read_text())
        except FileNotFoundError:
            raise ConfigError(f"--hf-config {path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--hf-config {path}: not JSON ({e})") from None
    kind = str(cfg.get("model_type", "llama"))
    if kind in _READ_EXACTLY and path != "<dict>":
        return _as_trained(path, kind)
    vocab = _get(cfg, path, "vocab_size")
    if kind == "gpt2":
        h = _get(cfg, path, "n_embd", "hidden_size")
        layers = _get(cfg, path, "n_layer", "num_hidden_layers")
        inner = _get(cfg, path, "n_inner", default=4 * h)
        positions = _get(cfg, path, "n_positions", "max_position_embeddings")
        block = {"ln_1": {"scale": fp32_shape(layers, h), "bias": fp32_shape(layers, h)},
                 "c_attn": {"kernel": fp32_shape(layers, h, 3 * h), "bias": fp32_shape(layers, 3 * h)},
                 "attn_proj": {"kernel": fp32_shape(layers, h, h), "bias": fp32_shape(layers, h)},
                 "ln_2": {"scale": fp32_shape(layers, h), "bias": fp32_shape(layers, h)},
                 "c_fc": {"kernel": fp32_shape(layers, h, inner), "bias": fp32_shape(layers, inner)},
                 "mlp_proj": {"kernel": fp32_shape(layers, inner, h), "bias": fp32_shape(layers, h)}}
        params = {"wte": {"embedding": fp32_shape(vocab, h)}, "wpe": {"embedding": fp32_shape(positions, h)},
                  "layers": block, "ln_f": {"scale": fp32_shape(h), "bias": fp32_shape(h)}}
        if not cfg.get("tie_word_embeddings", True):
            params["lm_head"] = {"kernel": fp32_shape(h, vocab)}
        heads = _get(cfg, path, "n_head", "num_attention_heads")
        arch = Arch(layers, h, heads, heads, h // heads, inner, vocab, gated=False)
    else:
        h = _get(cfg, path, "hidden_size")
        layers = _get(cfg, path, "num_hidden_layers")
        inter = _get(cfg, path, "intermediate_size")
        heads = _get(cfg, path, "num_attention_heads")
        kv = _get(cfg, path, "num_key_value_heads", default=heads)
        d = _get(cfg, path, "head_dim", default=h // heads)
        attn_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))

        def linear(n_in: int, n_out: int, bias: bool) -> dict[str, Any]:
            out = {"kernel": fp32_shape(layers, n_in, n_out)}
            if bias:
                out["bias"] = fp32_shape(layers, n_out)
            return out
        block = {"q": linear(h, heads * d, attn_bias), "k": linear(h, kv * d, attn_bias),
                 "v": linear(h, kv * d, attn_bias), "o": linear(heads * d, h, attn_bias),
                 "gate": linear(h, inter, mlp_bias), "up": linear(h, inter, mlp_bias),
                 "down": linear(inter, h, mlp_bias),
                 "input_norm": {"scale": fp32_shape(layers, h)}, "post_attention_norm": {"scale": fp32_shape(layers, h)}}
        params = {"embed": {"embedding": fp32_shape(vocab, h)}, "layers": block, "norm": {"scale": fp32_shape(h)}}
        if not cfg.get("tie_word_embeddings", False):
            params["lm_head"] = {"kernel": fp32_shape(h, vocab)}
        arch = Arch(layers, h, heads, kv, d, inter, vocab, gated=True)
    axes = {k: (1 if k == "layers" else 0) for k in params}
    name = Path(path).parent.name if path != "<dict>" else kind
    return ModelShape(f"Hugging Face {kind} ({name}, {layers} layers, hidden {h})", params, axes, arch=arch)


# hf_model's GPT-2 leaves under the embedded GPT's projection names (what lora.target_modules resolves to)
_GPT2_PROJECTIONS = {"c_attn": "qkv", "attn_proj": "proj", "c_fc": "fc", "mlp_proj": "out"}


def with_adapters(model: ModelShape, config: Config) -> ModelShape:
    """`model` (from a config.json) with the `lora` section's adapters beside its targeted projections
    (A [in, r], B [r, out], stacked like the kernel): what the run would train; unchanged without LoRA."""
    if not config.lora.enabled:
        return model
    from zerojax.models import lora
    gpt2 = model.arch is not None and not model.arch.gated
    probe = dataclasses.replace(config.model, name="gpt" if gpt2 else "llama")
    picked, r = lora.targets(probe), config.lora.r

    def add(node: Any) -> Any:
        if not isinstance(node, Mapping):
            return node
        out = {k: add(v) for k, v in node.items()}
        for name, sub in node.items():
            own = _GPT2_PROJECTIONS.get(name, name) if gpt2 else name
            if isinstance(sub, Mapping) and "kernel" in sub and own in picked:
                *lead, n_in, n_out = sub["kernel"].shape
                out[name] = {**out[name], "lora_a": fp32_shape(*lead, n_in, r), "lora_b": fp32_shape(*lead, r, n_out)}
        return out

    return dataclasses.replace(model, abstract_params=add(model.abstract_params),
                               name=f"{model.name} with rank-{r} LoRA adapters")


def counts_model(total_params: int, largest_layer_params: int) -> ModelShape:
    """A model known only by DeepSpeed's two numbers: synthetic leaves (`k` stacked layers of
    `largest_layer_params` as one [k, largest] leaf, and the remainder as one flat leaf), so the
    plan shards them as it would a real stack; replication from odd shapes is not modelled."""
    if largest_layer_params <= 0 or total_params < largest_layer_params:
        raise ConfigError(f"--params {total_params} --largest-layer {largest_layer_params}: need "
                          f"0 < largest layer <= total parameters")
    k, rest = divmod(total_params, largest_layer_params)
    params = {"layers": {"kernel": fp32_shape(k, largest_layer_params)}}
    if rest:
        params["rest"] = {"kernel": fp32_shape(rest)}
    return ModelShape("a model given by its parameter counts", params,
                      {"layers": 1, "rest": 0} if rest else {"layers": 1}, exact_shapes=False)

