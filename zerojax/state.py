"""The train state as an explicit pytree, and its creation in the plan's layout."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zerojax.config import Config
from zerojax.layout import Plan


class TrainState(NamedTuple):
    """Model state in the plan's layout.

    params:    what the forward pass reads (compute dtype, `param` placement).
    master:    fp32 copy the optimizer updates (`update` placement); None when params are fp32,
               because then the parameters are their own master copy.
    opt_state: the optax state, parameter-shaped leaves in the `update` placement.
    step:      optimizer steps taken, skipped ones included (DeepSpeed's global_steps).
    skipped:   steps skipped for non-finite gradients (the schedule position is step - skipped).
    """
    params: Any
    master: Any
    opt_state: Any
    step: jax.Array
    skipped: jax.Array


def state_shardings(plan: Plan) -> TrainState:
    return TrainState(params=plan.param_shardings,
                      master=plan.update_shardings if plan.policy.mixed else None,
                      opt_state=plan.opt_state_shardings,
                      step=plan.replicated, skipped=plan.replicated)


def abstract_state(plan: Plan) -> TrainState:
    """ShapeDtypeStructs (with shardings) of the state `init_state` makes: restore targets."""
    def sds(x: Any, dtype: Any, sharding: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding)

    sh, pol = state_shardings(plan), plan.policy
    params = jax.tree.map(lambda x, s: sds(x, pol.param, s), plan.abstract_params, sh.params)
    master = (jax.tree.map(lambda x, s: sds(x, pol.master, s), plan.abstract_params, sh.master)
              if pol.mixed else None)
    opt = jax.tree.map(lambda x, s: sds(x, x.dtype, s), plan.abstract_opt_state, sh.opt_state)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=plan.replicated)
    return TrainState(params, master, opt, scalar, scalar)


def check_params(plan: Plan, params: Any) -> None:
    """Params must have the structure and shapes the plan was made for."""
    want = jax.tree.structure(plan.abstract_params)
    got = jax.tree.structure(params)
    if want != got:
        raise ValueError(f"init_state: the parameter tree differs from the one the plan was made for\n"
                         f"  plan:   {want}\n  given:  {got}")
    bad = [(jax.tree_util.keystr(k), tuple(a.shape), tuple(b.shape)) for (k, a), b in
           zip(jax.tree_util.tree_leaves_with_path(plan.abstract_params), jax.tree.leaves(params))
           if tuple(a.shape) != tuple(b.shape)]
    if bad:
        lines = "\n".join(f"  {k}: plan {a}, given {b}" for k, a, b in bad)
        raise ValueError(f"init_state: parameter shapes differ from the plan's:\n{lines}")


def init_state(config: Config, plan: Plan, params: Any) -> TrainState:
    """Place `params` (any placement, any float dtype) into a fresh train state of the plan.

    `config` must be the one the plan was made from; it is taken for symmetry with
    `make_train_step` and checked.
    """
    if config.zero_optimization.stage != plan.stage:
        raise ValueError(f"init_state: config has ZeRO stage {config.zero_optimization.stage} but the "
                         f"plan was made for stage {plan.stage}; pass the plan's config")
    check_params(plan, params)
    pol = plan.policy

    def init(params: Any) -> TrainState:
        master = jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x.astype(pol.master), s),
                              params, plan.update_shardings)
        compute = jax.tree.map(lambda x: x.astype(pol.param), params)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(params=compute, master=master if pol.mixed else None,
                          opt_state=plan.tx.init(master), step=zero, skipped=zero)

    return jax.jit(init, out_shardings=state_shardings(plan))(params)
