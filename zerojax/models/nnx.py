"""Bridges from Flax NNX modules to zerojax's (params, loss_fn) form.

A model written the way the Flax examples write one works unmodified:

* kernels annotated with `nnx.with_partitioning` (logical axis names such as `("embed", "mlp")`) are
  built without a mesh context - zerojax places every array itself - and the names are kept: they
  reach the plan as each leaf's logical axes (`logical_axes`), where a mesh axis they name is honoured;
* Dropout and other modules holding `nnx.Rngs` streams draw fresh keys on every step, data shard and
  micro-batch: the streams are reseeded from the step's key (`TrainState.rng` folded with the step),
  so masks are reproducible from `run.seed` and a resumed run draws what an uninterrupted one would;
* a loss may also take the keys itself: `loss(model, batch, rngs)` receives an `nnx.Rngs`;
* `nnx.BatchStat`s (BatchNorm's running mean and var) are the step's model state (`TrainState.
  model_state`): read and updated by every micro-batch as Flax's own loop updates them, never
  differentiated, replicated, checkpointed. Each BatchNorm computes its statistics over the whole
  micro-batch, every data shard's rows together (its `axis_name` set to the data axes), so the
  normalisation and the running statistics are those of one device given the same rows.

Evaluation (`make_eval_step`, `engine.eval_batch`) runs the model in eval mode (`model.eval()`:
Dropout off, BatchNorm on its running statistics).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Union

import jax
from flax import nnx

from zerojax.core.annotations import logical_axes
from zerojax.core.mesh import data_axis
from zerojax.core.names import dotted
from zerojax.core.sharded_init import ParamsInit
from zerojax.core.state import TrainState, logical_params

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


def _sync_batch_norms(module: nnx.Module) -> None:
    """Inside the step's `shard_map`, every BatchNorm averages its batch statistics over the data
    axes, so they are the statistics of the whole micro-batch, as on one device. Outside a map
    (tracing for shapes) the model is left as it is."""
    manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    axes = data_axis()
    axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a in manual)
    if not axes:
        return
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.BatchNorm):
            if node.axis_index_groups is not None:
                raise ValueError(f"from_nnx: the BatchNorm at {'.'.join(map(str, path))} sets axis_index_groups; "
                                 f"zerojax computes batch statistics over the whole micro-batch: remove it")
            node.axis_name = axes if len(axes) > 1 else axes[0]


def from_nnx(model: ModelOrConstructor, loss: Callable[..., jax.Array]) -> tuple[Any, Callable]:
    """Split an NNX model into params and `loss_fn(params, batch, rng=None)` for zerojax.

    `model` is a module, or a constructor such as `lambda: Model(..., rngs=nnx.Rngs(0))`. A
    constructor is never run whole: the params returned are an unbuilt `ParamsInit` (shapes from
    `nnx.eval_shape`) that `init_state` / `initialize` build straight into the plan's shards, as
    DeepSpeed's `zero.Init` does. No mesh context is needed, whatever the model's annotations.
    `loss(model, batch)` (or `loss(model, batch, rngs)`) is written against the module as usual.
    Only `nnx.Param` variables are trained; the model's RNG streams are reseeded from the step's key
    on every call (`rng`; without one, as in evaluation, the model runs in eval mode). `nnx.BatchStat`s
    are the step's model state: `loss_fn.model_state` (and `params.model_state` for a constructor)
    holds their initial values and the plan takes them from there; the loss then takes
    `model_state=` and returns `(loss, new_model_state)`. Other state is held fixed. `to_nnx` writes
    trained parameters (and statistics) back into a module.
    The returned `loss_fn.logical_axes` holds the parameters' annotations (`logical_axes`), and
    `loss_fn.variable_types` their Variable classes (`plan(..., trainable=nnx.LoRAParam)` reads them).
    """
    if isinstance(model, nnx.Module):
        graphdef, param_state, stat_state, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
        params: Any = nnx.to_pure_dict(param_state)
        tags = _stream_tags(model)
        stats = nnx.to_pure_dict(stat_state)
    elif callable(model):
        constructor = model
        with nnx.use_eager_sharding(False):
            abstract_model = nnx.eval_shape(constructor)
        graphdef, param_state, stat_state, _ = nnx.split(abstract_model, nnx.Param, nnx.BatchStat, ...)
        tags = _stream_tags(abstract_model)
        # The non-parameter state (RNG keys and counters, statistics) is small: built concretely.
        stats, rest = jax.jit(lambda: _non_params(_build(constructor)))()
        params = ParamsInit(lambda: nnx.to_pure_dict(nnx.state(_build(constructor), nnx.Param)),
                            nnx.to_pure_dict(param_state))
    else:
        raise TypeError(f"from_nnx: expected an nnx.Module or a function returning one, got {type(model).__name__}")
    axes = logical_axes(param_state)
    kinds = variable_types(param_state)
    model_state = stats if jax.tree.leaves(stats) else None
    if isinstance(params, ParamsInit):
        params.logical_axes = axes
        params.variable_types = kinds  # type: ignore[attr-defined]
        params.model_state = model_state  # type: ignore[attr-defined]
    with_rngs = _takes_rngs(loss)

    def run(params: Any, batch: Any, rng: jax.Array | None, model_state: Any) -> tuple[jax.Array, Any]:
        state = jax.tree.map(lambda x: x, param_state)  # fresh Variables, at this trace's level
        nnx.replace_by_pure_dict(state, params)
        fresh_stats = jax.tree.map(lambda x: x, stat_state)
        if model_state is not None:
            nnx.replace_by_pure_dict(fresh_stats, model_state)
        module = nnx.merge(graphdef, state, fresh_stats, jax.tree.map(lambda x: x, rest))
        if rng is None:
            module.eval()
            rngs = nnx.Rngs(0)
        else:
            # one key per stream, all derived from the step's key: new masks every step and shard
            keys = {tag: jax.random.fold_in(rng, i) for i, tag in enumerate(tags)}
            if keys:
                nnx.reseed(module, policy="match_shape", **keys)
            rngs = nnx.Rngs(jax.random.fold_in(rng, len(tags)))
            _sync_batch_norms(module)
        held = _held(module)
        value = loss(module, batch, rngs) if with_rngs else loss(module, batch)
        _check_held(held, _held(module))
        return value, nnx.to_pure_dict(nnx.state(module, nnx.BatchStat))

    if model_state is None:
        def loss_fn(params: Any, batch: Any, rng: jax.Array | None = None) -> jax.Array:
            return run(params, batch, rng, None)[0]
    else:
        def loss_fn(params: Any, batch: Any, rng: jax.Array | None = None,  # type: ignore[misc]
                    model_state: Any = None) -> tuple[jax.Array, Any]:
            return run(params, batch, rng, model_state)

    loss_fn.logical_axes = axes  # type: ignore[attr-defined]
    loss_fn.model_state = model_state  # type: ignore[attr-defined]
    loss_fn.variable_types = kinds  # type: ignore[attr-defined]
    return params, loss_fn


def variable_types(param_state: Any) -> Any:
    """Each parameter's NNX Variable class (`nnx.Param`, `nnx.LoRAParam`, ...), as a tree shaped like the
    params dict: what `zerojax.plan(..., trainable=nnx.LoRAParam)` selects the trained leaves by."""
    kinds = jax.tree.map(type, param_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(kinds) if isinstance(kinds, nnx.State) else kinds


# Variables the step neither trains (nnx.Param), keeps (nnx.BatchStat) nor reseeds (RNG state).
_HELD = nnx.Not(nnx.Any(nnx.Param, nnx.BatchStat, nnx.RngState))


def _held(module: nnx.Module) -> dict[str, Any]:
    return {dotted(p): v for p, v in
            jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(module, _HELD)))}


def _check_held(before: dict[str, Any], after: dict[str, Any]) -> None:
    """A loss that assigns to any other Variable would lose the value after the step: refused, by name
    (values it sows anew, `nnx.Intermediate`, are not held and may be written)."""
    changed = [path for path, v in before.items() if path in after and after[path] is not v]
    if changed:
        raise ValueError(f"from_nnx: the loss assigns to {', '.join(changed[:5])}, a Variable that is neither an "
                         f"nnx.Param (trained) nor an nnx.BatchStat (kept as the step's model state), so the value "
                         f"would be dropped after every step; declare it as nnx.BatchStat to keep it, or stop "
                         f"assigning to it in the forward pass")


def _non_params(module: nnx.Module) -> tuple[Any, Any]:
    """(BatchStats as a pure dict, every other non-parameter Variable) of a built module."""
    _, _, stats, rest = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
    return nnx.to_pure_dict(stats), rest


def to_nnx(model: ModelOrConstructor, params: Any, model_state: Any = None) -> nnx.Module:
    """Write a params dict (e.g. `engine.params`) into `model`, in place, and return it. Given a
    constructor, an abstract module is made (`nnx.eval_shape`, nothing computed) and filled.

    `params` may also be a `TrainState`: its fp32 master copy (its params when they are their own
    master, as in an fp32 run, where `state.master` is None) and its model state (BatchNorm's running
    statistics) are written. `model_state`: statistics to write (e.g. `engine.model_state`)."""
    if isinstance(params, TrainState):
        state_ = params
        params = logical_params(state_)  # a frozen leaf has no master: its stored parameter
        model_state = state_.model_state if model_state is None else model_state
    if params is None:
        raise TypeError("to_nnx: params is None. A TrainState's `master` is None when the parameters are fp32 "
                        "(they are their own master copy): pass the state itself, to_nnx(model, state), or "
                        "state.params (engine.params on an engine)")
    if not isinstance(model, nnx.Module):
        constructor = model
        with nnx.use_eager_sharding(False):
            model = nnx.eval_shape(constructor)
        # the non-parameter state (RNG keys, statistics) is small and must be real to run the model
        stats, rest = jax.jit(lambda: _non_params(_build(constructor)))()
        nnx.update(model, rest)
        _write(model, nnx.BatchStat, stats, "model_state")
    _write(model, nnx.Param, params, "params")
    if model_state is not None:
        _write(model, nnx.BatchStat, model_state, "model_state")
    return model


def _write(model: nnx.Module, kind: type, values: Any, what: str) -> None:
    """`values` (a pure dict) into the module's variables of `kind`; a tree of other keys is one error
    naming them."""
    state = nnx.state(model, kind)
    want = {dotted(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))}
    try:
        got = {dotted(p) for p, _ in jax.tree_util.tree_leaves_with_path(values)}
    except Exception:  # noqa: BLE001 - anything not a tree is named below
        got = set()
    if not isinstance(values, dict) or want != got:
        missing, extra = sorted(want - got)[:5], sorted(got - want)[:5]
        raise ValueError(f"to_nnx: {what} do not match the module's {kind.__name__} variables "
                         f"(missing {missing}, unexpected {extra}; got {type(values).__name__})")
    nnx.replace_by_pure_dict(state, values)
    nnx.update(model, state)
