"""Tensor slicing (Megatron) composed with ZeRO: the evaluator's collectives, equality with the
single-device run for the GPT, the Llama and an annotated Flax model, and the all-reduces the compiled
step holds against Megatron's count."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import zerojax
from helpers import assert_tree_close, to_numpy
from zerojax.measure import hlo
from zerojax.rewrite.tensor_slices import tensor_parallel, warn_fallbacks
from zerojax.errors import ConfigError
from zerojax.models import llama

ROWS, SEQ, VOCAB = 16, 16, 64
LLAMA = dict(name="llama", vocab_size=VOCAB, seq_len=SEQ, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96, n_layers=2)
GPT = dict(name="gpt", vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=4, d_ff=64, n_layers=2, tie_embeddings=False)


def mesh(tensor: int, data: int | None = None) -> Mesh:
    devices = np.array(jax.devices())
    data = data or len(devices) // tensor
    if tensor == 1:
        return Mesh(devices[:data], ("data",))
    return Mesh(devices[:data * tensor].reshape(data, tensor), ("data", "tensor"))


def batch(i: int) -> dict[str, np.ndarray]:
    return {"tokens": np.random.default_rng(7 + i).integers(0, VOCAB, size=(ROWS, SEQ + 1), dtype=np.int32)}


# -- the evaluator on its own ---------------------------------------------------------------------------

def _on_slices(loss_fn: Any, params: Any, dims: Any, x: Any, tensor: int = 2) -> tuple[Any, Any, dict, str]:
    """(loss, gradients, fallbacks, compiled HLO) of `loss_fn` evaluated on `dims`-split slices."""
    m = mesh(tensor, 8 // tensor)
    spec = jax.tree.map(lambda p, d: P(*[("tensor" if i == d else None) for i in range(p.ndim)]), params, dims,
                        is_leaf=lambda v: v is None)
    seen: list[dict] = []
    fn = tensor_parallel(loss_fn, dims, "tensor", tensor, report=seen.append)

    def local(p: Any, x: Any) -> Any:
        value, grads = jax.value_and_grad(lambda p: fn(p, x))(p)
        return jax.lax.pmean(value, "data"), jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads)

    step = jax.jit(jax.shard_map(local, mesh=m, in_specs=(spec, P("data")), out_specs=(P(), spec), check_vma=False))
    value, grads = step(params, x)
    return value, grads, seen[-1], step.lower(params, x).compile().as_text()


def _tensor_allreduce_elems(text: str, tensor: int = 2) -> list[int]:
    """Elements all-reduced over tensor groups, per execution (trip counts applied)."""
    groups = {tuple(range(i, i + tensor)) for i in range(0, 8, tensor)}
    return [c.result_elems for c in hlo.collectives(text) if c.kind == "all-reduce" and set(c.groups) == groups
            for _ in range(c.count)]


def mlp_loss(p: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu((x * p["s"]) @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"]) ** 2)


def mlp_params() -> dict:
    k = jax.random.split(jax.random.key(0), 2)
    return {"s": jnp.linspace(0.5, 1.5, 8), "w1": jax.random.normal(k[0], (8, 16)) * 0.3, "b1": jnp.full((16,), 0.1),
            "w2": jax.random.normal(k[1], (16, 8)) * 0.3, "b2": jnp.full((8,), -0.1)}


def test_a_column_row_pair_costs_one_all_reduce_each_way_and_equals_the_whole_loss() -> None:
    params, x = mlp_params(), jax.random.normal(jax.random.key(1), (8, 4, 8))
    want, want_g = jax.value_and_grad(mlp_loss)(params, x)
    value, grads, fallbacks, text = _on_slices(mlp_loss, params, {"s": None, "w1": 1, "b1": 0, "w2": 0, "b2": None}, x)
    assert fallbacks == {}
    np.testing.assert_allclose(value, want, rtol=1e-6)
    assert_tree_close(to_numpy(grads), to_numpy(want_g), rtol=1e-5, atol=1e-6, what="column -> row")
    # forward: the row kernel's partial sums; backward: the column kernel's input cotangent, which the
    # replicated scale `s` needs ([2 rows, 4, 8] each)
    assert _tensor_allreduce_elems(text) == [2 * 4 * 8, 2 * 4 * 8]


def test_any_split_gives_the_whole_gradients_and_what_needs_gathering_is_reported() -> None:
    params, x = mlp_params(), jax.random.normal(jax.random.key(1), (8, 4, 8))
    want_g = jax.grad(mlp_loss)(params, x)
    # rows first, then columns: still no gather (the contraction sums, the next kernel splits again)
    _, grads, fallbacks, _ = _on_slices(mlp_loss, params, {"s": None, "w1": 0, "b1": None, "w2": 1, "b2": 0}, x)
    assert fallbacks == {}
    assert_tree_close(to_numpy(grads), to_numpy(want_g), rtol=1e-5, atol=1e-6, what="rows first")

    def running(p: dict, x: jax.Array) -> jax.Array:  # a prefix sum along the split features
        return jnp.mean(jnp.cumsum(x @ p["w1"], axis=-1) ** 2)

    want_g = jax.grad(running)(params, x)
    _, grads, fallbacks, _ = _on_slices(running, params, {"s": None, "w1": 1, "b1": None, "w2": None, "b2": None}, x)
    assert fallbacks == {"cumsum": 1}
    assert_tree_close(to_numpy(grads), to_numpy(want_g), rtol=1e-5, atol=1e-6, what="gathered for cumsum")


def test_vocabulary_parallel_embedding_and_cross_entropy() -> None:
    def loss(p: dict, tokens: jax.Array) -> jax.Array:
        h = jnp.tanh(jnp.take(p["embed"], tokens[:, :-1], axis=0))
        logits = h @ p["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    k = jax.random.split(jax.random.key(2), 2)
    params = {"embed": jax.random.normal(k[0], (VOCAB, 8)), "head": jax.random.normal(k[1], (8, VOCAB))}
    tokens = jnp.asarray(batch(0)["tokens"][:8])
    want, want_g = jax.value_and_grad(loss)(params, tokens)
    value, grads, fallbacks, _ = _on_slices(loss, params, {"embed": 0, "head": 1}, tokens, tensor=4)
    assert fallbacks == {}
    np.testing.assert_allclose(value, want, rtol=1e-6)
    assert_tree_close(to_numpy(grads), to_numpy(want_g), rtol=1e-5, atol=1e-6, what="vocabulary parallel")


# -- composed with ZeRO, through initialize --------------------------------------------------------------

def _config(model: dict, stage: int, gas: int = 1, **extra: Any) -> zerojax.Config:
    return zerojax.load_config({"train_batch_size": ROWS, "gradient_accumulation_steps": gas,
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0,
                                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                                "model": model, **extra})


def _shipped(model: dict) -> tuple[Any, Any]:
    cfg = _config(model, 0)
    if model["name"] == "llama":
        return llama.build(cfg.model, seed=0)
    from zerojax.models import gpt
    return gpt.init_params(cfg.model, 0), gpt.make_loss_fn(cfg.model)


def _train(model: dict, stage: int, tensor: int, gas: int = 1, steps: int = 2) -> tuple[list[float], zerojax.Engine]:
    params, loss_fn = _shipped(model)
    engine = zerojax.initialize(_config(model, stage, gas), params=params, loss_fn=loss_fn,
                                mesh=mesh(tensor, 1 if tensor == 1 else None))
    return [float(engine.train_batch(batch(i))["loss"]) for i in range(steps)], engine


_REFERENCE: dict[str, Any] = {}


def _reference(model: dict) -> tuple[list[float], Any]:
    """The single-device run, once per model."""
    if model["name"] not in _REFERENCE:
        losses, engine = _train(model, 0, 1)
        _REFERENCE[model["name"]] = (losses, to_numpy(engine.params))
    return _REFERENCE[model["name"]]


GRID = [(model, stage, tensor) for model in (LLAMA, GPT) for tensor in (2, 4) for stage in (0, 1, 2, 3)]


@pytest.mark.parametrize("model,stage,tensor", GRID,
                         ids=[f"{m['name']}-z{z}-t{t}" for m, z, t in GRID])
def test_tensor_by_zero_equals_one_device(model: dict, stage: int, tensor: int) -> None:
    """Every tensor size x ZeRO stage the 8 devices allow (data 4 or 2), gradient accumulation at stage 2."""
    want_losses, want_params = _reference(model)
    losses, engine = _train(model, stage, tensor, gas=2 if stage == 2 else 1)
    assert engine.plan.sliced and engine.plan.tensor_size == tensor
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    assert_tree_close(to_numpy(engine.params), want_params, rtol=1e-4, atol=5e-5, what=f"stage {stage} x tensor {tensor}")


def test_the_shipped_models_split_as_megatron_does() -> None:
    _, engine = _train(LLAMA, 3, 2, steps=0)
    dims = engine.plan.tensor_dims
    layers = dims["layers"]
    assert [layers[k]["kernel"] for k in ("q", "k", "v", "gate", "up")] == [2] * 5  # [layer, in, out]: columns
    assert [layers[k]["kernel"] for k in ("o", "down")] == [1, 1]  # rows
    assert dims["embed"]["embedding"] == 0 and dims["head"]["kernel"] == 1  # vocabulary
    assert layers["attn_norm"]["scale"] is None
    # ZeRO shards another dimension of each split leaf
    assert str(engine.plan.param_shardings["layers"]["q"]["kernel"].spec) == str(P(None, "data", "tensor"))
    assert "layers.q.kernel" in engine.plan.tensor_plan and "column-parallel" in engine.plan.tensor_plan
    report = engine.memory_report()
    assert report.tensor_size == 2 and abs(report.params / report.formula_params - 1) < 0.1


def test_key_value_heads_stay_whole_when_the_tensor_size_does_not_divide_them() -> None:
    _, engine = _train(LLAMA, 0, 4, steps=0)  # 2 key/value heads, tensor 4
    layers = engine.plan.tensor_dims["layers"]
    assert layers["k"]["kernel"] is None and layers["v"]["kernel"] is None and layers["q"]["kernel"] == 2
    assert "2 heads not divisible by 4" in engine.plan.tensor_plan


def test_the_compiled_step_holds_megatrons_all_reduces() -> None:
    """Per layer two all-reduces of the activations forward and two backward (no remat here), plus the
    vocabulary-parallel embedding's forward sum and the head's input cotangent: nothing else of that size."""
    model = {**LLAMA, "remat": False}
    cfg = _config(model, 0)
    params, loss_fn = llama.build(cfg.model, seed=0)
    plan = zerojax.plan(cfg, mesh(2), params)
    state = zerojax.init_state(cfg, plan, params)
    text = zerojax.make_train_step(cfg, plan, loss_fn).lower(state, batch(0)).compile().as_text()
    rows = ROWS // plan.data_size
    activation = rows * SEQ * model["d_model"]
    sizes = [n for n in _tensor_allreduce_elems(text) if n >= activation]
    assert sum(sizes) == (4 * model["n_layers"] + 2) * activation, sizes
    # the comms logger names the axis each collective runs over
    report = hlo.comms_report(text, mesh=plan.mesh)
    assert "all-reduce (tensor)" in report and "all-reduce (data)" in report, report


def test_partition_activations_keeps_each_layers_input_split_and_changes_no_value() -> None:
    """DeepSpeed's activation_checkpointing.partition_activations with a tensor axis: what the remat'd
    layers keep is each device's half of their input, gathered back where they run."""
    want_losses, want_params = _reference(LLAMA)
    params, loss_fn = _shipped(LLAMA)
    cfg = _config(LLAMA, 3, activation_checkpointing={"partition_activations": True})
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=mesh(2))
    assert engine.plan.step.partition_activations
    losses = [float(engine.train_batch(batch(i))["loss"]) for i in range(2)]
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    assert_tree_close(to_numpy(engine.params), want_params, rtol=1e-4, atol=5e-5, what="partitioned activations")
    text = engine.train_step_fn.lower(engine.state, engine.place_batch(batch(0), ROWS)).compile().as_text()
    whole = ROWS // engine.plan.data_size * SEQ * LLAMA["d_model"]
    groups = {(0, 1), (2, 3), (4, 5), (6, 7)}
    gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather" and set(c.groups) == groups
               and c.result_elems == whole]
    # each layer's kept input, gathered in the forward pass and again in its recomputation
    assert sum(c.count for c in gathers) >= 2 * LLAMA["n_layers"], [c.line[:120] for c in gathers]


