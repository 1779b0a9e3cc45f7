"""What the expert and sequence axes, and a hierarchical data axis, do to a run, read off a plan, as tables a
user can check at start-up and in `zerojax config explain` (the tensor axis has its own,
`TensorPlan.describe`).

- The expert axis (DeepSpeed's `ep_size`): which weights are split by experts, how many experts each
  device holds, the group ZeRO shards them over (the expert-data-parallel group), and the all-to-alls
  each MoE layer adds.
- The sequence axis (DeepSpeed-Ulysses): the rows' and tokens' split, the heads each device attends
  with, what ZeRO shards over (data x sequence), and the all-to-alls each attention layer adds.
- A hierarchical data axis: the hosts (`data_outer` rows), which groups stay inside one, and where
  ZeRO++'s hpZ keeps each weight's secondary copy.

Groups are named by their mesh axes (`data`, or `data_outer x data_inner`, then `expert`, `sequence`).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from zerojax.core.collectives import Shard
from zerojax.core.layout import Plan, is_layout
from zerojax.core.names import dotted
from zerojax.core.mesh import (DATA_INNER, DATA_OUTER, EXPERT, SEQUENCE, TENSOR, DataAxis, axes_size, data_axes,
                               data_size, expert_data_axes, expert_size, host_axes, row_axes, row_size, sequence_size,
                               tensor_size)

__all__ = ["expert_plan", "sequence_plan", "data_plan", "axis_plans"]


def _tuple(axes: DataAxis) -> tuple:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _named(axes: DataAxis) -> str:
    """A group by its axes, e.g. `data x expert` or `data_outer x data_inner x sequence`."""
    return " x ".join(_tuple(axes))


def _groups(mesh: Any, axes: DataAxis) -> str:
    """The device groups over one axis or several, e.g. `{0,1} {2,3} ...` (the first three, then a count)."""
    axes = _tuple(axes)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    where = [tuple(mesh.axis_names).index(a) for a in axes]
    ids = np.moveaxis(ids, where, list(range(ids.ndim - len(axes), ids.ndim)))
    ids = ids.reshape(-1, math.prod(mesh.shape[a] for a in axes))
    shown = " ".join("{" + ",".join(str(int(i)) for i in g) + "}" for g in ids[:3])
    return shown + (f" ... ({len(ids)} groups)" if len(ids) > 3 else "")


def expert_plan(plan: Plan) -> str | None:
    """The expert-parallel table: each expert weight, its experts per device and its ZeRO shard; None
    on a mesh without an expert axis."""
    ep = expert_size(plan.mesh)
    if ep == 1:
        return None
    mesh = plan.mesh
    experts = expert_data_axes(mesh)
    leaves = jax.tree_util.tree_leaves_with_path(plan.abstract_params)
    lays = jax.tree.leaves(plan.layouts, is_leaf=is_layout)
    rows = [(dotted(path), tuple(x.shape), lay) for (path, x), lay in zip(leaves, lays) if lay.over(EXPERT) is not None]
    out = [f"expert parallel over {ep} devices (ep_size; groups {_groups(mesh, EXPERT)}): "
           f"{len(rows)} of {len(lays)} weights split by experts, ZeRO over {_named(experts)} "
           f"{axes_size(mesh, experts)} (the expert-data-parallel group); every other weight ZeRO over "
           f"{_named(data_axes(mesh))} {data_size(mesh)}"]
    width = max((len(p) for p, *_ in rows), default=4)
    layers = 1
    for path, shape, lay in rows:
        dim = lay.over(EXPERT)
        layers = max(layers, shape[0] if dim > 0 else 1)  # [MoE layers, experts, ...] when stacked
        zero = _zero(lay.update, lay.param)
        out.append(f"  {path:<{width}} {str(shape):<20} experts dim {dim}: {shape[dim] // ep} of {shape[dim]} "
                   f"per device; {zero}")
    out.append(f"  all-to-alls over each expert group: 2 per MoE layer forward (tokens to their experts' "
               f"devices, results back) and their 2 transposes backward, {layers} MoE layer(s)")
    tp = tensor_size(plan.mesh)
    if tp > 1 and rows and all(lay.over(TENSOR) is None for *_, lay in rows):
        out.append(f"  experts whole on every tensor device (model.expert_tensor_parallelism: false): each sends "
                   f"1/{tp} of its dispatched capacity through them and all-gathers the results over its tensor "
                   f"group")
    return "\n".join(out)


def _zero(update: Any, param: Any) -> str:
    """Where ZeRO shards an expert weight: its optimizer state's group, and hpZ's secondary copy where the
    parameters sit on another."""
    if not isinstance(update, Shard):
        return "no ZeRO shard"
    out = f"ZeRO dim {update.dim} over {_named(update.axis)}"
    if isinstance(param, Shard) and param.axis != update.axis:
        out += f", parameters over {_named(param.axis)} (hpZ)"
    return out


def sequence_plan(plan: Plan, seq_len: int | None = None, heads: tuple[int, int] | None = None) -> str | None:
    """The sequence-parallel (Ulysses) summary: rows and tokens per device, heads per device in
    attention, the ZeRO group and the all-to-alls; None on a mesh without a sequence axis. `seq_len`
    and `heads` (query, key/value) are the model's, when known."""
    sp = sequence_size(plan.mesh)
    if sp == 1:
        return None
    tokens = f"each row's {seq_len} tokens in chunks of {seq_len // sp}" if seq_len else \
        f"each row's tokens in {sp} chunks"
    out = [f"sequence parallel (Ulysses) over {sp} devices (groups {_groups(plan.mesh, SEQUENCE)}): rows over "
           f"{_named(row_axes(plan.mesh))} {row_size(plan.mesh)}, {tokens}; ZeRO over {_named(data_axes(plan.mesh))} "
           f"{data_size(plan.mesh)}"]
    if heads is not None:
        q, kv = heads
        out.append(f"  attention: all heads on a chunk -> {q // sp} query / {kv // sp} key-value heads on the "
                   f"whole row per device")
    out.append("  all-to-alls over each sequence group: 2 per attention layer forward (q, k, v to the head "
               "split; the output back to the token split), their 2 transposes backward (and remat's replay)")
    return "\n".join(out)


