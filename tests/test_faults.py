"""Faults a run must survive or report: non-finite values, signals from a scheduler, a kill -9."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import zerojax
from zerojax.core.nonfinite import NonFiniteGuard
from zerojax.errors import NonFiniteError
from zerojax.runtime.preemption import stop_signals

from helpers import data_mesh, make_batch, make_config, mlp_params, mse_loss
from test_cli import ROOT, SMALL, run


def _engine(**extra) -> zerojax.Engine:
    return zerojax.initialize(make_config(2, dtype="bf16", train_batch_size=16, **extra), params=mlp_params(0),
                              loss_fn=mse_loss, mesh=data_mesh())


def _nan_batch(rows: int, seed: int) -> dict:
    batch = make_batch(rows, seed)
    batch["x"] = batch["x"].copy()
    batch["x"][3, 0] = np.nan
    return batch


def test_stop_applies_the_step_and_the_next_call_names_it() -> None:
    """`run.non_finite: stop` (DeepSpeed's bf16 behaviour: non-finite updates are applied): the engine
    raises from the next train_batch, and the trainer's guard names the same step and leaves."""
    engine = _engine(run={"non_finite": "stop"})
    assert not engine.plan.scaler.check_finite
    guard = NonFiniteGuard(engine)
    engine.train_batch(make_batch(16, 0))
    assert guard.problem() is None
    engine.train_batch(_nan_batch(16, 1))  # step 2: NaN gradients, applied
    with pytest.raises(NonFiniteError, match=r"^a non-finite loss or gradients at step 2 \(run.non_finite: stop\); "
                                             r"non-finite first in \['b_in'\]"):
        engine.train_batch(make_batch(16, 2))
    problem = guard.problem()
    assert problem is not None and problem.startswith("non-finite gradients at step 2, first in ['b_in']")


def test_bf16_check_grad_overflow_false_means_deepspeeds_behaviour() -> None:
    engine = _engine(bf16={"enabled": True, "check_grad_overflow": False})
    assert engine.config.run.non_finite == "stop" and not engine.plan.scaler.check_finite
    with pytest.raises(zerojax.ConfigError, match="run.non_finite: skip_step skips non-finite steps, but "
                                                  "bf16.check_grad_overflow: false"):
        _engine(bf16={"enabled": True, "check_grad_overflow": False}, run={"non_finite": "skip_step"})


def test_the_limit_of_consecutive_skipped_steps_stops_the_engine() -> None:
    engine = _engine(run={"non_finite_limit": 3})
    engine.train_batch(_nan_batch(16, 0))
    engine.train_batch(_nan_batch(16, 1))
    engine.train_batch(make_batch(16, 2))              # a clean step ends the streak
    engine.train_batch(_nan_batch(16, 3))
    engine.train_batch(_nan_batch(16, 4))
    with pytest.raises(NonFiniteError, match=r"^3 consecutive steps skipped \(run.non_finite_limit\) with a "
                                             r"non-finite loss or gradients, the first at step 4; non-finite first "
                                             r"in \['b_in'\]"):
        engine.train_batch(_nan_batch(16, 5))        # raised by the call of the step that reached it
    assert engine.skipped_steps == 5 and engine.global_steps == 6


def test_the_library_step_skips_a_non_finite_batch_by_default() -> None:
    """A hand-written loop over zerojax.make_train_step: one NaN batch no longer poisons later steps."""
    config = make_config(3, dtype="bf16", train_batch_size=16)
    plan = zerojax.plan(config, data_mesh(), mlp_params(0))
    state = zerojax.init_state(plan, mlp_params(0))
    step = zerojax.make_train_step(plan, mse_loss)
    state, _ = step(state, make_batch(16, 0))
    before = jax.device_get(state.master)
    state, metrics = step(state, _nan_batch(16, 1))
    assert bool(metrics["skipped"]) and bool(metrics["non_finite"]) and int(metrics["skipped_streak"]) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.master), before)
    state, metrics = step(state, make_batch(16, 2))
    assert not bool(metrics["skipped"]) and int(metrics["skipped_streak"]) == 0 and int(state.skipped) == 1
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


def test_skip_step_skips_non_finite_gradients() -> None:
    engine = _engine()  # skip_step is the default
    assert engine.config.bf16.check_grad_overflow and engine.plan.scaler.check_finite
    engine.train_batch(make_batch(16, 0))
    before = jax.device_get(engine.params)
    metrics = jax.device_get(engine.train_batch(_nan_batch(16, 1)))
    assert bool(metrics["skipped"]) and engine.skipped_steps == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(engine.params), before)
    assert NonFiniteGuard(engine).problem() is None  # skipped: the state is still finite


