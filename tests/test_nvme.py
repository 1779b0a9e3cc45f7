"""ZeRO-Infinity's NVMe tier (`offload_optimizer.device: nvme`): the optimizer state lives in files and
streams through a few host buffers, and the run trains as the in-memory one does.

Tiny sizes: `sub_group_size` 64 elements per tile, so the state is many tiles and several times the
buffers' bytes, which is what bounds host memory (peak RSS against the budget: benchmarks/nvme.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import pytest

import zerojax
from helpers import assert_tree_close, data_mesh, layerwise_loss, make_batch, make_config, mlp_params, to_numpy
from zerojax.errors import ConfigError

STEPS = 3
TILE = 64


def config(stage: int, dtype: str, nvme: Path | None, *, buffers: int = 8, pipeline: bool = True,
           optimizer: dict | None = None, threads: int = 2) -> zerojax.Config:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0, "sub_group_size": TILE}
    extra: dict[str, Any] = {}
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme), "buffer_count": buffers,
                                     "pipeline_read": pipeline, "pipeline_write": pipeline}
        extra["aio"] = {"thread_count": threads}
    return make_config(stage, dtype=dtype, gas=2, optimizer=optimizer, zero_optimization=zero, kernels="xla",
                       **extra)


def engine(cfg: zerojax.Config) -> zerojax.Engine:
    return zerojax.initialize(cfg, params=mlp_params(0), loss_fn=layerwise_loss, mesh=data_mesh())


def trained(cfg: zerojax.Config, steps: int = STEPS, first: int = 0) -> zerojax.Engine:
    e = engine(cfg)
    for i in range(first, first + steps):
        e.train_batch(make_batch(32, i))
    return e


@pytest.mark.parametrize("stage, dtype, pipeline", [(1, "fp32", True), (2, "bf16", False), (3, "bf16", True)])
def test_nvme_run_equals_the_in_memory_run(tmp_path: Path, stage: int, dtype: str, pipeline: bool) -> None:
    plain = trained(config(stage, dtype, None))
    nvme = trained(config(stage, dtype, tmp_path, pipeline=pipeline))
    step = nvme._train_step
    # Between steps the step's state holds no master copy and no moments: they are in the files ...
    assert nvme.state.master is None
    assert [x for x in jax.tree.leaves(nvme.state.opt_state) if x.ndim] == []
    assert step.files.folder.parent == tmp_path and step.files.folder.name.startswith("zerojax-swap-")
    # ... which hold several times what the host buffers do.
    assert step.files.file_bytes >= 4 * step.files.buffer_bytes, (step.files.file_bytes, step.files.buffer_bytes)
    assert step.files.buffer_bytes == 8 * TILE * 4
    # Streaming moves bytes, not arithmetic: the same parameters and optimizer state.
    assert_tree_close(to_numpy(nvme.params), to_numpy(plain.params), rtol=1e-6, atol=1e-8, what="params")
    whole = nvme.whole_state()
    assert_tree_close(to_numpy(whole.opt_state), to_numpy(plain.state.opt_state), rtol=1e-6, atol=1e-10,
                      what="opt_state")
    if plain.state.master is not None:
        assert_tree_close(to_numpy(whole.master), to_numpy(plain.state.master), rtol=1e-6, atol=1e-8, what="master")
    assert "files under" in nvme.plan.memory.describe()


def test_a_killed_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """The files are working state; the checkpoint holds everything. A fresh engine (the killed run's
    files are gone with it) loads the tag and continues exactly as the run that saved it did."""
    swap = tmp_path / "nvme"
    swap.mkdir()
    mine = swap / "user-data.bin"
    mine.write_bytes(b"not zerojax's")
    first = trained(config(3, "bf16", swap), steps=2)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    went_on = float(first.train_batch(make_batch(32, 2))["loss"])
    after = to_numpy(first.params)
    folder = first._train_step.files.folder
    first._train_step.files.close()  # the kill: the working files are gone
    assert not folder.exists()

    resumed = engine(config(3, "bf16", swap))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.global_steps == 2
    assert float(resumed.train_batch(make_batch(32, 2))["loss"]) == went_on
    assert_tree_close(to_numpy(resumed.params), after, rtol=0, atol=0, what="resumed params")
    # and the checkpoint loads into an in-memory run too (it holds the whole state, not the files)
    plain = engine(config(3, "bf16", None))
    plain.load_checkpoint(str(tmp_path / "ckpt"))
    plain.train_batch(make_batch(32, 2))
    assert_tree_close(to_numpy(plain.params), after, rtol=1e-6, atol=1e-8, what="in-memory resume")
    assert mine.read_bytes() == b"not zerojax's"  # nothing of the user's under nvme_path is touched


def test_nvme_refusals_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_optimizer\.buffer_count: 3 buffers cannot "
                                          r"hold one tile: .* set buffer_count to at least 4$"):
        engine(config(2, "bf16", tmp_path, buffers=3))
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_optimizer\.device: nvme updates the state "
                                          r"tile by tile .* lamb needs whole tensors: use device: cpu$"):
        engine(config(2, "bf16", tmp_path, optimizer={"type": "Lamb", "params": {"lr": 1e-3}}))
    assert list(tmp_path.iterdir()) == []  # refused before any file was made


def test_the_memory_table_counts_the_state_on_nvme(tmp_path: Path) -> None:
    """The bytes host offload would keep in host memory are the NVMe column's; the device column is the rest."""
    cpu = zerojax.plan(make_config(3, dtype="bf16", zero_optimization={
        "stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}}),
        data_mesh(), mlp_params(0)).report()
    nvme = zerojax.plan(config(3, "bf16", tmp_path), data_mesh(), mlp_params(0)).report()
    assert nvme.optimizer_nvme == cpu.optimizer_host > 0 and nvme.optimizer_host == 0
    assert nvme.device == cpu.device and nvme.optimizer == cpu.optimizer
    assert nvme.nvme_buffers == 8 * TILE * 4
    table = nvme.table()
    assert "NVMe MiB" in table.splitlines()[1] and "swap files" in table
    assert "NVMe" not in cpu.table()
    assert list(tmp_path.iterdir()) == []  # planning makes no file


def test_frozen_leaves_and_no_decay_groups_stream_as_in_memory(tmp_path: Path) -> None:
    """Each tile is updated with its own leaf's name in the tree, so name-based groups hold; frozen
    leaves have no state and no file region."""
    adamw = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}, "no_decay": ["layers.b"]}

    def run(nvme: Path | None) -> zerojax.Engine:
        cfg = config(2, "bf16", nvme, optimizer=adamw)
        cfg = zerojax.load_config(cfg, ["model.frozen=[w_in]"])
        return trained(cfg, steps=2)
    plain, nvme = run(None), run(tmp_path)
    assert nvme.plan.n_trained == len(jax.tree.leaves(mlp_params(0))) - 1
    assert {nvme.plan.trained_paths[r.leaf] for r in nvme._train_step.regions} == set(nvme.plan.trained_paths)
    assert_tree_close(to_numpy(nvme.params), to_numpy(plain.params), rtol=1e-6, atol=1e-8, what="params")


