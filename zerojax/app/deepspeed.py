"""Continue a DeepSpeed run: `zerojax import-deepspeed SRC DST --config C`, `train.py --resume
PATH/global_stepN`, and `zerojax export --format deepspeed` (docs/deepspeed_checkpoints.md).

The config names the model and its optimizer and schedule; the DeepSpeed checkpoint (read without
torch, `checkpoint.deepspeed_format`) brings the weights, fp32 masters, Adam moments, counters,
schedule position and loss scale, placed into a plan's shards (`checkpoint.deepspeed_import`) and
written as a zerojax checkpoint tag, which then resumes on any mesh and ZeRO stage.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from zerojax.checkpoint.deepspeed_import import (DeepSpeedImportError, check_destination, import_state,
                                                 is_deepspeed_checkpoint, mapping_sources, read, save_imported,
                                                 schedule_count)
from zerojax.config import Config
from zerojax.core.layout import Plan

__all__ = ["check_not_deepspeed", "export_fp32_state_dict", "import_into", "is_deepspeed_checkpoint", "sources_for"]

_FIX_NAMES = ("pass names= (a mapping from DeepSpeed's parameter names to the parameter tree, "
              "docs/deepspeed_checkpoints.md) for a model that is not the embedded GPT (GPT-2 names) or Llama")


def sources_for(config: Config | None, param_names: Any, names: Mapping[str, Any] | None = None,
                leaves: Any = None) -> dict[str, Any]:
    """zerojax leaf -> DeepSpeed source: the user's `names` mapping; else the Hugging Face table of the
    config's model (GPT-2 names for the embedded GPT, Llama's for `model.name: llama`) when the
    checkpoint uses those names; else the identity (DeepSpeed names equal to the dotted leaf paths)."""
    if names is not None:
        return mapping_sources(names)
    param_names = list(param_names)
    if config is not None and config.model.name in ("gpt", "llama"):
        from zerojax.models.hf import deepspeed_sources
        table = deepspeed_sources(config.model, param_names)
        flat = {s.name.replace("{i}", "0") for s in table.values()}
        if any(n in flat for n in param_names):
            return table
    return mapping_sources({n: n for n in (leaves if leaves is not None else param_names)})


def _config_lbi(config: Config | None) -> int | None:
    if config is None or config.scheduler is None:
        return None
    return int(getattr(config.scheduler.params, "last_batch_iteration", -1))


def import_into(source: str | os.PathLike, directory: str | os.PathLike, plan: Plan, config: Config | None = None,
                *, names: Mapping[str, Any] | None = None, tag: str | None = None, weights_only: bool = False,
                extra: Mapping[str, Any] | None = None) -> Path:
    """Read the DeepSpeed checkpoint `source` (a run folder with `latest`, or a global_stepN folder),
    place it into `plan`'s shards and save it under `directory/<tag>` (default: DeepSpeed's tag) as a
    zerojax checkpoint; returns the tag folder. `config` (the one the plan was made from) gives the
    model's name table and the scheduler's starting position; `names` maps other models' DeepSpeed
    parameter names to the parameter tree."""
    from zerojax.checkpoint.format import leaf_names

    check_destination(source, directory)  # before anything is read or written
    ckpt = read(source)
    sources = sources_for(config, ckpt.params, names, leaf_names(plan.abstract_params))
    state = import_state(ckpt, plan, sources, count=schedule_count(ckpt, _config_lbi(config)),
                         weights_only=weights_only, fix=_FIX_NAMES if names is None else "fix the names mapping")
    extra = dict(extra or {})
    if config is not None:
        extra.setdefault("config", config.to_dict())
    return save_imported(directory, tag, state, plan, ckpt, extra)


class _Lazy:
    """One tensor of a stacked leaf, read when written (the leaf is read once and kept until its last
    layer is written: host memory stays near the largest leaf)."""

    def __init__(self, shape: tuple[int, ...], read_piece: Any):
        self.shape, self._read = shape, read_piece

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._read()
        return out if dtype is None else out.astype(dtype)


def export_fp32_state_dict(directory: str | os.PathLike, tag: str | None, out_path: str | os.PathLike, *,
                           overwrite: bool = False) -> Path:
    """`zerojax export --format deepspeed`: what DeepSpeed's `zero_to_fp32.py` writes
    (`pytorch_model.bin`, a torch state dict of fp32 tensors) from a zerojax checkpoint's fp32 master,
    leaf by leaf. The embedded GPT and Llama get their Hugging Face names (the module keys of
    GPT2LMHeadModel / LlamaForCausalLM); other models their dotted leaf paths."""
    from zerojax import checkpoint as ck
    from zerojax.checkpoint.deepspeed_format import write_fp32_state_dict
    from zerojax.checkpoint.export import read_leaves
    from zerojax.core.names import join

    out = ck.absolute(out_path)
    if out.is_dir() or str(out_path).endswith(("/", os.sep)):  # `--out out/`: a folder, made if missing
        out = out / "pytorch_model.bin"
    if out.exists() and not overwrite:
        raise FileExistsError(f"export: {out} already exists and is never overwritten silently; pass --force "
                              f"(overwrite=True) to replace it, or choose another --out")
    tag_dir, meta = ck.unpipelined_tag(directory, tag, "export --format deepspeed")
    cfg = _model_config(meta)
    saved = {name: tuple(entry["shape"]) for name, entry in meta["params"].items()}
    state_dir = tag_dir / ck.STATE_DIR
    held: dict[str, np.ndarray] = {}

    def leaf(name: str) -> np.ndarray:
        if name not in held:
            held.clear()  # one leaf at a time
            (_, array), = read_leaves(state_dir, [join(meta["truth"], name)])
            held[name] = np.asarray(array, np.float32)
        return held[name]

    tensors: OrderedDict[str, Any] = OrderedDict()
    for name, shape in saved.items():
        if cfg is None:
            tensors[name] = _Lazy(shape, lambda name=name: leaf(name))
            continue
        from zerojax.models.hf import named_tensors
        path = tuple(name.split("."))
        dummy = np.lib.stride_tricks.as_strided(np.zeros((), np.float32), shape=shape, strides=(0,) * len(shape))
        for i, (hf_name, piece) in enumerate(named_tensors(cfg, path, dummy)):
            def read_piece(name: str = name, i: int = i, path: tuple = path) -> np.ndarray:
                return np.ascontiguousarray(list(named_tensors(cfg, path, leaf(name)))[i][1])
            tensors[hf_name] = _Lazy(tuple(piece.shape), read_piece)
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(write_fp32_state_dict(out, tensors))


def _model_config(meta: Mapping[str, Any]) -> Any:
    """The run's embedded GPT / Llama config when the checkpoint's parameters are exactly its, else None."""
    import dataclasses
    from zerojax.config import ModelConfig
    from zerojax.models import abstract_params

    model = meta.get("extra", {}).get("config", {}).get("model")
    if not model:
        return None
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in model.items() if k in fields})
    try:
        import jax
        expected = {".".join(str(getattr(k, "key", k)) for k in p): tuple(x.shape)
                    for p, x in jax.tree_util.tree_leaves_with_path(abstract_params(cfg))}
    except Exception:  # noqa: BLE001 - not a model this package builds
        return None
    saved = {name: tuple(entry["shape"]) for name, entry in meta["params"].items()}
    return cfg if saved == expected else None


def check_not_deepspeed(path: str) -> None:
    """`zerojax export` of a DeepSpeed folder: say what to do instead."""
    if is_deepspeed_checkpoint(path):
        raise DeepSpeedImportError(f"{path} is a DeepSpeed checkpoint, not a zerojax one: import it first with "
                                   f"zerojax import-deepspeed {path} DST --config CONFIG")
