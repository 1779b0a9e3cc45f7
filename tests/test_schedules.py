"""DeepSpeed's schedulers, update by update.

DeepSpeed builds the scheduler at last_batch_iteration (-1 for a new run) and steps it after every
applied optimizer step, so the optimizer step with optax count k (k >= 1) runs at scheduler position
last_batch_iteration + k, while count 0 runs with whatever the constructor left in the optimizer.
The reference functions below write DeepSpeed's formulas out in float64; the literal sequences were
recorded from deepspeed 0.19.8 (torch 2.13 CPU) by reading `optimizer.param_groups[0]` before each
`scheduler.step()`, with a torch AdamW whose lr is BASE_LR and betas (0.9, 0.999).
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.config import load_config
from zerojax.errors import ConfigError
from zerojax.optim.schedules import make_schedule

BASE_LR = 0.05


def scheduler(type_: str, lr: float = BASE_LR, **params):
    cfg = load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": lr}},
                       "scheduler": {"type": type_, "params": params}})
    return cfg.scheduler


def values(fn, n: int) -> np.ndarray:
    return np.array([float(fn(k)) for k in range(n)])


def by_count(start: float, at_position, last_batch_iteration: int, n: int) -> list[float]:
    """What the optimizer holds at each of the first n applied steps (see the module doc)."""
    return [start] + [at_position(last_batch_iteration + k) for k in range(1, n)]


def close(got, want, rtol=1e-5, atol=1e-9):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# DeepSpeed's formulas, as functions of the scheduler position (last_batch_iteration).

def ds_warmup_gamma(pos: int, warmup: int, kind: str) -> float:
    warmup = max(2, warmup)
    return math.log(pos + 1) / math.log(warmup) if kind == "log" else pos / warmup


def ds_warmup_lr(pos, lo, hi, warmup, kind="log"):
    gamma = ds_warmup_gamma(pos, warmup, kind) if pos < max(2, warmup) else 1.0
    return lo + (hi - lo) * gamma


def ds_warmup_decay_lr(pos, lo, hi, warmup, total, kind="log"):
    w = max(2, warmup)
    gamma = ds_warmup_gamma(pos, w, kind) if pos < w else max(0.0, (total - pos) / max(1.0, total - w))
    return lo + (hi - lo) * gamma


def ds_cosine_ratio(pos, total, warmup, min_ratio, cos_min, kind="log"):
    w = max(2, warmup)
    if pos < w:
        return min_ratio + (1 - min_ratio) * ds_warmup_gamma(pos, w, kind)
    progress = min(1.0, (pos - w + 1) / max(1, total - w))
    return max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


def ds_one_cycle_scale(pos, first, second, stairs1=0, stairs2=0):
    it = pos + 1  # OneCycle reads the cycle one batch ahead
    total = first + second
    x = 1.0 + it / total - math.floor(1 + it / total)
    if x <= first / total:
        scale, stairs = x / (first / total), stairs1
    else:
        scale, stairs = (x - 1) / (first / total - 1), stairs2
    if stairs > 0:
        ci = it % total
        place = ci * stairs / first if ci <= first else (total - ci) * stairs / second
        scale = math.floor(place) / stairs
    return scale


def ds_one_cycle(pos, lo, hi, first, second, mom_lo=0.8, mom_hi=0.9, stairs1=0, stairs2=0,
                 decay_steps=0, lr_rate=0.0, mom_rate=0.0):
    """(lr, beta1) at a position."""
    total = first + second
    if pos < total:
        s = ds_one_cycle_scale(pos, first, second, stairs1, stairs2)
        return lo + (hi - lo) * s, mom_hi - (mom_hi - mom_lo) * s
    k = pos - total + 1
    lr = lo if decay_steps == 0 or lr_rate == 0 else lo / (1 + lr_rate * k / decay_steps)
    mom = mom_hi if decay_steps == 0 or mom_rate == 0 else mom_hi * (1 + mom_rate * k / decay_steps)
    return lr, mom


def ds_range_test(pos, lo, size, rate, staircase):
    interval = (pos + 1) / size
    return lo * (1 + rate * (math.floor(interval) if staircase else interval))


# ---------------------------------------------------------------------------------------------

def test_no_scheduler_is_the_constant_optimizer_lr():
    s = make_schedule(None, 3e-4)
    assert s.beta1 is None and s.beta2 is None
    for k in (0, 1, 7, 10**6):
        assert float(s.lr(k)) == pytest.approx(3e-4)
    assert s.lr(0).dtype == jnp.float32


def test_warmup_lr_repeats_min_lr_on_the_first_two_steps():
    s = make_schedule(scheduler("WarmupLR", warmup_min_lr=0.001, warmup_max_lr=0.1, warmup_num_steps=10), BASE_LR)
    deepspeed = [0.001, 0.001, 0.03080197, 0.048235, 0.06060394, 0.07019803, 0.07803697, 0.08466471,
                 0.09040591, 0.09547001, 0.1, 0.1, 0.1, 0.1]
    close(values(s.lr, 14), deepspeed, rtol=1e-6)
    close(values(s.lr, 40), by_count(0.001, lambda t: ds_warmup_lr(t, 0.001, 0.1, 10), -1, 40))
    assert s.beta1 is None


def test_warmup_lr_linear_mid_and_end_of_warmup():
    s = make_schedule(scheduler("WarmupLR", warmup_min_lr=0.001, warmup_max_lr=0.1, warmup_num_steps=10,
                                warmup_type="linear"), BASE_LR)
    got = values(s.lr, 30)
    close(got, by_count(0.001, lambda t: ds_warmup_lr(t, 0.001, 0.1, 10, "linear"), -1, 30))
    assert got[1] == pytest.approx(0.001)          # position 0
    assert got[6] == pytest.approx(0.001 + 0.099 * 5 / 10)  # position 5: half way
    assert got[10] == pytest.approx(0.001 + 0.099 * 9 / 10)  # position 9: last warmup step
    assert got[11] == pytest.approx(0.1)            # position 10: warmed up


def test_warmup_lr_defaults_to_the_optimizer_lr_and_clamps_short_warmups():
    s = make_schedule(scheduler("WarmupLR", warmup_num_steps=8), BASE_LR)
    close(values(s.lr, 12), by_count(0.0, lambda t: ds_warmup_lr(t, 0.0, BASE_LR, 8), -1, 12))
    assert float(s.lr(9)) == pytest.approx(BASE_LR)
    # warmup_num_steps 1 behaves as 2 (deepspeed 0.19.8 gives these)
    s = make_schedule(scheduler("WarmupLR", warmup_num_steps=1, warmup_type="linear"), BASE_LR)
    close(values(s.lr, 6), [0.0, 0.0, 0.025, 0.05, 0.05, 0.05])


def test_warmup_num_steps_zero_is_rejected_as_deepspeed_does():
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        make_schedule(scheduler("WarmupLR", warmup_num_steps=0), BASE_LR)
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        make_schedule(scheduler("WarmupCosineLR", total_num_steps=10, warmup_num_steps=0), BASE_LR)


@pytest.mark.parametrize("lbi", [0, 4])
def test_warmup_lr_last_batch_iteration_starts_from_the_optimizer_lr(lbi):
    # The constructor writes nothing when resuming, so the first step uses the optimizer's own lr.
    s = make_schedule(scheduler("WarmupLR", warmup_min_lr=0.001, warmup_max_lr=0.1, warmup_num_steps=10,
                                last_batch_iteration=lbi), BASE_LR)
    close(values(s.lr, 20), by_count(BASE_LR, lambda t: ds_warmup_lr(t, 0.001, 0.1, 10), lbi, 20))
    deepspeed = {0: [0.05, 0.03080197, 0.048235, 0.06060394], 4: [0.05, 0.07803697, 0.08466471, 0.09040591]}
    close(values(s.lr, 4), deepspeed[lbi], rtol=1e-6)


def test_warmup_decay_lr_warms_up_then_falls_to_zero_at_total_num_steps():
    s = make_schedule(scheduler("WarmupDecayLR", warmup_min_lr=0.0, warmup_max_lr=0.2, warmup_num_steps=5,
                                total_num_steps=20), BASE_LR)
    got = values(s.lr, 30)
    close(got, by_count(0.0, lambda t: ds_warmup_decay_lr(t, 0.0, 0.2, 5, 20), -1, 30))
    close(got[:9], [0.0, 0.0, 0.08613531, 0.13652124, 0.17227062, 0.2, 0.2, 0.18666667, 0.17333333], rtol=1e-6)
    assert got[21] == 0.0 and got[29] == 0.0  # position 20 and beyond


def test_warmup_decay_lr_linear_with_last_batch_iteration():
    s = make_schedule(scheduler("WarmupDecayLR", warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=5,
                                total_num_steps=20, warmup_type="linear", last_batch_iteration=2), BASE_LR)
    got = values(s.lr, 25)
    close(got, by_count(BASE_LR, lambda t: ds_warmup_decay_lr(t, 0.01, 0.2, 5, 20, "linear"), 2, 25))
    close(got[:5], [0.05, 0.124, 0.162, 0.2, 0.18733333], rtol=1e-6)


def test_warmup_decay_lr_keeps_warming_up_when_total_is_shorter():
    s = make_schedule(scheduler("WarmupDecayLR", warmup_num_steps=25, total_num_steps=20, warmup_max_lr=0.3), BASE_LR)
    close(values(s.lr, 30), by_count(0.0, lambda t: ds_warmup_decay_lr(t, 0.0, 0.3, 25, 20), -1, 30))


def test_warmup_decay_lr_without_max_lr_uses_deepspeeds_1e3():
    # WarmupDecayLR's own signature default is 0.001; it never falls back to the optimizer lr.
    cfg = scheduler("WarmupDecayLR", warmup_num_steps=5, total_num_steps=20)
    cfg = dataclasses.replace(cfg, params=dataclasses.replace(cfg.params, warmup_max_lr=None))
    got = values(make_schedule(cfg, BASE_LR).lr, 8)
    close(got, [0.0, 0.0, 0.00043068, 0.00068261, 0.00086135, 0.001, 0.001, 0.00093333], rtol=2e-5)


def test_warmup_cosine_lr_first_step_is_zero_then_ratios_of_the_optimizer_lr():
    lr = 0.1
    s = make_schedule(scheduler("WarmupCosineLR", lr=lr, total_num_steps=20, warmup_num_steps=5,
                                warmup_min_ratio=0.1, cos_min_ratio=0.05, warmup_type="linear"), lr)
    got = values(s.lr, 40)
    ratio = lambda t: ds_cosine_ratio(t, 20, 5, 0.1, 0.05, "linear")  # noqa: E731
    close(got, by_count(0.0, lambda t: lr * ratio(t), -1, 40))
    assert got[0] == 0.0                            # constructor: "not started", not warmup_min_ratio
    assert got[1] == pytest.approx(lr * 0.1)        # position 0: warmup_min_ratio
    assert got[6] == pytest.approx(lr * (0.05 + 0.95 * (1 + math.cos(math.pi / 15)) / 2))  # first cosine step
    close(got[21:], lr * 0.05)                      # held at cos_min_ratio from position 19 on
    close(got[:8], [0.0, 0.01, 0.028, 0.046, 0.064, 0.082, 0.09896201, 0.09589341], rtol=1e-6)


def test_warmup_cosine_lr_log_and_late_decay_precision():
    lr = 0.1
    s = make_schedule(scheduler("WarmupCosineLR", lr=lr, total_num_steps=20, warmup_num_steps=5), lr)
    close(values(s.lr, 30), by_count(0.0, lambda t: lr * ds_cosine_ratio(t, 20, 5, 0.0, 1e-4), -1, 30), rtol=2e-6)
    # deepspeed 0.19.8 near the end of the decay, where the lr is small
    close(values(s.lr, 22)[17:], [0.0095581954, 0.0043322948, 0.0011025107, 1e-05, 1e-05], rtol=1e-5)


def test_warmup_cosine_lr_total_shorter_than_warmup_and_resume():
    lr = 0.1
    s = make_schedule(scheduler("WarmupCosineLR", lr=lr, total_num_steps=4, warmup_num_steps=6,
                                warmup_min_ratio=0.2), lr)
    close(values(s.lr, 12), by_count(0.0, lambda t: lr * ds_cosine_ratio(t, 4, 6, 0.2, 1e-4), -1, 12))
    s = make_schedule(scheduler("WarmupCosineLR", lr=lr, total_num_steps=20, warmup_num_steps=5,
                                warmup_min_ratio=0.1, last_batch_iteration=3), lr)
    close(values(s.lr, 25), by_count(lr, lambda t: lr * ds_cosine_ratio(t, 20, 5, 0.1, 1e-4), 3, 25))


def test_one_cycle_lr_and_momentum_over_a_symmetric_cycle():
    s = make_schedule(scheduler("OneCycle", cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=5), BASE_LR)
    lr, b1, b2 = values(s.lr, 30), values(s.beta1, 30), values(s.beta2, 30)
    close(lr[:12], [0.01, 0.028, 0.046, 0.064, 0.082, 0.1, 0.082, 0.064, 0.046, 0.028, 0.01, 0.01], rtol=1e-6)
    # The constructor writes beta1 = cycle_min_mom; the cycle itself starts at cycle_max_mom.
    close(b1[:12], [0.8, 0.88, 0.86, 0.84, 0.82, 0.8, 0.82, 0.84, 0.86, 0.88, 0.9, 0.9], rtol=1e-6)
    close(b2, 0.99)
    ref = [ds_one_cycle(t, 0.01, 0.1, 5, 5) for t in range(-1, 29)]
    close(lr[1:], [r[0] for r in ref[1:]])
    close(b1[1:], [r[1] for r in ref[1:]])


def test_one_cycle_asymmetric_with_post_cycle_decay():
    kw = dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, cycle_second_step_size=6,
              decay_step_size=3, decay_lr_rate=0.5, decay_mom_rate=0.01)
    s = make_schedule(scheduler("OneCycle", **kw), BASE_LR)
    ref = by_count((0.01, 0.8), lambda t: ds_one_cycle(t, 0.01, 0.1, 4, 6, decay_steps=3, lr_rate=0.5,
                                                       mom_rate=0.01), -1, 40)
    close(values(s.lr, 40), [r[0] for r in ref])
    close(values(s.beta1, 40), [r[1] for r in ref])
    # deepspeed 0.19.8: decay begins right after the cycle; DeepSpeed multiplies beta1 up
    close(values(s.lr, 14)[10:], [0.01, 0.00857143, 0.0075, 0.00666667], rtol=1e-6)
    close(values(s.beta1, 14)[10:], [0.9, 0.903, 0.906, 0.909], rtol=1e-6)


@pytest.mark.parametrize("first,second,stairs1,stairs2", [(6, 9, 3, 2), (6, 6, 4, 4), (5, 7, 0, 3)])
def test_one_cycle_stairs(first, second, stairs1, stairs2):
    s = make_schedule(scheduler("OneCycle", cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=first,
                                cycle_second_step_size=second, cycle_first_stair_count=stairs1,
                                cycle_second_stair_count=stairs2), BASE_LR)
    ref = by_count((0.01, 0.8), lambda t: ds_one_cycle(t, 0.01, 0.1, first, second, stairs1=stairs1,
                                                       stairs2=stairs2), -1, 30)
    close(values(s.lr, 30), [r[0] for r in ref])
    close(values(s.beta1, 30), [r[1] for r in ref])
    deepspeed = {(6, 9): [0.01, 0.01, 0.04, 0.04, 0.07, 0.07, 0.1, 0.055, 0.055, 0.055, 0.055, 0.01],
                 (6, 6): [0.01, 0.01, 0.0325, 0.055, 0.055, 0.0775, 0.1, 0.0775, 0.055, 0.055, 0.0325, 0.01],
                 (5, 7): [0.01, 0.028, 0.046, 0.064, 0.082, 0.1, 0.07, 0.07, 0.04, 0.04, 0.01, 0.01]}
    close(values(s.lr, 12), deepspeed[(first, second)], rtol=1e-6)


def test_one_cycle_resume_starts_from_the_optimizer_lr_and_betas():
    kw = dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=5, last_batch_iteration=3,
              decay_step_size=2, decay_lr_rate=0.3)
    s = make_schedule(scheduler("OneCycle", **kw), BASE_LR, base_betas=(0.9, 0.999))
    close(values(s.lr, 10), [0.05, 0.1, 0.082, 0.064, 0.046, 0.028, 0.01, 0.00869565, 0.00769231, 0.00689655],
          rtol=1e-6)
    close(values(s.beta1, 8), [0.9, 0.8, 0.82, 0.84, 0.86, 0.88, 0.9, 0.9], rtol=1e-6)
    close(values(s.beta2, 3), [0.999, 0.99, 0.99])
    ref = by_count((BASE_LR, 0.9), lambda t: ds_one_cycle(t, 0.01, 0.1, 5, 5, decay_steps=2, lr_rate=0.3), 3, 30)
    close(values(s.lr, 30), [r[0] for r in ref])


def test_one_cycle_without_momentum_cycling():
    s = make_schedule(scheduler("OneCycle", cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=5,
                                cycle_momentum=False, decay_step_size=2, decay_mom_rate=0.5), BASE_LR)
    assert s.beta1 is None and s.beta2 is None
    close(values(s.lr, 14), [0.01, 0.028, 0.046, 0.064, 0.082, 0.1, 0.082, 0.064, 0.046, 0.028, 0.01, 0.01,
                             0.01, 0.01], rtol=1e-6)  # decay_lr_rate 0: no lr decay
    # Optimizers without betas (SGD, Adagrad): DeepSpeed turns momentum cycling off.
    s = make_schedule(scheduler("OneCycle", cycle_min_lr=0.01, cycle_max_lr=0.1), BASE_LR, base_betas=None)
    assert s.beta1 is None and s.beta2 is None


def test_lr_range_test_continuous_and_staircase():
    s = make_schedule(scheduler("LRRangeTest", lr_range_test_min_lr=0.002, lr_range_test_step_size=4,
                                lr_range_test_step_rate=0.5), BASE_LR)
    close(values(s.lr, 30), by_count(0.002, lambda t: ds_range_test(t, 0.002, 4, 0.5, False), -1, 30))
    close(values(s.lr, 4), [0.002, 0.00225, 0.0025, 0.00275], rtol=1e-6)
    s = make_schedule(scheduler("LRRangeTest", lr_range_test_min_lr=0.002, lr_range_test_step_size=4,
                                lr_range_test_step_rate=2.0, lr_range_test_staircase=True), BASE_LR)
    close(values(s.lr, 30), by_count(0.002, lambda t: ds_range_test(t, 0.002, 4, 2.0, True), -1, 30))
    close(values(s.lr, 9), [0.002] * 4 + [0.006] * 4 + [0.01], rtol=1e-6)


def test_lr_range_test_resume():
    s = make_schedule(scheduler("LRRangeTest", lr_range_test_min_lr=0.002, lr_range_test_step_size=3,
                                lr_range_test_staircase=True, last_batch_iteration=5), BASE_LR)
    close(values(s.lr, 7), [0.05, 0.006, 0.006, 0.008, 0.008, 0.008, 0.01], rtol=1e-6)


def test_schedules_trace_under_jit_with_a_traced_count():
    schedules = [
        make_schedule(None, BASE_LR),
        make_schedule(scheduler("WarmupLR", warmup_num_steps=10), BASE_LR),
        make_schedule(scheduler("WarmupDecayLR", warmup_num_steps=5, total_num_steps=20), BASE_LR),
        make_schedule(scheduler("WarmupCosineLR", total_num_steps=20, warmup_num_steps=5), BASE_LR),
        make_schedule(scheduler("OneCycle", cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                                cycle_first_stair_count=2, decay_step_size=2, decay_lr_rate=0.1), BASE_LR),
        make_schedule(scheduler("LRRangeTest", lr_range_test_staircase=True, lr_range_test_step_size=3), BASE_LR),
    ]
    fns = [f for s in schedules for f in s if f is not None]

    @jax.jit
    def all_at(count):
        return jnp.stack([f(count) for f in fns])

    for k in (0, 1, 2, 5, 9, 17, 33):
        traced = all_at(jnp.int32(k))
        assert traced.dtype == jnp.float32
        close(traced, [float(f(k)) for f in fns], rtol=1e-6)

    # and inside a scan, as an optimizer step would call it
    def body(count, _):
        return count + 1, jnp.stack([f(count) for f in fns])
    _, scanned = jax.lax.scan(body, jnp.int32(0), None, length=12)
    close(scanned, [[float(f(k)) for f in fns] for k in range(12)], rtol=1e-6)


def test_long_runs_stay_accurate_in_float32():
    s = make_schedule(scheduler("WarmupDecayLR", warmup_max_lr=1e-3, warmup_num_steps=2000,
                                total_num_steps=1_000_000), BASE_LR)
    for k in (1000, 2001, 500_000, 999_990):
        assert float(s.lr(k)) == pytest.approx(ds_warmup_decay_lr(k - 1, 0.0, 1e-3, 2000, 1_000_000), rel=1e-5)


def test_a_run_shorter_than_its_schedule_is_warned_at_start_up() -> None:
    """`--set run.steps=30` under a WarmupDecayLR sized for 200 ends at the peak lr: the start-up line names
    run.steps and the schedule's keys, and the lr the last step runs with (the lr metrics.jsonl writes)."""
    from zerojax import load_config
    from zerojax.app.reports import schedule_warning
    from zerojax.optim.schedules import make_schedule
    sched = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 30,
                                                 "total_num_steps": 200, "warmup_type": "linear"}}
    base = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": sched}
    config = load_config(base, ["run.steps=30"])
    last_lr = float(make_schedule(config.scheduler, 1e-3).lr(29))
    assert last_lr == pytest.approx(1e-3 * 28 / 30, rel=1e-6)  # near the peak (DeepSpeed's position: 28), no decay
    end_lr = float(make_schedule(config.scheduler, 1e-3).lr(199))  # step 200's update: near 0
    assert end_lr < 2e-5
    assert schedule_warning(config) == (
        f"warning: run.steps=30 is shorter than the WarmupDecayLR schedule (scheduler.params.total_num_steps=200): "
        f"the run ends at lr {last_lr:.3e}, where the schedule goes on to lr {end_lr:.3e} at step 200; to run the "
        f"whole schedule set scheduler.params.total_num_steps=30, or set run.steps=200")
    short = schedule_warning(load_config(base, ["run.steps=10"]))  # inside the warmup too: both keys named
    assert "(scheduler.params.warmup_num_steps=30, scheduler.params.total_num_steps=200)" in short
    assert "set scheduler.params.total_num_steps=10 with scheduler.params.warmup_num_steps below it" in short
    assert schedule_warning(load_config(base, ["run.steps=200"])) is None
    assert schedule_warning(load_config(base, ["run.steps=500"])) is None
    assert schedule_warning(load_config({**base, "scheduler": None}, ["run.steps=3"])) is None
    range_test = {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 1000}}  # no end to reach
    assert schedule_warning(load_config({**base, "scheduler": range_test}, ["run.steps=3"])) is None
