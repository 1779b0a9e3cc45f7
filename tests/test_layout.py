"""ZeRO stages as layouts: dimension choice, placements per role, bytes per device against the
ZeRO formulas, and the collectives XLA actually emits for each stage."""
from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import zerojax
from helpers import (collective_shapes, collectives, computations_with, data_mesh,
                     layerwise_loss, make_batch, make_config, mlp_params, mse_loss, numel,
                     while_bodies)
from zerojax.core.collectives import PARTIAL, REPLICATED, Shard
from zerojax.core.measure import array_bytes
from zerojax.core.layout import (GRADIENTS, OPTIMIZER, PARAMETERS, STAGE_PARTITIONS, LeafLayout, choose_dim, leaf_layout, spec)
from zerojax.core.mesh import DATA

N = 8


def _layouts(p: zerojax.Plan) -> list[LeafLayout]:
    return jax.tree.leaves(p.layouts, is_leaf=lambda x: isinstance(x, LeafLayout))


# ------------------------------------------------------------------------------------------------
# choose_dim

@pytest.mark.parametrize("shape, n, want", [
    ((16, 32), 8, 0),          # the most major divisible dimension: each block is contiguous
    ((12, 16), 8, 1),          # ...of those the devices divide
    ((64, 64), 8, 0),
    ((2, 128, 64), 8, 1),      # 3 dimensions: dimension 0 is taken to stack layers, kept whole
    ((2, 64, 128), 8, 1),
    ((4, 8, 16, 32), 8, 2),    # 4: a nested stack [groups, layers, in, out]
    ((4, 8, 4, 4), 8, 1),      # ...failing the matrix, the most major dimension but the first
    ((8, 32, 4), 8, 1),        # 4 < n is not a candidate
    ((8, 4, 4), 8, 0),         # a layer axis only when nothing else divides
    ((32,), 8, 0),
    ((4,), 8, None),           # smaller than n
    ((12,), 8, None),          # not divisible
    ((3, 5), 8, None),
    ((), 8, None),             # scalars stay whole
    ((16, 32), 1, None),       # a single device shards nothing
    ((6, 10), 2, 0),
    ((12, 10), 4, 0),
])
def test_choose_dim(shape: tuple[int, ...], n: int, want: int | None) -> None:
    assert choose_dim(shape, n) == want


@pytest.mark.parametrize("shape, layer_axes, want", [
    ((16, 32), 1, 1),          # a stacked matrix [layers, features]: not the layer axis
    ((16, 32), 0, 0),
    ((8, 16, 32), 0, 0),       # known not to stack layers: dimension 0 is fine
    ((8, 16, 32), 1, 1),
    ((8, 8, 16, 32), 2, 2),    # two stacking axes
    ((8, 8, 4), 2, 1),         # nothing outside them divides: the most major but the first
])
def test_choose_dim_with_known_layer_axes(shape: tuple[int, ...], layer_axes: int, want: int) -> None:
    assert choose_dim(shape, 8, layer_axes) == want


def test_most_major_dimension_makes_contiguous_blocks() -> None:
    """Each device's block of a leaf sharded by choose_dim is, within each layer, one contiguous
    run of its elements (row-major), so a gather or reduce-scatter of a layer moves whole rows."""
    for shape, layers in [((16, 32), 1), ((2, 64, 128), 2), ((4, 24, 16, 8), 96)]:
        dim = choose_dim(shape, 8)
        assert math.prod(shape[:dim]) == layers, (shape, dim)
        flat = np.arange(math.prod(shape)).reshape(shape)
        for block in np.split(flat, 8, axis=dim):
            for run in block.reshape(layers, -1):
                assert np.all(np.diff(run) == 1), (shape, dim)


# ------------------------------------------------------------------------------------------------
# Placements per role

def test_stage_partitions() -> None:
    assert STAGE_PARTITIONS == {0: frozenset(), 1: {OPTIMIZER}, 2: {OPTIMIZER, GRADIENTS},
                                3: {OPTIMIZER, GRADIENTS, PARAMETERS}}


