"""Hugging Face transformers checkpoints in and out: Llama-family, Qwen2, Qwen3, Mistral, Mixtral and GPT-2.

Llama, Qwen2, Qwen3 and Mistral are the one Llama model with the family's options (zerojax.config.hf sets them
from config.json); each family's tensor names are a table here (`FAMILY_TENSORS`), and an export
without a source checkpoint writes the family its options name (`family`).

In: `model.hf_checkpoint: DIR` (or `zerojax import-hf DIR` to see the model keys it implies) reads a
local transformers folder - config.json and model.safetensors, or shards listed by
model.safetensors.index.json. config.json fills the model keys the config does not give; each
parameter is then created with `jax.make_array_from_callback` under the plan's sharding, and the
callback reads, with safetensors' lazy slices, only the block of the tensor that device holds
(transposed from torch's [out, in] where needed, one layer at a time for the stacked layers). No
device, and no host buffer beyond one layer's block, ever holds a whole parameter that the stage
shards - DeepSpeed's `zero.Init` loading a pretrained model, without the whole-model detour.

Out: `zerojax export --format hf` writes a checkpoint's parameters as a folder that
`transformers.AutoModelForCausalLM.from_pretrained` loads: config.json and model.safetensors, or
shards of at most `--max-shard-size` with model.safetensors.index.json, each written one tensor at a
time (one layer of a stacked leaf read from the zerojax checkpoint when it is written), so host
memory stays near one tensor whatever the model size. A run that was imported (its checkpoints
record the folder and every tensor's dtype and full shape, `source_record`) goes back as that
checkpoint: the same tensor names and shapes and the same config.json, with what the model trains
taken from the zerojax checkpoint and everything else copied unchanged from the source.

GPT-2 goes into the embedded GPT, which has GPT-2's shape (learned positions, pre-norm LayerNorm,
tanh-approximated GELU, fused qkv, biases) with `model.norm_eps` at GPT-2's 1e-5, and ties its LM
head to the token embedding as config.json's `tie_word_embeddings` says (GPT-2's default), so a tied
checkpoint trains tied and exports tied. A GPT told to keep its own head (`model.tie_embeddings:
false`) gets the tied embedding copied into it; its export keeps the checkpoint tied while that head
still equals the embedding, and adds `lm_head.weight` with `tie_word_embeddings: false` once training
has made them differ. Its position table is `model.seq_len` rows (an import keeps the first seq_len
of n_positions; an export writes those back and copies the rows past them from the source).
GPT-2's Conv1D weights are already stored [in, out] and are not transposed.

Mixtral goes into the mixture-of-experts Llama (every layer's MLP a MoE layer, its top-k routing with
no token dropped: zerojax.config.hf says which gate computes transformers' routing for each k). Its experts are separate
tensors per layer and expert (`block_sparse_moe.experts.{j}.w1`), ours one leaf stacked [layers,
experts, ...]: a device's block of that leaf is read as the block of each (layer, expert) tensor in it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import numpy as np

from zerojax.config.hf import ADAPTER_CONFIG, ADAPTER_WEIGHTS, HFError, adapter_keys, model_keys
from zerojax.core.measure import release_freed_heap
from zerojax.errors import ConfigError
from zerojax.models import abstract_params, lora

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ---------------------------------------------------------------------------------------------
# Names: each parameter of the zerojax model and the transformers tensor(s) it comes from.

class Source(NamedTuple):
    """One zerojax leaf's transformers tensor: `name` (with `{i}` for a stacked layer's index),
    stored transposed ([out, in], torch's Linear) or not. `prefix_rows`: the tensor may have more
    rows than the leaf, which takes the first ones (GPT-2's position table, n_positions >= seq_len).
    `per_expert`: the leaf's next dimension (after the layer's) is the expert, `{j}` in the name:
    one transformers tensor per layer and expert. `part`: (start, stop, rows) - the leaf is rows
    start:stop of a fused tensor of `rows` rows (Phi-3's qkv_proj and gate_up_proj, torch's [out, in]):
    split on import, the parts written back side by side on export."""
    name: str
    transpose: bool = False
    prefix_rows: bool = False
    per_expert: bool = False
    part: tuple[int, int, int] | None = None


def _layer_linears(pairs: tuple[tuple[str, str], ...]) -> dict[tuple[str, ...], Source]:
    return {("layers", ours, "kernel"): Source(f"model.layers.{{i}}.{theirs}.weight", transpose=True)
            for ours, theirs in pairs}


# Each dense llama-family model type's transformers tensors: zerojax leaf -> tensor name. The head
# (`lm_head.weight`) is added where the model is untied.
LLAMA_TENSORS: dict[tuple[str, ...], Source] = {
    ("embed", "embedding"): Source("model.embed_tokens.weight"),
    ("norm", "scale"): Source("model.norm.weight"),
    ("layers", "attn_norm", "scale"): Source("model.layers.{i}.input_layernorm.weight"),
    ("layers", "mlp_norm", "scale"): Source("model.layers.{i}.post_attention_layernorm.weight"),
    **_layer_linears((("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                      ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                      ("down", "mlp.down_proj"))),
}
QWEN2_TENSORS: dict[tuple[str, ...], Source] = {  # Llama's, and the query, key and value biases
    **LLAMA_TENSORS,
    ("layers", "q", "bias"): Source("model.layers.{i}.self_attn.q_proj.bias"),
    ("layers", "k", "bias"): Source("model.layers.{i}.self_attn.k_proj.bias"),
    ("layers", "v", "bias"): Source("model.layers.{i}.self_attn.v_proj.bias"),
}
QWEN3_TENSORS: dict[tuple[str, ...], Source] = {  # Llama's, and each head's query and key RMSNorm scales
    **LLAMA_TENSORS,
    ("layers", "q_norm", "scale"): Source("model.layers.{i}.self_attn.q_norm.weight"),
    ("layers", "k_norm", "scale"): Source("model.layers.{i}.self_attn.k_norm.weight"),
}
GEMMA2_TENSORS: dict[tuple[str, ...], Source] = {  # Llama's projections; four norms a layer, named Gemma's way
    **{path: source for path, source in LLAMA_TENSORS.items() if path[-2] != "mlp_norm"},
    ("layers", "post_attn_norm", "scale"): Source("model.layers.{i}.post_attention_layernorm.weight"),
    ("layers", "mlp_norm", "scale"): Source("model.layers.{i}.pre_feedforward_layernorm.weight"),
    ("layers", "post_mlp_norm", "scale"): Source("model.layers.{i}.post_feedforward_layernorm.weight"),
}
# Phi-3's fused tensors: each zerojax leaf and its share of the fused rows, by the parts' widths
# (`_fused`): [q | k | v] rows of qkv_proj, [gate | up] rows of gate_up_proj.
PHI3_FUSED: dict[str, tuple[tuple[str, ...], ...]] = {
    "model.layers.{i}.self_attn.qkv_proj.weight": (("layers", "q", "kernel"), ("layers", "k", "kernel"),
                                                   ("layers", "v", "kernel")),
    "model.layers.{i}.mlp.gate_up_proj.weight": (("layers", "gate", "kernel"), ("layers", "up", "kernel")),
}
FAMILY_TENSORS = {"llama": LLAMA_TENSORS, "mistral": LLAMA_TENSORS, "qwen2": QWEN2_TENSORS, "qwen3": QWEN3_TENSORS,
                  "gemma2": GEMMA2_TENSORS, "phi3": LLAMA_TENSORS}
FUSED = {"phi3": PHI3_FUSED}

# The options that name a family when model.hf_family is not set, and the one each names.
_NAMED_BY = {"qk_norm": "qwen3", "qkv_bias": "qwen2", "post_norms": "gemma2", "sliding_window": "mistral"}


def family(cfg: Any) -> str:
    """The transformers model type of a dense llama-model config: `model.hf_family` (set by an import),
    else the one its options name (Qwen3's per-head q/k norms, Qwen2's q/k/v biases, Gemma 2's post
    norms, Mistral's sliding window), else Llama. Options no one transformers family has together are
    refused."""
    if cfg.hf_family in FAMILY_TENSORS:
        return cfg.hf_family
    chosen = [key for key in _NAMED_BY if getattr(cfg, key)]
    if chosen == ["post_norms", "sliding_window"]:
        chosen = ["post_norms"]  # Gemma 2's local layers
    if len(chosen) > 1:
        raise HFError(f"model.{chosen[0]} and model.{chosen[1]} together match no Hugging Face family (Qwen3 has "
                      f"the q/k norms, Qwen2 the q/k/v biases, Gemma 2 the post norms, Mistral the sliding window); "
                      f"export this model with --format safetensors instead")
    kind = _NAMED_BY[chosen[0]] if chosen else "llama"
    _check_family(cfg, kind)
    return kind


# What each family computes, beyond the options that name it: a model whose switches differ is no
# checkpoint of that family, and an export under its name would load as another model.
_GEMMA2_SWITCHES = {"norm_offset": 1.0, "embed_scale": True, "post_norms": True, "mlp_activation": "gelu_tanh"}
_PLAIN_SWITCHES = {"norm_offset": 0.0, "embed_scale": False, "post_norms": False, "mlp_activation": "silu",
                   "attn_softcap": None, "final_softcap": None, "query_scale": None, "global_every": None}


def _check_family(cfg: Any, kind: str) -> None:
    want = _GEMMA2_SWITCHES if kind == "gemma2" else _PLAIN_SWITCHES
    for key, value in want.items():
        if getattr(cfg, key) != value:
            raise HFError(f"model.{key}: {getattr(cfg, key)}, but a Hugging Face {kind} checkpoint has "
                          f"{json.dumps(value)}; export this model with --format safetensors instead")
    if kind == "gemma2" and cfg.sliding_window is not None and cfg.global_every != 2:
        raise HFError(f"model.global_every: {cfg.global_every}, but Gemma 2 alternates local and global layers "
                      f"(2); export this model with --format safetensors instead")


def _fused(cfg: Any, kind: str) -> dict[tuple[str, ...], Source]:
    """The leaves of `kind`'s fused tensors, each with its rows (the parts' widths from the config)."""
    widths = {"q": cfg.n_heads * _head_dim(cfg), "k": (cfg.n_kv_heads or cfg.n_heads) * _head_dim(cfg),
              "v": (cfg.n_kv_heads or cfg.n_heads) * _head_dim(cfg), "gate": cfg.d_ff, "up": cfg.d_ff}
    out = {}
    for name, parts in FUSED.get(kind, {}).items():
        total, start = sum(widths[p[1]] for p in parts), 0
        for path in parts:
            out[path] = Source(name, transpose=True, part=(start, start + widths[path[1]], total))
            start += widths[path[1]]
    return out


def _head_dim(cfg: Any) -> int:
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def _llama_names(cfg: Any) -> dict[tuple[str, ...], Source]:
    kind = family(cfg)
    _check_family(cfg, kind)
    names = {**FAMILY_TENSORS[kind], **_fused(cfg, kind)}
    if not cfg.tie_embeddings:
        names[("head", "kernel")] = Source("lm_head.weight", transpose=True)
    return names


def moe_family(cfg: Any) -> str:
    """The transformers MoE model type of a MoE llama: Qwen3-MoE with Qwen3's q/k norms, else Mixtral."""
    if cfg.hf_family in ("mixtral", "qwen3_moe"):
        return cfg.hf_family
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


def _check_mixtral(cfg: Any) -> None:
    """The MoE Llama is a transformers Mixtral (or Qwen3-MoE) only in its shape and with a gate that
    renormalizes its top-k weights (every gate but DeepSpeed's top-1); else one error naming the key."""
    kind = moe_family(cfg)
    name = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}[kind]
    for key, want, why in (("moe_every", 1, f"every {name} layer's MLP is a mixture of experts"),
                           ("use_residual", False, f"{name} has no residual MLP beside its experts (PR-MoE)"),
                           ("qkv_bias", False, f"{name}'s attention has no biases"),
                           ("qk_norm", kind == "qwen3_moe", f"{name}'s attention has {'' if kind == 'qwen3_moe' else 'no '}"
                                                            f"query/key norms"),
                           ("sliding_window", None if kind == "qwen3_moe" else cfg.sliding_window,
                            "Qwen3-MoE's published checkpoints attend to the whole context")):
        if getattr(cfg, key) != want:
            raise HFError(f"model.{key}: {getattr(cfg, key)}, but a Hugging Face MoE checkpoint ({name}) needs "
                          f"{json.dumps(want)}: {why}; export this model with --format safetensors instead")
    _check_family(cfg, "mixtral")
    if cfg.experts_per_token == 1 and cfg.gating != "topk":
        raise HFError(f"model.gating: {cfg.gating} with model.experts_per_token 1 is DeepSpeed's top-1 gate, which "
                      f"weights a token's expert by its softmax probability where a Hugging Face Mixtral "
                      f"renormalizes it to 1 (model.gating: topk); export this model with --format safetensors "
                      f"instead")


