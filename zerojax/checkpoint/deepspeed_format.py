"""DeepSpeed's ZeRO checkpoint folders, read into and written from plain numpy, without torch.

What `DeepSpeedEngine.save_checkpoint` leaves (deepspeed/runtime/engine.py `save_checkpoint`,
`_save_checkpoint`, `_save_zero_checkpoint`, `_get_ckpt_name`, `_get_rank_zero_ckpt_name`)::

    run/
      latest                                        the tag, e.g. "global_step14" (no newline)
      global_step14/
        mp_rank_00_model_states.pt                  stages 1-2: module weights + bookkeeping
        zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3 instead: one per data-parallel rank
        [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   one per rank R; "bf16_" when bf16 is on

The model-states dict (engine.py `_common_checkpoint_state`) holds `module`, `param_shapes` (one
OrderedDict name -> torch.Size per optimizer group, in flattening order), counters, `lr_scheduler`,
`ds_config`, `ds_version` and, at the top level, the caller's client state.

Each optimizer file holds {"optimizer_state_dict": ..., "ds_config", "ds_version"}; the inner dict is
the ZeRO optimizer's `state_dict()`:

* stages 1-2 (deepspeed/runtime/zero/stage_1_and_2.py `state_dict`): the fp32 master weights of a
  group are its parameters flattened in `param_shapes` order, zero-padded to a multiple of
  2 * dp (`nccl_start_alignment_factor` * world size), and cut into dp equal partitions - a cut may
  fall inside a tensor. `single_partition_of_fp32_groups` is this rank's partition with the padding
  removed (`_get_groups_without_padding`); `base_optimizer_state` is the wrapped optimizer's own
  `state_dict()` over the still-padded partitions (or, with `elastic_checkpoint`, a list of lean
  per-group states plus `base_optimizer_state_step`).
* stage 3 (deepspeed/runtime/zero/stage3.py `_rigid_state_dict`): every parameter is split on its
  own into ceil(numel / dp)-element slices (the last padded with zeros,
  partition_parameters.py `_partition_param`); `fp32_flat_groups` holds, per sub-group, the
  concatenation of this rank's slices; the wrapped optimizer's state is under
  `optimizer_state_dict`.

`deepspeed/utils/zero_to_fp32.py` is the reference reader these rules were taken from (its
`zero3_partitioned_param_info` and the 2 * world_size alignment check). Every `.pt` is read through
`torch_zip`'s restricted unpickler, so a checkpoint cannot run code when it is read.

Three more layouts (`deepspeed/checkpoint/ds_to_universal.py` is the reference for all three):

* tensor parallel: every model-parallel rank M saves `mp_rank_MM_model_states.pt` and its own
  `zero_pp_rank_R_mp_rank_MM_optim_states.pt`, over its slices of the parameters. Each rank is read
  as above; a parameter is joined from its slices by the model states' `universal_checkpoint_info`
  (AutoTP's `affine_map`: per rank, strided pieces of the full tensor; else the name patterns:
  replicated, row-parallel joined on dimension 1, vocabulary rows cut to `original_vocab_size`, the
  rest joined on dimension 0), as `merge_tp_slices` joins them.
* MoE (expert parallel, stages 1-2): an expert group is partitioned over the expert-data-parallel
  ranks only (`partition_count` [dp, dp / ep_size]); expert-parallel rank p = r % ep_size holds local
  experts `...deepspeed_experts.L...`, which are expert p * local + L, the names DeepSpeed's
  `layer_*_expert_*_model_states.pt` files carry (engine.py `_save_moe_checkpoint`).
* universal (`ds_to_universal.py`'s output, `latest_universal`): `zero/<param>/fp32.pt`, `exp_avg.pt`,
  `exp_avg_sq.pt`, `step.pt`, each the whole parameter; `zero/optimizer_state.pt`; the run's
  model-states files for the names and counters.

Nothing is joined ahead of use: the parameters, moments and weights come back as `Tensors`, which
assemble one parameter when it is read, from shards mapped from their files (`torch_zip.load(mmap=
True)`), so the host holds one parameter at a time, never the model.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

from . import torch_zip
from .torch_zip import LazyArray, PickledEnum, PickledObject, TorchDtype, TorchFileError, TorchSize

__all__ = ["DS_VERSION", "DeepSpeedCheckpoint", "DeepSpeedCheckpointError", "Tensors", "read_checkpoint", "shape_of",
           "write_checkpoint", "write_fp32_state_dict"]

DS_VERSION = "0.19.6"
"""The DeepSpeed release whose layout this module reads and writes (written as `ds_version`)."""


class DeepSpeedCheckpointError(ValueError):
    """A DeepSpeed checkpoint that cannot be read: the message names the file and what to do."""


class Tensors(Mapping[str, np.ndarray]):
    """Named fp32 tensors of a checkpoint, each assembled from the files when it is asked for and not
    kept: the shard files are memory-mapped, so reading a model holds one parameter at a time in host
    memory, never the model. `shapes` answers names and shapes without reading any tensor."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], produce: Callable[[str], np.ndarray]) -> None:
        self.shapes = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
        self._produce = produce

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.shapes:
            raise KeyError(name)
        return self._produce(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __repr__(self) -> str:
        return f"Tensors({len(self)} tensors, assembled on access)"


def shape_of(tensors: Mapping[str, Any], name: str) -> tuple[int, ...]:
    """A tensor's shape without assembling it (any mapping of arrays works too)."""
    if isinstance(tensors, Tensors):
        return tensors.shapes[name]
    return tuple(np.shape(tensors[name]))


class _Flat:
    """Several 1-D arrays read as their concatenation, without concatenating them: `take` copies out
    one range (a parameter) only."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self.arrays = [np.asarray(a).reshape(-1) for a in arrays]
        self.starts = np.cumsum([0] + [a.size for a in self.arrays]).tolist()
        self.size = self.starts[-1]

    def take(self, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(hi - lo, np.float32) if out is None else out
        for a, start in zip(self.arrays, self.starts):
            a_lo, a_hi = max(lo, start), min(hi, start + a.size)
            if a_lo < a_hi:
                out[a_lo - lo:a_hi - lo] = a[a_lo - start:a_hi - start]
        return out


# Keys DeepSpeed itself writes into the model-states file (engine.py `_common_checkpoint_state`,
# `_save_checkpoint`, `_save_moe_checkpoint`); every other top-level key is the caller's client state.
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info", "num_experts",
    "ds_autoep_layers", "autoep_layers", "folding",
})

_ZERO_STAGE_ENUM = ("deepspeed.runtime.zero.config", "ZeroStageEnum")
_LOSS_SCALER_MODULE = "deepspeed.runtime.fp16.loss_scaler"


@dataclass
class DeepSpeedCheckpoint:
    """One tag of a DeepSpeed ZeRO checkpoint, reassembled: full-shape fp32 arrays by parameter name."""
    path: str                                  # the tag folder read
    tag: str
    zero_stage: int
    dp_world_size: int                         # ranks that wrote the optimizer shards
    params: Mapping[str, np.ndarray]           # fp32 master weights, full shapes, `param_shapes` order (`Tensors`:
    exp_avg: Mapping[str, np.ndarray] | None   # each assembled when read); Adam first moments, same names and
    exp_avg_sq: Mapping[str, np.ndarray] | None  # shapes; None if not saved
    step: int | None                           # the optimizer's step count
    lr: float | None                           # first param group's learning rate
    param_groups: list[dict[str, Any]]         # optimizer hyperparameters per group (lr, betas, eps, ...)
    group_names: list[list[str]]               # parameter names per optimizer group
    global_steps: int
    global_samples: int
    skipped_steps: int
    lr_scheduler: dict[str, Any] | None        # e.g. {"last_batch_iteration": 13}
    loss_scale: dict[str, Any] | None          # the loss scaler's fields, plus "type"
    ds_config: Any
    ds_version: str | None
    client_state: dict[str, Any]
    module: dict[str, np.ndarray]              # model-states weights (stage 3: empty placeholders)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    frozen_params: dict[str, np.ndarray] = field(default_factory=dict)
    shared_params: dict[str, str] = field(default_factory=dict)  # alias name -> name holding the data
    universal_info: Any = None                 # `universal_checkpoint_info`: how tensor-parallel slices join
    layout: str = "zero"                       # "zero" (per-rank shards), "universal" (one folder per parameter)
    tp_degree: int = 1                         # tensor-parallel ranks that wrote it (joined here)

    def fp32_state_dict(self) -> OrderedDict[str, np.ndarray]:
        """What `zero_to_fp32.py` produces: buffers (cast to fp32, as it does), frozen then trainable
        parameters, and shared parameters under every name."""
        out: OrderedDict[str, np.ndarray] = OrderedDict((k, v.astype(np.float32)) for k, v in self.buffers.items())
        out.update(self.frozen_params)
        out.update(self.params)
        for alias, source in self.shared_params.items():
            if source in out:
                out[alias] = out[source]
        return out


# --------------------------------------------------------------------------- reading

def _load(path: str, opaque: bool = False) -> Any:
    """A `.pt` file, its tensors mapped from the file (pages read when a tensor is assembled)."""
    try:
        return torch_zip.load(path, opaque=opaque, mmap=True)
    except TorchFileError as e:
        if e.refused is None:
            raise DeepSpeedCheckpointError(str(e)) from None
        raise DeepSpeedCheckpointError(_refused(path, e.refused, "")) from None


def _refused(path: str, qualname: str, where: str) -> str:
    return (f"{path}: holds a pickled '{qualname}'{where}, which this reader does not rebuild: a checkpoint is read "
            "as tensors, containers and the records DeepSpeed itself writes, because rebuilding any other object "
            "would import or run code from the file. The caller's client state may hold such objects (they are "
            "kept as inert records and not carried over), DeepSpeed's own entries and the optimizer files may not. "
            "If you trust the file, load it with torch and save it again without that object.")


def _foreign(obj: Any) -> list[str]:
    """The classes of the inert records (outside torch_zip's allowlist) anywhere inside `obj`."""
    found, stack, seen = [], [obj], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, PickledObject):
            if x.qualname not in torch_zip.ALLOWED_GLOBALS:
                found.append(x.qualname)
            stack.extend((x.args, x.state))
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return found


def _load_model_states(path: str) -> dict:
    """A model-states file, its client state allowed to hold other objects (Megatron-DeepSpeed's numpy
    RNG state, a user's class) as inert records - never imported or called, and not carried over.
    DeepSpeed's own keys must hold what this reader knows."""
    model = _load(path, opaque=True)
    if isinstance(model, dict):
        for key in sorted(_DEEPSPEED_KEYS & set(model)):
            found = _foreign(model[key])
            if found:
                raise DeepSpeedCheckpointError(_refused(path, found[0], f" under its {key!r} entry"))
    return model


def _within(arrays: Sequence[Any], path: str, what: str) -> None:
    """Tensors about to be copied together must be backed by the file's bytes: DeepSpeed writes its
    fp32 partitions and moments in full, so more logical bytes than the file holds can only come from
    expanded (stride-0) or aliased views of a few stored bytes - refused before anything is copied."""
    logical = sum(np.asarray(a).nbytes for a in arrays if isinstance(a, np.ndarray))
    size = os.path.getsize(path)
    if logical > size:
        raise DeepSpeedCheckpointError(f"{path}: its {what} declare {logical} bytes of tensors but the file holds "
                                       f"{size}: they are expanded or aliased views, which DeepSpeed never writes "
                                       "there; the file is crafted or corrupt and is not read")


def _plain_tag(latest: str, tag: str) -> None:
    """`latest` names a folder beside it: one plain name, never a path out of the run folder."""
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or os.sep in tag or "\0" in tag \
            or os.path.isabs(tag):
        raise DeepSpeedCheckpointError(
            f"{latest} names {tag!r}, which is not a tag folder of {os.path.dirname(latest)}: `latest` holds one "
            "folder name (e.g. global_step14), never a path. Pass the tag folder itself (run/global_stepN).")


def _has_model_states(folder: str) -> bool:
    try:
        return any(n.endswith("_model_states.pt") for n in os.listdir(folder))
    except OSError:
        return False


def _resolve(path: str) -> tuple[str, str]:
    """(tag, tag folder) from a run folder with `latest` or a tag folder itself."""
    if not os.path.isdir(path):
        raise DeepSpeedCheckpointError(f"{path} is not a folder: pass the folder save_checkpoint wrote (the one "
                                       "holding `latest`) or one of its global_stepN folders")
    latest = os.path.join(path, "latest")
    if not os.path.isfile(latest):  # a run folder holding only ds_to_universal.py's output
        latest = os.path.join(path, "latest_universal")
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8", errors="replace") as f:
            tag = f.read(4096).strip()
        _plain_tag(latest, tag)
        tag_dir = os.path.join(path, tag)
        if not tag or not os.path.isdir(tag_dir):
            raise DeepSpeedCheckpointError(
                f"{latest} names tag {tag!r}, but {tag_dir} does not exist: the save was interrupted or the folder "
                "was moved. Pass an existing tag folder (e.g. run/global_stepN) instead.")
        return tag, tag_dir
    if _has_model_states(path):
        return os.path.basename(os.path.normpath(path)), path
    tags = sorted(d for d in os.listdir(path) if _has_model_states(os.path.join(path, d)))
    hint = (f"it holds tag folders {tags}: pass one of them (e.g. {os.path.join(path, tags[-1])})" if tags
            else "pass the folder DeepSpeed's save_checkpoint wrote")
    raise DeepSpeedCheckpointError(f"{path} has no `latest` (nor ds_to_universal.py's `latest_universal`) file "
                                   f"and no *_model_states.pt: {hint}")


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, np.ndarray):  # torch.optim keeps `step` as a 0-d float tensor
        return int(value.reshape(-1)[0]) if value.size == 1 else None
    return int(value)


