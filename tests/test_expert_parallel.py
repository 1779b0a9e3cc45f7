"""The `expert` mesh axis (DeepSpeed's MoE `ep_size`) composed with ZeRO: the mesh and its errors, the
expert weights' layouts, the MoE Llama trained at expert 2 and 4 against one device, and the
all-to-alls over the expert groups in the compiled step; then with the sequence and tensor axes."""
from __future__ import annotations

import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import zerojax
from helpers import assert_tree_close, reference_run, to_numpy
from zerojax.measure import hlo
from zerojax.core.collectives import REPLICATED, Shard
from zerojax.core.mesh import (DATA, EXPERT, SEQUENCE, TENSOR, data_axes, data_size, expert_data_axes, expert_size,
                               row_axes, row_size)
from zerojax.rewrite.tensor_slices import tensor_parallel
from zerojax.errors import ConfigError
from zerojax.models import llama
from zerojax.models.moe import MoE
from zerojax.planner.axes import expert_plan
from zerojax.planner.mesh import make_mesh
from zerojax.planner.pipeline import make_pipeline_plan

ROWS = 16
SMALL = dict(name="llama", vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2,
             n_experts=4, drop_tokens=False, use_rts=False)
TOP1 = dict(experts_per_token=1, moe_aux_loss_coef=0.0)
TOP2 = dict(experts_per_token=2, top2_2nd_expert_sampling=False, moe_aux_loss_coef=0.0)


def config(stage: int = 0, mesh: dict | None = None, model: dict | None = None) -> zerojax.Config:
    return zerojax.load_config({
        "train_batch_size": ROWS, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "mesh": mesh or {}, "model": {**SMALL, **(model or TOP1)}})


def batch(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + i)
    return {"tokens": rng.integers(0, 64, size=(ROWS, 17), dtype=np.int32)}


def engine(stage: int, mesh: dict, devices: int, model: dict | None = None) -> zerojax.Engine:
    cfg = config(stage, mesh, model)
    params, loss_fn = llama.build(cfg.model, seed=0)
    return zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg, jax.devices()[:devices]))


def train(e: zerojax.Engine, steps: int = 2) -> tuple[list[float], Any]:
    return [float(e.train_batch(batch(i))["loss"]) for i in range(steps)], to_numpy(e.params)


@functools.lru_cache(maxsize=None)
def single(top: int) -> tuple[list[float], Any]:
    """The one-device run: every token gated together, every expert on the device."""
    return train(engine(0, {}, 1, TOP1 if top == 1 else TOP2))


def experts(tree: Any) -> Any:
    return tree["layers"]["moe"]["experts"]


# -- the mesh -------------------------------------------------------------------------------------------

def test_expert_axis_is_carved_out_of_the_data_parallel_devices() -> None:
    assert config().mesh.expert == 1
    assert make_mesh(config()).axis_names == (DATA,)
    m = make_mesh(config(mesh={"expert": 2}))
    assert m.axis_names == (DATA, EXPERT) and dict(m.shape) == {DATA: 4, EXPERT: 2}
    assert data_axes(m) == (DATA, EXPERT) and data_size(m) == 8 and expert_size(m) == 2
    # an expert group is consecutive devices
    assert [d.id for d in m.devices[0]] == [0, 1]
    assert config(mesh={"expert": 4}).batch(8).micro_batch_size == 2  # the batch triad counts data x expert


