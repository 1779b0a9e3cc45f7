"""Hugging Face checkpoints in and out, proven against transformers' own numbers.

tests/fixtures/hf holds a random tiny LlamaForCausalLM (grouped-query attention) and GPT2LMHeadModel
saved by transformers with their logits for fixed tokens (tests/fixtures/hf/make_fixtures.py made
them once; torch is never needed here). Imported into zerojax, at stage 0 and stage 3 over 8
devices, the models must give those logits within 1e-4; export -> import must give back the exact
weights.
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
from helpers import data_mesh, to_numpy
from test_cli import run
from zerojax.models import hf
from zerojax.planner.mesh import make_mesh
from zerojax.planner.plan import make_plan
from zerojax.models import gpt, llama

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
MODELS = ["llama", "gpt2"]


def config(name: str, stage: int = 0, **model: Any) -> zerojax.Config:
    return zerojax.load_config({
        "train_batch_size": 8, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "model": {"hf_checkpoint": str(FIXTURES / name), **model}})


def logits(cfg: Any, params: Any, tokens: np.ndarray) -> np.ndarray:
    fn = llama.apply if cfg.name == "llama" else gpt.apply
    return np.asarray(jax.jit(lambda p, t: fn(cfg, p, t))(params, jnp.asarray(tokens)))


def loss_fn(cfg: Any) -> Any:
    return llama.build(cfg)[1] if cfg.name == "llama" else gpt.make_loss_fn(cfg)


def test_config_json_fills_the_model_keys() -> None:
    m = config("llama").model
    assert (m.name, m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.norm_eps,
            m.tie_embeddings) == ("llama", 128, 64, 2, 4, 2, 96, 1e-5, False)
    g = config("gpt2").model
    assert (g.name, g.d_model, g.n_layers, g.n_heads, g.d_ff, g.seq_len, g.norm_eps, g.tie_embeddings) == \
        ("gpt", 32, 2, 4, 128, 32, 1e-5, True)
    assert config("gpt2", seq_len=16).model.seq_len == 16  # fewer positions than the checkpoint's: fine


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", MODELS)
def test_imported_logits_match_transformers(name: str, stage: int) -> None:
    cfg = config(name, stage)
    mesh = data_mesh()
    layout = make_plan(cfg, mesh, hf.abstract_params(cfg.model))
    params = hf.load_params(cfg.model.hf_checkpoint, cfg.model, layout.update_shardings)
    if stage == 3:  # built straight into shards: no device holds a whole sharded weight
        wq = params["layers"]["q"]["kernel"] if name == "llama" else params["blocks"]["qkv"]["kernel"]
        assert wq.addressable_shards[0].data.size * 8 == wq.size
    tokens = np.load(FIXTURES / name / "tokens.npy")
    want = np.load(FIXTURES / name / "logits.npy")
    np.testing.assert_allclose(logits(cfg.model, params, tokens), want, rtol=0, atol=1e-4)
    # The engine's loss of the same tokens (8 rows, ZeRO's sharded step) is transformers' loss.
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn(cfg.model), mesh=mesh)
    rows = np.tile(tokens, (4, 1))
    ref = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(np.tile(want, (4, 1, 1))[:, :-1]),
                                                          jnp.asarray(rows[:, 1:])).mean()
    np.testing.assert_allclose(float(engine.eval_batch({"tokens": rows})), float(ref), rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_export_then_import_gives_the_exact_weights(name: str, tmp_path: Path) -> None:
    """Train a step from the checkpoint, save, `zerojax export --format hf`, read it back. GPT-2 trains
    16 of its 32 positions: the other rows come back from the source; it trains tied, as its
    config.json says, so the export is tied too (no lm_head.weight, config.json unchanged)."""
    cfg = config(name, 3, **({"seq_len": 16} if name == "gpt2" else {}))
    mesh = data_mesh()
    layout = make_plan(cfg, mesh, hf.abstract_params(cfg.model))
    params = hf.load_params(cfg.model.hf_checkpoint, cfg.model, layout.update_shardings)
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn(cfg.model), mesh=mesh)
    tokens = np.tile(np.load(FIXTURES / name / "tokens.npy"), (4, 1))
    engine.train_batch({"tokens": tokens})
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.wait_for_checkpoint()
    trained = to_numpy(engine.params)
    out = hf.export_checkpoint(tmp_path / "ckpt", None, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    exported = json.loads((out / "config.json").read_text())
    source = json.loads((FIXTURES / name / "config.json").read_text())
    assert exported == source
    with hf.Checkpoint(FIXTURES / name) as src, hf.Checkpoint(out) as got:
        assert set(got.where) == set(src.where)
        if name == "gpt2":  # positions 16-31, which the model does not hold, are the source's
            assert "head" not in trained and "lm_head.weight" not in got.where  # tied, and stays tied
            wpe = got.read("transformer.wpe.weight", ())
            np.testing.assert_array_equal(wpe[16:], src.read("transformer.wpe.weight", ())[16:])
            np.testing.assert_array_equal(wpe[:16], trained["pos"])
    back_cfg = cfg.model
    keys, _ = hf.model_keys(out, back_cfg.seq_len)
    assert all(getattr(back_cfg, k) == v for k, v in keys.items()), keys  # the same model again
    back = hf.read_params(out, back_cfg)
    got_l, got_t = jax.tree.flatten(back)
    want_l, want_t = jax.tree.flatten(trained)
    assert got_t == want_t
    for g, w in zip(got_l, want_l):
        np.testing.assert_array_equal(np.asarray(g, np.float64), w)
    first = hf.read_params(FIXTURES / name, back_cfg)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), got_l))  # it trained
    with pytest.raises(FileExistsError, match="--force"):
        hf.export_checkpoint(tmp_path / "ckpt", None, tmp_path / "hf")


def test_a_gpt_told_to_keep_its_own_head_unties_the_export_once_it_trained(tmp_path: Path) -> None:
    """`model.tie_embeddings: false` on tied GPT-2: the head starts as the embedding, trains apart, and
    the export then adds lm_head.weight and unties config.json (dropping it would lose the training)."""
    cfg = config("gpt2", 0, tie_embeddings=False)
    mesh = data_mesh()
    params = hf.load_params(cfg.model.hf_checkpoint, cfg.model, make_plan(cfg, mesh, hf.abstract_params(cfg.model))
                            .update_shardings)
    np.testing.assert_array_equal(np.asarray(params["head"]["kernel"]).T, np.asarray(params["embed"]["embedding"]))
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn(cfg.model), mesh=mesh)
    engine.train_batch({"tokens": np.tile(np.load(FIXTURES / "gpt2" / "tokens.npy"), (4, 1))})
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.wait_for_checkpoint()
    out = hf.export_checkpoint(tmp_path / "ckpt", None, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with hf.Checkpoint(out) as got:
        np.testing.assert_array_equal(got.read("lm_head.weight", ()), to_numpy(engine.params)["head"]["kernel"].T)


def test_tied_llama_round_trip(tmp_path: Path) -> None:
    """A tied-embedding Llama writes no lm_head and reads back exactly."""
    cfg = zerojax.load_config({"train_batch_size": 8, "model": {"name": "llama", "vocab_size": 64, "d_model": 32,
                                                                "n_layers": 2, "n_heads": 4, "n_kv_heads": 1,
                                                                "tie_embeddings": True}}).model
    params = jax.tree.map(np.asarray, jax.jit(llama.build(cfg, seed=2)[0].fn)())
    hf.save_params(tmp_path, cfg, params)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert "lm_head.weight" not in f.keys() and "model.layers.1.self_attn.k_proj.weight" in f.keys()
        assert f.get_slice("model.layers.1.self_attn.k_proj.weight").get_shape() == [8, 32]
    back = hf.read_params(tmp_path, cfg)
    for g, w in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(g, w)


def _split_into_shards(src: Path, dst: Path) -> None:
    """The fixture as transformers writes a big model: two files and model.safetensors.index.json."""
    from safetensors.numpy import save_file
    from safetensors import safe_open
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    with safe_open(str(src / "model.safetensors"), "numpy") as f:
        names = sorted(f.keys())
        parts = [{n: f.get_tensor(n) for n in names[::2]}, {n: f.get_tensor(n) for n in names[1::2]}]
    weight_map = {}
    for i, part in enumerate(parts):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(part, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("name", MODELS)
def test_sharded_safetensors_import(name: str, tmp_path: Path) -> None:
    _split_into_shards(FIXTURES / name, tmp_path / "sharded")
    cfg = config(name, 3).model
    whole = hf.read_params(FIXTURES / name, cfg)
    layout = make_plan(config(name, 3), data_mesh(), hf.abstract_params(cfg))
    split = hf.load_params(tmp_path / "sharded", cfg, layout.update_shardings)
    for g, w in zip(jax.tree.leaves(split), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(np.asarray(g), w)
    tokens = np.load(FIXTURES / name / "tokens.npy")
    np.testing.assert_allclose(logits(cfg, split, tokens), np.load(FIXTURES / name / "logits.npy"), atol=1e-4)


def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(zerojax.ConfigError, match="model.hf_checkpoint: .*nope is not a folder"):
        config("nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(zerojax.ConfigError, match="config.json not found"):
        zerojax.load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(tmp_path / "empty")}})
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    with pytest.raises(zerojax.ConfigError, match="model_type 'bert'.*'llama'.*'gpt2'"):
        zerojax.load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(bert)}})
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(FIXTURES / "llama" / "config.json", no_weights / "config.json")
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    cfg = zerojax.load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(no_weights)}}).model
    with pytest.raises(zerojax.ConfigError, match="neither model.safetensors.*pytorch_model.bin.*safe_serialization"):
        hf.read_params(no_weights, cfg)
    # a truncated weights file (a copy cut short) names the file, not safetensors' header error alone
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copy(FIXTURES / "llama" / "config.json", cut / "config.json")
    (cut / "model.safetensors").write_bytes((FIXTURES / "llama" / "model.safetensors").read_bytes()[:2000])
    with pytest.raises(zerojax.ConfigError, match="cut/model.safetensors is not a readable safetensors file"):
        hf.read_params(cut, cfg)
    # config.json says 4 key/value heads; the tensors have 2
    wrong = tmp_path / "wrong"
    shutil.copytree(FIXTURES / "llama", wrong)
    hf_cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**hf_cfg, "num_key_value_heads": 4}))
    cfg = zerojax.load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(wrong)}}).model
    with pytest.raises(zerojax.ConfigError, match=r"k_proj.weight in model.safetensors has shape \[32, 64\].*"
                                                  r"model.n_kv_heads.*needs \[64, 64\]"):
        hf.read_params(wrong, cfg)
    # a model key the config gives that the checkpoint contradicts
    with pytest.raises(zerojax.ConfigError, match="model.d_model: 128 given.*has 64"):
        config("llama", d_model=128)
    with pytest.raises(zerojax.ConfigError, match="model.seq_len: 64 is longer than the 32 learned positions"):
        config("gpt2", seq_len=64)
    scaled = tmp_path / "scaled"
    shutil.copytree(FIXTURES / "llama", scaled)
    (scaled / "config.json").write_text(json.dumps({**hf_cfg, "rope_scaling": {"rope_type": "llama3", "factor": 8}}))
    with pytest.raises(zerojax.ConfigError, match="rope scaling llama3 without its low_freq_factor"):
        zerojax.load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(scaled)}})
    (scaled / "config.json").write_text(json.dumps({**hf_cfg, "rope_scaling": {"rope_type": "yarn", "factor": 8}}))
    with pytest.raises(zerojax.ConfigError, match="rope scaling 'yarn'.*default, linear and llama3"):
        zerojax.load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(scaled)}})


def test_import_hf_command_and_training_from_a_checkpoint(tmp_path: Path) -> None:
    proc = run("-m", "zerojax.cli", "import-hf", str(FIXTURES / "llama"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "n_kv_heads: 2" in proc.stdout and "78,144 parameters" in proc.stdout
    bad = run("-m", "zerojax.cli", "import-hf", str(tmp_path))
    assert bad.returncode == 2 and "config.json not found" in bad.stderr
    # train.py from the checkpoint (ASCII text: the fixture's vocabulary is 128), then export it
    text = tmp_path / "ascii.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 400)
    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3}, "mesh": {"cpu_devices": 8},
           "model": {"hf_checkpoint": str(FIXTURES / "llama"), "seq_len": 16},
           "data": {"path": str(text)}, "run": {"steps": 2, "eval_batches": 1, "progress": False,
                                                "output_dir": str(tmp_path / "run")}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    proc = run("train.py", "--config", str(tmp_path / "c.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # UTF-8 text has bytes past the fixture's 128 tokens: refused, not trained on as NaN
    (tmp_path / "utf8.txt").write_text("café = 'crème brûlée'\n" * 400, encoding="utf-8")
    cfg["data"] = {"path": str(tmp_path / "utf8.txt")}
    (tmp_path / "bytes.json").write_text(json.dumps({**cfg, "run": {**cfg["run"], "output_dir": str(tmp_path / "b")}}))
    refused = run("train.py", "--config", str(tmp_path / "bytes.json"))
    assert refused.returncode == 2 and "model.vocab_size: 128, but the corpus holds byte value" in refused.stderr
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert np.isfinite(records[0]["loss"]) and records[0]["loss"] < 10.0  # not the NaN of out-of-range tokens
    proc = run("-m", "zerojax.cli", "export", str(tmp_path / "run" / "checkpoints"), "--format", "hf",
               "--out", str(tmp_path / "exported"), "--max-shard-size", "100KB")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "4 shards" in proc.stdout
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["num_key_value_heads"] == 2
    index = json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    bad = run("-m", "zerojax.cli", "export", str(tmp_path / "run" / "checkpoints"), "--format", "hf",
              "--out", str(tmp_path / "x"), "--max-shard-size", "5 parsecs")
    assert bad.returncode == 2 and "--max-shard-size '5 parsecs': give bytes or a size such as 5GB" in bad.stderr


@pytest.mark.parametrize("name", MODELS)
def test_bf16_export_imports_back_as_the_same_bf16_weights(name: str, tmp_path: Path) -> None:
    """Published checkpoints are mostly bf16: `export --dtype bf16` -> import
    gives the bf16-rounded weights, on a sharded stage-3 plan too."""
    cfg = config(name, 3)
    mesh = data_mesh()
    layout = make_plan(cfg, mesh, hf.abstract_params(cfg.model))
    params = hf.load_params(cfg.model.hf_checkpoint, cfg.model, layout.update_shardings)
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn(cfg.model), mesh=mesh)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.wait_for_checkpoint()
    out = hf.export_checkpoint(tmp_path / "ckpt", None, tmp_path / "hf", dtype="bf16")
    back = hf.load_params(out, cfg.model, layout.update_shardings)
    want = jax.tree.map(lambda x: np.asarray(np.asarray(x).astype(jnp.bfloat16), np.float32), to_numpy(params))
    for g, w in zip(jax.tree.leaves(to_numpy(back)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), w)


@pytest.mark.parametrize("stage", [0, 3])
def test_gpt2_imports_into_a_shorter_context(stage: int) -> None:
    """GPT-2's position table is n_positions long; a model with a shorter seq_len takes its first rows."""
    cfg = config("gpt2", stage, seq_len=16)
    layout = make_plan(cfg, data_mesh(), hf.abstract_params(cfg.model))
    params = hf.load_params(cfg.model.hf_checkpoint, cfg.model, layout.update_shardings)
    whole = hf.read_params(FIXTURES / "gpt2", config("gpt2").model)
    assert params["pos"].shape[0] == 16
    np.testing.assert_array_equal(to_numpy(params)["pos"], whole["pos"][:16])
    assert hf.read_params(FIXTURES / "gpt2", cfg.model)["pos"].shape[0] == 16


