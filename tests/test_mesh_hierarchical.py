"""A hierarchical data axis (`mesh.data_outer` x `mesh.data_inner`): built from JAX's topology-aware
mesh helpers, every device used once, and every ZeRO stage trains on a (2 x 4) mesh exactly like a
single device (the same comparison as tests/test_step.py); then with the expert and sequence axes inside
data_inner (data_outer 2 x data_inner 2 x expert or sequence 2), their groups, and the MoE Llama trained
there against one device. hpZ on these meshes is tests/test_zeropp.py's."""
from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
import pytest

import zerojax
from helpers import ADAM, SGD, assert_tree_close, layerwise_loss, make_config, mse_loss, to_numpy
from test_step import run_and_compare
from zerojax.core.collectives import Shard
from zerojax.errors import ConfigError
from zerojax.core.mesh import (DATA_INNER, DATA_OUTER, EXPERT, SEQUENCE, data_axes, data_size, expert_data_axes,
                               host_axes, inner_major, row_axes, row_size)
from zerojax.models import llama
from zerojax.planner.mesh import hierarchical_sizes, make_mesh


def split(cfg: zerojax.Config, **mesh: int) -> zerojax.Config:
    return zerojax.load_config(cfg, [f"mesh.{k}={v}" for k, v in mesh.items()])


def test_mesh_from_config_keys() -> None:
    cfg = make_config(0)
    mesh = make_mesh(split(cfg, data_outer=2))
    assert dict(mesh.shape) == {DATA_OUTER: 2, DATA_INNER: 4}
    assert data_axes(mesh) == (DATA_OUTER, DATA_INNER) and data_size(mesh) == 8
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    assert dict(make_mesh(split(cfg, data_inner=2)).shape) == {DATA_OUTER: 4, DATA_INNER: 2}
    assert dict(make_mesh(split(cfg, data_outer=2, data_inner=4)).shape) == {DATA_OUTER: 2, DATA_INNER: 4}


@pytest.mark.parametrize("mesh, match", [
    (dict(data_outer=3), "mesh.data_outer: 3 does not divide the 8"),
    (dict(data_inner=3), "mesh.data_inner: 3 does not divide the 8"),
    (dict(data_outer=2, data_inner=2), r"2 x 2 = 4, but the data axis has 8 devices"),
    (dict(data_outer=2, data=4), "mesh.data: 4 of the 8 devices"),
    (dict(data_outer=2, stage=2), "does not combine with pipeline stages"),
])
def test_sizes_that_leave_devices_out_are_errors(mesh: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_mesh(split(make_config(0), **mesh))


def test_outer_size_must_match_processes_or_slices() -> None:
    class Dev:  # two "processes" of four devices each
        def __init__(self, i: int) -> None:
            self.id, self.process_index, self.platform = i, i // 4, "cpu"
    cfg = split(make_config(0), data_outer=4)
    assert hierarchical_sizes(cfg, 8) == (4, 2)
    with pytest.raises(ConfigError, match="sit in 2 processes; set mesh.data_outer: 2"):
        make_mesh(cfg, [Dev(i) for i in range(8)])


@pytest.mark.parametrize("stage, loss", [(0, "plain"), (1, "plain"), (2, "plain"), (3, "plain"), (3, "layerwise")])
def test_every_stage_matches_a_single_device_on_a_2x4_mesh(stage: int, loss: str) -> None:
    cfg = split(make_config(stage, gas=2, optimizer=ADAM), data_outer=2)
    fn = {"plain": mse_loss, "layerwise": layerwise_loss}[loss]
    p, _ = run_and_compare(cfg, make_mesh(cfg), fn, ("adam", "fp32", cfg.gradient_clipping), "fp32")
    assert p.data_size == 8
    if stage == 3:
        sharded = [(lay, s) for lay, s in zip(jax.tree.leaves(p.layouts, is_leaf=lambda x: hasattr(x, "param")),
                                              jax.tree.leaves(p.param_shardings)) if isinstance(lay.param, Shard)]
        assert sharded
        for lay, s in sharded:  # one shard per device over both axes
            assert s.spec[lay.param.dim] == (DATA_OUTER, DATA_INNER)


def test_sgd_gradient_scale_on_a_2x4_mesh() -> None:
    """SGD without momentum: a gradient reduced over one axis only would be off by 2 or 4."""
    cfg = split(make_config(2, gas=2, optimizer=SGD, clip=0.0), data_outer=2)
    run_and_compare(cfg, make_mesh(cfg), mse_loss, ("sgd", "fp32", 0.0), "fp32")


# -- with the expert and sequence axes: data_outer x data_inner x expert x sequence ------------------------

MOE = dict(name="llama", vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=1,
           n_experts=4, experts_per_token=1, drop_tokens=False, use_rts=False, moe_aux_loss_coef=0.0)
ROWS = 8
HOSTS = ((0, 1, 2, 3), (4, 5, 6, 7))  # partition ids of each data_outer row of a 2 x (4 devices) mesh


def moe_config(stage: int, mesh: dict, hpz: int = 1) -> zerojax.Config:
    """The MoE Llama with no token dropped, no noise and the aux loss off (each device gates its own tokens,
    so l_aux would be per device): any split of its rows and tokens trains as one device does."""
    return zerojax.load_config({
        "train_batch_size": ROWS, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "zero_hpz_partition_size": hpz},
        "mesh": mesh, "model": MOE})


