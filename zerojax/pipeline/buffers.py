"""Where a pipeline's parameters live: one flat row per stage, stacked and sharded over `stage`.

Stages are heterogeneous (an embedding on the first, an LM head on the last), yet all stages run
one SPMD program. So each stage's parameters are raveled into one vector, padded to the longest
stage's length `width`, and the S vectors are stacked into an `[S, width]` array with
`PartitionSpec("stage", ...)`: device (s, d) holds row s only. Inside the program a stage's
branch of `lax.switch` slices its own layers' parameters out of the row at static offsets.

What each device really holds is therefore `width` elements per parameter-shaped buffer - the
largest stage's parameters, padded up to a multiple of the data-parallel size - not the model;
the `parameters` partition keeps the padding small. ZeRO then shards the row's second dimension
over `data` exactly as it shards any array (layout.py), so ZeRO-1/2/3 compose unchanged.

A tied group (TiedLayerSpec) is stored once, in the row of the first stage that uses it (its
owner). Other stages that use it receive it at the start of the step and send its gradient back at
the end (executor.py), so the optimizer sees each tied parameter once: no duplicated master copy or
optimizer state, and the global gradient norm counts it once, as the unpipelined model does.

Padding stays zero: its gradient is zero, so elementwise optimizers never move it. Per-tensor
optimizers (Lamb's trust ratio) would see one tensor per row instead of one per parameter, so
pipelines reject them (engine check).

Expert weights (leaves a layer annotated with the logical name `expert`, the stacked experts of a
mixture-of-experts layer) live in a second array, `[S, ep, width]` (`ExpertRows`): device (s, e) of
the `expert` axis holds slice e of stage s's expert leaves along their expert dimension. The two
arrays are two ZeRO groups: the first is sharded and reduced over every data-parallel device, the
second over the expert-data-parallel ones only (DeepSpeed's expert-data-parallel group), which one
flat row could not be. A model with expert leaves has the second array at any expert size (`ep` 1
included), so a checkpoint's arrays depend on the model, not on the mesh.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.core.mesh import EXPERT
from zerojax.core.names import dotted
from zerojax.errors import ConfigError
from zerojax.pipeline.module import Partition, PipelineModule

ROWS = "stages"                # the stage rows: [S, width], or [S, tensor, width]
EXPERT_ROWS = "expert_stages"  # the expert rows: [S, ep, width]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One logical parameter entry inside a stage row: its leaves' shapes as stored there (one tensor
    slice of each leaf that `dims` splits), and the dimension each is split along (None: whole)."""
    key: str
    offset: int
    size: int
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int | None, ...] = ()

    def read(self, row: jax.Array, dtype: Any = None) -> Any:
        return self.unflatten(jax.lax.slice_in_dim(row, self.offset, self.offset + self.size), dtype)

    def unflatten(self, flat: jax.Array, dtype: Any = None) -> Any:
        leaves, start = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            leaf = flat[start:start + n].reshape(shape)
            leaves.append(leaf if dtype is None else leaf.astype(dtype))
            start += n
        return jax.tree.unflatten(self.treedef, leaves)

    def flatten(self, params: Any, dtype: Any, block: Any = 0, tensor: int = 1) -> jax.Array:
        """The entry's leaves raveled; with `tensor` > 1, tensor slice `block` (may be traced) of each."""
        leaves = jax.tree.leaves(params)
        if not leaves:
            return jnp.zeros((0,), dtype)
        dims = self.dims or (None,) * len(leaves)
        return jnp.concatenate([jnp.ravel(_slice(x, d, block, tensor)).astype(dtype) for x, d in zip(leaves, dims)])

    def tree_dims(self) -> Any:
        """The split dimensions as a tree shaped like the entry (for the tensor-parallel evaluator)."""
        return jax.tree.unflatten(self.treedef, list(self.dims or (None,) * len(self.shapes)))


def _slice(x: Any, dim: int | None, block: Any, tensor: int) -> Any:
    if dim is None or tensor == 1:
        return x
    n = x.shape[dim] // tensor
    return jax.lax.dynamic_slice_in_dim(x, block * n, n, dim)