def _with_extras(name: str, dst: Path) -> Path:
    """A fixture as published checkpoints often are. gpt2: with buffers the model does not use (the
    causal mask as booleans, a float scalar). tied: the Llama fixture tied (no lm_head.weight,
    tie_word_embeddings true) with a rotary buffer."""
    from safetensors import safe_open
    from safetensors.numpy import save_file
    src = FIXTURES / ("gpt2" if name == "gpt2" else "llama")
    shutil.copytree(src, dst)
    with safe_open(str(src / "model.safetensors"), "numpy") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    if name == "gpt2":
        tensors["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.bool_))
        tensors["transformer.h.0.attn.masked_bias"] = np.array(-1e4, np.float32)
    else:
        del tensors["lm_head.weight"]
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = (1e4 ** -(np.arange(8) / 8)).astype(np.float32)
        hf_cfg = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**hf_cfg, "tie_word_embeddings": True}, indent=2))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name", ["gpt2", "llama", "tied"])
def test_lr0_export_gives_the_source_back_bit_for_bit(name: str, tmp_path: Path, monkeypatch: Any) -> None:
    """Import -> one step at learning rate 0 -> export: the source's tensor names, dtypes and values,
    bit for bit, and its config.json. GPT-2 (tied, 32 positions) trains at seq_len 16 with buffers it
    does not use; Llama plain; Llama tied with a rotary buffer. Sharded, the same tensors again."""
    src = FIXTURES / "llama" if name == "llama" else _with_extras(name, tmp_path / "source")
    cfg = zerojax.load_config({
        "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "model": {"hf_checkpoint": str(src), **({"seq_len": 16} if name == "gpt2" else {})}})
    mesh = data_mesh()
    layout = make_plan(cfg, mesh, hf.abstract_params(cfg.model))
    params = hf.load_params(src, cfg.model, layout.update_shardings)
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn(cfg.model), mesh=mesh)
    tokens = np.load(src / "tokens.npy")
    engine.train_batch({"tokens": np.tile(tokens, (4, 1))})
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.wait_for_checkpoint()
    meta = json.loads(next((tmp_path / "ckpt").glob("*/meta.json")).read_text())
    assert meta["extra"]["hf_source"]["dir"] == str(src)  # what the import read, recorded
    third = (src / "model.safetensors").stat().st_size // 3
    for out, size in ((tmp_path / "hf", "5GB"), (tmp_path / "sharded", third), (tmp_path / "orbax", "5GB")):
        if out.name == "orbax":  # a store tensorstore cannot open is read through orbax, leaf by leaf
            from zerojax.checkpoint.export import LeafReader
            monkeypatch.setattr(LeafReader, "_store", lambda self, name: None)
        hf.export_checkpoint(tmp_path / "ckpt", None, out, max_shard_size=size)
        assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
        assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
        files = sorted(p.name for p in out.glob("*.safetensors"))
        if size == "5GB":
            assert files == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
        else:  # as transformers shards: each file within the limit, an index naming every tensor's file
            assert len(files) >= 3 and all((out / f).stat().st_size <= third + 4096 for f in files)
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert sorted(set(index["weight_map"].values())) == files
        with hf.Checkpoint(src) as want, hf.Checkpoint(out) as got:
            assert sorted(got.where) == sorted(want.where)
            for tensor in want.where:
                a, b = want.read(tensor, ()), got.read(tensor, ())
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), tensor
    if name != "tied":
        return
    # The source folder changed after the run read it: one clear error, and the two ways out.
    hf_cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf_cfg, "vocab_size": 256}))
    with pytest.raises(zerojax.ConfigError, match=f"{src} no longer holds the checkpoint the run was imported from: "
                                                  f"its config.json has changed; pass --hf-source DIR"):
        hf.export_checkpoint(tmp_path / "ckpt", None, tmp_path / "again")
    hf.export_checkpoint(tmp_path / "ckpt", None, tmp_path / "own", source="none")
    with hf.Checkpoint(tmp_path / "own") as own:  # the model's tensors only: no buffer
        assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in own and "lm_head.weight" not in own
    # The source lost its config.json: refused by name, and nothing of the source is left open.
    still_open: set[Any] = set()

    class Recorded(hf.Checkpoint):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            still_open.add(self)

        def close(self) -> None:
            still_open.discard(self)
            super().close()

    monkeypatch.setattr(hf, "Checkpoint", Recorded)
    (src / "config.json").unlink()
    with pytest.raises(zerojax.ConfigError, match=f"cannot be read \\({src / 'config.json'} not found\\); pass --hf-source"):
        hf.export_checkpoint(tmp_path / "ckpt", None, tmp_path / "again")
    assert not still_open
    shutil.rmtree(src)
    with pytest.raises(zerojax.ConfigError, match=f"imported from {src}, which the export reads .* cannot be read"):
        hf.export_checkpoint(tmp_path / "ckpt", None, tmp_path / "again")
    with pytest.raises(zerojax.ConfigError, match="--max-shard-size '5XB'"):
        hf.export_checkpoint(tmp_path / "ckpt", None, tmp_path / "again", max_shard_size="5XB")


