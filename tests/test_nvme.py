"""ZeRO-Infinity's NVMe tiers (`offload_optimizer.device: nvme`, `offload_param.device: nvme`): the
optimizer state, and stage 3's parameter partitions, live in files and stream through a few host
buffers, and the run trains as the in-memory one does.

Tiny sizes: `sub_group_size` 64 elements per tile (the parameters' `buffer_size` 32), so the state is
many tiles and several times the buffers' bytes, which is what bounds host memory (peak RSS against the
budget: benchmarks/nvme.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import zerojax
from helpers import (assert_tree_close, data_mesh, layerwise_loss, make_batch, make_config, mlp_params, mse_loss,
                     to_numpy)
from zerojax.errors import ConfigError

STEPS = 3
TILE = 64
PARAM_TILE, PARAM_BUFFERS = 32, 4  # offload_param's buffer_size (elements) and buffer_count


def config(stage: int, dtype: str, nvme: Path | str | None, *, buffers: int = 8, pipeline: bool = True,
           optimizer: dict | None = None, threads: int = 2, params: Path | None = None,
           max_in_cpu: int = 0, param_tile: int = PARAM_TILE, param_buffers: int = PARAM_BUFFERS,
           **more: Any) -> zerojax.Config:
    """`nvme`: the optimizer state's folder ("cpu": host memory instead); `params`: the parameters'."""
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0, "sub_group_size": TILE}
    extra: dict[str, Any] = {}
    if nvme == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme), "buffer_count": buffers,
                                     "pipeline_read": pipeline, "pipeline_write": pipeline}
        extra["aio"] = {"thread_count": threads}
    if params is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(params), "buffer_count": param_buffers,
                                 "buffer_size": param_tile, "max_in_cpu": max_in_cpu}
    zero.update(more)
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


@pytest.mark.parametrize("tier", ["optimizer", "params"])
def test_a_killed_run_resumes_from_its_checkpoint(tmp_path: Path, tier: str) -> None:
    """The files are working state; the checkpoint holds everything (the parameters too, when they are
    the ones swapped). A fresh engine (the killed run's files are gone with it) loads the tag and
    continues exactly as the run that saved it did, and so does an in-memory stage-3 run; a file of
    the user's under nvme_path is untouched."""
    swap = tmp_path / "nvme"
    swap.mkdir()
    mine = swap / "user-data.bin"
    mine.write_bytes(b"not zerojax's")
    swapped = lambda: config(3, "bf16", swap) if tier == "optimizer" else config(3, "bf16", None, params=swap)  # noqa: E731
    first = trained(swapped(), steps=2)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    went_on = float(first.train_batch(make_batch(32, 2))["loss"])
    after = to_numpy(first.params)
    folder = first._train_step.files.folder
    first._train_step.files.close()  # the kill: the working files are gone
    assert not folder.exists()

    resumed = engine(swapped())
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.global_steps == 2
    assert (resumed.state.params is None) == (tier == "params")
    assert float(resumed.train_batch(make_batch(32, 2))["loss"]) == went_on
    assert_tree_close(to_numpy(resumed.params), after, rtol=0, atol=0, what="resumed params")
    # the checkpoint loads into an in-memory run too (it holds the whole state, not the files)
    plain = engine(config(3, "bf16", None))
    plain.load_checkpoint(str(tmp_path / "ckpt"))
    plain_loss = float(plain.train_batch(make_batch(32, 2))["loss"])
    assert tier == "optimizer" or plain_loss == went_on
    tol = dict(rtol=1e-6, atol=1e-8) if tier == "optimizer" else dict(rtol=0, atol=0)
    assert_tree_close(to_numpy(plain.params), after, **tol, what="in-memory resume")
    assert mine.read_bytes() == b"not zerojax's"


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


# ------------------------------------------------------------------------------------------------
# offload_param.device: nvme - the parameters' stage-3 shards in files between steps.

def shards(params: Any, step: Any) -> list[np.ndarray]:
    """Per file region of the parameters' swap, the shard of `params` it stores (flat)."""
    leaves = jax.tree.leaves(params)
    out = []
    for r in step.params.filed:
        region = step.params.regions[r]
        data = next(s.data for s in leaves[region.leaf].addressable_shards if s.device == region.devices[0])
        out.append(np.asarray(data).reshape(-1))
    return out


@pytest.mark.parametrize("dtype, optimizer, max_in_cpu", [("fp32", None, 0), ("bf16", "nvme", 0), ("bf16", "cpu", 16)])
def test_param_nvme_run_equals_the_in_memory_stage3_run(tmp_path: Path, dtype: str, optimizer: str | None,
                                                        max_in_cpu: int) -> None:
    plain = trained(config(3, dtype, None))
    opt = tmp_path / "opt" if optimizer == "nvme" else optimizer
    swapped = trained(config(3, dtype, opt, params=tmp_path / "params", max_in_cpu=max_in_cpu))
    step = swapped._train_step
    # Between steps the state carries no parameters: the files (and max_in_cpu's held shards) do ...
    assert swapped.state.params is None
    files = step.files
    assert files.folder.parent == tmp_path / "params" and files.folder.name.startswith("zerojax-swap-")
    itemsize = {"fp32": 4, "bf16": 2}[dtype]
    assert files.dtype.itemsize == itemsize
    # ... the files hold the parameters' bytes: the in-memory run's stage-3 shards, in the compute dtype
    assert files.file_bytes == sum(step.params.regions[r].size for r in step.params.filed) * itemsize
    on_disk = [files.read_region(0, f) for f in range(len(step.params.filed))]
    for got, want in zip(on_disk, shards(plain.state.params, step)):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                   rtol=1e-2 if dtype == "bf16" else 1e-6, atol=1e-6)
    for got, want in zip(on_disk, shards(swapped.whole_state().params, step)):
        np.testing.assert_array_equal(got, want)
    # ... streamed through buffer_count buffers of buffer_size elements, several times smaller than the files
    assert files.buffer_bytes == PARAM_BUFFERS * PARAM_TILE * itemsize
    assert files.file_bytes >= 4 * files.buffer_bytes, (files.file_bytes, files.buffer_bytes)
    assert step.params.host_bytes == files.buffer_bytes + step.params.held_bytes
    held = {swapped.plan.leaf_paths[step.params.regions[r].leaf] for r in step.params.in_memory}
    if max_in_cpu:  # DeepSpeed's max_in_cpu: the first partitions (in order) up to the count stay in memory
        assert held == {"['b_in']", "['b_out']", "['layers']['b']"}, held
        per_device: dict[Any, int] = {}
        for r in step.params.in_memory:
            for d in step.params.regions[r].devices:
                per_device[d] = per_device.get(d, 0) + step.params.regions[r].size
        assert max(per_device.values()) <= max_in_cpu
    else:
        assert held == set() and step.params.held_bytes == 0
    # Swapping moves bytes, not arithmetic: the same parameters and optimizer state.
    assert_tree_close(to_numpy(swapped.params), to_numpy(plain.params), rtol=1e-6, atol=1e-8, what="params")
    assert_tree_close(to_numpy(swapped.whole_state().opt_state), to_numpy(plain.state.opt_state), rtol=1e-6,
                      atol=1e-10, what="opt_state")
    assert "parameters in files under" in swapped.plan.memory.describe()
    assert float(swapped.eval_batch(make_batch(32, 9))) == pytest.approx(float(plain.eval_batch(make_batch(32, 9))),
                                                                          rel=1e-5)


