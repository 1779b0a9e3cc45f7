"""Pipelined training equals unpipelined training of the same model.

For S in {2, 4} stages (x 4 or 2 data shards on the 8 devices), M in {S, 2S} micro-batches, GPipe
and 1F1B, with and without a tied layer (the input projection reused transposed as the output
layer, stored on stage 0 and used on the last stage), ZeRO-1 over data: three optimizer steps of
`zerojax.initialize(config, model=module)` must give the parameters, losses and gradient norms of
the single-device reference (`helpers.reference_run` on `module.loss`, the unpipelined model).
SGD without momentum checks the other ZeRO stages: its update is lr * g, so a gradient summed
over the wrong axis, a tied gradient not reduced or a micro-batch dropped cannot hide.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from helpers import ADAM, SGD, assert_relative_close, assert_tree_close, reference_run, to_numpy
from zerojax.pipeline.executor import make_grad_fn, tables
from zerojax.pipeline.schedule import build

D_IN, H = 8, 16
STEPS = 3
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def inputs(batch: dict[str, Any]) -> jax.Array:
    return batch["x"]


def mse(out: jax.Array, batch: dict[str, Any]) -> jax.Array:
    return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


def transposed(layer: nnx.Linear, x: jax.Array) -> jax.Array:
    """The tied input projection used as the output layer (like an LM head tied to the embedding)."""
    return x @ layer.kernel[...].T


def make_module(tied: bool, **kwargs: Any) -> zerojax.PipelineModule:
    """8 layers: [inputs, Linear(8,16), tanh, Linear(16,16), tanh, Linear(16,16), tanh, out]."""
    if tied:
        first = zerojax.TiedLayerSpec("io", nnx.Linear, D_IN, H)
        last = zerojax.TiedLayerSpec("io", nnx.Linear, D_IN, H, forward_fn=transposed)
    else:
        first, last = zerojax.LayerSpec(nnx.Linear, D_IN, H), zerojax.LayerSpec(nnx.Linear, H, D_IN)
    hidden = [zerojax.LayerSpec(nnx.Linear, H, H), jnp.tanh]
    return zerojax.PipelineModule([inputs, first, jnp.tanh, *hidden, *hidden, last], loss_fn=mse, **kwargs)


MODULES = {tied: make_module(tied) for tied in (False, True)}
PARAMS0 = {tied: MODULES[tied].init(0) for tied in (False, True)}


def batches(rows: int) -> list[dict[str, np.ndarray]]:
    out = []
    for i in range(STEPS):
        rng = np.random.default_rng(100 + i)
        x = rng.normal(size=(rows, D_IN)).astype(np.float32)
        out.append({"x": x, "y": np.tanh(1.5 * x[:, ::-1]).astype(np.float32)})
    return out


def config(stages: int, micro_batches: int, schedule: str = "1f1b", *, stage: int = 1, optimizer: dict = ADAM,
           clip: float = 1.0, dtype: str = "fp32", **extra: Any) -> zerojax.Config:
    data = 8 // stages
    raw: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro_batches,
        "optimizer": optimizer, "gradient_clipping": clip, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "mesh": {"stage": stages, "data": data}, "pipeline": {"schedule": schedule, **extra.pop("pipeline", {})}}
    if dtype in ("bf16", "fp16"):
        raw[dtype] = {"enabled": True}
    raw.update(extra)
    return zerojax.load_config(raw)


_references: dict[tuple, list[dict[str, Any]]] = {}


def reference(engine: zerojax.Engine, tied: bool, data: list[dict[str, np.ndarray]], key: tuple) -> list[dict]:
    if key not in _references:
        _references[key] = reference_run(engine.plan.tx, engine.plan.policy.param, MODULES[tied].loss,
                                         PARAMS0[tied], data, engine.config.gradient_clipping)
    return _references[key]


def train_and_compare(cfg: zerojax.Config, tied: bool, ref_key: tuple, dtype: str = "fp32") -> zerojax.Engine:
    engine = zerojax.initialize(cfg, model=MODULES[tied], params=PARAMS0[tied])
    data = batches(engine.train_batch_size())
    metrics = [jax.device_get(engine.train_batch(b)) for b in data]
    ref = reference(engine, tied, data, ref_key + (engine.train_batch_size(),))
    got = engine.params
    if dtype == "fp32":
        assert_tree_close(got, ref[-1]["master"], **FP32_TOL, what="params")
        for i, (m, r) in enumerate(zip(metrics, ref)):
            np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-5, err_msg=f"loss, step {i}")
            np.testing.assert_allclose(m["grad_norm"], r["grad_norm"], rtol=1e-5, err_msg=f"grad_norm, step {i}")
    else:
        assert_relative_close(got, ref[-1]["master"], rel=0.1, origin=PARAMS0[tied], what="params")
    assert engine.global_steps == STEPS
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(PARAMS0[tied])))
    assert moved > 100 * FP32_TOL["atol"]
    return engine


def placed(x: jax.Array, *spec: str) -> bool:
    return x.sharding.is_equivalent_to(jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec(*spec)),
                                       x.ndim)


# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, micro_batches", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_matches_unpipelined(stages: int, micro_batches: int, schedule: str, tied: bool) -> None:
    cfg = config(stages, micro_batches, schedule)
    engine = train_and_compare(cfg, tied, ("adam", tied))
    pipe = engine.pipeline
    assert pipe.stages == stages and pipe.schedule.micro_batches == micro_batches
    assert engine.plan.data_size == 8 // stages and engine.zero_optimization_stage() == 1
    if tied:  # the tied weight really crosses stages: stored on the first, used by the last
        (t,) = pipe.rows.tied
        assert t.owner == 0 and t.users == (stages - 1,)
    # ZeRO-1 layout: parameters replicated over data, master and moments sharded over (stage, data).
    assert placed(engine.state.params["stages"], "stage")
    mu = [x for x in jax.tree.leaves(engine.state.opt_state) if x.ndim == 2]
    assert mu and all(placed(x, "stage", "data") for x in mu)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_other_zero_stages_with_sgd(stage: int) -> None:
    cfg = config(2, 4, "1f1b", stage=stage, optimizer=SGD, clip=0.0)
    engine = train_and_compare(cfg, True, ("sgd", True))
    rows = engine.state.params["stages"]
    assert placed(rows, "stage", "data") if stage == 3 else placed(rows, "stage")


@pytest.mark.parametrize("stages, micro_batches", [(2, 2), (4, 8)])
def test_synchronous_1f1b(stages: int, micro_batches: int) -> None:
    """Paired ticks: a forward and a backward in one tick, the last stage's of the same micro-batch."""
    engine = train_and_compare(config(stages, micro_batches, "1f1b_sync"), True, ("adam", True))
    assert engine.pipeline.schedule.num_ticks == micro_batches + 2 * (stages - 1)


