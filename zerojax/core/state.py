"""The train state as an explicit pytree, and its creation in the plan's layout."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from zerojax.core.layout import Plan
from zerojax.core.offload import to_device
from zerojax.core.once import once_options
from zerojax.core.precision import LossScaleState, init_loss_scale
from zerojax.core.sharded_init import ParamsInit, abstract_params, build


class TrainState(NamedTuple):
    """Model state in the plan's layout.

    params:    what the forward pass reads (compute dtype, `param` placement), every leaf.
    master:    fp32 copy the optimizer updates (`update` placement); None when params are fp32,
               because then the parameters are their own master copy. Trainable leaves only: a
               frozen leaf is None here (its truth is its stored parameter).
    opt_state: the optax state, parameter-shaped leaves in the `update` placement (trainable only).
    step:      optimizer steps taken, skipped ones included (DeepSpeed's global_steps).
    skipped:   steps skipped for non-finite gradients (the schedule position is step - skipped).
    scaler:    the loss scaler's state (a fixed scale of 1 unless fp16 is on).
    rng:       the run's base PRNG key (raw uint32 key data); loss functions that take an `rng`
               get it folded with the step, micro-batch and data shard, so a resumed run draws
               the same numbers.
    model_state: what the step updates without differentiating it (NNX BatchNorm's running mean
               and var; `plan.model_state` at the start), replicated; None for a model without.
    """
    params: Any
    master: Any
    opt_state: Any
    step: jax.Array
    skipped: jax.Array
    scaler: LossScaleState
    rng: jax.Array
    model_state: Any = None


def logical_params(state: TrainState) -> Any:
    """The whole-shape parameters as trained: each leaf's master copy, and a frozen leaf's (or an fp32
    run's) stored parameter where there is none."""
    if state.master is None:
        return state.params
    return jax.tree.map(lambda p, m: p if m is None else m, state.params, state.master)


def state_shardings(plan: Plan) -> TrainState:
    """Where each field lives between steps (memory kinds included: offloaded state is on the host)."""
    rep = plan.replicated
    return TrainState(params=plan.param_storage,
                      master=plan.update_storage if plan.policy.mixed else None,
                      opt_state=plan.opt_state_storage,
                      step=rep, skipped=rep, scaler=jax.tree.map(lambda _: rep, _abstract_scaler(plan)),
                      rng=rep, model_state=jax.tree.map(lambda _: rep, plan.model_state))


def _abstract_scaler(plan: Plan) -> LossScaleState:
    return jax.eval_shape(lambda: init_loss_scale(plan.scaler, plan.n_trained))


def _abstract_rng() -> jax.ShapeDtypeStruct:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))


def abstract_state(plan: Plan) -> TrainState:
    """ShapeDtypeStructs (with shardings) of the state `init_state` makes: restore targets."""
    def sds(x: Any, dtype: Any, sharding: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding)

    sh, pol = state_shardings(plan), plan.policy
    params = jax.tree.map(lambda x, s: sds(x, pol.param, s), plan.abstract_params, sh.params)
    master = (jax.tree.map(lambda x, s: sds(x, pol.master, s), plan.abstract_trained, sh.master)
              if pol.mixed else None)
    opt = jax.tree.map(lambda x, s: sds(x, x.dtype, s), plan.abstract_opt_state, sh.opt_state)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=plan.replicated)
    scaler = jax.tree.map(lambda x, s: sds(x, x.dtype, s), _abstract_scaler(plan), sh.scaler)
    rng = _abstract_rng()
    model_state = jax.tree.map(lambda x, s: sds(x, x.dtype, s), plan.model_state, sh.model_state)
    return TrainState(params, master, opt, scalar, scalar, scaler, sds(rng, rng.dtype, sh.rng), model_state)


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


def init_state(plan: Plan, params: Any, rng: jax.Array | int | None = None) -> TrainState:
    """Place `params` (any placement, any float dtype) into a fresh train state of the plan; an
    unbuilt `zerojax.init_params(...)` is built there, straight into the plan's shards.

    `rng` (a key or a seed; default: the plan's seed, the config's `run.seed`) is the base key of
    loss functions that take one.
    """
    check_params(plan, abstract_params(params))
    rng = plan.seed if rng is None else rng
    fn, args = _init_fn(plan, params, rng if isinstance(rng, int) else key_data(rng))
    return fn(*args)


def _init_fn(plan: Plan, params: Any, key: jax.Array | int) -> tuple[Callable[..., TrainState], tuple[Any, ...]]:
    """The jitted state constructor and its arguments (`.lower(*args)` shows its memory).

    An unbuilt `ParamsInit` runs inside it, each parameter constrained to its update placement
    (sharded from stage 1 on; a frozen one to its parameter placement) as it is made, so it is computed
    shard by shard. Only the trainable leaves get a master copy and optimizer state. A seed (int `key`)
    becomes its key inside it too: the whole state is one compiled program."""
    pol = plan.policy
    pending = params if isinstance(params, ParamsInit) else None
    seed = key if isinstance(key, int) else None

    def init(params: Any, key: jax.Array, model_state: Any) -> TrainState:
        if seed is not None:
            key = key_data(seed)
        if pending is not None:
            params = build(pending, plan.init_shardings)
        params = to_device(params)  # computed on the device, whatever memory they come from
        master = jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x.astype(pol.master), s),
                              plan.trained(params), plan.update_shardings)
        compute = jax.tree.map(lambda x: x.astype(pol.param), params)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(params=compute, master=master if pol.mixed else None,
                          opt_state=plan.tx.init(master), step=zero, skipped=zero,
                          scaler=init_loss_scale(plan.scaler, plan.n_trained), rng=key,
                          model_state=jax.tree.map(jnp.asarray, model_state))

    jitted = jax.jit(init, out_shardings=state_shardings(plan), compiler_options=once_options(plan.mesh))
    return jitted, (None if pending is not None else params, None if seed is not None else key, plan.model_state)


def key_data(rng: jax.Array | int) -> jax.Array:
    """Raw uint32 key data from a seed, a typed key or raw key data (what orbax can store)."""
    if isinstance(rng, int):
        return jax.random.key_data(jax.random.key(rng))
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng)
    return jnp.asarray(rng, jnp.uint32)
