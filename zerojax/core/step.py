"""The pure train and eval steps: one jitted function for every ZeRO stage.

The step reads placements from the plan and moves gradients between them with explicit
collectives (collectives.move); it has no notion of "stage". Per optimizer step:

1. `make_grad_fn`, inside `shard_map` over `data`: for each micro-batch (a `lax.scan`), the
   gradient of the device's rows times the loss scale (the 1/dp of the mean applied around the
   reduction, as DeepSpeed applies it: `grad_average`), moved into the accumulator's placement
   (stage 2/3: reduce-scattered every micro-step; stage 0/1: kept PARTIAL and reduced once, at the
   boundary); at the boundary, the accumulator moved into the update placement (all-reduce for
   stage 0, reduce-scatter for stage 1, nothing for 2/3);
2. `apply_update`, under the automatic partitioner: unscale, finite check, global-norm clipping,
   the optax update on the (sharded) fp32 master copy, skipping the step on overflow, the loss
   scaler's update, and the cast + all-gather back to the parameter placement.

Frozen leaves (`LeafLayout.trainable` false) are a layout, not a branch: the tree is split once into
its trainable and frozen parts (`plan.trained` / `plan.frozen`), the loss is differentiated w.r.t.
the first with the second closed over, and gradients, master, optimizer state, clipping, the norm
and the finiteness flags are trees of the trainable leaves only.

Anything that produces gradients in the update placement (the pipeline executor does) reuses
`apply_update`, so precision, clipping, schedules and skipping behave the same everywhere.

The loss arrives prepared (`PreparedLoss`, from `zerojax.rewrite.prepare_loss`): remat, tensor
slices and per-use gathers are applied before the step sees it, so nothing here rewrites a jaxpr.

Relies on: the row axes (`core.mesh.row_axes`: the batch's rows) and the data axes (`data_axis`: what
gradients are reduced over, less a leaf's own split axes); the `sequence` axis only to hand out
token chunks; `tensor` and `expert` only through the layouts' specs.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zerojax.core.collectives import (PARTIAL, REPLICATED, ParamShard, PartialShard, Shard, gather_shard, move, to_varying, unwrap)
from zerojax.core.fused_update import FusedUpdate
from zerojax.core.layout import LeafLayout, Plan, is_layout, layers_read_at_use, map_layouts
from zerojax.core.mesh import DataAxis, data_axis, row_axes, row_size, sequence_size
from zerojax.core.sequence import batch_specs, split_tokens
from zerojax.core.nvme_step import NvmeStep
from zerojax.core.param_swap import ParamFiles, ParamSwapStep
from zerojax.core.offload import bring_in, run_update
from zerojax.pallas.backend import XLA
from zerojax.pallas.selfcheck import settle
from zerojax.core.precision import LossScaleState, leaf_finite, norm_and_finite, update_loss_scale
from zerojax.core.state import TrainState, state_shardings
from zerojax.optim.transforms import SKIP, Keep

LossFn = Callable[..., jax.Array]


class PreparedLoss(NamedTuple):
    """A user's loss made ready for a plan's step by `zerojax.rewrite.prepare_loss`, the one place
    that rewrites it (remat, tensor slices, per-use gathers); the step only runs it.

    user:      the loss as given; its signature says whether it takes `rng` / `model_state`.
    train:     what the gradient is taken of, over the step's parameter blocks (remat applied).
    eval:      the same for evaluation (no remat: nothing is differentiated).
    marked:    the loss gathers its own `ParamShard`s (`gathers_params`).
    check_vma: shard_map's varying-axes check can stay on (no jaxpr traced outside `shard_map` is
               re-evaluated inside it).
    """
    user: LossFn
    train: LossFn
    eval: LossFn
    marked: bool
    check_vma: bool


def prepared(loss: Any, where: str) -> PreparedLoss:
    """`loss` as a PreparedLoss; a plain function is refused (the core does not rewrite losses)."""
    if isinstance(loss, PreparedLoss):
        return loss
    raise TypeError(f"{where}: give the loss prepared for the plan, zerojax.rewrite.prepare_loss(plan, loss_fn) "
                    f"(zerojax.{where}(plan, loss_fn) prepares it for you)")


def handed_whole(lay: LeafLayout, marked: bool) -> bool:
    """Whether the loss receives this parameter whole, all-gathered before it runs.

    Only a loss that gathers its own shards (`marked`: `gathers_params`) gets any, and only the
    leaves sharded along dim 0: dim 0 may be a layer axis the loss scans, loops or indexes over,
    and a ParamShard cannot be sliced along its sharded axis. The evaluator (`gather_at_use`)
    needs no such rule: it gathers a stack sharded along its layer axis whole before the scan.
    """
    return marked and isinstance(lay.param, Shard) and lay.param.dim == 0


def _grad_source(lay: LeafLayout, marked: bool) -> Any:
    """A gathered parameter's gradient comes back reduce-scattered over the axis it was gathered over
    (all of the data axis, or - hpZ - the inner axis only, still to be summed over the outer one);
    a replicated one's, or one handed to the loss whole, is PARTIAL."""
    if not isinstance(lay.param, Shard) or handed_whole(lay, marked):
        return PARTIAL
    if isinstance(lay.grad, Shard) and lay.grad.axis != lay.param.axis:
        return PartialShard(lay.param.dim, lay.param.axis)
    return lay.param