def test_interleaved_schedule() -> None:
    cfg = config(2, 4, "interleaved", pipeline={"chunks": 2})
    engine = train_and_compare(cfg, True, ("adam", True))
    assert engine.pipeline.rows.virtual == 4
    assert engine.pipeline.schedule.idle_fraction < build("1f1b", 2, 4).idle_fraction


def test_bf16_and_eval() -> None:
    cfg = config(4, 4, "1f1b", dtype="bf16")
    engine = train_and_compare(cfg, False, ("adam-bf16", False), dtype="bf16")
    assert engine.state.params["stages"].dtype == jnp.bfloat16
    assert engine.state.master["stages"].dtype == jnp.float32
    # eval_batch runs the forward-only schedule on any multiple of the data size.
    held_out = batches(24)[0]
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), engine.params)
    want = float(MODULES[False].loss(params, held_out))
    np.testing.assert_allclose(float(engine.eval_batch(held_out)), want, rtol=2e-2)


def test_fp16_loss_scaling() -> None:
    """The loss scale multiplies the last stage's cotangent and apply_update divides it out (SGD:
    a scale left in the gradient would show up 65536-fold)."""
    cfg = config(2, 2, "1f1b", dtype="fp16", optimizer=SGD, clip=0.0)
    engine = train_and_compare(cfg, True, ("sgd-fp16", True), dtype="fp16")
    assert engine.skipped_steps == 0
    assert float(engine.state.scaler.scale) == 2.0 ** 16
    assert engine.state.params["stages"].dtype == jnp.float16


def test_executor_runs_the_schedule_it_is_given() -> None:
    """The switch branch each device executed, tick by tick, is the schedule's table."""
    cfg = config(4, 4, "1f1b")
    engine = zerojax.initialize(cfg, model=MODULES[True], params=PARAMS0[True])
    grad_fn = jax.jit(make_grad_fn(engine.pipeline.train, trace=True))
    data = batches(engine.train_batch_size())[0]
    loss, _, fwd, bwd = grad_fn(engine.state.params, data, 1.0)
    want = tables(engine.pipeline.schedule)
    np.testing.assert_array_equal(np.asarray(fwd), want["fwd"])
    np.testing.assert_array_equal(np.asarray(bwd), want["bwd"])
    # Every device ran each of its stage's forwards and backwards once: 4 of each.
    assert ((np.asarray(fwd) > 0).sum(axis=0) == 4).all() and ((np.asarray(bwd) > 0).sum(axis=0) == 4).all()
    idle = float(np.mean((np.asarray(fwd) == 0) & (np.asarray(bwd) == 0)))
    assert idle == pytest.approx((4 - 1) / (4 + 4 - 1))
    np.testing.assert_allclose(float(loss), float(MODULES[True].loss(PARAMS0[True], data)), rtol=1e-6)


