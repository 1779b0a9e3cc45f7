"""The pipelined train and eval steps: the executor's gradients into the shared `apply_update`.

A pipeline's model state is one tree, `{"stages": [S, width]}` (with expert weights also
`"expert_stages": [S, ep, width]`; buffers.py), laid out by the
ordinary ZeRO `plan` with its dimension 0 split over `stage` (`plan(..., lead="stage")`). So the
optimizer step is literally the unpipelined one (`zerojax.apply_update`): unscale, finite check,
global-norm clipping, the optax update on the ZeRO-sharded fp32 master, loss-scaler update and the
parameter re-gather all run unchanged, and checkpoints save and restore the state as they do for
any plan. ZeRO composes over the data-parallel devices inside each stage (`data`, with a sequence
axis data x sequence):

* stage 0 all-reduces the row gradient once per step, stage 1 reduce-scatters it once (what
  DeepSpeed allows with pipelines);
* stage 2 reduce-scatters each backward's gradient as soon as it is computed, inside the
  schedule's backward branch (the data group of a stage always runs the same branch, so the
  collective has all its participants), and accumulates 1/D of the row;
* stage 3 does the same and also keeps the row sharded over `data` between steps, all-gathering
  it once per step at the start of the schedule: parameters at rest are 1/D per device, during the
  step a stage's whole row (not one layer at a time, as the unpipelined stage 3 does).

Every stage gives the unpipelined model's parameters (tests/test_pipeline.py); DeepSpeed forbids
pipelines with ZeRO >= 2.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from zerojax.core.collectives import Placement, Shard
from zerojax.core.layout import MemoryReport, Plan
from zerojax.core.mesh import EXPERT, STAGE, TENSOR, row_size
from zerojax.core.once import once_options
from zerojax.core.state import TrainState, state_shardings
from zerojax.core.step import apply_update, check_batch, check_eval_batch, checked_kernels, loss_scale, step_key
from zerojax.errors import ConfigError
from zerojax.pipeline.buffers import EXPERT_ROWS, ROWS, StageRows
from zerojax.pipeline.executor import Pipeline, make_forward_fn, make_grad_fn
from zerojax.pipeline.module import PipelineModule
from zerojax.pipeline.schedule import Schedule, build

__all__ = ["EXPERT_ROWS", "ROWS", "PipelinePlan", "init_rows", "make_pipeline_eval_step", "make_pipeline_train_step",
           "pack_params", "row_placement"]


def row_placement(p: Placement) -> Placement:
    """A placement of the `[S, width]` (or `[S, tensor, width]`) leaf, seen on one device's row."""
    return Shard(0) if isinstance(p, Shard) else p


@dataclasses.dataclass(frozen=True, eq=False)
class PipelinePlan:
    """The ZeRO plan of the stage rows plus everything the executor needs."""
    plan: Plan
    module: PipelineModule
    rows: StageRows
    train: Pipeline

    @property
    def schedule(self) -> Schedule:
        return self.train.schedule

    @property
    def stages(self) -> int:
        return self.rows.stages

    def eval_pipeline(self, micro_batches: int) -> Pipeline:
        return dataclasses.replace(self.train, schedule=build("inference", self.stages, micro_batches,
                                                              self.rows.chunks))

    def memory_report(self) -> MemoryReport:
        """Per-device bytes against the ZeRO formula for one stage's row (what a device holds: with expert
        leaves, its stage row and its expert row)."""
        r = self.plan.report()
        s = self.stages
        width = self.rows.width + (self.rows.experts.width if self.rows.experts is not None else 0)
        return r._replace(n_params=width, formula_params=r.formula_params / s,
                          formula_grads=r.formula_grads / s, formula_optimizer=r.formula_optimizer / s)

    def table(self) -> str:
        sched = self.schedule
        return "\n".join([self.rows.table(),
                          f"schedule {sched.name}: {sched.micro_batches} micro-batches, {sched.num_ticks} ticks, "
                          f"idle {100 * sched.idle_fraction:.1f}% (textbook bubble "
                          f"{100 * sched.bubble:.1f}%), {sched.act_buffers} activation slots per stage"])