def _reduce_axis(lay: LeafLayout) -> DataAxis:
    """The data axes a leaf's gradient is summed over: the data axis less the axes the leaf is split
    over (an expert weight, split over `expert`, is summed over `data` only: every expert device holds
    other experts, and the all-to-all's transpose already brought each token's contribution)."""
    axes = data_axis()
    if isinstance(axes, str) or not lay.split:
        return axes
    rest = tuple(a for a in axes if a not in lay.split_axes)
    return rest[0] if len(rest) == 1 else rest


def local_params(plan: Plan, params: Any, *, for_grad: bool, marked: bool, readers: Any = None) -> Any:
    """Local parameter blocks as the loss sees them inside shard_map: the train and eval steps' and
    generation's (`models.generate`, its layer-by-layer layout). `for_grad`: the blocks are
    differentiated (typed per-device where their gradient is a partial sum); `marked`: the loss
    gathers its parameters itself (`gathers_params`).

    Parameters stored in host memory (offload) reach the device here, except the ones the loss
    gathers itself: those come in layer by layer, inside `gather`. `readers` (a tree of
    `ParamFiles.reader`s, 0 for a leaf passed in): the leaves read from files at use, whose block
    here is a zero placeholder.
    """
    stored = plan.memory.params
    if readers is None:
        readers = jax.tree.map(lambda _: 0, params)

    def one(lay: LeafLayout, x: jax.Array, read: Any) -> Any:
        if handed_whole(lay, marked):
            # A per-device (varying) gather outside the differentiated function: the gradient is
            # taken w.r.t. the whole array, so it is PARTIAL and reduce-scattered into Shard(0).
            gathered = gather_shard(bring_in(x, stored), 0, lay.wire)
            return to_varying(gathered) if for_grad else gathered
        if isinstance(lay.param, Shard):
            if for_grad and lay.param.axis is not None:
                # hpZ: the secondary copy is whole across data_outer; typed per-device there, its gradient
                # stays a per-host partial sum that the step reduce-scatters itself (`PartialShard`).
                x = to_varying(x)
            return ParamShard(x, lay.param.dim - x.ndim, on_host=stored is not None, wire=lay.wire,
                              read=read or None)
        x = bring_in(x, stored)
        return to_varying(x) if for_grad else x
    return map_layouts(one, plan.layouts, params, readers)


def takes_rng(loss_fn: LossFn) -> bool:
    """Loss functions with a parameter named `rng` receive a PRNG key (e.g. for dropout)."""
    try:
        return "rng" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False


def keeps_state(loss_fn: LossFn) -> bool:
    """Loss functions with a parameter named `model_state` keep state the step updates without
    differentiating it (BatchNorm's running statistics): `loss_fn(params, batch, ..., model_state=s)`
    returns `(loss, new_state)`."""
    try:
        return "model_state" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False


def check_model_state(plan: Plan, loss_fn: LossFn) -> None:
    """A loss that keeps model state needs the plan to hold its initial value, and the reverse; one
    without the other would train with statistics that never move, or drop them."""
    if keeps_state(loss_fn) and plan.model_state is None:
        raise ValueError("the loss keeps model state (a `model_state` parameter: e.g. BatchNorm's running "
                         "statistics) but the plan holds none: make it with zerojax.plan(config, mesh, params, "
                         "model_state=loss_fn.model_state)")
    if plan.model_state is not None and not keeps_state(loss_fn):
        raise ValueError("the plan holds model state (plan.model_state) but the loss takes no `model_state` "
                         "parameter, so it would never be read or updated; pass the loss zerojax.from_nnx returned "
                         "with those parameters")


StepLoss = Callable[[Any, Any, Any, Any], tuple[jax.Array, Any]]


def _step_loss(user: LossFn, fn: LossFn) -> StepLoss:
    """`loss(params, batch, rng, model_state) -> (value, model_state)` over the step's parameter
    blocks: `fn` (the prepared loss) called with `rng` and `model_state` only where the user's loss
    takes them (the state comes back unchanged from the others)."""
    rng_kw = takes_rng(user)

    def run(params: Any, batch: Any, rng: Any, model_state: Any) -> tuple[jax.Array, Any]:
        kwargs = {"rng": rng} if rng_kw else {}
        if keeps_state(user):
            return fn(params, batch, model_state=model_state, **kwargs)
        return fn(params, batch, **kwargs), model_state

    return run