def test_checkpoint_round_trip(tmp_path: Any) -> None:
    cfg = config(2, 2, "1f1b")
    engine = zerojax.initialize(cfg, model=MODULES[True], params=PARAMS0[True])
    data = batches(engine.train_batch_size())
    engine.train_batch(data[0])
    engine.save_checkpoint(str(tmp_path), async_save=False)
    after_one = to_numpy(engine.params)
    engine.train_batch(data[1])
    fresh = zerojax.initialize(cfg, model=MODULES[True])  # stage-local init, then restore
    fresh.load_checkpoint(str(tmp_path))
    assert fresh.global_steps == 1
    assert_tree_close(to_numpy(fresh.params), after_one, rtol=0, atol=0, what="restored")
    fresh.train_batch(data[1])
    assert_tree_close(to_numpy(fresh.params), to_numpy(engine.params), rtol=0, atol=0, what="continued")

    # zero_to_fp32 for a pipeline: the logical parameters under their own names, not the rows.
    from zerojax.checkpoint import export_safetensors
    exported = zerojax.load_exported(str(export_safetensors(tmp_path, None, tmp_path / "model.safetensors")))
    assert_tree_close(to_numpy(exported), after_one, rtol=0, atol=0, what="exported")
    assert set(exported) == set(PARAMS0[True]) and "stages" not in exported


def test_stage_local_init_is_the_module_init() -> None:
    """Each stage creates only its own layers, and together they are `module.init(seed)`."""
    engine = zerojax.initialize(config(4, 4, "1f1b", run={"seed": 3}), model=MODULES[True])
    assert_tree_close(to_numpy(engine.params), to_numpy(MODULES[True].init(3)), rtol=0, atol=0, what="init")
    rows = engine.pipeline.rows
    width = rows.width
    assert width % 128 == 0 and width >= max(rows.stored)
    # Each device holds one row: its own stage's parameters, not the model.
    shard = engine.state.params["stages"].addressable_shards[0].data
    assert shard.shape == (1, width)


# ------------------------------------------------------------------------------------------------
# Bad configs: one ConfigError naming the key, before anything compiles.

def test_more_stages_than_layers() -> None:
    small = zerojax.PipelineModule([zerojax.LayerSpec(nnx.Linear, 4, 4), jnp.tanh, zerojax.LayerSpec(nnx.Linear, 4, 4)],
                                   loss_fn=mse)
    with pytest.raises(zerojax.ConfigError, match=r"mesh.stage: 4 pipeline stages but the model has only 3 layers; use at most 3 stages"):
        zerojax.initialize(config(4, 4), model=small)


def test_interleaved_needs_a_multiple_of_stages() -> None:
    with pytest.raises(zerojax.ConfigError, match=r"gradient_accumulation_steps: .* multiple of 2 \(got 3\)"):
        zerojax.initialize(config(2, 3, "interleaved", pipeline={"chunks": 2}), model=MODULES[False])


def test_stage_axis_must_divide_devices() -> None:
    with pytest.raises(zerojax.ConfigError, match=r"mesh.stage: 3 does not divide the 8 devices"):
        zerojax.initialize({"train_batch_size": 8, "mesh": {"stage": 3}}, model=MODULES[False])


def test_num_stages_must_match_the_mesh() -> None:
    module = make_module(False, num_stages=2)
    with pytest.raises(zerojax.ConfigError, match=r"mesh.stage: the mesh has 4 stages but PipelineModule\(num_stages=2\)"):
        zerojax.initialize(config(4, 4), model=module)


def test_per_tensor_optimizer_is_rejected() -> None:
    with pytest.raises(zerojax.ConfigError, match=r"optimizer.type: lamb reads whole parameter tensors .*use Adam, AdamW"):
        zerojax.initialize(config(2, 2, optimizer={"type": "Lamb", "params": {"lr": 1e-3}}), model=MODULES[False])


def test_chunks_need_the_interleaved_schedule() -> None:
    with pytest.raises(zerojax.ConfigError, match=r"pipeline.chunks: 2 chunks per stage need pipeline.schedule"):
        config(2, 2, "1f1b", pipeline={"chunks": 2})


def test_stage_mesh_needs_a_pipeline_module() -> None:
    with pytest.raises(zerojax.ConfigError, match=r"mesh.stage: 2 pipeline stages need a pipelined model"):
        zerojax.initialize(config(2, 2), params=PARAMS0[False], loss_fn=MODULES[False].loss)


