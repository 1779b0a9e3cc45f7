"""A hierarchical data axis (`mesh.data_outer` x `mesh.data_inner`): built from JAX's topology-aware
mesh helpers, every device used once, and every ZeRO stage trains on a (2 x 4) mesh exactly like a
single device (the same comparison as tests/test_step.py)."""
from __future__ import annotations

import jax
import pytest

import zerojax
from helpers import ADAM, SGD, layerwise_loss, make_config, mse_loss
from test_step import run_and_compare
from zerojax.core.collectives import Shard
from zerojax.errors import ConfigError
from zerojax.core.mesh import DATA_INNER, DATA_OUTER, data_axes, data_size
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