# -- a user's Flax model, split by its own annotations -----------------------------------------------------

D, HEADS = 32, 2


def part(init: Any, names: tuple) -> Any:
    return nnx.with_partitioning(init, names)


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        dense = nnx.initializers.xavier_uniform()
        self.attention = nnx.MultiHeadAttention(
            HEADS, D, qkv_features=D, decode=False, use_bias=False, rngs=rngs,
            kernel_init=part(dense, ("embed", "heads", "kv")), out_kernel_init=part(dense, ("heads", "kv", "embed")))
        self.up = nnx.Linear(D, 4 * D, kernel_init=part(dense, ("embed", "mlp")), bias_init=part(
            nnx.initializers.zeros, ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(4 * D, D, kernel_init=part(dense, ("mlp", "embed")), rngs=rngs)
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x), mask=mask, decode=False)
        return x + self.down(nnx.relu(self.up(self.norm2(x))))


class LM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=part(nnx.initializers.normal(0.02), ("vocab", "embed")),
                               rngs=rngs)
        self.blocks = nnx.List([Block(rngs=rngs) for _ in range(2)])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(x)


def lm_loss(model: LM, batch: dict) -> jax.Array:
    logits = model(batch["tokens"][:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["tokens"][:, 1:, None], -1))


RULES = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor", "embed": None}