@pytest.mark.parametrize("dtype, optimizer", [("bf16", None), ("fp32", None), ("bf16", "nvme"), ("fp32", "nvme")])
def test_param_nvme_reads_stacked_layers_at_use(tmp_path: Path, dtype: str, optimizer: str | None) -> None:
    """A plain loss (evaluated through gather-at-use) over a scanned stack: where the compiled program
    only computes gradients of the stacked layer leaf (a mixed-precision run, or the optimizer on NVMe,
    whose update runs on the host and reads an fp32 run's master copy from the parameters' files), the
    leaf is read from the files inside the step, layer by layer, and is no argument of that program;
    training equals the in-memory stage-3 run. fp32 with the optimizer on the device keeps the read
    before the step (its update, in the same program, reads the parameters as its master copy)."""
    def run(cfg: zerojax.Config) -> tuple[zerojax.Engine, Any]:
        e = zerojax.initialize(cfg, params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh())
        memory = e._train_step.lower(e.state, make_batch(32, 0)).compile().memory_analysis()
        for i in range(STEPS):
            e.train_batch(make_batch(32, i))
        return e, memory

    opt = (lambda name: tmp_path / name) if optimizer == "nvme" else (lambda name: optimizer)  # noqa: E731
    plain = run(config(3, dtype, None))[0]
    _, plain_memory = run(config(3, dtype, opt("plain")))  # the same programs, parameters not on NVMe
    swapped, memory = run(config(3, dtype, opt("swapped"), params=tmp_path / "params"))
    step = swapped._train_step
    paths = swapped.plan.leaf_paths
    assert swapped.state.params is None
    assert_tree_close(to_numpy(swapped.params), to_numpy(plain.params), rtol=1e-6, atol=1e-8, what="params")
    if optimizer is not None:
        assert_tree_close(to_numpy(swapped.whole_state().opt_state), to_numpy(plain.state.opt_state), rtol=1e-6,
                          atol=1e-10, what="opt_state")
    if dtype == "fp32" and optimizer is None:  # the parameters are the master copy the update reads
        assert memory.argument_size_in_bytes == plain_memory.argument_size_in_bytes
        assert step.at_use == frozenset() and step.params.reads == 0
        return
    layers, w_shape = mlp_params(0)["layers"]["w"].shape[0], mlp_params(0)["layers"]["w"].shape
    devices, gas = len(jax.devices()), 2
    shard_bytes = int(np.prod(w_shape)) // devices * {"bf16": 2, "fp32": 4}[dtype]
    assert plain_memory.argument_size_in_bytes - memory.argument_size_in_bytes == shard_bytes, (
        plain_memory.argument_size_in_bytes, memory.argument_size_in_bytes)
    w = paths.index("['layers']['w']")
    assert step.at_use == {w}, [paths[i] for i in step.at_use]
    # each device reads its block of each layer in every micro-batch's forward pass and again in the
    # backward (the gather's custom VJP keeps the placeholder, not the layer read)
    assert step.params.reads == 2 * STEPS * gas * layers * devices


