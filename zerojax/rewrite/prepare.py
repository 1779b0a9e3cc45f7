"""The one door from a user's loss to the loss the step runs: `prepare_loss(plan, loss_fn)`.

The planner API (`zerojax.make_train_step`, `make_eval_step`, `make_grad_fn`), the engine and the
pipeline call it; the step in `zerojax.core.step` only runs what it returns (`PreparedLoss`). In
order, a loss is

1. rematerialized per scanned layer when the plan asks for it (`remat.for_loss`; for the gradient
   only, and not for a loss that gathers its own shards: it places its own remat too);
2. run on each device's tensor slices when the plan splits weights over `tensor`
   (`tensor_slices.tensor_parallel`, Megatron's collectives as custom VJPs);
3. evaluated with each ZeRO-3-sharded parameter gathered where it is used (`gather_at_use`),
   unless it is marked `gathers_params` (and no weight is tensor-sliced: a sliced loss's gathers on
   whole arrays would do nothing, so it is rewritten like any other).

Relies on: the step's `shard_map` over the data axes (and `tensor`), in which the rewritten loss is
traced; the plan's `tensor_dims` / `tensor_size` and `step` record (remat, prefetch,
partition_activations). Each rewrite keeps the loss's value and gradients; only where collectives
and recomputation happen changes.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from zerojax.core.collectives import Shard, is_gathering
from zerojax.core.layout import Plan, is_layout
from zerojax.core.mesh import TENSOR
from zerojax.core.step import LossFn, PreparedLoss
from zerojax.rewrite.gather_at_use import gather_at_use
from zerojax.rewrite.remat import for_loss
from zerojax.rewrite.tensor_slices import tensor_parallel

__all__ = ["prepare_loss", "on_tensor_slices"]


def gathers_own(plan: Plan, loss_fn: LossFn) -> bool:
    """The loss gathers its own `ParamShard`s (`gathers_params`). Not when weights are tensor-sliced:
    the loss is then re-run on slices (`tensor_parallel`), and its gathers on whole arrays do nothing."""
    return is_gathering(loss_fn) and not plan.sliced


def on_tensor_slices(fn: Callable[..., Any], dims: Any, size: int, *,
                     partition_activations: bool = False) -> Callable[..., Any]:
    """`fn` run on each device's slices of the weights `dims` splits over the `tensor` axis (of
    `size` devices); `fn` itself when nothing is split (`size` 1). The pipeline runs each stage's
    layers through this, the plain step the whole loss."""
    if size <= 1:
        return fn
    return tensor_parallel(fn, dims, TENSOR, size, partition_activations=partition_activations)


def _interpreted(plan: Plan) -> bool:
    """Some rewrite re-binds a jaxpr traced outside `shard_map` (whose types carry no varying axes):
    tensor slices, or a gather at use of a sharded parameter."""
    return plan.sliced or any(isinstance(lay.param, Shard)
                              for lay in jax.tree.leaves(plan.layouts, is_leaf=is_layout))


def prepare_loss(plan: Plan, loss_fn: LossFn) -> PreparedLoss:
    """`loss_fn` rewritten for `plan` (see the module docstring); a PreparedLoss is returned as is.

    Nothing is traced here: each rewrite traces the loss when the step is traced, on the values the
    step gives it."""
    if isinstance(loss_fn, PreparedLoss):
        return loss_fn
    marked = gathers_own(plan, loss_fn)

    def evaluated(fn: LossFn) -> LossFn:
        if marked:
            return fn
        sliced = fn if not plan.sliced else on_tensor_slices(
            fn, plan.tensor_dims, plan.tensor_size, partition_activations=plan.step.partition_activations)
        return gather_at_use(sliced, plan.step.prefetch)

    trained = loss_fn if is_gathering(loss_fn) else for_loss(plan.step.remat, loss_fn)
    return PreparedLoss(user=loss_fn, train=evaluated(trained), eval=evaluated(loss_fn), marked=marked,
                        check_vma=marked or not _interpreted(plan))