def init_rows(pp: PipelinePlan, key: jax.Array | int = 0) -> dict[str, jax.Array]:
    """Fresh fp32 rows in the update placement; each stage creates only the parameters it stores (and
    each expert device only its slice of the expert rows).

    Parameters depend on the key and the layer index only (`PipelineModule.init_layer`), so any
    partition gives the model `module.init(key)` gives.
    """
    key = jax.random.key(key) if isinstance(key, int) else key
    rows = pp.rows
    sliced = rows.tensor > 1
    experts = rows.experts
    split = experts is not None and experts.size > 1

    def branch(device: int) -> Callable[[], dict[str, jax.Array]]:
        def make() -> dict[str, jax.Array]:
            params = {k: pp.module.init_layer(k, key) for k in rows.slots[device]}
            block = jax.lax.axis_index(TENSOR) if sliced else 0
            out = {ROWS: rows.pack_device(device, params, jnp.float32, block)}
            if experts is not None:
                out[EXPERT_ROWS] = experts.pack_device(device, params, jnp.float32,
                                                       jax.lax.axis_index(EXPERT) if split else 0)
            return out
        return make

    def local() -> dict[str, jax.Array]:
        out = jax.lax.switch(jax.lax.axis_index(STAGE), [branch(d) for d in range(rows.stages)])
        return {name: x[(None,) * (2 if name == EXPERT_ROWS or sliced else 1)] for name, x in out.items()}

    P = jax.sharding.PartitionSpec
    specs = {ROWS: P(STAGE, TENSOR) if sliced else P(STAGE)}
    if experts is not None:
        specs[EXPERT_ROWS] = P(STAGE, EXPERT if split else None)
    mapped = jax.shard_map(local, mesh=pp.plan.mesh, in_specs=(), out_specs=specs, check_vma=False)
    return jax.jit(mapped, out_shardings=pp.plan.update_shardings, compiler_options=once_options(pp.plan.mesh))()


def pack_params(pp: PipelinePlan, params: dict[str, Any]) -> dict[str, jax.Array]:
    """Logical parameters (`module.init()`-shaped) -> rows in the update placement."""
    want = pp.module.abstract_params()
    if jax.tree.structure(params) != jax.tree.structure(want) or any(
            tuple(a.shape) != tuple(b.shape) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want))):
        raise ConfigError(f"initialize: params= does not match the PipelineModule's parameters; expected the "
                          f"structure of module.init(): {jax.tree.map(lambda x: tuple(x.shape), want)}")
    return jax.jit(lambda p: pp.rows.pack(p, jnp.float32), out_shardings=pp.plan.update_shardings)(params)


def make_pipeline_train_step(pp: PipelinePlan) -> Callable[[TrainState, Any], Any]:
    """A jitted `step(state, batch) -> (state, metrics)`, metrics as the unpipelined step's."""
    grad_fn = make_grad_fn(pp.train)
    plan = checked_kernels(pp.plan)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        check_batch(plan, batch)
        loss, grads = grad_fn(state.params, batch, loss_scale(plan, state), step_key(state))
        return apply_update(plan, state, grads, loss)

    shardings = state_shardings(plan)
    return jax.jit(step, in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0)


def eval_micro_batches(pp: PipelinePlan, rows_per_shard: int) -> int:
    """Micro-batches for an eval batch: the training count when it divides the rows, else the
    largest divisor of the rows below it (interleaved: a multiple of S, else 1 chunk-group)."""
    gas = pp.schedule.micro_batches
    for m in range(min(gas, rows_per_shard), 0, -1):
        if rows_per_shard % m == 0 and (pp.rows.chunks == 1 or m % pp.stages == 0):
            return m
    raise ConfigError(f"eval batch: {rows_per_shard} rows per data shard cannot be split into a multiple "
                      f"of mesh.stage={pp.stages} micro-batches for the interleaved schedule")


class PipelineEvalStep:
    """`eval_step(params, batch) -> mean loss` through the forward-only schedule, one jitted program per
    micro-batch count (the batch's rows decide it). `lower(params, batch)` lowers the program that batch
    runs, as a jitted step's does: a multi-process run compares it across processes before its first
    call (`Engine._agreed`)."""

    def __init__(self, pp: PipelinePlan):
        self.pp = pp

    @functools.lru_cache(maxsize=None)
    def _program(self, micro_batches: int) -> Any:
        fwd = make_forward_fn(self.pp.eval_pipeline(micro_batches))
        return jax.jit(fwd, in_shardings=(self.pp.plan.param_shardings, None))

    def _for(self, batch: Any) -> Any:
        plan = self.pp.plan
        check_eval_batch(plan, batch)
        rows = jax.tree.leaves(batch)[0].shape[0] // row_size(plan.mesh)
        return self._program(eval_micro_batches(self.pp, rows))

    def __call__(self, params: Any, batch: Any) -> jax.Array:
        return self._for(batch)(params, batch)

    def lower(self, params: Any, batch: Any) -> Any:
        return self._for(batch).lower(params, batch)


def make_pipeline_eval_step(pp: PipelinePlan) -> PipelineEvalStep:
    """`eval_step(params, batch) -> mean loss` through the forward-only schedule."""
    return PipelineEvalStep(pp)
