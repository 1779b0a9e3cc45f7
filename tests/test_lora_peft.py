"""PEFT's LoRA format both ways, against logits peft itself computed (tests/fixtures/peft/make_fixtures.py):
an adapter read onto an imported Hugging Face base, a trained adapter written in PEFT's format (and read
back), and the merged model written as a plain transformers folder."""
from __future__ import annotations

import json
import re
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
    # an adapter_config.json without target_modules takes the section's: tensors beyond them are refused
    (bad / "adapter_config.json").write_text(json.dumps({k: v for k, v in cfg_json.items() if k != "target_modules"}))
    with pytest.raises(ConfigError, match="holds tensors no adapter of this model takes"):
        hf.read_params(BASE, config(adapter=str(bad), target_modules=["q_proj"]).model)


def _damaged(folder: Path, damage: str) -> None:
    """A copy of the fixture adapter with one thing wrong, as a user's folder may be."""
    folder.mkdir()
    weights, config_json = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    data, cfg_json = (ADAPTER / weights.name).read_bytes(), json.loads((ADAPTER / config_json.name).read_text())
    weights.write_bytes(data[:len(data) // 2] if damage == "truncated weights" else data)
    changed = {"r 8 over rank-4 weights": {"r": 8}, "r a string": {"r": "four"}, "no r": {"r": None},
               "a target module not in the model": {"target_modules": ["q_proj", "v_proj", "qkv_proj"]},
               "weights of a module not targeted": {"target_modules": ["q_proj", "v_proj"]}}.get(damage, {})
    cfg_json = {k: v for k, v in {**cfg_json, **changed}.items() if v is not None}
    text = {"invalid JSON": '{"r": 4, ', "a JSON list": "[4]"}.get(damage, json.dumps(cfg_json))
    if damage != "no adapter_config.json":
        config_json.write_text(text)


@pytest.mark.parametrize("damage, says", [
    ("truncated weights", r"lora\.adapter: \S+/adapter_model\.safetensors is not a readable safetensors file .*"
                          r"re-save it with save_pretrained"),
    ("no adapter_config.json", r"lora\.adapter: \S+ needs adapter_config\.json and adapter_model\.safetensors"),
    ("invalid JSON", r"lora\.adapter: \S+/adapter_config\.json is not valid JSON"),
    ("a JSON list", r"lora\.adapter: \S+/adapter_config\.json holds a JSON list, not PEFT's adapter config"),
    ("r a string", r"lora\.adapter: \S+/adapter_config\.json has r: \"four\", where PEFT writes a positive "
                   r"integer; fix that entry or re-save the adapter"),
    ("no r", r"lora\.adapter: \S+/adapter_config\.json has no r, where PEFT writes a positive integer"),
    ("a target module not in the model", r"lora\.adapter: 'qkv_proj' in the target_modules of \S+'s "
                                         r"adapter_config\.json is no projection of the llama model .* give its own "
                                         r"base as model\.hf_checkpoint"),
    ("r 8 over rank-4 weights", r"lora\.adapter: \S+/adapter_model\.safetensors: \S+ has shape \[4, \d+\], but "
                                r"\S+/adapter_config\.json says r: 8, .* the folder's two files disagree; set r"),
    ("weights of a module not targeted", r"lora\.adapter: \S+ holds tensors of projections \S+/adapter_config\.json's "
                                         r"target_modules does not name .*down_proj.* the folder's two files disagree"),
])
def test_a_damaged_adapter_folder_is_one_error_before_training(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                               damage: str, says: str) -> None:
    """`train.py` with `lora.adapter` naming a damaged folder: exit 2 with one line naming the file and
    the fix, before any output folder is made or anything compiled; the folder is left as it was."""
    from zerojax.app.cli import main
    folder = tmp_path / "adapter"
    _damaged(folder, damage)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    run = tmp_path / "run"
    (tmp_path / "lora.yaml").write_text(json.dumps({
        "train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "mesh": {"cpu_devices": 8},
        "model": {"hf_checkpoint": str(BASE), "seq_len": 16},
        "lora": {"adapter": str(folder)}, "data": {"source": "file", "path": __file__},
        "run": {"steps": 1, "output_dir": str(run)}}))
    code = main(["train", "--config", str(tmp_path / "lora.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.fullmatch(f"zerojax: error: {says}.*\n", err), err
    assert not run.exists()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_the_lora_config_trains_with_the_main_command_and_exports_both_ways(tmp_path: Path) -> None:
    """configs/lora.yaml through `python train.py --config` (four steps, fp32 so the stored base is the
    checkpoint's own values), then `zerojax export --format peft` and `--format hf`: the exported adapter on
    the base and the merged model give the same logits, and not the base's. The same run stopped by
    SIGTERM after its first step and continued with `--resume auto` (the frozen base read again from
    model.hf_checkpoint, the adapters and their moments from the tag) ends with the same losses and
    adapters."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, cwd=root)

    def args(out: Path) -> list[str]:
        return ["train.py", "--config", "configs/lora.yaml", "--set", "run.steps=4", "run.eval_batches=1",
                "run.log_every=1", "steps_per_print=1", "run.progress=false", "run.sample_tokens=0",
                "bf16.enabled=false", f"run.output_dir={out}"]

    out = tmp_path / "run"
    proc = run(*args(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(78,144 frozen)" in proc.stdout, proc.stdout[-2000:]

    import signal
    from test_faults import _popen, _signal_at
    from zerojax.checkpoint import latest_tag, read_params
    stopped = tmp_path / "stopped"
    code, stdout, stderr = _signal_at(_popen(*args(stopped)[1:]), "step 1:", signal.SIGTERM)
    assert code == 143 and "SIGTERM after step" in stdout, stderr[-3000:]
    assert latest_tag(stopped / "checkpoints") in ("global_step1", "global_step2")  # the signal lands mid-run
    proc = run(*args(stopped), "--resume", "auto")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]

    def losses(run_dir: Path) -> list[tuple[int, float]]:
        return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert losses(stopped) == losses(out) and len(losses(out)) == 4
    continued, whole = read_params(stopped / "checkpoints")[0], read_params(out / "checkpoints")[0]
    assert jax.tree.structure(continued) == jax.tree.structure(whole)
    for a, b in zip(jax.tree.leaves(continued), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(a, b)
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
