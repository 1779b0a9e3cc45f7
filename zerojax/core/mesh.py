"""The device mesh's axes and the groups they form; every layout, collective and batch split asks here.

The axes, outermost first (an axis of size 1 is left out, `data` always kept):

    stage  x  data  x  expert  x  sequence  x  tensor
           or data_outer x data_inner  x  expert  x  sequence  x  tensor

* `stage`: pipeline stages. `tensor` (Megatron slicing), innermost: one tensor group is consecutive
  devices, the fastest links.
* `data`, or a hierarchical pair (`data_outer` across hosts or slices, `data_inner` within one) that
  every layout and collective treats together as "the data axis" while keeping the inner axis
  addressable on its own (ZeRO++'s hpZ partitions within a host). Both axes of the pair are kept,
  even at size 1.
* `expert` (DeepSpeed's MoE `ep_size`) is carved out of the data-parallel devices: the batch's rows
  are split over data x expert, and the MoE layers' expert weights over `expert`.
* `sequence` (DeepSpeed-Ulysses) splits each row's tokens. It sits inside `expert`, next to `tensor`:
  Ulysses' all-to-alls run in every attention layer, the experts' only in MoE layers.

On a hierarchical mesh every axis but `data_outer` lies inside one host: a host is one `data_outer` row
of data_inner x expert x sequence x tensor devices, so the experts' and Ulysses' all-to-alls and the
tensor collectives never cross hosts, as DeepSpeed keeps its expert and sequence groups inside a node;
only ZeRO's data-parallel reductions and gathers span `data_outer`.

Three groups follow, and `row_axes`, `data_axes` and `expert_data_axes` are their one definition:

* rows (`row_axes`, `row_size`): what the batch's rows are split over and the batch triad counts,
  data x expert (data_outer x data_inner x expert);
* data-parallel (`data_axes`, `data_size`): what ZeRO shards every other weight over and the
  gradient mean divides by, data x expert x sequence;
* expert-data-parallel (`expert_data_axes`): what an expert weight, split over `expert`, is ZeRO-sharded
  and reduced over, data x sequence.

Each group has a part within one host (`host_axes`: the group less `data_outer`), where ZeRO++'s hpZ
keeps a weight's secondary copy (`inner_major` orders the group for its primary partition).
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


def _data_axis(names: tuple) -> tuple:
    """The data axis proper: (`data`,) or the hierarchical pair (`data_outer`, `data_inner`)."""
    if DATA in names:
        return (DATA,)
    if all(a in names for a in HIERARCHICAL):
        return HIERARCHICAL
    raise ConfigError(f"mesh: needs an axis named '{DATA}' or the pair {HIERARCHICAL} (got axes {names})")


def _one(axes: tuple) -> DataAxis:
    """A group of one axis is named by the axis alone (`data`), of several by the tuple."""
    return axes[0] if len(axes) == 1 else axes


def _row_axes(names: tuple) -> DataAxis:
    return _one((*_data_axis(names), *((EXPERT,) if EXPERT in names else ())))


def _data_axes(names: tuple) -> DataAxis:
    rows = _row_axes(names)
    return (*_tuple(rows), SEQUENCE) if SEQUENCE in names else rows


def row_axes(mesh: Any) -> DataAxis:
    """The mesh axis (or axes) the batch's rows are split over: the data axis (`data`, or
    (`data_outer`, `data_inner`)), then `expert` where there is one."""
    return _row_axes(tuple(mesh.axis_names))


def data_axes(mesh: Any) -> DataAxis:
    """The mesh axis (or axes) ZeRO shards over and gradients are averaged over: every data-parallel
    device, the row axes and then `sequence` (each row's tokens are split over it)."""
    return _data_axes(tuple(mesh.axis_names))


def data_axis() -> DataAxis:
    """`data_axes` of the mesh being traced (inside `shard_map`), for collectives in step and model code;
    `data` outside any mesh (a collective built before it is placed, or a placement-only call)."""
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    return _data_axes(names) if names else DATA


def expert_data_axes(mesh: Any) -> DataAxis:
    """What an expert weight (split over `expert`) is ZeRO-sharded and reduced over: the data axes less
    `expert`, DeepSpeed's expert-data-parallel group (`data`, or (`data`, `sequence`); hierarchical:
    (`data_outer`, `data_inner`[, `sequence`]))."""
    return _one(tuple(a for a in _tuple(data_axes(mesh)) if a != EXPERT))


def host_axes(group: DataAxis) -> DataAxis:
    """The part of a data-parallel group (`data_axes`, `expert_data_axes`) inside one host: the group less
    `data_outer`. ZeRO++'s hpZ keeps a weight's secondary copy split over it, so a parameter gather never
    crosses hosts: data_inner x expert x sequence for an ordinary weight, data_inner x sequence for an
    expert weight (its experts are split over `expert` already)."""
    return _one(tuple(a for a in _tuple(group) if a != DATA_OUTER))


def inner_major(group: DataAxis) -> tuple:
    """The group's axes with the within-host part first and `data_outer` last: hpZ's primary partition.
    Block i of the host part then holds exactly the `data_outer` blocks of that host's devices, so an
    all-gather over `data_outer` turns a primary shard into the secondary copy's block."""
    return (*_tuple(host_axes(group)), DATA_OUTER) if DATA_OUTER in _tuple(group) else _tuple(group)


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
