"""Re-running a loss's jaxpr equation by equation, with some equations done another way.

Both rewrites of a user's loss work this way: stage 3's gather-at-use (`gather_at_use`: parameters
stay sharded until an equation uses them) and activation checkpointing (`remat`: scan bodies become
checkpointed layers). Each gives `interpret` a function that returns an equation's outputs, and
calls `bind` for the equations it leaves as they are.

Relies on: no mesh axis; `jax.extend.core`'s Literal/Var and a primitive's `bind` (the JAX internals
this folder, and only it, reads).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from jax._src import source_info_util
from jax.extend import core as jcore

Step = Callable[[Any, list[Any]], list[Any]]  # (equation, its input values) -> its output values


def bind(eqn: Any, args: Sequence[Any]) -> list[Any]:
    """The equation as written, on `args` (traced or concrete)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """(constants, carries) of a `scan` equation's operands, which come in that order before the scanned
    inputs. JAX 0.10 names the counts (`num_consts`, `num_carry`); JAX 0.11 groups the operands in a
    flat tree instead (`ft_in`: constants, carries, scanned inputs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def interpret(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], step: Step) -> list[Any]:
    """The outputs of `jaxpr` on `consts` and `args`, each equation's outputs given by `step`."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        # as jax's own eval_jaxpr does: what the equation emits keeps the user's call stack and name
        # stack, so compiled instructions name the model code they come from (flops profile, HLO dumps)
        where = source_info_util.user_context(
            eqn.source_info.traceback,
            name_stack=source_info_util.current_name_stack() + eqn.source_info.name_stack)
        with where:
            out = step(eqn, [read(v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, out):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]