def check_batch(plan: Plan, batch: Any) -> None:
    """The global batch's leading dimension must be train_batch_size (checked before any compile)."""
    want = plan.batch.train_batch_size
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        if not x.shape or x.shape[0] != want:
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)}: leading dimension is "
                f"{x.shape[0] if x.shape else 'missing'}, expected train_batch_size={want} "
                f"(= micro {plan.batch.micro_batch_size} x accumulation "
                f"{plan.batch.gradient_accumulation_steps} x data {row_size(plan.mesh)})")


def check_eval_batch(plan: Plan, batch: Any) -> None:
    """An eval batch's rows are split over `data`, so their number must be a multiple of it."""
    dp = row_size(plan.mesh)
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        if not x.shape or x.shape[0] % dp:
            raise ValueError(f"eval batch{jax.tree_util.keystr(path)}: leading dimension "
                             f"{x.shape[0] if x.shape else 'missing'} must be a multiple of the "
                             f"data-parallel size {dp}")


class GradAverage(NamedTuple):
    """Where the 1/dp of the data-parallel mean is applied, as DeepSpeed applies it.

    in_loss: divides the scaled loss before differentiation (only when some gradient is reduced
             inside the backward pass: ZeRO-3's reduce-scatter is the transpose of its gather, so
             there is no point between the gradient and its sum);
    pre:     multiplies each device's gradient in the communication dtype before the sum;
    post:    multiplies the sum.
    The product is always 1/dp; the split decides where a half-precision gradient or sum overflows.
    """
    in_loss: float
    pre: float
    post: float


def reduced_in_backward(plan: Plan, marked: bool = False) -> bool:
    """Some gradient is reduce-scattered inside the backward pass (ZeRO-3 gathered parameters);
    `marked`: the loss gathers its own shards (`gathers_params`)."""
    return any(isinstance(_grad_source(lay, marked), (Shard, PartialShard))
               for lay in jax.tree.leaves(plan.layouts, is_leaf=is_layout))


def grad_average(plan: Plan, marked: bool = False) -> GradAverage:
    """DeepSpeed's averaging rule for this plan.

    * stage 0 (engine.allreduce_bucket), and stages 1-2 with `reduce_scatter: false`
      (stage_1_and_2.gradient_reduction_w_predivide): `prescale_gradients` divides by dp before the
      sum; otherwise the gradient is divided by `gradient_predivide_factor` before and multiplied by
      factor/dp after (default factor 1: sum, then divide);
    * stages 1-3 with `reduce_scatter: true` (stage_1_and_2.average_tensor, stage3's reduce path):
      divided by dp before the sum (the config rules refuse prescale/predivide at stages 2-3 there, as
      DeepSpeed asserts, and warns that stage 1 ignores them);
    * ZeRO-3 with gathered parameters: in the loss (see GradAverage);
    * `gradient_allreduce_op: sum` (`plan.step.average` False): nothing, the gradients are summed
      (engine.allreduce_bucket and stage_1_and_2 skip the division and the predivide factor then).
    """
    if not plan.step.average:
        return GradAverage(1.0, 1.0, 1.0)
    dp = plan.data_size
    if reduced_in_backward(plan, marked):
        return GradAverage(1.0 / dp, 1.0, 1.0)
    if plan.step.predivide:
        return GradAverage(1.0, 1.0 / dp, 1.0)
    f = plan.step.predivide_factor
    return GradAverage(1.0, 1.0 / f, f / dp)


GradFn = Callable[..., tuple[Any, ...]]


def make_grad_fn(plan: Plan, loss: PreparedLoss) -> GradFn:
    """(params, global batch, loss scale, key) -> (mean loss, scaled gradients in the update
    placement), not yet jitted; see `micro_grad_fn` (a loss keeping model state takes it as a fifth
    argument and returns the updated one third)."""
    micro_fn = micro_grad_fn(plan, prepared(loss, "make_grad_fn"))

    def grad_fn(params: Any, batch: Any, scale: jax.Array, key: jax.Array, *model_state: Any) -> tuple[Any, ...]:
        losses, *rest = micro_fn(params, batch, scale, key, *model_state)
        return (jnp.mean(losses), *rest)

    return grad_fn