def test_param_nvme_reads_the_next_layer_ahead(tmp_path: Path) -> None:
    """With read-ahead (the plan's stage-3 prefetch, on by default), the callback reading layer i of the
    stack starts the read of the layer its device asks for next (i+1 in the forward, i-1 in the backward,
    each end again where the pass turns) before it returns, into the pool's buffers; the next callback
    finds it read. Training equals the in-memory stage-3 run and the run without read-ahead, bit for bit
    (step boundaries drop what was read ahead: nothing read before a write-back is served after it)."""
    def run(cfg: zerojax.Config, log: list | None = None) -> zerojax.Engine:
        e = zerojax.initialize(cfg, params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh())
        files = getattr(e._train_step, "params", None)
        if log is not None:
            read, fetch = files.read_block, files._fetch

            def logged_read(leaf: int, device: int, layer: int) -> np.ndarray:
                log.append(("read", (leaf, device), layer))
                out = read(leaf, device, layer)
                log.append(("returned", (leaf, device), layer))
                return out

            def logged_fetch(key: tuple[int, int], layer: int, stale: Any) -> None:
                log.append(("ahead", key, layer))
                fetch(key, layer, stale)
            files.read_block, files._fetch = logged_read, logged_fetch
        for i in range(STEPS):
            e.train_batch(make_batch(32, i))
        return e

    layers, devices, gas = mlp_params(0)["layers"]["w"].shape[0], len(jax.devices()), 2
    block = mlp_params(0)["layers"]["w"][0].size // devices
    roomy = dict(param_tile=block, param_buffers=2 * devices)  # each device: the block in use and the next
    log: list[tuple[str, tuple[int, int], int]] = []
    plain = run(config(3, "bf16", None))
    ahead = run(config(3, "bf16", None, params=tmp_path / "a", **roomy), log)
    synchronous = run(config(3, "bf16", None, params=tmp_path / "b", overlap_comm=False, **roomy))
    assert_tree_close(to_numpy(ahead.params), to_numpy(plain.params), rtol=1e-6, atol=1e-8, what="params")
    assert_tree_close(to_numpy(ahead.params), to_numpy(synchronous.params), rtol=0, atol=0, what="params")
    files = ahead._train_step.params
    assert files.read_ahead and not synchronous._train_step.params.read_ahead
    # per (leaf, device): every read issued the read of the layer asked for next before it returned
    for key in {k for _, k, _ in log}:
        mine = [(what, layer) for what, k, layer in log if k == key]
        calls = [layer for what, layer in mine if what == "read"]
        issued = [layer for what, layer in mine if what == "ahead"]
        assert [what for what, _ in mine] == ["read", "ahead", "returned"] * len(calls), mine[:6]
        assert len(calls) == 2 * STEPS * gas * layers
        assert issued[:-1] == calls[1:], (calls[:12], issued[:12])
    # the last step: each device's first read waited on the disk, all others had been read ahead
    reads = 2 * gas * layers * devices
    assert files.last.reads == reads and files.last.ahead == reads - devices, files.last
    assert synchronous._train_step.params.last.ahead == 0 and synchronous._train_step.params.last.reads == reads
    assert files.last.read_s > 0 and files._ahead == {} and len(files._free) == 2 * devices


