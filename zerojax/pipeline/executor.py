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
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from zerojax.core.collectives import PARTIAL, Placement, Shard, move, zeros_like_local
from zerojax.errors import ConfigError
from zerojax.core.mesh import STAGE, TENSOR, data_axes, data_size, row_axes, row_size, sequence_size
from zerojax.core.sequence import batch_specs, split_tokens
from zerojax.core.tensor_parallel import tensor_parallel
from zerojax.pipeline.buffers import StageRows
from zerojax.pipeline.schedule import Backward, Forward, RecvActivation, RecvGrad, Schedule


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


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline:
    """What the executor needs: the mesh, the stage rows, the schedules and the dtypes/placements.

    `param` / `grad` / `update` are placements of a device's row (dimension 0 of the local row)
    over the data-parallel axes (`data_axes`: data, and sequence with one): the parameters
    REPLICATED or Shard(0) (ZeRO-3); the gradient accumulator PARTIAL (ZeRO-0/1: each backward
    adds the device's own contribution, reduced once after the last tick) or Shard(0) (ZeRO-2/3:
    each backward's gradient is reduce-scattered at once, so the accumulator is 1/D of the row);
    the reduced gradient at the update REPLICATED or Shard(0).
    """
    mesh: Mesh
    rows: StageRows
    schedule: Schedule
    param_dtype: Any
    accum_dtype: Any
    comm_dtype: Any
    param: Placement
    update: Placement
    interval: int = 0
    grad: Placement = PARTIAL
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

    def row_spec(self, placement: Placement) -> P:
        """The rows' spec: `[S, width]`, or `[S, tensor, width]` with tensor slices; width over the
        data-parallel axes when sharded."""
        lead = (STAGE, TENSOR) if self.tensor > 1 else (STAGE,)
        return P(*lead, data_axes(self.mesh)) if isinstance(placement, Shard) else P(*lead)

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


def _stage_fn(pipe: Pipeline, v: int) -> Callable[..., tuple[Any, jax.Array]]:
    """Virtual stage v as (row, tied_in, x, micro_batch) -> (activation out, loss); the last stage
    has no activation out and the others no loss (None)."""
    rows, module = pipe.rows, pipe.rows.module
    layers = [module.layers[i] for i in rows.partition.layers(v)]
    last = v == rows.virtual - 1

    def layers_fn(params: dict[str, Any], x: Any, micro: Any) -> Any:
        out = module.run_layers(params, micro if v == 0 else x, layers, pipe.interval)
        return jnp.asarray(module.loss_fn(out, micro), jnp.float32) if last else out

    if rows.tensor > 1:  # the stage's layers on this device's tensor slices, with Megatron's collectives
        layers_fn = tensor_parallel(layers_fn, rows.stage_dims(v), TENSOR, rows.tensor,
                                    partition_activations=pipe.partition_activations)

    def run(row: jax.Array, tied_in: dict[str, jax.Array], x: Any, micro: Any) -> tuple[Any, jax.Array]:
        out = layers_fn(rows.read_stage(v, row, tied_in), x, micro)
        return (None, out) if last else (out, None)

    return run


def activation_shape(pipe: Pipeline, micro: Any) -> jax.ShapeDtypeStruct:
    """The activation passed between stages; every stage boundary must pass the same one."""
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
        if len(leaves) != 1 or leaves[0].shape != shapes[0].shape or leaves[0].dtype != shapes[0].dtype:
            raise ConfigError(
                f"PipelineModule: stage {v} passes {sh} to stage {v + 1} but stage 0 passes {shapes[0]}; "
                f"every stage boundary must carry one array of one shape (choose partition_method / "
                f"layers so that cuts fall between layers with equal outputs)")
    return shapes[0]


def _check_tables(pipe: Pipeline) -> None:
    sched, rows = pipe.schedule, pipe.rows
    if sched.stages != rows.stages or sched.chunks != rows.chunks:
        raise ValueError(f"schedule is for {sched.stages} stages x {sched.chunks} chunks but the "
                         f"rows are for {rows.stages} x {rows.chunks}")


