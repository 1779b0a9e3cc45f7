"""The device mesh: a `data` axis that ZeRO shards over (and, for pipelines, a `stage` axis; for tensor
parallelism, a `tensor` axis, the innermost, so one tensor group is consecutive devices).

The data axis may be hierarchical (`mesh.data_outer`): two mesh axes, `data_outer` across hosts or
slices (slow links) and `data_inner` within one (fast links), that every layout and collective
treats together as "the data axis" - a ZeRO shard is split over both - while keeping the inner
axis addressable on its own (a secondary partition within a host, as ZeRO++'s hpZ keeps, needs it).

Expert parallelism (DeepSpeed's `ep_size`) carves an `expert` axis out of the data-parallel devices:
the mesh is (`data`, `expert`), the data-parallel set is both (`data_axes` is the pair, as for the
hierarchical axis: the batch rows and every non-expert ZeRO shard are split over both), and the MoE
layers' expert weights are split over `expert` and ZeRO-sharded over `data` only.

A `sequence` axis (DeepSpeed-Ulysses, `mesh.sequence`) sits inside the data-parallel set, between
`data` and `tensor`: each row's tokens are split over it, and ZeRO shards weights over data x
sequence together, as DeepSpeed's ALST does, so `data_axes` names both; `row_axes` / `row_size` are
the part the batch's rows are split over (what the batch triad counts).
"""
from __future__ import annotations

import math
from typing import Any, Union

import jax

from zerojax.errors import ConfigError

DATA = "data"
STAGE = "stage"
TENSOR = "tensor"
EXPERT = "expert"
SEQUENCE = "sequence"
DATA_OUTER = "data_outer"
DATA_INNER = "data_inner"
HIERARCHICAL = (DATA_OUTER, DATA_INNER)
DataAxis = Union[str, tuple]


def request_cpu_devices(n: int | None) -> None:
    """Ask for `n` virtual CPU devices; effective only before JAX's backends start.

    On a machine with an accelerator the CPU count does not matter, so this is harmless there.
    Once the backends have started the count cannot change: the mesh check then reports the
    devices that exist.
    """
    if n is None:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backends already initialized; make_mesh reports a shortfall


def _tuple(axes: DataAxis) -> tuple:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _row_axes(names: tuple) -> DataAxis:
    if DATA in names and EXPERT in names:
        return (DATA, EXPERT)
    if DATA in names:
        return DATA
    if all(a in names for a in HIERARCHICAL):
        return HIERARCHICAL
    raise ConfigError(f"mesh: needs an axis named '{DATA}' or the pair {HIERARCHICAL} (got axes {names})")


def _data_axes(names: tuple) -> DataAxis:
    rows = _row_axes(names)
    return (*_tuple(rows), SEQUENCE) if SEQUENCE in names else rows


def row_axes(mesh: Any) -> DataAxis:
    """The mesh axis (or axes) the batch's rows are split over: `data`, (`data`, `expert`) or
    (`data_outer`, `data_inner`)."""
    return _row_axes(tuple(mesh.axis_names))


def data_axes(mesh: Any) -> DataAxis:
    """The mesh axis (or axes) ZeRO shards over and gradients are averaged over: every data-parallel
    device, the row axes and then `sequence` (each row's tokens are split over it)."""
    return _data_axes(tuple(mesh.axis_names))


def data_axis() -> DataAxis:
    """`data_axes` of the mesh being traced (inside `shard_map`), for collectives in step and model code."""
    return _data_axes(tuple(jax.sharding.get_abstract_mesh().axis_names))


def expert_data_axes(mesh: Any) -> DataAxis:
    """What an expert weight (split over `expert`) is ZeRO-sharded and reduced over: the data axes less
    `expert`, DeepSpeed's expert-data-parallel group (`data`, or (`data`, `sequence`))."""
    rest = tuple(a for a in _tuple(data_axes(mesh)) if a != EXPERT)
    return rest[0] if len(rest) == 1 else rest


def axes_size(mesh: Any, axes: DataAxis) -> int:
    """Devices spanned by one mesh axis or a tuple of them."""
    return math.prod(int(mesh.shape[a]) for a in _tuple(axes))


def data_size(mesh: Any) -> int:
    """Devices ZeRO shards over (`data_axes`): rows x sequence. The 1/dp of the gradient mean divides by it."""
    return axes_size(mesh, data_axes(mesh))


def row_size(mesh: Any) -> int:
    """Data-parallel row shards (`row_axes`): what the batch triad counts, data_size / sequence_size."""
    return axes_size(mesh, row_axes(mesh))


def sequence_size(mesh: Any) -> int:
    """Devices one row's tokens are split over: the `sequence` axis's size, 1 on a mesh without one."""
    return int(mesh.shape[SEQUENCE]) if SEQUENCE in tuple(mesh.axis_names) else 1


def sequence_axis() -> str | None:
    """The sequence axis of the mesh being traced (inside `shard_map`), or None on a mesh without one, for
    the collectives of sequence-parallel model code (Ulysses attention, the loss's token counts)."""
    return SEQUENCE if SEQUENCE in tuple(jax.sharding.get_abstract_mesh().axis_names) else None


def tensor_size(mesh: Any) -> int:
    """Devices in one tensor-parallel group: the `tensor` axis's size, 1 on a mesh without one."""
    return int(mesh.shape[TENSOR]) if TENSOR in tuple(mesh.axis_names) else 1


def tensor_axis() -> str | None:
    """The tensor axis of the mesh being traced (inside `shard_map`), or None on a mesh without one, for
    the collectives of tensor-parallel model code."""
    return TENSOR if TENSOR in tuple(jax.sharding.get_abstract_mesh().axis_names) else None


def expert_size(mesh: Any) -> int:
    """Devices in one expert-parallel group: the `expert` axis's size, 1 on a mesh without one."""
    return int(mesh.shape[EXPERT]) if EXPERT in tuple(mesh.axis_names) else 1


def expert_axis() -> str | None:
    """The expert axis of the mesh being traced (inside `shard_map`), or None on a mesh without one, for
    the all-to-alls of a MoE layer (`zerojax.models.moe.moe_apply`)."""
    return EXPERT if EXPERT in tuple(jax.sharding.get_abstract_mesh().axis_names) else None
