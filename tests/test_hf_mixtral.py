"""Hugging Face Mixtral checkpoints in and out of the mixture-of-experts Llama, against transformers.

tests/fixtures/hf/mixtral is a random tiny MixtralForCausalLM (4 experts a layer, top-2, grouped-query
attention) saved by transformers with its logits for fixed tokens (tests/fixtures/hf/make_fixtures.py;
torch is never needed here); mixtral_top1 (4 experts, num_experts_per_tok 1) and mixtral_top3 (6
experts, num_experts_per_tok 3) are made the same way. Imported at ZeRO stage 0, stage 3, and stage 3
with the experts split over an expert axis, the model must give those logits; export -> import must
give back the exact weights.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from helpers import to_numpy
from zerojax.app.trainer import build_engine, build_model
from zerojax.models import hf, llama
from zerojax.planner.mesh import make_mesh

SOURCE = Path(__file__).resolve().parent / "fixtures" / "hf" / "mixtral"
TOP1, TOP3 = SOURCE.parent / "mixtral_top1", SOURCE.parent / "mixtral_top3"


def config(stage: int = 0, expert: int = 1, src: Path = SOURCE, **model: Any) -> zerojax.Config:
    return zerojax.load_config({
        "train_batch_size": 8, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "mesh": {"expert": expert}, "model": {"hf_checkpoint": str(src), **model}})


def engine_of(cfg: zerojax.Config) -> zerojax.Engine:
    """train.py's engine: the plan of the model's annotated parameters (the experts' `expert` dimension
    split over an expert axis), each device reading its blocks of the checkpoint's tensors into it."""
    mesh = make_mesh(cfg)
    return build_engine(cfg, mesh, build_model(cfg, mesh))


def rows() -> np.ndarray:
    return np.tile(np.load(SOURCE / "tokens.npy"), (4, 1))


def test_config_json_fills_the_moe_keys() -> None:
    """Mixtral's shape, and the gate that computes its routing: top-2, no token dropped, no noise."""
    m = config().model
    assert (m.name, m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.rope_theta,
            m.norm_eps) == ("llama", 32, 16, 2, 4, 2, 12, 1e6, 1e-5)
    assert (m.n_experts, m.experts_per_token, m.moe_every, m.use_residual, m.drop_tokens, m.noisy_gate_policy,
            m.top2_2nd_expert_sampling, m.moe_aux_loss_coef) == (4, 2, 1, False, False, None, False, 0.02)
    assert config(moe_aux_loss_coef=0.0).model.moe_aux_loss_coef == 0.0  # a training choice: the config's wins
    with pytest.raises(zerojax.ConfigError, match="model.drop_tokens: True given, but the checkpoint .* has False"):
        config(drop_tokens=True)
    dense = SOURCE.parent / "llama"
    with pytest.raises(zerojax.ConfigError, match=r"model.n_experts: 4 given, but model.hf_checkpoint's config.json "
                                                  r"describes a dense model .*remove model.n_experts"):
        config(src=dense, n_experts=4)


@pytest.mark.parametrize("stage, expert", [(0, 1), (3, 1), (3, 2)])
def test_imported_logits_match_transformers(stage: int, expert: int) -> None:
    cfg = config(stage, expert)
    engine = engine_of(cfg)
    w1 = engine.params["layers"]["moe"]["experts"]["gate"]  # [layers, experts, d_model, d_ff]
    block = w1.addressable_shards[0].data  # read straight into the shards: ZeRO-3's eighth, experts split over ep
    assert block.size * (8 if stage == 3 else 1) == w1.size and block.shape[1] == 4 // expert, block.shape
    tokens, want = np.load(SOURCE / "tokens.npy"), np.load(SOURCE / "logits.npy")
    got = np.asarray(jax.jit(lambda p, t: llama.apply(cfg.model, p, t))(engine.params, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # The engine's evaluation loss of the same tokens (8 rows split over the devices) is transformers'.
    ref = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(np.tile(want, (4, 1, 1))[:, :-1]),
                                                          jnp.asarray(rows()[:, 1:])).mean()
    np.testing.assert_allclose(float(engine.eval_batch({"tokens": rows()})), float(ref), rtol=1e-5)


def test_export_then_import_gives_the_exact_weights(tmp_path: Path) -> None:
    """Stage 3 with the experts split in two: saved as imported, and with every weight changed (as
    training changes them; no step is compiled). `export --format hf` of the first is the source bit for
    bit; of the second, the source's tensor names, shapes and config.json holding the changed weights
    exactly. Without the source (`--hf-source none`) the config.json written from the model keys
    describes the same model."""
    imported = engine_of(config(3, 2))
    imported.save_checkpoint(str(tmp_path / "ckpt"), tag="imported")
    moved = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.5 + 0.25, p))(imported.params)
    engine = zerojax.initialize(imported.config, params=moved, loss_fn=llama.build(imported.config.model)[1],
                                mesh=imported.mesh)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="trained")
    engine.wait_for_checkpoint()
    same = hf.export_checkpoint(tmp_path / "ckpt", "imported", tmp_path / "same")
    with hf.Checkpoint(SOURCE) as src, hf.Checkpoint(same) as got:
        assert sorted(got.where) == sorted(src.where)
        for name in src.where:
            assert got.read(name, ()).tobytes() == src.read(name, ()).tobytes(), name

    trained = to_numpy(engine.params)
    out = hf.export_checkpoint(tmp_path / "ckpt", "trained", tmp_path / "hf")
    assert (out / "config.json").read_bytes() == (SOURCE / "config.json").read_bytes()
    back = hf.read_params(out, engine.config.model)
    assert jax.tree.structure(back) == jax.tree.structure(trained)
    for g, w in zip(jax.tree.leaves(back), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(g, np.float64), w)
    with hf.Checkpoint(SOURCE) as src, hf.Checkpoint(out) as got:
        assert sorted(got.where) == sorted(src.where)
        name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
        assert got.shape(name) == src.shape(name) == (16, 12)
        np.testing.assert_array_equal(got.read(name, ()), trained["layers"]["moe"]["experts"]["down"][1, 3].T)
        assert not np.array_equal(got.read(name, ()), src.read(name, ()))  # it trained

    own = hf.export_checkpoint(tmp_path / "ckpt", "trained", tmp_path / "own", source="none")
    written = json.loads((own / "config.json").read_text())
    assert (written["model_type"], written["architectures"], written["num_local_experts"],
            written["num_experts_per_tok"], written["router_aux_loss_coef"]) == \
        ("mixtral", ["MixtralForCausalLM"], 4, 2, 0.02)
    keys, _ = hf.model_keys(own)
    assert all(getattr(engine.config.model, k) == v for k, v in keys.items()), keys


