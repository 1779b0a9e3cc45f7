"""Bridges from Flax NNX modules to zerojax's (params, loss_fn) form."""
from __future__ import annotations

from typing import Any, Callable, Union

import jax
from flax import nnx

from zerojax.core.sharded_init import ParamsInit

ModelOrConstructor = Union[nnx.Module, Callable[[], nnx.Module]]


def from_nnx(model: ModelOrConstructor, loss: Callable[[nnx.Module, Any], jax.Array]) -> tuple[Any, Callable]:
    """Split an NNX model into params and `loss_fn(params, batch)` for zerojax.

    `model` is a module, or a constructor such as `lambda: Model(..., rngs=nnx.Rngs(0))`. A
    constructor is never run whole: the params returned are an unbuilt `ParamsInit` (shapes from
    `nnx.eval_shape`) that `init_state` / `initialize` build straight into the plan's shards, as
    DeepSpeed's `zero.Init` does. `loss(model, batch)` is written against the module as usual.
    Only `nnx.Param` variables are trained; other state (RNG counters, statistics) is held fixed.
    `to_nnx` writes trained parameters back into a module.
    """
    if isinstance(model, nnx.Module):
        graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
        params: Any = nnx.to_pure_dict(param_state)
    elif callable(model):
        constructor = model
        graphdef, param_state, _ = nnx.split(nnx.eval_shape(constructor), nnx.Param, ...)
        # The non-parameter state (RNG keys and counters, statistics) is small: built concretely.
        rest = jax.jit(lambda: nnx.split(constructor(), nnx.Param, ...)[2])()
        params = ParamsInit(lambda: nnx.to_pure_dict(nnx.state(constructor(), nnx.Param)),
                            nnx.to_pure_dict(param_state))
    else:
        raise TypeError(f"from_nnx: expected an nnx.Module or a function returning one, got {type(model).__name__}")

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        state = jax.tree.map(lambda x: x, param_state)
        nnx.replace_by_pure_dict(state, params)
        return loss(nnx.merge(graphdef, state, rest), batch)

    return params, loss_fn


def to_nnx(model: ModelOrConstructor, params: Any) -> nnx.Module:
    """Write a params dict (e.g. `engine.params`) into `model`, in place, and return it. Given a
    constructor, an abstract module is made (`nnx.eval_shape`, nothing computed) and filled."""
    if not isinstance(model, nnx.Module):
        constructor = model
        model = nnx.eval_shape(constructor)
        # the non-parameter state (RNG keys, statistics) is small and must be real to run the model
        nnx.update(model, jax.jit(lambda: nnx.split(constructor(), nnx.Param, ...)[2])())
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model