def moe_batch(i: int) -> dict[str, np.ndarray]:
    return {"tokens": np.random.default_rng(300 + i).integers(0, 64, size=(ROWS, 17), dtype=np.int32)}


def moe_engine(cfg: zerojax.Config, devices: int = 8) -> zerojax.Engine:
    params, loss_fn = llama.build(cfg.model, seed=0)
    return zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg, jax.devices()[:devices]))


def moe_train(e: zerojax.Engine) -> tuple[list[float], Any]:
    return [float(e.train_batch(moe_batch(i))["loss"]) for i in range(2)], to_numpy(e.params)


@functools.lru_cache(maxsize=None)
def moe_single() -> tuple[list[float], Any]:
    return moe_train(moe_engine(moe_config(0, {}), 1))


def assert_single_device(e: zerojax.Engine, what: str) -> None:
    want_losses, want = moe_single()
    losses, got = moe_train(e)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5, what=what)


@pytest.mark.parametrize("mesh, shape, rows, data, experts", [
    ({"data_outer": 2, "expert": 2}, {DATA_OUTER: 2, DATA_INNER: 2, EXPERT: 2},
     (DATA_OUTER, DATA_INNER, EXPERT), (DATA_OUTER, DATA_INNER, EXPERT), (DATA_OUTER, DATA_INNER)),
    ({"data_outer": 2, "sequence": 2}, {DATA_OUTER: 2, DATA_INNER: 2, SEQUENCE: 2},
     (DATA_OUTER, DATA_INNER), (DATA_OUTER, DATA_INNER, SEQUENCE), (DATA_OUTER, DATA_INNER, SEQUENCE)),
    ({"data_outer": 2, "expert": 2, "sequence": 2}, {DATA_OUTER: 2, DATA_INNER: 1, EXPERT: 2, SEQUENCE: 2},
     (DATA_OUTER, DATA_INNER, EXPERT), (DATA_OUTER, DATA_INNER, EXPERT, SEQUENCE), (DATA_OUTER, DATA_INNER, SEQUENCE)),
])
def test_expert_and_sequence_axes_sit_inside_data_inner(mesh: dict, shape: dict, rows: tuple, data: tuple,
                                                         experts: tuple) -> None:
    """The groups on data_outer x data_inner x expert x sequence: rows over data x expert, ZeRO over that x
    sequence, expert weights over that less expert; every axis but data_outer is inside one host."""
    m = make_mesh(moe_config(3, mesh))
    assert m.axis_names == tuple(shape) and dict(m.shape) == shape
    assert (row_axes(m), data_axes(m), expert_data_axes(m)) == (rows, data, experts)
    assert row_size(m) == 8 // shape.get(SEQUENCE, 1) and data_size(m) == 8
    assert moe_config(3, mesh).batch(row_size(m)).micro_batch_size == ROWS // row_size(m)
    assert host_axes(data) == data[1:] and inner_major(experts) == (*experts[1:], DATA_OUTER)
    for outer, host in enumerate(HOSTS):  # one data_outer row is one host's consecutive devices
        assert sorted(d.id for d in m.devices[outer].flat) == list(host)


