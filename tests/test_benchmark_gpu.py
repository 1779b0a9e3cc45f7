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
    ran = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--tiny", "--warmup", "1", "--rounds", "2",
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
    assert r["errors"] == {}
    # numbers brought back from a GPU machine render to the same table here
    again = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--from-json", str(out), "--out", str(page)],
                           cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=600)
    assert again.stdout == ran.stdout and "| ZeRO stage 3 |" in again.stdout


def test_a_failing_section_leaves_its_traceback_and_the_others_still_report(monkeypatch):
    """One command per lease: a section that breaks on the card must not take the rest down with it."""
    import argparse
    from benchmarks import gpu

    def broken(*_):
        raise RuntimeError("out of memory on the card")

    monkeypatch.setattr(gpu, "measure_training", broken)
    monkeypatch.setattr(gpu, "measure_adam", lambda n, args, device: {
        "backend": "triton", "parameters": n, "fused_gbps": 0.9, "copy_gbps": 1.0, "optax_gbps": 0.5})
    saved = []
    args = argparse.Namespace(tiny=True, adam_params=1000, warmup=1, rounds=2, batch=4, attention="auto", no_remat=False)
    r = gpu.measure(args, lambda out: saved.append(sorted(k for k in ("training", "adam", "generate") if k in out)))
    assert "out of memory on the card" in r["errors"]["training"] and "training" not in r
    assert r["adam"]["parameters"] == 1000 and "generate" not in r  # generation needs the trained engine
    assert saved == [[], ["adam"]]  # written after each section, so a cut-short run keeps what it measured
    assert "Not measured: training failed (RuntimeError: out of memory on the card)." in gpu.render(r)