def test_param_nvme_refusals_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_param\.device: nvme swaps ZeRO-3's parameter "
                                          r"partitions to files, but zero_optimization\.stage is 2; set "):
        config(2, "bf16", None, params=tmp_path)
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_param\.nvme_path: device nvme keeps"):
        make_config(3, zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}})
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_param\.device: nvme is not built for "
                                          r"pipeline runs \(mesh\.stage 2\)"):
        make_config(3, zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
                    mesh={"stage": 2})
    assert list(tmp_path.iterdir()) == []


def test_the_memory_table_counts_the_parameters_on_nvme(tmp_path: Path) -> None:
    """The stored parameters' bytes go to the NVMe column; the optimizer's stay where they were."""
    plain = zerojax.plan(config(3, "bf16", None), data_mesh(), mlp_params(0)).report()
    rep = zerojax.plan(config(3, "bf16", None, params=tmp_path), data_mesh(), mlp_params(0)).report()
    assert rep.params_nvme == plain.params > 0 and rep.params_host == 0
    assert rep.device == plain.device - plain.params and rep.optimizer == plain.optimizer
    assert rep.param_buffers == PARAM_BUFFERS * PARAM_TILE * 2
    table = rep.table()
    assert "NVMe MiB" in table.splitlines()[1] and "parameter partitions in swap files" in table
    assert list(tmp_path.iterdir()) == []


def test_the_non_finite_guard_reads_the_parameters_from_their_files(tmp_path: Path) -> None:
    """Between steps the state holds no parameters; a save's finiteness check reads them back."""
    from zerojax.core.nonfinite import NonFiniteGuard
    e = trained(config(3, "fp32", None, params=tmp_path), steps=1)
    assert NonFiniteGuard(e).problem(saving=True) is None
    step = e._train_step
    first = step.params.filed[0]
    step.files.write_region(0, 0, np.full(step.params.regions[first].size, np.nan, np.float32))
    leaf = e.plan.leaf_paths[step.params.regions[first].leaf]
    assert NonFiniteGuard(e).problem(saving=True) == f"non-finite parameters by step 1 in {leaf}"


