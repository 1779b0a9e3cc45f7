"""The llama family's Hugging Face options, proven against transformers' own numbers.

tests/fixtures/hf/make_fixtures.py made, with transformers, a random tiny checkpoint of each option:
llama3_tied (Llama 3.2: rope_scaling llama3, tied embeddings), llama_linear (linear rope scaling),
qwen2 (q/k/v biases, tied), qwen3 (per-head q/k RMSNorm, head_dim 24 with hidden 64 and 4 heads),
mistral (sliding_window 8: over 24 tokens most keys are outside a query's window), gemma2 (soft-capped
scores and logits, query_pre_attn_scalar 20 with head_dim 24, (1 + w) norms before and after attention and
MLP, scaled embeddings, GeGLU, layer 0 local with window 8 and layer 1 global), phi3 (fused qkv_proj and
gate_up_proj, split on import and fused again on export; window 8) and qwen3_moe (Qwen3's attention, 4
experts a layer, top-2 renormalized), with
the logits of 24 tokens a row and greedy `generate` of 8 tokens after the first 10. Imported into
the one llama model, each must give those logits within 1e-4 and those tokens exactly, and write
itself back (names, shapes, config.json) bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from helpers import data_mesh, to_numpy
from zerojax.models.generate import generate
from zerojax.models import decode, hf, llama
from zerojax.planner.plan import make_plan

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
FAMILIES = ["llama3_tied", "llama_linear", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "qwen3_moe"]


def config(name: str, stage: int = 0, mesh: dict[str, Any] | None = None, **model: Any) -> zerojax.Config:
    return zerojax.load_config({
        "train_batch_size": 8, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "mesh": mesh or {},
        "model": {"hf_checkpoint": str(FIXTURES / name), "seq_len": 24, **model}})


def logits(cfg: Any, params: Any, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(lambda p, t: llama.apply(cfg, p, t))(params, jnp.asarray(tokens)))


def test_config_json_sets_each_familys_options(tmp_path: Path) -> None:
    m = config("llama3_tied").model
    assert (m.rope_scaling, m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
            m.rope_original_max_positions, m.tie_embeddings, m.qkv_bias, m.qk_norm) == \
        ("llama3", 8.0, 1.0, 4.0, 32, True, False, False)
    assert (config("llama_linear").model.rope_scaling, config("llama_linear").model.rope_factor) == ("linear", 4.0)
    q2 = config("qwen2").model
    assert (q2.qkv_bias, q2.qk_norm, q2.tie_embeddings, q2.rope_theta, q2.head_dim) == (True, False, True, 1e6, None)
    q3 = config("qwen3").model
    assert (q3.qkv_bias, q3.qk_norm, q3.head_dim, q3.d_model, q3.n_heads) == (False, True, 24, 64, 4)
    assert config("mistral").model.sliding_window == 8 and q3.sliding_window is None
    g = config("gemma2").model
    assert (g.hf_family, g.tie_embeddings, g.head_dim, g.query_scale, g.attn_softcap, g.final_softcap,
            g.sliding_window, g.global_every, g.norm_offset, g.embed_scale, g.post_norms, g.mlp_activation) == \
        ("gemma2", True, 24, 20.0, 2.0, 3.0, 8, 2, 1.0, True, True, "gelu_tanh")
    p3 = config("phi3").model
    assert (p3.hf_family, p3.sliding_window, p3.d_ff, p3.n_kv_heads, p3.tie_embeddings) == ("phi3", 8, 96, 2, False)
    qm = config("qwen3_moe").model  # transformers 5 writes num_local_experts; the published file num_experts
    assert (qm.hf_family, qm.n_experts, qm.experts_per_token, qm.d_ff, qm.qk_norm, qm.head_dim, qm.moe_every,
            qm.drop_tokens, qm.moe_aux_loss_coef) == ("qwen3_moe", 4, 2, 12, True, 12, 1, False, 0.001)
    from zerojax.tools.estimate import embedded_model
    assert embedded_model(config("qwen3")).arch.head_dim == 24  # the estimator's attention shapes too
    # Llama 3.2's config.json as published (transformers 4): rope_theta beside a rope_scaling dict
    published = tmp_path / "published"
    shutil.copytree(FIXTURES / "llama3_tied", published)
    hf_cfg = json.loads((published / "config.json").read_text())
    rope = hf_cfg.pop("rope_parameters")
    hf_cfg.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    (published / "config.json").write_text(json.dumps(hf_cfg))
    again = zerojax.load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(published), "seq_len": 24}})
    assert dataclasses.replace(again.model, hf_checkpoint=m.hf_checkpoint) == m


@pytest.mark.parametrize("name", FAMILIES)
def test_family_logits_and_greedy_tokens_match_transformers(name: str) -> None:
    cfg = config(name).model
    params = hf.read_params(cfg.hf_checkpoint, cfg)
    tokens = np.load(FIXTURES / name / "tokens.npy")
    got = logits(cfg, params, tokens)
    np.testing.assert_allclose(got, np.load(FIXTURES / name / "logits.npy"), rtol=0, atol=1e-4)
    if cfg.rope_scaling:  # the scaling changes these logits: the fixture proves the scaled frequencies
        plain = logits(dataclasses.replace(cfg, rope_scaling=None), params, tokens)
        assert np.abs(plain - got).max() > 1e-2
    if cfg.attn_softcap:  # Gemma 2: each of its switches changes these logits
        for change in ({"attn_softcap": None}, {"final_softcap": None}, {"global_every": None},
                       {"query_scale": None}, {"embed_scale": False}):
            assert np.abs(logits(dataclasses.replace(cfg, **change), params, tokens) - got).max() > 1e-2, change
    if cfg.sliding_window:  # the window changes these logits; the blockwise form (3 and 5 tiles) honours it too
        whole = logits(dataclasses.replace(cfg, sliding_window=None), params, tokens)
        assert np.abs(whole - got).max() > 1e-2
        for block in (8, 5):
            tiled = logits(dataclasses.replace(cfg, attention="blockwise", attention_block=block), params, tokens)
            np.testing.assert_allclose(tiled, np.load(FIXTURES / name / "logits.npy"), rtol=0, atol=1e-4)
    out = generate(decode.decoder(cfg), params, tokens[:, :10], np.full(2, 10), 8)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.load(FIXTURES / name / "generated.npy"))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_export_writes_the_checkpoint_back_bit_for_bit(name: str, tmp_path: Path) -> None:
    """`export --format hf` of a model with no source checkpoint (`save_params`, what `--hf-source none`
    writes): the family's tensor names and config.json, which reads back as the same model."""
    cfg = config(name).model
    params = hf.read_params(cfg.hf_checkpoint, cfg)
    out = hf.save_params(tmp_path / "hf", cfg, params)
    with hf.Checkpoint(FIXTURES / name) as src, hf.Checkpoint(out) as got:
        assert set(got.where) == set(src.where)
        for tensor in src.where:
            np.testing.assert_array_equal(got.read(tensor, ()), src.read(tensor, ()))
    keys, _ = hf.model_keys(out, cfg.seq_len)
    assert all(getattr(cfg, k) == v for k, v in keys.items()), keys
    written, source = json.loads((out / "config.json").read_text()), json.loads((FIXTURES / name / "config.json").read_text())
    assert written["model_type"] == source["model_type"]
    for key in ("query_pre_attn_scalar", "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                "sliding_window", "num_experts", "moe_intermediate_size", "norm_topk_prob"):
        if key in written:  # transformers' strict config classes check the types too (an int stays an int)
            assert (written[key], type(written[key])) == (source.get(key, source.get("num_local_experts")),
                                                          type(source.get(key, source.get("num_local_experts")))), key


def _step_save_export(engine: zerojax.Engine, tokens: np.ndarray, tmp_path: Path) -> tuple[float, Path]:
    """One train step on `tokens`, which must lower their eval loss, a checkpoint of it, and that
    checkpoint exported as `export --format hf` does: (the loss before the step, the exported folder)."""
    before = float(engine.eval_batch({"tokens": tokens}))
    engine.train_batch({"tokens": tokens})
    assert float(engine.eval_batch({"tokens": tokens})) < before
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.wait_for_checkpoint()
    return before, hf.export_checkpoint(tmp_path / "ckpt", None, tmp_path / "hf")


def _assert_same_tensors(out: Path, source: Path) -> None:
    """The exported folder holds the source checkpoint's tensors, by name and shape."""
    with hf.Checkpoint(source) as src, hf.Checkpoint(out) as got:
        assert {t: got.shape(t) for t in got.where} == {t: src.shape(t) for t in src.where}


def _assert_reads_back_as_trained(out: Path, model: Any, engine: zerojax.Engine) -> None:
    """The exported weights, read back as `model`, are the engine's trained parameters exactly."""
    back = hf.read_params(out, model)
    for g, w in zip(jax.tree.leaves(back), jax.tree.leaves(to_numpy(engine.params))):
        np.testing.assert_array_equal(g, w)


def test_qwen3_trains_at_zero3_and_exports_through_its_source(tmp_path: Path) -> None:
    """A train step of the Qwen3 fixture at stage 3 over 8 devices (each device holding 1/8 of q's
    kernel), then `export --format hf` back through the source checkpoint."""
    cfg = config("qwen3", 3)
    mesh = data_mesh()
    layout = make_plan(cfg, mesh, hf.abstract_params(cfg.model))
    params = hf.load_params(cfg.model.hf_checkpoint, cfg.model, layout.update_shardings)
    wq = params["layers"]["q"]["kernel"]
    assert wq.addressable_shards[0].data.size * 8 == wq.size
    engine = zerojax.initialize(cfg, params=params, loss_fn=llama.build(cfg.model)[1], mesh=mesh,
                                decode=decode.decoder(cfg.model))
    _, out = _step_save_export(engine, np.tile(np.load(FIXTURES / "qwen3" / "tokens.npy"), (4, 1)), tmp_path)
    assert json.loads((out / "config.json").read_text()) == json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    _assert_reads_back_as_trained(out, cfg.model, engine)


def test_unsupported_families_and_options_are_refused_by_name(tmp_path: Path) -> None:
    base = json.loads((FIXTURES / "qwen2" / "config.json").read_text())

    def load(**changes: Any) -> None:
        folder = tmp_path / "ckpt"
        shutil.copytree(FIXTURES / "qwen2", folder, dirs_exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**base, **changes}))
        zerojax.load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(folder)}})

    with pytest.raises(zerojax.ConfigError, match="model_type 'gemma3'.*nearest it reads: gemma2"):
        load(model_type="gemma3")
    with pytest.raises(zerojax.ConfigError, match="model_type 'qwen2_moe'.*nearest it reads: qwen3_moe"):
        load(model_type="qwen2_moe")
    with pytest.raises(zerojax.ConfigError, match="final_logit_softcapping.*soft-capping is Gemma 2's"):
        load(final_logit_softcapping=30.0)
    with pytest.raises(zerojax.ConfigError, match="use_sliding_window: true"):
        load(use_sliding_window=True)
    with pytest.raises(zerojax.ConfigError, match="rope scaling 'dynamic'"):
        load(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6})


