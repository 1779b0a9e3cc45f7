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

from typing import Any, Mapping

import jax
import numpy as np

from zerojax.core.offload import to_device
from zerojax.core.precision import leaf_finite

FIX = ("lower optimizer.params.lr (or warm it up) and check the data for bad values; with "
       "run.non_finite: stop, set it back to skip_step to skip steps whose gradients are not finite")


def _names(paths: list[str], bad: np.ndarray) -> str:
    names = [paths[i] for i in np.flatnonzero(bad)]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


class NonFiniteGuard:
    """Asks the engine's state, at fetch points only, whether the run has gone non-finite."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.skipping = engine.plan.scaler.check_finite
        self._params_finite = jax.jit(lambda params: leaf_finite(to_device(params)))  # offloaded too

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
        finite = np.asarray(jax.device_get(self._params_finite(state.params)))
        if not finite.all():
            return (f"non-finite parameters by step {int(state.step)} in "
                    f"{_names(list(paths), ~finite) if len(paths) == len(finite) else 'some leaves'}")
        return None


def stop_message(problem: str, step: int, newest: str | None, ckpt_dir: Any) -> str:
    """The one message a stopped run prints: what, where, what was kept, how to go on."""
    kept = (f"the newest checkpoint, {newest} in {ckpt_dir}, is from before it (continue from there with "
            f"--resume {newest} after the fix)" if newest else "no checkpoint was saved")
    return f"{problem}; stopped at step {step} without saving: {kept}. To fix: {FIX}"
