"""The central equivalence proof: every ZeRO stage trains exactly like a single device.

For each case, three optimizer steps of `make_train_step` on the 8 virtual devices (or a 4- or
2-device mesh) are compared with a single-device reference: plain `jax.value_and_grad` of the mean
loss over the whole global batch, DeepSpeed's gradient clipping, and the plan's own optax transform
(`p.tx`). Parameters, optimizer state, loss and gradient norm must agree: tightly in fp32, loosely in
bf16 (whose reference keeps fp32 master weights and runs the forward in bf16, as the step does).

SGD without momentum is included because Adam's normalization hides a gradient scaled by a constant
(shard_map's implicit sum of replicated-input gradients would scale it by N); SGD's update does not.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from zerojax.core.collectives import gather, gathers_params
from helpers import (ADAM, SGD, assert_relative_close, assert_tree_close, data_mesh, forward, layerwise_loss,
                     make_batch, make_config, mlp_params, mse_loss, reference_run, to_numpy, train_steps)

STEPS = 3
TBS = 32
PARAMS0 = mlp_params(0)
BATCHES = [make_batch(TBS, i) for i in range(STEPS)]
LOSSES = {"plain": mse_loss, "layerwise": layerwise_loss}

# fp32: reduction order is the only difference, so element-wise and tight. bf16: the step sums bf16
# gradients per shard and micro-batch while the reference takes one bf16 gradient of the whole batch,
# so the update as a whole (L2, per leaf) must agree within BF16_REL (measured: <= 0.04).
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
FP32_OPT_TOL = dict(rtol=1e-4, atol=1e-9)
BF16_REL = 0.1
METRIC_RTOL = {"fp32": 1e-5, "bf16": 1e-2}

_reference_cache: dict[tuple, list[dict[str, Any]]] = {}


def reference(p: zerojax.Plan, key: tuple, clip: float) -> list[dict[str, Any]]:
    """Reference results depend only on optimizer, dtype and clipping: computed once per key."""
    if key not in _reference_cache:
        _reference_cache[key] = reference_run(p.tx, p.policy.param, mse_loss, PARAMS0, BATCHES, clip)
    return _reference_cache[key]


def assert_state_shardings(p: zerojax.Plan, state: zerojax.TrainState) -> None:
    """params / master / optimizer leaves are still in the plan's layout after a step."""
    def check(tree: Any, shardings: Any, what: str) -> None:
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        wanted = jax.tree.leaves(shardings)
        assert len(leaves) == len(wanted), what
        for (path, x), s in zip(leaves, wanted):
            assert x.sharding.is_equivalent_to(s, x.ndim), (
                f"{what}{jax.tree_util.keystr(path)}: {x.sharding} is not the plan's {s}")

    check(state.params, p.param_shardings, "params")
    if p.policy.mixed:
        check(state.master, p.update_shardings, "master")
    else:
        assert state.master is None
    check(state.opt_state, p.opt_state_shardings, "opt_state")


def run_and_compare(cfg: zerojax.Config, mesh: Any, loss_fn: Any, ref_key: tuple,
                    dtype: str) -> tuple[zerojax.Plan, list[dict[str, Any]]]:
    p, state, metrics = train_steps(cfg, BATCHES, PARAMS0, loss_fn, mesh)
    assert_state_shardings(p, state)

    ref = reference(p, ref_key, cfg.gradient_clipping)
    final = ref[-1]
    if p.policy.mixed:
        master = to_numpy(state.master)
        # The stored compute params are exactly the master copy cast to the compute dtype.
        cast = jax.tree.map(lambda x: np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float64),
                            master)
        assert_tree_close(to_numpy(state.params), cast, rtol=0, atol=0, what="params vs master")
    else:
        master = to_numpy(state.params)
    if dtype == "fp32":
        assert_tree_close(master, final["master"], **FP32_TOL, what="master")
        assert_tree_close(to_numpy(state.opt_state), final["opt_state"], **FP32_OPT_TOL, what="opt_state")
    else:
        assert_relative_close(master, final["master"], rel=BF16_REL, origin=PARAMS0, what="master")
        assert_relative_close(to_numpy(state.opt_state), final["opt_state"], rel=BF16_REL, what="opt_state")
    for i, (m, r) in enumerate(zip(metrics, ref)):
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=METRIC_RTOL[dtype], err_msg=f"loss, step {i}")
        np.testing.assert_allclose(m["grad_norm"], r["grad_norm"], rtol=METRIC_RTOL[dtype],
                                   err_msg=f"grad_norm, step {i}")
        assert not bool(m["skipped"])
    assert int(state.step) == STEPS and int(state.skipped) == 0
    # Training actually moved the parameters by much more than the tolerance.
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(master), jax.tree.leaves(PARAMS0)))
    assert moved > 100 * FP32_TOL["atol"]
    return p, metrics


# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_adam_matches_single_device(stage: int, gas: int, dtype: str) -> None:
    cfg = make_config(stage, gas=gas, dtype=dtype, optimizer=ADAM)
    p, _ = run_and_compare(cfg, data_mesh(), mse_loss, ("adam", dtype, cfg.gradient_clipping), dtype)
    assert p.batch.gradient_accumulation_steps == gas and p.data_size == 8
    assert p.batch.micro_batch_size == TBS // (gas * 8)


@pytest.mark.parametrize("gas, dtype", [(1, "fp32"), (4, "fp32"), (4, "bf16")])
def test_stage3_layerwise_gathering_loss(gas: int, dtype: str) -> None:
    """A loss that gathers ZeRO-3 parameters per layer inside its scan (`gathers_params`)."""
    cfg = make_config(3, gas=gas, dtype=dtype, optimizer=ADAM)
    p, _ = run_and_compare(cfg, data_mesh(), layerwise_loss, ("adam", dtype, cfg.gradient_clipping), dtype)
    sharded = [lay.param for lay in jax.tree.leaves(p.layouts, is_leaf=lambda x: hasattr(x, "param"))
               if isinstance(lay.param, zerojax.core.collectives.Shard)]
    assert len(sharded) >= 4  # the loss really received ParamShards


@pytest.mark.parametrize("stage, loss, threshold", [(0, "plain", 0), (1, "plain", 0), (2, "plain", 0),
                                                    (3, "plain", 0), (3, "layerwise", 0), (3, "layerwise", 600)])
def test_sgd_without_momentum_catches_scaled_gradients(stage: int, loss: str, threshold: int) -> None:
    """SGD's step is lr * g: a gradient off by a factor of N (or 1/N) cannot hide.

    threshold 600 keeps w_in (512 elements) and the biases whole under stage 3 while layers.w
    (2048) is sharded: persistent parameters with sharded gradients (PARTIAL -> reduce-scatter).
    """
    cfg = make_config(stage, gas=2, optimizer=SGD, clip=0.0, threshold=threshold)
    p, _ = run_and_compare(cfg, data_mesh(), LOSSES[loss], ("sgd", "fp32", 0.0), "fp32")
    if threshold:
        params = {jax.tree_util.keystr(k): lay.param for k, lay in jax.tree_util.tree_leaves_with_path(
            p.layouts, is_leaf=lambda x: hasattr(x, "param"))}
        assert params["['w_in']"] == zerojax.core.collectives.REPLICATED
        assert params["['layers']['w']"] == zerojax.core.collectives.Shard(1)


@pytest.mark.parametrize("n, stage, loss", [(4, 3, "layerwise"), (2, 2, "plain")])
def test_smaller_meshes(n: int, stage: int, loss: str) -> None:
    """Meshes over a subset of the devices: 4 and 2 data shards (b_out (4,) shards on both)."""
    cfg = make_config(stage, gas=2, optimizer=ADAM)
    p, _ = run_and_compare(cfg, data_mesh(n), LOSSES[loss], ("adam", "fp32", cfg.gradient_clipping), "fp32")
    assert p.data_size == n and p.batch.micro_batch_size == TBS // (2 * n)


@pytest.mark.parametrize("stage, optimizer", [(2, "sgd"), (3, "adam")])
def test_gradient_clipping_engages_and_matches(stage: int, optimizer: str) -> None:
    clip = 0.05
    cfg = make_config(stage, gas=2, optimizer=SGD if optimizer == "sgd" else ADAM, clip=clip)
    _, metrics = run_and_compare(cfg, data_mesh(), layerwise_loss if stage == 3 else mse_loss,
                                 (optimizer, "fp32", clip), "fp32")
    assert all(float(m["grad_norm"]) > 2 * clip for m in metrics), "clipping never engaged"
    # And it mattered: the unclipped reference ends elsewhere.
    p = zerojax.plan(cfg, data_mesh(), PARAMS0)
    clipped = reference(p, (optimizer, "fp32", clip), clip)[-1]["master"]
    unclipped = reference(p, (optimizer, "fp32", 0.0), 0.0)[-1]["master"]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(unclipped)))
    assert diff > 1e-3


