"""ZeRO-3 on models written the way users write them, with no `gathers_params` marking.

Three shapes (benchmarks/user_models.py): a Flax NNX stack (`nnx.vmap` layers, `nnx.scan` over an
`nnx.remat` body) through `from_nnx`, a plain loss over `lax.scan` + `jax.checkpoint`, and a Python
loop of layers. Stage 3 must train them to the same parameters as stage 0, hold only a few layers'
gathered weights at a time, and reduce-scatter (never all-reduce) their gradients.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax.measure.hlo import collectives as hlo_collectives
from benchmarks.user_models import SHAPES
from helpers import assert_relative_close, assert_tree_close, data_mesh, gathers_in_loops, to_numpy, while_bodies
from zerojax.core.collectives import ParamShard, Shard
from zerojax.rewrite.gather_at_use import gather_at_use
from zerojax.core.layout import is_layout

ROWS = 32


ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}
# Adam is nearly blind to a gradient off by a constant factor; plain SGD is not.
SGD = {"type": "SGD", "params": {"lr": 0.1}}


def config(stage: int, *, dtype: str = "fp32", gas: int = 1, optimizer: dict | None = None,
           **zero: Any) -> zerojax.Config:
    # run.non_finite: stop measures the ZeRO-3 floor itself: skipping non-finite steps (the default)
    # selects between the old and new optimizer state, which holds one more copy of its shards.
    raw: dict[str, Any] = {
        "train_batch_size": ROWS, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
        "optimizer": optimizer or ADAMW, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
        "run": {"non_finite": "stop"},
    }
    if dtype == "bf16":
        raw["bf16"] = {"enabled": True}
    return zerojax.load_config(raw)


def train(shape: str, stage: int, steps: int = 3, *, dtype: str = "fp32", gas: int = 1,
          optimizer: dict | None = None, **size: int) -> tuple[zerojax.Plan, Any]:
    params, loss_fn, make_batch = SHAPES[shape](**{"width": 64, "layers": 3, **size})
    cfg = config(stage, dtype=dtype, gas=gas, optimizer=optimizer)
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=data_mesh())
    for i in range(steps):
        engine.train_batch(make_batch(ROWS, i))
    return engine.plan, to_numpy(engine.params)


def sharded_leaves(plan: zerojax.Plan) -> int:
    return sum(isinstance(lay.param, Shard) for lay in jax.tree.leaves(plan.layouts, is_leaf=is_layout))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_stage3_trains_to_the_stage0_parameters(shape: str, optimizer: str) -> None:
    opt = {"sgd": SGD, "adamw": ADAMW}[optimizer]
    _, want = train(shape, 0, optimizer=opt)
    plan, got = train(shape, 3, gas=2, optimizer=opt)
    assert sharded_leaves(plan) >= 6  # the loss really ran on sharded parameters
    if optimizer == "sgd":
        assert_tree_close(got, want, rtol=1e-5, atol=1e-6, what=f"{shape} stage 3 vs 0")
    else:  # Adam turns rounding noise of near-zero gradients into +-lr steps: compare the update
        origin = to_numpy(SHAPES[shape](width=64, layers=3)[0])
        assert_relative_close(got, want, rel=1e-2, origin=origin, what=f"{shape} stage 3 vs 0")


def test_stage3_bf16_nnx_matches_stage0() -> None:
    _, want = train("nnx_scan", 0, dtype="bf16")
    _, got = train("nnx_scan", 3, dtype="bf16")
    assert_tree_close(got, want, rtol=2e-2, atol=2e-3, what="bf16 nnx stage 3 vs 0")


def compiled_step(shape: str, stage: int, *, layers: int = 8, width: int = 128, **zero: Any) -> tuple[Any, int, int]:
    """(compiled step, Ψ, layers) of a deeper model."""
    params, loss_fn, make_batch = SHAPES[shape](width=width, layers=layers)
    cfg = config(stage, **zero)
    plan = zerojax.plan(cfg, data_mesh(), params)
    state = zerojax.init_state(cfg, plan, params)
    step = zerojax.make_train_step(cfg, plan, loss_fn)
    psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(plan.abstract_params))
    return step.lower(state, make_batch(ROWS, 0)).compile(), psi, layers


@pytest.mark.parametrize("shape, overlap", [("nnx_scan", True), ("nnx_scan", False), ("lax_scan", True),
                                            ("loop", False)])
def test_stage3_holds_a_few_layers_and_reduce_scatters(shape: str, overlap: bool) -> None:
    compiled, psi, layers = compiled_step(shape, 3, overlap_comm=overlap)
    full_grads = 4 * psi
    temp = compiled.memory_analysis().temp_size_in_bytes
    # Whole-model gathering (the old behaviour) needs > 2x the fp32 gradients. ZeRO's schedule holds
    # at most three layers' weights whole (the layer computed, the one prefetched, and in the
    # backward pass that layer's full gradient until it is reduce-scattered; two without prefetch),
    # plus the gradient shards the step returns (1/8 of the gradients) and a little for the
    # activations of these 4 rows per device; one layer is ~1/8 of the gradients here.
    layer = full_grads / layers
    bound = (3 if overlap else 2) * layer + full_grads / 8 + 0.03 * full_grads
    assert temp < bound, f"temp {temp / layer:.2f} layers (bound {bound / layer:.2f})"
    found = hlo_collectives(compiled.as_text())
    reduced = sum(c.result_elems for c in found if c.kind == "all-reduce")
    assert reduced < 0.01 * psi, "stage 3 all-reduced gradients instead of reduce-scattering them"
    gathered = sum(c.elems_per_device for c in found if c.kind == "all-gather")
    scattered = sum(c.elems_per_device for c in found if c.kind == "reduce-scatter")
    ideal = psi * 7 / 8
    # forward + backward gathers and one reduce-scatter: 3Ψ (ZeRO paper), within 10%
    assert 1.9 * ideal <= gathered <= 2.2 * ideal and 0.95 * ideal <= scattered <= 1.1 * ideal
    if shape != "loop":
        bodies = while_bodies(compiled.as_text())
        in_loop = sum(c.elems_per_device for c in found if c.kind == "all-gather" and c.computation in bodies)
        assert in_loop >= 0.8 * gathered, "the scanned layers were not gathered inside the loop"


@pytest.mark.parametrize("shape", ["lax_scan", "nnx_scan"])
@pytest.mark.parametrize("overlap", [True, False])
def test_stage3_gathered_weights_at_the_peak_are_at_most_three_layers(shape: str, overlap: bool) -> None:
    """What XLA's buffer assignment holds at the step's peak: at most three layers' gathered weights
    and full gradients together with prefetch (two without), never one more layer's gather hoisted
    out of its loop (the backward pass's first layer, next to the forward pass, was one)."""
    from benchmarks.user_models import compile_with_peak, weight_shapes
    layers = 8
    params, loss_fn, make_batch = SHAPES[shape](width=128, layers=layers)
    cfg = config(3, overlap_comm=overlap)
    plan = zerojax.plan(cfg, data_mesh(), params)
    state = zerojax.init_state(cfg, plan, params)
    shapes = weight_shapes(params, zerojax.find_layer_axes(loss_fn, params, make_batch(ROWS, 0)))
    _, at_peak = compile_with_peak(zerojax.make_train_step(cfg, plan, loss_fn).lower(state, make_batch(ROWS, 0)), shapes)
    if not at_peak:
        pytest.skip("this XLA writes no live-range report")
    layer = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(plan.abstract_params)) / layers
    whole = (at_peak["gathered"] + at_peak["grads"]) / layer
    assert whole <= (3.0 if overlap else 2.0) + 0.05, f"{whole:.2f} layers whole at the peak"