def _train_lm(stage: int, tensor: int) -> tuple[list[float], zerojax.Engine]:
    params, loss_fn = zerojax.from_nnx(lambda: LM(rngs=nnx.Rngs(0)), lm_loss)
    cfg = _config({}, stage, mesh={"logical_axis_rules": RULES, "tensor": tensor})
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=mesh(tensor, 1 if tensor == 1 else None))
    return [float(engine.train_batch(batch(i))["loss"]) for i in range(2)], engine


_LM_REFERENCE: list[Any] = []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_annotated_flax_model_splits_by_its_logical_axes_and_equals_one_device(stage: int) -> None:
    if not _LM_REFERENCE:
        _LM_REFERENCE.extend(_train_lm(0, 1))
    want, reference = _LM_REFERENCE
    losses, engine = _train_lm(stage, 2)
    dims = engine.plan.tensor_dims
    assert dims["blocks"][0]["attention"]["query"]["kernel"] == 1 and dims["blocks"][0]["up"]["kernel"] == 1
    assert dims["blocks"][0]["down"]["kernel"] == 0 and dims["embed"]["embedding"] == 0
    assert "annotation 'heads'" in engine.plan.tensor_plan
    np.testing.assert_allclose(losses, want, rtol=2e-5)
    assert_tree_close(to_numpy(engine.params), to_numpy(reference.params), rtol=1e-4, atol=5e-5, what="annotated")


