"""Schedules as data: dependencies, bubble, buffer slots and DeepSpeed's 1F1B order (no devices)."""
from __future__ import annotations

import itertools

import pytest

import zerojax
from zerojax.pipeline.schedule import (Backward, Forward, LoadMicroBatch, OptimizerStep, RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad, build)

CASES = [(s, m) for s in (2, 4) for m in (1, 3, s, 2 * s)]


def ops(sched: zerojax.pipeline.Schedule) -> dict[tuple[str, int, int], int]:
    """(F or B, micro-batch, virtual stage) -> tick."""
    out = {}
    for t, row in enumerate(sched.ticks):
        for s, instrs in enumerate(row):
            for ins in instrs:
                if isinstance(ins, (Forward, Backward)):
                    key = ("F" if isinstance(ins, Forward) else "B", ins.micro_batch, ins.chunk * sched.stages + s)
                    assert key not in out, f"{key} runs twice"
                    out[key] = t
    return out


def check_dependencies(sched: zerojax.pipeline.Schedule, training: bool = True) -> None:
    v, m = sched.stages * sched.chunks, sched.micro_batches
    when = ops(sched)
    assert len(when) == v * m * (2 if training else 1)
    for mb, st in itertools.product(range(m), range(v)):
        if st > 0:
            assert when[("F", mb, st)] > when[("F", mb, st - 1)]
        if training:
            # The forward slot runs before the backward slot, so the last stage may pair F m + B m.
            assert when[("B", mb, st)] > when[("F", mb, st)] or (
                st == v - 1 and when[("B", mb, st)] == when[("F", mb, st)])
            if st < v - 1:
                assert when[("B", mb, st)] > when[("B", mb, st + 1)]
    for t in range(sched.num_ticks):
        for s in range(sched.stages):
            kinds = [type(c) for c in sched.computes(t, s)]
            assert kinds in ([], [Forward], [Backward], [Forward, Backward], [Backward, Forward])


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "1f1b_sync"])
@pytest.mark.parametrize("stages, micro_batches", CASES)
def test_bubble_is_the_textbook_one(name: str, stages: int, micro_batches: int) -> None:
    sched = build(name, stages, micro_batches)
    check_dependencies(sched)
    bubble = (stages - 1) / (micro_batches + stages - 1)
    assert sched.bubble == pytest.approx(bubble)
    assert sched.idle_fraction == pytest.approx(bubble)   # forwards and backwards of equal cost
    if name == "1f1b_sync":  # paired: M + 2(S-1) ticks, and lockstep costs nothing extra
        assert sched.num_ticks == micro_batches + 2 * (stages - 1)
        assert sched.lockstep_idle(1, 3) == pytest.approx(bubble)
    else:
        assert sched.num_ticks == 2 * (micro_batches + stages - 1)
    if name == "gpipe":
        assert sched.lockstep_idle(1, 3) == pytest.approx(bubble)


def test_lockstep_cost_of_deepspeeds_1f1b() -> None:
    """In steady-state 1F1B, neighbouring stages run a forward and a backward in the same tick; in
    lockstep the tick lasts a backward, so the forward stage idles for the difference."""
    one_f, sync = build("1f1b", 4, 8), build("1f1b_sync", 4, 8)
    assert one_f.lockstep_idle(1, 2) == pytest.approx(0.4)
    assert sync.lockstep_idle(1, 2) == pytest.approx(3 / 11)
    # Heterogeneous stages: the cost list is per stage; a uniformly scaled list changes nothing.
    assert sync.lockstep_idle([2, 2, 2, 2], [4, 4, 4, 4]) == pytest.approx(3 / 11)
    assert sync.lockstep_idle([1, 1, 1, 2], [2, 2, 2, 4]) > 3 / 11


def live_inputs(sched: zerojax.pipeline.Schedule) -> int:
    """Most micro-batches one stage holds at once: from the tick its input arrives (stage 0: its
    forward) to the tick of its backward, both included."""
    when = ops(sched)
    peak = 0
    for s in range(sched.stages):
        arrive = {mb: when[("F", mb, max(s - 1, 0))] for mb in range(sched.micro_batches)}
        for t in range(sched.num_ticks):
            live = [mb for mb, a in arrive.items() if a <= t <= when[("B", mb, s)]]
            peak = max(peak, len(live))
    return peak


@pytest.mark.parametrize("stages, micro_batches", CASES)
def test_1f1b_bounds_live_activations_by_stages(stages: int, micro_batches: int) -> None:
    one_f, gpipe = build("1f1b", stages, micro_batches), build("gpipe", stages, micro_batches)
    sync = build("1f1b_sync", stages, micro_batches)
    assert live_inputs(one_f) <= stages and one_f.act_buffers <= stages
    assert live_inputs(gpipe) == micro_batches and gpipe.act_buffers == micro_batches
    assert live_inputs(sync) <= min(2 * stages - 1, micro_batches) and sync.act_buffers <= 2 * stages - 1


@pytest.mark.parametrize("stages, micro_batches", [(4, 8), (2, 3), (4, 2)])
def test_1f1b_is_deepspeeds_train_schedule(stages: int, micro_batches: int) -> None:
    """Stage s: min(S-s-1, M) warm-up forwards, then one forward / one backward, then the rest."""
    sched = build("1f1b", stages, micro_batches)
    for s in range(stages):
        order = [("F" if isinstance(c, Forward) else "B", c.micro_batch) for t in range(sched.num_ticks)
                 if (c := sched.compute(t, s)) is not None]
        warm = min(stages - s - 1, micro_batches)
        want = [("F", i) for i in range(warm)]
        for i in range(micro_batches - warm):
            want += [("F", warm + i), ("B", i)]
        want += [("B", i) for i in range(micro_batches - warm, micro_batches)]
        assert order == want