def test_prefetch_gathers_the_next_layer_off_the_critical_path() -> None:
    """With overlap_comm, every gather inside the forward layer loop reads only the shards (no
    matmul before it in the iteration) and feeds only the loop carry (no matmul of the same
    iteration waits for it): it is layer i+1's gather, free to run during layer i's compute.
    Without it, the loop's gathers feed that iteration's matmuls (the backward loop likewise
    gathers the layer below ahead)."""
    def loop_gathers(overlap: bool) -> list[tuple[bool, bool]]:
        compiled, _, _ = compiled_step("lax_scan", 3, layers=4, overlap_comm=overlap)
        return [g for gs in gathers_in_loops(compiled.as_text()).values() for g in gs]

    ahead = loop_gathers(True)  # forward and backward loops
    assert ahead and not any(after for after, _ in ahead)
    assert not any(feeds for _, feeds in ahead), "a gather in a layer loop feeds its own iteration"
    in_place = loop_gathers(False)  # the weights' gathers feed their matmuls (a bias' may not)
    assert in_place and sum(feeds for _, feeds in in_place) > len(in_place) / 2


def test_prefetch_respects_the_live_parameter_limit() -> None:
    """stage3_max_live_parameters below two layers: no prefetch (the in-place schedule)."""
    small = compiled_step("lax_scan", 3, layers=4, stage3_max_live_parameters=40_000)[0]
    default = compiled_step("lax_scan", 3, layers=4)[0]
    off = compiled_step("lax_scan", 3, layers=4, overlap_comm=False)[0]
    assert small.as_text().count("all-gather(") == off.as_text().count("all-gather(")
    assert default.as_text().count("all-gather(") != off.as_text().count("all-gather(")