@pytest.mark.parametrize("mesh, match", [
    ({"expert": 3}, r"^mesh\.expert: 3 does not divide the data-parallel size 8"),
    ({"expert": 4, "data": 2}, r"^mesh\.expert: 4 does not divide the data-parallel size 2"),
])
def test_bad_expert_sizes_are_named(mesh: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_mesh(config(mesh=mesh))


def test_plan_refuses_what_is_not_built_with_the_expert_axis() -> None:
    cfg = config(mesh={"expert": 8})
    params, loss_fn = llama.build(cfg.model, seed=0)
    with pytest.raises(ConfigError, match=r"^mesh\.expert: 8 expert-parallel devices do not divide the 4 experts"):
        zerojax.plan(cfg, make_mesh(cfg), params, logical_axes=loss_fn.logical_axes)
    cfg = config(mesh={"expert": 2, "stage": 2, "tensor": 2})
    with pytest.raises(ConfigError, match=r"^mesh\.tensor: 2 with a pipelined mixture-of-experts model"):
        make_pipeline_plan(cfg, make_mesh(cfg), llama.pipeline_module(cfg.model, num_stages=2))


# -- the layouts ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_weights_split_over_expert_and_zero_over_data_only(stage: int) -> None:
    cfg = config(stage, {"expert": 2})
    params, loss_fn = llama.build(cfg.model, seed=0)
    plan = zerojax.plan(cfg, make_mesh(cfg), params, logical_axes=loss_fn.logical_axes)
    for name, lay in experts(plan.layouts).items():
        assert lay.split == ((1, EXPERT),), name  # [groups, experts, ...]: the expert dimension
        for role, place in (("param", lay.param), ("grad", lay.grad), ("update", lay.update)):
            if isinstance(place, Shard):
                assert place.axis == DATA and place.dim not in (0, 1), (name, role)
    gate = experts(plan.layouts)["gate"]
    assert isinstance(gate.update, Shard) == (stage >= 1) and (gate.param == REPLICATED) == (stage < 3)
    # everything else is an ordinary data-parallel leaf: ZeRO over data x expert
    router = plan.layouts["layers"]["moe"]["router"]["kernel"]
    assert router.split == () and (not isinstance(router.update, Shard) or router.update.axis is None)
    if stage >= 1:
        assert set(plan.update_shardings["layers"]["q"]["kernel"].spec) >= {(DATA, EXPERT)}

    # per device, an expert weight is 1/ep of the whole (and 1/(data x ep) where ZeRO shards it)
    whole = sum(math.prod(x.shape) for x in jax.tree.leaves(experts(plan.abstract_params)))

    def per_device(shardings: Any) -> int:
        return sum(math.prod(s.shard_shape(x.shape)) for s, x in
                   zip(jax.tree.leaves(experts(shardings)), jax.tree.leaves(experts(plan.abstract_params))))

    assert per_device(plan.param_shardings) * (2 * (4 if stage == 3 else 1)) == whole
    assert per_device(plan.update_shardings) * (2 * (4 if stage >= 1 else 1)) == whole


# -- training equals one device -------------------------------------------------------------------------

@pytest.mark.parametrize("ep, stage, top", [(2, 0, 1), (2, 3, 1), (4, 0, 2), (4, 3, 1), (2, 1, 2), (4, 2, 1)])
def test_expert_parallel_llama_trains_to_the_single_device_parameters(ep: int, stage: int, top: int) -> None:
    """No token dropped and no noise, the aux loss off (each device gates its own tokens, as DeepSpeed's
    ranks do, so l_aux is per device): data x expert devices give the one-device losses and parameters."""
    want_losses, want = single(top)
    e = engine(stage, {"expert": ep}, 2 * ep, TOP1 if top == 1 else TOP2)
    assert dict(e.plan.mesh.shape) == {DATA: 2, EXPERT: ep}
    losses, got = train(e)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-5, atol=1e-6, what=f"expert {ep} stage {stage} vs one device")
    start = to_numpy(llama.build(config().model, seed=0)[0].fn())
    moved = np.abs(experts(got)["down"] - experts(start)["down"]).max()
    assert moved > 1e-4  # the experts did train


def test_an_expert_data_group_of_one_device_accumulates_per_expert_device() -> None:
    """data 1 x expert 2 at ZeRO-2: the experts' gradients are reduced over a group of one device (their
    accumulator REPLICATED over it), yet each expert device holds other experts' gradients."""
    want_losses, want = single(1)
    e = engine(2, {"expert": 2}, 2)
    assert dict(e.plan.mesh.shape) == {DATA: 1, EXPERT: 2}
    losses, got = train(e)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5, what="data 1 x expert 2, stage 2")


def test_aux_loss_is_per_device_as_without_the_expert_axis() -> None:
    """With l_aux on, expert 2 over 4 devices equals 4 data-parallel devices (both gate per device)."""
    model = {**TOP1, "moe_aux_loss_coef": 0.1}
    plain_losses, plain = train(engine(3, {}, 4, model))
    losses, got = train(engine(3, {"expert": 2}, 4, model))
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert_tree_close(got, plain, rtol=1e-5, atol=1e-6, what="expert 2 vs data 4, aux loss on")


