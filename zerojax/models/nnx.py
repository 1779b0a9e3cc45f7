"""Bridges from Flax NNX modules to zerojax's (params, loss_fn) form.

A model written the way the Flax examples write one works unmodified:

* kernels annotated with `nnx.with_partitioning` (logical axis names such as `("embed", "mlp")`) are
  built without a mesh context - zerojax places every array itself - and the names are kept: they
  reach the plan as each leaf's logical axes (`logical_axes`), where a mesh axis they name is honoured;
* Dropout and other modules holding `nnx.Rngs` streams draw fresh keys on every step, data shard and
  micro-batch: the streams are reseeded from the step's key (`TrainState.rng` folded with the step),
  so masks are reproducible from `run.seed` and a resumed run draws what an uninterrupted one would;
* a loss may also take the keys itself: `loss(model, batch, rngs)` receives an `nnx.Rngs`.

Evaluation (`make_eval_step`, `engine.eval_batch`) runs the model in eval mode (`model.eval()`:
Dropout off, BatchNorm on its running statistics).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Union

import jax
from flax import nnx

from zerojax.core.annotations import logical_axes
from zerojax.core.sharded_init import ParamsInit

__all__ = ["from_nnx", "to_nnx", "logical_axes"]

ModelOrConstructor = Union[nnx.Module, Callable[[], nnx.Module]]


def _build(constructor: Callable[[], nnx.Module]) -> nnx.Module:
    """Run a model constructor without eager sharding: annotated variables are created unplaced
    (zerojax places them) and keep their annotations as metadata."""
    with nnx.use_eager_sharding(False):
        return constructor()


def _takes_rngs(loss: Callable[..., Any]) -> bool:
    """`loss(model, batch, rngs)`: a third parameter (or one named `rngs`) receives an `nnx.Rngs`."""
    try:
        params = list(inspect.signature(loss).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return any(p.name == "rngs" for p in params) or len(positional) >= 3


def _stream_tags(model: nnx.Module) -> list[str]:
    return sorted({node.tag for _, node in nnx.iter_graph(model) if isinstance(node, nnx.RngStream)})


def from_nnx(model: ModelOrConstructor, loss: Callable[..., jax.Array]) -> tuple[Any, Callable]:
    """Split an NNX model into params and `loss_fn(params, batch, rng=None)` for zerojax.

    `model` is a module, or a constructor such as `lambda: Model(..., rngs=nnx.Rngs(0))`. A
    constructor is never run whole: the params returned are an unbuilt `ParamsInit` (shapes from
    `nnx.eval_shape`) that `init_state` / `initialize` build straight into the plan's shards, as
    DeepSpeed's `zero.Init` does. No mesh context is needed, whatever the model's annotations.
    `loss(model, batch)` (or `loss(model, batch, rngs)`) is written against the module as usual.
    Only `nnx.Param` variables are trained; the model's RNG streams are reseeded from the step's key
    on every call (`rng`; without one, as in evaluation, the model runs in eval mode) and other state
    (statistics) is held fixed. `to_nnx` writes trained parameters back into a module.
    The returned `loss_fn.logical_axes` holds the parameters' annotations (`logical_axes`).
    """
    if isinstance(model, nnx.Module):
        graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
        params: Any = nnx.to_pure_dict(param_state)
        tags = _stream_tags(model)
    elif callable(model):
        constructor = model
        with nnx.use_eager_sharding(False):
            abstract_model = nnx.eval_shape(constructor)
        graphdef, param_state, _ = nnx.split(abstract_model, nnx.Param, ...)
        tags = _stream_tags(abstract_model)
        # The non-parameter state (RNG keys and counters, statistics) is small: built concretely.
        rest = jax.jit(lambda: nnx.split(_build(constructor), nnx.Param, ...)[2])()
        params = ParamsInit(lambda: nnx.to_pure_dict(nnx.state(_build(constructor), nnx.Param)),
                            nnx.to_pure_dict(param_state))
    else:
        raise TypeError(f"from_nnx: expected an nnx.Module or a function returning one, got {type(model).__name__}")
    axes = logical_axes(param_state)
    if isinstance(params, ParamsInit):
        params.logical_axes = axes
    with_rngs = _takes_rngs(loss)

    def loss_fn(params: Any, batch: Any, rng: jax.Array | None = None) -> jax.Array:
        state = jax.tree.map(lambda x: x, param_state)  # fresh Variables, at this trace's level
        nnx.replace_by_pure_dict(state, params)
        module = nnx.merge(graphdef, state, jax.tree.map(lambda x: x, rest))
        if rng is None:
            module.eval()
            rngs = nnx.Rngs(0)
        else:
            # one key per stream, all derived from the step's key: new masks every step and shard
            keys = {tag: jax.random.fold_in(rng, i) for i, tag in enumerate(tags)}
            if keys:
                nnx.reseed(module, policy="match_shape", **keys)
            rngs = nnx.Rngs(jax.random.fold_in(rng, len(tags)))
        return loss(module, batch, rngs) if with_rngs else loss(module, batch)

    loss_fn.logical_axes = axes  # type: ignore[attr-defined]
    return params, loss_fn


def to_nnx(model: ModelOrConstructor, params: Any) -> nnx.Module:
    """Write a params dict (e.g. `engine.params`) into `model`, in place, and return it. Given a
    constructor, an abstract module is made (`nnx.eval_shape`, nothing computed) and filled."""
    if not isinstance(model, nnx.Module):
        constructor = model
        with nnx.use_eager_sharding(False):
            model = nnx.eval_shape(constructor)
        # the non-parameter state (RNG keys, statistics) is small and must be real to run the model
        nnx.update(model, jax.jit(lambda: nnx.split(_build(constructor), nnx.Param, ...)[2])())
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model
