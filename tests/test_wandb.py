"""The wandb monitor: an offline run folder (what `wandb sync` uploads) holding the same Train/Samples/*
events at the same values as metrics.jsonl, and one clear error before compiling when wandb is absent."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import ROOT, SMALL

TINY = [*SMALL, "run.steps=3", "run.log_every=1", "steps_per_print=1", "run.sample_tokens=0",
        "scheduler.params.total_num_steps=3", "scheduler.params.warmup_num_steps=1", "wandb.enabled=true"]


def _train(tmp_path: Path, *args: str, pythonpath: str = str(ROOT)) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath, "JAX_PLATFORMS": "cpu", "WANDB_DIR": str(tmp_path),
           **{f"WANDB_{d}_DIR": str(tmp_path / d.lower()) for d in ("CACHE", "CONFIG", "DATA")}}  # nothing in ~
    for key in ("XLA_FLAGS", "WANDB_MODE"):  # the config's keys must be what decides
        env.pop(key, None)
    return subprocess.run([sys.executable, "train.py", "--config", "configs/zero1.yaml", "--set", *TINY, *args,
                           f"run.output_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def _history(path: Path) -> dict[int, dict[str, float]]:
    """The history rows of a .wandb file, read with wandb's own Record message. The file is a LevelDB
    log (wandb's header `:W&B`, magic, version, then 32 KiB blocks of checksummed chunks); wandb ships
    no reader of its own for it."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, rows = 7, b"", {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                rows[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def test_offline_run_folder_holds_the_metrics(tmp_path: Path) -> None:
    pytest.importorskip("wandb")  # the test extra installs it
    proc = _train(tmp_path, "wandb.mode=offline", "wandb.project=tiny")
    assert proc.returncode == 0, proc.stderr[-3000:]
    folders = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 1, list((tmp_path / "wandb").iterdir())
    assert f"upload it with `wandb sync {folders[0]}`" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    samples = 32  # train_batch_size: DeepSpeed's x axis is samples seen
    expected = {r["step"] * samples: {"Train/Samples/train_loss": r["loss"], "Train/Samples/lr": r["lr"],
                                      "Train/Samples/loss_scale": r["loss_scale"]} for r in rows}
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert _history(next(folders[0].glob("*.wandb"))) == expected


def test_missing_wandb_fails_before_compiling(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named wandb')\n")
    proc = _train(tmp_path, pythonpath=f"{fake.parent}{os.pathsep}{ROOT}")  # wandb there, not installed
    assert proc.returncode != 0
    assert "wandb.enabled: needs the `wandb` package; pip install 'zerojax[wandb]'" in proc.stderr
    assert "compiled step" not in proc.stdout and not (tmp_path / "run" / "config.json").exists()
