"""The DeepSpeed-shaped engine: accessors, NNX bridge, logical params, eval."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax


class Net(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.a = nnx.Linear(16, 64, rngs=rngs)
        self.b = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))


def mse(model: Net, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]).astype(jnp.float32) - batch["y"]) ** 2)


def data(rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 16)).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, :4] * 2).astype(np.float32)}


DS_CONFIG = {"train_batch_size": 32, "gradient_accumulation_steps": 2,
             "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
             "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}


@pytest.fixture(scope="module")
def engine() -> zerojax.Engine:
    params, loss_fn = zerojax.from_nnx(Net(rngs=nnx.Rngs(0)), mse)
    return zerojax.initialize(DS_CONFIG, params=params, loss_fn=loss_fn)


def test_accessors(engine: zerojax.Engine) -> None:
    assert engine.train_batch_size() == 32
    assert engine.gradient_accumulation_steps() == 2
    assert engine.train_micro_batch_size_per_gpu() == 2  # 32 / (2 * 8)
    assert engine.zero_optimization_stage() == 2


def test_training_counts_steps_and_learns(engine: zerojax.Engine) -> None:
    start = engine.global_steps
    before = float(engine.eval_batch(data(64, 99)))
    for i in range(15):
        metrics = engine.train_batch(data(32, i))
    assert engine.global_steps == start + 15 and engine.skipped_steps == 0
    assert set(metrics) == {"loss", "grad_norm", "lr", "loss_scale", "skipped", "non_finite", "skipped_streak",
                            "micro_losses"}
    assert float(engine.eval_batch(data(64, 99))) < 0.7 * before


def test_params_are_logical_fp32_master(engine: zerojax.Engine) -> None:
    params = engine.params
    assert params["a"]["kernel"].shape == (16, 64) and params["a"]["kernel"].dtype == jnp.float32
    compute = engine.state.params["a"]["kernel"]
    assert compute.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(compute, np.float32), np.asarray(params["a"]["kernel"]),
                               rtol=1e-2, atol=1e-2)


def test_to_nnx_writes_trained_weights_back(engine: zerojax.Engine) -> None:
    model = Net(rngs=nnx.Rngs(0))
    zerojax.to_nnx(model, engine.params)
    np.testing.assert_array_equal(np.asarray(model.a.kernel[...]), np.asarray(engine.params["a"]["kernel"]))


def test_lr_follows_schedule() -> None:
    params, loss_fn = zerojax.from_nnx(Net(rngs=nnx.Rngs(0)), mse)
    cfg = dict(DS_CONFIG, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4,
                                                                    "warmup_type": "linear"}})
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn)
    lrs = [float(engine.train_batch(data(32, i))["lr"]) for i in range(6)]
    # DeepSpeed: the first two steps use warmup_min_lr (0), then t/W of the max, then the max.
    np.testing.assert_allclose(lrs, [0.0, 0.0, 2.5e-3, 5e-3, 7.5e-3, 1e-2], rtol=1e-6, atol=1e-9)


def test_initialize_needs_params_and_loss() -> None:
    with pytest.raises(TypeError, match="from_nnx"):
        zerojax.initialize(DS_CONFIG)


def test_wrong_batch_is_clear(engine: zerojax.Engine) -> None:
    with pytest.raises(ValueError, match="train_batch_size=32"):
        engine.train_batch(data(30, 0))
    with pytest.raises(ValueError, match="multiple of the data-parallel size 8"):
        engine.eval_batch(data(12, 0))


def test_custom_mesh_sets_data_parallel_size() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    params, loss_fn = zerojax.from_nnx(Net(rngs=nnx.Rngs(0)), mse)
    engine = zerojax.initialize(DS_CONFIG, params=params, loss_fn=loss_fn, mesh=mesh)
    assert engine.train_micro_batch_size_per_gpu() == 4  # 32 / (2 * 4)
    assert engine.plan.data_size == 4
    shards = {s.data.shape for x in jax.tree.leaves(engine.state.master) for s in x.addressable_shards}
    assert (4, 64) in shards  # the (16, 64) kernel split 4 ways along its rows


def test_to_nnx_from_a_constructor_runs_with_its_non_parameter_state() -> None:
    """An abstract module filled with parameters still needs real RNG keys and batch statistics."""
    class Net(nnx.Module):
        def __init__(self) -> None:
            rngs = nnx.Rngs(0)
            self.fc = nnx.Linear(4, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.drop(self.bn(self.fc(x)))

    ref = Net()
    params = jax.tree.map(lambda x: x + 1.0, nnx.to_pure_dict(nnx.state(ref, nnx.Param)))
    model = zerojax.to_nnx(Net, params)
    zerojax.to_nnx(ref, params)
    x = jnp.arange(8.0).reshape(2, 4)
    model.train()
    ref.train()
    np.testing.assert_allclose(model(x), ref(x), rtol=1e-6)   # dropout keys and statistics are real
    model.eval()
    ref.eval()
    np.testing.assert_allclose(model(x), ref(x), rtol=1e-6)


def test_layer_axes_reach_the_plan() -> None:
    """`initialize(..., layer_axes=...)` is `plan`'s argument: a stacked bias [8, 64] sharded along
    its layer axis when the axes are not known is split along its features once they are, and
    ZeRO-3 then compares the persistence threshold with one layer (64 elements, kept whole)."""
    rng = np.random.default_rng(0)
    params = {"layers": {"w": rng.normal(size=(8, 16, 16)).astype(np.float32) * 0.1,
                         "b": np.zeros((8, 64), np.float32)}}

    def loss_fn(params: dict, batch: dict) -> jax.Array:
        def body(h: jax.Array, layer: dict) -> tuple[jax.Array, None]:
            return jnp.tanh(h @ layer["w"] + layer["b"][:16]), None
        h, _ = jax.lax.scan(body, batch["x"], params["layers"])
        return jnp.mean((h[:, :4] - batch["y"]) ** 2)

    x = rng.normal(size=(32, 16)).astype(np.float32)
    batch = {"x": x, "y": np.tanh(1.5 * x[:, :4])}
    cfg = {**DS_CONFIG, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    guessed = zerojax.initialize(cfg, params=params, loss_fn=loss_fn)
    axes = zerojax.find_layer_axes(loss_fn, params, batch)
    assert axes == {"layers": {"w": 1, "b": 1}}
    told = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, layer_axes=axes)
    assert guessed.plan.layouts["layers"]["b"].param == zerojax.core.collectives.Shard(0)
    assert told.plan.layouts["layers"]["b"].param == zerojax.core.collectives.Shard(1)
    kept = {**cfg, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}
    assert zerojax.initialize(kept, params=params, loss_fn=loss_fn, layer_axes=axes).plan.layouts[
        "layers"]["b"].param == zerojax.core.collectives.REPLICATED
    curves = [[float(engine.train_batch(batch)["loss"]) for _ in range(3)] for engine in (guessed, told)]
    np.testing.assert_allclose(curves[0], curves[1], rtol=1e-5)   # a layout changes no result
    assert curves[0][-1] < curves[0][0]
    with pytest.raises(TypeError, match="drop layer_axes"):
        zerojax.initialize(cfg, model=object(), layer_axes=axes)
    with pytest.raises(ValueError, match=r"layer_axes=\{'stack': 1\}.*its top level: \['layers'\]"):
        zerojax.initialize(cfg, params=params, loss_fn=loss_fn, layer_axes={"stack": 1})


def test_compile_for_compiles_the_first_step_and_the_finite_check_with_the_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine(compile_for=batch) lowers the train step first and compiles it in a thread while the
    state initializes; the finiteness check that the trainer's guard and every save share (one program)
    compiles on a second thread from the start and is not waited for: the engine is built while it may
    still compile, and its first use waits for it. Nothing compiles twice or on the caller's thread
    after the engine is built."""
    import threading
    from jax import monitoring
    import zerojax.engine.engine as engine_module
    from zerojax.checkpoint import nonfinite_params
    from zerojax.core.nonfinite import NonFiniteGuard
    from zerojax.planner.mesh import make_mesh

    finite_lowered, built = threading.Event(), threading.Event()
    events: list[tuple[str, str, str]] = []  # (event, program, thread) in order

    def listen(event: str, secs: float, fun_name: str = "", **_) -> None:
        thread = threading.current_thread().name
        if thread.startswith("zerojax-compile") and fun_name == "jit(<lambda>)":
            built.wait(timeout=120)  # an engine that waited for this compile would stall here
        events.append((event.rsplit("/", 1)[-1], fun_name, thread))
        if event.endswith("jaxpr_to_mlir_module_duration") and fun_name == "jit(<lambda>)":
            finite_lowered.set()

    real_init = engine_module.init_state

    def init_state(*args, **kwargs):
        assert finite_lowered.wait(timeout=60), "the finiteness check did not start before the state's init"
        return real_init(*args, **kwargs)

    monkeypatch.setattr(engine_module, "init_state", init_state)
    params, loss_fn = zerojax.from_nnx(Net(rngs=nnx.Rngs(1)), mse)
    config = zerojax.load_config({**DS_CONFIG, "zero_optimization": {"stage": 3}})
    monitoring.register_event_duration_secs_listener(listen)
    try:
        engine = zerojax.Engine(config, params, loss_fn, make_mesh(config), compile_for=data(32, 0))
        at_build = len(events)
        built.set()
        metrics = engine.train_batch(data(32, 1))
        assert NonFiniteGuard(engine).problem(saving=True) is None
        assert nonfinite_params(engine.state, engine.plan) == []
        assert np.isfinite(float(metrics["loss"]))
    finally:
        monitoring.unregister_event_duration_listener(listen)
    compiles = [(name, thread) for event, name, thread in events if event == "backend_compile_duration"]
    names = [name for name, _ in compiles]
    assert [names.count(name) for name in ("jit(init)", "jit(step)", "jit(<lambda>)")] == [1, 1, 1], compiles
    assert ("jit(<lambda>)", "zerojax-compile_0") in compiles and ("jit(step)", "zerojax-compile_1") in compiles
    # only XLA's compiles leave the caller's thread: every trace and lowering is Python, made on it
    assert [e for e in events if e[2] != "MainThread" and e[0].startswith("jaxpr_")] == []
    # the step was lowered before the state's program was traced (one thread, in that order)
    order = [(event, name) for event, name, thread in events if thread == "MainThread"]
    assert order.index(("jaxpr_to_mlir_module_duration", "jit(step)")) < order.index(("jaxpr_trace_duration", "init"))
    # after the engine is built: the finiteness check's compile (on its thread), nothing on the caller's
    assert [c for c in events[at_build:] if c[0] == "backend_compile_duration"] == [
        ("backend_compile_duration", "jit(<lambda>)", "zerojax-compile_0")], events[at_build:]


def test_first_step_hands_the_compilers_memory_back_and_compiles_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step is compiled before its first call runs and the compiler's freed heap is returned
    then (once per step, not per call), so the step's buffers do not stack on it in the host's
    peak; later calls reuse the same executable (no second compile of the step)."""
    import zerojax.engine.engine as engine_module
    released: list[int] = []
    monkeypatch.setattr(engine_module, "release_freed_heap", lambda: released.append(1), raising=False)
    params, loss_fn = zerojax.from_nnx(Net(rngs=nnx.Rngs(0)), mse)
    engine = zerojax.initialize(DS_CONFIG, params=params, loss_fn=loss_fn)
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_kw: compiles.append(event) if event == "/jax/compilation_cache/compile_time_saved_sec"
        or event == "/jax/core/compile/backend_compile_duration" else None)
    engine.train_batch(data(32, 0))
    assert released == [1]
    first = len(compiles)
    assert first > 0  # the listener sees compiles
    for i in range(1, 3):
        engine.train_batch(data(32, i))
    assert released == [1] and len(compiles) == first
