"""LoRA (`lora` section): adapters on the shipped models' projections, the base frozen. Training at every
ZeRO stage and with the tensor axis equals a one-device optax run that trains only the adapters; the
base stays bit-identical; generation runs base plus adapter; the refusals name their key."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import zerojax
from zerojax.errors import ConfigError
from zerojax.models import gpt, llama, lora
from zerojax.models.decode import decoder

sys.path.insert(0, str(Path(__file__).parent))
import helpers as h  # noqa: E402

ROWS, SEQ, VOCAB = 8, 8, 64
LLAMA = dict(name="llama", vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2,
             remat=False)
GPT = dict(name="gpt", vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=4, d_ff=64, n_layers=2, tie_embeddings=False)
LORA = {"enabled": True, "lora_r": 4, "lora_alpha": 8}


def config(model: dict, stage: int = 0, lora_section: dict | None = None, **extra: Any) -> zerojax.Config:
    return zerojax.load_config({"train_batch_size": ROWS, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                "gradient_clipping": 1.0,
                                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                                "model": model, "lora": LORA if lora_section is None else lora_section, **extra})


def batch(i: int) -> dict[str, np.ndarray]:
    return {"tokens": np.random.default_rng(3 + i).integers(0, VOCAB, size=(ROWS, SEQ + 1), dtype=np.int32)}


def mesh(tensor: int) -> Mesh:
    devices = np.array(jax.devices())
    if tensor == 1:
        return Mesh(devices, ("data",))
    return Mesh(devices.reshape(-1, tensor), ("data", "tensor"))


def start(cfg: zerojax.Config) -> dict[str, Any]:
    """The adapted Llama's parameters with every B non-zero, so the first step trains A too."""
    params = nnx.to_pure_dict(nnx.state(llama.constructor(cfg.model)(), nnx.Param))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: np.asarray(x) + (0.05 if str(p[-1].key) == "lora_b" else 0.0), params)


def adapters_mask(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(lambda p, _: lora.is_adapter([str(k.key) for k in p]), params)


_REFERENCE: dict[str, Any] = {}


def reference(cfg: zerojax.Config, tx: optax.GradientTransformation, params: Any) -> list[dict]:
    """One device, plain optax: the base's gradients stopped and its updates zeroed (optax.masked)."""
    if "run" not in _REFERENCE:
        mask = adapters_mask(params)
        loss_fn = llama.build(cfg.model)[1]

        def loss(p: Any, b: Any) -> jax.Array:
            return loss_fn(jax.tree.map(lambda x, t: x if t else jax.lax.stop_gradient(x), p, mask), b)

        ref_tx = optax.chain(optax.masked(tx, mask), optax.masked(optax.set_to_zero(), jax.tree.map(lambda t: not t, mask)))
        _REFERENCE["run"] = h.reference_run(ref_tx, jnp.float32, loss, params, [batch(i) for i in range(3)], clip=1.0)
    return _REFERENCE["run"]


GRID = [(0, 1), (1, 1), (2, 1), (3, 1), (3, 2)]


@pytest.mark.parametrize("stage,tensor", GRID, ids=[f"z{z}-t{t}" for z, t in GRID])
def test_lora_training_equals_one_device_optax(stage: int, tensor: int) -> None:
    cfg = config(LLAMA, stage)
    params = start(cfg)
    engine = zerojax.initialize(cfg, params=params, loss_fn=llama.build(cfg.model)[1], mesh=mesh(tensor))
    metrics = [jax.device_get(engine.train_batch(batch(i))) for i in range(3)]
    ref = reference(cfg, engine.plan.tx, params)
    got = h.to_numpy(engine.params)
    h.assert_tree_close(got, ref[-1]["master"], rtol=2e-4, atol=2e-5, what=f"stage {stage} x tensor {tensor}")
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], [r["loss"] for r in ref], rtol=2e-5)
    # the base is frozen, bit for bit; both adapter matrices moved
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        names = [str(k.key) for k in path]
        now = got
        for n in names:
            now = now[n]
        if lora.is_adapter(names):
            assert not np.array_equal(now, x), names
        else:
            np.testing.assert_array_equal(now, x, err_msg=".".join(names))
    trained = engine.plan.trained_paths
    assert trained and all("lora_" in p for p in trained) and len(trained) == 14  # 7 projections x (A, B)
    assert len([x for x in jax.tree.leaves(engine.state.opt_state) if x.ndim]) == 2 * len(trained)
    if tensor > 1:
        dims = engine.plan.tensor_dims["layers"]
        assert (dims["q"]["lora_a"], dims["q"]["lora_b"], dims["q"]["kernel"]) == (None, 2, 2)  # column
        assert (dims["o"]["lora_a"], dims["o"]["lora_b"], dims["o"]["kernel"]) == (1, None, 1)  # row


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_generation_runs_base_plus_adapter_without_a_merged_copy(model: dict) -> None:
    """The KV-cache decoder's logits are the training forward's, adapter included, and equal the merged
    model's (computed only here, for the check)."""
    cfg = config(model).model
    if model["name"] == "gpt":
        params = gpt.init_params(cfg, 0)
    else:
        params = nnx.to_pure_dict(nnx.state(llama.constructor(cfg)(), nnx.Param))
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.05 if str(p[-1].key) == "lora_b" else x, params)
    family = gpt if model["name"] == "gpt" else llama
    tokens = jnp.arange(6)[None] % VOCAB
    logits = family.apply(cfg, params, tokens)
    dec = decoder(cfg)
    out, _ = dec.prefill(params, dec.init_cache(params, 1, SEQ), tokens, jnp.array([6]))
    np.testing.assert_allclose(out[0], logits[0, -1], atol=1e-5)
    base = family.apply(lora.without(cfg), lora.merged(cfg, jax.tree.map(np.asarray, params)), tokens)
    np.testing.assert_allclose(base, logits, atol=1e-5)
    plain = family.apply(lora.without(cfg), lora.merged(cfg, jax.tree.map(np.asarray, lora.disabled(params))), tokens)
    assert np.abs(plain - logits).max() > 1e-3  # the adapter does change the outputs