# Each MoE family's router and experts: its layer's MoE prefix, and the names of the SwiGLU gate, up
# and down projections of expert {j}.
MOE_TENSORS = {"mixtral": ("model.layers.{i}.block_sparse_moe.", (("gate", "w1"), ("up", "w3"), ("down", "w2"))),
               "qwen3_moe": ("model.layers.{i}.mlp.", (("gate", "gate_proj"), ("up", "up_proj"),
                                                       ("down", "down_proj")))}


def _mixtral_names(cfg: Any) -> dict[tuple[str, ...], Source]:
    """The MoE Llama as transformers' MixtralForCausalLM (or Qwen3MoeForCausalLM): the Llama's (Qwen3's)
    attention and norms, and in every layer a router (`gate`, [experts, hidden]) and experts whose
    projections are the SwiGLU gate, up and down (Mixtral's w1, w3, w2)."""
    _check_mixtral(cfg)
    names = {path: source for path, source in _llama_names(cfg).items()
             if not (path[0] == "layers" and path[1] in ("gate", "up", "down"))}
    moe, projections = MOE_TENSORS[moe_family(cfg)]
    names[("layers", "moe", "router", "kernel")] = Source(moe + "gate.weight", transpose=True)
    for ours, theirs in projections:
        names[("layers", "moe", "experts", ours)] = Source(moe + "experts.{j}." + theirs + ".weight",
                                                           transpose=True, per_expert=True)
    return names


def _gpt2_names(prefix: str, head: str | None, tied: bool = False) -> dict[tuple[str, ...], Source]:
    """`prefix`: "transformer." (GPT2LMHeadModel) or "" (GPT2Model, as the original uploads are).
    `tied`: the model has no head of its own (`model.tie_embeddings`); otherwise its head comes from
    `head`, or from the token embedding where the checkpoint ties them."""
    block = prefix + "h.{i}."
    names = {("embed", "embedding"): Source(prefix + "wte.weight"),
             ("pos",): Source(prefix + "wpe.weight", prefix_rows=True),
             ("ln_f", "scale"): Source(prefix + "ln_f.weight"), ("ln_f", "bias"): Source(prefix + "ln_f.bias")}
    if not tied:
        names[("head", "kernel")] = Source(head or prefix + "wte.weight", transpose=True)
    for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
        names[("blocks", ours, "scale")] = Source(block + theirs + ".weight")
        names[("blocks", ours, "bias")] = Source(block + theirs + ".bias")
    for ours, theirs in (("qkv", "attn.c_attn"), ("proj", "attn.c_proj"), ("fc", "mlp.c_fc"),
                         ("out", "mlp.c_proj")):
        names[("blocks", ours, "kernel")] = Source(block + theirs + ".weight")  # Conv1D: [in, out] already
        names[("blocks", ours, "bias")] = Source(block + theirs + ".bias")
    return names