# -- the plan's other sources and its errors ---------------------------------------------------------------

def test_deepspeed_layer_specs_choose_the_split() -> None:
    params, _ = _shipped(LLAMA)
    cfg = _config(LLAMA, 0, tensor_parallel={"autotp_size": 2, "partition_config": {"layer_specs": [
        {"patterns": [r"\.up\.kernel$"], "partition_type": "column"},
        {"patterns": [r"\.down\.kernel$"], "partition_type": "row"},
        {"patterns": [r"\.q\.kernel$"], "partition_type": "skip"}]}})
    plan = zerojax.plan(cfg, mesh(2), params)
    layers = plan.tensor_dims["layers"]
    assert layers["up"]["kernel"] == 2 and layers["down"]["kernel"] == 1 and layers["q"]["kernel"] is None
    assert layers["gate"]["kernel"] == 2  # use_default_specs: the rest as Megatron's names say


def test_a_pattern_matching_nothing_is_one_error_naming_it() -> None:
    params, _ = _shipped(LLAMA)
    cfg = _config(LLAMA, 0, tensor_parallel={"autotp_size": 2, "partition_config": {"layer_specs": [
        {"patterns": [r"mlp\.c_fc"], "partition_type": "column"}]}})
    with pytest.raises(ConfigError, match=r"mlp\\\\.c_fc.*match no parameter"):
        zerojax.plan(cfg, mesh(2), params)


def test_a_split_the_tensor_size_does_not_divide_is_one_error_naming_the_leaf() -> None:
    params, _ = _shipped(LLAMA)
    cfg = _config(LLAMA, 0, mesh={"logical_axis_rules": {"x": "tensor"}},
                  tensor_parallel={"autotp_size": 4, "partition_config": {"layer_specs": [
                      {"patterns": [r"attn_norm"], "partition_type": "column"}]}})
    params = {**params.abstract, "layers": {**params.abstract["layers"],
                                            "attn_norm": {"scale": jax.ShapeDtypeStruct((2, 66), jnp.float32)}}}
    with pytest.raises(ConfigError, match=r"layers.attn_norm.scale \(2, 66\).*does not divide 66"):
        zerojax.plan(cfg, mesh(4), params)


# -- composed with pipeline stages ----------------------------------------------------------------------------

PIPELINE_GRID = [(GPT, stage, tensor) for tensor in (2, 4) for stage in (0, 1, 2, 3)] + [(LLAMA, 1, 2), (LLAMA, 3, 2)]


@pytest.mark.parametrize("model,stage,tensor", PIPELINE_GRID,
                         ids=[f"{m['name']}-z{z}-t{t}" for m, z, t in PIPELINE_GRID])
