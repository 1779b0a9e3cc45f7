"""`python train.py --config ...` and `zerojax config explain` as a user runs them."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["run.steps=12", "run.log_every=3", "steps_per_print=6", "model.d_model=64", "model.n_layers=2",
         "model.seq_len=32", "data.max_bytes=200000", "run.eval_batches=1", "run.progress=false",
         "scheduler.params.total_num_steps=12", "scheduler.params.warmup_num_steps=3"]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the config's mesh.cpu_devices must be what asks for devices
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def test_configs_differ_only_in_stage() -> None:
    import yaml
    configs = [yaml.safe_load((ROOT / f"configs/zero{s}.yaml").read_text()) for s in range(4)]
    for s, c in enumerate(configs):
        assert c["zero_optimization"].pop("stage") == s
        assert c["run"].pop("output_dir") == f"runs/zero{s}"
    assert all(c == configs[0] for c in configs)


def test_train_writes_metrics_config_and_falls(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run("train.py", "--config", "configs/zero3.yaml", "--set", *SMALL, f"run.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeRO stage 3" in proc.stdout and "formula" in proc.stdout
    assert "over 8 data shards" in proc.stdout
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 3, 6, 9, 12]
    for r in records:
        assert set(r) == {"step", "loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens_per_s"}
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    saved = json.loads((out / "config.json").read_text())
    assert saved["zero_optimization"]["stage"] == 3 and saved["run"]["steps"] == 12
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] is not None and summary["steps"] == 12
    # what runs after the last step says so, in order; the schedule fits the run: no warning
    lines = proc.stdout.splitlines()
    at = [next(i for i, l in enumerate(lines) if l.startswith(p)) for p in
          ("step 12:", f"saving final checkpoint global_step12 to {out / 'checkpoints'}...",
           "validating on 1 batch(es) after step 12...", "done: 12 steps")]
    assert at == sorted(at)
    assert "warning: run.steps" not in proc.stdout

    # A second run never overwrites the first one's files.
    again = run("train.py", "--config", "configs/zero3.yaml", "--set", *SMALL, f"run.output_dir={out}",
                "run.steps=3")
    assert again.returncode == 0, again.stderr[-3000:]
    # run.steps=3 under a schedule sized for 12 ends before its decay: said at start-up, naming both keys
    warned = [l for l in again.stdout.splitlines() if l.startswith("warning: run.steps")]
    assert len(warned) == 1 and re.fullmatch(
        r"warning: run\.steps=3 is shorter than the WarmupCosineLR schedule \(scheduler\.params\.total_num_steps=12\): "
        r"the run ends at lr (\S+), where the schedule goes on to lr \S+ at step 12; to run the whole schedule set "
        r"scheduler\.params\.total_num_steps=3, or set run\.steps=12", warned[0])
    last_lr = json.loads((tmp_path / "run-2" / "metrics.jsonl").read_text().splitlines()[-1])["lr"]
    assert float(re.search(r"ends at lr (\S+),", warned[0])[1]) == pytest.approx(last_lr, rel=1e-3)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == len(records)
    assert (tmp_path / "run-2" / "metrics.jsonl").exists()


def test_override_changes_stage(tmp_path: Path) -> None:
    proc = run("train.py", "--config", "configs/zero3.yaml", "--set", *SMALL, "zero_optimization.stage=1",
               "run.steps=2", f"run.output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeRO stage 1" in proc.stdout


def test_fp16_config_trains(tmp_path: Path) -> None:
    """configs/fp16.yaml: the main command in fp16 with the dynamic loss scaler."""
    out = tmp_path / "run"
    proc = run("train.py", "--config", "configs/fp16.yaml", "--set", *SMALL, f"run.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "precision fp16" in proc.stdout
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss_scale"] == 2.0 ** 16
    assert records[-1]["loss"] < records[0]["loss"] - 0.5


@pytest.mark.parametrize("args, message", [
    (["--set", "zero_optimization.stag=2"], "unknown key 'zero_optimization.stag'; did you mean 'stage'"),
    (["--set", "train_batch_size=30"], "train_batch_size"),
    (["--set", "nokey"], "write it as key.path=value"),
])
def test_bad_input_is_one_clear_error(args: list, message: str, tmp_path: Path) -> None:
    proc = run("train.py", "--config", "configs/zero3.yaml", *args, f"run.output_dir={tmp_path}")
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_config_file() -> None:
    proc = run("train.py", "--config", "configs/nope.yaml")
    assert proc.returncode == 2 and "configs/nope.yaml: not found" in proc.stderr


def test_config_explain() -> None:
    proc = run("-m", "zerojax.cli", "config", "explain", "configs/zero2.yaml", "--set", "run.steps=7")
    assert proc.returncode == 0, proc.stderr
    lines = {l.split()[0]: l for l in proc.stdout.splitlines()[1:]}
    assert "override" in lines["run.steps"]
    assert "file" in lines["zero_optimization.stage"]
    assert "derived" in lines["gradient_accumulation_steps"]
    assert lines["gradient_accumulation_steps"].split()[1] == "1"
    assert "default" in lines["fp16.loss_scale_window"]


def test_resume_continues_exactly_and_export(tmp_path: Path) -> None:
    """6 steps + resume in a fresh process to 12 == 12 uninterrupted steps, bitwise; then export."""
    small = [*SMALL, "run.save_every=4"]
    straight = run("train.py", "--config", "configs/zero2.yaml", "--set", *small, f"run.output_dir={tmp_path / 'a'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    half = run("train.py", "--config", "configs/zero2.yaml", "--set", *small, "run.steps=6",
               f"run.output_dir={tmp_path / 'b'}")
    assert half.returncode == 0, half.stderr[-3000:]
    # a fresh run must not write into another run's checkpoints
    clash = run("train.py", "--config", "configs/zero2.yaml", "--set", *small,
                f"run.checkpoint_dir={tmp_path / 'b' / 'checkpoints'}", f"run.output_dir={tmp_path / 'c'}")
    assert clash.returncode == 2 and "pass --resume" in clash.stderr
    resumed = run("train.py", "--config", "configs/zero2.yaml", "--set", *small, f"run.output_dir={tmp_path / 'b'}",
                  "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "global_step6" in resumed.stdout

    def curve(d: Path) -> dict:
        return {r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())}

    a, b = curve(tmp_path / "a"), curve(tmp_path / "b")
    assert set(b) >= {1, 3, 6, 9, 12}
    for step in (9, 12):
        assert a[step] == b[step]
    ckpts = tmp_path / "b" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "global_step12"

    out = tmp_path / "model.safetensors"
    exported = run("-m", "zerojax.cli", "export", str(ckpts), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    import numpy as np
    import zerojax
    params = zerojax.load_exported(str(out))
    assert params["blocks"]["fc"]["kernel"].shape == (2, 64, 256)
    assert params["embed"]["embedding"].dtype == np.float32


def test_ctrl_c_saves_a_complete_checkpoint(tmp_path: Path) -> None:
    import signal
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "train.py", "--config", "configs/zero1.yaml", "--set", *SMALL,
                              "run.steps=100000", "steps_per_print=2", f"run.output_dir={out}"],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:
            if line.startswith("step 4:"):
                child.send_signal(signal.SIGINT)
                break
        stdout, stderr = child.communicate(timeout=300)
    finally:
        child.kill()
    assert child.returncode == 130, stderr[-3000:]
    assert "saving a checkpoint before exiting" in stdout
    # the message says how to go on: this command, with --resume
    import shlex
    said = [l for l in stderr.splitlines() if l.startswith("zerojax: continue the run with: ")]
    assert len(said) == 1 and said[0].endswith(" " + shlex.join(
        ["train.py", "--config", "configs/zero1.yaml", "--set", *SMALL, "run.steps=100000", "steps_per_print=2",
         f"run.output_dir={out}", "--resume", "latest"])), stderr[-3000:]
    tag = (out / "checkpoints" / "latest").read_text().strip()
    stopped = int(tag.removeprefix("global_step"))
    assert stopped >= 4
    from zerojax import checkpoint
    meta = checkpoint.metadata(out / "checkpoints")  # complete, and it knows where the data stopped
    assert meta["step"] == stopped and meta["extra"]["data_position"] == stopped


def test_pipeline_config_trains(tmp_path: Path) -> None:
    """configs/pipeline.yaml: the GPT cut into 4 stages x 2 data shards, 1F1B, through train.py."""
    out = tmp_path / "run"
    proc = run("train.py", "--config", "configs/pipeline.yaml", "--set", *SMALL, f"run.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pipeline partition (parameters, 4 stages)" in proc.stdout
    assert "schedule 1f1b: 8 micro-batches" in proc.stdout and "mesh {'stage': 4, 'data': 2}" in proc.stdout
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] is not None and summary["steps"] == 12


def test_progress_bar_shows_the_newest_steps_numbers_and_what_runs_after(tmp_path: Path, capsys) -> None:
    """Between logged steps the bar shows the newest step the device has finished, named by its step
    (not the last logged step's numbers unnamed), and after the last step it says what runs."""
    import jax.numpy as jnp
    from zerojax import load_config
    from zerojax.app.monitor import Monitor
    config = load_config({"train_batch_size": 8, "run": {"progress": True, "log_every": 10}, "steps_per_print": 10})
    monitor = Monitor(config, tmp_path, 4, tokens_per_step=8, samples_per_step=8)

    def metrics(step: int) -> dict:
        return {"loss": jnp.float32(10.0 - step), "lr": jnp.float32(step * 1e-3), "grad_norm": jnp.float32(1.0),
                "loss_scale": jnp.float32(1.0), "skipped": jnp.bool_(False)}
    try:
        for step in (1, 2, 3):
            monitor.step(step, metrics(step))
        assert "step=2, loss=8.000, lr=2.00e-03" in monitor._bar.postfix  # step 3's call shows step 2's
        monitor.phase("validating on 1 batch(es) after step 3...")
        assert "step=3, loss=7.000, lr=3.00e-03" in monitor._bar.postfix and monitor._bar.desc.startswith("validating")
    finally:
        monitor.close()
    assert "validating on 1 batch(es) after step 3..." in capsys.readouterr().out


# train.py with a listener on the event JAX records around every program it obtains, compiled or read
# from the persistent cache (so a warm cache does not hide one): what the run needed beyond memory.
COUNT_PROGRAMS = """
import sys
from jax import monitoring
programs, hits = [], []
monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: programs.append(secs) if event == '/jax/core/compile/backend_compile_duration' else None)
monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == '/jax/compilation_cache/cache_hits' else None)
from zerojax.app.cli import main
rc = main(['train', *sys.argv[1:]])
print(f'programs: {len(programs)}, cache hits: {len(hits)}')
sys.exit(rc)
"""


def test_train_py_compiles_each_program_once_into_its_compile_cache(tmp_path: Path) -> None:
    """A one-step zero3.yaml run (start-up, step, final save, validation, sample) needs a handful of
    programs, each compiled once, and leaves them in run.compile_cache for the next run."""
    cache = tmp_path / "jax-cache"
    settings = ["run.steps=1", f"run.output_dir={tmp_path / 'run'}", f"run.compile_cache={cache}",
                "run.progress=false", "model.d_model=64", "model.n_layers=2", "model.seq_len=32",
                "data.max_bytes=200000", "run.eval_batches=1", "run.sample_tokens=4"]
    p = run("-c", COUNT_PROGRAMS, "--config", "configs/zero3.yaml", "--set", *settings)
    assert p.returncode == 0, p.stderr[-3000:]
    programs, hits = map(int, re.search(r"programs: (\d+), cache hits: (\d+)", p.stdout).groups())
    assert programs <= 7, p.stdout[-2000:]   # 92 before programs were compiled once each; 14 before the
    # finiteness check was shared and generate stopped running eager scalar and slicing ops
    assert hits == 0 and any(cache.iterdir())  # a fresh folder: all compiled, all kept

    again = run("-c", COUNT_PROGRAMS, "--config", "configs/zero3.yaml", "--set", *settings,
                f"run.output_dir={tmp_path / 'run2'}")
    assert again.returncode == 0, again.stderr[-3000:]
    warm = re.search(r"programs: (\d+), cache hits: (\d+)", again.stdout).groups()
    assert warm == (str(programs), str(programs))  # the second run reads every program from the cache


def test_compile_cache_folder(tmp_path: Path) -> None:
    from zerojax.errors import ConfigError
    from zerojax.config import load_config
    from zerojax.runtime.compile_cache import cache_dir
    assert cache_dir("auto", {"HOME": str(tmp_path)}).parts[-3:] == (".cache", "zerojax", "jax")
    assert cache_dir("auto", {"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "zerojax" / "jax"
    assert cache_dir("auto", {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}) == "/elsewhere"  # the environment's
    assert cache_dir(str(tmp_path / "c"), {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}) == tmp_path / "c"
    assert cache_dir(None, {}) is None
    cfg = ROOT / "configs" / "zero3.yaml"
    assert load_config(cfg).run.compile_cache == "auto"
    assert load_config(cfg, ["run.compile_cache=false"]).run.compile_cache is None
    assert load_config(cfg, ["run.compile_cache=none"]).run.compile_cache is None
    with pytest.raises(ConfigError, match="run.compile_cache"):
        load_config(cfg, ["run.compile_cache=3"])