# -- the compiled step ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 3])
def test_step_holds_all_to_alls_over_the_expert_groups(stage: int) -> None:
    e = engine(stage, {"expert": 2}, 8)
    text = e._train_step.lower(e.state, e.place_batch(batch(0))).compile().as_text()
    found = hlo.collectives(text)
    a2a = [c for c in found if c.kind == "all-to-all"]
    assert a2a and {hlo.mesh_axes(c.groups, e.plan.mesh) for c in a2a} == {EXPERT}
    # two per MoE layer forward, and their transposes in the backward pass
    assert sum(c.count for c in a2a) >= 4
    # the expert weights' gradients are summed over `data` only; the others over data x expert
    spans = {hlo.mesh_axes(c.groups, e.plan.mesh) for c in found if c.kind in ("all-reduce", "reduce-scatter")}
    assert {DATA, f"{DATA}+{EXPERT}"} <= spans


# -- with the sequence axis -----------------------------------------------------------------------------

def test_expert_and_sequence_axes_share_the_data_parallel_devices() -> None:
    """data 2 x expert 2 x sequence 2: rows over data x expert, tokens over sequence; expert weights
    ZeRO-sharded over data x sequence, every other weight over all three."""
    cfg = config(3, {"expert": 2, "sequence": 2})
    m = make_mesh(cfg)
    assert m.axis_names == (DATA, EXPERT, SEQUENCE) and dict(m.shape) == {DATA: 2, EXPERT: 2, SEQUENCE: 2}
    assert row_axes(m) == (DATA, EXPERT) and data_axes(m) == (DATA, EXPERT, SEQUENCE)
    assert expert_data_axes(m) == (DATA, SEQUENCE) and row_size(m) == 4 and data_size(m) == 8
    params, loss_fn = llama.build(cfg.model, seed=0)
    plan = zerojax.plan(cfg, m, params, logical_axes=loss_fn.logical_axes)
    assert plan.batch.micro_batch_size == ROWS // 4
    assert {lay.param.axis for lay in experts(plan.layouts).values()} == {(DATA, SEQUENCE)}
    assert plan.layouts["layers"]["q"]["kernel"].param.axis is None  # the whole data axis


@pytest.mark.parametrize("stage", [1, 3])
def test_expert_and_sequence_parallel_llama_trains_to_the_single_device_parameters(stage: int) -> None:
    want_losses, want = single(1)
    e = engine(stage, {"expert": 2, "sequence": 2}, 8)
    losses, got = train(e)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5, what=f"data 2 x expert 2 x sequence 2, stage {stage}")
    if stage == 3:  # the experts' all-to-alls stay in the expert groups, Ulysses' in the sequence groups
        text = e._train_step.lower(e.state, e.place_batch(batch(0))).compile().as_text()
        a2a = [c for c in hlo.collectives(text) if c.kind == "all-to-all"]
        assert {hlo.mesh_axes(c.groups, e.plan.mesh) for c in a2a} == {EXPERT, SEQUENCE}


# -- with the tensor axis: each expert's MLP sliced Megatron-style ----------------------------------------

@pytest.mark.parametrize("stage", [1, 3])
def test_expert_and_tensor_parallel_llama_trains_to_the_single_device_parameters(
        stage: int, caplog: pytest.LogCaptureFixture) -> None:
    """data 2 x expert 2 x tensor 2: the all-to-alls stay on the expert axis; each device holds its experts'
    gate/up columns and down rows (DeepSpeed-MoE's enable_expert_tensor_parallelism)."""
    want_losses, want = single(1)
    e = engine(stage, {"expert": 2, "tensor": 2}, 8)
    assert dict(e.plan.mesh.shape) == {DATA: 2, EXPERT: 2, TENSOR: 2}
    splits = {name: lay.split for name, lay in experts(e.plan.layouts).items()}
    assert splits == {"gate": ((3, TENSOR), (1, EXPERT)), "up": ((3, TENSOR), (1, EXPERT)),
                      "down": ((2, TENSOR), (1, EXPERT))}
    with caplog.at_level(logging.WARNING, logger="zerojax.rewrite.tensor_slices"):
        losses, got = train(e)
    assert not caplog.records  # every equation, the all-to-alls included, ran on slices
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5, what=f"data 2 x expert 2 x tensor 2, stage {stage}")


def test_expert_sequence_and_tensor_axes_together_train_to_the_single_device_parameters() -> None:
    """expert 2 x sequence 2 x tensor 2 (4 key/value heads: Ulysses takes one per device of each slice)."""
    model = {**TOP1, "n_kv_heads": 4, "n_layers": 1}
    want_losses, want = train(engine(0, {}, 1, model), steps=1)
    e = engine(3, {"expert": 2, "sequence": 2, "tensor": 2}, 8, model)
    assert dict(e.plan.mesh.shape) == {DATA: 1, EXPERT: 2, SEQUENCE: 2, TENSOR: 2}
    losses, got = train(e, steps=1)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5, what="expert 2 x sequence 2 x tensor 2, stage 3")


