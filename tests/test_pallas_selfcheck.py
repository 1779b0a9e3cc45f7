"""`kernels: auto` uses the Pallas kernels only after they have proved themselves on the backend.

No GPU here, so the check is exercised two ways on CPU: `plan` is told its platform resolved to
Triton (as on a GPU) and the real check, run where a step is first made (`checked_kernels`, which
the engine and `make_train_step` call), then fails for real (Triton cannot run on a CPU device); and
the check itself runs on the interpreted kernels, correct and deliberately broken.
"""
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import zerojax
import zerojax.planner.plan
from helpers import ADAM, data_mesh, make_config, mlp_params
from zerojax.pallas import adam, loss_scale, selfcheck
from zerojax.core.step import checked_kernels
from zerojax.pallas.backend import INTERPRET, TRITON, XLA

PARAMS0 = mlp_params(0)
CPU = jax.devices("cpu")[0]


@pytest.fixture(autouse=True)
def fresh_verdicts() -> Any:
    selfcheck.forget()
    yield
    selfcheck.forget()


@pytest.fixture
def as_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan` resolves `auto` and `pallas` to Triton, as it does on a GPU platform."""
    real = zerojax.planner.plan.resolve_kernels

    def on_gpu(kernels: str, platform: str, optimizer: str) -> str:
        return real(kernels, "gpu", optimizer)
    monkeypatch.setattr(zerojax.planner.plan, "resolve_kernels", on_gpu)


def test_auto_falls_back_to_xla_with_one_line_when_the_kernels_do_not_build(as_on_gpu: None, capsys) -> None:
    planned = zerojax.plan(make_config(2), data_mesh(), PARAMS0)
    assert planned.kernels == TRITON        # making a plan compiles nothing: the check runs with the step
    first = checked_kernels(planned)
    second = checked_kernels(zerojax.plan(make_config(1), data_mesh(), PARAMS0))
    assert first.kernels == XLA and second.kernels == XLA
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines          # one line per process and backend, not per plan
    assert lines[0].startswith("zerojax: kernels: auto: using the XLA (optax) update; the Pallas kernels' "
                               "self-check failed (triton on cpu): compile/run error: ")


def test_a_pipeline_engine_runs_the_check_and_names_the_update_that_runs(as_on_gpu: None, capsys) -> None:
    """Pipelines use the fused update too, so `auto` checks it where the pipelined step is made."""
    from flax import nnx
    module = zerojax.PipelineModule([lambda b: b["x"], zerojax.LayerSpec(nnx.Linear, 4, 4), jnp.tanh,
                                     zerojax.LayerSpec(nnx.Linear, 4, 4)],
                                    loss_fn=lambda out, b: jnp.mean((out - b["y"]) ** 2))
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "optimizer": ADAM,
           "mesh": {"stage": 2, "data": 4}}
    engine = zerojax.initialize(cfg, model=module)
    assert engine.plan.kernels == XLA and engine.pipeline.plan.kernels == XLA
    assert "self-check failed (triton on cpu)" in capsys.readouterr().out


def test_pallas_fails_loudly_when_the_kernels_do_not_build(as_on_gpu: None) -> None:
    with pytest.raises(zerojax.ConfigError, match=r"^kernels: 'pallas' forces the fused kernels, but their "
                                                  r"self-check failed \(triton on cpu\): compile/run error: .*"
                                                  r"; use kernels: auto \(falls back to the optax update\) or xla$"):
        zerojax.make_train_step(zerojax.plan(make_config(2, kernels="pallas"), data_mesh(), PARAMS0), lambda p, b: 0.0)


def test_a_passing_check_keeps_the_kernels_and_runs_once(capsys) -> None:
    calls = []

    def ok(backend: str, device: Any) -> selfcheck.Verdict:
        calls.append((backend, device.platform))
        return selfcheck.Verdict(True)
    for requested in ("auto", "pallas", "auto"):
        assert selfcheck.settle(requested, TRITON, CPU, check=ok) == TRITON
    assert calls == [(TRITON, "cpu")]
    assert capsys.readouterr().out == ""


def test_xla_and_the_interpret_mode_of_pallas_on_cpu_are_not_checked() -> None:
    def fail(backend: str, device: Any) -> selfcheck.Verdict:
        raise AssertionError("checked")
    assert selfcheck.settle("xla", XLA, CPU, check=fail) == XLA
    assert selfcheck.settle("pallas", INTERPRET, CPU, check=fail) == INTERPRET
    assert zerojax.plan(make_config(1, kernels="pallas"), data_mesh(), PARAMS0).kernels == INTERPRET


def wrong_adam(*args: Any, **kw: Any) -> Any:
    p, m, v, cast = adam.adam_update_reference(*args, **kw)
    p = [x + 1e-4 * jnp.abs(x).max() for x in p]                   # 1e-4 of the scale: 100x the tolerance
    return p, m, v, [x.astype(cast[0].dtype) for x in p]


def wrong_counts(grads: Any, inv_scale: Any, **kw: Any) -> Any:
    sumsq, bad = loss_scale.grad_stats_reference(grads, inv_scale)
    return sumsq, [b * 0 for b in bad]                             # misses the inf and the NaN


def raises(*args: Any, **kw: Any) -> Any:
    raise RuntimeError("ptxas fatal: something the GPU compiler said\nsecond line")


@pytest.mark.parametrize("adam_fn, stats_fn, reason", [
    (wrong_adam, loss_scale.grad_stats_reference,
     r"mismatch with the jnp reference: max error 1\.0\de-04 x max \|reference\| \(tolerance 1e-06\)"),
    (adam.adam_update_reference, wrong_counts,
     r"mismatch with the jnp reference: non-finite counts \[0, 0, 0, 0\], expected \[0, 2, 0, 0\]"),
    (raises, loss_scale.grad_stats_reference,
     r"compile/run error: RuntimeError: ptxas fatal: something the GPU compiler said"),
], ids=["wrong-update", "wrong-counts", "compile-error"])
def test_a_failing_check_falls_back_under_auto_and_raises_under_pallas(
        monkeypatch: pytest.MonkeyPatch, capsys, adam_fn: Any, stats_fn: Any, reason: str) -> None:
    monkeypatch.setattr(adam, "adam_update_pallas", adam_fn)
    monkeypatch.setattr(loss_scale, "grad_stats_pallas", stats_fn)
    verdict = selfcheck.run_check(INTERPRET, CPU)
    assert not verdict.ok and re.fullmatch(reason, verdict.reason), verdict
    assert selfcheck.settle("auto", INTERPRET, CPU, check=lambda b, d: verdict, checked=(INTERPRET,)) == XLA
    out = capsys.readouterr().out
    assert out == (f"zerojax: kernels: auto: using the XLA (optax) update; the Pallas kernels' self-check "
                   f"failed (interpret on cpu): {verdict.reason}\n")
    with pytest.raises(zerojax.ConfigError, match="^kernels: 'pallas' forces the fused kernels"):
        selfcheck.settle("pallas", INTERPRET, CPU, check=lambda b, d: verdict, checked=(INTERPRET,))


def test_the_check_passes_through_settle_with_the_real_kernels_interpreted() -> None:
    """The seam tests use: `checked` makes settle run the real check on the interpret backend."""
    assert selfcheck.settle("auto", INTERPRET, CPU, checked=(INTERPRET,)) == INTERPRET
    assert selfcheck.verdict(INTERPRET, CPU, check=None) == selfcheck.Verdict(True)   # cached