def test_tensor_by_pipeline_by_zero_equals_one_device(model: dict, stage: int, tensor: int, tmp_path: Any) -> None:
    """2 pipeline stages x (2 data x 2 tensor, or 1 data x 4 tensor): each stage row holds its tensor
    slice of every split weight, the stage's layers run on slices (the Llama's attention split by
    heads too), and two steps give the unpipelined model's."""
    from helpers import SGD, reference_run
    from zerojax.models import gpt

    cfg = _config(model, stage, gas=2, optimizer=SGD, gradient_clipping=0.05, mesh={"stage": 2, "tensor": tensor},
                  zero_allow_untested_optimizer=True, pipeline={"schedule": "1f1b"})
    if model["name"] == "llama":
        params, loss_fn = llama.build(cfg.model, seed=0)
        params, family = jax.tree.map(np.asarray, params.fn()), llama
    else:
        params, loss_fn, family = gpt.init_params(cfg.model, 0), gpt.make_loss_fn(cfg.model), gpt
    module = family.pipeline_module(cfg.model)
    devices = np.array(jax.devices()).reshape(2, 8 // (2 * tensor), tensor)
    engine = zerojax.initialize(cfg, model=module, params=family.pipeline_params(cfg.model, params),
                                mesh=Mesh(devices, ("stage", "data", "tensor")))
    rows = engine.pipeline.rows
    assert rows.tensor == tensor and engine.state.params["stages"].shape == (2, tensor, rows.width)
    assert "layer_01.up.kernel" in engine.plan.tensor_plan or "layer_01.fc.kernel" in engine.plan.tensor_plan
    data = [batch(i) for i in range(2)]
    metrics = [engine.train_batch(b) for b in data]
    # clipping is on (0.05, below the gradient norm): the norm counts the whole leaves that every
    # tensor slice's row holds a copy of once, as the unpipelined model's does
    ref = reference_run(engine.plan.tx, jnp.float32, loss_fn, params, data, 0.05)
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], [r["loss"] for r in ref], rtol=2e-5)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], [r["grad_norm"] for r in ref], rtol=2e-5)
    assert ref[0]["grad_norm"] > 0.05
    assert_tree_close(engine.params, family.pipeline_params(cfg.model, ref[-1]["master"]), rtol=1e-5, atol=1e-5,
                      what=f"pipeline x tensor, stage {stage}")
    # the saved rows export (and read back) as the logical model, tensor slices joined
    engine.save_checkpoint(str(tmp_path), async_save=False)
    out = zerojax.checkpoint.export_safetensors(tmp_path, None, tmp_path / "model.safetensors")
    assert_tree_close(zerojax.checkpoint.load_exported(out), to_numpy(engine.params), rtol=0, atol=0, what="export")
    read, _ = zerojax.checkpoint.read_params(tmp_path)
    assert_tree_close(read, to_numpy(engine.params), rtol=0, atol=0, what="read_params")