def _stacked(path: tuple[str, ...]) -> bool:
    return path[0] in ("layers", "blocks")


def _lead(path: tuple[str, ...], source: Source) -> int:
    """How many leading dimensions of leaf `path` index whole transformers tensors (layer, expert)."""
    return int(_stacked(path)) + int(source.per_expert)


def _tensor_name(source: Source, ix: tuple[int, ...]) -> str:
    return source.name.format(**dict(zip("ij", ix)))


def _tensors_of(path: tuple[str, ...], source: Source, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], str]]:
    """(leading index, transformers name) of each tensor that leaf `path` of `shape` holds."""
    return [(ix, _tensor_name(source, ix)) for ix in itertools.product(*map(range, shape[:_lead(path, source)]))]


def _paths(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, Mapping):
            yield from _paths(value, prefix + (key,))
        else:
            yield prefix + (key,), value


# ---------------------------------------------------------------------------------------------
# Reading.

def _shard_name(index: Path, file: Any) -> str:
    """A shard named by the index is a file of its folder: a path (`../x`, `/etc/x`, `sub/x`) would read
    a file the user never gave, so it is refused."""
    if (not isinstance(file, str) or not file or file in (".", "..") or "/" in file or "\\" in file
            or os.sep in file or "\0" in file or os.path.isabs(file)):
        raise HFError(f"model.hf_checkpoint: {index} names shard {file!r}, which is not a file of "
                      f"{index.parent}; an index names the shards beside it (model-00001-of-00002.safetensors) - "
                      "fix the weight_map or re-save with save_pretrained")
    return file