def test_train_py_plans_the_expert_split() -> None:
    """train.py's model builder hands the Llama's logical axes to the plan, so mesh.expert splits the
    experts there too (not only through `zerojax.initialize`)."""
    from zerojax.app.trainer import build_model
    cfg = config(3, {"expert": 2})
    plan = build_model(cfg, make_mesh(cfg)).plan
    assert all(lay.split == ((1, EXPERT),) for lay in experts(plan.layouts).values())


# -- with pipeline stages: the experts in rows of their own ----------------------------------------------

def pipeline_config(stage: int, mesh: dict) -> zerojax.Config:
    """Two micro-batches of two rows per data shard, AdamW with clipping, the aux loss on: it travels
    between the stages beside the hidden states."""
    return zerojax.load_config({
        "train_batch_size": ROWS, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "pipeline": {"schedule": "1f1b"},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "mesh": mesh, "model": {**SMALL, **TOP2, "moe_aux_loss_coef": 0.01}})


@functools.lru_cache(maxsize=None)
def unpipelined() -> tuple[Any, list[float], Any, float]:
    """The MoE Llama at data 2 x expert 2 without stages: its start, losses, end (as pipeline layers) and
    evaluation loss. Each device gates the same micro-batch's rows as in the pipeline, so l_aux agrees."""
    cfg = pipeline_config(0, {"expert": 2})
    params, loss_fn = llama.build(cfg.model, seed=0)
    e = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg, jax.devices()[:4]))
    start = llama.pipeline_params(cfg.model, to_numpy(e.params))
    losses, end = train(e)
    return start, losses, llama.pipeline_params(cfg.model, end), float(e.eval_batch(batch(9)))


def pipelined(stage: int, expert: int, start: Any = None) -> zerojax.Engine:
    cfg = pipeline_config(stage, {"stage": 2, "expert": expert})
    return zerojax.initialize(cfg, model=llama.pipeline_module(cfg.model), params=start, mesh=make_mesh(cfg))


@pytest.mark.parametrize("stage", [1, 3])
def test_pipelined_moe_llama_equals_it_unpipelined(stage: int) -> None:
    """stage 2 x data 2 x expert 2: the experts' rows split over stage and expert and ZeRO-sharded over data
    only, the other weights' rows over data x expert; losses, evaluation and parameters as without stages."""
    start, want_losses, want, want_eval = unpipelined()
    e = pipelined(stage, 2, start)
    assert dict(e.mesh.shape) == {"stage": 2, DATA: 2, EXPERT: 2}
    rows = e.pipeline.rows
    assert rows.arrays == ("stages", "expert_stages") and rows.experts.size == 2
    zero = {"param": stage == 3, "update": True}
    for role, shardings in (("param", e.plan.param_shardings), ("update", e.plan.update_shardings)):
        assert shardings["expert_stages"].spec == P("stage", EXPERT, DATA if zero[role] else None)
        assert shardings["stages"].spec == P("stage", (DATA, EXPERT) if zero[role] else None)
    # a device holds 1/2 of its stage's expert leaves (and under ZeRO-3 1/2 of that row)
    whole = sum(x.size for entry in start.values() for x in jax.tree.leaves(entry.get("moe", {}).get("experts", {})))
    assert sum(s.size for d in rows.experts.slots for s in d.values()) * 2 == whole
    block = e.state.params["expert_stages"].addressable_shards[0].data.shape
    assert block == (1, 1, rows.experts.width // (2 if stage == 3 else 1))
    losses, got = train(e)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5, what=f"stage 2 x data 2 x expert 2, ZeRO {stage}")
    np.testing.assert_allclose(float(e.eval_batch(batch(9))), want_eval, rtol=1e-5)


