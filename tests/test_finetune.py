"""The loop people expect, on configs/qwen3_finetune.yaml as the README runs it (`train.py --config ...`):
a Hugging Face Qwen3 fixture fine-tuned on a datasets folder, validated every step, the best checkpoint
kept by validation loss through retention and a resume, `--resume auto` starting and then continuing
the run with the same batches, and `export`, `sample` and `plot` taking the same run folder and `-o`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zerojax
from zerojax.app import trainer
from zerojax.app.cli import main
from zerojax.engine.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/qwen3_finetune.yaml"


def test_finetune_config_validates_keeps_the_best_and_resumes(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.chdir(ROOT)  # the config names the shipped fixtures by relative paths, as the README runs it
    out = tmp_path / "run"
    seen: list[dict[str, np.ndarray]] = []
    real_train, real_eval = Engine.train_batch, trainer.evaluate
    monkeypatch.setattr(Engine, "train_batch", lambda self, batch: (seen.append(batch), real_train(self, batch))[1])
    # validation losses as scripted (each computed for real first): best at step 2, then worse
    scripted = [3.0, 2.0, 2.5, 2.6]
    losses: list[float] = []
    monkeypatch.setattr(trainer, "evaluate", lambda engine, batches, n: (losses.append(real_eval(engine, batches, n)),
                                                                         scripted.pop(0))[1])
    common = [f"run.output_dir={out}", "run.eval_every=1", "run.sample_tokens=0", "run.progress=false",
              "checkpoint.max_to_keep=1"]
    # 40 training documents, 8 a step: 0.4 epochs is 2 steps; nothing to resume yet, so `auto` starts the run
    assert main(["train", "--config", CONFIG, "--set", *common, "run.epochs=0.4", "--resume", "auto"]) == 0
    ckpt = out / "checkpoints"
    assert (ckpt / ".best").read_text().strip() == "global_step2"
    assert len(seen) == 2
    # `auto` again: there is a checkpoint now, so the same command continues the run to 0.8 epochs
    assert main(["train", "--config", CONFIG, "--set", *common, "run.epochs=0.8", "--resume", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert len(seen) == 4 and not scripted and all(np.isfinite(losses))
    config = zerojax.load_config(CONFIG, [*common, "run.epochs=0.8"])
    assert config.data.source == "datasets" and config.data.packing == "pad"
    source, _ = trainer.make_batches(config.data, 8, config.model.seq_len, config.model.vocab_size)
    for k, batch in enumerate(seen):  # straight through the stop: the batches one run would have taken
        np.testing.assert_array_equal(batch["tokens"], source.batch(k)["tokens"])
        np.testing.assert_array_equal(batch["loss_mask"], source.batch(k)["loss_mask"])
    # max_to_keep 1 keeps the newest tag and the one `best` names (the resumed run kept its record)
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["global_step2", "global_step4"]
    assert (ckpt / ".best").read_text().strip() == "global_step2" and (ckpt / "latest").read_text().strip() == "global_step4"
    meta = json.loads((ckpt / "global_step2" / "meta.json").read_text())
    assert meta["extra"]["val_loss"] == 2.0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_loss"] for r in rows if "val_loss" in r] == [3.0, 2.0, 2.5, 2.6]

    # export, sample and plot: the same run folder, the same -o
    assert main(["export", str(out), "--tag", "best", "-o", str(tmp_path / "best.safetensors")]) == 0
    from safetensors.numpy import load_file
    assert any("embed" in k for k in load_file(str(tmp_path / "best.safetensors")))
    assert main(["sample", str(out), "--tag", "best", "--tokens", "4", "--prompt", "Question", "-o",
                 str(tmp_path / "sample.txt")]) == 0
    assert (tmp_path / "sample.txt").read_text().startswith("Question")
    assert main(["sample", str(out), "--tokens", "4", "-o", str(tmp_path / "sample.txt")]) == 2  # never replaced
    assert "never overwritten" in capsys.readouterr().err
    assert main(["plot", str(out), "-o", str(tmp_path / "run.png")]) == 0
    assert (tmp_path / "run.png").stat().st_size > 0


def test_eval_every_without_eval_batches_is_refused(monkeypatch: Any) -> None:
    monkeypatch.chdir(ROOT)
    with pytest.raises(zerojax.ConfigError, match="run.eval_every: 5, but run.eval_batches is 0"):
        zerojax.load_config(str(ROOT / CONFIG), ["run.eval_batches=0"])