class Checkpoint:
    """The tensors of a transformers folder, read lazily by slices (safetensors' `get_slice`)."""

    def __init__(self, directory: str | os.PathLike[str], single: str = SINGLE_FILE,
                 key: str = "model.hf_checkpoint"):
        """`key`: the config key that named the folder, which every error names."""
        from safetensors import safe_open

        self.root, self.key = Path(directory).expanduser(), key
        index = self.root / INDEX_FILE
        if single == SINGLE_FILE and index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError(f"weight_map is a {type(weight_map).__name__}, not a mapping")
            except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
                raise HFError(f"{key}: {index} is not a safetensors index ({e!r})") from None
            self.where = {name: self.root / _shard_name(index, file) for name, file in weight_map.items()}
        elif (self.root / single).is_file():
            self.where = {}
        else:
            found = sorted(p.name for p in self.root.iterdir() if p.suffix in (".bin", ".safetensors", ".pt"))
            raise HFError(f"{key}: {self.root} has neither {SINGLE_FILE} nor {INDEX_FILE}"
                          + (f" (found {', '.join(found)})" if found else "")
                          + "; zerojax reads safetensors: save with save_pretrained(..., safe_serialization=True)")
        self._stack = contextlib.ExitStack()
        self._files: dict[Path, Any] = {}
        files = sorted(set(self.where.values())) or [self.root / single]
        try:
            for path in files:
                if not path.is_file():
                    raise HFError(f"{key}: {path} is listed in {INDEX_FILE} but missing")
                try:
                    handle = self._stack.enter_context(safe_open(str(path), framework="numpy"))
                except Exception as e:  # safetensors' own error type: a truncated or foreign file
                    raise HFError(f"{key}: {path} is not a readable safetensors file ({e}); "
                                  f"re-save it with save_pretrained(..., safe_serialization=True)") from None
                self._files[path] = handle
                if not self.where:
                    self.where = {name: path for name in handle.keys()}
        except BaseException:
            self._stack.close()  # the files opened so far
            raise

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _slice(self, name: str) -> Any:
        if name not in self.where:
            raise HFError(f"{self.key}: tensor {name} is not in {self.root} (the model its config.json "
                          f"describes needs it); is the checkpoint complete?")
        return self._files[self.where[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def file(self, name: str) -> str:
        return self.where[name].name

    def dtype(self, name: str) -> str:
        """safetensors' dtype code ("F32", "BF16", ...)."""
        return str(self._slice(name).get_dtype())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Only `index` of tensor `name` is read from disk."""
        import ml_dtypes  # noqa: F401  (numpy knows bfloat16, the dtype of most published checkpoints, by it)
        if not index:
            return np.asarray(self._files[self.where[name]].get_tensor(name))
        return np.asarray(self._slice(name)[index])


def _names_for(cfg: Any, ckpt: Checkpoint) -> dict[tuple[str, ...], Source]:
    if cfg.name == "llama":
        return _mixtral_names(cfg) if cfg.n_experts else _llama_names(cfg)
    prefix = "transformer." if "transformer.wte.weight" in ckpt else ""
    return _gpt2_names(prefix, "lm_head.weight" if "lm_head.weight" in ckpt else None, cfg.tie_embeddings)


def _refuse_fused(table: Mapping[tuple[str, ...], Source], what: str) -> None:
    fused = next((source.name for source in table.values() if source.part is not None), None)
    if fused is not None:
        raise HFError(f"{what}: this model's Hugging Face names fuse several parameters into one tensor ({fused}, "
                      f"Phi-3's), which a DeepSpeed checkpoint of it holds whole; use model.hf_checkpoint and "
                      f"export --format hf for Phi-3")


def deepspeed_sources(cfg: Any, names: Any) -> dict[str, Source]:
    """The name table for a DeepSpeed checkpoint of this model written by the Hugging Face Trainer:
    zerojax leaf (dotted) -> the DeepSpeed parameter name it comes from (`names`: the checkpoint's
    parameter names, e.g. `model.layers.0.self_attn.q_proj.weight`, `transformer.h.0.attn.c_attn.weight`).
    The table is `model.hf_checkpoint`'s: a tied GPT-2 (no `lm_head.weight`: DeepSpeed saves a tied
    parameter once) trains tied; a GPT with its own head gets it from `wte`, as an import does."""
    present = set(names)
    if cfg.name == "llama":
        table = _llama_names(cfg)
        _refuse_fused(table, "import-deepspeed")
    else:
        prefix = "transformer." if "transformer.wte.weight" in present else ""
        table = _gpt2_names(prefix, "lm_head.weight" if "lm_head.weight" in present else None, cfg.tie_embeddings)
    return {".".join(path): source for path, source in table.items()}


def named_tensors(cfg: Any, path: tuple[str, ...], array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(transformers / HF Trainer name, tensor) of one zerojax leaf of the embedded GPT or Llama: one
    per layer (and expert) for a stacked leaf, transposed to torch's [out, in] where the table says so."""
    source = _export_names(cfg)[path]
    _refuse_fused({path: source}, "export --format deepspeed")
    for ix, name in _tensors_of(path, source, np.shape(array)):
        part = array[ix] if ix else array
        yield name, (part.T if source.transpose else part)


def _expected(path: tuple[str, ...], shape: tuple[int, ...], source: Source) -> tuple[int, ...]:
    """The transformers shape of one layer (and expert) of a zerojax leaf."""
    one = shape[_lead(path, source):]
    return tuple(reversed(one)) if source.transpose else tuple(one)


def _check_shapes(cfg: Any, ckpt: Checkpoint, abstract: Mapping[str, Any],
                  names: Mapping[tuple[str, ...], Source]) -> None:
    """Every tensor the model needs is there with the shape the config implies (before any read)."""
    for path, leaf in _paths(abstract):
        if path not in names and lora.is_adapter(path):
            continue  # a new adapter, not read from the checkpoint
        source = names[path]
        want = _expected(path, tuple(leaf.shape), source)
        if source.part is not None:
            start, stop, rows = source.part
            if want[0] != stop - start:
                raise HFError(f"model.hf_checkpoint: the model's {'.'.join(path)} has {want[0]} rows of the fused "
                              f"{source.name}, the config's sizes give it {stop - start}")
            want = (rows,) + want[1:]
        for _, name in _tensors_of(path, source, tuple(leaf.shape)):
            got = ckpt.shape(name)
            ok = got == want or (source.prefix_rows and len(got) == 2 and got[1] == want[1] and got[0] >= want[0])
            if not ok:
                raise HFError(f"model.hf_checkpoint: tensor {name} in {ckpt.file(name)} has shape {list(got)}, but "
                              f"the model the config describes (model.{_key_of(path)}) needs {list(want)}; the "
                              f"config's model keys and the checkpoint disagree - remove the model size keys from "
                              f"the config to take config.json's, or fix config.json")


def _key_of(path: tuple[str, ...]) -> str:
    if "experts" in path:
        return "n_experts / d_ff"
    if "router" in path:
        return "n_experts"
    if path[-2:-1] in (("k",), ("v",)):
        return "n_kv_heads"
    if path[-2:-1] in (("gate",), ("up",), ("down",), ("fc",), ("out",)):
        return "d_ff"
    if path[0] in ("embed", "head"):
        return "vocab_size / d_model"
    return "d_model / n_heads"


def _block(ckpt: Checkpoint, path: tuple[str, ...], source: Source, index: tuple[slice, ...],
           shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """The block `index` of zerojax leaf `path`, read from the checkpoint slice by slice."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    # bounded by the zerojax shape: a checkpoint tensor may be longer (GPT-2's n_positions > seq_len)
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))

    def one(name: str, idx: tuple[slice, ...]) -> np.ndarray:
        if source.transpose:
            idx = tuple(reversed(idx))
            if source.part is not None:  # this leaf's rows of the fused tensor
                idx = (slice(idx[0].start + source.part[0], idx[0].stop + source.part[0]),) + idx[1:]
            return ckpt.read(name, idx).T
        return ckpt.read(name, idx)

    lead = _lead(path, source)
    if lead:  # one read per (layer, expert) tensor in the block
        ranges = [range(n)[s] for n, s in zip(shape[:lead], index[:lead])]
        parts = [one(_tensor_name(source, ix), index[lead:]) for ix in itertools.product(*ranges)]
        out = np.stack(parts).reshape(tuple(map(len, ranges)) + parts[0].shape)
    else:
        out = one(source.name, index)
    return np.ascontiguousarray(out.astype(dtype))


ADAPTER_PREFIX = "base_model.model."  # PEFT's names: the base model's module path under its wrapper


def adapter_names(cfg: Any, base: Mapping[tuple[str, ...], Source]) -> dict[tuple[str, ...], Source]:
    """PEFT's tensor of each adapter leaf: `base_model.model.<module>.lora_A.weight` [r, in] and
    `lora_B.weight` [out, r] beside the projection's own tensor, stored as torch's Linear stores
    them (transposed from our A [in, r] and B [r, out]) whatever the base's own layout."""
    picked = lora.targets(cfg)
    out = {}
    for path, source in base.items():
        if path[-1] == "kernel" and len(path) >= 2 and path[-2] in picked:
            stem = ADAPTER_PREFIX + source.name.removesuffix(".weight")
            out[path[:-1] + ("lora_a",)] = Source(f"{stem}.lora_A.weight", transpose=True)
            out[path[:-1] + ("lora_b",)] = Source(f"{stem}.lora_B.weight", transpose=True)
    return out


@contextlib.contextmanager
def _sources(directory: str | os.PathLike[str], cfg: Any, seed: int) -> Iterator[Callable[..., np.ndarray]]:
    """`block(path, index, shape, dtype)` of every leaf of `cfg`'s model: the base from the checkpoint
    folder; the adapters (with `cfg.lora`) from `lora.adapter`'s PEFT file, or new (`lora.initial`)."""
    abstract = abstract_params(cfg)
    adapter_dir = getattr(getattr(cfg, "lora", None), "adapter", None)
    with Checkpoint(directory) as ckpt, contextlib.ExitStack() as stack:
        names = _names_for(cfg, ckpt)
        _check_shapes(cfg, ckpt, abstract, names)
        adapters = adapter_names(cfg, names) if getattr(cfg, "lora", None) is not None else {}
        peft = None
        if adapter_dir is not None:
            peft = stack.enter_context(Checkpoint(adapter_dir, single=ADAPTER_WEIGHTS, key="lora.adapter"))
            _check_adapter(cfg, peft, abstract, adapters)

        def block(path: tuple[str, ...], index: tuple[Any, ...], shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            if path in adapters and peft is not None:
                return _block(peft, path, adapters[path], index, shape, dtype)
            if path in adapters:
                return np.ascontiguousarray(lora.initial(path, shape, dtype, seed)[tuple(index)])
            return _block(ckpt, path, names[path], index, shape, dtype)

        yield block


def _check_adapter(cfg: Any, peft: Checkpoint, abstract: Mapping[str, Any],
                   adapters: Mapping[tuple[str, ...], Source]) -> None:
    """The PEFT file holds exactly the adapters the lora section describes, each of the right shape.
    Where the section's value is the folder's own adapter_config.json's, a mismatch is the folder's two
    files disagreeing (a partial or mixed copy), and the error says so rather than naming a key the user
    never set."""
    where = f"lora.adapter: {peft.root / ADAPTER_WEIGHTS}"
    own = adapter_keys(peft.root)[0]
    config_file = peft.root / ADAPTER_CONFIG
    own_targets = own.get("target_modules") == tuple(cfg.lora.target_modules)
    recopy = "copy the adapter folder again from where save_pretrained wrote it"
    for path, leaf in _paths(abstract):
        if path in adapters:
            want = _expected(path, tuple(leaf.shape), adapters[path])
            for _, name in _tensors_of(path, adapters[path], tuple(leaf.shape)):
                if name not in peft and own_targets:
                    raise HFError(f"{where} has no {name}, but {config_file}'s target_modules names that "
                                  f"projection: the folder's two files disagree; {recopy}")
                if name not in peft:
                    raise HFError(f"{where} has no {name}; its adapter_config.json's target_modules and the "
                                  f"lora section disagree (remove lora.target_modules to take the adapter's)")
                if peft.shape(name) != want and own["r"] == cfg.lora.r:
                    raise HFError(f"{where}: {name} has shape {list(peft.shape(name))}, but {config_file} says "
                                  f"r: {own['r']}, which needs {list(want)}: the folder's two files disagree; "
                                  f"set r in {ADAPTER_CONFIG} to the weights' rank, or {recopy}")
                if peft.shape(name) != want:
                    raise HFError(f"{where}: {name} has shape {list(peft.shape(name))}, but lora.r {cfg.lora.r} on "
                                  f"this base needs {list(want)}; remove lora.r to take the adapter's")
    expected = {name for path, leaf in _paths(abstract) if path in adapters
                for _, name in _tensors_of(path, adapters[path], tuple(leaf.shape))}
    extra = sorted(set(peft.where) - expected)
    if extra and own_targets:
        raise HFError(f"{where} holds tensors of projections {config_file}'s target_modules does not name "
                      f"({', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}): the folder's two files "
                      f"disagree; add those projections to its target_modules, or {recopy}")
    if extra:
        raise HFError(f"{where} holds tensors no adapter of this model takes ({', '.join(extra[:4])}"
                      f"{' ...' if len(extra) > 4 else ''}); only LoRA on the projections lora.target_modules "
                      f"names is read")


def load_params(directory: str | os.PathLike[str], cfg: Any, shardings: Any, seed: int = 0) -> dict[str, Any]:
    """The checkpoint's parameters as the zerojax model's params tree, each leaf created under its
    sharding in `shardings` (the plan's `update_shardings`), each device reading only its block. With
    `cfg.lora`, the adapters come from `lora.adapter` or are new (drawn from `seed`)."""
    import jax

    abstract = abstract_params(cfg)
    with _sources(directory, cfg, seed) as block:
        flat_shardings = dict(_paths(shardings))
        out: dict[str, Any] = {}
        for path, leaf in _paths(abstract):
            shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
            array = jax.make_array_from_callback(
                shape, flat_shardings[path],
                lambda idx, path=path, shape=shape, dtype=dtype: block(path, idx, shape, dtype))
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = array
    return out


def read_params(directory: str | os.PathLike[str], cfg: Any, seed: int = 0) -> dict[str, Any]:
    """The checkpoint's parameters as numpy arrays (whole, on the host): for tests and small models."""
    abstract = abstract_params(cfg)
    with _sources(directory, cfg, seed) as block:
        out: dict[str, Any] = {}
        for path, leaf in _paths(abstract):
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = block(path, (), tuple(leaf.shape), np.dtype(leaf.dtype))
    return out


def describe(directory: str | os.PathLike[str]) -> str:
    """What `zerojax import-hf DIR` prints: the model keys, checked against every tensor's shape."""
    from zerojax.config import ModelConfig
    keys, _ = model_keys(directory)
    cfg = dataclasses.replace(ModelConfig(), **keys)
    if cfg.name == "llama" and cfg.n_kv_heads is None:
        cfg = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)
    abstract = abstract_params(cfg)
    with Checkpoint(directory) as ckpt:
        _check_shapes(cfg, ckpt, abstract, _names_for(cfg, ckpt))
        files = sorted({p.name for p in ckpt.where.values()})
    n = sum(math.prod(x.shape) for _, x in _paths(abstract))
    kind = keys["name"] + (f" model with {cfg.n_experts} experts a layer" if cfg.n_experts else " model")
    lines = [f"{directory}: {kind}, {n:,} parameters in {len(files)} safetensors file(s); every "
             f"tensor has the shape these keys imply.", "model:", f"  hf_checkpoint: {directory}"]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in keys.items()]
    lines.append(f"train from it: zerojax train --config CONFIG --set model.hf_checkpoint={directory} "
                 f"(model keys not given are taken from its config.json)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Writing.

EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_ST_INTEGERS = {"I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_FLOATS = ("F64", "F32", "F16", "BF16")
# Files of a transformers folder other than weights that an export carries over (tokenizer, generation).
_CARRIED_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
DEFAULT_MAX_SHARD_SIZE = "5GB"


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes
    return {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
            "float16": np.dtype(np.float16)}[name]


def parse_size(size: int | str) -> int:
    """Bytes of `max_shard_size` as transformers takes it: an int, or "5GB", "500MB", "2GiB"."""
    import re
    if isinstance(size, int) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", str(size).upper())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"export --max-shard-size {size!r}: give bytes or a size such as 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2) or "_"))


