"""ZeRO++ (Wang et al. 2023): hpZ's secondary parameter partition on a (2 x 4) hierarchical mesh,
and the quantized collectives of qwZ / qgZ.

hpZ must train exactly like a single device (the comparison of tests/test_step.py) while its
compiled step gathers parameters only within the inner groups, except the one gather per step that
builds the secondary copy from the updated shards.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from helpers import ADAM, data_mesh, layerwise_loss, make_batch, make_config, mlp_params, mse_loss, train_steps
from test_step import run_and_compare
from zerojax.core import quantize
from zerojax.measure import hlo
from zerojax.core.collectives import Shard
from zerojax.errors import ConfigError
from zerojax.core.mesh import (DATA_INNER, DATA_OUTER, EXPERT, SEQUENCE, axes_size, data_axes, expert_data_axes,
                               host_axes, inner_major)
from zerojax.models import llama
from zerojax.planner.mesh import make_mesh
from test_mesh_hierarchical import assert_single_device, moe_batch, moe_config, moe_engine

INNER = 4
HOSTS = ((0, 1, 2, 3), (4, 5, 6, 7))   # partition ids of the (2 x 4) mesh's inner groups
LOSSES = {"plain": mse_loss, "layerwise": layerwise_loss}


def zeropp(stage: int = 3, *, hpz: int = 1, qw: bool = False, qg: bool = False, outer: int | None = 2,
           **kw: Any) -> zerojax.Config:
    over = [f"zero_optimization.zero_hpz_partition_size={hpz}",
            f"zero_optimization.zero_quantized_weights={str(qw).lower()}",
            f"zero_optimization.zero_quantized_gradients={str(qg).lower()}"]
    if outer is not None:
        over.append(f"mesh.data_outer={outer}")
    return zerojax.load_config(make_config(stage, optimizer=ADAM, **kw), over)


def _axes(axis: Any) -> tuple:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def compiled_collectives(cfg: zerojax.Config, params: Any, loss_fn: Any = mse_loss) -> list[hlo.Collective]:
    p = zerojax.plan(cfg, make_mesh(cfg), params)
    state = zerojax.init_state(cfg, p, params)
    text = zerojax.make_train_step(cfg, p, loss_fn).lower(state, make_batch(32, 0)).compile().as_text()
    return hlo.collectives(text)


# -- hpZ -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss", ["plain", "layerwise"])
def test_hpz_matches_a_single_device(loss: str) -> None:
    cfg = zeropp(hpz=INNER, gas=2)
    p, _ = run_and_compare(cfg, make_mesh(cfg), LOSSES[loss], ("adam", "fp32", cfg.gradient_clipping), "fp32")
    sharded = [(lay, s) for lay, s in zip(jax.tree.leaves(p.layouts, is_leaf=lambda x: hasattr(x, "param")),
                                          jax.tree.leaves(p.param_shardings)) if isinstance(lay.param, Shard)]
    assert sharded
    for lay, s in sharded:  # the secondary copy: split over the inner axis, whole across hosts
        assert s.spec[lay.param.dim] == DATA_INNER


def test_hpz_equals_plain_zero3_over_steps() -> None:
    params = mlp_params(0, divisible=True)
    batches = [make_batch(32, i) for i in range(4)]
    plain = zeropp(gas=2)
    hpz = zeropp(hpz=INNER, gas=2)
    _, s0, m0 = train_steps(plain, batches, params, layerwise_loss, make_mesh(plain))
    _, s1, m1 = train_steps(hpz, batches, params, layerwise_loss, make_mesh(hpz))
    np.testing.assert_allclose([m["loss"] for m in m1], [m["loss"] for m in m0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s0.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_hpz_parameter_gathers_stay_within_inner_groups() -> None:
    params = mlp_params(0, divisible=True)
    plain = compiled_collectives(zeropp(gas=2), params, layerwise_loss)
    hpz = compiled_collectives(zeropp(hpz=INNER, gas=2), params, layerwise_loss)
    outer_groups = {tuple(sorted(g)) for g in zip(*HOSTS)}  # (0, 4), (1, 5), ...
    gathers = [c for c in hpz if c.kind == "all-gather"]
    inner = [c for c in gathers if not c.crosses(HOSTS)]
    cross = [c for c in gathers if c.crosses(HOSTS)]
    assert inner and all(set(map(tuple, c.groups)) == set(HOSTS) for c in inner)
    # the only cross-host gathers build the secondary copy: one per sharded leaf, over the outer groups
    n_sharded = len(jax.tree.leaves(params))
    assert len(cross) == n_sharded and all(c.count == 1 for c in cross)
    assert all({tuple(sorted(g)) for g in c.groups} == outer_groups for c in cross)
    # their result is exactly the secondary copy: each leaf's elements / INNER
    psi = sum(x.size for x in jax.tree.leaves(params))
    assert sum(c.result_elems for c in cross) == psi // INNER
    # cross-host parameter traffic against plain ZeRO-3's (every gather spans the hosts there)
    plain_cross = sum(c.bytes_per_device for c in plain if c.kind == "all-gather" and c.crosses(HOSTS))
    assert all(c.crosses(HOSTS) for c in plain if c.kind == "all-gather")
    assert sum(c.bytes_per_device for c in cross) <= plain_cross / INNER
    # gradients still end reduced over every device: inner reduce-scatters then outer ones
    rs = [c for c in hpz if c.kind == "reduce-scatter"]
    assert any(c.crosses(HOSTS) for c in rs) and any(not c.crosses(HOSTS) for c in rs)


def test_hpz_memory_counts_the_secondary_copy() -> None:
    params = mlp_params(0, divisible=True)
    cfg = zeropp(hpz=INNER, dtype="bf16")
    p = zerojax.plan(cfg, make_mesh(cfg), params)
    rep = p.report()
    psi = sum(x.size for x in jax.tree.leaves(params))
    assert rep.params == 2 * psi // INNER and rep.formula_params == 2 * psi / INNER
    # gradients and the master copy stay split over all 8 devices
    assert rep.grads == jnp.dtype(p.policy.accum).itemsize * psi // 8 == rep.formula_grads


def test_hpz_size_builds_the_hierarchical_mesh() -> None:
    mesh = make_mesh(zeropp(hpz=2, outer=None))
    assert dict(mesh.shape) == {DATA_OUTER: 4, DATA_INNER: 2}


@pytest.mark.parametrize("cfg, mesh, match", [
    (dict(stage=2, hpz=4), None, "needs stage 3"),
    (dict(hpz=2), None, "data-parallel devices within a host are data_inner 4 = 4; they must be equal"),
    (dict(hpz=4), "flat", "needs a hierarchical data axis"),
    (dict(stage=2, qw=True), None, "zero_quantized_weights: ZeRO.. quantizes stage 3"),
    (dict(stage=1, qg=True), None, "zero_quantized_gradients: ZeRO.. quantizes stage 3"),
])
def test_zeropp_config_errors(cfg: dict, mesh: str | None, match: str) -> None:
    c = zeropp(**cfg)
    m = data_mesh() if mesh == "flat" else make_mesh(c)
    with pytest.raises(ConfigError, match=match):
        zerojax.plan(c, m, mlp_params(0, divisible=True))


def test_hpz_with_offloaded_parameters_is_an_error() -> None:
    c = zerojax.load_config(zeropp(hpz=INNER), ["zero_optimization.offload_param.device=cpu"])
    with pytest.raises(ConfigError, match="offload_param"):
        zerojax.plan(c, make_mesh(c), mlp_params(0, divisible=True))


# -- qwZ / qgZ -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(1000,), (7, 300), (256,)])
def test_quantize_round_trip_is_within_half_a_step(bits: int, shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32) * 3
    x.reshape(-1)[:256] = 0.0  # an all-zero block must come back exactly
    q, scale = quantize.quantize(jnp.asarray(x), bits)
    assert q.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert q.shape == (scale.shape[0], quantize.BLOCK if bits == 8 else quantize.BLOCK // 2)
    back = np.asarray(quantize.dequantize(q, scale, shape, bits))
    flat = np.pad(x.reshape(-1), (0, -x.size % quantize.BLOCK)).reshape(-1, quantize.BLOCK)
    step = np.repeat(np.asarray(scale), quantize.BLOCK)[:x.size].reshape(shape)
    assert np.all(np.abs(back - x) <= step / 2 + 1e-6 * np.abs(x))
    np.testing.assert_allclose(np.asarray(scale), np.abs(flat).max(axis=1) / (127 if bits == 8 else 7), rtol=1e-6)
    assert np.all(back.reshape(-1)[:256] == 0)


def _mapped(fn: Any, in_spec: Any, out_spec: Any) -> Any:
    from jax.sharding import PartitionSpec as P
    return jax.jit(jax.shard_map(fn, mesh=data_mesh(), in_specs=P(*in_spec), out_specs=P(*out_spec),
                                 check_vma=False))


def test_quantized_all_gather_gathers_dequantized_shards() -> None:
    x = np.random.default_rng(1).normal(size=(6, 8 * 40)).astype(np.float32)
    got = np.asarray(_mapped(lambda s: quantize.all_gather(s, "data", 1), (None, "data"), (None,))(x))
    want = np.concatenate([np.asarray(quantize.dequantize(*quantize.quantize(jnp.asarray(s)), s.shape))
                           for s in np.split(x, 8, axis=1)], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)  # (fused division vs not: 1 ulp)
    assert np.max(np.abs(got - x)) <= np.max(np.abs(x)) / 127 / 2 + 1e-6


def test_quantized_reduce_scatter_sums_every_devices_chunk() -> None:
    g = np.random.default_rng(2).normal(size=(8, 16, 40)).astype(np.float32)  # device d's gradient: g[d]
    got = np.asarray(_mapped(lambda s: quantize.reduce_scatter(s[0], "data", 0)[None], ("data",), ("data",))(g))
    got = got.reshape(-1, 40)
    want = g.sum(axis=0)
    # each of the 8 summed chunks is off by at most half its int4 step
    steps = sum(np.abs(g[d]).max() / 7 / 2 for d in range(8))
    assert np.max(np.abs(got - want)) <= steps
    assert np.max(np.abs(got - want)) > 0  # it did quantize
    exact = np.asarray(_mapped(lambda s: jax.lax.psum_scatter(s[0], "data", scatter_dimension=0, tiled=True)[None],
                               ("data",), ("data",))(g)).reshape(-1, 40)
    np.testing.assert_allclose(exact, want, rtol=1e-5, atol=1e-5)


# Relative distance of every step's loss from the unquantized run's. Per step, on a 2.9k-parameter MLP
# with 4 rows per device, int4 gradients twice quantized (hpZ + qgZ: within and across hosts) move a
# step's loss by up to ~2.3%; benchmarks/zeropp.py measures the GPT's final loss against the 2% target.
QUANT_TOL = 0.03


@pytest.mark.parametrize("kw", [dict(qw=True), dict(qg=True), dict(qw=True, qg=True),
                                dict(hpz=INNER, qw=True, qg=True)])
@pytest.mark.parametrize("loss", ["plain", "layerwise"])
def test_quantized_training_tracks_unquantized(kw: dict, loss: str) -> None:
    params = mlp_params(0, divisible=True)
    batches = [make_batch(32, i) for i in range(6)]
    ref = zeropp(gas=2, dtype="bf16")
    cfg = zeropp(gas=2, dtype="bf16", **kw)
    _, _, m0 = train_steps(ref, batches, params, LOSSES[loss], make_mesh(ref))
    _, s, m1 = train_steps(cfg, batches, params, LOSSES[loss], make_mesh(cfg))
    l0, l1 = np.array([m["loss"] for m in m0]), np.array([m["loss"] for m in m1])
    np.testing.assert_allclose(l1, l0, rtol=QUANT_TOL)
    assert l1[-1] < 0.5 * l1[0]  # and it trained
    assert not np.array_equal(l1[1:], l0[1:])  # the quantized collectives did run


def test_quantized_collectives_in_the_compiled_step() -> None:
    """qwZ gathers int8 (plus fp32 scales); qgZ turns the gathered parameters' reduce-scatters into
    all-to-alls of packed int4 (uint8) codes."""
    params = mlp_params(0, divisible=True)
    plain = compiled_collectives(zeropp(gas=2, dtype="bf16"), params, layerwise_loss)
    q = compiled_collectives(zeropp(gas=2, dtype="bf16", qw=True, qg=True), params, layerwise_loss)
    assert not any(c.kind == "all-to-all" for c in plain)
    assert any(c.kind == "all-gather" and "s8" in c.dtypes for c in q)
    assert any(c.kind == "all-to-all" and "u8" in c.dtypes for c in q)
    rs = lambda cs: sum(c.result_elems * c.count for c in cs if c.kind == "reduce-scatter")  # noqa: E731
    assert rs(q) < rs(plain)  # the gathered parameters' reduce-scatters went to all-to-all


def test_estimate_counts_the_secondary_copy_at_stage_3_only() -> None:
    from zerojax.tools import estimate as E
    base = zerojax.load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "optimizer": ADAM,
                                "zero_optimization": {"stage3_param_persistence_threshold": 0},
                                "model": {"d_model": 64, "n_layers": 2, "n_heads": 2, "seq_len": 32}})
    hpz = zerojax.load_config(base, ["zero_optimization.zero_hpz_partition_size=8"])
    model = E.embedded_model(base)
    for choice in E.CHOICES:
        plain, secondary = (E.plan_exact(c, model, 64, 8, choice).report for c in (base, hpz))
        if choice.stage == 3 and not choice.offload.endswith("params"):  # hpZ is off with offloaded parameters
            # bf16 parameters: 1/8 of each instead of 1/64; gradients and optimizer state unchanged
            assert secondary.params > 4 * plain.params and secondary.formula_params == 2 * plain.n_params / 8
            assert (secondary.grads, secondary.optimizer) == (plain.grads, plain.optimizer)
        else:
            assert secondary == plain, choice


def test_hpz_with_qgz_quantizes_both_reduction_hops() -> None:
    """Within the host the gather's transpose is an int4 all-to-all; across hosts the reduce-scatter
    that finishes each gradient is one too (DeepSpeed's hierarchical all-to-all)."""
    params = mlp_params(0, divisible=True)
    cs = compiled_collectives(zeropp(hpz=INNER, gas=2, dtype="bf16", qg=True), params, layerwise_loss)
    a2a = [c for c in cs if c.kind == "all-to-all"]
    assert any(c.crosses(HOSTS) for c in a2a) and any(not c.crosses(HOSTS) for c in a2a)


@pytest.mark.parametrize("saved_hpz,loaded_hpz", [(INNER, 1), (1, INNER)])
def test_a_checkpoint_moves_between_hpz_and_plain_zero3(tmp_path: Any, saved_hpz: int, loaded_hpz: int) -> None:
    """Checkpoints hold logical parameters: a run saved with hpZ resumes without it and the other way
    round, and both go on exactly as an uninterrupted run."""
    params = mlp_params(0, divisible=True)
    batches = [make_batch(32, i) for i in range(4)]
    first, second = zeropp(hpz=saved_hpz), zeropp(hpz=loaded_hpz)
    a = zerojax.initialize(first, params=params, loss_fn=layerwise_loss)
    for b in batches[:2]:
        a.train_batch(b)
    a.save_checkpoint(str(tmp_path))
    b = zerojax.initialize(second, params=params, loss_fn=layerwise_loss)
    b.load_checkpoint(str(tmp_path))
    straight = zerojax.initialize(second, params=params, loss_fn=layerwise_loss)
    for batch in batches[:2]:
        straight.train_batch(batch)
    for batch in batches[2:]:
        got, want = b.train_batch(batch), straight.train_batch(batch)
        np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
    for x, y in zip(jax.tree.leaves(b.params), jax.tree.leaves(straight.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


# -- hpZ with the expert and sequence axes -------------------------------------------------------------------

def test_hpz_partition_counts_the_hosts_data_parallel_devices() -> None:
    """zero_hpz_partition_size is DeepSpeed's: the devices of one host sharing the secondary copy, so with
    expert and sequence axes inside data_inner it is data_inner x expert x sequence."""
    shapes = {(4, (("expert", 2),)): {DATA_OUTER: 2, DATA_INNER: 2, EXPERT: 2},
              (2, (("expert", 2),)): {DATA_OUTER: 4, DATA_INNER: 1, EXPERT: 2},
              (4, (("sequence", 2),)): {DATA_OUTER: 2, DATA_INNER: 2, SEQUENCE: 2},
              (4, (("expert", 2), ("sequence", 2))): {DATA_OUTER: 2, DATA_INNER: 1, EXPERT: 2, SEQUENCE: 2}}
    for (hpz, axes), shape in shapes.items():
        cfg = moe_config(3, dict(axes), hpz=hpz)
        mesh = make_mesh(cfg)
        assert dict(mesh.shape) == shape
        params, loss_fn = llama.build(cfg.model, seed=0)
        p = zerojax.plan(cfg, mesh, params, logical_axes=loss_fn.logical_axes)
        data, experts = data_axes(mesh), expert_data_axes(mesh)
        q, gate = p.layouts["layers"]["q"]["kernel"], p.layouts["layers"]["moe"]["experts"]["gate"]
        assert q.param.axis == host_axes(data) and q.update.axis == inner_major(data)
        if EXPERT in shape:  # an expert weight: within the host's part of its expert-data-parallel group
            assert gate.param.axis == host_axes(experts) and gate.update.axis == inner_major(experts)
            assert gate.param.axis == ((DATA_INNER, SEQUENCE) if SEQUENCE in shape else DATA_INNER)
        rep = p.report()  # Ψ/hpz parameters per device, the expert weights' 1/expert slices included
        assert rep.formula_params == pytest.approx(4 * rep.n_params / hpz) and rep.params == rep.formula_params


@pytest.mark.parametrize("cfg, match", [
    (dict(hpz=3, mesh={"expert": 2}), r"zero_hpz_partition_size: 3 is not a multiple of mesh\.expert x mesh\.sequence"),
    (dict(hpz=2, mesh={"data_inner": 2, "sequence": 2}), r"data-parallel devices within a host are data_inner 2 x "
                                                        r"sequence 2 = 4; they must be equal"),
])
def test_hpz_sizes_that_are_not_the_hosts_part_are_one_error(cfg: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        c = moe_config(3, cfg["mesh"], hpz=cfg["hpz"])
        params, loss_fn = llama.build(c.model, seed=0)
        zerojax.plan(c, make_mesh(c), params, logical_axes=loss_fn.logical_axes)


@pytest.mark.parametrize("axis", ["expert", "sequence"])
def test_hpz_with_expert_or_sequence_axis_matches_a_single_device(axis: str) -> None:
    """hpZ 4 on data_outer 2 x data_inner 2 x (expert or sequence) 2 trains as one device does, and every
    parameter gather of the loss stays inside a host: over data_inner x expert (or x sequence) for an
    ordinary weight, data_inner alone for an expert weight; the only cross-host gathers refresh the
    secondary copy, once per sharded leaf over data_outer."""
    e = moe_engine(moe_config(3, {axis: 2}, hpz=4))
    assert dict(e.mesh.shape) == {DATA_OUTER: 2, DATA_INNER: 2, axis: 2}
    assert_single_device(e, f"hpZ 4 on data_outer 2 x data_inner 2 x {axis} 2")
    text = e._train_step.lower(e.state, e.place_batch(moe_batch(0))).compile().as_text()
    found = hlo.collectives(text)
    assert {hlo.mesh_axes(c.groups, e.mesh) for c in found if c.kind == "all-to-all"} == {axis}  # within hosts
    gathers = [c for c in found if c.kind == "all-gather"]
    inner = {hlo.mesh_axes(c.groups, e.mesh) for c in gathers if not c.crosses(HOSTS)}
    cross = [c for c in gathers if c.crosses(HOSTS)]
    want = {f"{DATA_INNER}+{axis}"} | ({DATA_INNER} if axis == EXPERT else set())
    assert inner == want
    assert {hlo.mesh_axes(c.groups, e.mesh) for c in cross} == {DATA_OUTER} and all(c.count == 1 for c in cross)
    lays = jax.tree.leaves(e.plan.layouts, is_leaf=lambda x: hasattr(x, "param"))
    secondary = sum(x.size // axes_size(e.mesh, (*lay.split_axes, *_axes(lay.param.axis)))
                    for lay, x in zip(lays, jax.tree.leaves(e.plan.abstract_params)) if isinstance(lay.param, Shard))
    assert sum(c.result_elems for c in cross) == secondary  # exactly each device's secondary blocks
