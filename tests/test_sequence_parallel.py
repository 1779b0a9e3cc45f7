"""DeepSpeed-Ulysses sequence parallelism (`sequence_parallel_size` -> mesh.sequence) on the Llama, alone,
with the tensor axis and with pipeline stages."""
from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
import pytest

import zerojax
from helpers import assert_tree_close, to_numpy
from zerojax.measure.hlo import collectives
from zerojax.errors import ConfigError
from zerojax.models import llama
from zerojax.planner.mesh import make_mesh

ROWS, T = 4, 16
SMALL = dict(name="llama", vocab_size=64, seq_len=T, d_model=64, n_heads=8, n_kv_heads=4, d_ff=96, n_layers=2)


def config(stage: int, sp: int, tensor: int = 1, **model: Any) -> zerojax.Config:
    return zerojax.load_config({
        "train_batch_size": ROWS, "gradient_clipping": 0.0, "sequence_parallel_size": sp,
        "mesh": {"tensor": tensor} if tensor > 1 else {},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "model": {**SMALL, **model}})


def batch(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(200 + i)
    return {"tokens": rng.integers(0, 64, size=(ROWS, T + 1), dtype=np.int32),
            "loss_mask": (rng.random((ROWS, T)) > 0.3).astype(np.float32)}  # document boundaries


def engine(stage: int, sp: int, n: int, tensor: int = 1, **model: Any) -> zerojax.Engine:
    cfg = config(stage, sp, tensor, **model)
    params, loss_fn = llama.build(cfg.model, seed=0)
    return zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg, jax.devices()[:n]))


@pytest.fixture(scope="module")
def single() -> tuple[list[float], Any]:
    e = engine(0, 1, 1)
    losses = [float(e.train_batch(batch(i))["loss"]) for i in range(2)]
    return losses, to_numpy(e.params)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_llama_equals_the_single_device_run(single: tuple[list[float], Any], stage: int, sp: int) -> None:
    e = engine(stage, sp, sp)
    assert dict(e.mesh.shape) == {"data": 1, "sequence": sp}
    losses = [float(e.train_batch(batch(i))["loss"]) for i in range(2)]
    np.testing.assert_allclose(losses, single[0], rtol=1e-5)
    assert_tree_close(to_numpy(e.params), single[1], rtol=1e-4, atol=1e-5, what=f"sequence {sp} stage {stage}")
    if stage == 3:  # ZeRO shards over data x sequence
        assert any("sequence" in str(s.spec) for s in jax.tree.leaves(e.plan.update_shardings))


def test_data_and_sequence_together_equal_data_alone() -> None:
    """Rows over data (each shard's own masked mean, as DeepSpeed's ranks) and tokens over sequence."""
    ref, e = engine(3, 1, 2), engine(3, 2, 4)
    assert dict(e.mesh.shape) == {"data": 2, "sequence": 2} and e.plan.batch.micro_batch_size == ROWS // 2
    for i in range(2):
        np.testing.assert_allclose(float(e.train_batch(batch(i))["loss"]), float(ref.train_batch(batch(i))["loss"]),
                                   rtol=1e-5)
    assert_tree_close(to_numpy(e.params), to_numpy(ref.params), rtol=1e-4, atol=1e-5, what="data 2 x sequence 2")


def test_two_all_to_alls_per_layer_forward_over_the_sequence_groups() -> None:
    e = engine(0, 2, 4)  # data 2 x sequence 2: the groups are {0, 1} and {2, 3}
    text = e._train_step.lower(e.state, e.place_batch(batch(0))).compile().as_text()
    found = [c for c in collectives(text) if c.kind == "all-to-all"]
    assert found and all(sorted(map(sorted, c.groups)) == [[0, 1], [2, 3]] for c in found)
    per_region: dict[str, list[int]] = {}
    for c in found:
        per_region.setdefault(c.computation, []).append(c.count)
    # the forward scan: q/k/v in and the output back, once per layer; the backward scan adds remat's
    # replay and the two transposes; nothing else (the batch is placed with rows over data only)
    assert sorted(per_region.values(), key=len) == [[SMALL["n_layers"]] * 2, [SMALL["n_layers"]] * 4]


def test_a_head_count_the_sequence_axis_does_not_divide_is_one_error() -> None:
    e = engine(0, 4, 4, n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match=r"mesh\.sequence: 4 .* does not divide the 2 key/value heads"):
        e.train_batch(batch(0))