def test_3d_yaml_trains_like_the_plain_llama(tmp_path: Any) -> None:
    """The 3D config, verbatim with relative paths: tensor 2 x pipeline 2 x data 2 prints its plan, and its
    loss falls by as much as configs/llama.yaml's on the same data and steps."""
    import json
    from test_cli import run

    small = ["run.steps=8", "run.log_every=4", "steps_per_print=4", "model.d_model=64", "model.n_layers=2",
             "model.d_ff=128", "model.seq_len=32", "data.max_bytes=100000", "run.eval_batches=0",
             "run.progress=false", "run.sample_tokens=0", "scheduler.params.total_num_steps=8",
             "scheduler.params.warmup_num_steps=2"]
    losses = {}
    for name in ("3d", "llama"):
        out = tmp_path / name
        proc = run("train.py", "--config", f"configs/{name}.yaml", "--set", *small, f"run.output_dir={out}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records]
        if name == "3d":
            assert "mesh {'stage': 2, 'data': 2, 'tensor': 2}" in proc.stdout
            assert "column-parallel" in proc.stdout and "row-parallel" in proc.stdout
    drop = {name: ls[0] - ls[-1] for name, ls in losses.items()}  # the pipelined layers start from another init
    assert drop["3d"] > 0.5 and abs(drop["3d"] - drop["llama"]) < 0.2 * drop["llama"], losses


# -- pairs read off an unannotated loss ------------------------------------------------------------------

def test_the_pairs_read_off_the_loss_are_megatrons() -> None:
    abstract_batch = {"tokens": jax.ShapeDtypeStruct((4, SEQ + 1), jnp.int32)}
    params, loss_fn = _shipped(LLAMA)
    derived = zerojax.find_tensor_splits(loss_fn, params, abstract_batch, size=2)
    _, engine = _train(LLAMA, 0, 2, steps=0)
    named = engine.plan.tensor_dims
    for key in ("q", "k", "v", "o", "gate", "up", "down"):
        assert derived["layers"][key]["kernel"] == named["layers"][key]["kernel"], key
    assert derived["head"]["kernel"] == 1 and derived["layers"]["attn_norm"]["scale"] is None
    # 2 key/value heads over 4: attention cannot be split without gathering, so only the MLP pairs
    at4 = zerojax.find_tensor_splits(loss_fn, params, abstract_batch, size=4)["layers"]
    assert [at4[k]["kernel"] for k in ("q", "k", "v", "o", "gate", "up", "down")] == [None] * 4 + [2, 2, 1]
    mlp = zerojax.find_tensor_splits(mlp_loss, mlp_params(), jax.ShapeDtypeStruct((8, 4, 8), jnp.float32))
    assert mlp == {"s": None, "w1": 1, "b1": None, "w2": 0, "b2": None}


def test_an_unannotated_flax_model_trains_on_the_pairs_read_off_its_loss() -> None:
    """The Flax model above without using its annotations (no logical_axis_rules): its attention's
    [features, heads, head_dim] kernels split by heads and the MLP pair (the tied embedding, read
    transposed by `attend`, stays whole)."""
    if not _LM_REFERENCE:
        _LM_REFERENCE.extend(_train_lm(0, 1))
    want, reference = _LM_REFERENCE
    params, loss_fn = zerojax.from_nnx(lambda: LM(rngs=nnx.Rngs(0)), lm_loss)
    dims = zerojax.find_tensor_splits(loss_fn, params, batch(0), size=2)
    block = dims["blocks"][0]
    assert block["attention"]["query"]["kernel"] == 1 and block["attention"]["out"]["kernel"] == 0
    assert block["up"]["kernel"] == 1 and block["down"]["kernel"] == 0
    cfg = _config({}, 3, mesh={"tensor": 2})
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=mesh(2), tensor_dims=dims)
    assert "derived from the loss" in engine.plan.tensor_plan
    losses = [float(engine.train_batch(batch(i))["loss"]) for i in range(2)]
    np.testing.assert_allclose(losses, want, rtol=2e-5)
    assert_tree_close(to_numpy(engine.params), to_numpy(reference.params), rtol=1e-4, atol=5e-5, what="derived")


def test_config_explain_prints_the_tensor_plan() -> None:
    from test_cli import run
    proc = run("-m", "zerojax.cli", "config", "explain", "configs/llama.yaml", "--set", "mesh.tensor=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tensor parallel over 2 devices" in proc.stdout
    assert "layers.o.kernel" in proc.stdout and "row-parallel (input features)" in proc.stdout


def test_llama_factorys_autotp_config_trains_the_llama_on_two_way_tensor_slices() -> None:
    """LLaMA-Factory's ds_z2_autotp_config.json as it ships, the Trainer's "auto"s given as the Trainer
    fills them and its optimizer passed in code: ZeRO-2 over 4 data replicas of 2 tensor slices."""
    import optax
    from pathlib import Path
    path = Path(__file__).parent / "fixtures" / "ds_configs" / "llama_factory_ds_z2_autotp_config.json"
    cfg = zerojax.load_config(path, ["fp16.enabled=false", "bf16.enabled=false", "train_micro_batch_size_per_gpu=4",
                                     *(f"model.{k}={v}" for k, v in LLAMA.items())])
    params, loss_fn = llama.build(cfg.model, seed=0)
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, optimizer=optax.adamw(3e-3))
    assert dict(engine.mesh.shape) == {"data": 4, "tensor": 2} and engine.plan.stage == 2
    assert engine.plan.tensor_dims["layers"]["down"]["kernel"] == 1
    losses = [float(engine.train_batch(batch(0))["loss"]) for _ in range(4)]  # one batch: the loss falls
    assert losses[-1] < losses[0] - 0.1, losses