def test_stage0_of_the_same_model_needs_whole_gradients() -> None:
    """The yardstick of the test above: without ZeRO-3 the step's temp is > 1.5x the gradients."""
    compiled, psi, _ = compiled_step("lax_scan", 0)
    assert compiled.memory_analysis().temp_size_in_bytes > 1.5 * 4 * psi


# ------------------------------------------------------------------------------------------------
# The evaluator on control flow: gradients equal those of the plain loss.

def _shard_grad(loss: Callable[[Any, jax.Array], jax.Array], params: dict[str, jax.Array], x: jax.Array) -> Any:
    """Gradients of the global mean loss, with every parameter sharded on its last dim and gathered
    where it is used."""
    mesh = data_mesh()
    n = mesh.shape["data"]
    specs = {k: P(*([None] * (v.ndim - 1)), "data") for k, v in params.items()}
    fn = gather_at_use(loss)

    def local(p: dict[str, jax.Array], x: jax.Array) -> Any:
        return jax.grad(lambda p: fn({k: ParamShard(v, -1) for k, v in p.items()}, x) / n)(p)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs,
                                 check_vma=False))(params, x)


@jax.custom_vjp
def _scaled_tanh(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w)


def _scaled_tanh_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    y = jnp.tanh(x @ w)
    return y, (x, w, y)


def _scaled_tanh_bwd(res: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w, y = res
    d = g * (1 - y ** 2)
    return d @ w.T, x.T @ d


_scaled_tanh.defvjp(_scaled_tanh_fwd, _scaled_tanh_bwd)


def _control_flow_loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jax.jit(lambda h, w: jax.nn.relu(h @ w))(x, p["a"])                       # jit + custom_jvp
    h = jax.lax.cond(p["a"].sum() > 0, lambda h: h @ p["b"], lambda h: -(h @ p["b"]), h)  # a parameter predicate
    h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ p["c"]), h)               # scan (static trip)
    h = _scaled_tanh(h, p["d"])                                                     # custom_vjp
    h, _ = jax.lax.scan(lambda h, w: (jnp.sin(h @ w), None), h, p["stack"])        # stacked, no remat
    h = h @ (0.5 * p["b"]).T                                                        # a recipe chain
    return jnp.mean(h ** 2)


def test_control_flow_gradients_equal_the_plain_loss() -> None:
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)  # noqa: E731
    params = {"a": w(16, 16), "b": w(16, 16), "c": w(16, 16), "d": w(16, 16), "stack": w(3, 16, 16)}
    x = w(32, 16)
    want = jax.grad(_control_flow_loss)(params, x)
    got = _shard_grad(_control_flow_loss, params, x)
    assert_tree_close(to_numpy(got), to_numpy(want), rtol=1e-5, atol=1e-6, what="grad")


@jax.custom_jvp
def _tripled_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


_tripled_matmul.defjvp(lambda p, t: (p[0] @ p[1], 3 * (t[0] @ p[1] + p[0] @ t[1])))


def test_a_custom_jvp_reading_a_sharded_parameter_keeps_its_rule() -> None:
    """The parameter is gathered for the call and the call keeps its rule (a tripled gradient), as
    the plain loss differentiates it: the gradients' scale is the rule's, not the body's."""
    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return jnp.mean(_tripled_matmul(jnp.tanh(x), p["a"]) ** 2)

    params = {"a": jnp.asarray(np.random.default_rng(2).normal(size=(16, 16)) * 0.3, jnp.float32)}
    x = jnp.asarray(np.random.default_rng(3).normal(size=(32, 16)), jnp.float32)
    want = jax.grad(loss)(params, x)
    plain = jax.grad(lambda p, x: jnp.mean((jnp.tanh(x) @ p["a"]) ** 2))(params, x)["a"]
    np.testing.assert_allclose(want["a"], 3 * plain, rtol=1e-5, atol=1e-7)
    assert_tree_close(to_numpy(_shard_grad(loss, params, x)), to_numpy(want), rtol=1e-5, atol=1e-6, what="grad")