# ---------------------------------------------------------------------------------------------
# A tensor axis: each device reads its (tensor x ZeRO) block; the export is the tensor-1 run's.

def tensor_config(tensor: int, stage: int = 3) -> zerojax.Config:
    return zerojax.load_config(config("llama", stage), [f"mesh.tensor={tensor}"])


def _span(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    assert step == 1
    return start, stop


def device_blocks(cfg: Any, shardings: Any) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """Per device, the transformers tensor blocks it holds: each stacked layer's slice of its block,
    in torch's [out, in] order where the tensor is stored transposed."""
    abstract, names = hf.abstract_params(cfg), hf._llama_names(cfg)
    flat = dict(hf._paths(shardings))
    out = []
    for path, leaf in hf._paths(abstract):
        source, shape = names[path], tuple(leaf.shape)
        for index in flat[path].devices_indices_map(shape).values():
            spans = tuple(_span(s, n) for s, n in zip(index, shape))
            layers, rest = (range(*spans[0]), spans[1:]) if hf._stacked(path) else ([None], spans)
            rest = tuple(reversed(rest)) if source.transpose else rest
            out += [(source.name.format(i=i), rest) for i in layers]
    return sorted(out)


def test_with_a_tensor_axis_each_device_reads_only_its_block(monkeypatch: Any) -> None:
    """Tensor 2 x ZeRO-3 over 4: every read from the safetensors files is one device's block of one
    layer (q_proj: an eighth), each device's exactly once; the weights are the checkpoint's and the
    engine's loss is transformers'."""
    cfg = tensor_config(2)
    plan = make_plan(cfg, make_mesh(cfg), hf.abstract_params(cfg.model))
    assert plan.update_shardings["layers"]["q"]["kernel"].spec == jax.sharding.PartitionSpec(None, "data", "tensor")
    reads: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    real = hf.Checkpoint.read

    def recorded(self: hf.Checkpoint, name: str, index: tuple[slice, ...]) -> np.ndarray:
        shape = self.shape(name)
        reads.append((name, tuple(_span(s, n) for s, n in zip(index, shape)) if index else
                      tuple((0, n) for n in shape)))
        return real(self, name, index)

    monkeypatch.setattr(hf.Checkpoint, "read", recorded)
    params = hf.load_params(cfg.model.hf_checkpoint, cfg.model, plan.update_shardings)
    assert sorted(reads) == device_blocks(cfg.model, plan.update_shardings)
    q = [spans for name, spans in reads if name == "model.layers.0.self_attn.q_proj.weight"]
    assert len(q) == 8 and {(b - a) * (d - c) for (a, b), (c, d) in q} == {64 * 64 // 8}
    monkeypatch.setattr(hf.Checkpoint, "read", real)
    for g, w in zip(jax.tree.leaves(to_numpy(params)), jax.tree.leaves(hf.read_params(FIXTURES / "llama", cfg.model))):
        np.testing.assert_array_equal(g, w)
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn(cfg.model), mesh=plan.mesh)
    tokens = np.load(FIXTURES / "llama" / "tokens.npy")
    rows = np.tile(tokens, (4, 1))
    want = np.tile(np.load(FIXTURES / "llama" / "logits.npy"), (4, 1, 1))
    ref = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(want[:, :-1]), jnp.asarray(rows[:, 1:])).mean()
    np.testing.assert_allclose(float(engine.eval_batch({"tokens": rows})), float(ref), rtol=1e-5)