def test_a_pipelined_checkpoint_resumes_at_another_tensor_size(tmp_path: Any) -> None:
    """Rows saved at tensor 2 are cut into the logical model by the saved manifest and packed into the
    rows of tensor 1 and tensor 4 (parameters and Adam moments): the same model, the same next loss."""
    from zerojax.models import gpt

    def engine_at(tensor: int) -> zerojax.Engine:
        cfg = _config(GPT, 1, gas=2, mesh={"stage": 2, "tensor": tensor}, pipeline={"schedule": "1f1b"})
        devices = np.array(jax.devices()).reshape(2, 8 // (2 * tensor), tensor)
        axes = ("stage", "data", "tensor") if tensor > 1 else ("stage", "data")
        return zerojax.initialize(cfg, model=gpt.pipeline_module(cfg.model),
                                  mesh=Mesh(devices if tensor > 1 else devices[..., 0], axes))

    saved = engine_at(2)
    saved.train_batch(batch(0))
    saved.save_checkpoint(str(tmp_path), async_save=False)
    want = float(saved.train_batch(batch(1))["loss"])
    for tensor in (1, 4):
        engine = engine_at(tensor)
        engine.load_checkpoint(str(tmp_path))
        assert engine.global_steps == 1
        assert_tree_close(engine.params, zerojax.checkpoint.read_params(tmp_path)[0], rtol=0, atol=0,
                          what=f"tensor {tensor}")
        np.testing.assert_allclose(float(engine.train_batch(batch(1))["loss"]), want, rtol=2e-5)
        # the step after the restore used the restored Adam moments: the same update as the saver's
        # (Adam turns float noise in near-zero gradients into steps of up to ~lr/10; fresh moments: ~lr)
        assert_tree_close(engine.params, saved.params, rtol=1e-4, atol=1e-4, what=f"after a step at tensor {tensor}")


def test_a_custom_vjp_keeps_its_backward_rule_and_the_gather_is_logged(caplog: Any) -> None:
    """A straight-through estimator on split activations: its own backward (identity), not the
    derivative of its body (round: zero), and the evaluator says it gathered for it."""
    @jax.custom_vjp
    def straight_through(x: jax.Array) -> jax.Array:
        return jnp.round(x * 4) / 4

    straight_through.defvjp(lambda x: (straight_through(x), None), lambda _, ct: (ct,))

    def loss(p: dict, x: jax.Array) -> jax.Array:
        h = straight_through(x @ p["w1"])
        return jnp.mean((h @ p["w2"]) ** 2)

    params, x = mlp_params(), jax.random.normal(jax.random.key(1), (8, 4, 8))
    want_g = jax.grad(loss)(params, x)
    assert float(jnp.abs(want_g["w1"]).max()) > 0  # the rule passes gradients through the rounding
    _, grads, fallbacks, _ = _on_slices(loss, params, {"s": None, "w1": 1, "b1": None, "w2": 0, "b2": None}, x)
    assert fallbacks == {"custom_vjp_call": 1}
    with caplog.at_level("WARNING", logger="zerojax.rewrite.tensor_slices"):
        warn_fallbacks(fallbacks)  # what the step reports by default
    assert "1 equations ran on gathered activations (custom_vjp_call x1)" in caplog.text
    assert_tree_close(to_numpy(grads), to_numpy(want_g), rtol=1e-5, atol=1e-6, what="straight-through")


# -- custom derivative rules and the other higher-order primitives on split activations -----------------

@jax.custom_jvp
def _straight_through(x: jax.Array) -> jax.Array:
    return jnp.round(x * 4) / 4


_straight_through.defjvp(lambda p, t: (_straight_through(p[0]), t[0]))  # the rounding passes gradients as they are


@jax.custom_jvp
def _tripled_gradient(x: jax.Array) -> jax.Array:
    return x


_tripled_gradient.defjvp(lambda p, t: (p[0], 3 * t[0]))


@jax.custom_jvp
def _safe_sqrt(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.maximum(x, 0.0))  # its own derivative at x <= 0 is 0 * inf: NaN


@_safe_sqrt.defjvp
def _safe_sqrt_jvp(p: tuple, t: tuple) -> tuple:
    (x,), (dx,) = p, t
    y = _safe_sqrt(x)
    return y, jnp.where(x > 0, dx / (2 * jnp.where(x > 0, y, 1.0)), 0.0)


@jax.custom_jvp
def _shares(x: jax.Array) -> jax.Array:
    """Each feature's share of the row's total: a sum over the split features, then a halved gradient."""
    return x / jnp.sum(x, axis=-1, keepdims=True)


_shares.defjvp(lambda p, t: (_shares(p[0]), 0.5 * t[0] / jnp.sum(p[0], axis=-1, keepdims=True)))


@jax.custom_vjp
def _doubled_vjp(x: jax.Array) -> jax.Array:
    return jnp.tanh(x)


_doubled_vjp.defvjp(lambda x: (jnp.tanh(x), x), lambda x, ct: (2 * ct * (1 - jnp.tanh(x) ** 2),))


def _scan_square(h: jax.Array) -> jax.Array:
    return jax.lax.scan(lambda c, _: (jnp.tanh(c) * _tripled_gradient(c), None), h, None, length=2)[0]


def _while_square(h: jax.Array) -> jax.Array:
    return jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, jnp.tanh(s[1]) * s[1]), (0, h))[1]


