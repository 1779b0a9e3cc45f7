"""The library's functions as users call them: a config first, then the plan it made.

`zerojax.init_state(config, plan, params)` and `zerojax.make_train_step(config, plan, loss_fn)` keep
the signature users know. The config is optional (`make_train_step(plan, loss_fn)` works too): the
plan already holds every decision. Given one, it must be the config the plan was made from - the
step follows the plan, so another config would otherwise be ignored without a word. The loss is
rewritten for the plan here (`zerojax.rewrite.prepare_loss`), not inside the step.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax

from zerojax.config import Config, as_config, differences, fingerprint
from zerojax.core import state as _state, step as _step
from zerojax.core.layout import Plan
from zerojax.core.state import TrainState
from zerojax.errors import ConfigError
from zerojax.rewrite import prepare_loss

__all__ = ["init_state", "make_train_step", "make_eval_step", "make_grad_fn", "check_origin"]

ConfigLike = Config | Mapping[str, Any] | str | None


def check_origin(config: ConfigLike, plan: Plan, where: str) -> None:
    """`config` (a Config, a dict or a file path; None: nothing to check) must be the plan's own."""
    if config is None:
        return
    diff = differences(fingerprint(as_config(config)), plan.origin)
    if diff:
        shown = ", ".join(f"{k} {mine} (plan: {theirs})" for k, mine, theirs in diff[:4])
        raise ConfigError(f"{where}: the config differs from the one the plan was made from in {len(diff)} "
                          f"key(s): {shown}; pass the plan's own config, or none ({where}(plan, ...)), or make "
                          f"the plan from this config")


def _split(where: str, args: tuple[Any, ...]) -> tuple[ConfigLike, Plan, tuple[Any, ...]]:
    """(config, plan, rest) from `(config, plan, *rest)` or `(plan, *rest)`."""
    if args and isinstance(args[0], Plan):
        return None, args[0], args[1:]
    if len(args) >= 2 and isinstance(args[1], Plan):
        return args[0], args[1], args[2:]
    raise TypeError(f"{where}: expected ({where.split('.')[-1]}(config, plan, ...) or (plan, ...)) with a plan "
                    f"from zerojax.plan")


def init_state(*args: Any, rng: jax.Array | int | None = None) -> TrainState:
    """`init_state([config,] plan, params, rng=None)`: `zerojax.core.state.init_state` with the
    config checked against the plan. `rng` defaults to the config's `run.seed`."""
    config, plan, rest = _split("init_state", args)
    check_origin(config, plan, "init_state")
    if len(rest) == 2:
        rest, rng = rest[:1], rest[1]
    (params,) = rest
    return _state.init_state(plan, params, rng)


def make_train_step(*args: Any) -> Callable[[TrainState, Any], Any]:
    """`make_train_step([config,] plan, loss_fn)`: see `zerojax.core.step.make_train_step`."""
    config, plan, (loss_fn,) = _split("make_train_step", args)
    check_origin(config, plan, "make_train_step")
    return _step.make_train_step(plan, prepare_loss(plan, loss_fn))


def make_eval_step(*args: Any) -> Callable[[Any, Any], jax.Array]:
    """`make_eval_step([config,] plan, loss_fn)`: see `zerojax.core.step.make_eval_step`."""
    config, plan, (loss_fn,) = _split("make_eval_step", args)
    check_origin(config, plan, "make_eval_step")
    return _step.make_eval_step(plan, prepare_loss(plan, loss_fn))


def make_grad_fn(*args: Any) -> Callable[..., tuple[Any, ...]]:
    """`make_grad_fn([config,] plan, loss_fn)`: see `zerojax.core.step.make_grad_fn`."""
    config, plan, (loss_fn,) = _split("make_grad_fn", args)
    check_origin(config, plan, "make_grad_fn")
    return _step.make_grad_fn(plan, prepare_loss(plan, loss_fn))