@dataclasses.dataclass(frozen=True)
class Tied:
    """A tied group: stored by `owner`, received by `users` (other stages that run it)."""
    key: str
    owner: int
    users: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """The `[S, size, width]` storage of the expert leaves: per stage device, its entries' expert
    leaves, slice e (of `size`, the expert axis) along each leaf's expert dimension in row [d, e]."""
    size: int
    width: int
    slots: tuple[dict[str, Slot], ...]

    def pack_device(self, device: int, params: dict[str, Any], dtype: Any, block: Any = 0) -> jax.Array:
        return _pack(self.slots[device], self.width, params, dtype, block, self.size)

    def pack(self, params: dict[str, Any], dtype: Any = jnp.float32) -> jax.Array:
        return jnp.stack([jnp.stack([self.pack_device(d, params, dtype, e) for e in range(self.size)])
                          for d in range(len(self.slots))])


@dataclasses.dataclass(frozen=True, eq=False)
class StageRows:
    """The `[S, width]` storage of a partitioned PipelineModule.

    With `chunks` > 1 (interleaved schedule) the model is cut into S * chunks virtual stages and
    device d runs virtual stages d, d + S, d + 2S, ...: its row holds all of their parameters.
    """
    module: PipelineModule
    partition: Partition           # over the S * chunks virtual stages
    stages: int                    # devices along the `stage` axis
    width: int
    slots: tuple[dict[str, Slot], ...]   # per device: the entries stored in its row
    tied: tuple[Tied, ...]
    tensor: int = 1                      # tensor slices per stage: rows are [S, tensor, width] when > 1
    experts: ExpertRows | None = None    # the expert leaves' rows, for a model that has expert leaves

    @property
    def arrays(self) -> tuple[str, ...]:
        """The names of the arrays the parameters live in (`ROWS`, and `EXPERT_ROWS` with expert leaves)."""
        return (ROWS,) if self.experts is None else (ROWS, EXPERT_ROWS)

    @property
    def chunks(self) -> int:
        return self.partition.num_stages // self.stages

    @property
    def virtual(self) -> int:
        return self.partition.num_stages

    def device(self, virtual_stage: int) -> int:
        return virtual_stage % self.stages

    @property
    def stored(self) -> tuple[int, ...]:
        """Parameters (unpadded) stored per device: its row, and its slice of the expert leaves."""
        dense = [sum(s.size for s in slots.values()) for slots in self.slots]
        if self.experts is not None:
            dense = [n + sum(s.size for s in e.values()) for n, e in zip(dense, self.experts.slots)]
        return tuple(dense)

    def owner(self, key: str) -> int:
        return next(d for d, slots in enumerate(self.slots) if key in slots)

    def slot(self, key: str) -> Slot:
        return self.slots[self.owner(key)][key]

    def stage_keys(self, virtual_stage: int) -> tuple[str, ...]:
        """Logical entries the virtual stage's layers read (stored or received)."""
        keys = (self.module.layers[i].param_key for i in self.partition.layers(virtual_stage))
        return tuple(dict.fromkeys(k for k in keys if k is not None))

    def read_stage(self, virtual_stage: int, rows: dict[str, jax.Array], tied_in: dict[str, jax.Array],
                   dtype: Any = None) -> dict[str, Any]:
        """The logical parameters a virtual stage runs with: from its device's rows (`{ROWS: row}`, and
        `EXPERT_ROWS`: this device's expert slice), or received (tied)."""
        device = self.device(virtual_stage)
        mine = self.slots[device]
        experts = {} if self.experts is None else self.experts.slots[device]
        out = {}
        for key in self.stage_keys(virtual_stage):
            if key in mine:
                out[key] = mine[key].read(rows[ROWS], dtype)
                if key in experts:
                    out[key] = _merge(out[key], experts[key].read(rows[EXPERT_ROWS], dtype))
            else:
                out[key] = self.slot(key).unflatten(tied_in[key], dtype)
        return out

    def whole_ranges(self) -> list[list[tuple[int, int]]]:
        """Per device row, the [start, end) ranges of leaves kept whole (copied into every tensor slice)."""
        out = []
        for slots in self.slots:
            ranges: list[tuple[int, int]] = []
            for slot in sorted(slots.values(), key=lambda sl: sl.offset):
                start = slot.offset
                for shape, dim in zip(slot.shapes, slot.dims or (None,) * len(slot.shapes)):
                    end = start + math.prod(shape)
                    if dim is None:
                        if ranges and ranges[-1][1] == start:
                            ranges[-1] = (ranges[-1][0], end)
                        else:
                            ranges.append((start, end))
                    start = end
            out.append(ranges)
        return out

    def norm(self, grads: Any) -> jax.Array:
        """The global L2 norm of `{rows: [S, tensor, width]}` gradients counting each whole leaf once:
        its copies in tensor slices 1.. are left out (Megatron's rule for tensor-duplicated parameters).
        The mask is computed from each row's whole ranges, never stored."""
        (g,) = jax.tree.leaves(grads)
        ranges = self.whole_ranges()
        k = max(1, max(len(r) for r in ranges))
        bounds = np.full((self.stages, 2 * k), self.width + 1, np.int32)
        for d, rs in enumerate(ranges):
            for i, (a, b) in enumerate(rs):
                bounds[d, 2 * i:2 * i + 2] = (a, b)
        pos = jnp.arange(self.width, dtype=jnp.int32)
        inside = jax.vmap(lambda b: jnp.searchsorted(b, pos, side="right") % 2 == 1)(jnp.asarray(bounds))
        first = (jnp.arange(self.tensor) == 0)[None, :, None]
        counted = ~inside[:, None, :] | first  # split leaves in every slice, whole ones in slice 0
        sq = jnp.square(g.astype(jnp.float32))
        return jnp.sqrt(jnp.sum(jnp.where(counted, sq, 0.0)))

    def stage_dims(self, virtual_stage: int) -> dict[str, Any]:
        """Per entry the virtual stage reads, its leaves' tensor-split dimensions (as `read_stage` gives them)."""
        return {key: self.slot(key).tree_dims() for key in self.stage_keys(virtual_stage)}

    def pack_device(self, device: int, params: dict[str, Any], dtype: Any, block: Any = 0) -> jax.Array:
        """Device `device`'s row (tensor slice `block`) from logical entries (only those it stores are read)."""
        return _pack(self.slots[device], self.width, params, dtype, block, self.tensor)

    def pack(self, params: dict[str, Any], dtype: Any = jnp.float32) -> dict[str, jax.Array]:
        """Logical parameters -> `{ROWS: [S, width]}` (`[S, tensor, width]` with tensor slices; and
        `EXPERT_ROWS: [S, ep, width]` with expert leaves), traced or on one device."""
        if self.tensor == 1:
            rows = jnp.stack([self.pack_device(d, params, dtype) for d in range(self.stages)])
        else:
            rows = jnp.stack([jnp.stack([self.pack_device(d, params, dtype, t) for t in range(self.tensor)])
                              for d in range(self.stages)])
        return {ROWS: rows} if self.experts is None else {ROWS: rows, EXPERT_ROWS: self.experts.pack(params, dtype)}

    def unpack(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """The arrays of `pack` (any placement) -> logical parameters, as numpy arrays (slices joined)."""
        out = _unpack(self.slots, arrays[ROWS])
        if self.experts is not None:
            for key, part in _unpack(self.experts.slots, arrays[EXPERT_ROWS]).items():
                out[key] = _merge(out.get(key, {}), part)
        return {k: out[k] for k in self.module.abstract_params()}

    def manifest(self) -> dict[str, dict[str, Any]]:
        """Where each logical parameter leaf sits in the rows, by dotted name (JSON-able).

        Checkpoints carry it, so `zerojax export` writes the logical parameters of a pipelined run
        (not its padded rows) without the PipelineModule at hand. An expert leaf's entry names its
        array (`"array": EXPERT_ROWS`) and the dimension its slices join along (`expert_dim`).
        """
        found = _entries(self.slots, self.tensor, "tensor_dim")
        if self.experts is not None:
            found.update({name: {**e, "array": EXPERT_ROWS}
                          for name, e in _entries(self.experts.slots, self.experts.size, "expert_dim").items()})
        order = [dotted(path, key) for key, entry in self.module.abstract_params().items()
                 for path, _ in jax.tree_util.tree_flatten_with_path(entry)[0]]
        return {name: found[name] for name in order}

    def table(self) -> str:
        """The partition, plus what each device stores."""
        lines = [self.partition.table()]
        if self.chunks > 1:
            lines.append(f"device d runs virtual stages d, d+{self.stages}, ... ({self.chunks} chunks each)")
        lines.append("stored per device: " + ", ".join(f"{n:,}" for n in self.stored)
                     + f" parameters; row width {self.width:,} (padded to the largest)")
        if self.experts is not None:
            per = [sum(s.size for s in e.values()) for e in self.experts.slots]
            lines.append(f"expert leaves per device (1/{self.experts.size} of each stage's): "
                         + ", ".join(f"{n:,}" for n in per) + f"; expert row width {self.experts.width:,}")
        for t in self.tied:
            where = ", ".join(str(u) for u in t.users) or "no other stage"
            lines.append(f"tied {t.key!r}: stored on stage {t.owner}, also used by {where}")
        return "\n".join(lines)


def _pack(slots: dict[str, Slot], width: int, params: dict[str, Any], dtype: Any, block: Any, count: int
          ) -> jax.Array:
    """One device's row: its slots' leaves (slice `block` of `count` of each split leaf), zero-padded to `width`."""
    ordered = sorted(slots.values(), key=lambda sl: sl.offset)
    pieces = [sl.flatten(_part(params[sl.key], sl), dtype, block, count) for sl in ordered]
    pieces.append(jnp.zeros((width - sum(sl.size for sl in ordered),), dtype))
    return jnp.concatenate(pieces)


def _unpack(slots: tuple[dict[str, Slot], ...], rows: Any) -> dict[str, Any]:
    """`[S, width]` or `[S, slices, width]` rows -> each slot's (partial) entry, slices joined along its dims."""
    rows = np.asarray(jax.device_get(rows))
    if rows.ndim == 2:
        rows = rows[:, None]
    out = {}
    for d, per_device in enumerate(slots):
        for key, slot in per_device.items():
            pieces = [jax.tree.leaves(slot.unflatten(rows[d, t, slot.offset:slot.offset + slot.size]))
                      for t in range(rows.shape[1])]
            leaves = [np.concatenate([p[i] for p in pieces], axis=dim) if dim is not None else pieces[0][i]
                      for i, dim in enumerate(slot.dims or (None,) * len(slot.shapes))]
            out[key] = jax.tree.unflatten(slot.treedef, [np.asarray(x) for x in leaves])
    return out


def _entries(slots: tuple[dict[str, Slot], ...], count: int, dim_key: str) -> dict[str, dict[str, Any]]:
    """The manifest entries of one array's slots: row, offset and shape of each leaf; a leaf split into
    `count` slices along a dimension is stored `block`-shaped in each [d, t] row, joined along `dim_key`."""
    out = {}
    for d, per_device in enumerate(slots):
        for key, slot in sorted(per_device.items(), key=lambda kv: kv[1].offset):
            skeleton = jax.tree.unflatten(slot.treedef, range(len(slot.shapes)))
            start = slot.offset
            for (path, _), shape, dim in zip(jax.tree_util.tree_flatten_with_path(skeleton)[0], slot.shapes,
                                             slot.dims or (None,) * len(slot.shapes)):
                entry: dict[str, Any] = {"row": d, "offset": start, "shape": list(shape)}
                if dim is not None:
                    whole = [s * count if i == dim else s for i, s in enumerate(shape)]
                    entry.update({"shape": whole, "block": list(shape), dim_key: dim})
                out[dotted(path, key)] = entry
                start += math.prod(shape)
    return out


def _part(entry: Any, slot: Slot) -> Any:
    """The leaves of a logical entry that `slot` stores (all of them, or its dense or expert part)."""
    if jax.tree.structure(entry) == slot.treedef:
        return entry
    skeleton = jax.tree.unflatten(slot.treedef, range(len(slot.shapes)))
    paths = {p for p, _ in jax.tree_util.tree_flatten_with_path(skeleton)[0]}
    return _select(entry, lambda path: path in paths)


def _select(tree: dict, keep: Any, prefix: tuple = ()) -> dict:
    """The nested dict `tree` with only the leaves whose key path `keep` accepts (empty dicts dropped)."""
    out = {}
    for k, v in tree.items():
        path = (*prefix, jax.tree_util.DictKey(k))
        if isinstance(v, dict):
            sub = _select(v, keep, path)
            if sub:
                out[k] = sub
        elif keep(path):
            out[k] = v
    return out


def _merge(a: Any, b: Any) -> Any:
    """Two nested dicts with disjoint leaves as one (an entry's dense and expert parts)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if k in out and isinstance(v, dict) else v
    return out


def expert_dims(module: PipelineModule) -> dict[str, tuple[int | None, ...]]:
    """Per logical entry with expert leaves, each leaf's expert dimension (the one its layer named
    `expert`; None for the entry's other leaves)."""
    out = {}
    for key, axes in module.logical_axes().items():
        flat = jax.tree.leaves(axes, is_leaf=lambda x: x is None or isinstance(x, tuple))
        dims = tuple(None if x is None or EXPERT not in x else list(x).index(EXPERT) for x in flat)
        if any(d is not None for d in dims):
            out[key] = dims
    return out


def _slot(key: str, entry: Any, offset: int, split: tuple[int | None, ...], count: int) -> Slot:
    """The slot of `entry`'s leaves (a whole entry, or its dense or expert part), each leaf split into
    `count` slices along its `split` dimension (None: whole)."""
    leaves, treedef = jax.tree.flatten(entry)
    split = split or (None,) * len(leaves)
    shapes = tuple(tuple(s // count if count > 1 and i == split[j] else s for i, s in enumerate(x.shape))
                   for j, x in enumerate(leaves))
    return Slot(key, offset, sum(math.prod(sh) for sh in shapes), treedef, shapes, split if count > 1 else ())


def stage_rows(module: PipelineModule, num_stages: int, chunks: int = 1, align: int = 1, tensor: int = 1,
               dims: dict[str, tuple[int | None, ...]] | None = None, expert: int = 1,
               expert_align: int = 1) -> StageRows:
    """Lay out the module's parameters over `num_stages` devices; `width` is a multiple of `align`.

    A parameter entry is stored by the device of the first virtual stage (in layer order) that
    uses it; a tied entry used by other devices too is sent to them (see executor.py). With
    `tensor` > 1, `dims[key]` names each leaf's split dimension (None: whole): each stage has one row
    per tensor slice, holding that slice of every split leaf and a copy of the whole ones. Expert
    leaves go to the expert rows (`ExpertRows`), `expert` slices of each, width a multiple of
    `expert_align`.
    """
    dims = dims or {}
    edims = expert_dims(module)
    if edims and tensor > 1:
        raise ConfigError(f"mesh.tensor: {tensor} with a pipelined mixture-of-experts model: the expert rows of "
                          f"pipeline stages are not tensor-sliced yet; set mesh.tensor: 1 (or mesh.stage: 1, where "
                          f"the tensor and expert axes compose)")
    tied_experts = sorted(set(edims) & set(module.tied_keys))
    if tied_experts:
        raise ConfigError(f"PipelineModule: tied layers {tied_experts} hold expert weights; a tied group is sent "
                          f"whole between stages, so tie only layers without `expert`-annotated parameters")
    part = module.partition(num_stages * chunks)
    abstract = module.abstract_params()
    slots: list[dict[str, Slot]] = [{} for _ in range(num_stages)]
    eslots: list[dict[str, Slot]] = [{} for _ in range(num_stages)]
    offsets, eoffsets = [0] * num_stages, [0] * num_stages
    owner: dict[str, int] = {}
    users: dict[str, list[int]] = {}
    for v in range(num_stages * chunks):
        d = v % num_stages
        for i in part.layers(v):
            key = module.layers[i].param_key
            if key is None:
                continue
            if key in owner:
                if owner[key] != d and d not in users.setdefault(key, []):
                    users[key].append(d)
                continue
            owner[key] = d
            entry = abstract[key]
            if key in edims:
                flags = [e is not None for e in edims[key]]
                paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(entry)[0]]
                chosen = {p for p, f in zip(paths, flags) if f}
                eslots[d][key] = _slot(key, _select(entry, lambda p: p in chosen), eoffsets[d],
                                       tuple(e for e in edims[key] if e is not None), expert)
                eoffsets[d] += eslots[d][key].size
                entry = _select(entry, lambda p: p not in chosen)
            slots[d][key] = _slot(key, entry, offsets[d], tuple(dims.get(key, ())), tensor)
            offsets[d] += slots[d][key].size
    width = max(align, -(-max(offsets) // align) * align)
    experts = None
    if edims:
        experts = ExpertRows(expert, max(expert_align, -(-max(eoffsets) // expert_align) * expert_align),
                             tuple(eslots))
    tied = tuple(Tied(k, owner[k], tuple(users.get(k, ()))) for k in module.tied_keys)
    return StageRows(module, part, num_stages, width, tuple(slots), tied, tensor, experts)