def test_micro_batch_order_is_deepspeeds() -> None:
    """Micro-batch i is rows [i*m*dp, (i+1)*m*dp); data shard d gets block d of m rows of it.

    The loss squares the mean residual of the rows it is given, so it depends on how rows are
    grouped: only that exact grouping reproduces the step's gradient.
    """
    def grouped_loss(params: Any, batch: Any) -> jax.Array:
        return jnp.mean(jnp.mean(forward(params, batch["x"]) - batch["y"], axis=0) ** 2)

    gas, n = 2, 8
    cfg = make_config(2, gas=gas, optimizer=SGD, clip=0.0)
    p = zerojax.plan(cfg, data_mesh(), PARAMS0)
    m = p.batch.micro_batch_size
    state = zerojax.init_state(cfg, p, PARAMS0)
    step = zerojax.make_train_step(cfg, p, grouped_loss)
    batch = BATCHES[0]
    state, metrics = step(state, batch)

    def blocks_loss(params: Any) -> jax.Array:
        parts = [grouped_loss(params, jax.tree.map(lambda x: x[b * m:(b + 1) * m], batch))
                 for b in range(gas * n)]  # block b = micro b // n, shard b % n
        return jnp.mean(jnp.stack(parts))

    params0 = jax.tree.map(jnp.asarray, PARAMS0)
    loss, grads = jax.jit(jax.value_and_grad(blocks_loss))(params0)
    lr = cfg.optimizer.params.lr
    want = jax.tree.map(lambda w, g: w - lr * g, params0, grads)
    assert_tree_close(to_numpy(state.params), to_numpy(want), rtol=1e-5, atol=1e-6, what="params")
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)

    # Another grouping (shard d taking gas*m contiguous rows) gives another loss: the test can tell.
    def other(params: Any) -> jax.Array:
        parts = [grouped_loss(params, jax.tree.map(lambda x: x[d * gas * m:(d + 1) * gas * m], batch))
                 for d in range(n)]
        return jnp.mean(jnp.stack(parts))
    assert abs(float(jax.jit(other)(params0)) - float(loss)) > 1e-4