def safetensors_parts(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file as (its JSON header, its data bytes)."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def test_a_tensor_2_run_exports_what_a_tensor_1_run_of_its_weights_does(tmp_path: Path) -> None:
    """A step at tensor 2, saved; the same weights saved again by a tensor-1 engine (loaded from that
    checkpoint); the two exports are the same files, byte for byte but for the checkpoint path the
    safetensors header records, and hold the trained weights."""
    cfg2, cfg1 = tensor_config(2), tensor_config(1, stage=1)
    plan2 = make_plan(cfg2, make_mesh(cfg2), hf.abstract_params(cfg2.model))
    two = zerojax.initialize(cfg2, params=hf.load_params(cfg2.model.hf_checkpoint, cfg2.model, plan2.update_shardings),
                             loss_fn=loss_fn(cfg2.model), mesh=plan2.mesh)
    two.train_batch({"tokens": np.tile(np.load(FIXTURES / "llama" / "tokens.npy"), (4, 1))})
    two.save_checkpoint(str(tmp_path / "t2"))
    plan1 = make_plan(cfg1, make_mesh(cfg1), hf.abstract_params(cfg1.model))
    one = zerojax.initialize(cfg1, params=hf.load_params(cfg1.model.hf_checkpoint, cfg1.model, plan1.update_shardings),
                             loss_fn=loss_fn(cfg1.model), mesh=plan1.mesh)
    one.load_checkpoint(str(tmp_path / "t2"))
    one.save_checkpoint(str(tmp_path / "t1"))
    out2 = hf.export_checkpoint(tmp_path / "t2", None, tmp_path / "hf2")
    out1 = hf.export_checkpoint(tmp_path / "t1", None, tmp_path / "hf1")
    files = sorted(p.name for p in out1.iterdir())
    assert files == sorted(p.name for p in out2.iterdir()) and "model.safetensors" in files
    for f in files:
        if f.endswith(".safetensors"):  # the header names the checkpoint it came from: all else is equal
            (head2, data2), (head1, data1) = safetensors_parts(out2 / f), safetensors_parts(out1 / f)
            assert head2.pop("__metadata__").pop("source") == str(tmp_path / "t2" / "global_step1")
            assert head1.pop("__metadata__").pop("source") == str(tmp_path / "t1" / "global_step1")
            assert head2 == head1 and data2 == data1, f
        else:
            assert (out2 / f).read_bytes() == (out1 / f).read_bytes(), f
    for g, w in zip(jax.tree.leaves(hf.read_params(out2, cfg2.model)), jax.tree.leaves(to_numpy(two.params))):
        np.testing.assert_array_equal(g, w)


def test_index_naming_a_file_outside_its_folder_is_refused(tmp_path: Path) -> None:
    """model.safetensors.index.json names the shards beside it; `../x` (or an absolute path) would make
    zerojax read a file the user never gave it."""
    _split_into_shards(FIXTURES / "gpt2", tmp_path / "sharded")
    shutil.move(tmp_path / "sharded" / "model-00002-of-00002.safetensors", tmp_path / "outside.safetensors")
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    for bad in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        weight_map = {n: (bad if f.startswith("model-00002") else f) for n, f in content["weight_map"].items()}
        index.write_text(json.dumps({**content, "weight_map": weight_map}))
        with pytest.raises(hf.HFError, match=f"index.json names shard '{bad}', which is not a file of"):
            hf.Checkpoint(tmp_path / "sharded")
