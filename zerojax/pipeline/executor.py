"""Running a schedule: one `jax.shard_map` over the (`stage`, data-parallel) mesh, one `lax.scan` over ticks.

The schedule (schedule.py) is turned into integer tables `[ticks, stages]` - which branch each
stage runs, on which micro-batch, reading which buffer slot, and where to store what it receives -
and the scan walks them. Every tick, on every device:

1. compute: a tick has a forward slot and a backward slot. One `lax.switch` on the table entry
   runs nothing or the forward of virtual stage v, a second one nothing or the backward of
   virtual stage v (GPipe and DeepSpeed's 1F1B fill at most one slot per tick; the paired
   schedules fill both in their steady state). A stage is heterogeneous code (the first embeds
   tokens, the last computes the loss), and the switch is how different stages run different
   code inside one SPMD program: a device only executes its own branch. Parameters come from the
   device's row of the `[S, width]` stage buffer (buffers.py).
2. communicate: one `lax.ppermute` sends every stage's forward output to stage s+1, one sends every
   backward's input-gradient to stage s-1 (collectives stay outside the switch, so every device
   takes part in every one; a stage that produced nothing sends zeros that nobody stores). The
   permutation is over `stage` only, so each device sends to the device with the same data (and
   sequence, tensor) coordinates in the next stage: with a `sequence` axis (Ulysses) an activation
   is a sequence chunk, passed from chunk holder to chunk holder.
3. store: a stage that receives in this tick (table entry >= 0) writes into the slot the schedule
   allocated for that micro-batch.

An activation is an array or a tuple of arrays (a MoE model passes its load-balancing loss beside the
hidden states): buffers, sends and stores go leaf by leaf.

Backward recomputes the stage's forward from its stored *input* and backpropagates at once
(`jax.vjp` inside the branch), so what a stage keeps per in-flight micro-batch is one activation,
the schedule's slot count bounds activation memory (1F1B: S slots, GPipe: M), and residuals of
different stages are never mixed. `activation_checkpoint_interval` k additionally rematerializes
each run of k layers inside that recomputation.

Gradients: shard_map's autodiff is not used (jax.vjp runs inside the body), and the trap of
shard_map's implicit psum is avoided explicitly: the row is cast to data-varying before it is
differentiated, so its gradient is this device's contribution (PARTIAL over the data-parallel
devices, `zerojax.core.mesh.data_axes`: data, and sequence where each device holds a chunk of the
rows' tokens), never an implicit psum. ZeRO-0/1 add it to a whole-row accumulator reduced once
after the last tick (all-reduce, or reduce-scatter into the update placement); ZeRO-2/3
reduce-scatter it inside the backward branch - every device of a stage's data group runs the same
branch in the same tick, so the collective has all its participants - into an accumulator of 1/D
of the row. Tied parameters are received from their owner stage before the first tick; their
gradients are sent back and added into the owner's row after the last one.

The parameters are one or two arrays of rows (`RowGroup`): the stage rows, and for a mixture of experts
the expert rows, whose width is ZeRO-sharded and whose gradient is summed over the expert-data-parallel
devices only (each device of an expert group holds other experts; the all-to-all's transpose has already
brought every token's contribution to its expert). Both go through the same gathers and reductions.

Layers that draw noise (a MoE gate's) get a key per step, data shard, micro-batch and layer, the same in
a micro-batch's forward and in its backward's recomputation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from zerojax.core.collectives import PARTIAL, REPLICATED, Placement, Shard, move, zeros_like_local
from zerojax.errors import ConfigError
from zerojax.core.mesh import (STAGE, TENSOR, DataAxis, axes_size, data_axes, data_size, row_axes, row_size,
                               sequence_size)
from zerojax.core.sequence import batch_specs, split_tokens
from zerojax.pipeline.buffers import ROWS, StageRows
from zerojax.pipeline.schedule import Backward, Forward, RecvActivation, RecvGrad, Schedule
from zerojax.rewrite import on_tensor_slices


def vary(x: Any, axes: tuple[str, ...] | None = None) -> Any:
    """Type `x` as varying over `axes` (default: every manual axis of the mesh being traced; a no-op
    for axes it already varies over)."""
    axes = tuple(jax.sharding.get_abstract_mesh().axis_names) if axes is None else axes

    def one(leaf: Any) -> Any:
        varying = getattr(getattr(jax.typeof(leaf), "mat", None), "varying", None)
        if varying is None:  # a shard_map that does not check varying axes: nothing to type
            return leaf
        missing = tuple(a for a in axes if a not in varying)
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf
    return jax.tree.map(one, x)


def tables(schedule: Schedule) -> dict[str, np.ndarray]:
    """The schedule as `[ticks, stages]` int32 tables the scan reads.

    A tick has a forward slot and a backward slot per stage. fwd / bwd: 0 for an empty slot, else
    1 + v for virtual stage v; *_mb the micro-batch; *_buf the activation slot holding its input;
    bwd_gbuf the slot holding its output gradient; recv_act / recv_grad the slot that data arriving
    at the end of the tick goes to (-1: nothing arrives).
    """
    t, s = schedule.num_ticks, schedule.stages
    keys = (("fwd", 0), ("fwd_mb", 0), ("fwd_buf", 0), ("bwd", 0), ("bwd_mb", 0), ("bwd_buf", 0),
            ("bwd_gbuf", 0), ("recv_act", -1), ("recv_grad", -1))
    out = {k: np.full((t, s), fill, np.int32) for k, fill in keys}
    for tick in range(t):
        for stage in range(s):
            for ins in schedule.ticks[tick][stage]:
                if isinstance(ins, (Forward, Backward)):
                    slot = "fwd" if isinstance(ins, Forward) else "bwd"
                    out[slot][tick, stage] = 1 + ins.chunk * s + stage
                    out[f"{slot}_mb"][tick, stage] = ins.micro_batch
                    out[f"{slot}_buf"][tick, stage] = max(ins.buffer, 0)
                    if isinstance(ins, Backward):
                        out["bwd_gbuf"][tick, stage] = max(ins.grad_buffer, 0)
                elif isinstance(ins, RecvActivation):
                    out["recv_act"][tick, stage] = ins.buffer
                elif isinstance(ins, RecvGrad):
                    out["recv_grad"][tick, stage] = ins.buffer
    return out


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """One array of rows as the executor handles it.

    `param` / `grad` / `update` are placements of a device's row (dimension 0 of the local row)
    over `zero`, the devices its width is ZeRO-sharded over and its gradient summed over (the stage
    rows: every data-parallel device, `data_axes`; the expert rows: the expert-data-parallel ones): the
    parameters REPLICATED or Shard(0) (ZeRO-3); the gradient accumulator PARTIAL (ZeRO-0/1: each
    backward adds the device's own contribution, reduced once after the last tick) or Shard(0)
    (ZeRO-2/3: each backward's gradient is reduce-scattered at once, so the accumulator is 1/D of the
    row); the reduced gradient at the update REPLICATED or Shard(0). `param_spec` / `update_spec` are
    the whole array's PartitionSpecs; `lead` the leading dimensions of a device's block before its width
    (1: `[1, width]`; 2: `[1, 1, width]`, a tensor or expert slice).
    """
    name: str
    zero: DataAxis
    param: Placement
    grad: Placement
    update: Placement
    param_spec: P
    update_spec: P
    lead: int = 1


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline:
    """What the executor needs: the mesh, the stage rows, the schedules, the dtypes and the row groups
    (`RowGroup`, the stage rows first)."""
    mesh: Mesh
    rows: StageRows
    schedule: Schedule
    param_dtype: Any
    accum_dtype: Any
    comm_dtype: Any
    groups: tuple[RowGroup, ...]
    interval: int = 0
    partition_activations: bool = False  # tensor slices: checkpointed layers keep their inputs split

    @property
    def stages(self) -> int:
        return self.rows.stages

    @property
    def data_size(self) -> int:
        """Devices a row is ZeRO-sharded and its gradient reduced over (data x sequence)."""
        return data_size(self.mesh)

    @property
    def row_size(self) -> int:
        """Shards of each micro-batch's rows (data; the sequence axis splits tokens, not rows)."""
        return row_size(self.mesh)

    @property
    def tensor(self) -> int:
        return self.rows.tensor

    def specs(self, which: str) -> dict[str, P]:
        """Per row group, the PartitionSpec of its parameters (`param`) or reduced gradients (`update`)."""
        return {g.name: getattr(g, f"{which}_spec") for g in self.groups}

    @property
    def checks_vma(self) -> bool:
        """shard_map's varying-axes check stays on without tensor slices. The tensor-parallel evaluator
        re-binds a jaxpr traced outside `shard_map` (no varying types), as `gather_at_use` does, and
        its custom VJPs place every tensor collective themselves."""
        return self.tensor == 1

    @property
    def replicas(self) -> tuple[str, ...]:
        """Axes the loss is averaged over: the data-parallel ones (each data shard's mean; under a
        sequence axis each chunk's share of it), and tensor (its slices give one value)."""
        data = data_axes(self.mesh)
        data = (data,) if isinstance(data, str) else tuple(data)
        return (*data, TENSOR) if self.tensor > 1 else data


def _perms(stages: int, cyclic: bool) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    fwd = [(s, s + 1) for s in range(stages - 1)] + ([(stages - 1, 0)] if cyclic else [])
    bwd = [(s + 1, s) for s in range(stages - 1)] + ([(0, stages - 1)] if cyclic else [])
    return fwd, bwd


def _stage_fn(pipe: Pipeline, v: int, deterministic: bool = False) -> Callable[..., tuple[Any, jax.Array]]:
    """Virtual stage v as (rows, tied_in, x, micro_batch, rng) -> (activation out, loss); the last stage
    has no activation out and the others no loss (None). `deterministic`: evaluation (layers in eval mode)."""
    rows, module = pipe.rows, pipe.rows.module
    layers = [module.layers[i] for i in rows.partition.layers(v)]
    last = v == rows.virtual - 1

    def layers_fn(params: dict[str, Any], x: Any, micro: Any, rng: Any) -> Any:
        out = module.run_layers(params, micro if v == 0 else x, layers, pipe.interval, rng, deterministic)
        return jnp.asarray(module.loss_fn(out, micro), jnp.float32) if last else out

    if rows.tensor > 1:  # the stage's layers on this device's tensor slices, with Megatron's collectives
        layers_fn = on_tensor_slices(layers_fn, rows.stage_dims(v), rows.tensor,
                                     partition_activations=pipe.partition_activations)

    def run(arrays: dict[str, jax.Array], tied_in: dict[str, jax.Array], x: Any, micro: Any,
            rng: Any = None) -> tuple[Any, jax.Array]:
        out = layers_fn(rows.read_stage(v, arrays, tied_in), x, micro, rng)
        return (None, out) if last else (out, None)

    return run


def activation_shape(pipe: Pipeline, micro: Any) -> Any:
    """The activation passed between stages (an array's or a tuple of arrays' shapes); every stage
    boundary must pass the same one."""
    rows, module = pipe.rows, pipe.rows.module
    abstract = {k: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, pipe.param_dtype), p)
                for k, p in module.abstract_params().items()}
    x, shapes = micro, []
    for v in range(rows.virtual - 1):
        layers = [module.layers[i] for i in rows.partition.layers(v)]
        x = jax.eval_shape(lambda p, h: module.run_layers(p, h, layers), abstract, x)
        shapes.append(x)
    if not shapes:
        return jax.ShapeDtypeStruct((), jnp.float32)
    for v, sh in enumerate(shapes):
        leaves = jax.tree.leaves(sh)
        if (jax.tree.structure(sh) != jax.tree.structure(shapes[0]) or not leaves
                or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(leaves, jax.tree.leaves(shapes[0])))):
            raise ConfigError(
                f"PipelineModule: stage {v} passes {sh} to stage {v + 1} but stage 0 passes {shapes[0]}; "
                f"every stage boundary must carry the same arrays of the same shapes (choose partition_method "
                f"/ layers so that cuts fall between layers with equal outputs)")
    return shapes[0]