def test_pipelined_moe_checkpoint_resumes_at_another_expert_size(tmp_path: Any) -> None:
    """Expert rows saved at expert 2 are cut into the logical experts by the saved manifest and packed into
    the rows of expert 1 and 4 (parameters and Adam's moments): the same model, the same next loss. The
    export writes the logical model, each expert whole."""
    saved = pipelined(1, 2, unpipelined()[0])
    saved.train_batch(batch(0))
    saved.save_checkpoint(str(tmp_path), async_save=False)
    on_disk = zerojax.checkpoint.read_params(tmp_path)[0]
    want = float(saved.train_batch(batch(1))["loss"])
    for expert in (1, 4):
        e = pipelined(3, expert)
        e.load_checkpoint(str(tmp_path))
        assert e.global_steps == 1 and e.pipeline.rows.experts.size == expert
        assert_tree_close(e.params, on_disk, rtol=0, atol=0, what=f"expert {expert}")
        np.testing.assert_allclose(float(e.train_batch(batch(1))["loss"]), want, rtol=2e-5)
        assert_tree_close(e.params, saved.params, rtol=1e-4, atol=1e-4, what=f"after a step at expert {expert}")
    from zerojax.checkpoint import export_safetensors
    exported = zerojax.load_exported(str(export_safetensors(tmp_path, None, tmp_path / "model.safetensors")))
    assert set(exported) == set(on_disk) and exported["layer_01"]["moe"]["experts"]["gate"].shape == (4, 32, 48)
    assert_tree_close(to_numpy(exported), on_disk, rtol=0, atol=0, what="exported")


class UserMoEBlock(nnx.Module):
    """A user's block, written as the Flax guides write one, around DeepSpeed's MoE layer."""

    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.moe = MoE(d, 2 * d, 4, k=2, capacity_factor=4.0, top2_2nd_expert_sampling=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y, _, _ = self.moe(self.norm(x), None)
        return x + y


def test_a_users_flax_moe_model_pipelines_to_the_single_device_run() -> None:
    """A PipelineModule of a user's Flax layers with two MoE blocks, one a stage, at stage 2 x data 2 x
    expert 2 and ZeRO-3: the experts land in expert rows, and losses and parameters are one device's
    (a capacity that drops no token)."""
    def mse(out: jax.Array, b: dict) -> jax.Array:
        return jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)

    d = 16
    module = zerojax.PipelineModule(
        [lambda b: b["x"], zerojax.LayerSpec(nnx.Linear, d, d), jnp.tanh, zerojax.LayerSpec(UserMoEBlock, d),
         zerojax.LayerSpec(nnx.Linear, d, d), zerojax.LayerSpec(UserMoEBlock, d)], loss_fn=mse,
        partition_method="uniform")
    start = module.init(0)
    cfg = zerojax.load_config({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "mesh": {"stage": 2, "data": 4, "expert": 2}})
    e = zerojax.initialize(cfg, model=module, params=start)
    assert e.pipeline.rows.arrays == ("stages", "expert_stages")
    rng = np.random.default_rng(0)
    data = [{"x": (x := rng.normal(size=(e.train_batch_size(), 8, d)).astype(np.float32)),
             "y": np.tanh(x[..., ::-1]).astype(np.float32)} for _ in range(3)]
    losses = [float(e.train_batch(b)["loss"]) for b in data]
    want = reference_run(e.plan.tx, e.plan.policy.param, module.loss, start, data, 1.0)
    np.testing.assert_allclose(losses, [float(r["loss"]) for r in want], rtol=1e-5)
    assert_tree_close(e.params, want[-1]["master"], rtol=1e-4, atol=1e-5, what="a user's pipelined MoE model")


def test_train_py_pipelines_the_moe_llama() -> None:
    """train.py's model builder cuts the MoE Llama into stages with its experts in expert rows."""
    from zerojax.app.trainer import build_model
    cfg = pipeline_config(1, {"stage": 2, "expert": 2})
    model = build_model(cfg, make_mesh(cfg))
    assert model.pipeline.rows.arrays == ("stages", "expert_stages")
    assert model.plan.layouts["expert_stages"].split == ((0, "stage"), (1, EXPERT))


# -- with the tensor axis, experts whole: DeepSpeed's enable_expert_tensor_parallelism=False -----------

WHOLE = {**TOP1, "expert_tensor_parallelism": False}


