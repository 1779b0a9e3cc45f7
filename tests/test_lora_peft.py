"""PEFT's LoRA format both ways, against logits peft itself computed (tests/fixtures/peft/make_fixtures.py):
an adapter read onto an imported Hugging Face base, a trained adapter written in PEFT's format (and read
back), and the merged model written as a plain transformers folder."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import zerojax
from zerojax.errors import ConfigError
from zerojax.models import hf, llama, lora

FIXTURES = Path(__file__).parent / "fixtures"
BASE, ADAPTER = FIXTURES / "hf" / "llama", FIXTURES / "peft" / "llama_qv"


def config(**lora_section) -> zerojax.Config:
    return zerojax.load_config({"train_batch_size": 8, "model": {"name": "llama", "hf_checkpoint": str(BASE)},
                                "lora": lora_section})


def logits(cfg, params) -> np.ndarray:
    return np.asarray(llama.apply(cfg, params, np.load(BASE / "tokens.npy")))


def test_a_peft_adapter_onto_an_imported_base_gives_peffts_logits() -> None:
    cfg = config(adapter=str(ADAPTER))
    assert (cfg.lora.enabled, cfg.lora.r, cfg.lora.lora_alpha) == (True, 4, 8.0)
    assert cfg.sources["lora.r"].startswith("derived (lora.adapter")
    assert lora.targets(cfg.model) == {"q", "v", "down"}
    params = hf.read_params(BASE, cfg.model)
    assert params["layers"]["q"]["lora_a"].shape == (2, 64, 4) and "lora_a" not in params["layers"]["k"]
    np.testing.assert_allclose(logits(cfg.model, params), np.load(ADAPTER / "logits.npy"), atol=1e-4)


def test_new_adapters_on_an_imported_base_start_as_the_base() -> None:
    cfg = config(enabled=True, r=2, target_modules=["q_proj", "o_proj"])
    params = hf.read_params(BASE, cfg.model, seed=3)
    assert np.abs(params["layers"]["q"]["lora_a"]).max() > 0 and not params["layers"]["o"]["lora_b"].any()
    np.testing.assert_allclose(logits(cfg.model, params), np.load(BASE / "logits.npy"), atol=1e-4)


def test_export_adapter_and_merged_model_round_trip(tmp_path: Path) -> None:
    cfg = config(adapter=str(ADAPTER))
    params = hf.read_params(BASE, cfg.model)
    trained = jax.tree_util.tree_map_with_path(  # as if trained: every adapter matrix changed
        lambda p, x: x * 1.5 + 0.01 if lora.is_adapter([str(k.key) for k in p]) else x, params)
    want = logits(cfg.model, trained)

    out = hf.save_adapter(tmp_path / "adapter", cfg.model, trained, base=str(BASE))
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["target_modules"] == ["down_proj", "q_proj", "v_proj"] and written["r"] == 4
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    again = config(adapter=str(out))
    np.testing.assert_allclose(logits(again.model, hf.read_params(BASE, again.model)), want, atol=1e-5)

    merged = hf.save_params(tmp_path / "merged", cfg.model, jax.tree.map(np.asarray, trained))
    plain = zerojax.load_config({"train_batch_size": 8, "model": {"name": "llama", "hf_checkpoint": str(merged)}})
    assert plain.model.lora is None
    np.testing.assert_allclose(logits(plain.model, hf.read_params(merged, plain.model)), want, atol=1e-4)


def test_adapter_refusals(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lora.r: 8 given, but lora.adapter's .* has 4"):
        config(adapter=str(ADAPTER), r=8)
    bad = tmp_path / "dora"
    bad.mkdir()
    (bad / "adapter_model.safetensors").write_bytes((ADAPTER / "adapter_model.safetensors").read_bytes())
    cfg_json = json.loads((ADAPTER / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg_json, "use_dora": True}))
    with pytest.raises(ConfigError, match="has use_dora: true; only plain LoRA is built"):
        config(adapter=str(bad))
    (bad / "adapter_config.json").write_text(json.dumps({**cfg_json, "target_modules": ["q_proj"]}))
    with pytest.raises(ConfigError, match="holds tensors no adapter of this model takes"):
        hf.read_params(BASE, config(adapter=str(bad)).model)


def test_the_lora_config_trains_with_the_main_command_and_exports_both_ways(tmp_path: Path) -> None:
    """configs/lora.yaml through `python train.py --config` (two steps, fp32 so the stored base is the
    checkpoint's own values), then `zerojax export --format peft` and `--format hf`: the exported adapter on
    the base and the merged model give the same logits, and not the base's."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, cwd=root)

    out = tmp_path / "run"
    proc = run("train.py", "--config", "configs/lora.yaml", "--set", "run.steps=2", "run.eval_batches=1",
               "run.progress=false", "run.sample_tokens=0", "bf16.enabled=false", f"run.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(78,144 frozen)" in proc.stdout, proc.stdout[-2000:]
    for fmt in ("peft", "hf"):
        proc = run("-m", "zerojax.cli", "export", str(out / "checkpoints"), "--format", fmt, "--out", str(tmp_path / fmt),
                   *(["--hf-source", str(BASE)] if fmt == "peft" else []))
        assert proc.returncode == 0, proc.stderr[-3000:]
    adapted = config(adapter=str(tmp_path / "peft"))
    assert adapted.lora.r == 8 and lora.targets(adapted.model) == set(lora.PROJECTIONS["llama"])
    want = logits(adapted.model, hf.read_params(BASE, adapted.model))
    plain = zerojax.load_config({"train_batch_size": 8, "model": {"name": "llama", "hf_checkpoint": str(tmp_path / "hf")}})
    np.testing.assert_allclose(logits(plain.model, hf.read_params(tmp_path / "hf", plain.model)), want, atol=1e-4)
    assert np.abs(want - np.load(BASE / "logits.npy")).max() > 1e-4  # the trained adapters changed the model
