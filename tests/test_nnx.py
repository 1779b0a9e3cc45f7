"""A Flax model written the way the Flax examples write one, trained with no glue.

`LM` follows the style of flax's `examples/lm1b_nnx` TransformerLM (written here, not copied): kernels
annotated with `nnx.with_partitioning` logical axes, an `nnx.MultiHeadAttention` with its `decode`
attribute, Dropout holding the `nnx.Rngs` it was built with, and the embedding reused as the output
layer. (Attention without biases: a key bias has no effect on softmax attention, so its gradient is
rounding noise that Adam would amplify into different values at every stage.) No `jax.set_mesh`, no wrapper: `from_nnx` and `initialize` take it as it is.
"""
from __future__ import annotations

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zerojax
from helpers import assert_tree_close, data_mesh, to_numpy
from zerojax.core.collectives import Shard

VOCAB, D, HEADS, LAYERS, SEQ = 64, 32, 2, 2, 8


def part(init, names):
    return nnx.with_partitioning(init, names)


class Block(nnx.Module):
    def __init__(self, dropout: float, *, rngs: nnx.Rngs):
        dense = nnx.initializers.xavier_uniform()
        self.attention = nnx.MultiHeadAttention(
            HEADS, D, qkv_features=D, decode=False, dropout_rate=0.0, use_bias=False, rngs=rngs,
            kernel_init=part(dense, ("embed", "heads", "kv")), out_kernel_init=part(dense, ("heads", "kv", "embed")))
        self.up = nnx.Linear(D, 4 * D, kernel_init=part(dense, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(4 * D, D, kernel_init=part(dense, ("mlp", "embed")), rngs=rngs)
        self.norm1 = nnx.LayerNorm(D, scale_init=part(nnx.initializers.ones, ("embed",)), rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, scale_init=part(nnx.initializers.ones, ("embed",)), rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.dropout(self.attention(self.norm1(x), mask=mask, decode=False))
        return x + self.dropout(self.down(nnx.relu(self.up(self.norm2(x)))))


class LM(nnx.Module):
    def __init__(self, dropout: float = 0.1, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=part(nnx.initializers.normal(0.02), ("vocab", "embed")),
                               rngs=rngs)
        self.blocks = nnx.List([Block(dropout, rngs=rngs) for _ in range(LAYERS)])
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.dropout(self.embed(tokens))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(x)


def loss(model: LM, batch: dict) -> jax.Array:
    logits = model(batch["tokens"][:, :-1])
    labels = batch["tokens"][:, 1:]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))


def config(stage: int, **extra) -> dict:
    return {"train_batch_size": 16, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "gradient_clipping": 1.0, **extra}


def batches(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, size=(16, SEQ + 1)).astype(np.int32)} for _ in range(n)]


def train(stage: int, steps: int, dropout: float = 0.1, model_loss=loss) -> tuple[list[float], zerojax.Engine]:
    params, loss_fn = zerojax.from_nnx(lambda: LM(dropout, rngs=nnx.Rngs(0)), model_loss)
    engine = zerojax.initialize(config(stage), params=params, loss_fn=loss_fn, mesh=data_mesh())
    return [float(engine.train_batch(b)["loss"]) for b in batches(steps)], engine


def test_annotated_model_needs_no_mesh_context_and_keeps_its_annotations() -> None:
    params, loss_fn = zerojax.from_nnx(lambda: LM(rngs=nnx.Rngs(0)), loss)
    assert loss_fn.logical_axes["embed"]["embedding"] == ("vocab", "embed")
    assert loss_fn.logical_axes["blocks"][0]["up"]["kernel"] == ("embed", "mlp")
    assert loss_fn.logical_axes["blocks"][0]["up"]["bias"] is None
    plan = zerojax.plan(config(3), data_mesh(), params)
    assert plan.layouts["blocks"][0]["up"]["kernel"].names == ("embed", "mlp")
    note = plan.annotations()
    assert note.startswith("model annotations: ") and "embed, heads, kv, mlp, vocab" in note
    assert "none names an axis of this mesh (data)" in note


