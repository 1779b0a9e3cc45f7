"""Hang detection: a run that makes no progress for `distributed.hang_timeout` seconds fails loudly.

A multi-process run whose processes stop meeting in the same collectives does not fail by itself:
every process waits in its collective forever, silent, at 0% CPU. The trainer reports progress
(`beat(step, doing)`) at each step, save and evaluation; when none comes for the timeout, this
process writes one line saying what it was doing (e.g. "in train step 47 (the step's all-gathers and
reduce-scatters)"), dumps every thread's Python stack (faulthandler) and exits with `EXIT_HUNG`.
Every process of the run has the same timeout, so every stuck process reports; `zerojax launch`
names them and exits non-zero (see docs/distributed.md). A process that has reported waits a little
before it exits: the first exit ends the others through JAX's coordination service, and a peer whose
deadline came a moment later must still get to write its own report.

The report comes from a Python thread (a collective releases the GIL while it waits); should the
process hold the GIL for good, faulthandler's own C timer dumps the stacks a little later.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from typing import IO, Iterator

ENV_HANG_TIMEOUT = "ZEROJAX_HANG_TIMEOUT"  # what `zerojax launch --hang-timeout` sets; wins over the config
EXIT_HUNG = 86                             # this process stopped itself: no progress for the timeout
REPORT_PREFIX = "zerojax watchdog:"        # the first line of a report (the launcher looks for it)
FIRST_STEP_ALLOWANCE = 3.0                 # the first step also compiles: it gets this many timeouts
PEER_REPORT_SECONDS = 30.0                 # at most this long (or one timeout) a reported process waits
                                           # before exiting, so its stuck peers report too


def hang_timeout(configured: float | None, environ: dict[str, str] | None = None) -> float | None:
    """The timeout in seconds (None or 0: off): `ZEROJAX_HANG_TIMEOUT` if set, else the config's."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_HANG_TIMEOUT, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            from zerojax.errors import ConfigError
            raise ConfigError(f"{ENV_HANG_TIMEOUT}={text!r}: expected seconds (0: off), e.g. "
                              f"{ENV_HANG_TIMEOUT}=600 or zerojax launch --hang-timeout 600") from None
    else:
        value = configured
    return value if value else None


class Watchdog:
    """Fails this process when `beat` has not been called for `timeout` seconds."""

    def __init__(self, timeout: float, *, process: int = 0, processes: int = 1, stream: IO[str] | None = None,
                 exit_code: int | None = EXIT_HUNG):
        self.timeout, self.process, self.processes = timeout, process, processes
        self.stream = stream if stream is not None else sys.stderr
        self.exit_code = exit_code  # None: report only (tests)
        self.fired = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last = time.monotonic()
        self._deadline = self._last + timeout * FIRST_STEP_ALLOWANCE
        self.done = "nothing yet (starting up)"
        self.doing = "starting: the first step compiles"
        self._thread = threading.Thread(target=self._watch, name="zerojax-watchdog", daemon=True)
        self._thread.start()
        self._arm_fallback()

    def beat(self, doing: str, done: str | None = None, allowance: float = 1.0) -> None:
        """Progress: now `doing` (e.g. "in train step 48"), after `done`; `allowance` timeouts to go."""
        with self._lock:
            self._last = time.monotonic()
            self._deadline = self._last + self.timeout * allowance
            self.doing = doing
            if done is not None:
                self.done = done
        self._arm_fallback()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            faulthandler.cancel_dump_traceback_later()
        self._thread.join(timeout=5)

    def _arm_fallback(self) -> None:
        """faulthandler's C timer: stacks and exit even if the report thread never gets the GIL."""
        if self.exit_code is None:
            return
        with contextlib.suppress(Exception):
            left = self._deadline - time.monotonic()
            faulthandler.dump_traceback_later(left + max(30.0, self.timeout / 2), exit=True, file=self.stream)

    def _watch(self) -> None:
        interval = min(1.0, self.timeout / 10)
        while not self._stop.wait(interval):
            with self._lock:
                late = time.monotonic() > self._deadline
                idle, doing, done = time.monotonic() - self._last, self.doing, self.done
            if late:
                self._report(idle, doing, done)
                return

    def _report(self, idle: float, doing: str, done: str) -> None:
        who = f"process {self.process} of {self.processes}" if self.processes > 1 else "this process"
        try:
            self.stream.write(
                f"{REPORT_PREFIX} {who} made no progress for {idle:.0f} s (distributed.hang_timeout="
                f"{self.timeout:g} s); last progress: {done}; now {doing}. Every thread's Python stack "
                f"follows (most recent call first); stopping with exit code {self.exit_code}.\n")
            self.stream.flush()
            try:
                faulthandler.dump_traceback(file=self.stream, all_threads=True)
            except (AttributeError, ValueError, OSError):  # a stream without a file descriptor
                for ident, frame in sys._current_frames().items():
                    self.stream.write(f"Thread {ident:#x}:\n" + "".join(traceback.format_stack(frame)))
            self.stream.flush()
        finally:
            self.fired.set()
            if self.exit_code is not None:
                if self.processes > 1:
                    time.sleep(min(self.timeout, PEER_REPORT_SECONDS))
                os._exit(self.exit_code)


_current: Watchdog | None = None


def beat(doing: str, done: str | None = None, allowance: float = 1.0) -> None:
    """Report progress to the watchdog of this run, if one is watching (else nothing)."""
    if _current is not None:
        _current.beat(doing, done, allowance)


@contextlib.contextmanager
def watching(configured: float | None) -> Iterator[Watchdog | None]:
    """Watch the enclosed run for hangs with the configured timeout (or `ZEROJAX_HANG_TIMEOUT`)."""
    global _current
    timeout = hang_timeout(configured)
    if timeout is None or _current is not None:
        yield _current
        return
    import jax
    dog = Watchdog(timeout, process=jax.process_index(), processes=jax.process_count())
    _current = dog
    try:
        yield dog
    finally:
        _current = None
        dog.close()