def micro_grad_fn(plan: Plan, prepared_loss: PreparedLoss, readers: Any = None) -> GradFn:
    """(params, global batch, loss scale, key) -> (each micro-batch's loss, averaged over the data
    shards; scaled gradients in the update placement), not yet jitted. A loss that keeps model state
    (`keeps_state`) takes it as a fifth argument and the updated state is returned third: each
    micro-batch updates it in turn (as each forward pass updates a torch module's buffers), and the
    result is averaged over the data shards (the NNX bridge computes BatchNorm's statistics over the
    whole micro-batch, so the shards agree).

    Micro-batch i is rows [i*m*dp, (i+1)*m*dp) of the global batch and data shard d gets its d-th
    block of m rows (DeepSpeed's order). The gradient is that of the global mean loss times
    `scale` (`apply_update` divides it out); the returned loss is unscaled. `key` is raw key data;
    micro-batch i on data shard d draws from `fold_in(fold_in(key, d), i)`. Each device
    differentiates its own mean loss times scale/gas, as DeepSpeed's ranks do; the 1/dp of the
    mean is applied around the reduction (`grad_average`). `readers`: see `local_params`.
    """
    prep = prepared(prepared_loss, "make_train_step")
    check_model_state(plan, prep.user)
    keeps = keeps_state(prep.user)
    pol, gas, dp, m = (plan.policy, plan.batch.gradient_accumulation_steps, row_size(plan.mesh),
                       plan.batch.micro_batch_size)
    sp = sequence_size(plan.mesh)
    marked = prep.marked
    loss = _step_loss(prep.user, prep.train)
    layouts = plan.trained_layouts  # gradients exist for the trainable leaves only
    avg = grad_average(plan, marked)

    def local(params: Any, batch: Any, scale: jax.Array, key: jax.Array, model_state: Any
              ) -> tuple[jax.Array, Any, Any]:
        rows = jax.tree.map(lambda x: x[:, 0], batch)  # (gas, m, ...) of this device
        wrapped = local_params(plan, params, for_grad=True, marked=marked, readers=readers)
        # Differentiated w.r.t. the trainable leaves only: the frozen ones are closed over, so no
        # gradient of theirs is computed, reduced or stored.
        trained, frozen = plan.trained(wrapped), plan.frozen(wrapped)
        shard_key = jax.random.fold_in(jax.random.wrap_key_data(key), jax.lax.axis_index(data_axis()))

        def scaled(t: Any, mb: Any, rng: jax.Array, ms: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
            value, ms = loss(plan.merge(t, frozen), mb, rng, ms)
            value = value.astype(jnp.float32)
            return value * (scale * avg.in_loss / gas), (value, ms)

        def micro(carry: Any, xs: Any) -> tuple[Any, jax.Array]:
            acc, ms = carry
            i, mb = xs
            rng = jax.random.fold_in(shard_key, i)
            (_, (value, ms)), g = jax.value_and_grad(scaled, has_aux=True)(trained, mb, rng, ms)
            # Gradients of host-stored blocks leave the backward pass in host memory.
            g = bring_in(unwrap(g), plan.memory.params)
            g = map_layouts(
                lambda lay, x: move(x.astype(pol.accum), _grad_source(lay, marked), lay.grad, comm_dtype=pol.comm,
                                    axis=_reduce_axis(lay), pre=avg.pre, post=avg.post,
                                    quantized=lay.wire.quantize_gradients),
                layouts, g)
            return (jax.tree.map(jnp.add, acc, g), ms), value

        def zeros(lay: LeafLayout, x: jax.ShapeDtypeStruct, sharding: Any) -> jax.Array:
            z = jnp.zeros(sharding.shard_shape(x.shape), pol.accum)
            # Accumulators holding per-device values (PARTIAL, Shard) are typed as varying, and so is a
            # leaf's block over the axes it is split over (an expert weight's over `expert`, even where
            # its expert-data-parallel group is one device and its gradient is REPLICATED over it).
            z = z if lay.grad == REPLICATED else to_varying(z)
            return to_varying(z, lay.split_axes) if lay.split else z

        acc0 = map_layouts(zeros, layouts, plan.abstract_trained, plan.grad_shardings)
        # the model state is carried as per-device values (each shard's update) and averaged at the end
        ms0 = jax.tree.map(to_varying, model_state)
        (acc, ms), values = jax.lax.scan(micro, (acc0, ms0), (jnp.arange(gas), rows))
        grads = map_layouts(lambda lay, a: move(a, lay.grad, lay.update, comm_dtype=pol.comm, axis=_reduce_axis(lay),
                                                pre=avg.pre, post=avg.post), layouts, acc)
        return jax.lax.pmean(values, data_axis()), grads, jax.lax.pmean(ms, data_axis())

    def grad_fn(params: Any, batch: Any, scale: jax.Array, key: jax.Array, model_state: Any = None
                ) -> tuple[Any, ...]:
        check_batch(plan, batch)
        if keeps and model_state is None:
            raise ValueError("grad_fn: the loss keeps model state; pass it (state.model_state) as the fifth argument")
        shaped = jax.tree.map(lambda x: x.reshape(gas, dp, m, *x.shape[1:]), split_tokens(batch, sp))
        mapped = jax.shard_map(local, mesh=plan.mesh,
                               in_specs=(plan.param_specs, batch_specs(shaped, row_axes(plan.mesh), 1, sp, micro=True), P(), P(),
                                         P()),
                               out_specs=(P(), plan.update_specs, P()), check_vma=prep.check_vma)
        losses, grads, new_state = mapped(params, shaped, jnp.asarray(scale, jnp.float32), key,
                                          model_state if keeps else None)
        return (losses, grads, new_state) if keeps else (losses, grads)

    return grad_fn


def make_param_gather(plan: Plan) -> Callable[[Any], Any]:
    """Updated master shards -> parameters: cast to the compute dtype *before* the all-gather.

    Written as an explicit collective so the gather moves compute-dtype bytes (Ψ in bf16, the
    ZeRO figure); left to the partitioner, XLA may gather fp32 and cast afterwards.
    """
    pol = plan.policy

    def local(master: Any) -> Any:
        return map_layouts(lambda lay, x: move(x.astype(pol.param), lay.update, lay.param, axis=_reduce_axis(lay)),
                           plan.trained_layouts, master)

    return jax.shard_map(local, mesh=plan.mesh, in_specs=(plan.update_specs,),
                         out_specs=plan.trained(plan.param_specs))


def clip_coefficient(norm: jax.Array, max_norm: float) -> jax.Array:
    """DeepSpeed's rule: max_norm / (norm + 1e-6) when that is below 1, else 1; 0 disables."""
    if max_norm <= 0:
        return jnp.ones((), jnp.float32)
    return jnp.minimum(1.0, max_norm / (norm + 1e-6))


def clip_by_global_norm(grads: Any, norm: jax.Array, max_norm: float) -> Any:
    """Scale `grads` by `clip_coefficient` (returned unchanged when clipping is off)."""
    if max_norm <= 0:
        return grads
    coef = clip_coefficient(norm, max_norm)
    return jax.tree.map(lambda g: g * coef.astype(g.dtype), grads)


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def apply_update(plan: Plan, state: TrainState, grads: Any, loss: jax.Array
                 ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step from gradients in the update placement that carry the loss scale.

    Unscale in fp32, check the loss and every leaf are finite (fp16; bf16 and fp32 unless
    `run.non_finite: stop`), clip by the
    global norm, run the optimizer update on the master copy (on the host when the plan offloads
    it there: `offload.run_update`), and - on overflow - keep the previous
    master and optimizer state (so the schedule, driven by the optimizer's count, does not move
    either), count a skipped step and let the loss scaler react. Parameters are re-derived from
    the master, so a skipped step leaves them bit-identical too. `plan.kernels` picks the optax
    update (xla) or the fused Pallas kernels; both give the same state.
    """
    pol = plan.policy
    inv_scale = (1.0 / loss_scale(plan, state)).astype(pol.master)
    old_master = (state.master if pol.mixed else
                  _constrain(bring_in(plan.trained(state.params), plan.memory.params), plan.update_shardings))
    update = _optax_update if plan.kernels == XLA else _fused_update
    loss_ok = jnp.isfinite(loss)
    result = update(plan, state, grads, inv_scale, old_master, loss_ok)
    return finish_update(plan, state, result, loss)


def finish_update(plan: Plan, state: TrainState, result: UpdateResult, loss: jax.Array
                  ) -> tuple[TrainState, dict[str, jax.Array]]:
    """The step's end once the optimizer has run (here, or streamed from files by `core.nvme_step`):
    the loss scaler reacts, the new shards are cast and gathered into the parameter placement, the
    counters move and the metrics are collected."""
    pol, sc = plan.policy, plan.scaler
    grad_norm, finite, overflow, master, opt_state, shards = result
    loss_ok = jnp.isfinite(loss)
    scaler = (update_loss_scale(sc, state.scaler, overflow, state.step, ~finite) if sc.check_finite
              else _note_non_finite(state.scaler, finite, state.step))
    position = state.step - state.skipped
    params = make_param_gather(plan)(bring_in(shards, plan.memory.optimizer))  # gathered on the device
    params = plan.merge(params, plan.frozen(state.params))  # frozen leaves pass through as they were stored
    new = TrainState(params=params, master=master if pol.mixed else None,
                     opt_state=opt_state, step=state.step + 1, skipped=state.skipped + overflow.astype(jnp.int32),
                     scaler=scaler, rng=state.rng, model_state=state.model_state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": plan.schedule.lr(position),
               "loss_scale": loss_scale(plan, state), "skipped": overflow, "non_finite": ~(jnp.all(finite) & loss_ok),
               "skipped_streak": scaler.streak}
    return new, metrics


def _note_non_finite(s: LossScaleState, finite: jax.Array, step: jax.Array) -> LossScaleState:
    """Without skipping (bf16/fp32 by default), remember the first step whose gradients were not
    finite and in which leaves, in the scaler's `last_overflow` and `first_bad`: a run that stops on
    it can then name both, though it reads them only when it fetches metrics (no per-step sync)."""
    first = ~jnp.any(s.first_bad) & ~jnp.all(finite)
    return s._replace(first_bad=jnp.where(first, ~finite, s.first_bad),
                      last_overflow=jnp.where(first, step, s.last_overflow).astype(s.last_overflow.dtype))


# (grad norm, per-leaf finite, overflow, master, opt_state, shards to gather)
UpdateResult = tuple[jax.Array, jax.Array, jax.Array, Any, Any, Any]


def _overflow(plan: Plan, state: TrainState, finite: jax.Array, loss_ok: jax.Array) -> jax.Array:
    """Skip the step: a non-finite loss or gradient anywhere, or the scaler stuck at its minimum."""
    if not plan.scaler.check_finite:
        return jnp.zeros((), jnp.bool_)
    return ~jnp.all(finite) | ~loss_ok | state.scaler.stuck


def unscaled(plan: Plan, state: TrainState, grads: Any, inv_scale: jax.Array, loss_ok: jax.Array
             ) -> tuple[Any, jax.Array, jax.Array, jax.Array]:
    """Gradients unscaled in the master dtype, their global norm, per-leaf finiteness and whether the
    step is skipped: what the optimizer needs besides its state, wherever that state lives."""
    grads = jax.tree.map(lambda g: g.astype(plan.policy.master) * inv_scale, grads)
    if plan.rule.norm is None:
        grad_norm, finite = norm_and_finite(grads)  # one reduction per leaf for both
    else:  # a layout's own norm (copies inside a leaf): the flags apart
        grad_norm, finite = plan.rule.norm(grads), leaf_finite(grads)
    return grads, grad_norm, finite, _overflow(plan, state, finite, loss_ok)


def _optax_update(plan: Plan, state: TrainState, grads: Any, inv_scale: jax.Array, old_master: Any,
                  loss_ok: jax.Array) -> UpdateResult:
    """The update with optax, under XLA's automatic partitioner."""
    grads, grad_norm, finite, overflow = unscaled(plan, state, grads, inv_scale, loss_ok)

    def optimize(master: Any, opt_state: Any, grads: Any, grad_norm: jax.Array, overflow: jax.Array
                 ) -> tuple[Any, Any]:
        """The per-shard, elementwise part: it runs where the plan puts the update (device or host)."""
        clipped = clip_by_global_norm(grads, grad_norm, plan.rule.clip)
        # The transformations keep their own buffers on a skipped step and read the kept ones
        # (transforms.SKIP: no copies of the moments); `keep.select` keeps the rest, all of a user's
        # transformation that takes no extra arguments.
        keep = Keep(overflow) if plan.scaler.check_finite else None
        extra = {SKIP: keep} if keep is not None else {}
        updates, new_opt_state = optax.with_extra_args_support(plan.tx).update(clipped, opt_state, master, **extra)
        new_master = optax.apply_updates(master, updates)
        if keep is not None:
            new_master = keep.select(master, new_master)
            new_opt_state = keep.select(opt_state, new_opt_state)
        return new_master, new_opt_state

    master, opt_state = run_update(plan.memory, optimize, old_master, state.opt_state, grads, grad_norm, overflow)
    return grad_norm, finite, overflow, master, opt_state, master


def _fused_update(plan: Plan, state: TrainState, grads: Any, inv_scale: jax.Array, old_master: Any,
                  loss_ok: jax.Array) -> UpdateResult:
    """The same with the Pallas kernels, on each device's shards: one read of the gradients for
    norm and finiteness, then one fused Adam pass that unscales, clips, skips on overflow and
    writes the compute-dtype copy the all-gather sends."""
    pol = plan.policy
    fused = FusedUpdate(plan)
    stats = fused.grad_stats(grads, inv_scale)
    coef = clip_coefficient(stats.norm, plan.rule.clip)
    overflow = _overflow(plan, state, stats.leaf_finite, loss_ok)
    # The kernels run on the device: offloaded state comes in for them (the plan never puts a fused
    # update on the host).
    old_master, opt_state = bring_in((old_master, state.opt_state), plan.memory.optimizer)
    master, opt_state, cast = fused.adam(grads, old_master, opt_state, grad_scale=inv_scale * coef,
                                         apply=~overflow, emit=pol.param if pol.mixed else None)
    return stats.norm, stats.leaf_finite, overflow, master, opt_state, cast if pol.mixed else master


def _constrain(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def loss_scale(plan: Plan, state: TrainState) -> jax.Array:
    """The scale the step multiplies the loss by (and divides the gradients by): the state's under a
    dynamic scaler; a static one never moves (`update_loss_scale`), so its value is the plan's constant,
    folded into the program: at bf16's and fp32's 1, the per-leaf unscale multiply is not there at all."""
    if plan.scaler.dynamic:
        return state.scaler.scale
    return jnp.asarray(plan.scaler.initial, jnp.float32)


def step_key(state: TrainState) -> jax.Array:
    """Raw key data for this step: the base key folded with the step counter."""
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step))


def checked_kernels(plan: Plan) -> Plan:
    """The plan with its update backend confirmed by the kernels' self-check, run where a step is
    first made (it compiles, once per process and backend): a failed check falls back to the XLA
    update, or is an error when the kernels were forced (`kernels: pallas`)."""
    if plan.kernels == XLA or plan.rule.checked or isinstance(plan.mesh, jax.sharding.AbstractMesh):
        return plan
    settled = settle("pallas" if plan.rule.strict else "auto", plan.kernels, plan.mesh.local_devices[0])
    return plan.with_kernels(settled)


def make_train_step(plan: Plan, loss: PreparedLoss) -> Callable[[TrainState, Any], Any]:
    """A jitted `step(state, batch) -> (state, metrics)`; `step.lower(state, batch)` shows the HLO.

    `loss` is the user's `loss_fn(params, batch) -> scalar` (the mean loss over the rows it is
    given; a parameter named `rng` receives a PRNG key) prepared for the plan by
    `zerojax.rewrite.prepare_loss`: under ZeRO-3 it is evaluated with each sharded parameter
    all-gathered where it is used; loss functions marked with `zerojax.gathers_params` receive
    `ParamShard`s and gather them themselves. `zerojax.make_train_step(plan, loss_fn)` prepares it.
    metrics: loss, grad_norm, lr, loss_scale (the scale this step used), skipped, and micro_losses
    (each micro-batch's mean loss, in DeepSpeed's order). With `offload_optimizer.device: nvme` the
    step is a `core.nvme_step.NvmeStep` (same call; the state it returns holds no master copy or
    optimizer moments: those live in its files, `step.full(state)` reads them back); with
    `offload_param.device: nvme` a `core.param_swap.ParamSwapStep` around it (its state holds no
    parameters between steps).
    """
    prep = prepared(loss, "make_train_step")
    plan = checked_kernels(plan)
    at_use = read_at_use(plan, prep)
    files = ParamFiles(plan) if at_use else None
    readers = None if files is None else jax.tree.unflatten(jax.tree.structure(plan.abstract_params), [
        files.reader(i, plan.mesh) if i in at_use else 0 for i in range(len(jax.tree.leaves(plan.abstract_params)))])
    grad_fn = micro_grad_fn(plan, prep, readers)
    keeps = keeps_state(prep.user)
    if plan.memory.swap is not None:  # optimizer state on NVMe: the update streams from files on the host
        inner: Callable[..., Any] = NvmeStep(plan, *_around_the_update(plan, grad_fn, keeps, at_use),
                                             at_use=at_use, filed=files)
        return inner if plan.memory.param_swap is None else ParamSwapStep(plan, inner, files, at_use)

    shardings = state_shardings(plan)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        state = state._replace(params=placeholders(plan, state.params))
        losses, grads, *model_state = grad_fn(state.params, batch, loss_scale(plan, state), step_key(state),
                                              *((state.model_state,) if keeps else ()))
        new, metrics = apply_update(plan, state, grads, jnp.mean(losses))
        if keeps:  # a skipped step leaves the model state as it was, with the parameters
            new = new._replace(model_state=_select(metrics["skipped"], state.model_state, model_state[0]))
        return new, {**metrics, "micro_losses": losses}

    given = shardings if not at_use else shardings._replace(params=jax.tree.unflatten(
        jax.tree.structure(shardings.params),
        [None if i in at_use else sh for i, sh in enumerate(jax.tree.leaves(shardings.params))]))
    jitted = jax.jit(step, in_shardings=(given, None), out_shardings=(shardings, None), donate_argnums=0)
    # parameters on NVMe: read onto the devices before the step (the stacked layers of a mixed-precision run
    # inside it, at use, read ahead), written back after it
    return jitted if plan.memory.param_swap is None else ParamSwapStep(plan, jitted, files, at_use)


def placeholders(plan: Plan, params: Any) -> Any:
    """`params` with each leaf read from files at use (None: `ParamSwapStep` hands it so) a zero block
    in its parameter placement, the placeholder its gradient flows to (`ParamFiles.reader`)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: x is None)
    if all(x is not None for x in leaves):
        return params
    shardings = jax.tree.leaves(state_shardings(plan).params)
    return jax.tree.unflatten(jax.tree.structure(plan.abstract_params), [
        jax.lax.with_sharding_constraint(jnp.zeros(a.shape, plan.policy.param), sh) if x is None else x
        for x, a, sh in zip(leaves, jax.tree.leaves(plan.abstract_params), shardings)])


def read_at_use(plan: Plan, prep: PreparedLoss) -> frozenset[int]:
    """The parameter leaves (flat indices) a step with `offload_param.device: nvme` reads from the files
    at use, layer by layer inside the compiled step, rather than before it: `layout.layers_read_at_use`'s,
    when the step evaluates the loss through `rewrite.gather_at_use`. None for a loss that gathers its
    own shards: it slices them itself."""
    return frozenset() if prep.marked else layers_read_at_use(plan)


def _around_the_update(plan: Plan, grad_fn: GradFn, keeps: bool, at_use: frozenset[int] = frozenset()
                       ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The device parts of a step whose optimizer runs elsewhere (`core.nvme_step`): before it, the
    gradients, unscaled, with their norm, finiteness, the skip decision and the clip coefficient (and
    an fp32 run's parameters in the update placement, its master copy, None for the leaves `at_use`:
    the host reads those from their files); after it, `finish_update`."""
    pol = plan.policy

    def front(state: TrainState, batch: Any) -> tuple[Any, ...]:
        given = state.params
        state = state._replace(params=placeholders(plan, given))
        losses, grads, *model_state = grad_fn(state.params, batch, loss_scale(plan, state), step_key(state),
                                              *((state.model_state,) if keeps else ()))
        inv_scale = (1.0 / loss_scale(plan, state)).astype(pol.master)
        grads, norm, finite, overflow = unscaled(plan, state, grads, inv_scale, jnp.isfinite(jnp.mean(losses)))
        master = None
        if not pol.mixed:
            master = _constrain(bring_in(plan.trained(state.params), plan.memory.params), plan.update_shardings)
            if at_use:
                flat = jax.tree.leaves(given, is_leaf=lambda x: x is None)
                trained = [x for x, t in zip(flat, jax.tree.leaves(plan.trainable)) if t]
                master = jax.tree.unflatten(jax.tree.structure(master), [
                    m if x is not None else None for m, x in zip(jax.tree.leaves(master), trained)])
        return losses, grads, master, norm, finite, overflow, clip_coefficient(norm, plan.rule.clip), model_state

    def back(state: TrainState, shards: Any, opt_state: Any, norm: jax.Array, finite: jax.Array,
             overflow: jax.Array, losses: jax.Array, model_state: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        new, metrics = finish_update(plan, state, (norm, finite, overflow, None, opt_state, shards), jnp.mean(losses))
        if keeps:
            new = new._replace(model_state=_select(overflow, state.model_state, model_state[0]))
        return new, {**metrics, "micro_losses": losses}

    return front, back


def make_eval_step(plan: Plan, loss: PreparedLoss) -> Callable[..., jax.Array]:
    """A jitted `eval_step(params, batch) -> mean loss`; rows split over `data` (any multiple of dp).
    A loss keeping model state: `eval_step(params, batch, model_state)`.

    A loss function that takes `rng` gets `rng=None` here: evaluation is deterministic. A loss that
    keeps model state is evaluated on the state given: `eval_step(state.params, batch,
    state.model_state)` (BatchNorm on the trained running statistics).
    """
    prep = prepared(loss, "make_eval_step")
    check_model_state(plan, prep.user)
    run = _step_loss(prep.user, prep.eval)
    marked = prep.marked
    keeps = keeps_state(prep.user)

    def local(params: Any, batch: Any, model_state: Any) -> jax.Array:
        value, _ = run(local_params(plan, params, for_grad=False, marked=marked), batch, None, model_state)
        return jax.lax.pmean(value.astype(jnp.float32), data_axis())

    sp = sequence_size(plan.mesh)

    def eval_step(params: Any, batch: Any, model_state: Any) -> jax.Array:
        check_eval_batch(plan, batch)
        batch = split_tokens(batch, sp)
        mapped = jax.shard_map(local, mesh=plan.mesh,
                               in_specs=(plan.param_specs, batch_specs(batch, row_axes(plan.mesh), 0, sp), P()),
                               out_specs=P(), check_vma=prep.check_vma)
        return mapped(params, batch, model_state)

    shardings = state_shardings(plan).params
    if not keeps:
        return jax.jit(lambda params, batch: eval_step(params, batch, None), in_shardings=(shardings, None))
    jitted = jax.jit(eval_step, in_shardings=(shardings, None, None))

    def checked(params: Any, batch: Any, model_state: Any = None) -> tuple[Any, Any, Any]:
        if model_state is None:
            raise ValueError("eval_step: the loss keeps model state (e.g. BatchNorm's running statistics); pass the "
                             "trained state: eval_step(state.params, batch, state.model_state)")
        return params, batch, model_state

    def evaluate(*args: Any) -> jax.Array:
        return jitted(*checked(*args))

    evaluate.lower = lambda *args: jitted.lower(*checked(*args))  # type: ignore[attr-defined]
    return evaluate
