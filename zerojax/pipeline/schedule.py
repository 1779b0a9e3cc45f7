"""Pipeline schedules as data: per tick, per stage, a list of instructions.

A schedule is built in two steps. First each stage gets the *order* of its compute operations
(GPipe: all forwards, then all backwards; 1F1B: DeepSpeed's TrainSchedule - a warm-up of S-s-1
forwards, then one forward / one backward alternately, then the remaining backwards). Then a
simulator places the operations on ticks of unit length, each as early as its inputs allow:
a forward of micro-batch m on stage s needs the activation stage s-1 sent in an earlier tick; a
backward needs its own forward and the gradient stage s+1 sent in an earlier tick. The result is
the familiar timeline, e.g. 1F1B with S=2, M=4 (F3 = forward of micro-batch 3):

    stage 0:  F0 F1 .  B0 F2 B1 F3 B2 .  B3
    stage 1:  .  F0 B0 F1 B1 F2 B2 F3 B3 .

Instructions carry the buffer slots they use, allocated by the builder: an activation slot holds
a stage's input from the moment it is received until the micro-batch's backward has run (the
executor keeps only the stage input and recomputes the stage's forward inside its backward), a
gradient slot holds a received gradient until it is consumed. The number of slots is the memory
the schedule needs: GPipe keeps every micro-batch's input (M slots), 1F1B at most S.

Sends and receives are paired within a tick: what stage s sends in tick t, stage s±1 receives at
the end of tick t (the executor moves data with one `ppermute` in each direction per tick).
Interleaved 1F1B (Megatron's virtual stages: each device runs `chunks` non-adjacent model chunks)
is built the same way, over S*chunks virtual stages placed round-robin on the S devices.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from zerojax.errors import ConfigError


# -- instructions ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Instruction:
    def __str__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({fields})"


@dataclasses.dataclass(frozen=True)
class LoadMicroBatch(Instruction):
    """Read micro-batch rows (first stage: inputs; last stage: labels for the loss)."""
    micro_batch: int


@dataclasses.dataclass(frozen=True)
class Forward(Instruction):
    """Run the stage (model chunk `chunk`) on its input in activation slot `buffer` (-1: the batch)."""
    micro_batch: int
    buffer: int
    chunk: int = 0


@dataclasses.dataclass(frozen=True)
class Backward(Instruction):
    """Recompute the stage's forward from slot `buffer` and backpropagate the gradient in slot
    `grad_buffer` (-1: the loss), accumulating parameter gradients."""
    micro_batch: int
    buffer: int
    grad_buffer: int
    chunk: int = 0


@dataclasses.dataclass(frozen=True)
class SendActivation(Instruction):
    micro_batch: int


@dataclasses.dataclass(frozen=True)
class RecvActivation(Instruction):
    micro_batch: int
    buffer: int


@dataclasses.dataclass(frozen=True)
class SendGrad(Instruction):
    micro_batch: int


@dataclasses.dataclass(frozen=True)
class RecvGrad(Instruction):
    micro_batch: int
    buffer: int


@dataclasses.dataclass(frozen=True)
class ReduceTiedGrads(Instruction):
    """Send tied-parameter gradients to the stage that stores them and sum them there."""


@dataclasses.dataclass(frozen=True)
class ReduceGrads(Instruction):
    """Reduce the accumulated gradients over the data axis into the ZeRO update placement."""


@dataclasses.dataclass(frozen=True)
class OptimizerStep(Instruction):
    pass


FORWARD, BACKWARD = "F", "B"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`ticks[t][s]`: the instructions stage s executes in tick t; `finish`: after the last tick."""
    name: str
    stages: int
    micro_batches: int
    chunks: int
    ticks: tuple[tuple[tuple[Instruction, ...], ...], ...]
    finish: tuple[Instruction, ...]
    act_buffers: int
    grad_buffers: int

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    def computes(self, tick: int, stage: int) -> list[Forward | Backward]:
        """The forward and/or backward stage `stage` runs in tick `tick` (at most one of each)."""
        return [ins for ins in self.ticks[tick][stage] if isinstance(ins, (Forward, Backward))]

    def compute(self, tick: int, stage: int, kind: type | None = None) -> Forward | Backward | None:
        """The first compute instruction of the tick (of type `kind` if given), or None."""
        return next((c for c in self.computes(tick, stage) if kind is None or isinstance(c, kind)), None)

    def lockstep_idle(self, forward: Sequence[float] | float = 1.0, backward: Sequence[float] | float = 1.0) -> float:
        """Idle share of device time when ticks run in lockstep.

        Costs are per virtual stage (or one number for all). A tick lasts as long as its busiest
        device (the ticks end with a collective), and a device's work in a tick is the cost of the
        forward and backward it runs there.
        """
        v = self.stages * self.chunks
        f = [forward] * v if isinstance(forward, (int, float)) else list(forward)
        b = [backward] * v if isinstance(backward, (int, float)) else list(backward)
        busy = total = 0.0
        for t in range(self.num_ticks):
            work = [sum((f if isinstance(c, Forward) else b)[c.chunk * self.stages + s] for c in self.computes(t, s))
                    for s in range(self.stages)]
            busy += sum(work)
            total += max(work) * self.stages
        return 1 - busy / total

    @property
    def idle_fraction(self) -> float:
        """`lockstep_idle` with forwards and backwards of equal cost on every stage."""
        return self.lockstep_idle()

    @property
    def bubble(self) -> float:
        """The textbook bubble for this schedule: (S-1)/(v*M+S-1) with v chunks per device."""
        s, m, v = self.stages, self.micro_batches, self.chunks
        return (s - 1) / (v * m + s - 1)

    def timeline(self) -> str:
        """One line per stage: F3 / B3 / F4+B1 (chunk c: F3.c), '.' for idle."""
        def name(ins: Forward | Backward) -> str:
            tag = FORWARD if isinstance(ins, Forward) else BACKWARD
            return f"{tag}{ins.micro_batch}" + (f".{ins.chunk}" if self.chunks > 1 else "")
        cells = [["+".join(name(c) for c in self.computes(t, s)) or "." for t in range(self.num_ticks)]
                 for s in range(self.stages)]
        w = max(len(c) for row in cells for c in row)
        return "\n".join(f"stage {s}: " + " ".join(c.ljust(w) for c in row) for s, row in enumerate(cells))


