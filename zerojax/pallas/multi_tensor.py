"""One kernel launch over many arrays, block by block, updating them in place.

DeepSpeed's FusedAdam walks all parameter tensors in a few launches (apex's multi_tensor_apply)
instead of one launch per tensor, and needs no flat copy of the state to do it. The same here:
each array is viewed as 1-D (free for a contiguous array), split into `block`-element blocks, and
the blocks of all arrays form one grid. Program `i` finds its array from static segment bounds and
touches only that array's block; every other operand's block index is clamped to a valid block and
never read or written. Outputs alias their inputs (`input_output_aliases`), so XLA updates the
buffers in place and moves exactly the bytes the kernel body reads and writes.

Boundary blocks: Triton does not mask out-of-bounds accesses by itself, so bodies get
`Block.load` / `Block.store`, which mask the tail of an array whose size is not a multiple of the
block. Mosaic GPU copies blocks with TMA, which clips at the array's end, and runs one array per
launch: its block pipeline would otherwise copy every operand's block for every program.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from zerojax.pallas.backend import INTERPRET, MOSAIC_GPU, TRITON

# Elements per program. 1024 fp32 elements are 4 KiB per operand; with 4 warps each thread moves
# 8 contiguous elements of every operand (two 16-byte loads). On an H100 (`python -m
# benchmarks.kernels --block B`) 1024 ran Adam at 0.95-1.01x optax's speed from 1e8 to 1e9
# parameters, 2048 at 0.83-0.94x and 8192 at 0.90x: more, smaller programs keep more loads in
# flight. Mosaic GPU's TMA copies at most 256 elements along a dimension.
BLOCK = 1024
MOSAIC_BLOCK = 256
NUM_WARPS = 4
# Arrays per launch: each adds a branch to the kernel and up to 8 pointers to its parameters
# (Adam: 4 inputs, 4 outputs); 48 keeps them under CUDA's classic 4 KiB kernel-parameter limit.
MAX_ARRAYS_PER_LAUNCH = 48


class Segment(NamedTuple):
    """Programs [start, start + blocks) process array `index` of `size` elements."""
    index: int
    start: int
    blocks: int
    size: int


def segments(sizes: Sequence[int], block: int) -> list[Segment]:
    out, start = [], 0
    for i, n in enumerate(sizes):
        blocks = -(-n // block)
        out.append(Segment(i, start, blocks, n))
        start += blocks
    return out


@dataclasses.dataclass(frozen=True)
class Block:
    """Access to one program's block of one array. `mask` marks the real elements of a tail block
    (None: the whole block is real); loads give 0 beyond the array's end on every backend.

    Triton masks the memory accesses. Mosaic GPU's TMA clips copies at the array's end by itself
    (`clipped`); loads are still zeroed past it, so reductions over the block stay exact."""
    mask: Any | None
    clipped: bool = False

    def load(self, ref: Any) -> jax.Array:
        if self.mask is None:
            return ref[...]
        if self.clipped:
            return jnp.where(self.mask, ref[...], 0)
        from jax.experimental.pallas import triton as plt
        return plt.load(ref, mask=self.mask, other=0)

    def store(self, ref: Any, value: jax.Array) -> None:
        if self.mask is None or self.clipped:
            ref[...] = value.astype(ref.dtype)
            return
        from jax.experimental.pallas import triton as plt
        plt.store(ref, value.astype(ref.dtype), mask=self.mask)


def _lane_index(block: int, backend: str, interpret: bool) -> jax.Array:
    """0..block-1; Mosaic GPU needs the register layout spelled out (a warpgroup-strided vector)."""
    if backend != MOSAIC_GPU or interpret:
        return jnp.arange(block, dtype=jnp.int32)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    vec = max(1, min(2, block // 128))
    return plgpu.broadcasted_iota(jnp.int32, (block,), 0, layout=plgpu.Layout.WG_STRIDED((block,), vec_size=vec))


class Output(NamedTuple):
    """One per-array output: written in place over input `alias`, or a new array of `dtype`."""
    alias: int | None = None
    dtype: Any = None


# body(scalars_ref, in_refs, out_refs, stats_ref | None, block) -> None
Body = Callable[[Any, tuple, tuple, Any, Block], None]


def compiler_params(backend: str) -> Any:
    if backend == TRITON:
        from jax.experimental.pallas import triton as plt
        return plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
    if backend == MOSAIC_GPU:
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return plgpu.CompilerParams()
    return None


def default_block(backend: str) -> int:
    return MOSAIC_BLOCK if backend == MOSAIC_GPU else BLOCK


def stats_width(backend: str) -> int:
    """Floats of per-program statistics; Mosaic GPU copies whole 128-byte lines."""
    return 32 if backend == MOSAIC_GPU else 2


def scalar_width(backend: str, n: int) -> int:
    """Length of the runtime-scalar operand: a power of two (Triton), 128 bytes (Mosaic GPU)."""
    width = 32 if backend == MOSAIC_GPU else 1
    while width < n:
        width *= 2
    return width


def launch(body: Body, arrays: Sequence[Sequence[jax.Array]], scalars: jax.Array, outputs: Sequence[Output],
           *, backend: str, block: int | None = None, stats: bool = False, name: str = "multi_tensor",
           interpret: bool = False) -> tuple[list[tuple[jax.Array, ...]], list[jax.Array] | None]:
    """Run `body` over every block of every array group; returns per-group outputs (and statistics).

    arrays[k] is one group: equal-sized 1-D arrays (e.g. a parameter, its gradient and moments).
    outputs describes the outputs of each group. With `stats`, every program also writes
    `stats_width(backend)` floats; they come back per group as a (blocks, width) array.
    `interpret` runs a GPU backend's kernel (its blocking and body) in the interpreter, for tests;
    backend "interpret" is the Triton kernel interpreted.
    """
    arrays = [tuple(group) for group in arrays]
    block = block or default_block(backend)
    if not arrays:
        return [], ([] if stats else None)
    per_launch = 1 if backend == MOSAIC_GPU else MAX_ARRAYS_PER_LAUNCH
    results: list[tuple[jax.Array, ...] | None] = [None] * len(arrays)
    stat_parts: list[jax.Array | None] = [None] * len(arrays)
    for k, group in enumerate(arrays):  # empty arrays: nothing to launch
        if group[0].shape[0] == 0:
            results[k] = tuple(group[o.alias] if o.alias is not None else jnp.zeros((0,), o.dtype)
                               for o in outputs)
            stat_parts[k] = jnp.zeros((0, stats_width(backend)), jnp.float32)
    work = [k for k, group in enumerate(arrays) if group[0].shape[0]]
    for first in range(0, len(work), per_launch):
        chunk = work[first:first + per_launch]
        outs, st = _launch_one(body, [arrays[k] for k in chunk], scalars, tuple(outputs), backend=backend,
                               block=block, stats=stats, name=name, interpret=interpret or backend == INTERPRET)
        for j, k in enumerate(chunk):
            results[k] = outs[j]
            if stats:
                stat_parts[k] = st[j]
    return results, (stat_parts if stats else None)


def _launch_one(body: Body, arrays: list[tuple[jax.Array, ...]], scalars: jax.Array,
                outputs: tuple[Output, ...], *, backend: str, block: int, stats: bool, name: str,
                interpret: bool) -> tuple[list[tuple[jax.Array, ...]], list[jax.Array]]:
    from jax.experimental import pallas as pl

    n_in, n_out = len(arrays[0]), len(outputs)
    sizes = [group[0].shape[0] for group in arrays]
    for group in arrays:
        if len(group) != n_in or any(x.ndim != 1 or x.shape[0] != group[0].shape[0] for x in group):
            raise ValueError("multi_tensor.launch: each group needs equal-sized 1-D arrays")
    segs = segments(sizes, block)
    programs = segs[-1].start + segs[-1].blocks
    clipped = backend == MOSAIC_GPU  # TMA copies stop at the array's end; Triton must mask
    width = stats_width(backend)

    def block_map(seg: Segment) -> Callable[[jax.Array], tuple[jax.Array]]:
        if len(segs) == 1:
            return lambda i: (i,)
        return lambda i: (jnp.clip(i - seg.start, 0, seg.blocks - 1),)

    scalar_spec = pl.BlockSpec(scalars.shape, lambda i: (0,))
    in_specs = [scalar_spec] + [pl.BlockSpec((block,), block_map(seg)) for seg in segs for _ in range(n_in)]
    out_specs = [pl.BlockSpec((block,), block_map(seg)) for seg in segs for _ in range(n_out)]
    out_shape = []
    aliases = {}
    for k, group in enumerate(arrays):
        for j, out in enumerate(outputs):
            if out.alias is not None:
                src = group[out.alias]
                aliases[1 + k * n_in + out.alias] = k * n_out + j
                out_shape.append(jax.ShapeDtypeStruct(src.shape, src.dtype))
            else:
                out_shape.append(jax.ShapeDtypeStruct(group[0].shape, out.dtype))
    if stats:
        out_specs.append(pl.BlockSpec((width,), lambda i: (i,)))
        out_shape.append(jax.ShapeDtypeStruct((programs * width,), jnp.float32))

    def kernel(s_ref: Any, *refs: Any) -> None:
        ins, outs = refs[:len(segs) * n_in], refs[len(segs) * n_in:]
        stats_ref = outs[len(segs) * n_out] if stats else None
        pid = pl.program_id(0)

        def run(seg: Segment) -> None:
            mask = None
            if seg.size % block:
                offsets = (pid - seg.start) * block + _lane_index(block, backend, interpret)
                mask = offsets < seg.size
            body(s_ref, ins[seg.index * n_in:(seg.index + 1) * n_in],
                 outs[seg.index * n_out:(seg.index + 1) * n_out], stats_ref, Block(mask, clipped))

        if len(segs) == 1:
            run(segs[0])
            return
        for seg in segs:
            pl.when((pid >= seg.start) & (pid < seg.start + seg.blocks))(functools.partial(run, seg))

    flat_in = [scalars] + [x for group in arrays for x in group]
    flat_out = pl.pallas_call(
        kernel, grid=(programs,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases, interpret=interpret,
        compiler_params=None if interpret else compiler_params(backend), name=name)(*flat_in)
    results = [tuple(flat_out[k * n_out:(k + 1) * n_out]) for k in range(len(segs))]
    stat_parts = []
    if stats:
        table = flat_out[-1].reshape(programs, width)
        stat_parts = [table[s.start:s.start + s.blocks] for s in segs]
    return results, stat_parts
