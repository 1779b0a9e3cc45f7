"""A run's folders: one run per folder (a lock naming the holder), no empty folders after a failed start,
and the final loss reported even when the last step is not a logging step."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from test_cli import ROOT, SMALL, run
from zerojax.errors import ConfigError
from zerojax.runtime.run_lock import LOCK_FILE, RunLock


def test_a_held_folder_refuses_a_second_lock_naming_the_holder(tmp_path: Path) -> None:
    first = RunLock(tmp_path)
    with pytest.raises(ConfigError, match=rf"^run.output_dir: {tmp_path} is in use by another run \(process "
                                          rf"\d+ on .*, started .*\); wait for it to finish"):
        RunLock(tmp_path)
    first.release()
    RunLock(tmp_path).release()          # free again once released
    assert (tmp_path / LOCK_FILE).exists()


def test_a_crashed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    code = f"from pathlib import Path; from zerojax.runtime.run_lock import RunLock; RunLock(Path({str(tmp_path)!r})); import os; os._exit(9)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 9
    RunLock(tmp_path).release()


def test_train_py_refuses_a_folder_another_run_holds(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from zerojax.runtime.run_lock import RunLock
        RunLock(Path({str(out)!r})); print("held", flush=True); time.sleep(120)""")], cwd=ROOT,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = run("train.py", "--config", "configs/zero3.yaml", "--set", *SMALL, f"run.output_dir={out}")
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2  # a configuration error
    assert f"run.output_dir: {out} is in use by another run (process {holder.pid} on " in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written into the other run's folder


def test_a_failed_start_leaves_no_empty_folders(tmp_path: Path) -> None:
    tokens = tmp_path / "tiny.bin"
    np.arange(10, dtype=np.uint16).tofile(tokens)  # far too short for one batch
    out = tmp_path / "runs" / "deep" / "run"
    proc = run("train.py", "--config", "configs/zero3.yaml", "--set", *SMALL, f"run.output_dir={out}",
               f"data.path={tokens}")
    assert proc.returncode != 0 and "data" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


def test_the_last_loss_is_the_last_steps_even_off_the_logging_grid(tmp_path: Path) -> None:
    out = tmp_path / "run"
    steps = ["run.steps=4" if s.startswith("run.steps=") else s for s in SMALL]
    proc = run("train.py", "--config", "configs/zero3.yaml", "--set", *steps, "run.log_every=3",
               f"run.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 3]
    assert summary["last_loss"] != logged[-1]["loss"]          # step 4's, not step 3's
    assert f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}" in proc.stdout