# -- per-stage operation orders ----------------------------------------------------------------------

Op = tuple[str, int, int]  # (F or B, micro-batch, virtual stage)


def gpipe_order(stage: int, stages: int, micro_batches: int) -> list[Op]:
    return [(FORWARD, m, stage) for m in range(micro_batches)] + \
           [(BACKWARD, m, stage) for m in range(micro_batches)]


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[Op]:
    """DeepSpeed's TrainSchedule / PipeDream-Flush: warm-up, steady 1F1B, cool-down."""
    warmup = min(stages - stage - 1, micro_batches)
    ops: list[Op] = [(FORWARD, m, stage) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        ops += [(FORWARD, warmup + i, stage), (BACKWARD, i, stage)]
    ops += [(BACKWARD, m, stage) for m in range(micro_batches - warmup, micro_batches)]
    return ops


def sync_one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[Op]:
    """1F1B for lockstep ticks: 2(S-s-1) warm-up forwards, so that in the steady state every stage
    runs one forward *and* one backward per tick (paired) and all ticks cost the same. Stage s then
    holds up to 2(S-s)-1 micro-batches (DeepSpeed's order: S-s), the price of never idling a stage
    that runs a forward while its neighbour runs a backward."""
    warmup = min(2 * (stages - stage - 1), micro_batches)
    ops: list[Op] = [(FORWARD, m, stage) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        ops += [(FORWARD, warmup + i, stage), (BACKWARD, i, stage)]
    ops += [(BACKWARD, m, stage) for m in range(micro_batches - warmup, micro_batches)]
    return ops


def forward_order(stage: int, stages: int, micro_batches: int) -> list[Op]:
    return [(FORWARD, m, stage) for m in range(micro_batches)]


def interleaved_order(device: int, stages: int, micro_batches: int, chunks: int) -> list[Op]:
    """Megatron's interleaved 1F1B: micro-batches in groups of S, chunk by chunk."""
    total = micro_batches * chunks

    def unit(k: int, forward: bool) -> Op:
        group, within = divmod(k, stages * chunks)
        chunk, offset = divmod(within, stages)
        if not forward:
            chunk = chunks - 1 - chunk
        return (FORWARD if forward else BACKWARD, group * stages + offset, chunk * stages + device)

    warmup = min((stages - device - 1) * 2 + (chunks - 1) * stages, total)
    ops = [unit(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [unit(warmup + i, True), unit(i, False)]
    ops += [unit(k, False) for k in range(total - warmup, total)]
    return ops


# -- simulation --------------------------------------------------------------------------------------

def _simulate(orders: Sequence[Sequence[Op]], devices: int, virtual: int, pair: bool) -> list[list[list[Op]]]:
    """Place each device's ops on ticks, in order, as early as their inputs allow.

    A tick has one forward slot and one backward slot per device. Unpaired (GPipe), a device runs
    one op per tick; paired (1F1B), it also runs the next op of its order in the same tick when
    that is of the other kind and ready - so steady-state 1F1B ticks hold a forward *and* a
    backward on every stage and cost the same everywhere when ticks run in lockstep. Inputs come
    from earlier ticks, except that the forward slot runs before the backward slot, so a backward
    may use its own stage's forward of the same tick (the last stage's F m + B m).
    """
    done: dict[tuple[str, int, int], int] = {}  # (kind, micro-batch, virtual stage) -> tick finished
    pos = [0] * devices
    timeline: list[list[list[Op]]] = []
    total = sum(len(o) for o in orders)

    def ready(op: Op, t: int, same_tick: list[Op]) -> bool:
        kind, m, v = op
        if kind == FORWARD:
            return v == 0 or done.get((FORWARD, m, v - 1), t) < t
        own = done.get((FORWARD, m, v), t) < t or (FORWARD, m, v) in same_tick
        return own and (v == virtual - 1 or done.get((BACKWARD, m, v + 1), t) < t)

    while sum(pos) < total:
        t = len(timeline)
        row: list[list[Op]] = [[] for _ in range(devices)]
        for d in range(devices):
            order = orders[d]
            if pos[d] < len(order) and ready(order[pos[d]], t, []):
                row[d].append(order[pos[d]])
                nxt = pos[d] + 1
                if pair and nxt < len(order) and order[nxt][0] != order[pos[d]][0] and ready(order[nxt], t, row[d]):
                    row[d].append(order[nxt])
        for d, ops in enumerate(row):
            for op in ops:
                done[op] = t
            pos[d] += len(ops)
        if not any(row):
            raise RuntimeError("schedule deadlocks: the per-stage orders are inconsistent")
        timeline.append(row)
    return timeline


class _Slots:
    """A free-list of buffer slots; `release_at[t]` frees slots once tick t's compute has read them."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.count = 0

    def take(self) -> int:
        if self.free:
            return self.free.pop(0)
        self.count += 1
        return self.count - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)
        self.free.sort()


def _assemble(name: str, stages: int, micro_batches: int, chunks: int,
              timeline: list[list[list[Op]]], training: bool) -> Schedule:
    virtual = stages * chunks
    ticks: list[list[list[Instruction]]] = [[[] for _ in range(stages)] for _ in timeline]
    act = [_Slots() for _ in range(stages)]
    grad = [_Slots() for _ in range(stages)]
    act_slot: dict[tuple[int, int], int] = {}    # (micro-batch, virtual stage) -> slot on its device
    grad_slot: dict[tuple[int, int], int] = {}
    for t, row in enumerate(timeline):
        frees: list[tuple[_Slots, int]] = []
        for d, op in ((d, op) for d, ops in enumerate(row) for op in ops):
            kind, m, v = op
            chunk = v // stages
            if kind == FORWARD:
                buf = act_slot.get((m, v), -1)
                if v == 0 or v == virtual - 1:
                    ticks[t][d].append(LoadMicroBatch(m))
                ticks[t][d].append(Forward(m, buf, chunk))
                if not training and buf >= 0:
                    frees.append((act[d], buf))
                if v < virtual - 1:
                    ticks[t][d].append(SendActivation(m))
                    dst = (v + 1) % stages
                    slot = act[dst].take()
                    act_slot[(m, v + 1)] = slot
                    ticks[t][dst].append(RecvActivation(m, slot))
            else:
                buf, gbuf = act_slot.get((m, v), -1), grad_slot.get((m, v), -1)
                if v == virtual - 1:
                    ticks[t][d].append(LoadMicroBatch(m))
                ticks[t][d].append(Backward(m, buf, gbuf, chunk))
                if buf >= 0:
                    frees.append((act[d], buf))
                if gbuf >= 0:
                    frees.append((grad[d], gbuf))
                if v > 0:
                    ticks[t][d].append(SendGrad(m))
                    dst = (v - 1) % stages
                    slot = grad[dst].take()
                    grad_slot[(m, v - 1)] = slot
                    ticks[t][dst].append(RecvGrad(m, slot))
        # Slots read by this tick's compute are free for data received at the end of the *next*
        # tick or later: the executor writes received data after computing, so a slot could even
        # be reused within the tick, but keeping it one tick longer keeps the bound obvious.
        for pool, slot in frees:
            pool.give(slot)
    finish = (ReduceTiedGrads(), ReduceGrads(), OptimizerStep()) if training else ()
    return Schedule(name, stages, micro_batches, chunks, tuple(tuple(tuple(c) for c in r) for r in ticks),
                    finish, max(1, max(a.count for a in act)), max(1, max(g.count for g in grad)))


def build(name: str, stages: int, micro_batches: int, chunks: int = 1) -> Schedule:
    """A named schedule: "gpipe", "1f1b", "interleaved" (chunks > 1), or "inference" (forwards only,
    in the order of 1F1B, or of interleaved 1F1B when chunks > 1)."""
    if stages < 1 or micro_batches < 1:
        raise ConfigError(f"pipeline: need at least one stage and one micro-batch (got S={stages}, M={micro_batches})")
    interleaved = name == "interleaved" or (name == "inference" and chunks > 1)
    if name == "interleaved" and chunks < 2:
        raise ConfigError("pipeline.chunks: the interleaved schedule needs at least 2 chunks per stage")
    if interleaved and micro_batches % stages:
        raise ConfigError(
            f"gradient_accumulation_steps: the interleaved schedule runs micro-batches in groups of "
            f"mesh.stage={stages}, so it needs a multiple of {stages} (got {micro_batches}); "
            f"set gradient_accumulation_steps to {stages * max(1, round(micro_batches / stages))}")
    if chunks != 1 and not interleaved:
        raise ConfigError("pipeline.chunks: only the interleaved schedule runs several chunks per stage")
    builders: dict[str, Callable[[int, int, int], list[Op]]] = {
        "gpipe": gpipe_order, "1f1b": one_f_one_b_order, "1f1b_sync": sync_one_f_one_b_order,
        "inference": forward_order,
        "interleaved": lambda d, s, m: interleaved_order(d, s, m, chunks)}
    if name not in builders:
        raise ConfigError(f"pipeline.schedule: unknown schedule {name!r}; use one of {', '.join(sorted(builders))}")
    training = name != "inference"
    make = builders["interleaved" if interleaved else name]
    orders = [[op for op in make(d, stages, micro_batches) if training or op[0] == FORWARD] for d in range(stages)]
    timeline = _simulate(orders, stages, stages * chunks, pair=name in ("1f1b_sync", "interleaved"))
    return _assemble(name, stages, micro_batches, chunks, timeline, training)