def _loss_scale(record: Any) -> dict[str, Any] | None:
    if not isinstance(record, PickledObject):
        return None
    state = record.state if isinstance(record.state, dict) else {}
    out = {"type": record.name}
    out.update({k: (v.name if isinstance(v, TorchDtype) else v) for k, v in state.items()})
    return out


def _base_state(opt: dict, stage: int) -> tuple[list[dict], list[dict], Any]:
    """Per-group optimizer state dicts, the param groups and any separately stored step."""
    if stage <= 2:
        base = opt.get("base_optimizer_state")
        if isinstance(base, list):  # elastic_checkpoint: lean per-group states
            return [dict(s) for s in base], [], opt.get("base_optimizer_state_step")
    else:
        base = opt.get("optimizer_state_dict")
    if not isinstance(base, dict) or "state" not in base:
        return [], [], None
    groups = list(base.get("param_groups") or [])
    order = [i for g in groups for i in g.get("params", [])]
    if not order:
        order = sorted(base["state"])
    states = [dict(base["state"].get(i, {})) for i in order]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return states, hyper, None


_EXPERT = re.compile(r"\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)(?=\.)")


def _flat_groups(shapes: list[Mapping], counts: list[int], dp: int, where: str) -> list[tuple[int, list[int], dict]]:
    """(optimizer group, the ranks whose partitions make its flat vector in order, its parameters):
    one per group; an expert group (partitioned over the expert-data-parallel ranks only, MoE) gives
    one per expert-parallel rank, its local experts renamed to their global ids as DeepSpeed's
    `_save_moe_checkpoint` names them (ep rank p's local expert l is expert p * local + l)."""
    out = []
    for g, (group_shapes, count) in enumerate(zip(shapes, counts)):
        if count == dp:
            out.append((g, list(range(dp)), dict(group_shapes)))
            continue
        ep = dp // count
        local: dict[str, set[str]] = {}
        for name in group_shapes:
            m = _EXPERT.search(name)
            if m is None:
                raise DeepSpeedCheckpointError(
                    f"{where} group {g}: partitioned over {count} of {dp} ranks (an expert group), but its parameter "
                    f"{name!r} is not a DeepSpeed MoE expert (.deepspeed_moe.experts.deepspeed_experts.N.): which "
                    "expert each rank holds cannot be told")
            local.setdefault(name[:m.start()], set()).add(m.group(1))
        for p in range(ep):  # groups.py: expert-parallel rank r % ep, expert-data-parallel rank r // ep
            def rename(name: str) -> str:
                m = _EXPERT.search(name)
                n_local = len(local[name[:m.start()]])
                return name[:m.start(1)] + str(p * n_local + int(m.group(1))) + name[m.end(1):]
            out.append((g, [r for r in range(dp) if r % ep == p], {rename(n): s for n, s in group_shapes.items()}))
    return out


