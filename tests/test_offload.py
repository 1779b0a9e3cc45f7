"""ZeRO-Offload: offloaded runs equal the plain ones, and the state really sits in host memory.

On CPU "host" and "device" are the same RAM, so what is checked here is the layout (memory kinds of
the state between steps, S(5) host memory spaces in the compiled step, the update compiled as a
host computation) and the arithmetic (identical parameters), not a memory saving.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import pytest

import zerojax
from helpers import (assert_tree_close, data_mesh, layerwise_loss, make_batch, make_config, mlp_params, mse_loss,
                     to_numpy)
from zerojax.planner import settings
from zerojax.measure.hlo import entry_layout_bytes
from zerojax.core.measure import HOST_KINDS, step_memory

STEPS = 3


def config(stage: int, dtype: str, optimizer: dict | None = None, param: dict | None = None,
           opt: dict | None = None, kernels: str = "xla") -> zerojax.Config:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if optimizer:
        zero["offload_optimizer"] = optimizer
    if param:
        zero["offload_param"] = param
    return make_config(stage, dtype=dtype, gas=2, optimizer=opt, zero_optimization=zero, kernels=kernels)


def engine(cfg: zerojax.Config) -> zerojax.Engine:
    return zerojax.initialize(cfg, params=mlp_params(0), loss_fn=layerwise_loss, mesh=data_mesh())


def trained(cfg: zerojax.Config) -> zerojax.Engine:
    e = engine(cfg)
    for i in range(STEPS):
        e.train_batch(make_batch(32, i))
    return e


CASES = {
    # stage, dtype, offload_optimizer, offload_param, where the update runs
    "stage1-fp32-host-update": (1, "fp32", {"device": "cpu"}, None, "host"),
    "stage2-bf16-device-update-unpinned": (2, "bf16", {"device": "cpu", "compute": "device", "pin_memory": False},
                                           None, "device"),
    "stage3-bf16-all-offloaded": (3, "bf16", {"device": "cpu"}, {"device": "cpu"}, "host"),
    "stage3-fp32-params-only": (3, "fp32", None, {"device": "cpu"}, "device"),
    # The fused Pallas update (interpreted on CPU) runs on the device: the state comes in for it.
    "stage3-bf16-pallas-kernels": (3, "bf16", {"device": "cpu"}, {"device": "cpu"}, "device"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_run_equals_the_plain_run(case: str) -> None:
    stage, dtype, opt_off, param_off, update = CASES[case]
    kernels = "pallas" if "pallas" in case else "xla"
    plain = trained(config(stage, dtype, kernels=kernels))
    off = trained(config(stage, dtype, opt_off, param_off, kernels=kernels))
    assert off.plan.memory.update == update
    assert not plain.plan.memory.offloaded and off.plan.memory.offloaded
    # Offload moves bytes, never arithmetic: the same parameters and optimizer state.
    assert_tree_close(to_numpy(off.params), to_numpy(plain.params), rtol=1e-6, atol=1e-8, what=f"{case} params")
    assert_tree_close(to_numpy(off.state.opt_state), to_numpy(plain.state.opt_state), rtol=1e-6, atol=1e-10,
                      what=f"{case} opt_state")
    assert off.global_steps == STEPS

    # Between steps the state sits where the layout says.
    opt_kind = None if opt_off is None else ("pinned_host" if opt_off.get("pin_memory", True) else "unpinned_host")
    param_kind = None if param_off is None else "pinned_host"
    moments = [x for x in jax.tree.leaves(off.state.opt_state) if x.ndim]  # Adam's m and v
    scalars = [x for x in jax.tree.leaves(off.state.opt_state) if not x.ndim]  # its step count
    assert len(moments) == 2 * len(jax.tree.leaves(off.params)) and scalars
    for leaf in moments + jax.tree.leaves(off.state.master):
        assert leaf.sharding.memory_kind == (opt_kind or "device")
    for leaf in jax.tree.leaves(off.state.params):
        assert leaf.sharding.memory_kind == (param_kind or "device")
    assert {x.sharding.memory_kind for x in scalars} == {"device"}  # counters stay on the device

    # The compiled step takes exactly the plan's host bytes in host memory (S(5) in its layout).
    batch = off.place_batch(make_batch(32, 0), 32)
    compiled = off.train_step_fn.lower(off.state, batch).compile()
    used = step_memory(compiled)
    report = off.memory_report()
    assert report.host > 0 and used.host_arguments == report.host and used.host_outputs == report.host
    assert step_memory(plain.train_step_fn.lower(plain.state, plain.place_batch(make_batch(32, 0), 32)).compile()
                       ).host_arguments == 0
    assert "host MiB" in report.table() and off.plan.memory.describe() in report.table()

    # compute: host compiles the optimizer update as a host computation; compute: device does not.
    lowered = off.train_step_fn.lower(off.state, batch).as_text()
    assert ('_xla_compute_type = "host"' in lowered) == (update == "host")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offloaded_params_with_a_plain_loss_gathered_at_use(dtype: str) -> None:
    """A loss that does not gather its own parameters (gather_at_use evaluates it, prefetching the scanned
    layers) over host-stored stage-3 parameters: their host-typed shards once made the custom VJPs'
    cotangents mismatch ("Expected cotangent type float32[] but got float32<host>[]")."""
    def run(param: dict | None) -> zerojax.Engine:
        e = zerojax.initialize(config(3, dtype, None, param), params=mlp_params(0), loss_fn=mse_loss,
                               mesh=data_mesh())
        for i in range(2):
            e.train_batch(make_batch(32, i))
        return e
    plain, off = run(None), run({"device": "cpu"})
    assert off.plan.memory.params == "pinned_host"
    assert_tree_close(to_numpy(off.params), to_numpy(plain.params), rtol=1e-6, atol=1e-8, what="params")


def test_report_splits_device_and_host_bytes() -> None:
    cfg = config(3, "bf16", {"device": "cpu"}, {"device": "cpu"})
    p = zerojax.plan(cfg, data_mesh(), mlp_params(0))
    full = p.report()
    plain = zerojax.plan(config(3, "bf16"), data_mesh(), mlp_params(0)).report()
    assert (full.params, full.grads, full.optimizer) == (plain.params, plain.grads, plain.optimizer)
    counters = sum(x.dtype.itemsize for x in jax.tree.leaves(p.abstract_opt_state) if not x.shape)
    assert full.params_host == full.params and full.optimizer_host == full.optimizer - counters
    assert full.device == full.grads + counters and plain.host == 0
    only_opt = zerojax.plan(config(1, "bf16", {"device": "cpu"}), data_mesh(), mlp_params(0)).report()
    assert only_opt.params_host == 0 and only_opt.optimizer_host == only_opt.optimizer - counters > 0


def test_offloaded_checkpoint_restores_anywhere(tmp_path: Path) -> None:
    off = trained(config(3, "bf16", {"device": "cpu"}, {"device": "cpu"}))
    off.save_checkpoint(str(tmp_path), async_save=False)
    for target in (config(3, "bf16", {"device": "cpu"}, {"device": "cpu"}), config(1, "bf16")):
        e = engine(target)
        e.load_checkpoint(str(tmp_path))
        assert_tree_close(to_numpy(e.params), to_numpy(off.params), rtol=0, atol=0, what="params")
        assert_tree_close(to_numpy(e.state.opt_state), to_numpy(off.state.opt_state), rtol=0, atol=0, what="opt")
        kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(e.state.master)}
        assert kinds == ({"pinned_host"} if target.zero_optimization.offload_optimizer.device == "cpu"
                         else {"device"})


def test_offload_errors_name_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    lamb = {"type": "Lamb", "params": {"lr": 1e-2}}
    with pytest.raises(zerojax.ConfigError, match=r"offload_optimizer\.compute: host runs elementwise optimizers "
                                                  r"only .*lamb needs norms across shards: use compute: device"):
        zerojax.plan(config(2, "fp32", {"device": "cpu", "compute": "host"}, opt=lamb), data_mesh(), mlp_params(0))
    assert zerojax.plan(config(2, "fp32", {"device": "cpu"}, opt=lamb), data_mesh(),
                        mlp_params(0)).memory.update == "device"  # auto falls back
    with pytest.raises(zerojax.ConfigError, match=r"compute: host runs the optax update on the host, but kernels "
                                                  r"resolve to interpret"):
        zerojax.plan(config(2, "fp32", {"device": "cpu", "compute": "host"}, kernels="pallas"), data_mesh(),
                     mlp_params(0))
    monkeypatch.setattr(settings, "_available_kinds", lambda mesh: {"device"})
    with pytest.raises(zerojax.ConfigError, match=r"^zero_optimization\.offload_param\.device: cpu needs the "
                                                  r"'pinned_host' memory kind, but the cpu backend's devices offer "
                                                  r"\['device'\]; set zero_optimization\.offload_param\.device: none"):
        zerojax.plan(config(3, "fp32", None, {"device": "cpu"}), data_mesh(), mlp_params(0))


def test_entry_layout_bytes_reads_memory_spaces() -> None:
    hlo = ("HloModule m, entry_computation_layout={(f32[2,4]{1,0:S(5)}, bf16[8]{0}, s32[])->"
           "(f32[2,4]{1,0:S(5)}, /*index=1*/bf16[8]{0:T(128)S(5)})}, num_partitions=8\n")
    assert entry_layout_bytes(hlo) == (16 + 4, 32, 0, 32 + 16)
    assert set(HOST_KINDS) == {"pinned_host", "unpinned_host"}


def _placements_by_function(module_text: str) -> dict[str, list[tuple[str, str]]]:
    """(memory kind, tensor type) of every memory placement annotation, per function of a lowered module."""
    found: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for line in module_text.splitlines():
        m = re.match(r"\s*func\.func (?:public|private) @([\w.]+)", line)
        if m:
            current = m.group(1)
        m = re.search(r'_xla_buffer_placement = "(\w+)"\}\} : \((tensor<[^>]*>)\)', line)
        if m:
            found.setdefault(current, []).append((m.group(1), m.group(2)))
    return found


def test_parameters_come_in_layer_by_layer_on_gpu() -> None:
    """Lowered for CUDA (on CPU, JAX drops placement annotations), each stacked layer's shard is moved to
    the device inside the scanned body, one layer at a time - never the whole stack before the forward."""
    e = engine(config(3, "bf16", {"device": "cpu"}, {"device": "cpu"}))
    traced = e.train_step_fn.trace(e.state, e.place_batch(make_batch(32, 0), 32))
    placements = _placements_by_function(traced.lower(lowering_platforms=("cuda",)).as_text())
    stacked = e.state.params["layers"]["w"].addressable_shards[0].data.shape  # (layers, 32, 4)
    layer = "tensor<" + "x".join(map(str, stacked[1:])) + "xbf16>"
    whole = "tensor<" + "x".join(map(str, stacked)) + "xbf16>"
    bodies = [name for name, found in placements.items() if name != "main" and ("device", layer) in found]
    assert bodies, placements
    # The whole stack reaches the device only as a gradient, after the backward pass (in the shard_map
    # body, not in a scanned one), and leaves the device only to be stored.
    assert all(("device", whole) not in placements[name] for name in bodies)