def test_sliding_window_under_ulysses_equals_the_single_device_run() -> None:
    """A Mistral-shaped llama (window 4 over 16 tokens) with sequence parallelism 2 at stage 3: each
    device attends the whole sequence for half the heads, at their global positions, so the window
    cuts the same keys as on one device, in the dense and the blockwise form."""
    from zerojax.planner.mesh import make_mesh

    def run(sp: int, n: int, **model: Any) -> float:
        cfg = zerojax.load_config({
            "train_batch_size": 2, "gradient_clipping": 0.0, "sequence_parallel_size": sp,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "model": {"name": "llama", "vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 4, "n_kv_heads": 2,
                      "d_ff": 64, "n_layers": 2, "init_std": 0.3, **model}})
        params, loss_fn = llama.build(cfg.model, seed=0)
        engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg, jax.devices()[:n]))
        tokens = np.random.default_rng(0).integers(0, 64, size=(2, 17), dtype=np.int32)
        return float(engine.eval_batch({"tokens": tokens}))

    one = run(1, 1, sliding_window=4)
    assert abs(one - run(1, 1)) > 1e-4  # the window matters here
    np.testing.assert_allclose(run(2, 2, sliding_window=4), one, rtol=1e-5)
    np.testing.assert_allclose(run(2, 2, sliding_window=4, attention="blockwise", attention_block=4), one, rtol=1e-5)