# (the function of the column kernel's split activations, the equations run on gathered inputs)
BETWEEN = {
    "straight-through": (_straight_through, {}),
    "gradient-scaling": (_tripled_gradient, {}),
    "nan-safe-sqrt": (lambda h: _safe_sqrt(h - 0.2), {}),
    "needs-a-sum": (lambda h: _shares(jnp.exp(h)), {"custom_jvp_call": 1}),
    "custom-vjp": (_doubled_vjp, {"custom_vjp_call": 1}),
    "relu-softmax": (lambda h: jax.nn.softmax(jax.nn.relu(h).reshape(*h.shape[:-1], 4, 4), axis=-1).reshape(h.shape), {}),
    "jit": (jax.jit(lambda h: _straight_through(h) * h), {}),
    "remat": (jax.checkpoint(lambda h: _tripled_gradient(jnp.sin(h)) * h), {}),
    "cond": (lambda h: jax.lax.cond(h.shape[0] > 1, lambda v: _tripled_gradient(v) ** 2, jnp.tanh, h),
             {"cond": 1}),
    "cond-traced": (lambda h: jax.lax.cond(jnp.max(jnp.abs(h)) < 1e6, jnp.sin, lambda v: 3 * v, h), {"cond": 1}),
    "scan": (_scan_square, {}),
    # JAX differentiates no while loop: one that only computes a factor
    "while": (lambda h: h * _while_square(jax.lax.stop_gradient(h)), {"while": 1}),
}


@pytest.mark.parametrize("between", list(BETWEEN))
def test_derivative_rules_and_control_flow_between_a_pair_give_the_whole_gradients(between: str) -> None:
    """The gradients (their scale included) equal the one-device run's: a custom JVP's rule is applied
    to the blocks, or the call runs as written on gathered inputs and is reported; never its body's
    own derivative (zero through the rounding, unscaled, NaN at the root)."""
    fn, gathered = BETWEEN[between]

    def loss(p: dict, x: jax.Array) -> jax.Array:
        return jnp.mean((fn(x @ p["w1"]) @ p["w2"]) ** 2)

    params, x = mlp_params(), jax.random.normal(jax.random.key(1), (8, 4, 8))
    want, want_g = jax.value_and_grad(loss)(params, x)
    assert bool(jnp.all(jnp.isfinite(want_g["w1"]))) and float(jnp.abs(want_g["w1"]).max()) > 0
    value, grads, fallbacks, _ = _on_slices(loss, params, {"s": None, "w1": 1, "b1": None, "w2": 0, "b2": None}, x)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    assert_tree_close(to_numpy(grads), to_numpy(want_g), rtol=1e-5, atol=1e-6, what=between)
    assert fallbacks == gathered


def test_a_straight_through_estimator_trains_on_tensor_slices_as_on_one_device() -> None:
    """Through `initialize` with plain SGD (whose step is the gradient itself, scale included): the
    weights under the straight-through rounding move at tensor 2 as on one device."""
    def loss(p: dict, batch: dict) -> jax.Array:
        return jnp.mean((_straight_through(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2)

    params = {k: v for k, v in mlp_params().items() if k in ("w1", "w2")}
    data = {"x": np.asarray(jax.random.normal(jax.random.key(1), (8, 8))),
            "y": np.asarray(jax.random.normal(jax.random.key(2), (8, 8)))}
    runs = {}
    for tensor in (1, 2):
        cfg = zerojax.load_config({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                   "zero_optimization": {"stage": 0}, "mesh": {"tensor": tensor}})
        engine = zerojax.initialize(cfg, params=params, loss_fn=loss, mesh=mesh(tensor, 1),
                                    tensor_dims={"w1": 1, "w2": 0} if tensor > 1 else None)
        engine.train_batch(data)
        runs[tensor] = to_numpy(engine.params)
    moved = np.abs(runs[1]["w1"] - np.asarray(params["w1"])).max()
    assert moved > 1e-3  # the rule passes the gradient through the rounding
    assert_tree_close(runs[2], runs[1], rtol=1e-5, atol=1e-6, what="straight-through, SGD")