@pytest.mark.parametrize("stage, param, grad, update", [
    (0, REPLICATED, PARTIAL, REPLICATED),      # all-reduce at the boundary
    (1, REPLICATED, PARTIAL, Shard(0)),        # reduced once, at the boundary, into shards
    (2, REPLICATED, Shard(0), Shard(0)),       # reduce-scattered every micro-step
    (3, Shard(0), Shard(0), Shard(0)),
])
def test_leaf_layout_per_stage(stage: int, param: Any, grad: Any, update: Any) -> None:
    assert leaf_layout((16, 32), N, STAGE_PARTITIONS[stage], 0) == LeafLayout(param, grad, update)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_indivisible_leaf_stays_whole(stage: int) -> None:
    lay = leaf_layout((3, 5), N, STAGE_PARTITIONS[stage], 0)
    assert lay.param == REPLICATED and lay.update == REPLICATED
    # A gradient the stage would shard is reduced into a replicated copy instead.
    assert lay.grad == (REPLICATED if stage >= 2 else PARTIAL)


def test_persistence_threshold() -> None:
    parts = STAGE_PARTITIONS[3]
    small = leaf_layout((16, 32), N, parts, persistence_threshold=513)     # 512 elements < 513
    assert small == LeafLayout(REPLICATED, Shard(0), Shard(0))              # only the param stays whole
    assert leaf_layout((16, 32), N, parts, persistence_threshold=512).param == Shard(0)
    # Through the config, on a whole model: DeepSpeed's default (1e5) keeps this tiny model whole.
    params = mlp_params(0, divisible=True)
    p = zerojax.plan(make_config(3, threshold=100_000), data_mesh(), params)
    assert all(lay.param == REPLICATED for lay in _layouts(p))
    assert all(isinstance(lay.grad, Shard) and isinstance(lay.update, Shard) for lay in _layouts(p))
    p = zerojax.plan(make_config(3, threshold=1000), data_mesh(), params)
    got = {jax.tree_util.keystr(k): lay.param for k, lay in
           jax.tree_util.tree_leaves_with_path(p.layouts, is_leaf=lambda x: isinstance(x, LeafLayout))}
    assert got["['layers']['w']"] == Shard(1)   # 2048 elements: sharded
    assert got["['w_in']"] == REPLICATED        # 512 elements: persistent


def test_spec_and_plan_shardings() -> None:
    assert spec(Shard(1), 3) == P(None, DATA, None)
    assert spec(REPLICATED, 2) == P() and spec(PARTIAL, 2) == P()
    params = mlp_params(0)   # b_out (4,) and w_out (32, 4) do not divide by 8
    p = zerojax.plan(make_config(3), data_mesh(), params)
    specs = jax.tree.map(lambda s: s.spec, p.param_shardings)
    assert specs["w_in"] == P(DATA, None) and specs["layers"]["w"] == P(None, DATA, None)
    assert specs["b_out"] == P() and specs["w_out"] == P(DATA, None)
    assert p.batch_sharding.spec == P(DATA)
    # Optimizer state: parameter-shaped leaves follow `update`, counters are replicated.
    for leaf, s in zip(jax.tree.leaves(p.abstract_opt_state), jax.tree.leaves(p.opt_state_shardings)):
        if leaf.shape == ():
            assert s.spec == P()
    report = p.report()
    assert 0 < report.replicated_fraction < 0.1


# ------------------------------------------------------------------------------------------------
# Bytes per device: plan's report vs ZeRO formula vs the actual arrays