def test_pipeline_module_needs_a_stage_axis() -> None:
    cfg = zerojax.load_config({"train_batch_size": 8, "optimizer": ADAM})
    with pytest.raises(zerojax.ConfigError, match=r"mesh.stage: a PipelineModule needs mesh.stage >= 2"):
        zerojax.initialize(cfg, model=MODULES[False])


def test_stage_boundaries_must_carry_one_shape() -> None:
    """Cuts between layers with different output widths cannot share one ppermute buffer."""
    module = zerojax.PipelineModule([inputs, zerojax.LayerSpec(nnx.Linear, D_IN, H), zerojax.LayerSpec(nnx.Linear, H, 4),
                                     zerojax.LayerSpec(nnx.Linear, 4, D_IN)], loss_fn=mse, partition_method="uniform")
    engine = zerojax.initialize(config(4, 4), model=module)
    with pytest.raises(zerojax.ConfigError, match=r"stage 1 passes .* but stage 0 passes .* every stage boundary"):
        engine.train_batch(batches(engine.train_batch_size())[0])


def test_bad_layers_and_tied_shapes() -> None:
    with pytest.raises(zerojax.ConfigError, match=r"layers\[1\]: expected a LayerSpec"):
        zerojax.PipelineModule([inputs, nnx.Linear(2, 2, rngs=nnx.Rngs(0))], loss_fn=mse)
    with pytest.raises(zerojax.ConfigError, match=r"TiedLayerSpec key 'io' builds parameters shaped differently"):
        zerojax.PipelineModule([zerojax.TiedLayerSpec("io", nnx.Linear, 2, 3),
                                zerojax.TiedLayerSpec("io", nnx.Linear, 3, 3)], loss_fn=mse)
    with pytest.raises(zerojax.ConfigError, match=r"loss_fn"):
        zerojax.PipelineModule([inputs])


# ------------------------------------------------------------------------------------------------
# Layers that draw noise (a MoE gate's) get keys, the same in a micro-batch's forward and backward.

class Noisy(nnx.Module):
    """Scales its input by a weight and, in training, by noise drawn from the key it is handed."""

    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.ones((d,)))

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        noise = 1.0 if rng is None else jax.random.uniform(rng, x.shape, minval=0.5, maxval=1.5)
        return x * self.w[...] * noise


def test_a_layer_that_takes_rng_gets_one_key_per_micro_batch_in_forward_and_backward() -> None:
    """With the keys the executor derives (the step's key, the data shard, the micro-batch, the layer
    index), the pipeline's loss and gradient are those of the unpipelined loss under the same keys: a
    backward that recomputed with another key than its forward would give another gradient. Evaluation
    hands out no key."""
    module = zerojax.PipelineModule([inputs, zerojax.LayerSpec(nnx.Linear, D_IN, H), zerojax.LayerSpec(Noisy, H),
                                     zerojax.LayerSpec(nnx.Linear, H, D_IN)], loss_fn=mse)
    assert [layer.spec.takes_rng for layer in module.layers[1:]] == [False, True, False]
    cfg = config(2, 2, stage=1, mesh={"stage": 2, "data": 1})
    engine = zerojax.initialize(cfg, model=module, params=module.init(0), mesh=jax.sharding.Mesh(
        np.array(jax.devices()[:2]).reshape(2, 1), ("stage", "data")))
    data = batches(engine.train_batch_size())[0]
    key = jax.random.key_data(jax.random.key(7))
    loss, grads = jax.jit(make_grad_fn(engine.pipeline.train))(engine.state.params, data, 1.0, key)

    shard = jax.random.fold_in(jax.random.wrap_key_data(key), 0)  # the one data shard

    def reference(params: Any) -> jax.Array:
        micro = [jax.tree.map(lambda x, i=i: x[i:i + 1], data) for i in range(2)]
        return sum(module.loss(params, mb, jax.random.fold_in(shard, i)) for i, mb in enumerate(micro)) / 2

    want_loss, want = jax.value_and_grad(reference)(module.init(0))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert_tree_close(engine.pipeline.rows.unpack(jax.device_get(grads)), to_numpy(want), rtol=1e-5, atol=1e-6,
                      what="gradient under the drawn keys")
    # without noise the gradient is another one: the keys were used
    plain = jax.grad(lambda p: module.loss(p, data))(module.init(0))
    assert not np.allclose(np.asarray(plain["layer_02"]["w"]), np.asarray(want["layer_02"]["w"]), rtol=1e-3)
    np.testing.assert_allclose(float(engine.eval_batch(data)), float(module.loss(module.init(0), data)), rtol=1e-6)