def _enter(pipe: Pipeline, rows_local: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A device's whole row, typed per-device, and the tied vectors it receives from their owners."""
    rows = pipe.rows
    row = rows_local[0, 0] if pipe.tensor > 1 else rows_local[0]
    if isinstance(pipe.param, Shard):  # ZeRO-3: the stage's row is gathered once per step
        row = jax.lax.all_gather(row, data_axes(pipe.mesh), axis=0, tiled=True)
    # Differentiated per device: the row's gradient stays this device's contribution (PARTIAL).
    row = vary(row)
    tied_in = {}
    for t in rows.tied:
        if not t.users:
            continue
        slot = rows.slot(t.key)
        piece = jax.lax.slice_in_dim(row, slot.offset, slot.offset + slot.size)
        got = [jax.lax.ppermute(piece, STAGE, [(t.owner, u)]) for u in t.users]
        tied_in[t.key] = vary(sum(got[1:], got[0]))
    return row, tied_in


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


def _forward_branches(stage_fns: list[Callable[..., Any]], row: jax.Array, tied_in: Any,
                      act: jax.ShapeDtypeStruct) -> list[Callable[..., Any]]:
    """`lax.switch` branches `(x, micro_batch) -> (activation out, loss)`: index 0 idles, index
    v + 1 runs virtual stage v. Every branch returns the same types (zeros where a stage has no
    output or no loss), as a switch needs."""
    def zeros_act() -> jax.Array:
        return vary(jnp.zeros(act.shape, act.dtype))

    def idle(x: jax.Array, mb: Any) -> tuple[jax.Array, jax.Array]:
        return zeros_act(), vary(jnp.zeros((), jnp.float32))

    def forward(v: int) -> Callable[..., Any]:
        def branch(x: jax.Array, mb: Any) -> tuple[jax.Array, jax.Array]:
            y, loss = stage_fns[v](row, tied_in, x, mb)
            loss = jnp.zeros((), jnp.float32) if loss is None else loss
            return (zeros_act() if y is None else vary(y)), vary(loss)
        return branch

    return [idle] + [forward(v) for v in range(len(stage_fns))]


def make_grad_fn(pipe: Pipeline, *, trace: bool = False) -> Callable[..., Any]:
    """(rows [S, width], batch, loss cotangent scale) -> (mean loss, gradient rows in `update`).

    batch leaves are global `[M * dp * m, ...]`; micro-batch i is rows [i*m*dp, (i+1)*m*dp) and
    data shard d gets its d-th block of m rows, as in the unpipelined step (with a sequence axis,
    sequence device p takes chunk p of those rows' tokens). The gradient returned
    is `scale` times the gradient of the mean loss over the whole batch. With `trace`, also two
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
    update_local = pipe.update

    def local(rows_local: jax.Array, micro: Any, act: jax.ShapeDtypeStruct, scale: jax.Array) -> Any:
        me = jax.lax.axis_index(STAGE)
        row, tied_in = _enter(pipe, rows_local)
        micro = jax.tree.map(lambda x: x[:, 0], micro)
        # Each device's loss is its data shard's mean (under a sequence axis its chunk's share of
        # it, `zerojax.models.loss.masked_mean`): the batch mean is their mean over the dp devices.
        cot = vary(scale.astype(jnp.float32) / (M * dp))

        def zeros_act() -> jax.Array:
            return vary(jnp.zeros(act.shape, act.dtype))

        def no_backward(x, dy, mb, acc, acc_tied):
            return zeros_act(), acc, acc_tied

        def backward(v):
            def branch(x, dy, mb, acc, acc_tied):
                (y, loss), pullback = jax.vjp(lambda p, tv, h: stage_fns[v](p, tv, h, mb), row, tied_in, x)
                dp_, dtied, dx = pullback((None if y is None else dy, None if loss is None else cot))
                # ZeRO-2/3: reduce-scattered here, over the data group that runs this same branch.
                acc = acc + move(dp_.astype(acc.dtype), PARTIAL, pipe.grad, comm_dtype=pipe.comm_dtype)
                acc_tied = {k: a + dtied[k].astype(a.dtype) for k, a in acc_tied.items()}
                return (zeros_act() if v == 0 else vary(dx.astype(act.dtype))), acc, acc_tied
            return branch

        forwards = _forward_branches(stage_fns, row, tied_in, act)
        backwards = [no_backward] + [backward(v) for v in range(V)]

        def tick(carry: Any, xs: dict[str, jax.Array]) -> Any:
            stash, gstash, acc, acc_tied, loss_sum = carry
            at = {k: x[me] for k, x in xs.items()}
            # The forward slot runs first: the last stage's backward of micro-batch m may follow
            # its forward of m in the same tick (paired schedules).
            out_act, loss = jax.lax.switch(at["fwd"], forwards, stash[at["fwd_buf"]],
                                           jax.tree.map(lambda a: a[at["fwd_mb"]], micro))
            out_grad, acc, acc_tied = jax.lax.switch(
                at["bwd"], backwards, stash[at["bwd_buf"]], gstash[at["bwd_gbuf"]],
                jax.tree.map(lambda a: a[at["bwd_mb"]], micro), acc, acc_tied)
            act_in = jax.lax.ppermute(out_act, STAGE, fwd_perm)
            grad_in = jax.lax.ppermute(out_grad, STAGE, bwd_perm)
            stash = _store(stash, at["recv_act"], act_in)
            gstash = _store(gstash, at["recv_grad"], grad_in)
            return (stash, gstash, acc, acc_tied, loss_sum + loss), (at["fwd"], at["bwd"])

        carry = (vary(jnp.zeros((sched.act_buffers, *act.shape), act.dtype)),
                 vary(jnp.zeros((sched.grad_buffers, *act.shape), act.dtype)),
                 vary(zeros_like_local(row.shape, pipe.accum_dtype, pipe.grad, dp)),
                 {t.key: vary(jnp.zeros((rows.slot(t.key).size,), pipe.accum_dtype)) for t in tied},
                 vary(jnp.zeros((), jnp.float32)))
        xs = {k: jnp.asarray(v) for k, v in tab.items()}
        (_, _, acc, acc_tied, loss_sum), (fwd_ran, bwd_ran) = jax.lax.scan(tick, carry, xs)

        # ReduceTiedGrads: every user's gradient goes back to the owner's row (non-owners receive
        # zeros from the ppermute and add nothing).
        for t in tied:
            slot = rows.slot(t.key)
            back = [jax.lax.ppermute(acc_tied[t.key], STAGE, [(u, t.owner)]) for u in t.users]
            full = jnp.zeros(row.shape, acc.dtype).at[slot.offset:slot.offset + slot.size].set(sum(back[1:], back[0]))
            acc = acc + move(full, PARTIAL, pipe.grad, comm_dtype=pipe.comm_dtype)
        # ReduceGrads: the accumulator -> the update placement (all-reduce, reduce-scatter or nothing).
        grads = move(acc, pipe.grad, update_local, comm_dtype=pipe.comm_dtype)
        loss = jax.lax.pmean(jax.lax.psum(loss_sum, STAGE) / M, pipe.replicas)
        out = (loss, grads[None, None] if pipe.tensor > 1 else grads[None])
        if trace:  # identical over data (the tables depend on the stage only); pmax just types it so
            out += (jax.lax.pmax(fwd_ran, pipe.replicas)[:, None], jax.lax.pmax(bwd_ran, pipe.replicas)[:, None])
        return out

    def grad_fn(rows_array: jax.Array, batch: Any, scale: jax.Array | float = 1.0) -> Any:
        shaped, specs, micro0 = _split_micro_batches(pipe, batch)
        act = activation_shape(pipe, micro0)
        out_specs = (P(), pipe.row_spec(update_local)) + ((P(None, STAGE), P(None, STAGE)) if trace else ())
        mapped = jax.shard_map(
            lambda r, b, s: local(r, b, act, s), mesh=pipe.mesh,
            in_specs=(pipe.row_spec(pipe.param), specs, P()), out_specs=out_specs, check_vma=pipe.checks_vma)
        return mapped(rows_array, shaped, jnp.asarray(scale, jnp.float32))

    return grad_fn


def _store(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """buf[slot] = value where slot >= 0 (the schedule's receive); unchanged otherwise."""
    i = jnp.maximum(slot, 0)
    return buf.at[i].set(jnp.where(slot >= 0, value, buf[i]))


def make_forward_fn(pipe: Pipeline) -> Callable[[jax.Array, Any], jax.Array]:
    """(rows, batch) -> mean loss, by the forward-only schedule in `pipe.schedule`.

    batch leaves are `[M * dp * m, ...]` with M = pipe.schedule.micro_batches.
    """
    _check_tables(pipe)
    sched, rows = pipe.schedule, pipe.rows
    S, V, M = rows.stages, rows.virtual, sched.micro_batches
    tab = tables(sched)
    fwd_perm, _ = _perms(S, rows.chunks > 1)
    stage_fns = [_stage_fn(pipe, v) for v in range(V)]

    def local(rows_local: jax.Array, micro: Any, act: jax.ShapeDtypeStruct) -> jax.Array:
        me = jax.lax.axis_index(STAGE)
        row, tied_in = _enter(pipe, rows_local)
        micro = jax.tree.map(lambda x: x[:, 0], micro)

        branches = _forward_branches(stage_fns, row, tied_in, act)

        def tick(carry: Any, xs: dict[str, jax.Array]) -> Any:
            stash, loss_sum = carry
            at = {k: x[me] for k, x in xs.items()}
            mb = jax.tree.map(lambda a: a[at["fwd_mb"]], micro)
            y, loss = jax.lax.switch(at["fwd"], branches, stash[at["fwd_buf"]], mb)
            stash = _store(stash, at["recv_act"], jax.lax.ppermute(y, STAGE, fwd_perm))
            return (stash, loss_sum + loss), None

        carry = (vary(jnp.zeros((sched.act_buffers, *act.shape), act.dtype)), vary(jnp.zeros((), jnp.float32)))
        xs = {k: jnp.asarray(v) for k, v in tab.items() if k in ("fwd", "fwd_mb", "fwd_buf", "recv_act")}
        (_, loss_sum), _ = jax.lax.scan(tick, carry, xs)
        return jax.lax.pmean(jax.lax.psum(loss_sum, STAGE) / M, pipe.replicas)

    def forward_fn(rows_array: jax.Array, batch: Any) -> jax.Array:
        shaped, specs, micro0 = _split_micro_batches(pipe, batch)
        act = activation_shape(pipe, micro0)
        mapped = jax.shard_map(lambda r, b: local(r, b, act), mesh=pipe.mesh,
                               in_specs=(pipe.row_spec(pipe.param), specs), out_specs=P(),
                               check_vma=pipe.checks_vma)
        return mapped(rows_array, shaped)

    return forward_fn
