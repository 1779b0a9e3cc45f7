"""Multi-process runs: where a process learns its place, and 2 processes x 4 devices against 1 x 8.

The multi-process tests start real processes through `zerojax launch` (tests/multiprocess_worker.py)
with a timeout on every subprocess; the rest checks the start-up logic without starting JAX twice.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import zerojax
from helpers import assert_tree_close, data_mesh, layerwise_loss, mlp_params, to_numpy
from multiprocess_worker import STEPS, batches, config_for
from zerojax.config import DistributedConfig, load_config
from zerojax.runtime.distributed import (Processes, cpu_devices_per_process, differences, fingerprint, global_array, local_rows, resolve)

ROOT = Path(__file__).resolve().parents[1]
CACHE = os.path.abspath(os.environ.get("ZEROJAX_TEST_CACHE", ROOT / ".cache" / "jax"))


def launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`zerojax launch ...` from the repository root, with this suite's compilation cache."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ZEROJAX_TEST_CACHE": CACHE, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # each process asks for its own share of devices
    return subprocess.run([sys.executable, "-m", "zerojax.cli", "launch", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------------
# Where the coordinates come from.

def dist(**kw: object) -> DistributedConfig:
    return DistributedConfig(**kw)


def test_single_process_without_coordinates() -> None:
    assert resolve(dist(), {}) is None
    assert resolve(dist(), {"ZEROJAX_NUM_PROCESSES": "1", "ZEROJAX_PROCESS_ID": "0",
                            "ZEROJAX_COORDINATOR_ADDRESS": "h:1"}) is None


def test_launcher_environment() -> None:
    env = {"ZEROJAX_COORDINATOR_ADDRESS": "127.0.0.1:4321", "ZEROJAX_NUM_PROCESSES": "2",
           "ZEROJAX_PROCESS_ID": "1", "ZEROJAX_LOCAL_RANK": "1", "ZEROJAX_LOCAL_SIZE": "2",
           "ZEROJAX_DEVICES_PER_PROCESS": "4"}
    p = resolve(dist(), env)
    assert p == Processes("127.0.0.1:4321", 2, 1, 1, 2, 4, origin="zerojax launch")
    assert p.local_device_ids() == [4, 5, 6, 7]


def test_config_wins_over_environment_per_value() -> None:
    env = {"ZEROJAX_COORDINATOR_ADDRESS": "a:1", "ZEROJAX_NUM_PROCESSES": "4", "ZEROJAX_PROCESS_ID": "3"}
    p = resolve(dist(coordinator_address="b:2", num_processes=4), env)
    assert (p.coordinator_address, p.num_processes, p.process_id) == ("b:2", 4, 3)


def test_deepspeed_environment() -> None:
    env = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "WORLD_SIZE": "3", "RANK": "2", "LOCAL_RANK": "0"}
    p = resolve(dist(), env)
    assert (p.coordinator_address, p.num_processes, p.process_id, p.local_rank) == ("node0:29500", 3, 2, 0)
    # Only a complete set counts: a stray RANK in an image's environment leaves a single process alone.
    assert resolve(dist(), {"RANK": "0", "LOCAL_RANK": "0"}) is None
    assert resolve(dist(), {k: v for k, v in env.items() if k != "MASTER_PORT"}) is None


def test_slurm_one_task_per_node_gets_every_local_device() -> None:
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
           "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "2"}
    p = resolve(dist(), env)
    assert p.origin == "SLURM" and p.coordinator_address is None  # JAX derives it from the node list
    assert (p.num_processes, p.process_id, p.local_size) == (2, 1, 1)
    assert p.local_device_ids() == []  # all local GPUs, not JAX's one-GPU-per-process default
    per_gpu = resolve(dist(), {**env, "SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1"})
    assert per_gpu.local_size == 8 and per_gpu.local_device_ids() is None  # JAX's default: device LOCALID
    assert resolve(dist(), {**env, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert resolve(dist(join="never"), env) is None


def test_open_mpi_kubernetes_and_tpu_are_detected() -> None:
    ompi = {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert resolve(dist(), ompi).origin == "Open MPI"
    assert resolve(dist(), {"KUBERNETES_SERVICE_HOST": "x", "JOB_COMPLETION_INDEX": "0"}).origin == "Kubernetes"
    assert resolve(dist(), {"KUBERNETES_SERVICE_HOST": "x"}) is None  # a plain pod is one process
    assert resolve(dist(), {"TPU_WORKER_HOSTNAMES": "t0,t1"}).origin == "Cloud TPU"
    assert resolve(dist(join="always"), {}).origin == "JAX cluster detection"


@pytest.mark.parametrize("given, env, match", [
    (dict(num_processes=2), {}, "distributed.coordinator_address.*ZEROJAX_COORDINATOR_ADDRESS"),
    (dict(coordinator_address="h:1", num_processes=2), {}, "process_id.*ZEROJAX_PROCESS_ID"),
    (dict(), {"ZEROJAX_COORDINATOR_ADDRESS": "h:1", "ZEROJAX_NUM_PROCESSES": "2", "ZEROJAX_PROCESS_ID": "2"},
     "ZEROJAX_PROCESS_ID: process_id 2 is outside 0..1"),
    (dict(), {"ZEROJAX_NUM_PROCESSES": "two"}, "ZEROJAX_NUM_PROCESSES='two': expected an integer"),
])
def test_incomplete_or_wrong_coordinates_are_one_clear_error(given: dict, env: dict, match: str) -> None:
    with pytest.raises(zerojax.ConfigError, match=match):
        resolve(dist(**given), env)


def test_cpu_devices_split_over_processes() -> None:
    config = load_config({"train_batch_size": 8, "mesh": {"cpu_devices": 8}})
    procs = Processes("h:1", 2, 0)
    assert cpu_devices_per_process(config, None) == 8
    assert cpu_devices_per_process(config, procs) == 4
    assert cpu_devices_per_process(config, Processes("h:1", 2, 0, devices_per_process=3)) == 3
    with pytest.raises(zerojax.ConfigError, match="mesh.cpu_devices: 8 devices do not split evenly over 3"):
        cpu_devices_per_process(config, Processes("h:1", 3, 0))


def test_distributed_keys_parse_and_are_checked() -> None:
    config = load_config({"train_batch_size": 8, "distributed": {"join": "never", "check_consistency": True,
                                                                  "initialization_timeout": 30}})
    assert config.distributed.join == "never" and config.distributed.check_consistency
    with pytest.raises(zerojax.ConfigError, match="distributed.join"):
        load_config({"train_batch_size": 8, "distributed": {"join": "sometimes"}})


# ------------------------------------------------------------------------------------------------
# Rows and fingerprints in one process.

def test_one_process_owns_every_row_and_places_host_data() -> None:
    p = zerojax.plan(config_for(1), data_mesh(), mlp_params(0))
    assert local_rows(p.batch_sharding, 32).tolist() == list(range(32))
    x = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    placed = global_array(x, p.batch_sharding, 32)
    assert placed.sharding == p.batch_sharding
    np.testing.assert_array_equal(np.asarray(placed), x)


def test_fingerprint_differences_name_the_key() -> None:
    params = mlp_params(0)
    a = fingerprint(config_for(1), params)
    b = fingerprint(config_for(1, optimizer={"type": "Adam", "params": {"lr": 0.5}}), params)
    assert differences(a, a) == []
    assert any(line.startswith("config.optimizer.params.lr: here 0.5, process 0 0.01") for line in differences(b, a))
    wider = {**params, "w_out": np.zeros((32, 5), np.float32)}
    assert any("w_out" in line for line in differences(fingerprint(config_for(1), wider), a))
    # The process's own id is not part of it.
    assert fingerprint(config_for(1, distributed={"process_id": 1, "num_processes": 2}), params) == fingerprint(
        config_for(1, distributed={"process_id": 0, "num_processes": 2}), params)


def _module(collective: str) -> str:
    return ("HloModule step, num_partitions=8\n\n%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
            "  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(f32[] %a, f32[] %b)\n}\n\n"
            "ENTRY %main (p: f32[64]) -> f32[64] {\n  %p = f32[64]{0} parameter(0)\n"
            f"  ROOT %c = {collective}\n}}\n")


def test_program_digests_tell_collectives_of_another_size_dtype_or_group_apart() -> None:
    """The processes compare their step programs by collectives: two that differ only in one
    collective's size, dtype or devices must get different digests (kinds and counts alone would
    call a gather of another width, or over another mesh axis, the same program)."""
    from zerojax.runtime.agreement import program_digest
    base = "f32[64]{0} all-reduce(f32[64]{0} %p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add"
    variants = {
        "size": base.replace("f32[64]{0} all", "f32[32]{0} all"),
        "dtype": base.replace("f32[64]{0} all", "bf16[64]{0} all"),
        "groups": base.replace("{{0,1,2,3},{4,5,6,7}}", "{{0,2,4,6},{1,3,5,7}}"),
    }
    perm = "f32[64]{0} collective-permute(f32[64]{0} %p), channel_id=1, source_target_pairs={{0,1},{1,0}}"
    variants_perm = {"pairs": perm.replace("{{0,1},{1,0}}", "{{0,2},{2,0}}")}
    for reference, changed in ((base, variants), (perm, variants_perm)):
        mine = program_digest("lowered", _module(reference))["collectives"]
        assert len(mine) == 1
        for what, text in changed.items():
            theirs = program_digest("lowered", _module(text))["collectives"]
            assert theirs != mine, f"a collective of another {what} got the same digest: {mine}"


# ------------------------------------------------------------------------------------------------
# Two processes x 4 devices, launched through `zerojax launch`.

@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("two_processes")
    proc = launch("-n", "2", "tests/multiprocess_worker.py", "train", str(out), "1", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for stage in (1, 3):
        assert f"[0] stage {stage}: {STEPS} steps done" in proc.stdout
        assert f"[1] stage {stage}: {STEPS} steps done" in proc.stdout
    return out


def one_process_engine(stage: int, n: int = 8) -> zerojax.Engine:
    return zerojax.initialize(config_for(stage), params=mlp_params(0), loss_fn=layerwise_loss, mesh=data_mesh(n))


@pytest.mark.parametrize("stage", [1, 3])
def test_two_processes_train_like_one(two_processes: Path, stage: int) -> None:
    engine = one_process_engine(stage)
    for batch in batches(STEPS):
        engine.train_batch(batch)
    want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(to_numpy(engine.params))}
    got = dict(np.load(two_processes / f"stage{stage}.npz"))
    assert sorted(got) == sorted(want)
    assert_tree_close(got, want, rtol=1e-5, atol=1e-7, what=f"stage {stage} params")
    # Training moved them: the comparison is not between two copies of the initial parameters.
    start = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(mlp_params(0))}
    assert max(float(np.max(np.abs(got[k] - start[k]))) for k in got) > 1e-3


@pytest.mark.parametrize("stage, devices", [(3, 8), (1, 4)])
def test_checkpoint_from_two_processes_restores_in_one(two_processes: Path, stage: int, devices: int) -> None:
    saved = two_processes / f"ckpt{stage}"
    meta = json.loads((saved / f"global_step{STEPS}" / "meta.json").read_text())
    assert meta["step"] == STEPS and meta["mesh"] == {"data": 8}
    state_dir = saved / f"global_step{STEPS}" / "state"
    assert sorted(p.name for p in state_dir.glob("ocdbt.process_*")) == ["ocdbt.process_0", "ocdbt.process_1"]

    reference = one_process_engine(stage)
    for batch in batches(STEPS):
        reference.train_batch(batch)
    engine = one_process_engine(stage, devices)
    engine.load_checkpoint(str(saved))
    assert engine.global_steps == STEPS
    assert_tree_close(to_numpy(engine.params), to_numpy(reference.params), rtol=1e-5, atol=1e-7, what="params")
    assert_tree_close(to_numpy(engine.state.opt_state), to_numpy(reference.state.opt_state),
                      rtol=1e-5, atol=1e-9, what="opt_state")
    # And it trains on from there like the reference.
    extra = batches(STEPS + 1)[-1]
    assert abs(float(engine.train_batch(extra)["loss"]) - float(reference.train_batch(extra)["loss"])) < 1e-5


def test_consistency_check_names_the_differing_process() -> None:
    proc = launch("-n", "2", "--grace", "2", "tests/multiprocess_worker.py", "mismatch", timeout=180)
    assert proc.returncode != 0
    assert "no mismatch found" not in proc.stdout
    text = proc.stdout + proc.stderr
    assert "distributed.check_consistency: process(es) [1] hold a different config" in text
    assert "optimizer.params.lr: process 0 0.01, process 1 0.02" in text


def refusals(text: str, p: int) -> list[str]:
    """Process p's lines of a refusal (its first line and the differing keys listed under it)."""
    lines = text.splitlines()
    at = next((i for i, l in enumerate(lines) if l.startswith(f"[{p}] ") and "hold a different config or plan" in l),
              None)
    if at is None:
        return []
    return [lines[at]] + [l for l in lines[at + 1:at + 6] if l.startswith(f"[{p}]   ")]


