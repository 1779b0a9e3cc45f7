"""benchmarks/gpu.py's CPU path: the one command a lent GPU runs, at a toy size, end to end."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_runs_and_reports_every_number(tmp_path):
    out = tmp_path / "gpu.json"
    page = tmp_path / "benchmarks.md"
    page.write_text("untouched\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as on one GPU
    env["JAX_PLATFORMS"] = "cpu"
    subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--tiny", "--warmup", "1", "--rounds", "2",
                    "--batch", "4", "--adam-params", "20000", "--json", str(out), "--out", str(page)],
                   cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=600)
    r = json.loads(out.read_text())
    assert r["platform"] == "cpu" and r["size"] == "tiny" and r["peak_source"] == "measured bf16 matmul"
    assert set(r["training"]["stages"]) == {"stage 0", "stage 3"}
    for row in r["training"]["stages"].values():
        # the same initial weights and batch: the library's step and the hand-written one agree
        assert abs(row["first_loss"] - row["baseline_first_loss"]) < 1e-3 * abs(row["baseline_first_loss"])
        assert row["tokens_per_s"] > 0 and row["baseline_tokens_per_s"] > 0 and 0 < row["mfu"] < 1
    assert r["adam"]["backend"] == "interpret" and r["adam"]["copy_gbps"] > 0
    assert [g["batch"] for g in r["generate"]] == [1, 4]
    assert all(g["tokens_per_s"] > 0 and g["bound_tokens_per_s"] > 0 for g in r["generate"])
    assert page.read_text() == "untouched\n"  # CPU numbers never replace a GPU's table