def paper_bytes(stage: int, psi: int, n: int) -> float:
    """Rajbhandari et al., mixed-precision Adam, K = 12."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


@pytest.fixture(scope="module")
def bf16_adam() -> dict[int, tuple[zerojax.Config, zerojax.Plan, zerojax.TrainState]]:
    """A bf16 + Adam plan and state per stage for a model whose every leaf divides by 8."""
    params = mlp_params(0, divisible=True)
    out = {}
    for stage in (0, 1, 2, 3):
        cfg = make_config(stage, gas=2, dtype="bf16")
        p = zerojax.plan(cfg, data_mesh(), params)
        out[stage] = (cfg, p, zerojax.init_state(cfg, p, params))
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_device_match_zero_formula(stage: int, bf16_adam: Any) -> None:
    _, p, state = bf16_adam[stage]
    r = p.report()
    psi = r.n_params
    want = paper_bytes(stage, psi, N)
    ratio = r.total / want
    print(f"\nstage {stage}: report {r.total} B/device, ZeRO formula {want:.0f} B, ratio {ratio:.4f}")
    print(r.table())
    assert abs(ratio - 1) < 0.05
    assert r.formula_total == pytest.approx(want, rel=1e-9)
    assert r.replicated_fraction == 0.0
    # The arrays the state really holds, per device.
    assert array_bytes(state.params) == r.params
    assert array_bytes(state.master) + array_bytes(state.opt_state) == r.optimizer
    measured = array_bytes(state.params) + array_bytes(state.master) + array_bytes(state.opt_state)
    grads = r.grads  # the accumulator is a temporary of the step, not part of the state
    assert abs((measured + grads) / want - 1) < 0.05
    # Every addressable shard of a leaf has the same shape (no ragged padding).
    for leaf in jax.tree.leaves((state.params, state.master, state.opt_state)):
        assert len({s.data.shape for s in leaf.addressable_shards}) == 1


# ------------------------------------------------------------------------------------------------
# Collectives in the compiled step

@pytest.fixture(scope="module")
def compiled_hlo(bf16_adam: Any) -> dict[int, str]:
    batch = make_batch(32, 0)
    out = {}
    for stage, (cfg, p, state) in bf16_adam.items():
        step = zerojax.make_train_step(cfg, p, mse_loss)
        out[stage] = step.lower(state, batch).compile().as_text()
    return out


LEAF_SHAPES = {tuple(x.shape) for x in jax.tree.leaves(mlp_params(0, divisible=True))}
MIN_LEAF = min(numel(s) for s in LEAF_SHAPES)
# What the loss uses at once: the stacked leaves' layers, every other leaf whole.
USED_SHAPES = {s for k, v in mlp_params(0, divisible=True).items() if k != "layers" for s in [v.shape]} | {
    v.shape[1:] for v in mlp_params(0, divisible=True)["layers"].values()}


def _big_all_reduces(hlo: str) -> list[tuple[int, ...]]:
    """All-reduce results that are not scalars (the loss and the per-leaf squared norms are fine)."""
    return [s for s in collective_shapes(hlo, "all-reduce") if numel(s) > 1]


def test_stage0_all_reduces_gradients(compiled_hlo: dict[int, str]) -> None:
    hlo = compiled_hlo[0]
    reduced = set(collective_shapes(hlo, "all-reduce"))
    assert LEAF_SHAPES <= reduced, f"gradients not all-reduced: {LEAF_SHAPES - reduced}"
    assert not collectives(hlo, "reduce-scatter")
    assert not collectives(hlo, "all-gather")   # nothing is sharded


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_stages_reduce_scatter_and_never_all_reduce_gradients(stage: int,
                                                                      compiled_hlo: dict[int, str]) -> None:
    hlo = compiled_hlo[stage]
    assert len(collectives(hlo, "reduce-scatter")) >= len(LEAF_SHAPES)
    big = _big_all_reduces(hlo)
    assert not [s for s in big if s in LEAF_SHAPES], f"gradient-sized all-reduce: {big}"
    assert not [s for s in big if numel(s) >= MIN_LEAF], f"large all-reduce: {big}"
    # Every leaf comes back whole: parameters after the update (1, 2) or before the forward (3), where
    # a scanned stack is gathered one layer at a time.
    assert (LEAF_SHAPES if stage < 3 else USED_SHAPES) <= set(collective_shapes(hlo, "all-gather"))


def test_stage1_reduces_once_stage2_every_micro_step(compiled_hlo: dict[int, str]) -> None:
    """With accumulation, stage 1's reduce-scatters sit at the boundary (the entry computation)
    and stage 2's inside the micro-step loop."""
    rs1 = computations_with(compiled_hlo[1], "reduce-scatter")
    assert rs1 == {"ENTRY"}, rs1
    rs2 = computations_with(compiled_hlo[2], "reduce-scatter")
    assert rs2 and rs2 <= while_bodies(compiled_hlo[2]), rs2