def test_expert_and_sequence_axes_inside_each_process() -> None:
    class Dev:  # two "processes" of four devices each
        def __init__(self, i: int) -> None:
            self.id, self.process_index, self.platform, self.device_kind = i, i // 4, "cpu", "cpu"
    mesh = make_mesh(moe_config(3, {"data_outer": 2, "expert": 2, "sequence": 2}), [Dev(i) for i in range(8)])
    for outer in range(2):
        assert {d.process_index for d in mesh.devices[outer].flat} == {outer}


@pytest.mark.parametrize("mesh, match", [
    ({"data_outer": 2, "expert": 3}, r"^mesh\.expert: 3 does not divide the data-parallel size 8"),
    ({"data_outer": 3, "expert": 2}, r"^mesh\.data_outer: 3 does not divide the 4 data-parallel devices per expert"),
    ({"data_outer": 2, "data_inner": 4, "expert": 2}, r"2 x 4 = 8, but the data axis has 4 devices"),
    ({"data_outer": 2, "sequence": 2, "data": 8}, r"^mesh\.data: 8 of the 4 devices left by mesh\.sequence 2"),
])
def test_expert_and_sequence_sizes_that_do_not_fit_are_one_error(mesh: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_mesh(moe_config(3, mesh))


@pytest.mark.parametrize("stage", [1, 3])
def test_hierarchical_data_with_expert_axis_equals_one_device(stage: int) -> None:
    """data_outer 2 x data_inner 2 x expert 2: expert weights ZeRO-sharded over data_outer x data_inner only,
    their all-to-alls within each host."""
    e = moe_engine(moe_config(stage, {"data_outer": 2, "expert": 2}))
    gate = e.plan.layouts["layers"]["moe"]["experts"]["gate"]
    assert gate.split == ((1, EXPERT),) and gate.update.axis == (DATA_OUTER, DATA_INNER)
    assert_single_device(e, f"data_outer 2 x data_inner 2 x expert 2, stage {stage}")


def test_hierarchical_data_with_sequence_axis_equals_one_device() -> None:
    e = moe_engine(moe_config(3, {"data_outer": 2, "sequence": 2}))
    assert e.plan.batch.micro_batch_size == 2
    assert_single_device(e, "data_outer 2 x data_inner 2 x sequence 2, stage 3")


def test_startup_lines_name_the_hosts_and_groups() -> None:
    from zerojax.planner.axes import axis_plans
    cfg = moe_config(3, {"expert": 2, "sequence": 2}, hpz=4)
    params, loss_fn = llama.build(cfg.model, seed=0)
    lines = "\n".join(axis_plans(zerojax.plan(cfg, make_mesh(cfg), params, logical_axes=loss_fn.logical_axes),
                                  cfg.model))
    assert ("hierarchical data axis: data_outer 2 (hosts: groups {0,1,2,3} {4,5,6,7}) x data_inner 1; expert, "
            "sequence inside each host") in lines
    assert ("hpZ: parameters' secondary copy over data_inner x expert x sequence 4 (one host's part of the ZeRO "
            "group), expert weights' over data_inner x sequence 2") in lines
    assert "ZeRO over data_outer x data_inner x sequence 4 (the expert-data-parallel group)" in lines
    assert "ZeRO dim 2 over data_inner x sequence x data_outer, parameters over data_inner x sequence (hpZ)" in lines
    assert "rows over data_outer x data_inner x expert 4" in lines