def test_targets_and_refusals() -> None:
    assert lora.targets(config(GPT).model) == {"qkv", "proj", "fc", "out"}  # DeepSpeed's defaults, mapped
    assert lora.targets(config(LLAMA, lora_section={**LORA, "target_modules": ["q_proj", "v"]}).model) == {"q", "v"}
    with pytest.raises(ConfigError, match="lora.target_modules: 'qproj' is no projection of the llama model"):
        lora.targets(config(LLAMA, lora_section={**LORA, "target_modules": ["qproj"]}).model)
    with pytest.raises(ConfigError, match="lora.lora_dropout: 0.1 is built for the llama model only"):
        config(GPT, lora_section={**LORA, "lora_dropout": 0.1})
    with pytest.raises(ConfigError, match="lora.r: given while lora.enabled is false"):
        config(GPT, lora_section={"r": 4})
    with pytest.raises(ConfigError, match="lora.enabled: a pipeline"):
        config(GPT, lora_section=LORA, mesh={"stage": 2})
    with pytest.raises(ConfigError, match="lora.adapter: a PEFT adapter goes onto its base model"):
        config(LLAMA, lora_section={"adapter": str(Path(__file__).parent / "fixtures" / "peft")})
    cfg = config({**GPT, "trainable": ["ln_f"]})  # trained beside the adapters
    p = zerojax.plan(cfg, mesh(1), gpt.abstract_params(cfg.model))
    assert set(p.trained_paths) == {x for x in p.trained_paths if "lora_" in x or "ln_f" in x} and any(
        "ln_f" in x for x in p.trained_paths)
    with pytest.raises(ConfigError, match="lora.enabled: the model has no adapter parameters"):
        zerojax.plan(cfg, mesh(1), gpt.abstract_params(lora.without(cfg.model)))


def test_rl_reference_of_a_lora_policy_is_its_own_frozen_base() -> None:
    """`rl.reference` of a LoRA policy: the live parameters with the adapters off, no copy of the weights;
    its log-probabilities are the base model's."""
    from zerojax.models import rl
    cfg = config(GPT).model
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.05 if str(p[-1].key) == "lora_b" else x, gpt.init_params(cfg, 0))
    engine = type("E", (), {"params": params})()
    ref = rl.reference(cfg, engine)
    assert isinstance(ref, rl.BaseReference) and not hasattr(ref, "params")
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, SEQ), dtype=np.int32)
    base = lora.merged(cfg, jax.tree.map(np.asarray, lora.disabled(params)))
    want = rl.token_logprobs(gpt.apply(lora.without(cfg), base, jnp.asarray(tokens[:, :-1])), jnp.asarray(tokens))
    np.testing.assert_allclose(ref.logprobs(tokens), np.asarray(want), atol=1e-5)
    policy = rl.token_logprobs(gpt.apply(cfg, params, jnp.asarray(tokens[:, :-1])), jnp.asarray(tokens))
    assert np.abs(np.asarray(policy) - np.asarray(want)).max() > 1e-3
    with pytest.raises(ValueError, match="no LoRA adapters"):
        rl.BaseReference(lora.without(cfg), lambda: params)


def test_rlhf_example_trains_only_adapters(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "examples/rlhf.py", "--steps", "3", "--lora", "4", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl"] < 1e-3 < rows[-1]["kl"]  # starts at the base (B = 0), then moves away from it
    assert json.loads((tmp_path / "config.json").read_text())["lora"]["r"] == 4


def test_estimate_counts_a_lora_fine_tune_of_a_config_json_as_the_run_plans_it() -> None:
    """`zerojax estimate --hf-config` with a lora section: the adapters are added to the config.json's
    model, and the plan-exact count is the run's (configs/lora.yaml on the imported Llama fixture)."""
    from zerojax.tools.estimate import Choice, choose_model, plan_exact
    root = Path(__file__).resolve().parents[1]
    cfg = zerojax.load_config(str(root / "configs" / "lora.yaml"),
                              [f"model.hf_checkpoint={root / 'tests/fixtures/hf/llama'}"])
    model = choose_model(cfg, hf_config=str(root / "tests/fixtures/hf/llama/config.json"))
    rep = plan_exact(cfg, model, 8, 8, Choice(3)).report
    run = zerojax.plan(cfg, mesh(1), llama.build(cfg.model)[0]).report()
    assert (rep.n_params, rep.n_frozen) == (run.n_params, run.n_frozen) == (92_992, 78_144)
    assert rep.params + rep.grads + rep.optimizer == run.params + run.grads + run.optimizer