def _stage12_layout(partitions: list[list[np.ndarray]], flat_groups: list[tuple[int, list[int], dict]],
                    where: str) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """name -> (flat group, offset in its flat vector, shape): each flat vector is its ranks' lean
    partitions in rank order, its parameters in `param_shapes` order."""
    layout = {}
    for v, (g, ranks, group_shapes) in enumerate(flat_groups):
        size = sum(np.asarray(partitions[r][g]).size for r in ranks)
        offset = 0
        for name, shape in group_shapes.items():
            n = _numel(shape)
            if offset + n > size:
                raise DeepSpeedCheckpointError(
                    f"{where} group {g}: param_shapes need more than the {size} elements the ranks' partitions hold "
                    f"(ran out at {name!r}); the optimizer files do not belong to this model-states file")
            layout[name] = (v, offset, tuple(int(d) for d in shape))
            offset += n
        align = 2 * len(ranks)  # zero_to_fp32.py `zero2_align`: padding up to 2 * world_size elements
        if align * math.ceil(offset / align) != align * math.ceil(size / align):
            raise DeepSpeedCheckpointError(
                f"{where} group {g}: param_shapes account for {offset} elements but the ranks' partitions hold "
                f"{size}; the optimizer files do not belong to this model-states file")
    return layout


def _stage12_table(partitions: list[list[np.ndarray]], flat_groups: list[tuple[int, list[int], dict]],
                   layout: Mapping[str, tuple]) -> Tensors:
    flats = [_Flat([partitions[r][g] for r in ranks]) for g, ranks, _ in flat_groups]

    def produce(name: str) -> np.ndarray:
        v, offset, shape = layout[name]
        return flats[v].take(offset, offset + _numel(shape)).reshape(shape)
    return Tensors({n: v[2] for n, v in layout.items()}, produce)