def test_wrong_batch_leading_dim_raises() -> None:
    cfg = make_config(2, gas=2)
    p = zerojax.plan(cfg, data_mesh(), PARAMS0)
    state = zerojax.init_state(cfg, p, PARAMS0)
    step = zerojax.make_train_step(cfg, p, mse_loss)
    with pytest.raises(ValueError, match="train_batch_size"):
        step(state, make_batch(TBS // 2, 0))
    with pytest.raises(ValueError, match="train_batch_size"):
        step(state, {"x": make_batch(TBS, 0)["x"], "y": make_batch(TBS + 8, 0)["y"]})
    # The state survived the rejected call (nothing was donated).
    assert int(state.step) == 0
    eval_step = zerojax.make_eval_step(cfg, p, mse_loss)
    with pytest.raises(ValueError, match="multiple of the data-parallel size 8"):
        eval_step(state.params, make_batch(12, 0))


def test_eval_step_matches_loss() -> None:
    for stage, loss in ((0, mse_loss), (3, layerwise_loss)):
        cfg = make_config(stage)
        p = zerojax.plan(cfg, data_mesh(), PARAMS0)
        state = zerojax.init_state(cfg, p, PARAMS0)
        got = zerojax.make_eval_step(cfg, p, loss)(state.params, BATCHES[1])
        want = mse_loss(jax.tree.map(jnp.asarray, PARAMS0), BATCHES[1])
        np.testing.assert_allclose(got, want, rtol=1e-5)


def noisy_loss(params: dict[str, Any], batch: dict[str, Any], rng: Any) -> jax.Array:
    """Input noise drawn from the step's key (None: evaluation, no noise)."""
    x = batch["x"]
    if rng is not None:
        x = x + 0.5 * jax.random.normal(rng, x.shape, x.dtype)
    return jnp.mean((forward(params, x) - batch["y"]) ** 2)


def test_loss_with_rng_gets_a_key_per_step_shard_and_micro_batch() -> None:
    """The draws depend only on (seed, step, shard, micro-batch): every stage trains the same,
    another seed trains differently, and evaluation is deterministic."""
    def run(stage: int, seed: int) -> tuple[Any, list[float]]:
        cfg = make_config(stage, gas=2, optimizer=SGD)
        p = zerojax.plan(cfg, data_mesh(), PARAMS0)
        state = zerojax.init_state(cfg, p, PARAMS0, rng=seed)
        step = zerojax.make_train_step(cfg, p, noisy_loss)
        losses = []
        for batch in BATCHES:
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        evaluate = zerojax.make_eval_step(cfg, p, noisy_loss)
        assert float(evaluate(state.params, BATCHES[0])) == float(evaluate(state.params, BATCHES[0]))
        return to_numpy(state.params), losses

    p0, l0 = run(0, 7)
    p3, l3 = run(3, 7)
    assert_tree_close(p3, p0, **FP32_TOL, what="stage 3 vs stage 0, same seed")
    np.testing.assert_allclose(l3, l0, rtol=1e-5)
    _, other = run(0, 8)
    assert abs(other[0] - l0[0]) > 1e-3  # another seed draws other noise


def test_a_marked_loss_receives_dim0_leaves_whole() -> None:
    """A loss that gathers its own shards may scan, loop or index over dimension 0 of any leaf,
    and a ParamShard cannot be sliced along its sharded axis: leaves sharded along dimension 0
    (here a matrix and a stack the loss indexes in a fori_loop) reach it whole, a stack sharded
    along a later dimension as a ParamShard; all train as at stage 0."""
    from zerojax.core.collectives import ParamShard
    seen: list[dict[str, bool]] = []   # per trace: which leaves arrived as shards

    @gathers_params
    def loss(params: dict[str, Any], batch: dict[str, Any]) -> jax.Array:
        seen.append({k: isinstance(v, ParamShard) for k, v in params.items()})
        h = batch["x"] @ gather(params["w"])
        h = jax.lax.fori_loop(0, 8, lambda i, h: jnp.tanh(h + gather(params["stack"])[i]), h)
        h, _ = jax.lax.scan(lambda h, m: (jnp.tanh(h @ gather(m)), None), h, params["mats"])
        return jnp.mean((h[:, :4] - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    params = {"w": (rng.normal(size=(16, 32)) * 0.3).astype(np.float32),
              "stack": (rng.normal(size=(8, 32)) * 0.1).astype(np.float32),
              "mats": (rng.normal(size=(2, 32, 32)) * 0.2).astype(np.float32)}
    got = {}
    for stage in (0, 3):
        cfg = make_config(stage, optimizer=SGD, clip=0.0, threshold=0)
        p = zerojax.plan(cfg, data_mesh(), params)
        if stage == 3:
            assert [p.layouts[k].param for k in ("w", "stack", "mats")] == [
                zerojax.core.collectives.Shard(0), zerojax.core.collectives.Shard(0), zerojax.core.collectives.Shard(1)]
        state = zerojax.init_state(cfg, p, params)
        step = zerojax.make_train_step(cfg, p, loss)
        for batch in BATCHES:
            state, _ = step(state, batch)
        got[stage] = to_numpy(state.params)
    assert seen[-1] == {"w": False, "stack": False, "mats": True}, seen
    assert_tree_close(got[3], got[0], **FP32_TOL, what="stage 3 vs 0")


def test_the_core_step_runs_a_prepared_loss_only() -> None:
    """core.step does not rewrite losses: a plain function is refused naming the door, and the
    door's result trains as zerojax.make_train_step does (the same loss after one step)."""
    from zerojax.core import step as core_step
    from zerojax.rewrite import prepare_loss

    cfg = make_config(3)
    plan = zerojax.plan(cfg, data_mesh(), mlp_params(0))
    with pytest.raises(TypeError, match=r"make_train_step: .*zerojax\.rewrite\.prepare_loss\(plan, loss_fn\)"):
        core_step.make_train_step(plan, mse_loss)
    batch = make_batch(TBS, 0)
    losses = []
    for make in (lambda: core_step.make_train_step(plan, prepare_loss(plan, mse_loss)),
                 lambda: zerojax.make_train_step(plan, mse_loss)):
        _, metrics = make()(zerojax.init_state(plan, mlp_params(0)), batch)
        losses.append(float(metrics["loss"]))
    assert losses[0] == losses[1]


def test_update_reads_each_gradient_leaf_once_for_its_norm_and_finiteness() -> None:
    """The update's global norm and the per-leaf finiteness flags of the skip share one reduction per
    gradient leaf (`precision.norm_and_finite`): every reduction is a kernel XLA compiles before the
    first step, and the update had two per leaf."""
    from zerojax.core.state import abstract_state
    from zerojax.core.step import apply_update
    for dtype in ("fp32", "bf16"):
        plan = zerojax.plan(make_config(3, optimizer=ADAM, dtype=dtype), data_mesh(), mlp_params(0))
        grads = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, plan.policy.accum, sharding=s),
                             plan.abstract_trained, plan.update_shardings)
        update = jax.jit(lambda s, g, loss: apply_update(plan, s, g, loss))
        text = update.lower(abstract_state(plan), grads, jax.ShapeDtypeStruct((), jnp.float32)).as_text()
        # one per leaf, plus the skip's all() over the flags and the scaler's any() over them
        assert text.count("stablehlo.reduce") == plan.n_trained + 2, (dtype, text.count("stablehlo.reduce"))