def test_an_annotation_naming_the_data_axis_is_honoured() -> None:
    """A kernel annotated ("embed", "data") is sharded along its second dimension, where ZeRO's own rule
    would pick the first."""
    class Tiny(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.a = nnx.Linear(16, 32, kernel_init=part(nnx.initializers.lecun_normal(), ("embed", "data")), rngs=rngs)
            self.b = nnx.Linear(16, 32, rngs=rngs)

    params, _ = zerojax.from_nnx(lambda: Tiny(nnx.Rngs(0)), lambda m, b: 0.0)
    plan = zerojax.plan(config(3), data_mesh(), params)
    assert plan.layouts["a"]["kernel"].param == Shard(1)
    assert plan.layouts["b"]["kernel"].param == Shard(0)
    assert "follows the ones naming mesh axes (data)" in plan.annotations()


def test_stage_3_equals_stage_0_with_dropout() -> None:
    """Dropout 0.1 draws the same masks at every stage: the keys follow the data shard and micro-batch."""
    l0, e0 = train(0, 3)
    l3, e3 = train(3, 3)
    np.testing.assert_allclose(l3, l0, rtol=2e-5)
    assert_tree_close(to_numpy(e3.params), to_numpy(e0.params), rtol=1e-4, atol=1e-6, what="dropout 0.1")


def test_dropout_masks_change_every_step_and_are_off_in_evaluation() -> None:
    """Same batch, same parameters: a different loss on each step's draw, one deterministic eval loss."""
    params, loss_fn = zerojax.from_nnx(lambda: LM(0.5, rngs=nnx.Rngs(0)), loss)
    plan = zerojax.plan(config(0, optimizer={"type": "SGD", "params": {"lr": 0.0}}, zero_allow_untested_optimizer=True),
                        data_mesh(), params)
    state = zerojax.init_state(plan, params)
    step = zerojax.make_train_step(plan, loss_fn)
    batch = batches(1)[0]
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert len(set(losses)) == 3, losses
    evaluate = zerojax.make_eval_step(plan, loss_fn)
    assert float(evaluate(state.params, batch)) == float(evaluate(state.params, batch))
    assert float(evaluate(state.params, batch)) not in losses


def test_a_resumed_run_draws_the_masks_an_uninterrupted_one_draws(tmp_path) -> None:
    full, engine = train(3, 4)
    params, loss_fn = zerojax.from_nnx(lambda: LM(0.1, rngs=nnx.Rngs(0)), loss)
    first = zerojax.initialize(config(3), params=params, loss_fn=loss_fn, mesh=data_mesh())
    for b in batches(2):
        first.train_batch(b)
    first.save_checkpoint(str(tmp_path))
    first.wait_for_checkpoint()
    resumed = zerojax.initialize(config(3), params=params, loss_fn=loss_fn, mesh=data_mesh())
    resumed.load_checkpoint(str(tmp_path))
    rest = [float(resumed.train_batch(b)["loss"]) for b in batches(4)[2:]]
    np.testing.assert_allclose(rest, full[2:], rtol=1e-6)
    assert_tree_close(to_numpy(resumed.params), to_numpy(engine.params), rtol=1e-6, atol=1e-7, what="resumed")


def test_a_loss_taking_rngs_gets_fresh_keys() -> None:
    """`loss(model, batch, rngs)`: the keys come from the step, so the noise differs per step."""
    def noisy(model: LM, batch: dict, rngs: nnx.Rngs) -> jax.Array:
        return loss(model, batch) + 0.1 * jax.random.normal(rngs.noise(), ())

    losses, _ = train(0, 3, dropout=0.0, model_loss=noisy)
    plain, _ = train(0, 3, dropout=0.0)
    assert abs(losses[0] - plain[0]) > 1e-6 and len(set(np.round(np.subtract(losses, plain), 6))) == 3


# ------------------------------------------------------------------------------------------------
# Written as flax's own NNX examples write it (lm1b_nnx): one two-name annotation, ("embed", "kv"), for
# every attention kernel, whether (in, heads, head_dim) or (heads, head_dim, out). JAX reads a shorter
# PartitionSpec as unnamed trailing dimensions; so does the plan.

class ExampleBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        dense = nnx.initializers.xavier_uniform()
        self.attention = nnx.MultiHeadAttention(HEADS, D, qkv_features=D, decode=False, use_bias=False, rngs=rngs,
                                                kernel_init=part(dense, ("embed", "kv")))
        self.up = nnx.Linear(D, 4 * D, kernel_init=part(dense, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(4 * D, D, kernel_init=part(dense, ("mlp", "embed")), rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm(x), mask=mask, decode=False)
        return x + self.down(nnx.relu(self.up(x)))


class ExampleLM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=part(nnx.initializers.normal(0.02), ("vocab", "embed")),
                               rngs=rngs)
        self.blocks = nnx.List([ExampleBlock(rngs=rngs) for _ in range(LAYERS)])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, nnx.make_causal_mask(tokens))
        return self.embed.attend(x)


def one_device_sgd(make, model_loss, batches_: list[dict], lr: float) -> tuple[list[float], nnx.Module]:
    """The plain Flax NNX loop on one device: nnx.Optimizer over optax.sgd."""
    import optax
    with nnx.use_eager_sharding(False):  # annotated, built without a mesh (one device)
        model = make()
    optimizer = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(model_loss)(model, batch)
        optimizer.update(model, grads)
        return value

    with jax.default_device(jax.devices()[0]):
        losses = [float(train_step(model, optimizer, jax.tree.map(jnp.asarray, b))) for b in batches_]
    return losses, model


def sgd_config(stage: int, **extra) -> dict:
    return {"train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def test_a_two_name_annotation_on_a_three_dimensional_kernel_names_its_leading_dimensions() -> None:
    params, loss_fn = zerojax.from_nnx(lambda: ExampleLM(rngs=nnx.Rngs(0)), loss)
    query = params.abstract["blocks"][0]["attention"]["query"]["kernel"]
    assert query.shape == (D, HEADS, D // HEADS)
    assert loss_fn.logical_axes["blocks"][0]["attention"]["query"]["kernel"] == ("embed", "kv")
    plan = zerojax.plan(sgd_config(3), data_mesh(), params)
    assert plan.layouts["blocks"][0]["attention"]["query"]["kernel"].names == ("embed", "kv", None)
    assert plan.layouts["blocks"][0]["attention"]["out"]["kernel"].names == ("embed", "kv", None)
    with np.testing.assert_raises_regex(ValueError, r"names 4 dimensions .* name at most 3"):
        zerojax.plan(sgd_config(3), data_mesh(), params, logical_axes=jax.tree.map(
            lambda x: ("a", "b", "c", "d") if x.ndim == 3 else None, params.abstract))


@pytest.mark.parametrize("mesh", [{"data": 8}, {"data": 4, "tensor": 2}])
def test_a_flax_example_model_trains_at_zero3_as_on_one_device(mesh: dict) -> None:
    make = lambda: ExampleLM(rngs=nnx.Rngs(0))  # noqa: E731
    data = batches(3)
    want_losses, want = one_device_sgd(make, loss, data, lr=0.1)
    params, loss_fn = zerojax.from_nnx(make, loss)
    cfg = sgd_config(3, mesh={**mesh, "logical_axis_rules": {"kv": "tensor", "mlp": "tensor"}})
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn)
    if "tensor" in mesh:
        assert engine.plan.tensor_dims["blocks"][0]["attention"]["query"]["kernel"] == 1  # heads, named "kv"
    losses = [float(engine.train_batch(b)["loss"]) for b in data]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_tree_close(to_numpy(engine.params), to_numpy(nnx.to_pure_dict(nnx.state(want, nnx.Param))),
                      rtol=1e-4, atol=1e-6, what=f"{mesh} vs one device")


# ------------------------------------------------------------------------------------------------
# BatchNorm's running statistics (nnx.BatchStat): the step's model state, updated as Flax's own loop
# updates them. The CNN is the Flax MNIST guide's, smaller.

class CNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(4, rngs=rngs)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(8, rngs=rngs)
        self.linear = nnx.Linear(8 * 2 * 2, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(nnx.relu(self.bn1(self.conv1(x))), window_shape=(2, 2), strides=(2, 2))
        x = nnx.avg_pool(nnx.relu(self.bn2(self.conv2(x))), window_shape=(2, 2), strides=(2, 2))
        return self.linear(x.reshape(x.shape[0], -1))


def cnn_loss(model: CNN, batch: dict) -> jax.Array:
    logits = model(batch["image"])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["label"][:, None], -1))


def images(n: int) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"image": (rng.normal(size=(16, 8, 8, 1)) + 0.5).astype(np.float32),
             "label": rng.integers(0, 10, size=16).astype(np.int32)} for _ in range(n)]


