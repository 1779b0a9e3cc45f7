"""comms_logger, memory_breakdown, wall_clock_breakdown and flops_profiler.output_file in a run.

The comms logger reads the collectives of the compiled train step: its bytes must be the ZeRO
paper's volumes for the plan (reduce-scatter Ψ + all-gather Ψ per device for stage 2), so the test
checks them against Ψ computed from the parameters, not against numbers copied from a run.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import jax
import pytest

import zerojax
from helpers import data_mesh, make_batch, make_config, mlp_params, mse_loss

SMALL = ["run.steps=4", "run.log_every=2", "steps_per_print=2", "model.d_model=32", "model.n_layers=1",
         "model.n_heads=2", "model.seq_len=16", "data.max_bytes=50000", "run.eval_batches=0",
         "run.progress=false", "run.save_every=100", "scheduler.params.total_num_steps=4",
         "scheduler.params.warmup_num_steps=1"]


def _stage2_text() -> tuple[str, int]:
    params = mlp_params(0, divisible=True)  # every leaf shards over 8 devices
    cfg = make_config(2)
    p = zerojax.plan(cfg, data_mesh(), params)
    state = zerojax.init_state(cfg, p, params)
    step = zerojax.make_train_step(cfg, p, mse_loss)
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    return step.lower(state, make_batch(32, 0)).compile().as_text(), psi


def _row(report: str, op: str) -> tuple[int, float]:
    m = re.search(rf"^\s+{op}(?: \([^)]*\))?\s+\S+\s+(\d+)\s+([\d,]+) B", report, re.M)
    assert m, report
    return int(m.group(1)), float(m.group(2).replace(",", ""))


def test_report_counts_zero_paper_bytes() -> None:
    from zerojax.measure.hlo import comms_report
    text, psi = _stage2_text()
    report = comms_report(text)
    n = 8
    _, rs = _row(report, "reduce-scatter")
    _, ag = _row(report, "all-gather")
    want = 4 * psi * (n - 1) / n  # fp32 gradients reduce-scattered, fp32 parameters gathered
    assert rs == pytest.approx(want, rel=1e-3) and ag == pytest.approx(want, rel=1e-3)
    # Over 3 steps every count and byte triples.
    count1, _ = _row(report, "reduce-scatter")
    count3, rs3 = _row(comms_report(text, steps=3), "reduce-scatter")
    assert count3 == 3 * count1 and rs3 == pytest.approx(3 * rs, rel=1e-3)
    # prof_ops: only the named kinds; verbose / debug list each op with its computation.
    only = comms_report(text, kinds={"all-gather"}, verbose=True, debug=True)
    assert "reduce-scatter" not in only and "all-gather" in only
    assert re.search(r"- all-gather f32 .* per step in \S+", only)


def test_prof_ops_names_are_checked() -> None:
    cfg = zerojax.load_config({"train_batch_size": 8, "comms_logger": {"prof_ops": ["all_gather_into_tensor"]}})
    assert cfg.comms_logger.prof_ops == ("all_gather_into_tensor",)
    with pytest.raises(zerojax.ConfigError, match=r"comms_logger.prof_ops\[0\]: 'broadcast_x'"):
        zerojax.load_config({"train_batch_size": 8, "comms_logger": {"prof_ops": ["broadcast_x"]}})


def test_run_prints_comms_memory_and_time(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from zerojax.app.trainer import train
    profile = tmp_path / "flops.txt"
    config = zerojax.load_config("configs/zero2.yaml", [
        *SMALL, f"run.output_dir={tmp_path / 'run'}", "comms_logger.enabled=true", "comms_logger.prof_all=false",
        "comms_logger.prof_ops=[reduce_scatter_tensor]", "memory_breakdown=true", "wall_clock_breakdown=true",
        "flops_profiler.enabled=true", f"flops_profiler.output_file={profile}"])
    summary = train(config)
    out = capsys.readouterr().out
    reports = [block for block in out.split("comms logger:")[1:]]
    assert len(reports) == 2, out  # the first print step, then the whole run
    # the run's 4 steps and no more: the flops profiler times one of them, it trains none of its own
    assert "per step" in reports[0] and "4 steps" in reports[1]
    count1, bytes1 = _row(reports[0], "reduce-scatter")
    count4, bytes4 = _row(reports[1], "reduce-scatter")
    assert count1 > 0 and bytes1 > 0 and count4 == 4 * count1 and bytes4 == pytest.approx(4 * bytes1, rel=1e-3)
    assert "all-gather" not in reports[0].split("total")[0]  # prof_ops kept only reduce-scatter
    assert "reduce-scatter (data)" in reports[0]  # the run's mesh names each collective's axes
    assert out.count("memory breakdown: measured on device 0") == 2  # steps 2 and 4
    assert len(re.findall(r": live arrays [\d.]+ MiB", out)) == 2 * len(jax.local_devices())
    times = re.findall(r"time per step: data ([\d.]+) ms, dispatch ([\d.]+) ms, device ([\d.]+) ms, log", out)
    assert len(times) == 2, out
    assert "flops profile:" in profile.read_text() and "flops profile:" not in out
    assert summary["steps"] == 4, summary  # run.steps optimizer steps, none added by the profiler


def test_tag_validation_and_unused_parameters() -> None:
    from zerojax.engine.engine import validate_tag
    validate_tag("best", "best", "Fail")
    validate_tag("a", "b", "Ignore")
    with pytest.warns(UserWarning, match="tag 'a' but process 0 under 'b'"):
        validate_tag("a", "b", "Warn")
    with pytest.raises(ValueError, match="checkpoint.tag_validation: .*'a'.*'b'"):
        validate_tag("a", "b", "Fail")
    cfg = zerojax.load_config({"train_batch_size": 8, "zero_optimization": {"ignore_unused_parameters": False}})
    with pytest.raises(zerojax.ConfigError, match="ignore_unused_parameters: false is not supported"):
        zerojax.plan(cfg, data_mesh(), mlp_params(0))