def _zeros(shapes: Any, lead: tuple[int, ...] = ()) -> Any:
    """Zeros (typed per device) shaped like an activation, with `lead` extra leading dimensions (buffers)."""
    return jax.tree.map(lambda a: vary(jnp.zeros((*lead, *a.shape), a.dtype)), shapes)


def _at(buffers: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda b: b[i], buffers)


def _check_tables(pipe: Pipeline) -> None:
    sched, rows = pipe.schedule, pipe.rows
    if sched.stages != rows.stages or sched.chunks != rows.chunks:
        raise ValueError(f"schedule is for {sched.stages} stages x {sched.chunks} chunks but the "
                         f"rows are for {rows.stages} x {rows.chunks}")


def _enter(pipe: Pipeline, local: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """A device's whole rows (per group), typed per-device, and the tied vectors it receives from their owners."""
    rows, out = pipe.rows, {}
    for g in pipe.groups:
        row = local[g.name][(0,) * g.lead]
        if isinstance(g.param, Shard):  # ZeRO-3: the stage's row is gathered once per step
            row = jax.lax.all_gather(row, g.zero, axis=0, tiled=True)
        # Differentiated per device: the row's gradient stays this device's contribution (PARTIAL).
        out[g.name] = vary(row)
    tied_in = {}
    for t in rows.tied:
        if not t.users:
            continue
        slot = rows.slot(t.key)
        piece = jax.lax.slice_in_dim(out[ROWS], slot.offset, slot.offset + slot.size)
        got = [jax.lax.ppermute(piece, STAGE, [(t.owner, u)]) for u in t.users]
        tied_in[t.key] = vary(sum(got[1:], got[0]))
    return out, tied_in


def _split_micro_batches(pipe: Pipeline, batch: Any) -> tuple[Any, Any, Any]:
    """Global `[M * dp * m, ...]` leaves -> `(M, dp, m, ...)`, their specs (rows over the row axes) and
    one micro-batch's abstract value on one device.

    With a `sequence` axis the batch is first turned into `inputs` / `labels`
    (`zerojax.core.sequence.split_tokens`) and dimension 1 of each micro-batch leaf is split over it:
    a device's micro-batch is its chunk of each of its rows' tokens."""
    m_count, dp, sp = pipe.schedule.micro_batches, pipe.row_size, sequence_size(pipe.mesh)
    batch = split_tokens(batch, sp)
    rows = jax.tree.leaves(batch)[0].shape[0]
    if rows % (m_count * dp):
        raise ValueError(f"batch: {rows} rows do not split into {m_count} micro-batches x {dp} data shards")
    m = rows // (m_count * dp)
    shaped = jax.tree.map(lambda x: x.reshape(m_count, dp, m, *x.shape[1:]), batch)

    def local(x: jax.Array) -> jax.ShapeDtypeStruct:
        tail = list(x.shape[3:])
        if tail:
            tail[0] //= sp  # the tokens (a no-op without a sequence axis)
        return jax.ShapeDtypeStruct((m, *tail), x.dtype)

    return shaped, batch_specs(shaped, row_axes(pipe.mesh), 1, sp, micro=True), jax.tree.map(local, shaped)


def _forward_branches(stage_fns: list[Callable[..., Any]], rows: dict[str, jax.Array], tied_in: Any,
                      act: Any, rng_of: Callable[[Any], Any]) -> list[Callable[..., Any]]:
    """`lax.switch` branches `(x, micro_batch, micro-batch index) -> (activation out, loss)`: index 0
    idles, index v + 1 runs virtual stage v. Every branch returns the same types (zeros where a stage
    has no output or no loss), as a switch needs."""
    def idle(x: Any, mb: Any, i: jax.Array) -> tuple[Any, jax.Array]:
        return _zeros(act), vary(jnp.zeros((), jnp.float32))

    def forward(v: int) -> Callable[..., Any]:
        def branch(x: Any, mb: Any, i: jax.Array) -> tuple[Any, jax.Array]:
            y, loss = stage_fns[v](rows, tied_in, x, mb, rng_of(i))
            loss = jnp.zeros((), jnp.float32) if loss is None else loss
            return (_zeros(act) if y is None else vary(y)), vary(loss)
        return branch

    return [idle] + [forward(v) for v in range(len(stage_fns))]


def _keys(pipe: Pipeline, key: Any) -> Callable[[Any], Any]:
    """micro-batch index -> the key its layers fold their index into: the step's key folded with this
    device's data-parallel index and the micro-batch (None without a key)."""
    if key is None:
        return lambda i: None
    shard = jax.random.fold_in(jax.random.wrap_key_data(key), jax.lax.axis_index(data_axes(pipe.mesh)))
    return lambda i: jax.random.fold_in(shard, i)


def make_grad_fn(pipe: Pipeline, *, trace: bool = False) -> Callable[..., Any]:
    """(params {group: rows}, batch, loss cotangent scale, key) -> (mean loss, gradient rows in `update`).

    batch leaves are global `[M * dp * m, ...]`; micro-batch i is rows [i*m*dp, (i+1)*m*dp) and
    data shard d gets its d-th block of m rows, as in the unpipelined step (with a sequence axis,
    sequence device p takes chunk p of those rows' tokens). The gradient returned
    is `scale` times the gradient of the mean loss over the whole batch. `key` (raw key data, or None)
    feeds the layers that draw noise. With `trace`, also two
    `[ticks, stages]` tables of the branches each device's forward and backward switches executed
    (0: none, 1 + v: virtual stage v).
    """
    _check_tables(pipe)
    sched, rows = pipe.schedule, pipe.rows
    S, V, M, dp = rows.stages, rows.virtual, sched.micro_batches, pipe.data_size  # dp: data x sequence
    tab = tables(sched)
    fwd_perm, bwd_perm = _perms(S, rows.chunks > 1)
    stage_fns = [_stage_fn(pipe, v) for v in range(V)]
    tied = [t for t in rows.tied if t.users]
    groups = pipe.groups

    def local(rows_local: dict[str, jax.Array], micro: Any, act: Any, scale: jax.Array, key: Any) -> Any:
        me = jax.lax.axis_index(STAGE)
        row, tied_in = _enter(pipe, rows_local)
        rng_of = _keys(pipe, key)
        micro = jax.tree.map(lambda x: x[:, 0], micro)
        # Each device's loss is its data shard's mean (under a sequence axis its chunk's share of
        # it, `zerojax.models.loss.masked_mean`): the batch mean is their mean over the dp devices.
        cot = vary(scale.astype(jnp.float32) / (M * dp))

        def no_backward(x, dy, mb, i, acc, acc_tied):
            return _zeros(act), acc, acc_tied

        def backward(v):
            def branch(x, dy, mb, i, acc, acc_tied):
                (y, loss), pullback = jax.vjp(lambda p, tv, h: stage_fns[v](p, tv, h, mb, rng_of(i)),
                                              row, tied_in, x)
                dp_, dtied, dx = pullback((None if y is None else dy, None if loss is None else cot))
                # ZeRO-2/3: reduce-scattered here, over the data group that runs this same branch.
                acc = {g.name: acc[g.name] + move(dp_[g.name].astype(acc[g.name].dtype), PARTIAL, g.grad,
                                                  comm_dtype=pipe.comm_dtype, axis=g.zero) for g in groups}
                acc_tied = {k: a + dtied[k].astype(a.dtype) for k, a in acc_tied.items()}
                dx = _zeros(act) if v == 0 else jax.tree.map(lambda d, a: vary(d.astype(a.dtype)), dx, act)
                return dx, acc, acc_tied
            return branch

        forwards = _forward_branches(stage_fns, row, tied_in, act, rng_of)
        backwards = [no_backward] + [backward(v) for v in range(V)]

        def tick(carry: Any, xs: dict[str, jax.Array]) -> Any:
            stash, gstash, acc, acc_tied, loss_sum = carry
            at = {k: x[me] for k, x in xs.items()}
            # The forward slot runs first: the last stage's backward of micro-batch m may follow
            # its forward of m in the same tick (paired schedules).
            out_act, loss = jax.lax.switch(at["fwd"], forwards, _at(stash, at["fwd_buf"]),
                                           _at(micro, at["fwd_mb"]), at["fwd_mb"])
            out_grad, acc, acc_tied = jax.lax.switch(
                at["bwd"], backwards, _at(stash, at["bwd_buf"]), _at(gstash, at["bwd_gbuf"]),
                _at(micro, at["bwd_mb"]), at["bwd_mb"], acc, acc_tied)
            act_in = jax.lax.ppermute(out_act, STAGE, fwd_perm)
            grad_in = jax.lax.ppermute(out_grad, STAGE, bwd_perm)
            stash = _store(stash, at["recv_act"], act_in)
            gstash = _store(gstash, at["recv_grad"], grad_in)
            return (stash, gstash, acc, acc_tied, loss_sum + loss), (at["fwd"], at["bwd"])

        acc0 = {g.name: _accumulator(pipe, g, row[g.name].shape) for g in groups}
        carry = (_zeros(act, (sched.act_buffers,)), _zeros(act, (sched.grad_buffers,)), acc0,
                 {t.key: vary(jnp.zeros((rows.slot(t.key).size,), pipe.accum_dtype)) for t in tied},
                 vary(jnp.zeros((), jnp.float32)))
        xs = {k: jnp.asarray(v) for k, v in tab.items()}
        (_, _, acc, acc_tied, loss_sum), (fwd_ran, bwd_ran) = jax.lax.scan(tick, carry, xs)

        # ReduceTiedGrads: every user's gradient goes back to the owner's row (non-owners receive
        # zeros from the ppermute and add nothing).
        dense = groups[0]
        for t in tied:
            slot = rows.slot(t.key)
            back = [jax.lax.ppermute(acc_tied[t.key], STAGE, [(u, t.owner)]) for u in t.users]
            full = jnp.zeros(row[ROWS].shape, pipe.accum_dtype).at[slot.offset:slot.offset + slot.size].set(
                sum(back[1:], back[0]))
            acc[ROWS] = acc[ROWS] + move(full, PARTIAL, dense.grad, comm_dtype=pipe.comm_dtype, axis=dense.zero)
        # ReduceGrads: the accumulator -> the update placement (all-reduce, reduce-scatter or nothing).
        grads = {g.name: move(acc[g.name], g.grad, g.update, comm_dtype=pipe.comm_dtype, axis=g.zero)[(None,) * g.lead]
                 for g in groups}
        loss = jax.lax.pmean(jax.lax.psum(loss_sum, STAGE) / M, pipe.replicas)
        out = (loss, grads)
        if trace:  # identical over data (the tables depend on the stage only); pmax just types it so
            out += (jax.lax.pmax(fwd_ran, pipe.replicas)[:, None], jax.lax.pmax(bwd_ran, pipe.replicas)[:, None])
        return out

    def grad_fn(params: dict[str, jax.Array], batch: Any, scale: jax.Array | float = 1.0, key: Any = None) -> Any:
        shaped, specs, micro0 = _split_micro_batches(pipe, batch)
        act = activation_shape(pipe, micro0)
        out_specs = (P(), pipe.specs("update")) + ((P(None, STAGE), P(None, STAGE)) if trace else ())
        keyed = key is not None
        mapped = jax.shard_map(lambda r, b, s, k: local(r, b, act, s, k if keyed else None), mesh=pipe.mesh,
                               in_specs=(pipe.specs("param"), specs, P(), P()), out_specs=out_specs,
                               check_vma=pipe.checks_vma)
        return mapped({g.name: params[g.name] for g in groups}, shaped, jnp.asarray(scale, jnp.float32),
                      key if keyed else jnp.zeros((), jnp.uint32))

    return grad_fn


def _accumulator(pipe: Pipeline, group: RowGroup, shape: tuple[int, ...]) -> jax.Array:
    """A row group's zero gradient accumulator, typed per device except over the axes a REPLICATED
    accumulator is already reduced over (its ZeRO group of one device: every backward all-reduces into it)."""
    zeros = zeros_like_local(shape, pipe.accum_dtype, group.grad, axes_size(pipe.mesh, group.zero))
    if group.grad != REPLICATED:
        return vary(zeros)
    zero = (group.zero,) if isinstance(group.zero, str) else tuple(group.zero)
    return vary(zeros, tuple(a for a in pipe.mesh.axis_names if a not in zero))


def _store(buf: Any, slot: jax.Array, value: Any) -> Any:
    """buf[slot] = value where slot >= 0 (the schedule's receive); unchanged otherwise (leaf by leaf)."""
    i = jnp.maximum(slot, 0)
    return jax.tree.map(lambda b, x: b.at[i].set(jnp.where(slot >= 0, x, b[i])), buf, value)


def make_forward_fn(pipe: Pipeline) -> Callable[[dict[str, jax.Array], Any], jax.Array]:
    """(params {group: rows}, batch) -> mean loss, by the forward-only schedule in `pipe.schedule`, every
    layer in eval mode.

    batch leaves are `[M * dp * m, ...]` with M = pipe.schedule.micro_batches.
    """
    _check_tables(pipe)
    sched, rows = pipe.schedule, pipe.rows
    S, V, M = rows.stages, rows.virtual, sched.micro_batches
    tab = tables(sched)
    fwd_perm, _ = _perms(S, rows.chunks > 1)
    stage_fns = [_stage_fn(pipe, v, deterministic=True) for v in range(V)]

    def local(rows_local: dict[str, jax.Array], micro: Any, act: Any) -> jax.Array:
        me = jax.lax.axis_index(STAGE)
        row, tied_in = _enter(pipe, rows_local)
        micro = jax.tree.map(lambda x: x[:, 0], micro)

        branches = _forward_branches(stage_fns, row, tied_in, act, lambda i: None)

        def tick(carry: Any, xs: dict[str, jax.Array]) -> Any:
            stash, loss_sum = carry
            at = {k: x[me] for k, x in xs.items()}
            y, loss = jax.lax.switch(at["fwd"], branches, _at(stash, at["fwd_buf"]), _at(micro, at["fwd_mb"]),
                                     at["fwd_mb"])
            stash = _store(stash, at["recv_act"], jax.lax.ppermute(y, STAGE, fwd_perm))
            return (stash, loss_sum + loss), None

        carry = (_zeros(act, (sched.act_buffers,)), vary(jnp.zeros((), jnp.float32)))
        xs = {k: jnp.asarray(v) for k, v in tab.items() if k in ("fwd", "fwd_mb", "fwd_buf", "recv_act")}
        (_, loss_sum), _ = jax.lax.scan(tick, carry, xs)
        return jax.lax.pmean(jax.lax.psum(loss_sum, STAGE) / M, pipe.replicas)

    def forward_fn(params: dict[str, jax.Array], batch: Any) -> jax.Array:
        shaped, specs, micro0 = _split_micro_batches(pipe, batch)
        act = activation_shape(pipe, micro0)
        mapped = jax.shard_map(lambda r, b: local(r, b, act), mesh=pipe.mesh,
                               in_specs=(pipe.specs("param"), specs), out_specs=P(),
                               check_vma=pipe.checks_vma)
        return mapped({g.name: params[g.name] for g in pipe.groups}, shaped)

    return forward_fn