def test_stage3_gathers_parameters_for_the_forward(compiled_hlo: dict[int, str], bf16_adam: Any) -> None:
    """Stage 3 all-gathers parameters to use them; stages 1 and 2 all-gather once, after the update.

    With a plain loss (gathered where it is used) and with a layer-by-layer gathering loss alike,
    only one layer's slice of the stacked parameters is gathered at a time, inside the scan over
    layers.
    """
    plain = set(collective_shapes(compiled_hlo[3], "all-gather"))
    assert USED_SHAPES <= plain
    assert not {x.shape for x in mlp_params(0, divisible=True)["layers"].values()} & plain
    for stage in (1, 2):
        assert computations_with(compiled_hlo[stage], "all-gather") == {"ENTRY"}

    cfg, p, state = bf16_adam[3]
    hlo = zerojax.make_train_step(cfg, p, layerwise_loss).lower(state, make_batch(32, 0)).compile().as_text()
    gathered = set(collective_shapes(hlo, "all-gather"))
    stacked = mlp_params(0, divisible=True)["layers"]
    assert {stacked["w"].shape[1:], stacked["b"].shape[1:]} <= gathered     # one layer at a time
    assert not {stacked["w"].shape, stacked["b"].shape} & gathered          # never all layers
    loops = while_bodies(hlo)
    layer_gathers = [c for c in computations_with(hlo, "all-gather") if c in loops]
    assert layer_gathers


# ------------------------------------------------------------------------------------------------
# Stage 3 with the scanned, rematerialized GPT: only about one layer is whole at a time

def test_stage3_gpt_temp_memory_is_a_small_fraction_of_gradients() -> None:
    from zerojax.config import ModelConfig
    from zerojax.models import gpt
    from zerojax.core.state import abstract_state

    mc = ModelConfig(d_model=128, n_layers=8, n_heads=4, seq_len=32, remat=True)
    params = gpt.abstract_params(mc)
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    cfg = make_config(3, train_batch_size=8, threshold=0)
    p = zerojax.plan(cfg, data_mesh(), params)
    step = zerojax.make_train_step(cfg, p, gpt.make_loss_fn(mc))
    compiled = step.lower(abstract_state(p), {"tokens": jax.ShapeDtypeStruct((8, mc.seq_len + 1), np.int32)}
                          ).compile()
    mem = compiled.memory_analysis()
    grad_bytes = 4 * psi
    fraction = mem.temp_size_in_bytes / grad_bytes
    layer = sum(math.prod(x.shape[1:]) for x in jax.tree.leaves(params["blocks"])) * 4
    print(f"\nstage-3 GPT ({psi:,} params, {mc.n_layers} layers): temp {mem.temp_size_in_bytes / 2**20:.2f} MiB"
          f" = {fraction:.3f} x fp32 gradients ({grad_bytes / 2**20:.2f} MiB); one layer "
          f"{layer / 2**20:.2f} MiB; arguments {mem.argument_size_in_bytes / grad_bytes:.3f} x")
    assert fraction < 0.5
    # Parameters, m and v are sharded: the arguments are ~3/8 of the fp32 gradient size.
    assert mem.argument_size_in_bytes / grad_bytes < 3 / N + 0.05
    # The per-layer gathers and reduce-scatters sit inside the scanned loops.
    hlo = compiled.as_text()
    loops = while_bodies(hlo)
    assert computations_with(hlo, "all-gather") & loops
    assert computations_with(hlo, "reduce-scatter") & loops


def test_persistence_threshold_compares_one_layer_of_a_stack() -> None:
    """A (4, 16, 32) stack of 512-element layers under a 600 threshold: whole layers are small
    (kept replicated) when the leading axis stacks layers, while the 2048-element array counts
    whole otherwise."""
    parts = STAGE_PARTITIONS[3]
    assert leaf_layout((4, 16, 32), N, parts, 600).param == Shard(1)
    assert leaf_layout((4, 16, 32), N, parts, 600, layer_axes=1).param == REPLICATED
    assert leaf_layout((4, 16, 32), N, parts, 500, layer_axes=1).param == Shard(1)


def test_plan_takes_layer_axes_as_a_tree_prefix() -> None:
    cfg = zerojax.load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW"}, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 600}})
    params = {"layers": {"w": jax.ShapeDtypeStruct((4, 16, 32), np.float32)},
              "head": jax.ShapeDtypeStruct((16, 64), np.float32)}
    mesh = data_mesh()
    p = zerojax.plan(cfg, mesh, params, layer_axes={"layers": 1, "head": 0})
    assert p.layouts["layers"]["w"].param == REPLICATED and p.layouts["head"].param == Shard(0)
    assert zerojax.plan(cfg, mesh, params).layouts["layers"]["w"].param == Shard(1)
    with pytest.raises(ValueError, match="layer_axes"):
        zerojax.plan(cfg, mesh, params, layer_axes={"nope": 1})
