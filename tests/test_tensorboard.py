"""The TensorBoard monitor: train.py's event file holds DeepSpeed's Train/Samples/* scalars at the
values of metrics.jsonl; tensorboardX is looked for at start-up (a missing one is one error before
compiling) but imported only at the first event, after the first step."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

import zerojax
from helpers import samples_events, train_with_monitor
from zerojax.app import monitor
from zerojax.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _scalars(path: Path) -> dict[int, dict[str, float]]:
    """The scalar summaries of a TFRecord event file (length, its CRC, the Event proto, its CRC),
    read with tensorboardX's own Event message."""
    from tensorboardX.proto.event_pb2 import Event
    data, pos, out = path.read_bytes(), 0, {}
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
        for value in event.summary.value:
            out.setdefault(event.step, {})[value.tag] = value.simple_value
    return out


def test_events_hold_the_runs_metrics(tmp_path: Path) -> None:
    proc = train_with_monitor(tmp_path, "tensorboard", env={}, drop=[])
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    got, want = _scalars(files[0]), samples_events(tmp_path / "run")
    assert set(got) == set(want)
    for step, row in want.items():
        for tag, value in row.items():
            assert got[step][tag] == pytest.approx(value, rel=1e-6), (step, tag)


def test_tensorboardx_is_found_at_start_and_imported_at_the_first_event() -> None:
    code = ("import sys, zerojax\nfrom zerojax.app.monitor import check_monitors\n"
            "check_monitors(zerojax.load_config('configs/zero3.yaml'))\nprint('tensorboardX' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False"]


def test_a_missing_tensorboardx_is_one_error_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    config = zerojax.load_config(str(ROOT / "configs" / "zero3.yaml"))
    real = monitor.importlib.util.find_spec
    monkeypatch.setattr(monitor.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^tensorboard\.enabled: needs the `tensorboardX` package"):
        monitor.check_monitors(config)