def test_other_top_k_take_the_gate_that_renormalizes() -> None:
    """num_experts_per_tok 3: DeepSpeed's top-k gate (what TopKGate picks from k = 3); 1: the top-k gate
    too (gating: topk), whose one kept weight is 1 as Mixtral's, not the top-1 gate's probability."""
    m3, m1 = config(src=TOP3).model, config(src=TOP1).model
    assert (m3.n_experts, m3.experts_per_token, m3.gating, m3.drop_tokens) == (6, 3, "auto", False)
    assert (m1.n_experts, m1.experts_per_token, m1.gating, m1.drop_tokens) == (4, 1, "topk", False)
    with pytest.raises(zerojax.ConfigError, match=r"model.gating: auto given, but the checkpoint .* has topk"):
        config(src=TOP1, gating="auto")


@pytest.mark.parametrize("src, stage, expert", [(TOP1, 0, 1), (TOP3, 3, 2)], ids=["top1", "top3-stage3-expert2"])
def test_imported_top_k_logits_match_transformers(src: Path, stage: int, expert: int) -> None:
    cfg = config(stage, expert, src=src)
    engine = engine_of(cfg)
    tokens, want = np.load(src / "tokens.npy"), np.load(src / "logits.npy")
    got = np.asarray(jax.jit(lambda p, t: llama.apply(cfg.model, p, t))(engine.params, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_export_writes_num_experts_per_tok_and_refuses_the_top1_gate(tmp_path: Path) -> None:
    """A MoE Llama trained from scratch exports its k; DeepSpeed's top-1 gate is not Mixtral's forward."""
    base = {"name": "llama", "vocab_size": 32, "d_model": 16, "n_layers": 2, "n_heads": 4, "n_experts": 4}
    for k, gating in ((3, "auto"), (1, "topk")):
        cfg = zerojax.load_config({"train_batch_size": 8, "model": {**base, "experts_per_token": k,
                                                                    "gating": gating}}).model
        assert hf.hf_config(cfg)["num_experts_per_tok"] == k
    cfg = zerojax.load_config({"train_batch_size": 8, "model": {**base, "experts_per_token": 1}}).model
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), hf.abstract_params(cfg))
    with pytest.raises(zerojax.ConfigError, match=r"model.gating: auto with model.experts_per_token 1 is "
                                                  r"DeepSpeed's top-1 gate, .*--format safetensors"):
        hf.save_params(tmp_path, cfg, params)


def _edited(tmp_path: Path, **changes: Any) -> Path:
    dst = tmp_path / "edited"
    shutil.copytree(SOURCE, dst)
    hf_cfg = json.loads((SOURCE / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**hf_cfg, **changes}))
    return dst


@pytest.mark.parametrize("changes, seq_len, match", [
    ({"num_experts_per_tok": 5}, None, r"has num_experts_per_tok: 5; a token is routed to between 1 and "
                                       r"num_local_experts \(4\) experts"),
    ({"router_jitter_noise": 0.1}, None, r"has router_jitter_noise: 0.1; .*use 0"),
    ({"hidden_act": "gelu"}, None, r"has hidden_act: \"gelu\"; the llama model's MLP is SwiGLU"),
])
def test_a_mixtral_config_zerojax_cannot_compute_is_one_clear_error(tmp_path: Path, changes: dict, seq_len: Any,
                                                                    match: str) -> None:
    src = _edited(tmp_path, **changes)
    with pytest.raises(zerojax.ConfigError, match=r"^model.hf_checkpoint: .*config.json " + match):
        config(src=src, **({"seq_len": seq_len} if seq_len else {}))


def test_a_mixtral_sliding_window_is_the_models(tmp_path: Path) -> None:
    """config.json's sliding_window becomes model.sliding_window, shorter than the context or not
    (tests/test_hf_families.py proves the windowed attention against transformers' Mistral)."""
    m = config(src=_edited(tmp_path, sliding_window=8), seq_len=16).model
    assert m.n_experts == 4 and m.seq_len == 16 and m.sliding_window == 8


def test_a_moe_llama_not_shaped_as_mixtral_is_refused_at_export(tmp_path: Path) -> None:
    cfg = zerojax.load_config({"train_batch_size": 8, "model": {
        "name": "llama", "vocab_size": 32, "d_model": 16, "n_layers": 2, "n_heads": 4, "n_experts": 4,
        "experts_per_token": 2, "moe_every": 2}}).model
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), hf.abstract_params(cfg))
    with pytest.raises(zerojax.ConfigError, match=r"model.moe_every: 2, but a Hugging Face MoE checkpoint "
                                                  r"\(Mixtral\) needs 1"):
        hf.save_params(tmp_path, cfg, params)
