"""Where a generate call's weights and rows lie on the plan's mesh: decoding from the shards.

A training plan at ZeRO-3 stores each device's 1/(data x tensor) of every weight. Gathering them whole
for decoding would hold the whole model on every device for the length of the call, the very thing
ZeRO-3 was chosen to avoid (and would undo a tensor split). `choose` picks, per call, one of:

* `tensor`: weight-stationary tensor-parallel decoding. Every weight stays exactly as the plan stores
  it: its tensor dimension over the `tensor` axis and, at ZeRO-3, its ZeRO dimension over the data
  axes, which decoding re-reads as more tensor devices (each weight is a 2-D block; a contraction
  over a split dimension leaves partial sums that are all-reduced). XLA's SPMD partitioner places
  those collectives on the activations; the weights never move (tests/test_generate_layouts.py reads
  the compiled program: no all-gather inside the decode loop). With the data axes holding weight
  blocks, every device runs every row. This is DeepSpeed's hybrid engine's choice
  (tensor-parallel inference from the training shards), without its gather into a second copy.
  The decode step's layers run as a loop (`Decoder.rolled()`), so a backend that copies the layer
  slice a matmul reads (XLA:CPU) holds one layer's copy, not every layer's.
* `layers`: each device decodes its rows with every ZeRO-3 shard gathered where a layer uses it
  (`gather_at_use`, in every decode step). With the plan's prefetch (`overlap_comm`, the default at
  stage 3) the scanned stack gathers layer i+1 while layer i computes, holding at most two layers
  gathered (`gather_at_use._prefetch_ahead`); without it one layer's weights at a time, each
  gathered where it is used. The weights move in every step, so it pays when the rows' compute
  and activations outweigh the weights: a large batch (the rule below), or weights with no
  dimension the devices divide.
* `gathered`: every weight gathered whole once per call (the layout before this module): the most
  bytes per device, the fewest collectives. Never chosen by `choose` when the plan shards weights
  (it would exceed the plan's bytes); kept for the benchmarks and for `layout="gathered"`.

The rule: `tensor` (its weights are the plan's bytes per device, the budget), unless the batch is so large that one
step's activation traffic under `tensor` (about two all-reduces of each layer's [rows, width], which
`cache_bytes` of one position estimates) exceeds gathering the weights once (`layers`). With a device
that reports its memory, a layout whose weights and KV cache do not fit what is free moves to the other;
when neither fits, `choose` raises before anything compiles.

Rows are split over the data x expert axes (`row_axes`) where the weights leave those axes free (the
`layers` and `gathered` layouts, and `tensor` below ZeRO-3); a batch they do not divide is padded with
rows that are done from the start (`pad_rows`), so each device decodes its own rows.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.core.layout import Plan
from zerojax.core.mesh import axes_size, data_axes, row_axes
from zerojax.rewrite.gather_at_use import prefetches

NAMES = ("tensor", "layers", "gathered")


class Layout:
    """How one generate call decodes (a static argument of the compiled program).

    name: "tensor", "layers", "gathered", or "one device" (no plan).
    prefetch: `layers` gathers layer i+1 while layer i computes (the plan's `overlap_comm` prefetch).
    rows: the rows' sharding (None: one device).
    weights: per parameter leaf (flattened), the sharding the weights are held in during the call
        ("tensor", "gathered"); None for "layers" (the plan's shards, gathered at use).
    weight_bytes: per device, the most weight bytes the layout holds at once.
    planned_bytes: per device, the parameters as the plan stores them.
    why: one line on the choice.
    """

    def __init__(self, name: str, rows: NamedSharding | None, weights: tuple | None, weight_bytes: int,
                 planned_bytes: int, why: str, plan: Plan | None = None, prefetch: bool = False):
        self.name, self.rows, self.weights, self.plan = name, rows, weights, plan
        self.weight_bytes, self.planned_bytes, self.why, self.prefetch = weight_bytes, planned_bytes, why, prefetch

    def _key(self) -> tuple:
        return self.name, self.rows, self.weights, id(self.plan)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Layout({self.name}: weights {self.weight_bytes} B/device, planned {self.planned_bytes})"

    @property
    def row_shards(self) -> int:
        """Devices the rows are split over (1: every device decodes every row)."""
        return 1 if self.rows is None else axes_size(self.rows.mesh, tuple(_flat(self.rows.spec)))


def _flat(spec: P) -> list[str]:
    out: list[str] = []
    for a in spec:
        out += [] if a is None else list(a) if isinstance(a, tuple) else [a]
    return out


def _tuple(axes: Any) -> tuple[str, ...]:
    return tuple(axes) if isinstance(axes, tuple) else (axes,)


def pad_rows(batch: int, shards: int) -> int:
    """The batch padded up to a multiple of `shards`."""
    return -(-batch // shards) * shards


def _leaf_bytes(x: Any) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def _held(abstract: Any, shardings: Any) -> int:
    return sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))


def _one_layer(decoder: Any, params: Any, plan: Plan | None) -> tuple[int, int]:
    """(bytes, elements) of one layer of the decoder's scanned stacks (their leaves' slice along the
    scanned axes), as `layers` decoding gathers it on a device: with a plan, a leaf the tensor axis
    splits is gathered over the ZeRO axes only, so one device holds its tensor block."""
    from zerojax.rewrite.gather_at_use import find_layer_axes
    b = 1
    fn = lambda p, c, t, q: decoder.decode_step(p, c, t, q)  # noqa: E731
    cache = jax.eval_shape(lambda p: decoder.init_cache(p, b, 2), params)
    tok = jax.ShapeDtypeStruct((b,), np.int32)
    depth = jax.tree.leaves(find_layer_axes(fn, params, cache, tok, tok))
    split = [1] * len(depth) if plan is None else [
        1 if d is None else plan.tensor_size for d in jax.tree.leaves(plan.tensor_dims, is_leaf=lambda d: d is None)]
    size, count = 0, 0
    for x, k, t in zip(jax.tree.leaves(params), depth, split):
        if k:
            n = math.prod(x.shape) // math.prod(x.shape[:k]) // t
            size, count = size + n * np.dtype(x.dtype).itemsize, count + n
    return size, count


def one_layer_bytes(decoder: Any, params: Any, plan: Plan | None = None) -> int:
    """Bytes of one layer of the decoder's scanned stacks, what `layers` decoding gathers at a time
    (on a device of `plan`'s mesh when given: a tensor-split weight's block)."""
    return _one_layer(decoder, params, plan)[0]


def _free_bytes() -> int | None:
    """Free memory of this process's first device, when it reports it (GPU, TPU; None on CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def choose(plan: Plan | None, decoder: Any, params: Any, batch: int, max_len: int, name: str | None = None,
           cache_bytes: Callable[[Any, Any, int, int], int] | None = None) -> Layout:
    """The layout of one call (module docstring); `name` forces one of NAMES."""
    if name is not None and name not in NAMES:
        raise ValueError(f"generate: layout must be one of {', '.join(NAMES)} or None (got {name!r})")
    if plan is None:
        whole = sum(_leaf_bytes(x) for x in jax.tree.leaves(params))
        return Layout("one device", None, None, whole, whole, "no plan: the params on one device")
    mesh = plan.mesh
    rows_axes = row_axes(mesh)
    rows = NamedSharding(mesh, P(rows_axes))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    planned = _held(abstract, plan.param_shardings)
    whole = sum(_leaf_bytes(x) for x in jax.tree.leaves(abstract))
    layer, layer_elements = _one_layer(decoder, abstract, plan)
    shards = axes_size(mesh, rows_axes)
    cache = cache_bytes(decoder, abstract, pad_rows(batch, shards), max_len) if cache_bytes else 0
    step_cache = cache_bytes(decoder, abstract, pad_rows(batch, shards), 1) if cache_bytes else 0
    free = _free_bytes()

    held = plan.param_shardings
    reread = any(a in _flat(s.spec) for s in jax.tree.leaves(held) for a in _tuple(data_axes(mesh)))
    tensor = Layout("tensor", NamedSharding(mesh, P()) if reread else rows, tuple(jax.tree.leaves(held)),
                    _held(abstract, held), planned, "", plan)
    ahead = prefetches(plan.step.prefetch, layer_elements)
    layers = Layout("layers", rows, None, planned + (2 if ahead else 1) * layer, planned, "", plan, ahead)
    gathered = Layout("gathered", rows, tuple(NamedSharding(mesh, P()) for _ in jax.tree.leaves(abstract)), whole,
                      planned, "", plan)

    def fits(lay: Layout) -> bool:
        return free is None or lay.weight_bytes - planned + cache // lay.row_shards <= free

    if name is not None:
        lay = {"tensor": tensor, "layers": layers, "gathered": gathered}[name]
        lay.why = "asked for"
        return lay
    if 2 * step_cache > whole:
        layers.why = (f"{batch} rows: a step's activations (~{2 * step_cache} B) outweigh gathering the weights "
                      f"({whole} B), so the weights move, not the activations")
        chosen, other = layers, tensor
    else:
        tensor.why = f"weights stay where they lie: {tensor.weight_bytes} B per device (the plan stores {planned} B)"
        chosen, other = tensor, layers
    if not fits(chosen):
        if fits(other):
            other.why = f"{chosen.name} decoding does not fit the device's free {free} B"
            return other
        raise ValueError(f"generate: {batch} rows x {max_len} positions need a KV cache of {cache // chosen.row_shards} B per "
                         f"device and {chosen.weight_bytes} B of weights; the device has {free} B free. Generate "
                         "fewer rows per call or fewer new tokens")
    return chosen
