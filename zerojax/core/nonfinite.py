"""Stopping a run whose loss, gradients or parameters went non-finite, without a per-step host sync.

By default (`run.non_finite: skip_step`, and always with fp16) a step whose loss or gradients are not
finite is skipped and leaves the state untouched; the engine stops after `run.non_finite_limit` in a
row. So here only the parameters themselves going non-finite (e.g. an infinite learning rate) stops
the run, checked before every save and where the trainer fetches metrics anyway. With
`run.non_finite: stop` the step records the first step with non-finite gradients and their leaves
in the scaler state (`step._note_non_finite`), and the run stops at the next such point; no
checkpoint after the bad step is ever written.
"""
from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.core.offload import to_device
from zerojax.core.precision import leaf_finite

FIX = ("lower optimizer.params.lr (or warm it up) and check the data for bad values; with "
       "run.non_finite: stop, set it back to skip_step to skip steps whose gradients are not finite")


def _names(paths: list[str], bad: np.ndarray) -> str:
    names = [paths[i] for i in np.flatnonzero(bad)]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


@functools.lru_cache(maxsize=8)
def _finite_program(replicated: Any) -> Any:
    return jax.jit(lambda leaves: leaf_finite(to_device(leaves)), out_shardings=replicated)


#: Compiles of `finite_flags` under way in a background thread (`compile_finite_flags`), by `replicated`.
_AHEAD: dict[Any, concurrent.futures.Future] = {}


def finite_flags(replicated: Any) -> Any:
    """The program that says which of a list of leaves are all finite (offloaded ones too), answered on
    every process. One per run: the guard at fetch points and every save's check (`float_leaves`
    gives both the same arguments) share its compile. A compile of it started by
    `compile_finite_flags` is waited for here (and its error raised), so it is never compiled twice."""
    ahead = _AHEAD.pop(replicated, None)
    if ahead is not None:
        ahead.result()
    return _finite_program(replicated)


def compile_finite_flags(replicated: Any, leaves: list[Any], pool: concurrent.futures.Executor) -> None:
    """Lower `finite_flags` for `leaves` (arrays or `jax.ShapeDtypeStruct`s, as `float_leaves` lists
    them) here and compile it on `pool`, without waiting; its first use waits for it. Only XLA's
    compile leaves the calling thread: tracing and lowering are Python, and Python work on two threads
    at once can import one module twice over (a half-initialised module, then an import error)."""
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
    _AHEAD[replicated] = pool.submit(_finite_program(replicated).lower(specs).compile)


def float_leaves(state: Any) -> list[tuple[str, int, jax.Array]]:
    """(field, index among that field's leaves, leaf) of every float leaf of the fp32 master copy, then
    of the parameters: the argument list of `finite_flags` whoever asks."""
    return [(field, i, x) for field in ("master", "params") if getattr(state, field) is not None
            for i, x in enumerate(jax.tree.leaves(getattr(state, field))) if jnp.issubdtype(x.dtype, jnp.inexact)]


def params_finite(state: Any, replicated: Any) -> np.ndarray:
    """Per parameter leaf (in `jax.tree.leaves` order): whether it is all finite (integer leaves are)."""
    found = float_leaves(state)
    flags = np.asarray(jax.device_get(finite_flags(replicated)([x for *_, x in found])))
    finite = np.ones(len(jax.tree.leaves(state.params)), bool)
    for (field, i, _), ok in zip(found, flags):
        if field == "params":
            finite[i] = ok
    return finite


class NonFiniteGuard:
    """Asks the engine's state, at fetch points only, whether the run has gone non-finite."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.skipping = engine.plan.scaler.check_finite

    def problem(self, record: Mapping[str, Any] | None = None, *, saving: bool = False) -> str | None:
        """None while everything is finite; else what went wrong, where, and first at which step.

        The parameters themselves are checked (one reduction over them) before a save, and at
        fetches when steps are skipped, since then the gradients say nothing. Every process must
        call this at the same points: the reduction is a computation over the whole mesh."""
        state, paths = self.engine.state, self.engine.plan.leaf_paths
        if not self.skipping:
            first, bad = jax.device_get((state.scaler.last_overflow, state.scaler.first_bad))
            if bad.any():
                return (f"non-finite gradients at step {int(first) + 1}, first in "
                        f"{_names(self.engine.plan.trained_paths, bad)}")
            if record is not None and not np.isfinite(record["loss"]):
                return f"the loss is {record['loss']} at step {record['step']}"
        if not (saving or self.skipping):
            return None
        if state.params is None:  # parameters in NVMe files between steps: read them back to check them
            state = self.engine.whole_state()
        finite = params_finite(state, self.engine.plan.replicated)
        if not finite.all():
            return (f"non-finite parameters by step {int(state.step)} in "
                    f"{_names(list(paths), ~finite) if len(paths) == len(finite) else 'some leaves'}")
        return None


def stop_message(problem: str, step: int, newest: str | None, ckpt_dir: Any) -> str:
    """The one message a stopped run prints: what, where, what was kept, how to go on."""
    kept = (f"the newest checkpoint, {newest} in {ckpt_dir}, is from before it (continue from there with "
            f"--resume {newest} after the fix)" if newest else "no checkpoint was saved")
    return f"{problem}; stopped at step {step} without saving: {kept}. To fix: {FIX}"
