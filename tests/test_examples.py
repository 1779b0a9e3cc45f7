"""The two examples run end to end on a small size, each in a fresh process (they ask for devices)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def losses(stdout: str) -> tuple[float, float]:
    line = next(l for l in stdout.splitlines() if l.startswith("first loss"))
    parts = line.replace(",", "").split()
    return float(parts[2]), float(parts[5])


@pytest.mark.parametrize("stage", ["1", "3"])
def test_flax_loop_learns(stage: str) -> None:
    stdout = run_example("flax_loop.py", "--stage", stage, "--steps", "15")
    first, last = losses(stdout)
    assert last < first - 1.0
    assert "trained module: TinyLM, head kernel (64, 256)" in stdout  # built from a constructor


def test_port_from_deepspeed_learns_with_unmodified_config() -> None:
    config = json.loads((ROOT / "examples" / "ds_config.json").read_text())
    assert config["zero_optimization"]["stage"] == 2  # a plain DeepSpeed JSON file
    stdout = run_example("port_from_deepspeed.py", "--steps", "12")
    assert "ZeRO stage 2, batch 64 = micro 4 x accumulation 2 x data 8" in stdout
    first, last = losses(stdout)
    assert last < 0.75 * first
    assert "trained module: MLP, fc1 kernel (32, 256)" in stdout