def test_deepspeed_sequence_parallel_size_sets_the_mesh() -> None:
    cfg = config(1, 2)
    assert cfg.mesh.sequence == 2 and cfg.sources["mesh.sequence"] == "derived (sequence_parallel_size)"
    assert dict(make_mesh(cfg, jax.devices()[:8]).shape) == {"data": 4, "sequence": 2}
    assert cfg.batch(4).micro_batch_size == 1  # the batch triad counts data only
    with pytest.raises(ConfigError, match="sequence_parallel_size: 2, but mesh.sequence is 4"):
        zerojax.load_config({"train_batch_size": 4, "sequence_parallel_size": 2, "mesh": {"sequence": 4}})
    hierarchical = make_mesh(zerojax.load_config({"train_batch_size": 4, "sequence_parallel_size": 2,
                                                  "mesh": {"data_outer": 2}}))
    assert dict(hierarchical.shape) == {"data_outer": 2, "data_inner": 2, "sequence": 2}


# -- with the tensor axis: Ulysses on each tensor slice's heads ----------------------------------------------

TP = dict(d_model=32, n_layers=1)  # 8 query heads over 4 key/value heads of width 4


def unmasked(i: int) -> dict[str, np.ndarray]:
    """Without a loss mask each data shard's mean weighs the same number of predictions, so data 2 equals one device."""
    return {"tokens": batch(i)["tokens"]}


def trained(e: zerojax.Engine) -> tuple[list[float], Any]:
    return [float(e.train_batch(unmasked(i))["loss"]) for i in range(2)], to_numpy(e.params)


@pytest.fixture(scope="module")
def single_unmasked() -> tuple[list[float], Any]:
    return trained(engine(0, 1, 1, **TP))


@pytest.mark.parametrize("stage", [1, 3])
def test_sequence_and_tensor_axes_equal_the_single_device_run(single_unmasked: tuple[list[float], Any], stage: int,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    e = engine(stage, 2, 8, tensor=2, **TP)
    assert dict(e.mesh.shape) == {"data": 2, "sequence": 2, "tensor": 2}
    with caplog.at_level(logging.WARNING, logger="zerojax.rewrite.tensor_slices"):
        losses, got = trained(e)
    assert not caplog.records  # every equation ran on slices: Ulysses' all-to-alls on the slice's own heads
    np.testing.assert_allclose(losses, single_unmasked[0], rtol=1e-5)
    assert_tree_close(got, single_unmasked[1], rtol=1e-4, atol=1e-5,
                      what=f"data 2 x sequence 2 x tensor 2, stage {stage}")


def test_heads_the_sequence_and_tensor_axes_do_not_divide_are_one_error() -> None:
    e = engine(0, 2, 4, tensor=2, **TP, n_kv_heads=2)
    with pytest.raises(ValueError, match=r"mesh\.sequence: 2 .* x mesh\.tensor: 2 = 4 does not divide the 2 key/value"):
        e.train_batch(unmasked(0))


# -- with pipeline stages: a stage's layers run Ulysses on the sequence chunks the stages pass ---------------

PIPE = dict(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, tie_embeddings=False)


def pipelined(stage: int, sp: int) -> zerojax.Engine:
    """The Llama's pipeline form on stage 2 x data 2 (x sequence sp): 2 micro-batches of one row per data shard."""
    cfg = zerojax.load_config({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
        "sequence_parallel_size": sp, "mesh": {"stage": 2, "data": 2}, "pipeline": {"schedule": "1f1b"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "model": {**SMALL, **PIPE}})
    params, _ = llama.build(cfg.model, seed=0)
    params = llama.pipeline_params(cfg.model, jax.tree.map(np.asarray, params.fn()))
    return zerojax.initialize(cfg, model=llama.pipeline_module(cfg.model), params=params,
                              mesh=make_mesh(cfg, jax.devices()[:4 * sp]))


@pytest.fixture(scope="module")
def pipelined_without_sequence() -> tuple[list[float], Any]:
    e = pipelined(1, 1)
    return [float(e.train_batch(batch(i))["loss"]) for i in range(2)], to_numpy(e.params)


@pytest.mark.parametrize("stage", [1, 3])
def test_pipeline_stages_with_a_sequence_axis_equal_them_without(pipelined_without_sequence: tuple[list[float], Any],
                                                                 stage: int) -> None:
    """Each row's tokens over sequence inside every stage (Ulysses attention, chunk-wise rotary positions, the
    masked mean's counts summed over the group), and the rows' ZeRO shards over data x sequence."""
    e = pipelined(stage, 2)
    assert dict(e.mesh.shape) == {"stage": 2, "data": 2, "sequence": 2}
    losses = [float(e.train_batch(batch(i))["loss"]) for i in range(2)]
    np.testing.assert_allclose(losses, pipelined_without_sequence[0], rtol=1e-5)
    assert_tree_close(to_numpy(e.params), pipelined_without_sequence[1], rtol=1e-4, atol=1e-5,
                      what=f"stage 2 x data 2 x sequence 2, ZeRO {stage}")
    if stage == 3:
        assert e.state.params["stages"].sharding.spec == jax.sharding.PartitionSpec("stage", ("data", "sequence"))