class Tensor(NamedTuple):
    """One tensor to write: its name, safetensors dtype and shape, and `make(rows)`, which gives the rows
    `rows` (a slice of the first dimension; `()` for a scalar) when they are written, in any dtype."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    make: Callable[[Any], np.ndarray]


def _header(tensors: list[Tensor], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for t in tensors:
        size = _nbytes(t)
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-len(blob) % 8)  # 8-byte aligned data, as the format recommends


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


_WRITE_BLOCK = 16 * 2 ** 20  # bytes converted and copied at a time while writing a tensor


def _nbytes(t: Tensor) -> int:
    return math.prod(t.shape) * _ITEMSIZE[t.dtype]


def _st_numpy(code: str) -> np.dtype:
    import ml_dtypes
    floats = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    return np.dtype(floats.get(code) or _ST_INTEGERS[code])


def _write_tensor(f: Any, t: Tensor) -> None:
    """`t`'s bytes, made, converted and written a block of rows at a time (about `_WRITE_BLOCK`)."""
    dtype = _st_numpy(t.dtype)
    if not t.shape:
        np.ascontiguousarray(t.make(()), dtype=dtype).tofile(f)
        return
    step = max(1, _WRITE_BLOCK // max(1, math.prod(t.shape[1:]) * dtype.itemsize))
    for start in range(0, t.shape[0], step):
        rows = slice(start, min(start + step, t.shape[0]))
        block = np.asarray(t.make(rows))
        if tuple(block.shape) != (rows.stop - start,) + t.shape[1:]:
            raise ValueError(f"write_safetensors: rows {start}:{rows.stop} of {t.name} are {block.shape}, its header "
                             f"says {t.shape}")
        np.ascontiguousarray(block, dtype=dtype).tofile(f)


def write_safetensors(out: Path, tensors: list[Tensor], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                      metadata: Mapping[str, str] | None = None, single: str = SINGLE_FILE) -> list[str]:
    """Write `tensors` in their order as model.safetensors, or as shards of at most `max_shard_size`
    bytes (a tensor larger than that alone in its shard) with model.safetensors.index.json, as
    transformers' `save_pretrained` does. Each file is written as its tensors are made, one tensor at a
    time, under a temporary name; the files are renamed only when all are complete, and weight files
    of an earlier export that the new one does not have are removed. Returns the files written."""
    limit = parse_size(max_shard_size)
    metadata = {"format": "pt", **(metadata or {})}
    shards: list[list[Tensor]] = [[]]
    used = 0
    for t in tensors:
        if shards[-1] and used + _nbytes(t) > limit:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += _nbytes(t)
    n = len(shards)
    files = [single] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    out.mkdir(parents=True, exist_ok=True)
    temps = [out / f".{file}.tmp-{os.getpid()}" for file in files]
    try:
        for tmp, shard in zip(temps, shards):
            with open(tmp, "wb") as f:
                blob = _header(shard, metadata)
                f.write(struct.pack("<Q", len(blob)))
                f.write(blob)
                for t in shard:
                    _write_tensor(f, t)
                    if _nbytes(t) > _WRITE_BLOCK:
                        release_freed_heap()
                f.flush()
                os.fsync(f.fileno())
        for old in out.iterdir():  # an earlier export's shards must not mix with these
            if (old.name == INDEX_FILE or (old.name.startswith("model") and old.suffix == ".safetensors")) \
                    and old.name not in files:
                old.unlink()
        for tmp, file in zip(temps, files):
            os.replace(tmp, out / file)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
    if n > 1:
        index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors)},
                 "weight_map": {t.name: file for file, shard in zip(files, shards) for t in shard}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def hf_config(cfg: Any, dtype: str = "float32") -> dict[str, Any]:
    """config.json of the transformers model equal to the zerojax model `cfg` (an export with no
    source checkpoint: a model trained from scratch)."""
    if cfg.name == "llama" and cfg.n_experts:
        _check_mixtral(cfg)
        llama = hf_config(dataclasses.replace(cfg, n_experts=None, sliding_window=None, hf_family=None), dtype)
        dense_only = ("architectures", "model_type", "attention_bias", "mlp_bias", "use_sliding_window")
        moe = {k: v for k, v in llama.items() if k not in dense_only}
        routing = {"num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.moe_aux_loss_coef,
                   "output_router_logits": False}
        if moe_family(cfg) == "qwen3_moe":
            return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **moe,
                    "num_experts": cfg.n_experts, **routing, "moe_intermediate_size": cfg.d_ff,
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "attention_bias": False, "use_sliding_window": False, "sliding_window": None}
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **moe,
                "num_local_experts": cfg.n_experts, **routing, "router_jitter_noise": 0.0,
                "sliding_window": cfg.sliding_window}
    if cfg.name == "llama":
        kind = family(cfg)
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM"}[kind]
        out = {"architectures": [arch], "model_type": kind, "vocab_size": cfg.vocab_size,
               "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
               "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
               "head_dim": cfg.head_dim or cfg.d_model // cfg.n_heads, "hidden_act": "silu",
               "rms_norm_eps": cfg.norm_eps if cfg.norm_eps is not None else 1e-5,
               "rope_theta": cfg.rope_theta, "rope_scaling": _rope_scaling(cfg),
               "max_position_embeddings": cfg.seq_len,
               "tie_word_embeddings": bool(cfg.tie_embeddings), "torch_dtype": dtype}
        if kind == "llama":
            out.update(attention_bias=False, mlp_bias=False)
        elif kind == "qwen3":
            out.update(attention_bias=False, use_sliding_window=False)
        elif kind == "mistral":
            out.update(sliding_window=cfg.sliding_window)
        elif kind == "phi3":  # Phi3Config's pad_token_id (32000) is a row of Phi-3's own vocabulary only
            out.update(sliding_window=cfg.sliding_window, pad_token_id=None)
        elif kind == "gemma2":
            del out["hidden_act"]
            n = cfg.n_layers
            out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False, sliding_window=cfg.sliding_window,
                       query_pre_attn_scalar=_whole(cfg.query_scale or out["head_dim"]),
                       attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap,
                       layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
        else:
            out.update(use_sliding_window=False)
        return out
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": cfg.d_ff or 4 * cfg.d_model, "n_positions": cfg.seq_len,
            "layer_norm_epsilon": cfg.norm_eps if cfg.norm_eps is not None else 1e-6,
            "activation_function": "gelu_new", "tie_word_embeddings": bool(cfg.tie_embeddings),
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "torch_dtype": dtype}


