"""Preemption: SIGTERM (what SLURM, Kubernetes and cloud schedulers send before a kill), SIGUSR1
(SLURM's usual `--signal` warning) and Ctrl-C all stop a run at a step boundary with a checkpoint.

One process: the first signal only sets a flag; the training loop sees it after the current step,
saves, and the process exits 128 + the signal's number (130 SIGINT, 143 SIGTERM, 138 SIGUSR1), as a
shell reports a process killed by it. Stopping at a step boundary matters: an exception raised inside
a step could leave the engine holding donated (deleted) buffers and nothing saveable. A second signal
before the stop raises at once. The save itself has a time limit (`run.signal_save_seconds`): a
scheduler kills the job soon anyway, and a hung save must not keep it waiting.

Several processes: JAX's preemption service owns SIGTERM and agrees on one step for everybody
(`distributed.stop_requested`); Ctrl-C is re-sent as SIGTERM (`distributed.interrupts_as_preemption`)
and so is SIGUSR1 here.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator

import jax

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Preempted(KeyboardInterrupt):
    """The run stopped on a signal after saving; `exit_code` is 128 + the signal's number."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


class Signals:
    """Which stop signal arrived (None: none yet); read by the loop once per step."""

    def __init__(self) -> None:
        self.received: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # asked twice before the loop could stop: stop now
            raise Preempted(signum)
        self.received = signum


@contextlib.contextmanager
def stop_signals() -> Iterator[Signals]:
    """Turn SIGINT/SIGTERM/SIGUSR1 into a flag while training (see the module doc)."""
    flags = Signals()
    if threading.current_thread() is not threading.main_thread():
        yield flags
        return
    multi = jax.process_count() > 1 and jax.config.jax_enable_preemption_service
    if multi:
        handlers = {signal.SIGUSR1: lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM)}
    else:
        handlers = {s: flags._on_signal for s in SIGNALS}
    previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    try:
        yield flags
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)


@contextlib.contextmanager
def bounded(seconds: float, exit_code: int, what: str) -> Iterator[None]:
    """Run the block (a save on the way out) with further stop signals ignored and at most `seconds`
    of time: past that the process exits with `exit_code` (the previous complete checkpoint stays
    `latest`; a partial one is never marked complete)."""
    def give_up() -> None:
        print(f"zerojax: {what} did not finish within run.signal_save_seconds={seconds:g}; exiting without "
              f"it (the previous complete checkpoint is still the latest)", file=sys.stderr, flush=True)
        os._exit(exit_code)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    mine = threading.current_thread() is threading.main_thread() and jax.process_count() == 1
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS} if mine else {}
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