def test_infinite_lr_stops_the_run_and_saves_nothing_past_it(tmp_path: Path) -> None:
    """`optimizer.params.lr=.inf` used to train NaN to the end, save NaN checkpoints and exit 0."""
    out = tmp_path / "run"
    proc = run("train.py", "--config", "configs/zero3.yaml", "--set", *SMALL, "run.save_every=2",
               "optimizer.params.lr=.inf", f"run.output_dir={out}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # lr is 0 at step 1 of the warmup, inf at step 2: the save at step 2 finds inf parameters
    assert err[0].startswith("zerojax: error: non-finite parameters by step 2 in ['blocks']"), err[0]
    assert "stopped at step 2 without saving" in err[0] and "lower optimizer.params.lr" in err[0]
    assert "no checkpoint was saved" in err[0]
    assert not (out / "checkpoints").exists() or [p.name for p in (out / "checkpoints").iterdir()] == [".zerojax.lock"]
    assert not (out / "summary.json").exists()


def test_stop_signals_become_a_flag() -> None:
    with stop_signals() as flags:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flags.received == signal.SIGUSR1 and flags.name == "SIGUSR1"
        with pytest.raises(KeyboardInterrupt) as e:  # a second signal before the stop: at once
            os.kill(os.getpid(), signal.SIGTERM)
        assert e.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def _popen(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "train.py", *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _signal_at(child: subprocess.Popen, line_start: str, signum: int) -> tuple[int, str, str]:
    try:
        seen = []
        for line in child.stdout:
            seen.append(line)
            if line.startswith(line_start):
                child.send_signal(signum)
                break
        stdout, stderr = child.communicate(timeout=300)
    finally:
        child.kill()
    return child.returncode, "".join(seen) + stdout, stderr


def test_kill_9_resume_and_sigterm(tmp_path: Path) -> None:
    """kill -9 after step 6 (checkpoint at 4): the resumed run's metrics.jsonl holds every step once.
    Then SIGTERM, as a scheduler sends it: a checkpoint at a step boundary and exit 143."""
    out = tmp_path / "run"
    common = ["--config", "configs/zero1.yaml", "--set", *SMALL, "run.log_every=1", "steps_per_print=1",
              "run.save_every=4", "checkpoint.async_save=false", f"run.output_dir={out}"]
    assert _signal_at(_popen(*common, "run.steps=100000"), "step 6:", signal.SIGKILL)[0] == -signal.SIGKILL
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step4"
    rows = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert rows[:6] == [1, 2, 3, 4, 5, 6]

    resumed = run("train.py", *common, "run.steps=8", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "dropped" in resumed.stdout and "past step 4" in resumed.stdout
    rows = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 9))

    code, stdout, stderr = _signal_at(_popen(*common, "run.steps=100000", "--resume"), "step 10:", signal.SIGTERM)
    assert code == 143, stderr[-3000:]
    assert "SIGTERM after step" in stdout and "saving a checkpoint before exiting" in stdout, stdout[-2000:]
    tag = (out / "checkpoints" / "latest").read_text().strip()
    assert int(tag.removeprefix("global_step")) >= 10
    from zerojax import checkpoint
    meta = checkpoint.metadata(out / "checkpoints")
    assert meta["extra"]["data_position"] == meta["step"]
    assert "Traceback" not in stderr, stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Checked before training: folders, the checkpoint to resume, memory. These fail before any data is
# read or anything compiled, so they run in-process through the CLI.

def _fake_tag(ckpt_dir: Path, step: int) -> None:
    """A complete-looking tag folder (what list_tags reads), without arrays."""
    tag = ckpt_dir / f"global_step{step}"
    (tag / "state").mkdir(parents=True)
    (tag / "meta.json").write_text(json.dumps({"step": step, "saved_at": float(step)}))


def _train(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, float]:
    from zerojax.app.cli import main
    import time
    start = time.perf_counter()
    code = main(["train", "--config", "configs/zero3.yaml", "--set", *SMALL, *args])
    return code, capsys.readouterr().err, time.perf_counter() - start


def test_unwritable_folders_fail_at_start(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, err, _ = _train(capsys, f"run.output_dir={blocker / 'run'}")
    assert code == 2 and f"run.output_dir: cannot create {blocker / 'run'} (Not a directory)" in err
    code, err, _ = _train(capsys, f"run.output_dir={tmp_path / 'run'}", f"run.checkpoint_dir={blocker / 'ck'}")
    assert code == 2 and f"run.checkpoint_dir: cannot write to {blocker / 'ck'}" in err
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        code, err, _ = _train(capsys, f"run.output_dir={ro / 'run'}")
        assert code == 2 and "run.output_dir: cannot" in err and "Permission denied" in err


def test_resume_checks_the_tag_and_the_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = tmp_path / "zero3"
    for step in (4, 8):
        _fake_tag(base / "checkpoints", step)
    (base / "config.json").write_text("{}")
    code, err, seconds = _train(capsys, f"run.output_dir={base}", "run.save_every=4", "--resume", "global_step4")
    assert code == 2 and "--resume global_step4:" in err and "newer checkpoints (global_step8)" in err, err
    # Only the tags the run will write collide: from step 4 to 6 it writes global_step6 alone.
    from zerojax.runtime.preflight import check_resume_tag
    check_resume_tag(base / "checkpoints", "global_step4", steps=6, save_every=4)
    with pytest.raises(zerojax.ConfigError, match=r"newer checkpoints \(global_step8\)"):
        check_resume_tag(base / "checkpoints", "global_step4", steps=8, save_every=0)
    code, err, _ = _train(capsys, f"run.output_dir={base}", "--resume", "global_step5")
    assert code == 2 and "no checkpoint global_step5" in err and "global_step4, global_step8" in err

    # A second fresh run went to zero3-2 and stopped before its first checkpoint: --resume means zero3.
    from zerojax.runtime.preflight import resume_target
    second = tmp_path / "zero3-2"
    second.mkdir()
    (second / "config.json").write_text("{}")
    assert resume_target([base, second], base, "latest", None) == (base, base / "checkpoints", None)
    # Both hold checkpoints: the candidates are listed, each with the exact flag; a path picks one.
    _fake_tag(second / "checkpoints", 2)
    code, err, _ = _train(capsys, f"run.output_dir={base}", "--resume")
    assert code == 2 and f"--resume {base} (latest global_step8); --resume {second} (latest global_step2)" in err
    assert resume_target([base, second], base, str(second), None) == (second, second / "checkpoints", None)
    assert resume_target([base, second], base, str(base / "checkpoints" / "global_step8"), None) == (
        base, base / "checkpoints", "global_step8")


def test_a_batch_too_big_fails_in_seconds(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err, seconds = _train(capsys, "train_batch_size=1e12", f"run.output_dir={tmp_path / 'run'}")
    assert code == 2 and "train_batch_size: 1000000000000 needs about" in err and "GiB of host memory" in err
    assert "lower train_batch_size" in err and not (tmp_path / "run").exists()
    assert seconds < 60


def test_device_memory_estimate_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerojax.runtime import preflight
    from zerojax.config import load_config
    from zerojax.planner.plan import make_plan
    from zerojax.models import gpt

    class Device:
        device_kind = "a 1 GiB accelerator"

        def memory_stats(self) -> dict:
            return {"bytes_limit": 2 ** 30}

    config = load_config("configs/zero3.yaml", ["train_batch_size=4096", "train_micro_batch_size_per_gpu=512", "model.remat=false"])
    layout = make_plan(config, data_mesh(), gpt.abstract_params(config.model))
    monkeypatch.setattr(preflight.jax, "local_devices", lambda: [Device()])
    with pytest.raises(zerojax.ConfigError) as e:
        preflight.check_memory(config, layout, 64)
    msg = str(e.value)
    assert "per device (model state" in msg and "for 512 rows x 128 tokens" in msg
    assert "but a 1 GiB accelerator has 1.00 GiB" in msg and "lower train_micro_batch_size_per_gpu" in msg
    preflight.check_memory(load_config("configs/zero3.yaml"), make_plan(load_config("configs/zero3.yaml"), data_mesh(),
                           gpt.abstract_params(config.model)), 64)  # the shipped config fits


def test_sigterm_during_the_final_save_lets_it_finish(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """After the last step the run is still saving: a scheduler's SIGTERM then must not lose the
    run's only checkpoint. The save completes, evaluation is skipped, the exit code is 143."""
    from zerojax.checkpoint import latest_tag, verify
    from zerojax.engine.engine import Engine
    save = Engine.save_checkpoint

    def signalled_save(self: Engine, *args, **kwargs):  # the signal lands as the final save starts
        os.kill(os.getpid(), signal.SIGTERM)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "save_checkpoint", signalled_save)
    code, err, _ = _train(capsys, "run.steps=3", "run.save_every=100", f"run.output_dir={tmp_path / 'run'}")
    ckpts = tmp_path / "run" / "checkpoints"
    assert code == 143, err
    assert latest_tag(ckpts) == "global_step3"
    verify(ckpts, "global_step3")
    assert not (tmp_path / "run" / "summary.json").exists()