def test_timelines() -> None:
    assert build("1f1b", 2, 4).timeline().split("\n") == [
        "stage 0: F0 F1 .  B0 F2 B1 F3 B2 .  B3",
        "stage 1: .  F0 B0 F1 B1 F2 B2 F3 B3 . "]
    assert build("gpipe", 2, 3).timeline().split("\n") == [
        "stage 0: F0 F1 F2 .  .  B0 B1 B2",
        "stage 1: .  F0 F1 F2 B0 B1 B2 . "]
    assert build("1f1b_sync", 2, 4).timeline().split("\n") == [
        "stage 0: F0    F1    F2+B0 F3+B1 B2    B3   ",
        "stage 1: .     F0+B0 F1+B1 F2+B2 F3+B3 .    "]


@pytest.mark.parametrize("name, stages, micro_batches", [("1f1b", 4, 8), ("gpipe", 2, 4), ("1f1b_sync", 4, 8),
                                                         ("interleaved", 2, 4)])
def test_sends_pair_with_receives_and_slots_are_not_overwritten(name: str, stages: int, micro_batches: int) -> None:
    sched = build(name, stages, micro_batches, 2 if name == "interleaved" else 1)
    v = stages * sched.chunks
    held: dict[tuple[str, int, int], int] = {}   # (kind, stage, slot) -> micro-batch
    for t, row in enumerate(sched.ticks):
        for s, instrs in enumerate(row):
            for ins in instrs:
                if isinstance(ins, SendActivation):
                    recv = [i for i in row[(s + 1) % stages] if isinstance(i, RecvActivation)]
                    assert [i.micro_batch for i in recv] == [ins.micro_batch]
                if isinstance(ins, SendGrad):
                    recv = [i for i in row[(s - 1) % stages] if isinstance(i, RecvGrad)]
                    assert [i.micro_batch for i in recv] == [ins.micro_batch]
                if isinstance(ins, (Forward, Backward)) and ins.chunk * stages + s > 0:
                    assert held.get(("act", s, ins.buffer)) == ins.micro_batch
                if isinstance(ins, Backward) and ins.chunk * stages + s < v - 1:
                    assert held.pop(("grad", s, ins.grad_buffer)) == ins.micro_batch
        for s, instrs in enumerate(row):  # receives land after the tick's compute
            for ins in instrs:
                if isinstance(ins, RecvActivation):
                    assert ("act", s, ins.buffer) not in held or _consumed(sched, t, s, held[("act", s, ins.buffer)])
                    held[("act", s, ins.buffer)] = ins.micro_batch
                if isinstance(ins, RecvGrad):
                    assert ("grad", s, ins.buffer) not in held
                    held[("grad", s, ins.buffer)] = ins.micro_batch
    assert sched.finish == (ReduceTiedGrads(), ReduceGrads(), OptimizerStep())


def _consumed(sched: zerojax.pipeline.Schedule, tick: int, stage: int, micro_batch: int) -> bool:
    """The previous occupant's backward on this stage ran before `tick`."""
    return any(isinstance(c, Backward) and c.micro_batch == micro_batch
               for t in range(tick) for c in sched.computes(t, stage))


def test_loads_on_first_and_last_stage() -> None:
    sched = build("1f1b", 4, 4)
    for t, row in enumerate(sched.ticks):
        for s, instrs in enumerate(row):
            loads = [i for i in instrs if isinstance(i, LoadMicroBatch)]
            wants = [c for c in sched.computes(t, s) if s == 3 or (s == 0 and isinstance(c, Forward))]
            assert len(loads) == len(wants)


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 8), (2, 2)])
def test_interleaved(stages: int, micro_batches: int) -> None:
    sched = build("interleaved", stages, micro_batches, 2)
    check_dependencies(sched)
    assert sched.idle_fraction == pytest.approx((stages - 1) / (2 * micro_batches + stages - 1))
    assert sched.lockstep_idle(1, 3) == pytest.approx(sched.idle_fraction)   # paired, like 1f1b_sync
    assert sched.idle_fraction < build("1f1b", stages, micro_batches).idle_fraction


def test_inference_schedule() -> None:
    sched = build("inference", 4, 6)
    check_dependencies(sched, training=False)
    assert sched.num_ticks == 6 + 4 - 1 and sched.finish == ()
    assert sched.act_buffers <= 2


def test_bad_schedules() -> None:
    with pytest.raises(zerojax.ConfigError, match=r"gradient_accumulation_steps: .* multiple of 4 \(got 6\)"):
        build("interleaved", 4, 6, 2)
    with pytest.raises(zerojax.ConfigError, match=r"pipeline.schedule: unknown schedule 'zb'"):
        build("zb", 2, 2)
    with pytest.raises(zerojax.ConfigError, match=r"pipeline.chunks"):
        build("1f1b", 2, 2, 2)
    with pytest.raises(zerojax.ConfigError, match=r"at least one stage and one micro-batch"):
        build("1f1b", 2, 0)
