"""Hugging Face transformers checkpoints in and out: Llama-family and GPT-2.

In: `model.hf_checkpoint: DIR` (or `zerojax import-hf DIR` to see the model keys it implies) reads a
local transformers folder - config.json and model.safetensors, or shards listed by
model.safetensors.index.json. config.json fills the model keys the config does not give; each
parameter is then created with `jax.make_array_from_callback` under the plan's sharding, and the
callback reads, with safetensors' lazy slices, only the block of the tensor that device holds
(transposed from torch's [out, in] where needed, one layer at a time for the stacked layers). No
device, and no host buffer beyond one layer's block, ever holds a whole parameter that the stage
shards - DeepSpeed's `zero.Init` loading a pretrained model, without the whole-model detour.

Out: `zerojax export --format hf` writes a checkpoint's parameters as a folder that
`transformers.AutoModelForCausalLM.from_pretrained` loads: config.json and one model.safetensors,
written leaf by leaf (host memory stays near the largest stacked leaf).

GPT-2 goes into the embedded GPT, which has GPT-2's shape (learned positions, pre-norm LayerNorm,
tanh-approximated GELU, fused qkv, biases) with `model.norm_eps` at GPT-2's 1e-5. Two differences
are bridged here: the GPT keeps its own LM head, so an import copies GPT-2's tied token embedding
into it (an export writes it as `lm_head.weight` with `tie_word_embeddings: false`, exact either
way), and its position table is `model.seq_len` rows (an import keeps the first seq_len of
n_positions). GPT-2's Conv1D weights are already stored [in, out] and are not transposed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple

import numpy as np

from zerojax.config.hf import HFError, model_keys
from zerojax.errors import ConfigError
from zerojax.models import abstract_params

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ---------------------------------------------------------------------------------------------
# Names: each parameter of the zerojax model and the transformers tensor(s) it comes from.

class Source(NamedTuple):
    """One zerojax leaf's transformers tensor: `name` (with `{i}` for a stacked layer's index),
    stored transposed ([out, in], torch's Linear) or not. `prefix_rows`: the tensor may have more
    rows than the leaf, which takes the first ones (GPT-2's position table, n_positions >= seq_len)."""
    name: str
    transpose: bool = False
    prefix_rows: bool = False


def _llama_names(cfg: Any) -> dict[tuple[str, ...], Source]:
    layer = "model.layers.{i}."
    names = {("embed", "embedding"): Source("model.embed_tokens.weight"),
             ("norm", "scale"): Source("model.norm.weight"),
             ("layers", "attn_norm", "scale"): Source(layer + "input_layernorm.weight"),
             ("layers", "mlp_norm", "scale"): Source(layer + "post_attention_layernorm.weight")}
    for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                         ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                         ("down", "mlp.down_proj")):
        names[("layers", ours, "kernel")] = Source(layer + theirs + ".weight", transpose=True)
    if not cfg.tie_embeddings:
        names[("head", "kernel")] = Source("lm_head.weight", transpose=True)
    return names


def _gpt2_names(prefix: str, head: str | None) -> dict[tuple[str, ...], Source]:
    """`prefix`: "transformer." (GPT2LMHeadModel) or "" (GPT2Model, as the original uploads are)."""
    block = prefix + "h.{i}."
    names = {("embed", "embedding"): Source(prefix + "wte.weight"),
             ("pos",): Source(prefix + "wpe.weight", prefix_rows=True),
             ("ln_f", "scale"): Source(prefix + "ln_f.weight"), ("ln_f", "bias"): Source(prefix + "ln_f.bias"),
             ("head", "kernel"): Source(head or prefix + "wte.weight", transpose=True)}
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


def _paths(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, Mapping):
            yield from _paths(value, prefix + (key,))
        else:
            yield prefix + (key,), value


# ---------------------------------------------------------------------------------------------
# Reading.

class Checkpoint:
    """The tensors of a transformers folder, read lazily by slices (safetensors' `get_slice`)."""

    def __init__(self, directory: str | os.PathLike[str]):
        from safetensors import safe_open

        self.root = Path(directory).expanduser()
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise HFError(f"model.hf_checkpoint: {index} is not a safetensors index ({e!r})") from None
            self.where = {name: self.root / file for name, file in weight_map.items()}
        elif (self.root / SINGLE_FILE).is_file():
            self.where = {}
        else:
            found = sorted(p.name for p in self.root.iterdir() if p.suffix in (".bin", ".safetensors", ".pt"))
            raise HFError(f"model.hf_checkpoint: {self.root} has neither {SINGLE_FILE} nor {INDEX_FILE}"
                          + (f" (found {', '.join(found)})" if found else "")
                          + "; zerojax reads safetensors: save with save_pretrained(..., safe_serialization=True)")
        self._stack = contextlib.ExitStack()
        self._files: dict[Path, Any] = {}
        files = sorted(set(self.where.values())) or [self.root / SINGLE_FILE]
        try:
            for path in files:
                if not path.is_file():
                    raise HFError(f"model.hf_checkpoint: {path} is listed in {INDEX_FILE} but missing")
                handle = self._stack.enter_context(safe_open(str(path), framework="numpy"))
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
            raise HFError(f"model.hf_checkpoint: tensor {name} is not in {self.root} (the model its config.json "
                          f"describes needs it); is the checkpoint complete?")
        return self._files[self.where[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def file(self, name: str) -> str:
        return self.where[name].name

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Only `index` of tensor `name` is read from disk."""
        import ml_dtypes  # noqa: F401  (numpy knows bfloat16, the dtype of most published checkpoints, by it)
        return np.asarray(self._slice(name)[index])


def _names_for(cfg: Any, ckpt: Checkpoint) -> dict[tuple[str, ...], Source]:
    if cfg.name == "llama":
        return _llama_names(cfg)
    prefix = "transformer." if "transformer.wte.weight" in ckpt else ""
    return _gpt2_names(prefix, "lm_head.weight" if "lm_head.weight" in ckpt else None)


def deepspeed_sources(cfg: Any, names: Any) -> dict[str, Source]:
    """The name table for a DeepSpeed checkpoint of this model written by the Hugging Face Trainer:
    zerojax leaf (dotted) -> the DeepSpeed parameter name it comes from (`names`: the checkpoint's
    parameter names, e.g. `model.layers.0.self_attn.q_proj.weight`, `transformer.h.0.attn.c_attn.weight`).
    The table is `model.hf_checkpoint`'s; GPT-2 with tied embeddings (no `lm_head.weight`: DeepSpeed
    saves a tied parameter once) fills the GPT's own head from `wte`, as an import does."""
    present = set(names)
    if cfg.name == "llama":
        table = _llama_names(cfg)
    else:
        prefix = "transformer." if "transformer.wte.weight" in present else ""
        table = _gpt2_names(prefix, "lm_head.weight" if "lm_head.weight" in present else None)
    return {".".join(path): source for path, source in table.items()}


def named_tensors(cfg: Any, path: tuple[str, ...], array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(transformers / HF Trainer name, tensor) of one zerojax leaf of the embedded GPT or Llama: one
    per layer for a stacked leaf, transposed to torch's [out, in] where the table says so."""
    yield from _pieces(path, _export_names(cfg)[path], array)


def _expected(path: tuple[str, ...], shape: tuple[int, ...], source: Source) -> tuple[int, ...]:
    """The transformers shape of one layer of a zerojax leaf."""
    one = shape[1:] if _stacked(path) else shape
    return tuple(reversed(one)) if source.transpose else tuple(one)


def _check_shapes(cfg: Any, ckpt: Checkpoint, abstract: Mapping[str, Any],
                  names: Mapping[tuple[str, ...], Source]) -> None:
    """Every tensor the model needs is there with the shape the config implies (before any read)."""
    for path, leaf in _paths(abstract):
        source = names[path]
        want = _expected(path, tuple(leaf.shape), source)
        for i in range(leaf.shape[0]) if _stacked(path) else [None]:
            name = source.name.format(i=i)
            got = ckpt.shape(name)
            ok = got == want or (source.prefix_rows and len(got) == 2 and got[1] == want[1] and got[0] >= want[0])
            if not ok:
                raise HFError(f"model.hf_checkpoint: tensor {name} in {ckpt.file(name)} has shape {list(got)}, but "
                              f"the model the config describes (model.{_key_of(path)}) needs {list(want)}; the "
                              f"config's model keys and the checkpoint disagree - remove the model size keys from "
                              f"the config to take config.json's, or fix config.json")


def _key_of(path: tuple[str, ...]) -> str:
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
            return ckpt.read(name, tuple(reversed(idx))).T
        return ckpt.read(name, idx)

    if _stacked(path):
        layers = range(shape[0])[index[0]]
        out = np.stack([one(source.name.format(i=i), index[1:]) for i in layers])
    else:
        out = one(source.name, index)
    return np.ascontiguousarray(out.astype(dtype))


def load_params(directory: str | os.PathLike[str], cfg: Any, shardings: Any) -> dict[str, Any]:
    """The checkpoint's parameters as the zerojax model's params tree, each leaf created under its
    sharding in `shardings` (the plan's `update_shardings`), each device reading only its block."""
    import jax

    abstract = abstract_params(cfg)
    with Checkpoint(directory) as ckpt:
        names = _names_for(cfg, ckpt)
        _check_shapes(cfg, ckpt, abstract, names)
        flat_shardings = dict(_paths(shardings))
        out: dict[str, Any] = {}
        for path, leaf in _paths(abstract):
            shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
            array = jax.make_array_from_callback(
                shape, flat_shardings[path],
                lambda idx, path=path, shape=shape, dtype=dtype: _block(ckpt, path, names[path], idx, shape, dtype))
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = array
    return out


def read_params(directory: str | os.PathLike[str], cfg: Any) -> dict[str, Any]:
    """The checkpoint's parameters as numpy arrays (whole, on the host): for tests and small models."""
    abstract = abstract_params(cfg)
    with Checkpoint(directory) as ckpt:
        names = _names_for(cfg, ckpt)
        _check_shapes(cfg, ckpt, abstract, names)
        out: dict[str, Any] = {}
        for path, leaf in _paths(abstract):
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = _block(ckpt, path, names[path], (), tuple(leaf.shape), np.dtype(leaf.dtype))
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
    lines = [f"{directory}: {keys['name']} model, {n:,} parameters in {len(files)} safetensors file(s); every "
             f"tensor has the shape these keys imply.", "model:", f"  hf_checkpoint: {directory}"]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in keys.items()]
    lines.append(f"train from it: zerojax train --config CONFIG --set model.hf_checkpoint={directory} "
                 f"(model keys not given are taken from its config.json)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Writing.

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def hf_config(cfg: Any, dtype: str = "float32") -> dict[str, Any]:
    """config.json of the transformers model equal to the zerojax model `cfg`."""
    if cfg.name == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
                "head_dim": cfg.d_model // cfg.n_heads, "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "rms_norm_eps": cfg.norm_eps if cfg.norm_eps is not None else 1e-5,
                "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.seq_len,
                "tie_word_embeddings": bool(cfg.tie_embeddings), "torch_dtype": dtype}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": cfg.d_ff or 4 * cfg.d_model, "n_positions": cfg.seq_len,
            "layer_norm_epsilon": cfg.norm_eps if cfg.norm_eps is not None else 1e-6,
            "activation_function": "gelu_new", "tie_word_embeddings": False,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "torch_dtype": dtype}


def _export_names(cfg: Any) -> dict[tuple[str, ...], Source]:
    return _llama_names(cfg) if cfg.name == "llama" else _gpt2_names("transformer.", "lm_head.weight")


def _pieces(path: tuple[str, ...], source: Source, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(transformers name, tensor) of one zerojax leaf: one per layer for a stacked leaf."""
    for i, part in enumerate(array) if _stacked(path) else [(None, array)]:
        yield source.name.format(i=i), (part.T if source.transpose else part)


def write_params(out_dir: str | os.PathLike[str], cfg: Any, leaves: Iterator[tuple[tuple[str, ...], np.ndarray]],
                 shapes: Mapping[tuple[str, ...], tuple[int, ...]], dtype: str = "float32",
                 metadata: Mapping[str, str] | None = None) -> Path:
    """Write config.json and model.safetensors into `out_dir` from `leaves` (zerojax path, array),
    given in the order of `shapes`; only one leaf is held at a time."""
    import ml_dtypes

    np_dtype = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "float16": np.dtype(np.float16)}[dtype]
    names = _export_names(cfg)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for path, shape in shapes.items():
        source = names[path]
        one = tuple(shape[1:]) if _stacked(path) else tuple(shape)
        one = tuple(reversed(one)) if source.transpose else one
        for i in range(shape[0]) if _stacked(path) else [None]:
            size = math.prod(one) * np_dtype.itemsize
            header[source.name.format(i=i)] = {"dtype": _ST_DTYPES[dtype], "shape": list(one),
                                               "data_offsets": [offset, offset + size]}
            offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{SINGLE_FILE}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            order = list(shapes)
            for n, (path, array) in enumerate(leaves):
                if path != order[n] or tuple(array.shape) != tuple(shapes[path]):
                    raise ValueError(f"write_params: leaf {'.'.join(path)} {array.shape} out of order")
                for _, piece in _pieces(path, names[path], np.asarray(array)):
                    np.ascontiguousarray(piece.astype(np_dtype, copy=False)).tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out / SINGLE_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    return out


def save_params(out_dir: str | os.PathLike[str], cfg: Any, params: Mapping[str, Any], dtype: str = "float32") -> Path:
    """Write an in-memory params tree (numpy or jax arrays) as a transformers folder."""
    flat = dict(_paths(params))
    shapes = {path: tuple(np.shape(x)) for path, x in flat.items()}
    return write_params(out_dir, cfg, ((p, np.asarray(x)) for p, x in flat.items()), shapes, dtype)


def export_checkpoint(directory: str | os.PathLike[str], tag: str | None, out_dir: str | os.PathLike[str],
                      dtype: str = "fp32", *, overwrite: bool = False) -> Path:
    """`zerojax export --format hf`: a zerojax checkpoint's parameters (the fp32 master when there is
    one) as a transformers folder, read and written leaf by leaf. The model is the one the run's
    saved config names (`model.*`)."""
    from zerojax import checkpoint as ck
    from zerojax.config import ModelConfig

    hf_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype)
    if hf_dtype is None:
        raise ConfigError(f"export dtype {dtype!r}: use one of fp32, bf16, fp16")
    out = ck.absolute(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export --format hf: --out {out} is a file; name a folder to write")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"export --format hf: {out} is not empty and is never overwritten silently; pass "
                              f"--force to replace its config.json and model.safetensors, or choose another --out")
    tag_dir = ck.resolve_tag(ck.absolute(directory), tag)
    meta = ck.read_meta(tag_dir)
    ck.verified(tag_dir, meta)
    if meta.get("extra", {}).get(ck.PIPELINE_ROWS):
        raise ConfigError("export --format hf: this checkpoint is of a pipelined run (mesh.stage > 1); export it "
                          "with --format safetensors (the default) instead")
    model = meta.get("extra", {}).get("config", {}).get("model")
    if not model:
        raise ConfigError(f"export --format hf: {tag_dir} does not record the run's config (model.*), so the "
                          f"transformers architecture is unknown; export it with --format safetensors")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in model.items() if k in fields})
    expected = {".".join(p): tuple(x.shape) for p, x in _paths(abstract_params(cfg))}
    saved = {name: tuple(entry["shape"]) for name, entry in meta["params"].items()}
    if saved != expected:
        raise ConfigError(f"export --format hf: the parameters in {tag_dir} are not those of the {cfg.name} model "
                          f"its config names (a custom model?); export it with --format safetensors")
    shapes = {tuple(name.split(".")): shape for name, shape in saved.items()}
    from zerojax.core.names import join
    sources = [join(meta["truth"], name) for name in saved]
    leaves = ((tuple(name.split(".")), array) for (name, _), (_, array) in
              zip(saved.items(), ck.read_leaves(tag_dir / ck.STATE_DIR, sources)))
    return write_params(out, cfg, leaves, shapes, hf_dtype,
                        {"source": str(tag_dir), "step": str(meta["step"])})