def _whole(x: float) -> int | float:
    """An integral value as an int: Gemma2Config's query_pre_attn_scalar is typed int."""
    return int(x) if float(x).is_integer() else x


def _rope_scaling(cfg: Any) -> dict[str, Any] | None:
    """config.json's rope_scaling for `model.rope_scaling` (as Llama 3.2's config.json writes it)."""
    if cfg.rope_scaling is None:
        return None
    out = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                   original_max_position_embeddings=cfg.rope_original_max_positions)
    return out


def _export_names(cfg: Any) -> dict[tuple[str, ...], Source]:
    if cfg.name == "llama":
        return _mixtral_names(cfg) if cfg.n_experts else _llama_names(cfg)
    return _gpt2_names("transformer.", "lm_head.weight", cfg.tie_embeddings)


Reader = Callable[[tuple[str, ...], tuple[Any, ...]], np.ndarray]  # (zerojax path, index) -> that part of the leaf


def _rows(read: Reader, path: tuple[str, ...], ix: tuple[int, ...], transpose: bool, rows: Any) -> np.ndarray:
    """Rows `rows` of the transformers tensor that leading index `ix` (layer, expert) of leaf `path`
    is: read from the leaf alone (its columns, where the tensor is the leaf transposed)."""
    lead = tuple(ix)
    if transpose:
        return read(path, lead + (slice(None), rows)).T
    return read(path, lead + ((rows,) if rows != () else ()))


def _fuse(tensors: list[tuple[Tensor, Source]]) -> list[Tensor]:
    """The tensors to write: each fused tensor's parts (`Source.part`, each a Tensor of its own rows)
    joined into one at the place of its first part, its rows made from the parts they fall in."""
    groups: dict[str, list[tuple[Tensor, Source]]] = {}
    for t, source in tensors:
        if source.part is not None:
            groups.setdefault(t.name, []).append((t, source))
    out: list[Tensor] = []
    for t, source in tensors:
        if source.part is None:
            out.append(t)
            continue
        parts = groups.pop(t.name, None)
        if parts is None:
            continue  # joined already
        parts.sort(key=lambda part: part[1].part[0])  # the leaves come by name (k before q), the rows by start

        def make(rows: Any, parts=parts) -> np.ndarray:
            pieces = []
            for part, src in parts:
                start, stop, _ = src.part
                lo, hi = max(rows.start, start), min(rows.stop, stop)
                if lo < hi:
                    pieces.append(np.asarray(part.make(slice(lo - start, hi - start))))
            return np.concatenate(pieces)
        out.append(Tensor(t.name, t.dtype, (source.part[2],) + tuple(t.shape[1:]), make))
    return out


def _model_tensors(cfg: Any, read: Reader, shapes: Mapping[tuple[str, ...], tuple[int, ...]],
                   dtype: str, names: Mapping[tuple[str, ...], Source] | None = None) -> list[Tensor]:
    """Every zerojax leaf under its transformers name(s) (`names`: default the model's), no source checkpoint."""
    names = _export_names(cfg) if names is None else names
    out = []
    for path, shape in shapes.items():
        source = names[path]
        one = _expected(path, tuple(shape), source)
        for ix, name in _tensors_of(path, source, tuple(shape)):
            def make(rows: Any, path=path, ix=ix, source=source) -> np.ndarray:
                return _rows(read, path, ix, source.transpose, rows)
            out.append((Tensor(name, _ST_DTYPES[dtype], one, make), source))
    return _fuse(out)