def data_plan(plan: Plan) -> str | None:
    """The hierarchical data axis: its hosts, the groups inside each, and (hpZ) where each kind of weight
    keeps its secondary copy; None on a flat data axis."""
    mesh = plan.mesh
    if DATA_OUTER not in mesh.axis_names:
        return None
    inside = [a for a in mesh.axis_names if a != DATA_OUTER]
    out = [f"hierarchical data axis: data_outer {mesh.shape[DATA_OUTER]} (hosts: groups "
           f"{_groups(mesh, tuple(inside))}) x data_inner {mesh.shape[DATA_INNER]}; "
           f"{', '.join(a for a in inside if a != DATA_INNER) or 'no other axis'} inside each host; only ZeRO's "
           f"reductions and gathers over {_named(data_axes(mesh))} cross hosts"]
    if plan.hpz > 1:
        line = (f"  hpZ: parameters' secondary copy over {_named(host_axes(data_axes(mesh)))} "
                f"{axes_size(mesh, host_axes(data_axes(mesh)))} (one host's part of the ZeRO group)")
        if expert_size(mesh) > 1:
            experts = host_axes(expert_data_axes(mesh))
            line += f", expert weights' over {_named(experts)} {axes_size(mesh, experts)}"
        out.append(line + "; gradients and optimizer state over the whole group, refreshed into the copy by one "
                          "all-gather over data_outer per step")
    return "\n".join(out)


def axis_plans(plan: Plan, model: Any = None) -> list[str]:
    """The hierarchical data, expert and sequence tables that apply to `plan` (`model`: the config's model section, for the
    sequence length and heads; None for a model given in code)."""
    seq_len = getattr(model, "seq_len", None)
    heads = (model.n_heads, model.n_kv_heads or model.n_heads) if getattr(model, "n_heads", None) else None
    return [t for t in (data_plan(plan), expert_plan(plan), sequence_plan(plan, seq_len, heads)) if t is not None]