def pure(model: nnx.Module, kind: type) -> dict:
    return to_numpy(nnx.to_pure_dict(nnx.state(model, kind)))


@pytest.mark.parametrize("stage", [0, 3])
def test_batch_norm_statistics_update_as_in_a_one_device_flax_loop(stage: int, tmp_path) -> None:
    make = lambda: CNN(rngs=nnx.Rngs(0))  # noqa: E731
    data = images(3)
    want_losses, want = one_device_sgd(make, cnn_loss, data, lr=0.1)
    params, loss_fn = zerojax.from_nnx(make, cnn_loss)
    engine = zerojax.initialize(sgd_config(stage), params=params, loss_fn=loss_fn, mesh=data_mesh())
    losses = [float(engine.train_batch(b)["loss"]) for b in data]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)  # normalised by the whole batch's statistics
    start = pure(make(), nnx.BatchStat)
    assert engine.state.model_state["bn1"]["mean"].sharding.is_fully_replicated
    assert_tree_close(to_numpy(engine.params), pure(want, nnx.Param), rtol=1e-4, atol=1e-6, what="params")
    assert_tree_close(to_numpy(engine.model_state), pure(want, nnx.BatchStat), rtol=1e-4, atol=1e-6, what="stats")
    assert np.abs(to_numpy(engine.model_state)["bn2"]["var"] - start["bn2"]["var"]).max() > 1e-2  # they moved
    # evaluation reads the trained statistics, as the one-device model in eval mode does
    want.eval()
    test = images(4)[3]
    np.testing.assert_allclose(float(engine.eval_batch(test)), float(cnn_loss(want, test)), rtol=1e-5)
    # written back by to_nnx, and kept by a checkpoint
    back = zerojax.to_nnx(make, engine.state)
    assert_tree_close(pure(back, nnx.BatchStat), pure(want, nnx.BatchStat), rtol=1e-4, atol=1e-6, what="to_nnx")
    engine.save_checkpoint(str(tmp_path))
    engine.wait_for_checkpoint()
    fresh = zerojax.initialize(sgd_config(stage), params=params, loss_fn=loss_fn, mesh=data_mesh())
    fresh.load_checkpoint(str(tmp_path), load_module_only=True)
    assert_tree_close(to_numpy(fresh.model_state), to_numpy(engine.model_state), rtol=0, atol=0, what="restored")


