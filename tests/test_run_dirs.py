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


def _holder(folder: Path, key: str) -> subprocess.Popen:
    """Another run's process holding `folder`'s lock until killed."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from zerojax.runtime.run_lock import RunLock
        RunLock(Path({str(folder)!r}), {key!r}); print("held", flush=True); time.sleep(120)""")], cwd=ROOT,
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_run_on_one_checkpoint_dir_is_refused_up_front(tmp_path: Path) -> None:
    """Two runs with their own output folders but one run.checkpoint_dir: the second is refused before
    it builds or compiles anything, naming the lock and its holder, and leaves no folder behind."""
    shared = tmp_path / "ckpt"
    shared.mkdir()
    holder = _holder(shared, "run.checkpoint_dir")
    try:
        proc = run("train.py", "--config", "configs/zero3.yaml", "--set", *SMALL, f"run.output_dir={tmp_path / 'b'}",
                   f"run.checkpoint_dir={shared}")
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"run.checkpoint_dir: {shared} is in use by another run (process {holder.pid} on "
            in proc.stderr), proc.stderr[-2000:]
    assert f"lock {shared / LOCK_FILE}" in proc.stderr
    assert sorted(p.name for p in shared.iterdir()) == [LOCK_FILE] and not (tmp_path / "b").exists()


def test_a_save_into_a_folder_another_run_holds_is_refused(tmp_path: Path) -> None:
    """The library's save (engine.save_checkpoint) asks too: another run's folder gets nothing."""
    from test_checkpoint import small_setup
    from zerojax import checkpoint as ckpt
    plan, state = small_setup(stage=0)
    holder = _holder(tmp_path, "run.checkpoint_dir")
    try:
        with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint directory {tmp_path} is in use by another run "
                                                       rf"\(process {holder.pid} on "):
            ckpt.save(tmp_path, "t", state, plan, async_save=False)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]
    ckpt.save(tmp_path, "t", state, plan, async_save=False)  # the holder is gone: free again
    assert ckpt.list_tags(tmp_path) == ["t"]


def test_a_killed_holders_lock_is_taken_over_and_said(tmp_path: Path, capfd) -> None:
    """A run killed with its lock held (SIGKILL, the scheduler's time limit) never blocks the resume:
    the next run takes the lock over and says whose it was."""
    code = (f"from pathlib import Path; from zerojax.runtime.run_lock import RunLock; "
            f"RunLock(Path({str(tmp_path)!r}), 'run.checkpoint_dir'); import os; os._exit(9)")
    dead = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    assert dead.wait() == 9
    lock = RunLock(tmp_path, "run.checkpoint_dir")
    err = capfd.readouterr().err
    assert (f"run.checkpoint_dir: took over the lock {tmp_path / LOCK_FILE} left by process {dead.pid} on "
            in err and "which is no longer running" in err), err
    assert lock.taken_over is not None and lock.taken_over.startswith(f"process {dead.pid} on ")
    lock.release()
    RunLock(tmp_path, "run.checkpoint_dir").release()  # a clean release leaves nothing to take over
    assert "took over" not in capfd.readouterr().err


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