def _family_variant(tmp_path: Path, name: str, **changes: Any) -> None:
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder, dirs_exist_ok=True)
    hf_cfg = json.loads((FIXTURES / name / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf_cfg, **changes}))
    zerojax.load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(folder)}})


def test_new_families_refuse_what_they_do_not_compute(tmp_path: Path) -> None:
    """Each option of Gemma 2, Phi-3 and Qwen3-MoE the llama model does not compute is one error naming it."""
    with pytest.raises(zerojax.ConfigError, match="layer_types.*global_every: 2"):
        _family_variant(tmp_path, "gemma2", layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(zerojax.ConfigError, match="hidden_activation.*gelu_pytorch_tanh"):
        _family_variant(tmp_path, "gemma2", hidden_activation="gelu")
    with pytest.raises(zerojax.ConfigError, match="rope scaling 'longrope'"):  # Phi-3-*-128k's
        _family_variant(tmp_path, "phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                          "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    with pytest.raises(zerojax.ConfigError, match="partial_rotary_factor"):
        _family_variant(tmp_path, "phi3", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.5})
    with pytest.raises(zerojax.ConfigError, match="norm_topk_prob: false.*renormalize"):
        _family_variant(tmp_path, "qwen3_moe", norm_topk_prob=False)
    with pytest.raises(zerojax.ConfigError, match="mlp_only_layers"):
        _family_variant(tmp_path, "qwen3_moe", mlp_only_layers=[0])
    with pytest.raises(zerojax.ConfigError, match="decoder_sparse_step: 2"):
        _family_variant(tmp_path, "qwen3_moe", decoder_sparse_step=2)
    # the published Qwen3-MoE config.json names the expert count num_experts
    hf_cfg = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    _family_variant(tmp_path, "qwen3_moe", num_local_experts=None, num_experts=hf_cfg["num_local_experts"])


@pytest.mark.parametrize("name, mesh", [("gemma2", {}), ("gemma2", {"tensor": 2}), ("phi3", {}),
                                        ("phi3", {"tensor": 2}), ("qwen3_moe", {"expert": 2})])
def test_new_families_train_at_zero3(name: str, mesh: dict[str, Any], tmp_path: Path) -> None:
    """train.py's engine of each new family at stage 3 over 8 devices (with a tensor or expert axis):
    the imported model's evaluation loss is transformers' (from its logits), one step lowers it, and
    `export --format hf` through the source writes the trained weights back exactly, in the family's own
    tensors (Phi-3's fused again)."""
    import optax

    from zerojax.app.trainer import build_engine, build_model
    from zerojax.planner.mesh import make_mesh
    cfg = config(name, 3, mesh)
    m = make_mesh(cfg)
    engine = build_engine(cfg, m, build_model(cfg, m))
    tokens = np.tile(np.load(FIXTURES / name / "tokens.npy"), (4, 1))
    want = np.tile(np.load(FIXTURES / name / "logits.npy"), (4, 1, 1))[:, :-1]
    ref = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(want), jnp.asarray(tokens[:, 1:])).mean()
    before, out = _step_save_export(engine, tokens, tmp_path)
    np.testing.assert_allclose(before, float(ref), rtol=1e-5)
    _assert_same_tensors(out, FIXTURES / name)
    _assert_reads_back_as_trained(out, cfg.model, engine)