def test_to_nnx_takes_the_train_state_of_an_fp32_run() -> None:
    """fp32: the parameters are their own master copy, so `state.master` is None; the state itself works."""
    make = lambda: CNN(rngs=nnx.Rngs(0))  # noqa: E731
    params, loss_fn = zerojax.from_nnx(make, cnn_loss)
    plan = zerojax.plan(sgd_config(3), data_mesh(), params)
    state = zerojax.init_state(plan, params)
    assert state.master is None
    with pytest.raises(TypeError, match=r"pass the state itself, to_nnx\(model, state\)"):
        zerojax.to_nnx(make, state.master)
    with pytest.raises(ValueError, match=r"to_nnx: params do not match .*missing \['bn1.bias', 'bn1.scale'\]"):
        zerojax.to_nnx(make, {k: v for k, v in state.params.items() if k != "bn1"})
    model = zerojax.to_nnx(make, state)
    assert_tree_close(pure(model, nnx.Param), to_numpy(state.params), rtol=0, atol=0, what="params")
    assert_tree_close(pure(model, nnx.BatchStat), to_numpy(state.model_state), rtol=0, atol=0, what="stats")


def test_batch_statistics_without_the_plan_knowing_them_are_refused() -> None:
    """A built module's params are a plain dict: the plan must be told of the statistics."""
    params, loss_fn = zerojax.from_nnx(CNN(rngs=nnx.Rngs(0)), cnn_loss)
    plan = zerojax.plan(sgd_config(0), data_mesh(), params)
    with pytest.raises(ValueError, match=r"model_state=loss_fn.model_state"):
        zerojax.make_train_step(plan, loss_fn)
    plan = zerojax.plan(sgd_config(0), data_mesh(), params, model_state=loss_fn.model_state)
    state = zerojax.init_state(plan, params)
    evaluate = zerojax.make_eval_step(plan, loss_fn)
    with pytest.raises(ValueError, match=r"eval_step\(state.params, batch, state.model_state\)"):
        evaluate(state.params, images(1)[0])
    with pytest.raises(ValueError, match="takes no `model_state`"):
        zerojax.make_train_step(plan, lambda p, b: 0.0)


def test_a_loss_assigning_to_another_variable_is_refused_by_name() -> None:
    class Counter(nnx.Variable):
        pass

    class Counting(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)
            self.calls = Counter(jnp.zeros(()))

        def __call__(self, x: jax.Array) -> jax.Array:
            self.calls[...] = self.calls[...] + 1
            return self.fc(x)

    params, loss_fn = zerojax.from_nnx(lambda: Counting(nnx.Rngs(0)), lambda m, b: jnp.mean(m(b["x"]) ** 2))
    plan = zerojax.plan(sgd_config(0), data_mesh(), params)
    step = zerojax.make_train_step(plan, loss_fn)
    with pytest.raises(ValueError, match=r"assigns to calls, a Variable.*declare it as nnx.BatchStat"):
        step(zerojax.init_state(plan, params), {"x": np.ones((16, 4), np.float32)})
