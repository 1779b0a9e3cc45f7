"""Train your own model on your own data, end to end, as docs/your_model.md walks through it.

A Llama checkpoint in Hugging Face's format (the tiny fixture, vocabulary 128), a JSONL corpus and a
tokenizer.json trained here to fit that vocabulary; then the commands a user types, in a fresh folder
with relative paths: train.py from the checkpoint, stop, resume, `zerojax export --format hf`,
`zerojax sample` through the run's tokenizer, `zerojax plot`; then `zerojax tokenize` and the same
training from the token file.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np

from test_cli import ROOT, run
from zerojax import checkpoint
from zerojax.models import hf
from zerojax.config import load_config
from zerojax.runtime.data import make_batches
from zerojax.models import llama
from zerojax.app.sample import generate

FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama"
ANIMALS, PLACES = ["cat", "dog", "fox", "owl"], ["mat", "log", "box"]
DOCS = [f"note {i}: the {ANIMALS[i % 4]} sat on the {PLACES[i % 3]} and ate {i % 7} plums." for i in range(400)]
CONFIG = """\
train_batch_size: 8
optimizer: {type: AdamW, params: {lr: 1.0e-3, weight_decay: 0.01}}
zero_optimization: {stage: 3}
mesh: {cpu_devices: 8}
model: {hf_checkpoint: base, seq_len: 32}
data: {source: jsonl, path: corpus.jsonl, tokenizer: tokenizer.json}
run: {steps: 6, save_every: 3, log_every: 1, eval_batches: 1, output_dir: runs/mine, progress: false}
"""


def prepare(folder: Path) -> None:
    """What a user brings: the checkpoint folder, the corpus, a tokenizer whose ids fit the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    shutil.copytree(FIXTURE, folder / "base")
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "my.yaml").write_text(CONFIG)


def ok(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_hf_checkpoint_and_jsonl_to_a_trained_exported_sampled_model(tmp_path: Path, monkeypatch) -> None:
    prepare(tmp_path)
    train = str(ROOT / "train.py")
    first = ok(run(train, "--config", "my.yaml", "--set", "run.steps=3", cwd=tmp_path))
    assert "checkpoint global_step3" in first
    resumed = ok(run(train, "--config", "my.yaml", "--resume", cwd=tmp_path))
    assert "at step 3" in resumed and "checkpoint global_step6" in resumed
    rows = [json.loads(r) for r in (tmp_path / "runs/mine/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # it learns the corpus

    # step 1 trained the imported weights, not a fresh initialization: its loss is the fixture's
    # loss on the first batch of the tokenized corpus
    monkeypatch.chdir(tmp_path)
    config = load_config("my.yaml")
    batches, _ = make_batches(config.data, 8, 32, config.model.vocab_size)
    batch = batches.batch(0)
    logits = np.asarray(jax.jit(lambda p, t: llama.apply(config.model, p, t))(
        hf.read_params("base", config.model), batch["tokens"][:, :-1]), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, batch["tokens"][:, 1:, None], -1)[..., 0]
    expected = float((nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
    assert abs(rows[0]["loss"] - expected) < 1e-3, (rows[0]["loss"], expected)

    # export: a transformers folder holding exactly the run's final (fp32 master) weights
    ok(run("-m", "zerojax.cli", "export", "runs/mine/checkpoints", "--format", "hf", "--out", "exported",
           cwd=tmp_path))
    assert "n_kv_heads: 2" in ok(run("-m", "zerojax.cli", "import-hf", "exported", cwd=tmp_path))
    saved, where = checkpoint.read_params(tmp_path / "runs/mine/checkpoints")
    assert where.endswith("global_step6")
    exported = hf.read_params(tmp_path / "exported", config.model)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(exported)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), b)
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(exported), jax.tree.leaves(hf.read_params("base", config.model))))

    # sample: greedy text through the run's tokenizer, as the exported weights generate it
    text = ok(run("-m", "zerojax.cli", "sample", "--run", "runs/mine", "--prompt", "the cat", "--tokens", "8",
                  "--temperature", "0", cwd=tmp_path)).rstrip("\n")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    prompt = tok.encode("the cat", add_special_tokens=False).ids
    new = generate(config.model, exported, prompt, 8, temperature=0)
    assert text == tok.decode(prompt) + tok.decode(new)
    assert text.startswith("the cat") and len(text) > len("the cat")

    ok(run("-m", "zerojax.cli", "plot", "runs/mine", "-o", "mine.png", cwd=tmp_path))
    assert (tmp_path / "mine.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a larger corpus is tokenized once: the token file trains exactly as the JSONL did (same losses),
    # and its run samples through the tokenizer given on the command line
    said = ok(run("-m", "zerojax.cli", "tokenize", "corpus.jsonl", "--tokenizer", "tokenizer.json", "--out",
                  "train.bin", cwd=tmp_path))
    keys = said.split("--set ")[1].split()
    ok(run(train, "--config", "my.yaml", "--set", "run.steps=3", "run.output_dir=runs/bin", "data.tokenizer=null",
           *keys, cwd=tmp_path))
    binned = [json.loads(r) for r in (tmp_path / "runs/bin/metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in binned] == [r["loss"] for r in rows[:3]]
    greedy = ["--prompt", "the cat", "--tokens", "8", "--temperature", "0", "--tag", "global_step3"]
    refused = run("-m", "zerojax.cli", "sample", "--run", "runs/bin", *greedy, cwd=tmp_path)
    assert refused.returncode == 2 and "--tokenizer" in refused.stderr
    assert ok(run("-m", "zerojax.cli", "sample", "--run", "runs/bin", *greedy, "--tokenizer", "tokenizer.json",
                  cwd=tmp_path)) == ok(run("-m", "zerojax.cli", "sample", "--run", "runs/mine", *greedy, cwd=tmp_path))
