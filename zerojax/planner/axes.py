"""What the expert and sequence axes do to a run, read off a plan, as tables a user can check at start-up
and in `zerojax config explain` (the tensor axis has its own, `TensorPlan.describe`).

- The expert axis (DeepSpeed's `ep_size`): which weights are split by experts, how many experts each
  device holds, the group ZeRO shards them over (data only, the expert-data-parallel group), and the
  all-to-alls each MoE layer adds.
- The sequence axis (DeepSpeed-Ulysses): the rows' and tokens' split, the heads each device attends
  with, what ZeRO shards over (data x sequence), and the all-to-alls each attention layer adds.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zerojax.core.collectives import Shard
from zerojax.core.layout import Plan, is_layout
from zerojax.core.mesh import EXPERT, SEQUENCE, TENSOR, data_size, expert_size, row_size, sequence_size, tensor_size
from zerojax.planner.tensor import dotted

__all__ = ["expert_plan", "sequence_plan", "axis_plans"]


def _groups(mesh: Any, axis: str) -> str:
    """The device groups of one axis, e.g. `{0,1} {2,3} ...` (the first three, then a count)."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    ids = np.moveaxis(ids, tuple(mesh.axis_names).index(axis), -1).reshape(-1, mesh.shape[axis])
    shown = " ".join("{" + ",".join(str(int(i)) for i in g) + "}" for g in ids[:3])
    return shown + (f" ... ({len(ids)} groups)" if len(ids) > 3 else "")


def expert_plan(plan: Plan) -> str | None:
    """The expert-parallel table: each expert weight, its experts per device and its ZeRO shard; None
    on a mesh without an expert axis."""
    ep = expert_size(plan.mesh)
    if ep == 1:
        return None
    n = data_size(plan.mesh)
    leaves = jax.tree_util.tree_leaves_with_path(plan.abstract_params)
    lays = jax.tree.leaves(plan.layouts, is_leaf=is_layout)
    rows = [(dotted(path), tuple(x.shape), lay) for (path, x), lay in zip(leaves, lays) if lay.over(EXPERT) is not None]
    out = [f"expert parallel over {ep} devices (ep_size; groups {_groups(plan.mesh, EXPERT)}): "
           f"{len(rows)} of {len(lays)} weights split by experts, ZeRO over data {n // ep} (the expert-data-"
           f"parallel group); every other weight ZeRO over data x expert {n}"]
    width = max((len(p) for p, *_ in rows), default=4)
    layers = 1
    for path, shape, lay in rows:
        dim = lay.over(EXPERT)
        layers = max(layers, shape[0] if dim > 0 else 1)  # [MoE layers, experts, ...] when stacked
        zero = f"ZeRO dim {lay.update.dim} over data" if isinstance(lay.update, Shard) else "no ZeRO shard"
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
           f"data {row_size(plan.mesh)}, {tokens}; ZeRO over data x sequence {data_size(plan.mesh)}"]
    if heads is not None:
        q, kv = heads
        out.append(f"  attention: all heads on a chunk -> {q // sp} query / {kv // sp} key-value heads on the "
                   f"whole row per device")
    out.append("  all-to-alls over each sequence group: 2 per attention layer forward (q, k, v to the head "
               "split; the output back to the token split), their 2 transposes backward (and remat's replay)")
    return "\n".join(out)


def axis_plans(plan: Plan, model: Any = None) -> list[str]:
    """The expert and sequence tables that apply to `plan` (`model`: the config's model section, for the
    sequence length and heads; None for a model given in code)."""
    seq_len = getattr(model, "seq_len", None)
    heads = (model.n_heads, model.n_kv_heads or model.n_heads) if getattr(model, "n_heads", None) else None
    return [t for t in (expert_plan(plan), sequence_plan(plan, seq_len, heads)) if t is not None]