@pytest.mark.parametrize("stage", [1, 3])
def test_whole_experts_beside_a_tensor_axis_train_to_the_single_device_parameters(
        stage: int, caplog: pytest.LogCaptureFixture) -> None:
    """data 2 x expert 2 x tensor 2, model.expert_tensor_parallelism false: each expert whole on every tensor
    device (split over `expert` only, ZeRO over data), the dense weights sliced; each tensor device sends half
    of the dispatched capacity through the all-to-alls and the experts, gathered back before the combine."""
    want_losses, want = single(1)
    e = engine(stage, {"expert": 2, "tensor": 2}, 8, WHOLE)
    assert {name: lay.split for name, lay in experts(e.plan.layouts).items()} == {
        "gate": ((1, EXPERT),), "up": ((1, EXPERT),), "down": ((1, EXPERT),)}
    assert e.plan.layouts["layers"]["q"]["kernel"].split == ((2, TENSOR),)
    assert "experts whole on every tensor device" in expert_plan(e.plan)
    with caplog.at_level(logging.WARNING, logger="zerojax.rewrite.tensor_slices"):
        losses, got = train(e)
    assert not caplog.records  # the split capacity ran on slices throughout, nothing gathered early
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-4, atol=1e-5, what=f"whole experts, tensor 2, stage {stage}")
    if stage == 1:
        # per MoE layer: the all-to-alls carry half of the [E, C, M] = [4, 64, 32] capacity of each device's
        # 64 tokens, and the experts' results are all-gathered over the tensor groups (and the dropped
        # tokens' cotangents, in the backward pass)
        text = e._train_step.lower(e.state, e.place_batch(batch(0))).compile().as_text()
        found = hlo.collectives(text)
        a2a = [c for c in found if c.kind == "all-to-all"]
        assert a2a and {(hlo.mesh_axes(c.groups, e.plan.mesh), c.result_elems) for c in a2a} == {(EXPERT, 4 * 32 * 32)}
        gathered = [c for c in found if c.kind == "all-gather" and hlo.mesh_axes(c.groups, e.plan.mesh) == TENSOR]
        assert {c.result_elems for c in gathered} == {4 * 64 * 32} and sum(c.count for c in gathered) >= 2 * 2


@pytest.mark.parametrize("source", [{"mesh": {"logical_axis_rules": {"mlp": "tensor"}}},
                                    {"tensor_parallel": {"partition_config": {"layer_specs": [
                                        {"patterns": [r"experts\.(gate|up)$"], "partition_type": "column"}]}}}])
def test_whole_experts_stay_whole_whatever_the_source(source: dict) -> None:
    """An annotation rule or a layer_specs pattern that would slice the experts leaves them whole in this
    mode (the pattern counts as matched); the table names the key."""
    cfg = zerojax.load_config({"train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
                               **source, "mesh": {"expert": 2, "tensor": 2, **source.get("mesh", {})},
                               "model": {**SMALL, **WHOLE}})
    params, loss_fn = llama.build(cfg.model, seed=0)
    plan = zerojax.plan(cfg, make_mesh(cfg), params, logical_axes=loss_fn.logical_axes)
    assert all(lay.over(TENSOR) is None for lay in experts(plan.layouts).values())
    assert plan.tensor_plan.count("model.expert_tensor_parallelism: false") == 3


@pytest.mark.parametrize("drop", [False, True])
def test_whole_experts_split_a_capacity_the_tensor_group_does_not_divide(drop: bool) -> None:
    """5 tokens over 2 experts: capacity 5 without dropping (DeepSpeed pads it to a multiple of the tensor
    size), 3 with (where DeepSpeed asserts): padded to 6 and 4 with empty slots, the layer's output and
    every gradient are the unsplit layer's. The experts' gradients, each tensor device's from its own
    slots, are summed over the group."""
    layer = MoE(8, 12, 2, min_capacity=0, drop_tokens=drop, use_rts=False, enable_expert_tensor_parallelism=False,
                rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer, nnx.Param)
    x = jax.random.normal(jax.random.key(1), (5, 8))

    def loss(p: Any, x: jax.Array) -> jax.Array:
        out, _, _ = nnx.merge(graphdef, p)(x)
        return jnp.sum(jnp.sin(out))

    want = jax.value_and_grad(loss)(params, x)
    seen: list[dict] = []
    on_slices = tensor_parallel(loss, jax.tree.map(lambda _: None, params), TENSOR, 2, report=seen.append)
    mapped = jax.shard_map(jax.value_and_grad(on_slices), mesh=Mesh(np.array(jax.devices()[:2]), (TENSOR,)),
                           in_specs=(P(), P()), out_specs=P(), check_vma=False)
    text = jax.jit(mapped).lower(params, x).as_text()
    got = jax.jit(mapped)(params, x)
    assert seen[-1] == {} and "all_gather" in text
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_tree_close(to_numpy(got[1]), to_numpy(want[1]), rtol=1e-5, atol=1e-7, what=f"drop_tokens {drop}")