@pytest.mark.parametrize("override, keys", [
    ("zero_optimization.stage=2", ["zero_optimization.stage: process 0 3, process 1 2"]),
    ("mesh.tensor=2", ["mesh.tensor: process 0 1, process 1 2"]),
])
def test_train_py_with_a_stale_config_on_one_process_is_refused_on_both(tmp_path: Path, override: str,
                                                                          keys: list[str]) -> None:
    """`zerojax launch -n 2 train.py` where one host's config differs: before, the first collective (the
    run folder's broadcast, the state's initialisation) died in gloo's "collective mismatch"; now both
    processes refuse it within seconds, naming the key and the processes, before anything compiles."""
    from test_cli import SMALL
    small = [*SMALL, "model.d_model=32", "model.n_layers=1", "model.n_heads=2", f"run.output_dir={tmp_path / 'run'}"]
    proc = launch("-n", "2", "--grace", "2", "tests/multiprocess_worker.py", "stale", override,
                  "--config", "configs/zero3.yaml", "--set", *small, timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert "collective mismatch" not in text and "enforce fail" not in text.lower(), text[-3000:]  # no gloo words
    for p in (0, 1):
        said = "\n".join(refusals(text, p))
        assert f"[{p}] zerojax: error: distributed.check_consistency: process(es) [1] hold a different config or plan than process 0" in said, \
            text[-3000:]
        assert all(k in said for k in keys), said
        done = next(l for l in text.splitlines() if l.startswith(f"[{p}] train.py exited"))
        assert float(done.split("after ")[1].split(" s")[0]) < 60, done
    assert not (tmp_path / "run").exists()  # refused before the run folder was chosen


def test_an_engine_whose_model_differs_on_one_process_is_refused_before_compiling() -> None:
    """`zerojax.initialize` with the same config but a wider model on process 1 (another version of the
    code on one host): refused on both processes by name, before the state is initialised."""
    proc = launch("-n", "2", "--grace", "2", "tests/multiprocess_worker.py", "wider", timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no mismatch found" not in text, text[-3000:]
    for p in (0, 1):
        line = next((l for l in text.splitlines() if l.startswith(f"[{p}] refused after")), None)
        assert line is not None, text[-3000:]
        assert float(line.split("after ")[1].split(" s")[0]) < 30, line
        assert "ProcessMismatch: zerojax.initialize: process(es) [1] hold a different config or plan" in line, line
        said = "\n".join(l for l in text.splitlines() if l.startswith(f"[{p}]   "))
        assert "model['w_out']: process 0 [[32, 4], \"float32\"], process 1 [[32, 5], \"float32\"]" in said, said


@pytest.mark.parametrize("key, effect", [
    ("threshold", "zero_optimization.stage3_param_persistence_threshold: process 0 0, process 1 1000000"),
    ("stage", "zero_optimization.stage: process 0 3, process 1 2"),
])
def test_processes_that_compiled_different_steps_are_refused_before_step_0(key: str, effect: str) -> None:
    """What hangs a DeepSpeed ZeRO-3 run (ranks whose programs differ) is refused in seconds, on both
    processes, naming the key and where the collectives part."""
    proc = launch("-n", "2", "--grace", "2", "tests/multiprocess_worker.py", "diverge", key, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no divergence found" not in text, text[-3000:]
    for p in (0, 1):
        line = next((l for l in text.splitlines() if l.startswith(f"[{p}] refused after")), None)
        assert line is not None, text[-3000:]
        assert float(line.split("after ")[1].split(" s")[0]) < 60, line
        assert "ProgramMismatch: train step: process(es) [1] would run a different program than process 0" in line
        assert effect in line and "The programs part at collective #" in line, line


def test_train_py_under_launch_stops_together_and_resumes(tmp_path: Path) -> None:
    """`zerojax launch -n 2 train.py --config configs/zero3.yaml` (tiny model): one set of run files from
    process 0, checkpoint shards from both; Ctrl-C stops both after the same step with a checkpoint,
    and `--resume` continues from it in two processes."""
    from test_cli import SMALL
    out = tmp_path / "run"
    small = [*SMALL, "run.steps=60", "run.log_every=1", "steps_per_print=1", f"run.output_dir={out}"]
    cmd = [sys.executable, "-m", "zerojax.cli", "launch", "-n", "2", "train.py", "--config", "configs/zero3.yaml",
           "--set", *small]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    from test_launch import Lines
    try:
        lines = Lines(proc)
        lines.wait_for(lambda seen: any(l.startswith("[0] step 2:") for l in seen), 240)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    stdout, stderr = lines.text(), proc.stderr.read()
    assert code == 130, stderr[-3000:]
    stop = [l for l in stdout.splitlines() if "stop requested: every process stopped after step" in l]
    assert len(stop) == 1 and stop[0].startswith("[0] "), stdout[-3000:]
    stopped = int(stop[0].split("after step ")[1].split(";")[0])
    assert "[0] zerojax: interrupted" in stderr and "[1] zerojax: interrupted" in stderr
    assert "[0] ZeRO stage 3" in stdout and "[1] ZeRO stage 3" not in stdout
    assert [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, stopped + 1))
    tag = out / "checkpoints" / f"global_step{stopped}"
    assert (out / "checkpoints" / "latest").read_text().strip() == tag.name
    assert sorted(p.name for p in (tag / "state").glob("ocdbt.process_*")) == ["ocdbt.process_0", "ocdbt.process_1"]

    resumed = launch("-n", "2", "train.py", "--config", "configs/zero3.yaml", "--resume", "--set", *small,
                     f"run.steps={stopped + 2}", timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"[0] resumed from {tag} at step {stopped}" in resumed.stdout
    assert f"[0] done: {stopped + 2} steps" in resumed.stdout and "[1] done" not in resumed.stdout
    assert not (tmp_path / "run-2").exists()  # both processes agreed on the run folder
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, stopped + 3))


def test_train_py_under_launch_runs_200_steps_to_the_end(tmp_path: Path) -> None:
    """The README's `zerojax launch -n 2 train.py --config configs/zero3.yaml` path for 200 steps (a tiny
    model, logging only at step 1 and the end: no process reads a result in between). Before each
    process was held to one unfinished step (distributed.InFlight), the processes queued every step
    ahead of their devices and a gloo reduce-scatter gave up after its 30 s read timeout (2 runs of
    2 here); with only process 0 reading results every 5 steps, as in the README's config, the same
    queueing on process 1 was reported to hang at step 47."""
    out = tmp_path / "run"
    steps = ["run.steps=200", "run.log_every=1000", "steps_per_print=1000", "model.d_model=32", "model.n_layers=1",
             "model.n_heads=2", "model.seq_len=16", "data.max_bytes=100000", "run.eval_batches=1",
             "run.progress=false", "run.save_every=1000", "run.eval_every=100", f"run.output_dir={out}"]
    proc = launch("-n", "2", "train.py", "--config", "configs/zero3.yaml", "--set", *steps, timeout=420)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "[0] done: 200 steps" in proc.stdout, proc.stdout[-2000:]
    assert "[0] step 100: validation loss" in proc.stdout  # an evaluation in between, on both processes
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step200"
    # the end-of-run sample is one process's: said, with the command that makes it from the checkpoint
    assert f"[0] sample: not generated in a run of 2 processes; make one from the saved checkpoint with " \
           f"`zerojax sample {out}`" in proc.stdout, proc.stdout[-2000:]


def test_a_pipelined_moe_run_trains_and_evaluates_under_launch(tmp_path: Path) -> None:
    """configs/moe.yaml cut into 2 stages (stage 2 x data 2 x expert 2, the experts in rows of their own)
    over two processes: both agree on the train and the eval programs (the pipeline's evaluation picks
    its program per batch; it used to lack the `lower` the agreement compiles with) and finish."""
    out = tmp_path / "run"
    small = ["mesh.stage=2", "run.steps=3", "run.log_every=1000", "steps_per_print=1000", "model.d_model=32",
             "model.n_layers=2", "model.moe_every=1", "model.n_heads=2", "model.seq_len=16", "model.d_ff=32",
             "data.max_bytes=100000", "run.eval_batches=1", "run.progress=false", "run.save_every=1000",
             f"run.output_dir={out}"]
    proc = launch("-n", "2", "train.py", "--config", "configs/moe.yaml", "--set", *small, timeout=420)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "[0] expert parallel over 2 devices" in proc.stdout and "expert_stages" in proc.stdout, proc.stdout[-3000:]
    assert "[0] done: 3 steps" in proc.stdout and "validation loss" in proc.stdout, proc.stdout[-2000:]
    assert "sample: not generated (" not in proc.stdout  # no process fetches rows it does not hold


def test_a_stalled_process_is_reported_by_every_process_and_named() -> None:
    """Process 1 stops before step 4; process 0 then waits in that step's collectives. Within the hang
    timeout both dump their stacks saying where they are, and the launcher names both and fails."""
    from zerojax.runtime.watchdog import EXIT_HUNG
    started = time.monotonic()
    proc = launch("-n", "2", "--hang-timeout", "8", "--grace", "3", "tests/multiprocess_worker.py", "stall",
                  timeout=240)
    elapsed = time.monotonic() - started
    err = proc.stderr
    assert proc.returncode == EXIT_HUNG, proc.stdout[-2000:] + err[-4000:]
    assert "[1] stalling before step 4" in proc.stdout
    assert "zerojax launch: process(es) [0, 1] made no progress within the hang timeout" in err, err[-4000:]
    assert "[1] zerojax watchdog: process 1 of 2 made no progress for" in err
    assert "last progress: step 3; now in train step 4" in err
    assert "[0] zerojax watchdog: process 0 of 2 made no progress for" in err
    assert "now in train step 5" in err  # process 0 went on to dispatch step 4 and waits for it
    stack1 = [l for l in err.splitlines() if l.startswith("[1]   File")]
    assert any("multiprocess_worker.py" in l and " in stall" in l for l in stack1), err[-4000:]
    assert elapsed < 200


def test_save_then_load_latest_agrees_on_every_process(tmp_path: Path) -> None:
    """Process 0 writes meta.json and `latest` after the arrays are committed; a load of the latest tag
    right after a save must not run on any process before that (a barrier ends every save)."""
    proc = launch("-n", "2", "tests/multiprocess_worker.py", "saveload", str(tmp_path / "ckpt"), timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for p in (0, 1):
        for r in (1, 2, 3):
            assert f"[{p}] round {r}: saved global_step{r}, loaded global_step{r} at step {r}" in proc.stdout, \
                proc.stdout[-3000:]


def test_launch_with_relative_paths_from_a_fresh_working_directory(tmp_path: Path) -> None:
    """What a new user types, from a folder of their own: relative run.output_dir, then --resume, in two
    processes (every process resolves the relative paths against the same working directory)."""
    from test_cli import SMALL
    small = [*SMALL, "run.steps=4", "run.output_dir=runs/rel"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ZEROJAX_TEST_CACHE": CACHE, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "zerojax.cli", "launch", "-n", "2", str(ROOT / "train.py"),
                               "--config", str(ROOT / "configs" / "zero3.yaml"), *extra], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    first = run("--set", *small)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert (tmp_path / "runs" / "rel" / "checkpoints" / "latest").read_text().strip() == "global_step4"
    resumed = run("--resume", "--set", *small, "run.steps=6")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "[0] resumed from runs/rel/checkpoints/global_step4 at step 4" in resumed.stdout
    assert (tmp_path / "runs" / "rel" / "checkpoints" / "latest").read_text().strip() == "global_step6"