def test_hf_config_builds_the_family_with_fresh_weights(tmp_path: Path) -> None:
    """`model.hf_config: config.json` gives the same model keys as the checkpoint folder, and train.py's
    engine builds that model with fresh weights (no tensor read), which trains at stage 3 and exports as
    the family; the file's errors name model.hf_config."""
    from zerojax.app.trainer import build_engine, build_model
    from zerojax.tools.estimate import embedded_model

    def load(**model: Any) -> zerojax.Config:
        return zerojax.load_config({
            "train_batch_size": 8, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "model": {"seq_len": 24, **model}})

    for name in ("gemma2", "qwen3_moe"):
        fresh = load(hf_config=str(FIXTURES / name / "config.json")).model
        assert dataclasses.replace(fresh, hf_config=None) == dataclasses.replace(config(name).model, hf_checkpoint=None)
    assert load(hf_config=str(FIXTURES / "phi3")).model.hf_family == "phi3"  # the folder holding it too
    cfg = load(hf_config=str(FIXTURES / "gemma2" / "config.json"))
    from zerojax.tools.estimate import hf_model
    for name in ("gemma2", "phi3", "qwen3_moe"):  # the estimate counts the checkpoint's parameters, from the same file
        with hf.Checkpoint(FIXTURES / name) as src:
            n = sum(int(np.prod(src.shape(t))) for t in src.where)
        assert embedded_model(load(hf_config=str(FIXTURES / name / "config.json"))).total_params == n
        assert hf_model(FIXTURES / name / "config.json").total_params == n, name
    mesh = data_mesh()
    engine = build_engine(cfg, mesh, build_model(cfg, mesh))
    imported = hf.read_params(FIXTURES / "gemma2", config("gemma2").model)
    assert not np.allclose(to_numpy(engine.params)["layers"]["q"]["kernel"], imported["layers"]["q"]["kernel"])
    np.testing.assert_array_equal(to_numpy(engine.params)["norm"]["scale"], 0.0)  # Gemma's (1 + w) starts at 1
    _, out = _step_save_export(engine, np.tile(np.load(FIXTURES / "gemma2" / "tokens.npy"), (4, 1)), tmp_path)
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma2"
    _assert_same_tensors(out, FIXTURES / "gemma2")
    with pytest.raises(zerojax.ConfigError, match="model.hf_config: .*nope.json not found"):
        load(hf_config=str(tmp_path / "nope.json"))
    with pytest.raises(zerojax.ConfigError, match="model.hf_config: .* given with model.hf_checkpoint"):
        load(hf_config=str(FIXTURES / "qwen3" / "config.json"), hf_checkpoint=str(FIXTURES / "qwen3"))
    bad = tmp_path / "gemma3.json"
    bad.write_text(json.dumps({**json.loads((FIXTURES / "gemma2" / "config.json").read_text()), "model_type": "gemma3"}))
    with pytest.raises(zerojax.ConfigError, match="model.hf_config: .*model_type 'gemma3'.*nearest it reads: gemma2"):
        load(hf_config=str(bad))
