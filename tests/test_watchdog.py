"""Hang detection (zerojax/watchdog.py): a stalled run reports what it was doing, dumps every thread's
stack and fails; `zerojax launch` names the stuck processes (the two-process case is in
test_distributed.py::test_a_stalled_process_is_reported_by_every_process_and_named)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from zerojax.errors import ConfigError
from zerojax.runtime.watchdog import ENV_HANG_TIMEOUT, REPORT_PREFIX, Watchdog, hang_timeout


def test_timeout_comes_from_the_environment_before_the_config() -> None:
    assert hang_timeout(300.0, {}) == 300.0
    assert hang_timeout(300.0, {ENV_HANG_TIMEOUT: "12.5"}) == 12.5
    assert hang_timeout(300.0, {ENV_HANG_TIMEOUT: "0"}) is None
    assert hang_timeout(None, {}) is None and hang_timeout(0.0, {}) is None
    with pytest.raises(ConfigError, match=ENV_HANG_TIMEOUT):
        hang_timeout(300.0, {ENV_HANG_TIMEOUT: "soon"})


def test_a_stall_is_reported_with_what_it_was_doing_and_every_stack(tmp_path: Path) -> None:
    release = threading.Event()

    def stuck_worker() -> None:  # a thread that stops making progress, as a collective would
        release.wait(30)

    worker = threading.Thread(target=stuck_worker, name="worker")
    worker.start()
    with open(tmp_path / "report", "w+") as stream:
        dog = Watchdog(0.6, process=1, processes=2, stream=stream, exit_code=None)
        try:
            dog.beat("in train step 1", "step 0", allowance=1.0)
            for step in range(2, 6):  # progress keeps it quiet
                time.sleep(0.3)
                dog.beat(f"in train step {step}", f"step {step - 1}")
            assert not dog.fired.is_set()
            started = time.monotonic()
            assert dog.fired.wait(10), "no report after the timeout"
            assert 0.5 < time.monotonic() - started < 3
        finally:
            release.set()
            dog.close()
            worker.join()
        stream.seek(0)
        text = stream.read()
    first = text.splitlines()[0]
    assert first.startswith(f"{REPORT_PREFIX} process 1 of 2 made no progress for")
    assert "last progress: step 4; now in train step 5" in first
    assert "in stuck_worker" in text and "test_watchdog.py" in text  # faulthandler's stack of every thread
