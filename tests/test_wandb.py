"""The wandb monitor: an offline run folder (what `wandb sync` uploads) holding the same Train/Samples/*
events at the same values as metrics.jsonl, and one clear error before compiling when wandb is absent."""
from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import pytest

from helpers import assert_absent_package_refused, samples_events, train_with_monitor

def _train(tmp_path: Path, *args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    folders = {"WANDB_DIR": str(tmp_path), **{f"WANDB_{d}_DIR": str(tmp_path / d.lower())
                                              for d in ("CACHE", "CONFIG", "DATA")}}  # nothing in ~
    return train_with_monitor(tmp_path, "wandb", *args, env=folders, drop=["WANDB_MODE"], pythonpath=pythonpath)


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
    assert _history(next(folders[0].glob("*.wandb"))) == samples_events(tmp_path / "run")


def test_missing_wandb_fails_before_compiling(tmp_path: Path) -> None:
    assert_absent_package_refused(tmp_path, "wandb", "wandb", _train)
