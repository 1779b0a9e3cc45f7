"""Bridges from Flax NNX modules to zerojax's (params, loss_fn) form."""
from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx


def from_nnx(model: nnx.Module, loss: Callable[[nnx.Module, Any], jax.Array]) -> tuple[Any, Callable]:
    """Split an NNX model into a params dict and `loss_fn(params, batch)` for zerojax.

    `loss(model, batch)` is written against the module as usual. Only `nnx.Param` variables are
    trained; other state (RNG counters, statistics) is held fixed. The model object is not
    modified; `to_nnx` writes trained parameters back into it.
    """
    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(param_state)

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        state = jax.tree.map(lambda x: x, param_state)
        nnx.replace_by_pure_dict(state, params)
        return loss(nnx.merge(graphdef, state, rest), batch)

    return params, loss_fn


def to_nnx(model: nnx.Module, params: Any) -> nnx.Module:
    """Write a params dict (e.g. `engine.params`) back into `model`, in place; returns it."""
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model