def save_params(out_dir: str | os.PathLike[str], cfg: Any, params: Mapping[str, Any], dtype: str = "float32",
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write an in-memory params tree (numpy or jax arrays) as a transformers folder. A model with LoRA
    adapters (`cfg.lora`) is written merged (W + alpha / r A B): the plain model, which transformers
    loads without peft; `save_adapter` writes the adapters alone."""
    if getattr(cfg, "lora", None) is not None:
        params, cfg = lora.merged(cfg, params), lora.without(cfg)
    flat = dict(_paths(params))
    shapes = {path: tuple(np.shape(x)) for path, x in flat.items()}
    out = Path(out_dir)
    tensors = _model_tensors(cfg, lambda path, index: np.asarray(flat[path][index]), shapes, dtype)
    write_safetensors(out, tensors, max_shard_size)
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    return out


# What an export copies back from the checkpoint the run was imported from.

def source_record(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What a run imported from `model.hf_checkpoint`, kept in its checkpoints (`meta.json`'s extra
    `hf_source`): the folder, every tensor's dtype and full shape, and config.json's digest, so an export
    can tell whether the folder still holds what was read."""
    import hashlib
    root = Path(directory).expanduser().absolute()
    with Checkpoint(root) as ckpt:
        tensors = {name: [ckpt.dtype(name), list(ckpt.shape(name))] for name in ckpt.where}
    digest = hashlib.sha256((root / "config.json").read_bytes()).hexdigest()
    return {"dir": str(root), "config_sha256": digest, "tensors": tensors}


def _changed(record: Mapping[str, Any], now: Mapping[str, Any], where: Mapping[str, Path]) -> str | None:
    """How the folder differs from what the run read, or None."""
    for name, entry in record["tensors"].items():
        if name not in now["tensors"]:
            return f"tensor {name} is no longer there"
        if list(now["tensors"][name]) != list(entry):
            return (f"tensor {name} in {where[name].name} is {now['tensors'][name]} (dtype, shape), the run read "
                    f"{list(entry)}")
    extra = sorted(set(now["tensors"]) - set(record["tensors"]))
    if extra:
        return f"tensor {extra[0]} was not there when the run read it"
    if now["config_sha256"] != record["config_sha256"]:
        return "its config.json has changed"
    return None


def _source_tensors(cfg: Any, src: Checkpoint, read: Reader, dtype: str) -> tuple[list[Tensor], bool]:
    """Every tensor of the source checkpoint under its own name and full shape: the parts the model
    trains from the zerojax checkpoint (`read`), the rest (positions past the model's context, buffers,
    tensors the model does not use) copied from the source. GPT-2's tied head: the source stays tied
    while the model's own head equals its token embedding; once it differs, `lm_head.weight` is added
    (the second value is then True: config.json's tie_word_embeddings must become false)."""
    np_dtype, st_dtype = _np_dtype(dtype), _ST_DTYPES[dtype]
    abstract = abstract_params(cfg)
    names = _names_for(cfg, src)
    _check_shapes(cfg, src, abstract, names)
    trained: list[Tensor] = []
    fused: list[tuple[Tensor, Source]] = []
    taken: set[str] = set()
    untied = False
    for path, leaf in _paths(abstract):
        source = names[path]
        if cfg.name == "gpt" and path == ("head", "kernel") and source.name == names[("embed", "embedding")].name:
            vocab = leaf.shape[1]
            step = max(1, _WRITE_BLOCK // (4 * leaf.shape[0]))
            blocks = [slice(s, min(s + step, vocab)) for s in range(0, vocab, step)]
            untied = any(not np.array_equal(_rows(read, path, (), True, rows), read(("embed", "embedding"), (rows,)))
                         for rows in blocks)
            if untied:
                trained.append(Tensor("lm_head.weight", st_dtype, (vocab, leaf.shape[0]),
                                      lambda rows: _rows(read, ("head", "kernel"), (), True, rows)))
            continue
        for ix, name in _tensors_of(path, source, tuple(leaf.shape)):
            full = src.shape(name)
            if source.part is not None:  # a fused tensor's rows (Phi-3's): joined by `_fuse`
                def part(rows: Any, path=path, ix=ix, source=source) -> np.ndarray:
                    return _rows(read, path, ix, source.transpose, rows)
                fused.append((Tensor(name, st_dtype, _expected(path, tuple(leaf.shape), source), part), source))
                taken.add(name)
                continue

            held = _expected(path, tuple(leaf.shape), source)[0]  # rows the model has (GPT-2: seq_len positions)

            def make(rows: Any, path=path, ix=ix, source=source, name=name, held=held) -> np.ndarray:
                if rows == () or rows.stop <= held:
                    return _rows(read, path, ix, source.transpose, rows)
                past = src.read(name, (slice(max(rows.start, held), rows.stop),))  # rows past the model's: the source's
                if rows.start >= held:
                    return past
                return np.concatenate([_rows(read, path, ix, source.transpose, slice(rows.start, held)).astype(np_dtype),
                                       past.astype(np_dtype)])
            trained.append(Tensor(name, st_dtype, full, make))
            taken.add(name)
    copied = []
    for name in src.where:
        if name in taken:
            continue
        kind = src.dtype(name)
        if kind not in _ST_FLOATS and kind not in _ST_INTEGERS:
            raise HFError(f"export --format hf: tensor {name} in {src.root / src.file(name)} has dtype {kind}, "
                          f"which the export cannot copy; export with --hf-source none (only the model's tensors)")
        copied.append(Tensor(name, st_dtype if kind in _ST_FLOATS else kind, src.shape(name),
                             lambda rows, name=name: src.read(name, (rows,) if rows != () else ())))
    return trained + _fuse(fused) + copied, untied


def _config_from_source(src: Path, dtype: str, untied: bool) -> str:
    """The source's config.json, unchanged but for what the export changed: the dtype, the tie."""
    text = (src / "config.json").read_text()
    hf = json.loads(text)
    changes: dict[str, Any] = {key: dtype for key in ("torch_dtype", "dtype") if key in hf and hf[key] != dtype}
    if untied:
        changes["tie_word_embeddings"] = False
    return json.dumps({**hf, **changes}, indent=2) + "\n" if changes else text


def export_checkpoint(directory: str | os.PathLike[str], tag: str | None, out_dir: str | os.PathLike[str],
                      dtype: str = "fp32", *, overwrite: bool = False, source: str | os.PathLike[str] | None = None,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """`zerojax export --format hf`: a zerojax checkpoint's parameters (the fp32 master when there is
    one) as a transformers folder. The model is the one the run's saved config names (`model.*`).

    A run imported from a transformers checkpoint (`model.hf_checkpoint`, recorded at import; or
    `source`) is written back as that checkpoint: its tensor names, full shapes and config.json, with
    what the model trains from the zerojax checkpoint and everything else (GPT-2's positions past
    `model.seq_len`, buffers, tensors the model does not use) copied unchanged; a tied checkpoint stays
    tied. `source="none"`: only the model's own tensors, config.json made from the model keys.

    Written shard by shard (`max_shard_size`, as transformers' `save_pretrained`), one tensor at a time:
    one layer of a stacked leaf is read from the checkpoint when it is written, so host memory stays
    near one tensor whatever the model size."""
    from zerojax import checkpoint as ck

    hf_dtype = EXPORT_DTYPES.get(dtype)
    if hf_dtype is None:
        raise ConfigError(f"export dtype {dtype!r}: use one of fp32, bf16, fp16")
    parse_size(max_shard_size)
    out = ck.absolute(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export --format hf: --out {out} is a file; name a folder to write")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"export --format hf: {out} is not empty and is never overwritten silently; pass "
                              f"--force to replace its config.json and weights, or choose another --out")
    tag_dir, meta, cfg, shapes, read = _open_tag(directory, tag, "export --format hf")
    extra = meta.get("extra", {})
    if cfg.lora is not None:  # the adapters folded into their kernels as each is written: the plain model
        read = _merged_reader(cfg, read, shapes)
        shapes = {path: shape for path, shape in shapes.items() if not lora.is_adapter(path)}
        cfg = lora.without(cfg)

    record = extra.get("hf_source")
    if source is not None and str(source).lower() == "none":
        src_dir = None
    else:
        src_dir = source or (record or {}).get("dir") or cfg.hf_checkpoint
    metadata = {"source": str(tag_dir), "step": str(meta["step"])}
    if src_dir is None:
        write_safetensors(out, _model_tensors(cfg, read, shapes, hf_dtype), max_shard_size, metadata)
        (out / "config.json").write_text(json.dumps(hf_config(cfg, hf_dtype), indent=2) + "\n")
        return out
    fix = ("pass --hf-source DIR naming the folder the run was imported from, or --hf-source none to write only "
           "the model's own tensors")
    src_path = Path(src_dir).expanduser().absolute()
    try:
        if not (src_path / "config.json").is_file():  # before opening the weights, which `with src` closes
            raise HFError(f"{src_path / 'config.json'} not found")
        src = Checkpoint(src_path)
    except (HFError, OSError) as e:
        raise HFError(f"export --format hf: the run was imported from {src_path}, which the export reads for the "
                      f"tensors the model does not train, but it cannot be read ({str(e).removeprefix('model.hf_checkpoint: ')}); "
                      f"{fix}") from None
    with src:
        if record and source is None:
            why = _changed(record, source_record(src_path), src.where)
            if why:
                raise HFError(f"export --format hf: {src_path} no longer holds the checkpoint the run was imported "
                              f"from: {why}; {fix}")
        try:
            tensors, untied = _source_tensors(cfg, src, read, hf_dtype)
        except HFError as e:
            raise HFError(f"export --format hf: {src_path} is not the checkpoint this model was imported from "
                          f"({str(e).removeprefix('model.hf_checkpoint: ')}); {fix}") from None
        write_safetensors(out, tensors, max_shard_size, metadata)
    (out / "config.json").write_text(_config_from_source(src_path, hf_dtype, untied))
    for extra_file in sorted(src_path.iterdir()):  # tokenizer and generation settings travel with the weights
        if (extra_file.is_file() and extra_file.suffix in _CARRIED_SUFFIXES and extra_file.suffix not in _WEIGHT_SUFFIXES
                and extra_file.name not in ("config.json", INDEX_FILE)):
            shutil.copyfile(extra_file, out / extra_file.name)
    return out


def _open_tag(directory: str | os.PathLike[str], tag: str | None, what: str) -> tuple[Path, dict[str, Any], Any,
                                                                                  dict[tuple[str, ...], tuple[int, ...]],
                                                                                  Reader]:
    """A zerojax checkpoint tag of a shipped model: its folder, meta.json, the model config it records
    (with its `lora` section when enabled), every leaf's shape, and a reader of any block of a leaf."""
    from zerojax import checkpoint as ck
    from zerojax.checkpoint.export import LeafReader
    from zerojax.config import LoraConfig, ModelConfig
    from zerojax.core.names import join

    tag_dir, meta = ck.unpipelined_tag(directory, tag, what)
    config = meta.get("extra", {}).get("config", {})
    model = config.get("model")
    if not model:
        raise ConfigError(f"{what}: {tag_dir} does not record the run's config (model.*), so the "
                          f"transformers architecture is unknown; export it with --format safetensors")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in model.items() if k in fields and k != "lora"})
    section = config.get("lora") or {}
    if section.get("enabled"):
        keys = {f.name for f in dataclasses.fields(LoraConfig)}
        cfg = dataclasses.replace(cfg, lora=LoraConfig(**{k: tuple(v) if isinstance(v, list) else v
                                                          for k, v in section.items() if k in keys}))
    expected = {".".join(p): tuple(x.shape) for p, x in _paths(abstract_params(cfg))}
    saved = {name: tuple(entry["shape"]) for name, entry in meta["params"].items()}
    if saved != expected:
        raise ConfigError(f"{what}: the parameters in {tag_dir} are not those of the {cfg.name} model "
                          f"its config names (a custom model?); export it with --format safetensors")
    shapes = {tuple(name.split(".")): shape for name, shape in saved.items()}
    reader = LeafReader(tag_dir / ck.STATE_DIR)

    frozen, excluded = set(meta.get("frozen", ())), set(meta.get("excluded", ()))

    def read(path: tuple[str, ...], index: tuple[Any, ...]) -> np.ndarray:
        name = ".".join(path)
        if name in excluded:
            raise ConfigError(f"{what}: {tag_dir} was saved with exclude_frozen_parameters, so it does not hold "
                              f"{name}; export a tag saved with them, or only the adapters (--format peft)")
        return reader.read(join("params" if name in frozen else meta["truth"], name), index)  # frozen: no master

    return tag_dir, meta, cfg, shapes, read


def _merged_reader(cfg: Any, read: Reader, shapes: Mapping[tuple[str, ...], tuple[int, ...]]) -> Reader:
    """`read` with each adapted kernel's block W + alpha / r * A B (A's rows and B's columns of the block
    only): the merged model, one block at a time, never a merged copy of the whole model."""
    s, picked = lora.scale(cfg), lora.targets(cfg)

    def merged(path: tuple[str, ...], index: tuple[Any, ...]) -> np.ndarray:
        w = read(path, index)
        if path[-1] != "kernel" or len(path) < 2 or path[-2] not in picked:
            return w
        index = tuple(index) + (slice(None),) * (len(shapes[path]) - len(tuple(index)))
        lead, rows, cols = index[:-2], index[-2], index[-1]
        a = np.asarray(read(path[:-1] + ("lora_a",), lead + (rows, slice(None))), np.float32)
        b = np.asarray(read(path[:-1] + ("lora_b",), lead + (slice(None), cols)), np.float32)
        return (np.asarray(w, np.float32) + s * (a @ b)).astype(np.asarray(w).dtype)

    return merged


def export_adapter(directory: str | os.PathLike[str], tag: str | None, out_dir: str | os.PathLike[str], *,
                   overwrite: bool = False, base: str | None = None) -> Path:
    """`zerojax export --format peft`: a LoRA run's checkpoint's adapters as a PEFT folder
    (`save_adapter`); the base named in it is `base`, else the run's model.hf_checkpoint."""
    from zerojax import checkpoint as ck
    out = ck.absolute(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise FileExistsError(f"export --format peft: {out} exists and is never overwritten silently; pass --force "
                              f"to replace its adapter files, or choose another --out")
    _, _, cfg, shapes, read = _open_tag(directory, tag, "export --format peft")
    if cfg.lora is None:
        raise ConfigError("export --format peft: the run trained no LoRA adapters (its lora.enabled is false); "
                          "export the model with --format hf")
    params: dict[str, Any] = {}
    for path in shapes:
        if lora.is_adapter(path):
            node = params
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = read(path, ())
    return save_adapter(out, cfg, params, base=base or cfg.hf_checkpoint)


# ---------------------------------------------------------------------------------------------
# PEFT adapters out.

def _peft_targets(cfg: Any, names: Mapping[tuple[str, ...], Source]) -> list[str]:
    """adapter_config.json's target_modules: each adapted module's last name (q_proj), or its last two
    where the last is shared with a module left without an adapter (GPT-2's attn.c_proj / mlp.c_proj)."""
    picked = lora.targets(cfg)
    stems = {path[-2]: source.name.removesuffix(".weight").split(".") for path, source in names.items()
             if path[-1] == "kernel" and len(path) >= 2}
    unadapted = {parts[-1] for layer, parts in stems.items() if layer not in picked}
    return sorted({".".join(parts[-2:]) if parts[-1] in unadapted else parts[-1]
                   for layer, parts in stems.items() if layer in picked})


def save_adapter(out_dir: str | os.PathLike[str], cfg: Any, params: Mapping[str, Any],
                 base: str | None = None) -> Path:
    """Write the adapters of a params tree as a PEFT LoRA folder (adapter_config.json +
    adapter_model.safetensors, fp32) that `peft.PeftModel.from_pretrained(base_model, out_dir)` loads
    onto the base (`base`: its folder, recorded as base_model_name_or_path)."""
    if getattr(cfg, "lora", None) is None:
        raise ConfigError("export --adapter: the model has no LoRA adapters (lora.enabled is false)")
    names = adapter_names(cfg, _export_names(cfg))
    flat = {path: x for path, x in _paths(params) if path in names}
    shapes = {path: tuple(np.shape(x)) for path, x in flat.items()}
    out = Path(out_dir)
    tensors = _model_tensors(cfg, lambda path, index: np.asarray(flat[path][index]), shapes, "float32", names)
    write_safetensors(out, tensors, metadata={"format": "pt"}, single=ADAPTER_WEIGHTS)
    fan_in_fan_out = cfg.name != "llama"  # GPT-2's Conv1D stores its weight [in, out]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": cfg.lora.r, "lora_alpha": cfg.lora.lora_alpha, "lora_dropout": cfg.lora.lora_dropout,
              "target_modules": _peft_targets(cfg, _export_names(cfg)), "bias": "none",
              "fan_in_fan_out": fan_in_fan_out, "inference_mode": True, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "modules_to_save": None}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out