def test_a_killed_process_resumes_with_resume_auto(tmp_path: Path) -> None:
    """`python train.py` with NVMe state, as a user runs it: SIGKILL while the step-8 checkpoint is
    being written (the process frozen first, so the kill lands mid-save), `--resume auto` (from step 4:
    the half-written tag is never loaded), SIGTERM at step 10, `--resume auto` again: every logged loss and
    the final parameters equal those of a run never stopped."""
    import json
    import os
    import signal
    import threading
    import time

    from test_faults import _popen
    from zerojax.checkpoint import META_FILE, latest_tag, read_params
    from zerojax.checkpoint.format import SAVING_FILE

    def args(out: Path, *more: str) -> list[str]:
        return ["--config", "configs/zero3.yaml", "--set", "run.steps=12", "run.log_every=1", "steps_per_print=1",
                "model.d_model=32", "model.n_layers=1", "model.seq_len=16", "data.max_bytes=20000",
                "run.eval_batches=1", "run.sample_tokens=0", "run.progress=false", "run.save_every=4",
                "scheduler.params.total_num_steps=12", "scheduler.params.warmup_num_steps=3",
                "checkpoint.async_save=false", "zero_optimization.offload_optimizer.device=nvme",
                f"zero_optimization.offload_optimizer.nvme_path={tmp_path / 'nvme'}",
                "zero_optimization.sub_group_size=1024", f"run.output_dir={out}", *more]

    def finish(child: Any) -> tuple[int, str, str]:
        try:
            stdout, stderr = child.communicate(timeout=300)
        finally:
            child.kill()
        return child.returncode, stdout, stderr

    def losses(out: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    whole = tmp_path / "whole"
    code, _, stderr = finish(_popen(*args(whole)))
    assert code == 0, stderr[-3000:]

    out = tmp_path / "stopped"
    ckpts = out / "checkpoints"
    marker = ckpts / "global_step8" / SAVING_FILE
    child = _popen(*args(out))

    def freeze_mid_save() -> None:
        while child.poll() is None and not marker.exists():
            time.sleep(0.001)
        if child.poll() is None:
            os.kill(child.pid, signal.SIGSTOP)
    watcher = threading.Thread(target=freeze_mid_save)
    watcher.start()
    watcher.join(timeout=300)
    assert marker.exists() and not (ckpts / "global_step8" / META_FILE).exists()  # mid-save
    child.send_signal(signal.SIGKILL)
    assert finish(child)[0] == -signal.SIGKILL
    assert latest_tag(ckpts) == "global_step4"

    child = _popen(*args(out, "--resume", "auto"))
    for line in child.stdout:
        if line.startswith("step 10:"):
            child.send_signal(signal.SIGTERM)
            break
    code, stdout, stderr = finish(child)
    assert code == 143, stderr[-3000:]
    assert latest_tag(ckpts) == "global_step10"

    code, stdout, stderr = finish(_popen(*args(out, "--resume", "auto")))
    assert code == 0, stderr[-3000:]
    assert f"resumed from {ckpts / 'global_step10'} at step 10" in stdout
    assert losses(out) == losses(whole) and sorted(losses(out)) == list(range(1, 13))
    assert_tree_close(read_params(ckpts, "global_step12")[0], read_params(whole / "checkpoints", "global_step12")[0],
                      rtol=0, atol=0, what="params after the stopped run")