def test_the_step_lowers_for_an_abstract_state_without_touching_the_files(tmp_path: Path) -> None:
    """`step.lower(abstract_state(plan), batch)` (what `zerojax estimate --compiled` and
    `Engine(compile_for=)` do) needs shapes only: it lowers the device part for the slim state, writes
    nothing to the files, and its `compile()` is the step to call (what a multi-process run compares)."""
    from zerojax.core.state import abstract_state
    cfg = config(2, "bf16", tmp_path)
    plan = zerojax.plan(cfg, data_mesh(), mlp_params(0))
    step = zerojax.make_train_step(plan, layerwise_loss)
    before = step.files.read_region(0, 0).copy()
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=plan.batch_sharding),
                         make_batch(32, 0))
    lowered = step.lower(abstract_state(plan), batch)
    compiled = lowered.compile()
    assert "@main" in lowered.as_text() and compiled.as_text()  # the device part's program, compiled
    assert (step.files.read_region(0, 0) == before).all()
    state = zerojax.init_state(plan, mlp_params(0))
    slim, metrics = compiled(state, make_batch(32, 0))  # the whole step: device parts and the host update
    assert slim.master is None and int(slim.step) == 1 and float(metrics["loss"]) > 0


def test_compile_for_compiles_the_nvme_step_with_the_state(tmp_path: Path) -> None:
    """`Engine(compile_for=batch)` compiles the NVMe step's device part while the state initializes
    (its lowering needs shapes only) and the run trains as one without it."""
    def first_loss(compile_for: Any, folder: Path) -> float:
        e = zerojax.Engine(config(3, "bf16", folder), mlp_params(0), layerwise_loss, data_mesh(),
                           compile_for=compile_for)
        return float(e.train_batch(make_batch(32, 0))["loss"])
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert first_loss(make_batch(32, 0), tmp_path / "a") == first_loss(None, tmp_path / "b")


def test_closing_the_files_releases_their_descriptors(tmp_path: Path) -> None:
    """`SwapFiles.close()` removes the working files and closes them: an unlinked file still open keeps
    its disk space until the process lets go of it."""
    step = zerojax.make_train_step(zerojax.plan(config(2, "bf16", tmp_path), data_mesh(), mlp_params(0)),
                                   layerwise_loss)
    folder = step.files.folder

    def held() -> list[str]:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the listing's own descriptor, closed by now
                pass
        return [link for link in links if link.startswith(str(folder))]
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("reads the open files from /proc")
    assert len(held()) == len(step.files.names)
    step.files.close()
    assert not folder.exists() and held() == []


def test_reading_the_parameters_reads_the_master_file_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`engine.params` (the fp32 master) reads the master copy's file, not the optimizer moments': the
    moments stay on NVMe, off the host, and the values are the whole state's."""
    e = trained(config(2, "bf16", tmp_path), steps=1)
    files = e._train_step.files
    read: list[int] = []
    original = files.read_region
    monkeypatch.setattr(files, "read_region", lambda array, region: read.append(array) or original(array, region))
    params = to_numpy(e.params)
    assert set(read) == {files.names.index("master")}
    assert_tree_close(params, to_numpy(e.whole_state().master), rtol=0, atol=0, what="master")


def test_a_killed_process_swap_folder_is_removed_by_the_next_one(tmp_path: Path) -> None:
    """A SIGKILL skips every cleanup and leaves a folder as large as the state: the next swap under
    the same path removes the folders whose process no longer runs, and nothing else."""
    import socket
    import subprocess
    import sys
    from zerojax.core.swap import OWNER, SWAP_PREFIX, Swap, SwapFiles
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.split()[0]
    host = socket.gethostname()
    folders = {}
    for name, owner in (("dead", f"{host} {dead}\n"), ("live", f"{host} {os.getpid()}\n"),
                        ("elsewhere", f"another-host {dead}\n"), ("unowned", None)):
        folders[name] = tmp_path / f"{SWAP_PREFIX}{name}"
        folders[name].mkdir()
        (folders[name] / "master.f32").write_bytes(b"\0" * 64)
        if owner is not None:
            (folders[name] / OWNER).write_text(owner)
    mine = tmp_path / "user-data.bin"
    mine.write_bytes(b"not zerojax's")
    files = SwapFiles(Swap(str(tmp_path), buffer_count=2, tile=4), ["master"], [8])
    assert (files.folder / OWNER).read_text().split() == [host, str(os.getpid())]
    assert not folders["dead"].exists()
    assert all(folders[n].exists() for n in ("live", "elsewhere", "unowned"))
    assert mine.read_bytes() == b"not zerojax's"
    files.close()
