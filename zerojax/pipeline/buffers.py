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
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.core.names import dotted
from zerojax.pipeline.module import Partition, PipelineModule


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
        """Parameters (unpadded) stored per device."""
        return tuple(sum(s.size for s in slots.values()) for slots in self.slots)

    def owner(self, key: str) -> int:
        return next(d for d, slots in enumerate(self.slots) if key in slots)

    def slot(self, key: str) -> Slot:
        return self.slots[self.owner(key)][key]

    def stage_keys(self, virtual_stage: int) -> tuple[str, ...]:
        """Logical entries the virtual stage's layers read (stored or received)."""
        keys = (self.module.layers[i].param_key for i in self.partition.layers(virtual_stage))
        return tuple(dict.fromkeys(k for k in keys if k is not None))

    def read_stage(self, virtual_stage: int, row: jax.Array, tied_in: dict[str, jax.Array],
                   dtype: Any = None) -> dict[str, Any]:
        """The logical parameters a virtual stage runs with: from its device's row, or received."""
        mine = self.slots[self.device(virtual_stage)]
        out = {}
        for key in self.stage_keys(virtual_stage):
            if key in mine:
                out[key] = mine[key].read(row, dtype)
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
        slots = sorted(self.slots[device].values(), key=lambda sl: sl.offset)
        pieces = [sl.flatten(params[sl.key], dtype, block, self.tensor) for sl in slots]
        used = sum(sl.size for sl in slots)
        pieces.append(jnp.zeros((self.width - used,), dtype))
        return jnp.concatenate(pieces)

    def pack(self, params: dict[str, Any], dtype: Any = jnp.float32) -> jax.Array:
        """Logical parameters -> `[S, width]` rows (`[S, tensor, width]` with tensor slices), traced or
        on one device."""
        if self.tensor == 1:
            return jnp.stack([self.pack_device(d, params, dtype) for d in range(self.stages)])
        return jnp.stack([jnp.stack([self.pack_device(d, params, dtype, t) for t in range(self.tensor)])
                          for d in range(self.stages)])

    def unpack(self, rows: Any) -> dict[str, Any]:
        """Rows (any placement) -> logical parameters, as numpy arrays (tensor slices joined)."""
        rows = np.asarray(jax.device_get(rows))
        if rows.ndim == 2:
            rows = rows[:, None]
        out = {}
        for d, slots in enumerate(self.slots):
            for key, slot in slots.items():
                pieces = [jax.tree.leaves(slot.unflatten(rows[d, t, slot.offset:slot.offset + slot.size]))
                          for t in range(rows.shape[1])]
                leaves = [np.concatenate([p[i] for p in pieces], axis=dim) if dim is not None else pieces[0][i]
                          for i, dim in enumerate(slot.dims or (None,) * len(slot.shapes))]
                out[key] = jax.tree.unflatten(slot.treedef, [np.asarray(x) for x in leaves])
        return {k: out[k] for k in self.module.abstract_params()}

    def manifest(self) -> dict[str, dict[str, Any]]:
        """Where each logical parameter leaf sits in the rows, by dotted name (JSON-able).

        Checkpoints carry it, so `zerojax export` writes the logical parameters of a pipelined run
        (not its padded rows) without the PipelineModule at hand.
        """
        out = {}
        for d, slots in enumerate(self.slots):
            for key, slot in sorted(slots.items(), key=lambda kv: kv[1].offset):
                skeleton = jax.tree.unflatten(slot.treedef, range(len(slot.shapes)))
                paths = jax.tree_util.tree_flatten_with_path(skeleton)[0]
                start = slot.offset
                for (path, _), shape, dim in zip(paths, slot.shapes, slot.dims or (None,) * len(slot.shapes)):
                    name = dotted(path, key)
                    out[name] = {"row": d, "offset": start, "shape": list(shape)}
                    if dim is not None:  # stored as `block`-shaped tensor slices along `tensor_dim`, one per [d, t] row
                        whole = [s * self.tensor if i == dim else s for i, s in enumerate(shape)]
                        out[name].update(shape=whole, block=list(shape), tensor_dim=dim)
                    start += math.prod(shape)
        return out

    def table(self) -> str:
        """The partition, plus what each device stores."""
        lines = [self.partition.table()]
        if self.chunks > 1:
            lines.append(f"device d runs virtual stages d, d+{self.stages}, ... ({self.chunks} chunks each)")
        lines.append("stored per device: " + ", ".join(f"{n:,}" for n in self.stored)
                     + f" parameters; row width {self.width:,} (padded to the largest)")
        for t in self.tied:
            where = ", ".join(str(u) for u in t.users) or "no other stage"
            lines.append(f"tied {t.key!r}: stored on stage {t.owner}, also used by {where}")
        return "\n".join(lines)


def stage_rows(module: PipelineModule, num_stages: int, chunks: int = 1, align: int = 1, tensor: int = 1,
               dims: dict[str, tuple[int | None, ...]] | None = None) -> StageRows:
    """Lay out the module's parameters over `num_stages` devices; `width` is a multiple of `align`.

    A parameter entry is stored by the device of the first virtual stage (in layer order) that
    uses it; a tied entry used by other devices too is sent to them (see executor.py). With
    `tensor` > 1, `dims[key]` names each leaf's split dimension (None: whole): each stage has one row
    per tensor slice, holding that slice of every split leaf and a copy of the whole ones.
    """
    dims = dims or {}
    part = module.partition(num_stages * chunks)
    abstract = module.abstract_params()
    slots: list[dict[str, Slot]] = [{} for _ in range(num_stages)]
    offsets = [0] * num_stages
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
            leaves, treedef = jax.tree.flatten(abstract[key])
            split = tuple(dims.get(key, (None,) * len(leaves))) if tensor > 1 else ()
            shapes = tuple(tuple(s // tensor if split and i == split[j] else s for i, s in enumerate(x.shape))
                           for j, x in enumerate(leaves))
            size = sum(math.prod(sh) for sh in shapes)
            slots[d][key] = Slot(key, offsets[d], size, treedef, shapes, split)
            offsets[d] += size
    width = max(align, -(-max(offsets) // align) * align)
    tied = tuple(Tied(k, owner[k], tuple(users.get(k, ()))) for k in module.tied_keys)
    return StageRows(module, part, num_stages, width, tuple(slots), tied, tensor)