def _stage3_layout(size: int, shapes: list[Mapping], dp: int, where: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (offset in each rank's flat groups, shape): every parameter split on its own into
    ceil(numel / dp) elements per rank, in `param_shapes` order (zero_to_fp32.py
    `zero3_partitioned_param_info`)."""
    layout, offset = {}, 0
    for name, shape in ((n, s) for g in shapes for n, s in g.items()):
        part = math.ceil(_numel(shape) / dp)
        if offset + part > size:
            raise DeepSpeedCheckpointError(f"{where}: param_shapes need more elements than each rank's fp32 "
                                           f"flat groups hold (ran out at {name!r}, {size} per rank)")
        layout[name] = (offset, tuple(int(d) for d in shape))
        offset += part
    if offset != size:
        raise DeepSpeedCheckpointError(f"{where}: param_shapes account for {offset} elements per rank but each "
                                       f"rank's fp32 flat groups hold {size}; the optimizer files do not belong "
                                       "to this model-states file")
    return layout


def _stage3_table(ranks: list[_Flat], layout: Mapping[str, tuple], dp: int) -> Tensors:
    def produce(name: str) -> np.ndarray:
        offset, shape = layout[name]
        n = _numel(shape)
        part = math.ceil(n / dp)
        out = np.empty(part * dp, np.float32)
        for r, flat in enumerate(ranks):
            flat.take(offset, offset + part, out[r * part:(r + 1) * part])
        return out[:n].reshape(shape)
    return Tensors({n: v[1] for n, v in layout.items()}, produce)


def _bf16_enabled(ds_config: Any) -> bool:
    """engine.py names the optimizer shards "bf16_zero_pp_rank_..." when bf16 is enabled."""
    if not isinstance(ds_config, dict):
        return False
    section = ds_config.get("bf16") or ds_config.get("bfloat16")
    return isinstance(section, dict) and bool(section.get("enabled"))


def read_checkpoint(path: str | os.PathLike, *, opaque: bool = False) -> DeepSpeedCheckpoint:
    """Read a DeepSpeed ZeRO (stage 1, 2 or 3) checkpoint - tensor-parallel, MoE or universal ones too: the
    run folder (follows `latest`, else `latest_universal`) or a tag folder.

    Raises `DeepSpeedCheckpointError` naming the file for a missing `latest` target or rank file,
    a truncated archive, shapes that do not add up, or a pickled global outside the allowlist.
    Stage-0 checkpoints, and tensor-parallel ones that record no way to join their slices, are
    refused with a message saying so.
    Model-states files whose client state holds other objects (Megatron-DeepSpeed's numpy RNG state)
    are read with those objects as inert `PickledObject` records (never imported or called), on every
    route; `opaque` is kept for callers that passed it and changes nothing now.
    """
    tag, tag_dir = _resolve(os.fspath(path))
    try:
        return _read(tag, tag_dir, opaque)
    except DeepSpeedCheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        raise DeepSpeedCheckpointError(
            f"{tag_dir}: unexpected checkpoint contents ({type(e).__name__}: {e}); these files were not written "
            "by a DeepSpeed ZeRO optimizer this reader knows") from e


def _read(tag: str, tag_dir: str, opaque: bool) -> DeepSpeedCheckpoint:
    """A universal folder (`zero/<param>/fp32.pt`), or a ZeRO tag with one or more model-parallel
    ranks (each read on its own, then joined parameter by parameter)."""
    if os.path.isfile(os.path.join(tag_dir, "zero", "optimizer_state.pt")):
        return _read_universal(tag, tag_dir)
    tp = _mp_degree(tag_dir)
    parts = [_read_mp_rank(tag, tag_dir, mp) for mp in range(tp)]
    if parts[0].tp_degree != tp:  # the degree rank 0 recorded (mp_world_size) against the files present
        raise DeepSpeedCheckpointError(
            f"{tag_dir}: {os.path.basename(_model_states_file(tag_dir, 0))} says {parts[0].tp_degree} model-parallel "
            f"ranks saved this tag, but model-states files of {tp} are present (mp_rank_{tp:02d}... is missing): "
            "every tensor-parallel rank saves its own slices. Copy the missing files from the nodes that wrote them.")
    return parts[0] if tp == 1 else _join_tensor_parallel(parts, tag_dir)


def _read_mp_rank(tag: str, tag_dir: str, mp: int) -> DeepSpeedCheckpoint:
    """The steps for one model-parallel rank: find its model-states file, find and check the ranks'
    optimizer files, load them, lay out the fp32 weights and moments (stage 1-2 or stage 3 layout),
    then the counters."""
    model_file = _model_states_file(tag_dir, mp)
    model, shapes = _load_model(model_file)
    ds_config = model.get("ds_config")
    shards = _optimizer_files(tag_dir, ds_config, mp)
    model_files = _rank_model_files(tag_dir, model_file, shards)
    opts = _load_rank_optimizers(shards)
    per_rank_states = [_base_state(o, shards.stage) for o in opts]
    _check_backed(opts, per_rank_states, shards)
    where = f"{model_file} with {shards.name('*')}"
    rebuild = _stage12_tensors if shards.stage <= 2 else _stage3_tensors
    params, moments = rebuild(opts, per_rank_states, shapes, shards, where)
    step, lr, hyper = _step_and_lr(per_rank_states[0])
    ckpt = _assemble(tag, tag_dir, model, shapes, shards.stage, shards.dp, params, moments, step, lr, hyper,
                     opts[0].get("loss_scaler"), _frozen_params(model, shards.stage, model_files))
    if len(set(shards.counts)) > 1:  # MoE: the groups' names as read, every expert under its global id
        groups: dict[int, list[str]] = {}
        for g, _, names in _flat_groups(shapes, shards.counts, shards.dp, where):
            groups.setdefault(g, []).extend(names)
        ckpt = dataclasses.replace(ckpt, group_names=[groups[g] for g in sorted(groups)])
    return ckpt


def _assemble(tag: str, tag_dir: str, model: dict, shapes: list, stage: int, dp: int, params: Mapping,
              moments: Mapping, step: int | None, lr: float | None, hyper: list, loss_scaler: Any,
              frozen: dict) -> DeepSpeedCheckpoint:
    module = dict(model.get("module") or {})
    return DeepSpeedCheckpoint(
        path=tag_dir, tag=tag, zero_stage=stage, dp_world_size=dp, params=params,
        exp_avg=moments.get("exp_avg"), exp_avg_sq=moments.get("exp_avg_sq"), step=step, lr=lr,
        param_groups=hyper, group_names=[list(g.keys()) for g in shapes],
        global_steps=int(model.get("global_steps") or 0), global_samples=int(model.get("global_samples") or 0),
        skipped_steps=int(model.get("skipped_steps") or 0), lr_scheduler=model.get("lr_scheduler"),
        loss_scale=_loss_scale(loss_scaler), ds_config=model.get("ds_config"), ds_version=model.get("ds_version"),
        client_state={k: v for k, v in model.items() if k not in _DEEPSPEED_KEYS}, module=module,
        buffers={n: module[n] for n in (model.get("buffer_names") or []) if n in module},
        frozen_params=frozen, shared_params=dict(model.get("shared_params") or {}),
        universal_info=model.get("universal_checkpoint_info"), tp_degree=int(model.get("mp_world_size") or 1))


_MP_FILE = re.compile(r"^(?:zero_pp_rank_0_)?mp_rank_(\d+)_model_states\.pt$")


def _mp_degree(tag_dir: str) -> int:
    """How many model-parallel (tensor-parallel) ranks saved this tag: mp_rank_00, mp_rank_01, ..."""
    found = sorted({int(m.group(1)) for m in map(_MP_FILE.match, os.listdir(tag_dir)) if m})
    if found and found != list(range(len(found))):
        missing = sorted(set(range(found[-1] + 1)) - set(found))
        raise DeepSpeedCheckpointError(
            f"{tag_dir} holds model-states files of model-parallel ranks {found} but not of {missing}: every "
            "tensor-parallel rank saves its own slice, so all of them are needed. Copy the missing files from the "
            "nodes that wrote them.")
    return max(1, len(found))


def _model_states_file(tag_dir: str, mp: int = 0) -> str:
    """mp_rank_XX_model_states.pt (stages 1-2) or rank 0's zero_pp_rank_0_mp_rank_XX_... (stage 3)."""
    for name in (f"mp_rank_{mp:02d}_model_states.pt", f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt"):
        if os.path.exists(os.path.join(tag_dir, name)):
            return os.path.join(tag_dir, name)
    raise DeepSpeedCheckpointError(f"{tag_dir} has neither mp_rank_{mp:02d}_model_states.pt nor zero_pp_rank_0_"
                                   f"mp_rank_{mp:02d}_model_states.pt; it is not a DeepSpeed checkpoint tag")


def _load_model(model_file: str) -> tuple[dict, list]:
    """The model-states dict and its `param_shapes` (one OrderedDict per optimizer group)."""
    model = _load_model_states(model_file)
    if not isinstance(model, dict) or "module" not in model:
        raise DeepSpeedCheckpointError(f"{model_file} is not a DeepSpeed model-states file (no 'module' key)")
    shapes = model.get("param_shapes")
    if not shapes:
        raise DeepSpeedCheckpointError(f"{model_file} has no param_shapes: it was saved without a ZeRO optimizer "
                                       "(stage 0); read its 'module' and 'optimizer' with torch_zip.load instead")
    return model, shapes


@dataclass
class _Shards:
    """The ranks' optimizer files of one tag: their name prefix, stage, rank count, rank 0's state."""
    tag_dir: str
    prefix: str          # "bf16_" or ""
    stage: int
    dp: int
    first: dict          # rank 0's optimizer_state_dict
    mp: int = 0          # the model-parallel rank
    counts: list[int] = field(default_factory=list)  # ranks each group is partitioned over (MoE: fewer for experts)

    def name(self, rank: int | str) -> str:
        return _optim_name(self.prefix, rank, self.mp)

    def path(self, rank: int) -> str:
        return os.path.join(self.tag_dir, self.name(rank))


def _optim_name(prefix: str, rank: int | str, mp: int = 0) -> str:
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"


def _optimizer_files(tag_dir: str, ds_config: Any, mp: int = 0) -> _Shards:
    """Rank 0's optimizer file (bf16_ prefixed or not) gives the stage and the rank count; every
    rank's file must be there, and no more."""
    prefixes = ["bf16_", ""] if _bf16_enabled(ds_config) else ["", "bf16_"]
    prefix = next((p for p in prefixes if os.path.exists(os.path.join(tag_dir, _optim_name(p, 0, mp)))), None)
    if prefix is None:
        raise DeepSpeedCheckpointError(f"{_optim_name('', 0, mp)} is missing in {tag_dir} (nor is there a bf16_ one): "
                                       "the ZeRO optimizer shards were not saved, so the fp32 weights cannot be "
                                       "rebuilt")
    first_file = os.path.join(tag_dir, _optim_name(prefix, 0, mp))
    first = _load(first_file)
    opt0 = first.get("optimizer_state_dict") if isinstance(first, dict) else None
    if not isinstance(opt0, dict) or "zero_stage" not in opt0:
        raise DeepSpeedCheckpointError(f"{first_file} is not a ZeRO optimizer file "
                                       "(no optimizer_state_dict.zero_stage)")
    stage = int(opt0["zero_stage"])
    if stage not in (1, 2, 3):
        raise DeepSpeedCheckpointError(f"{first_file}: unsupported zero_stage {stage}")
    count = opt0.get("partition_count")
    counts = [int(c) for c in count] if isinstance(count, (list, tuple)) else [int(count)]
    dp = max(counts)
    if len(set(counts)) != 1 and (stage == 3 or any(c < 1 or dp % c for c in counts)):
        raise DeepSpeedCheckpointError(
            f"{first_file}: param groups are partitioned over different rank counts ({sorted(set(counts))}): an "
            "expert-parallel (MoE) checkpoint, which is read at ZeRO stages 1-2 when every count divides the "
            f"largest; {'at stage 3 ' if stage == 3 else ''}convert it with DeepSpeed's ds_to_universal.py first")
    if len(set(counts)) != 1 and isinstance(ds_config, dict) and ds_config.get("use_data_before_expert_parallelism"):
        raise DeepSpeedCheckpointError(
            f"{first_file}: an MoE checkpoint saved with use_data_before_expert_parallelism, whose ranks hold the "
            "experts in another order than this reader follows (groups.py: expert-parallel rank r % ep_size); "
            "convert it with DeepSpeed's ds_to_universal.py first")
    shards = _Shards(tag_dir, prefix, stage, dp, opt0, mp, counts)
    for rank in range(dp):
        if not os.path.exists(shards.path(rank)):
            raise DeepSpeedCheckpointError(
                f"{shards.name(rank)} is missing in {tag_dir}; the checkpoint was written by {dp} ranks "
                f"(partition_count in {os.path.basename(first_file)}), so files for ranks 0..{dp - 1} must all be "
                "present. Copy it from the node that wrote it, or read another tag.")
    present = [n for n in os.listdir(tag_dir) if n.startswith(prefix + "zero_pp_rank_")
               and n.endswith(f"_mp_rank_{mp:02d}_optim_states.pt")]
    if len(present) != dp:
        raise DeepSpeedCheckpointError(
            f"{tag_dir} holds {len(present)} optimizer files but partition_count says {dp} ranks: the folder mixes "
            "checkpoints (an older save with more ranks was overwritten?); save again into a clean folder")
    return shards


def _rank_model_files(tag_dir: str, model_file: str, shards: _Shards) -> list[str]:
    """Stage 3 saves one model-states file per rank (each with its slice of the frozen parameters)."""
    if shards.stage <= 2:
        return [model_file]
    files = [os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_{shards.mp:02d}_model_states.pt")
             for r in range(shards.dp)]
    for f in files:
        if not os.path.exists(f):
            raise DeepSpeedCheckpointError(
                f"{os.path.basename(f)} is missing in {tag_dir}; the stage-3 checkpoint was written by {shards.dp} "
                "ranks and each saves its own model-states file. Copy it from the node that wrote it.")
    return files


def _load_rank_optimizers(shards: _Shards) -> list[dict]:
    """Every rank's optimizer_state_dict, each checked to come from the same save as rank 0's."""
    opts = [shards.first]
    for rank in range(1, shards.dp):
        loaded = _load(shards.path(rank))
        opt = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
        if not isinstance(opt, dict) or int(opt.get("zero_stage", -1)) != shards.stage:
            raise DeepSpeedCheckpointError(f"{shards.path(rank)} does not match {shards.name(0)} (zero_stage "
                                           "differs or missing): the folder mixes checkpoints")
        opts.append(opt)
    return opts


def _check_backed(opts: list[dict], per_rank_states: list, shards: _Shards) -> None:
    """Each rank's fp32 partitions and moments are backed by its file's bytes (`_within`)."""
    key = "single_partition_of_fp32_groups" if shards.stage <= 2 else "fp32_flat_groups"
    for rank, (o, (states, _, _)) in enumerate(zip(opts, per_rank_states)):
        moment_arrays = [s.get(k) for s in states for k in ("exp_avg", "exp_avg_sq")]
        _within(list(o.get(key) or []) + moment_arrays, shards.path(rank), "fp32 partitions and Adam moments")


_Moments = dict[str, "Tensors | None"]


def _stage12_tensors(opts: list[dict], per_rank_states: list, shapes: list, shards: _Shards,
                     where: str) -> tuple[Tensors, _Moments]:
    """Stages 1-2: each group's flat vector is the ranks' partitions in rank order."""
    fp32 = [o.get("single_partition_of_fp32_groups") for o in opts]
    if any(not isinstance(g, list) or len(g) != len(shapes) for g in fp32):
        raise DeepSpeedCheckpointError(f"{where}: single_partition_of_fp32_groups does not have one entry per "
                                       f"param_shapes group ({len(shapes)}) in every rank's optimizer file")
    counts = shards.counts if len(shards.counts) == len(shapes) else [shards.dp] * len(shapes)
    flat_groups = _flat_groups(shapes, counts, shards.dp, where)
    layout = _stage12_layout(fp32, flat_groups, where)
    moments: _Moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        ranks = []
        for r, (states, _, _) in enumerate(per_rank_states):
            if len(states) != len(shapes) or any(key not in s for s in states):
                ranks = None
                break
            # rigid state is over padded partitions: keep as many elements as the lean fp32 partition
            lean = [np.asarray(fp32[r][g]).size for g in range(len(shapes))]
            if any(np.asarray(s[key]).size < n for s, n in zip(states, lean)):
                raise DeepSpeedCheckpointError(f"{where} ({key}): rank {r}'s {key} is smaller than its fp32 partition")
            ranks.append([np.asarray(s[key]).reshape(-1)[:n] for s, n in zip(states, lean)])
        moments[key] = None if ranks is None else _stage12_table(ranks, flat_groups, layout)
    return _stage12_table(fp32, flat_groups, layout), moments


def _stage3_tensors(opts: list[dict], per_rank_states: list, shapes: list, shards: _Shards,
                    where: str) -> tuple[Tensors, _Moments]:
    """Stage 3: each rank's flat groups hold its slice of every parameter, in param_shapes order."""
    dp = shards.dp
    flat_groups = [o.get("fp32_flat_groups") for o in opts]
    if any(not isinstance(g, list) or not g for g in flat_groups):
        raise DeepSpeedCheckpointError(f"{where}: an optimizer file has no fp32_flat_groups")
    rank_flat = [_Flat(g) for g in flat_groups]
    if len({f.size for f in rank_flat}) != 1:
        raise DeepSpeedCheckpointError(f"{where}: the ranks' fp32_flat_groups differ in size "
                                       f"({[f.size for f in rank_flat]}); the folder mixes checkpoints")
    layout = _stage3_layout(rank_flat[0].size, shapes, dp, where)
    moments: _Moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        ranks = []
        for states, _, _ in per_rank_states:
            if not states or any(key not in s for s in states):
                ranks = None
                break
            ranks.append(_Flat([s[key] for s in states]))
        if ranks is not None and any(r.size != rank_flat[0].size for r in ranks):
            raise DeepSpeedCheckpointError(f"{where}: {key} does not match the fp32 flat groups in size")
        moments[key] = None if ranks is None else _stage3_table(ranks, layout, dp)
    return _stage3_table(rank_flat, layout, dp), moments


def _step_and_lr(rank0_state: tuple[list[dict], list[dict], Any]) -> tuple[int | None, float | None, list[dict]]:
    """The optimizer's step (stored apart, per parameter, or per group) and the first group's lr."""
    states0, hyper, separate_step = rank0_state
    step = _as_int(separate_step)
    if step is None and states0 and "step" in states0[0]:
        step = _as_int(states0[0]["step"])
    if step is None and hyper and "step" in hyper[0]:
        step = _as_int(hyper[0]["step"])
    lr = float(hyper[0]["lr"]) if hyper and "lr" in hyper[0] else None
    return step, lr, hyper


def _frozen_params(model: dict, stage: int, model_files: list[str]) -> dict[str, np.ndarray]:
    """Frozen parameters: whole in the model states (stages 1-2), or one slice per rank's file
    (stage 3, zero_to_fp32.py `_zero3_merge_frozen_params`)."""
    frozen_shapes = model.get("frozen_param_shapes") or {}
    if not frozen_shapes:
        return {}
    if stage <= 2:
        fragments = model.get("frozen_param_fragments") or {}
        return {n: np.asarray(fragments[n]) for n in frozen_shapes if n in fragments}
    rank_models = [model] + [_load_model_states(f) for f in model_files[1:]]
    frozen = {}
    for name, shape in frozen_shapes.items():
        pieces = [np.asarray(m["frozen_param_fragments"][name]).reshape(-1) for m in rank_models]
        frozen[name] = np.concatenate(pieces)[:_numel(shape)].reshape(tuple(shape))
    return frozen


# --------------------------------------------------------------------------- tensor-parallel ranks

def _join_tensor_parallel(parts: list[DeepSpeedCheckpoint], tag_dir: str) -> DeepSpeedCheckpoint:
    """One checkpoint from the model-parallel ranks' own: each parameter joined from its slices when
    it is read, by the rule the run recorded in `universal_checkpoint_info` (what DeepSpeed's
    ds_to_universal.py `merge_tp_slices` follows)."""
    first = parts[0]
    info = first.universal_info
    where = os.path.join(tag_dir, "mp_rank_*_model_states.pt")
    if not isinstance(info, dict):
        raise DeepSpeedCheckpointError(
            f"{where}: the checkpoint was written by {len(parts)} tensor-parallel ranks but records no "
            "universal_checkpoint_info, which says how each parameter's slices join (row- or column-parallel, "
            "replicated, vocabulary-padded); DeepSpeed's AutoTP and Megatron-DeepSpeed write it. Without it no "
            "reader can join them: save from a run that records it, or merge the slices with the model's own code.")
    for mp, part in enumerate(parts[1:], 1):
        if list(part.params) != list(first.params) or (part.step, part.global_steps) != (first.step, first.global_steps):
            raise DeepSpeedCheckpointError(f"{tag_dir}: model-parallel rank {mp} holds other parameters or counters "
                                           "than rank 0: the folder mixes checkpoints")
    joins = {n: _tp_join(n, [shape_of(p.params, n) for p in parts], info, where) for n in first.params}

    def joined(tables: list[Mapping[str, np.ndarray]] | None) -> Tensors | None:
        if tables is None or any(t is None for t in tables):
            return None
        return Tensors({n: j[0] for n, j in joins.items()}, lambda n: joins[n][1]([t[n] for t in tables]))

    frozen = {}
    if first.frozen_params:
        frozen_joins = {n: _tp_join(n, [np.shape(p.frozen_params[n]) for p in parts], info, where)
                        for n in first.frozen_params}
        frozen = {n: j[1]([p.frozen_params[n] for p in parts]) for n, j in frozen_joins.items()}
    return dataclasses.replace(
        first, params=joined([p.params for p in parts]), exp_avg=joined([p.exp_avg for p in parts]),
        exp_avg_sq=joined([p.exp_avg_sq for p in parts]), frozen_params=frozen, tp_degree=len(parts))


def _matching(patterns: Any, name: str) -> Any:
    if isinstance(patterns, dict):
        return next((v for p, v in patterns.items() if isinstance(p, str) and re.match(p, name)), None)
    return next((p for p in patterns or [] if isinstance(p, str) and re.match(p, name)), None)


def _tp_join(name: str, shapes: list[tuple[int, ...]], info: dict,
             where: str) -> tuple[tuple[int, ...], Callable[[list[np.ndarray]], np.ndarray]]:
    """(full shape, join) for one parameter from its per-rank slice shapes."""
    affine = _matching((info.get("affine_map") or {}).get("params") or {}, name)
    if affine is not None:
        return _affine_join(name, shapes, affine, where)
    if _matching(info.get("tp_replicated_parameter_patterns"), name):
        return shapes[0], lambda slices: np.asarray(slices[0], np.float32)
    for key in ("parameter_to_average_patterns", "parameter_with_2_sub_params_cat_dim_0"):
        if _matching(info.get(key), name):
            raise DeepSpeedCheckpointError(f"{where}: parameter {name} is listed under {key}, a join this reader "
                                           "does not make; convert the checkpoint with DeepSpeed's ds_to_universal.py "
                                           "and pass the universal folder")
    if any(_matching(s.get("patterns"), name) for s in info.get("parameter_with_sub_params") or []
           if isinstance(s, dict)):
        raise DeepSpeedCheckpointError(f"{where}: parameter {name} is a fused parameter (parameter_with_sub_params) "
                                       "recorded without an affine_map; convert the checkpoint with DeepSpeed's "
                                       "ds_to_universal.py and pass the universal folder")
    axis = 1 if _matching(info.get("parameter_with_row_parallelism_patterns"), name) else 0
    if any(len(s) <= axis or s[:axis] + s[axis + 1:] != shapes[0][:axis] + shapes[0][axis + 1:] for s in shapes):
        raise DeepSpeedCheckpointError(f"{where}: the slices of {name} ({[list(s) for s in shapes]}) do not join "
                                       f"along dimension {axis}")
    full = list(shapes[0])
    full[axis] = sum(s[axis] for s in shapes)
    rows = None
    if _matching(info.get("vocabulary_parameter_patterns"), name):  # padded vocabulary rows are dropped
        rows = int(info.get("original_vocab_size", full[0]))
        full[0] = min(full[0], rows)
    return tuple(full), lambda slices: np.concatenate(slices, axis=axis)[:rows].astype(np.float32, copy=False)


def _affine_join(name: str, shapes: list[tuple[int, ...]], spec: Any,
                 where: str) -> tuple[tuple[int, ...], Callable[[list[np.ndarray]], np.ndarray]]:
    """DeepSpeed's `affine_map` entry: per rank, pieces copied from the rank's slice (`dest`: offset
    and strides there) to the full tensor (`source`: offset and strides there). Every index is checked
    in bounds before anything is copied; every element of the full tensor must be written."""
    bad = f"{where}: the affine_map entry of {name} "
    try:
        logical = tuple(int(d) for d in spec["logical_shape"])
        ranks = {int(k): v for k, v in spec["ranks"].items()}
        plan = []
        for r, shape in enumerate(shapes):
            if r not in ranks or tuple(int(d) for d in ranks[r]["shard_shape"]) != tuple(shape):
                raise DeepSpeedCheckpointError(bad + f"does not describe rank {r}'s slice {list(shape)}")
            for piece in ranks[r]["pieces"]:
                dims = tuple(int(d) for d in piece["shape"])
                (src, src_strides), (dst, dst_strides) = piece["source"], piece["dest"]
                plan.append((r, dims, _extent(int(src), src_strides, dims, _numel(logical), bad),
                             _extent(int(dst), dst_strides, dims, _numel(shape), bad)))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DeepSpeedCheckpointError(bad + f"is malformed ({type(e).__name__}: {e})") from None

    def join(slices: list[np.ndarray]) -> np.ndarray:
        out = np.empty(_numel(logical), np.float32)
        covered = np.zeros(_numel(logical), bool)
        for r, dims, (src, src_strides), (dst, dst_strides) in plan:
            flat = np.ascontiguousarray(slices[r], np.float32).reshape(-1)
            piece = np.lib.stride_tricks.as_strided(flat[dst:], dims, [s * 4 for s in dst_strides], writeable=False)
            np.lib.stride_tricks.as_strided(out[src:], dims, [s * 4 for s in src_strides])[...] = piece
            np.lib.stride_tricks.as_strided(covered[src:], dims, list(src_strides))[...] = True
        if not covered.all():
            raise DeepSpeedCheckpointError(bad + f"leaves {int((~covered).sum())} elements of the full tensor unwritten")
        return out.reshape(logical)
    return logical, join


def _extent(offset: int, strides: Any, dims: tuple[int, ...], size: int, bad: str) -> tuple[int, list[int]]:
    strides = [int(s) for s in strides]
    if len(strides) != len(dims) or offset < 0 or any(s < 0 for s in strides) or any(d < 0 for d in dims):
        raise DeepSpeedCheckpointError(bad + "has a piece with negative or mismatched offsets or strides")
    if _numel(dims) and offset + sum((d - 1) * s for d, s in zip(dims, strides)) >= size:
        raise DeepSpeedCheckpointError(bad + f"reaches past its tensor's {size} elements")
    return offset, strides


# --------------------------------------------------------------------------- universal folders

def _read_universal(tag: str, tag_dir: str) -> DeepSpeedCheckpoint:
    """What DeepSpeed's ds_to_universal.py writes: `zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt`
    (each the whole parameter, its tensor-parallel and ZeRO slices already joined; stages 1-2 as
    {"param": tensor, "cat_dim": ...}, stage 3 as the bare tensor), `zero/optimizer_state.pt` (param
    groups, loss scaler, stage) and the run's `mp_rank_*_model_states.pt` (names, counters)."""
    zero = os.path.join(tag_dir, "zero")
    model_file = _model_states_file(tag_dir, 0)
    model, shapes = _load_model(model_file)
    names = [n for g in shapes for n in g]
    for n in names:
        if not n or n in (".", "..") or "/" in n or "\\" in n or "\0" in n:
            raise DeepSpeedCheckpointError(f"{model_file}: parameter name {n!r} is not a folder name under {zero}")
    opt_file = os.path.join(zero, "optimizer_state.pt")
    opt = _load(opt_file)
    if not isinstance(opt, dict):
        raise DeepSpeedCheckpointError(f"{opt_file} is not the optimizer state ds_to_universal.py writes")
    stage = int(opt.get("zero_stage", 1))

    def tensor(name: str, state: str) -> np.ndarray:
        path = os.path.join(zero, name, f"{state}.pt")
        if not os.path.isfile(path):
            raise DeepSpeedCheckpointError(
                f"{path} is missing: ds_to_universal.py writes fp32.pt (and exp_avg.pt, exp_avg_sq.pt) for every "
                f"parameter of {os.path.basename(model_file)}'s param_shapes; convert again, or copy it")
        entry = _load(path)
        value = entry.get("param") if isinstance(entry, dict) else entry
        if not isinstance(value, np.ndarray):
            raise DeepSpeedCheckpointError(f"{path} holds no tensor (expected a tensor or {{'param': tensor, ...}})")
        _within([value], path, "tensor")
        return value

    recorded = {n: tuple(int(d) for d in sh) for g in shapes for n, sh in g.items()}

    def shape(name: str, value: np.ndarray) -> tuple[int, ...]:
        # stage 3's merge_zero3_slices saves the parameter flat: its shape is the recorded one
        flat = value.ndim == 1 and value.size == _numel(recorded[name]) and value.shape != recorded[name]
        return recorded[name] if flat else value.shape

    def table(state: str) -> Tensors:
        def produce(n: str) -> np.ndarray:
            value = tensor(n, state)
            return np.array(value, dtype=np.float32).reshape(shape(n, value))
        return Tensors({n: shape(n, tensor(n, state)) for n in names}, produce)

    have = {s: [os.path.isfile(os.path.join(zero, n, f"{s}.pt")) for n in names] for s in ("exp_avg", "exp_avg_sq")}
    moments = {s: table(s) if all(h) else None for s, h in have.items()}
    for s, h in have.items():
        if any(h) and not all(h):
            missing = [n for n, x in zip(names, h) if not x]
            raise DeepSpeedCheckpointError(
                f"{os.path.join(zero, missing[0], f'{s}.pt')} is missing ({s}.pt is there for the other parameters; "
                f"missing for {missing[:4]}): the conversion did not finish or the copy is partial; run "
                f"ds_to_universal.py on the original checkpoint again, or copy the missing files")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.get("param_groups") or [] if isinstance(g, dict)]
    step_file = os.path.join(zero, names[0], "step.pt") if names else ""
    step = _as_int(_load(step_file)) if step_file and os.path.isfile(step_file) else None
    if step is None and isinstance(opt.get("optimizer_state_dict"), dict):  # stage 3: no step.pt
        step = _step_and_lr((_base_state(opt, 3)[0], hyper, None))[0]
    if step is None and hyper and "step" in hyper[0]:
        step = _as_int(hyper[0]["step"])
    lr = float(hyper[0]["lr"]) if hyper and "lr" in hyper[0] else None
    dp = int(model.get("dp_world_size") or 1)
    model_files = [model_file] if stage <= 2 else [
        os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(dp)]
    frozen = _frozen_params(model, stage, model_files) if all(map(os.path.isfile, model_files)) else {}
    ckpt = _assemble(tag, tag_dir, model, shapes, stage, dp, table("fp32"), moments, step, lr, hyper,
                     opt.get("loss_scaler"), frozen)
    return dataclasses.replace(ckpt, layout="universal")


# --------------------------------------------------------------------------- writing

_PRECISIONS = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}

# DynamicLossScaler's attributes in the order its __init__ sets them (loss_scaler.py), DeepSpeed's
# defaults (initial_scale_power 16, loss_scale_window 1000, hysteresis 2, min_loss_scale 1).
_DYNAMIC_DEFAULTS = {"cur_scale": 65536.0, "dynamic": True, "cur_iter": 0, "last_overflow_iter": -1,
                     "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1, "delayed_shift": 2,
                     "cur_hysteresis": 2, "consecutive_hysteresis": False, "raise_error_at_min_scale": True}


def _loss_scaler_record(loss_scaler: Mapping[str, Any] | PickledObject | None, precision: str) -> PickledObject:
    if isinstance(loss_scaler, PickledObject):
        return loss_scaler
    given = dict(loss_scaler or {})
    kind = given.pop("type", None)
    if kind is None:
        dynamic_only = set(_DYNAMIC_DEFAULTS) - {"cur_scale", "dynamic"}
        dynamic = (bool(given["dynamic"]) if "dynamic" in given
                   else precision == "fp16" or bool(dynamic_only & set(given)))
        kind = "DynamicLossScaler" if dynamic else "LossScaler"
    if kind == "DynamicLossScaler":
        state = dict(_DYNAMIC_DEFAULTS)
        state.update(given)
        dtype = state.get("dtype", "float16")
        state["dtype"] = dtype if isinstance(dtype, TorchDtype) else TorchDtype(str(dtype))
        state["dynamic"] = True
    elif kind == "LossScaler":
        state = {"cur_scale": float(given.pop("cur_scale", 1.0)), "dynamic": False}
        state.update({k: v for k, v in given.items() if k != "dynamic"})
    else:
        raise ValueError(f"loss_scaler type must be LossScaler or DynamicLossScaler, got {kind!r}")
    return PickledObject.make(_LOSS_SCALER_MODULE, kind, state)


def _adam_group(lr: float, betas: Sequence[float], eps: float, weight_decay: float, step: int, index: int) -> dict:
    # deepspeed/ops/adam/fused_adam.py defaults (lr, bias_correction, betas, eps, weight_decay) plus
    # the group 'step' FusedAdam adds; torch's Optimizer.state_dict puts 'params' last.
    return {"lr": float(lr), "bias_correction": True, "betas": tuple(float(b) for b in betas), "eps": float(eps),
            "weight_decay": float(weight_decay), "step": int(step), "params": [index]}


def write_checkpoint(out_dir: str | os.PathLike, tag: str, params: Mapping[str, np.ndarray],
                     exp_avg: Mapping[str, np.ndarray] | None = None,
                     exp_avg_sq: Mapping[str, np.ndarray] | None = None, *,
                     stage: int, dp: int, step: int, global_steps: int, global_samples: int, skipped_steps: int,
                     lr: float, lr_scheduler: Mapping[str, Any] | None,
                     loss_scaler: Mapping[str, Any] | PickledObject | None = None, ds_config: Any = None,
                     client_state: Mapping[str, Any] | None = None,
                     param_groups: Sequence[Sequence[str]] | None = None, betas: Sequence[float] = (0.9, 0.999),
                     eps: float = 1e-8, weight_decay: float = 0.0, precision: str = "fp32",
                     buffers: Mapping[str, np.ndarray] | None = None, save_latest: bool = True,
                     ds_version: str = DS_VERSION) -> str:
    """Write `out_dir/tag/` exactly as DeepSpeed's save_checkpoint would for a ZeRO `stage` run on `dp`
    data-parallel ranks with FusedAdam, and point `out_dir/latest` at it. Returns the tag folder.

    `params` are the fp32 masters (any float dtype, cast to fp32), in flattening order; `param_groups`
    splits their names into optimizer groups (default: one group). `precision` sets the module
    weights' dtype, the default loss scaler (fp16: dynamic) and the "bf16_" optimizer-file prefix.
    `loss_scaler` is a dict of the scaler's fields (plus optional "type") or a record read earlier.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(_PRECISIONS)}, got {precision!r}")
    names = list(params)
    groups = [list(g) for g in param_groups] if param_groups is not None else [names]
    flat_names = [n for g in groups for n in g]
    if sorted(flat_names) != sorted(names) or len(set(flat_names)) != len(flat_names):
        raise ValueError("param_groups must list every parameter name exactly once")
    masters = {n: np.asarray(params[n], dtype=np.float32) for n in names}
    moments = {}
    for key, values in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if values is None:
            continue
        if set(values) != set(names):
            raise ValueError(f"{key} must have exactly the names of params")
        moments[key] = {n: np.asarray(values[n], dtype=np.float32) for n in names}
        for n in names:
            if moments[key][n].shape != masters[n].shape:
                raise ValueError(f"{key}[{n!r}] has shape {moments[key][n].shape}, params has {masters[n].shape}")
    if ds_config is None:
        ds_config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
                     "fp16": {"enabled": precision == "fp16"}}
    client_state = dict(client_state or {})
    clash = sorted(set(client_state) & _DEEPSPEED_KEYS)
    if clash:
        raise ValueError(f"client_state keys {clash} are DeepSpeed's own checkpoint keys; rename them")

    tag_dir = os.path.join(os.fspath(out_dir), str(tag))
    os.makedirs(tag_dir, exist_ok=True)
    module_dtype = _PRECISIONS[precision]
    buffers = {k: np.asarray(v) for k, v in (buffers or {}).items()}
    zero_stage = PickledEnum(*_ZERO_STAGE_ENUM, stage)
    scaler = _loss_scaler_record(loss_scaler, precision)
    clip = float(ds_config.get("gradient_clipping", 0.0)) if isinstance(ds_config, dict) else 0.0
    hyper = [_adam_group(lr, betas, eps, weight_decay, step, g) for g in range(len(groups))]

    def model_states(frozen_fragments: Any) -> dict:
        if stage <= 2:
            module = OrderedDict((n, masters[n].astype(module_dtype)) for n in names)
        else:  # ZeRO-3 weights live in the shards; the module holds empty placeholders (free_param)
            module = OrderedDict((n, np.zeros((0,), module_dtype)) for n in names)
        module.update(buffers)
        # engine.py `_common_checkpoint_state`, in its key order
        state = {
            "module": module, "buffer_names": list(buffers), "optimizer": None,
            "param_shapes": [OrderedDict((n, TorchSize(masters[n].shape)) for n in g) for g in groups],
            "frozen_param_shapes": None if stage == 1 else OrderedDict(),
            "shared_params": {}, "frozen_param_fragments": frozen_fragments,
            "lr_scheduler": dict(lr_scheduler) if lr_scheduler is not None else None,
            "data_sampler": None, "random_ltd": None, "sparse_tensor_module_names": set(),
            "skipped_steps": int(skipped_steps), "global_steps": int(global_steps),
            "global_samples": int(global_samples), "dp_world_size": dp, "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": ds_config, "ds_version": ds_version,
        }
        state.update(client_state)
        return state

    if stage <= 2:
        torch_zip.save(model_states(None if stage == 1 else OrderedDict()),
                       os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    else:
        for rank in range(dp):
            torch_zip.save(model_states(OrderedDict()),
                           os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))

    prefix = "bf16_" if precision == "bf16" else ""
    for rank in range(dp):
        if stage <= 2:
            parts = _stage12_rank(groups, masters, moments, dp, rank, step, hyper)
            # stage_1_and_2.py `state_dict`, in its key order (rigid: elastic_checkpoint defaults to off)
            opt = {"loss_scaler": scaler, "dynamic_loss_scale": bool(scaler.get("dynamic", False)),
                   "overflow": False, "clip_grad": clip, "base_optimizer_state": parts["base_optimizer_state"],
                   "single_partition_of_fp32_groups": parts["single_partition_of_fp32_groups"],
                   "zero_stage": zero_stage, "group_paddings": parts["group_paddings"],
                   "partition_count": parts["partition_count"], "ds_version": ds_version,
                   "param_slice_mappings": parts["param_slice_mappings"]}
        else:
            flat, states = _stage3_rank(groups, masters, moments, dp, rank, step)
            opt = {"zero_stage": zero_stage, "loss_scaler": scaler,
                   "dynamic_loss_scale": bool(scaler.get("dynamic", False)), "overflow": False,
                   "partition_count": dp, "optimizer_state_dict": {"state": states, "param_groups": hyper},
                   "fp32_flat_groups": flat}
        torch_zip.save({"optimizer_state_dict": opt, "ds_config": ds_config, "ds_version": ds_version},
                       os.path.join(tag_dir, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    if save_latest:
        with open(os.path.join(os.fspath(out_dir), "latest"), "w", encoding="utf-8") as f:
            f.write(str(tag))  # engine.py writes the bare tag
    return tag_dir


def _adam_state(step: int, moments: Mapping[str, np.ndarray]) -> dict:
    return {"step": int(step), **moments} if moments else {}


def _stage12_rank(groups: list[list[str]], masters: dict, moments: dict, dp: int, rank: int, step: int,
                  hyper: list[dict]) -> dict:
    fp32, paddings, mappings, states = [], [], [], {}
    for g, names in enumerate(groups):
        numel = sum(masters[n].size for n in names)
        align = 2 * dp  # stage_1_and_2.py: nccl_start_alignment_factor (2) * dp world size
        part = math.ceil(numel / align) * align // dp
        start = rank * part
        lean = max(0, min(part, numel - start))
        paddings.append(part - lean)

        def partition(values: dict) -> np.ndarray:
            flat = np.concatenate([values[n].reshape(-1) for n in names]) if names else np.zeros(0, np.float32)
            out = np.zeros(part, np.float32)
            out[:lean] = flat[start:start + lean]
            return out

        fp32.append(partition(masters)[:lean].copy())  # `_get_groups_without_padding`
        states[g] = _adam_state(step, {k: partition(v) for k, v in moments.items()})
        mapping, offset = OrderedDict(), 0
        for n in names:  # tensor_fragment.py `get_hp_fragment_mapping`: the overlap with this partition
            lo, hi = max(offset, start), min(offset + masters[n].size, start + part)
            if lo < hi:
                mapping[n] = PickledObject.make("deepspeed.utils.tensor_fragment", "fragment_address",
                                                {"numel": hi - lo, "start": lo - start})
            offset += masters[n].size
        mappings.append(mapping)
    return {"base_optimizer_state": {"state": states, "param_groups": hyper},
            "single_partition_of_fp32_groups": fp32, "group_paddings": paddings,
            "partition_count": [dp] * len(groups), "param_slice_mappings": mappings}


def _stage3_rank(groups: list[list[str]], masters: dict, moments: dict, dp: int, rank: int,
                 step: int) -> tuple[list[np.ndarray], dict]:
    def shard(values: dict, names: list[str]) -> np.ndarray:
        pieces = []
        for n in names:
            flat = values[n].reshape(-1)
            part = math.ceil(flat.size / dp)
            piece = np.zeros(part, np.float32)
            chunk = flat[rank * part:(rank + 1) * part]
            piece[:chunk.size] = chunk
            pieces.append(piece)
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    flat = [shard(masters, names) for names in groups]
    states = {g: _adam_state(step, {k: shard(v, names) for k, v in moments.items()}) for g, names in enumerate(groups)}
    return flat, states


def write_fp32_state_dict(path: str | os.PathLike, params: Mapping[str, np.ndarray]) -> str:
    """Write what `zero_to_fp32.py` writes: a torch state dict of fp32 tensors (`pytorch_model.bin`
    when `path` is a folder). Tensors are cast and written one at a time. Returns the file path."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "pytorch_model.bin")

    def lazy(value: np.ndarray) -> LazyArray:
        return LazyArray(np.shape(value), np.float32, lambda: np.asarray(value, dtype=np.float32))

    torch_zip.save(OrderedDict((name, lazy(value)) for name, value in params.items()), path)
    return path