def test_while_loop_with_sharded_constants_evaluates() -> None:
    """`while` is not reverse-differentiable; its value still matches with gathered constants."""
    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        h = jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ p["w"]), c[1] + 1), (x, 0))[0]
        return jnp.mean(h)

    params = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(16, 16)) * 0.3, jnp.float32)}
    x = jnp.ones((32, 16))
    mesh = data_mesh()
    fn = gather_at_use(loss)
    value = jax.jit(jax.shard_map(
        lambda p, x: jax.lax.pmean(fn({"w": ParamShard(p["w"], -1)}, x), "data"), mesh=mesh,
        in_specs=({"w": P(None, "data")}, P("data")), out_specs=P(), check_vma=False))(params, x)
    np.testing.assert_allclose(value, loss(params, x), rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Built straight into shards (DeepSpeed's zero.Init).

def test_nnx_constructor_builds_the_same_model_sharded() -> None:
    eager, loss_fn, make_batch = SHAPES["nnx_scan"](width=64, layers=3)
    lazy, lazy_loss_fn, _ = SHAPES["nnx_scan"](width=64, layers=3, constructor=True)
    assert isinstance(lazy, zerojax.ParamsInit)
    cfg = config(3)
    engine = zerojax.initialize(cfg, params=lazy, loss_fn=lazy_loss_fn, mesh=data_mesh())
    assert_tree_close(to_numpy(engine.params), to_numpy(eager), rtol=0, atol=0, what="init")
    for leaf, lay in zip(jax.tree.leaves(engine.state.params), jax.tree.leaves(engine.plan.layouts, is_leaf=is_layout)):
        if isinstance(lay.param, Shard):
            assert leaf.addressable_shards[0].data.size * 8 == leaf.size  # 1/8 on each device
    before = float(engine.eval_batch(make_batch(ROWS, 99)))
    for i in range(3):
        engine.train_batch(make_batch(ROWS, i))
    assert float(engine.eval_batch(make_batch(ROWS, 99))) < before


def test_init_never_holds_the_whole_model() -> None:
    """The state constructor's compiled buffers stay far below one whole fp32 copy of the model."""
    from zerojax.core.state import _init_fn, key_data
    params, _, _ = SHAPES["nnx_scan"](width=256, layers=8, constructor=True)
    plan = zerojax.plan(config(3), data_mesh(), params)
    fn, args = _init_fn(plan, params, key_data(0))
    mem = fn.lower(*args).compile().memory_analysis()
    whole = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(plan.abstract_params))
    assert mem.output_size_in_bytes < 0.4 * whole  # fp32 master + Adam m, v: 3/8 of the model
    assert mem.temp_size_in_bytes < 0.4 * whole, f"temp {mem.temp_size_in_bytes / whole:.2f}x the model"


def test_init_params_of_a_plain_function() -> None:
    def init(key: jax.Array) -> dict[str, jax.Array]:
        k1, k2 = jax.random.split(key)
        return {"w": jax.random.normal(k1, (64, 32)) * 0.1, "layers": jax.random.normal(k2, (3, 32, 32)) * 0.1}

    def loss_fn(p: dict[str, jax.Array], batch: dict[str, Any]) -> jax.Array:
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch["x"] @ p["w"], p["layers"])
        return jnp.mean(h ** 2)

    lazy = zerojax.init_params(init, jax.random.key(0))
    assert jax.tree.map(lambda x: x.shape, lazy.abstract) == {"w": (64, 32), "layers": (3, 32, 32)}
    engine = zerojax.initialize(config(3), params=lazy, loss_fn=loss_fn, mesh=data_mesh())
    assert_tree_close(to_numpy(engine.params), to_numpy(init(jax.random.key(0))), rtol=1e-6, atol=1e-7, what="init")
    batch = {"x": np.random.default_rng(0).normal(size=(ROWS, 64)).astype(np.float32)}
    first = float(engine.train_batch(batch)["loss"])
    for _ in range(3):
        last = float(engine.train_batch(batch)["loss"])
    assert last < first


def test_find_layer_axes_reads_the_stacks_off_the_loss() -> None:
    params, loss_fn, make_batch = SHAPES["nnx_scan"](width=64, layers=3, constructor=True)
    axes = zerojax.find_layer_axes(loss_fn, params, make_batch(4, 0))
    assert axes["blocks"]["up"] == {"kernel": 1, "bias": 1} and axes["inp"] == {"kernel": 0, "bias": 0}
    params, loss_fn, make_batch = SHAPES["loop"](width=64, layers=2)
    assert set(jax.tree.leaves(zerojax.find_layer_axes(loss_fn, params, make_batch(4, 0)))) == {0}
    # A 64x128 layer (8192 elements) stays sharded under a 10000 threshold only when compared whole.
    params, loss_fn, make_batch = SHAPES["lax_scan"](width=64, layers=3)
    cfg = config(3, stage3_param_persistence_threshold=10_000)
    p = zerojax.plan(cfg, data_mesh(), params, layer_axes=zerojax.find_layer_axes(loss_fn, params, make_batch(4, 0)))
    assert not isinstance(p.layouts["layers"]["up"].param, Shard)
    assert isinstance(zerojax.plan(cfg, data_mesh(), params).layouts["layers"]["up"].param, Shard)
