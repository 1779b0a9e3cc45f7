"""The Comet monitor: an offline experiment archive (what `comet upload` sends) holding the same
Train/Samples/* events at the same values as metrics.jsonl, DeepSpeed's samples_log_interval, and one
clear error before compiling when comet_ml is absent."""
from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from helpers import assert_absent_package_refused, samples_events, train_with_monitor
from zerojax.app.monitor import CometLog

def _train(tmp_path: Path, *args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    return train_with_monitor(tmp_path, "comet", *args, env={"HOME": str(tmp_path)},  # nothing in ~
                              drop=[k for k in os.environ if k.startswith("COMET_")], pythonpath=pythonpath)


def _metrics(archive: Path) -> dict[int, dict[str, float]]:
    """The metric messages of an offline archive's messages.json (one JSON message a line), by step."""
    rows: dict[int, dict[str, float]] = {}
    with zipfile.ZipFile(archive) as z:
        for line in z.read("messages.json").decode().splitlines():
            message = json.loads(line)
            if message["type"] == "metric_msg":
                metric = message["payload"]["metric"]
                if metric["metricName"].startswith("Train/"):
                    rows.setdefault(metric["step"], {})[metric["metricName"]] = metric["metricValue"]
    return rows


def test_offline_archive_holds_the_metrics(tmp_path: Path) -> None:
    pytest.importorskip("comet_ml")  # the test extra installs it
    proc = _train(tmp_path, "comet.online=false", "comet.project=tiny", "comet.experiment_name=tiny-run",
                  "comet.samples_log_interval=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "run" / "comet"
    assert f"archived in {folder} when the run ends" in proc.stdout
    archives = list(folder.glob("*.zip"))
    assert len(archives) == 1, list(folder.iterdir())
    with zipfile.ZipFile(archives[0]) as z:
        assert json.loads(z.read("experiment.json"))["project_name"] == "tiny"
    assert _metrics(archives[0]) == samples_events(tmp_path / "run")


class _Experiment:
    def __init__(self) -> None:
        self.logged: list[tuple[str, float, int]] = []

    def log_metric(self, name: str, value: float, step: int) -> None:
        self.logged.append((name, value, step))


def test_samples_log_interval_as_deepspeed() -> None:
    """DeepSpeed's EventsLogScheduler: first value of each event, then once the interval has passed."""
    experiment = _Experiment()
    log = CometLog(experiment, samples_log_interval=64)
    for samples in (32, 64, 96, 128, 160):
        log.log({"Train/Samples/lr": samples / 10}, samples)
    log.log({"Train/Samples/val_loss": 1.0}, 160)  # a new event: logged at once
    assert experiment.logged == [("Train/Samples/lr", 3.2, 32), ("Train/Samples/lr", 9.6, 96),
                                 ("Train/Samples/lr", 16.0, 160), ("Train/Samples/val_loss", 1.0, 160)]


def test_missing_comet_ml_fails_before_compiling(tmp_path: Path) -> None:
    assert_absent_package_refused(tmp_path, "comet", "comet_ml", _train)


def test_a_key_the_server_refuses_fails_before_compiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    """comet_ml does not raise on a refused key or an unreachable server: it logs an error and returns
    an experiment that is not alive, which would drop every event. The run stops at start with one line."""
    comet_ml = pytest.importorskip("comet_ml")
    from test_cli import SMALL
    from zerojax.app.cli import main

    class Dead:  # what comet_ml.start returns then (Experiment.alive is False)
        alive = False

        def get_key(self) -> str:
            return "0" * 32

    monkeypatch.setattr(comet_ml, "start", lambda **kwargs: Dead())
    code = main(["train", "--config", "configs/zero1.yaml", "--set", *SMALL, "run.steps=3", "comet.enabled=true",
                 "comet.api_key=not-a-key", f"run.output_dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("zerojax: error: comet: the Comet experiment did not start") and "COMET_API_KEY" in err
    assert "comet.online: false" in err and "comet.enabled: false" in err
    assert "compiled step" not in out and not (tmp_path / "run" / "config.json").exists()
