"""Pipeline schedules: measured idle fraction and compiled activation memory.

    python -m benchmarks.pipeline            (or: python benchmarks/pipeline.py)

For the embedded GPT cut into S = 4 stages x 2 data shards (8 virtual CPU devices), bf16 with fp32
master weights, AdamW, ZeRO-1 over `data`, and for each schedule (GPipe, DeepSpeed's 1F1B, the
paired `1f1b_sync`, interleaved 1F1B with 2 chunks per stage) and M micro-batches per step:

* idle fraction, executed: one training step's gradient pass is run with the executor's trace on,
  which records, tick by tick, which forward and backward `lax.switch` branches each device
  actually executed; the idle share of device time (a forward or backward = one unit, a tick as
  long as its busiest device) is compared with the textbook bubble (S-1)/(M+S-1) (interleaved:
  (S-1)/(v*M+S-1) with v chunks); and the same trace weighted by each branch's compiled FLOPs;
* temp bytes per device of the compiled train step (`compiled.memory_analysis()`), next to the
  bytes of the activation slots the schedule allocates (slots x one micro-batch's stage input):
  GPipe keeps all M inputs, 1F1B at most S, so GPipe's temp grows with M and 1F1B's does not.

Times are not reported: eight virtual devices share this machine's cores, so a device idling in
the bubble hands its core to the others and bubbles cost no wall time here.
Writes docs/benchmarks_pipeline.md and prints the same Markdown.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.pipeline.executor import _stage_fn, activation_shape, make_grad_fn  # noqa: E402
from zerojax.pipeline.step import init_rows, make_pipeline_train_step  # noqa: E402
from zerojax.planner.pipeline import make_pipeline_plan
from zerojax.core.state import init_state  # noqa: E402

MiB = 2 ** 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6, help="transformer blocks (plus embedding and head)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="rows per data shard per micro-batch")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks_pipeline.md"))
    ap.add_argument("--no-write", action="store_true", help="print only")
    return ap.parse_args(argv)


def config(args: argparse.Namespace, schedule: str, micro_batches: int) -> zerojax.Config:
    return zerojax.load_config({
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
        "mesh": {"stage": args.stages, "data": 8 // args.stages},
        "pipeline": {"schedule": schedule, "chunks": 2 if schedule == "interleaved" else 1},
        "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 4, "seq_len": args.seq_len}})


def measure(args: argparse.Namespace, schedule: str, micro_batches: int) -> dict:
    cfg = config(args, schedule, micro_batches)
    mesh = zerojax.make_mesh(cfg)
    module = gpt.pipeline_module(cfg.model)
    pp = make_pipeline_plan(cfg, mesh, module)
    state = init_state(cfg, pp.plan, init_rows(pp, 0))
    rows = pp.plan.batch.train_batch_size
    rng = np.random.default_rng(0)
    batch = {"tokens": jax.device_put(rng.integers(0, 256, size=(rows, args.seq_len + 1), dtype=np.int32),
                                      pp.plan.batch_sharding)}

    # Memory of the compiled train step (per device).
    step = make_pipeline_train_step(pp)
    mem = step.lower(state, batch).compile().memory_analysis()

    # The executed schedule: which branch every device ran in every tick.
    grad_fn = jax.jit(make_grad_fn(pp.train, trace=True))
    _, _, fwd, bwd = grad_fn(state.params, batch, 1.0)
    fwd, bwd = np.asarray(fwd), np.asarray(bwd)
    sched = pp.schedule
    ran = (fwd > 0).sum(axis=0) + (bwd > 0).sum(axis=0)
    assert (ran == 2 * micro_batches * sched.chunks).all(), ran

    micro = {"tokens": jax.ShapeDtypeStruct((args.micro, args.seq_len + 1), np.int32)}
    act = activation_shape(pp.train, micro)
    act_bytes = int(np.prod(act.shape)) * np.dtype(act.dtype).itemsize
    key = (pp.rows.chunks, pp.rows.partition.bounds)
    if key not in _FLOPS:  # the branches do not depend on M: compiled once per partition
        _FLOPS[key] = branch_flops(pp, micro, act)
    f_cost, b_cost = _FLOPS[key]
    unit = np.r_[0.0, np.ones(pp.rows.virtual)]
    return {"schedule": schedule, "M": micro_batches, "ticks": sched.num_ticks,
            "idle": lockstep_idle(fwd, bwd, unit, unit), "lockstep": lockstep_idle(fwd, bwd, f_cost, b_cost),
            "bwd_over_fwd": float(b_cost.sum() / f_cost.sum()),
            "theory": sched.bubble, "slots": sched.act_buffers, "grad_slots": sched.grad_buffers,
            "act_bytes": act_bytes, "stash": (sched.act_buffers + sched.grad_buffers) * act_bytes,
            "temp": mem.temp_size_in_bytes, "args": mem.argument_size_in_bytes,
            "partition": pp.rows.table(), "width": pp.rows.width}


_FLOPS: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def lockstep_idle(fwd: np.ndarray, bwd: np.ndarray, f_cost: np.ndarray, b_cost: np.ndarray) -> float:
    """Idle share of device time for an executed trace (`[ticks, devices]` branch codes) when every
    tick lasts as long as its busiest device."""
    work = f_cost[fwd] + b_cost[bwd]
    return float(1 - work.sum() / (work.shape[1] * work.max(axis=1).sum()))


def branch_flops(pp, micro: dict, act: jax.ShapeDtypeStruct) -> tuple[np.ndarray, np.ndarray]:
    """FLOPs of every forward and backward switch branch (index 0: the empty slot, 1+v: virtual
    stage v), each branch compiled alone on one device."""
    rows, dtype = pp.rows, pp.train.param_dtype
    row = jax.ShapeDtypeStruct((rows.width,), dtype)
    tied = {t.key: jax.ShapeDtypeStruct((rows.slot(t.key).size,), dtype) for t in rows.tied if t.users}
    fns = [_stage_fn(pp.train, v) for v in range(rows.virtual)]

    def flops(f) -> float:
        cost = jax.jit(f).lower(row, tied, act, micro).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost.get("flops", 0.0))

    def backward(f):
        def run(r, t, x, mb):
            (y, loss), pull = jax.vjp(lambda p, tv, h: f(p, tv, h, mb), r, t, x)
            return pull((None if y is None else jax.numpy.ones_like(y), None if loss is None else 1.0))
        return run

    return (np.asarray([0.0] + [flops(f) for f in fns]), np.asarray([0.0] + [flops(backward(f)) for f in fns]))


def report(args: argparse.Namespace, results: list[dict], seconds: float) -> str:
    s = args.stages
    first = results[0]
    lines = [
        "# Pipeline schedules: idle fraction and activation memory",
        "",
        f"<!-- Generated by `python -m benchmarks.pipeline`; {seconds:.0f} s on this machine. -->",
        "",
        f"The embedded GPT (d_model {args.d_model}, {args.layers} blocks + embedding + head, seq_len "
        f"{args.seq_len}) cut into {s} stages x {8 // s} data shards on 8 virtual CPU devices; bf16 "
        f"parameters, fp32 master, AdamW, ZeRO-1 over `data`; {args.micro} rows per data shard per "
        f"micro-batch, so one micro-batch's stage input (the activation a stage keeps per in-flight "
        f"micro-batch) is {first['act_bytes'] / MiB:.2f} MiB.",
        "",
        "The partition of GPipe and 1F1B (interleaved cuts the same layers into 2 x S chunks, one "
        "layer each, device d running chunks d and d + S):",
        "",
        "```",
        first["partition"],
        "```",
        "",
        "| schedule | M | ticks | idle, executed | bubble (S-1)/(vM+S-1) | idle, lockstep by FLOPs | "
        "activation slots | grad slots | slot bytes (MiB) | temp per device (MiB) | temp - slot bytes (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['schedule']} | {r['M']} | {r['ticks']} | {100 * r['idle']:.1f}% | "
                     f"{100 * r['theory']:.1f}% | {100 * r['lockstep']:.1f}% | {r['slots']} | {r['grad_slots']} | "
                     f"{r['stash'] / MiB:.2f} | {r['temp'] / MiB:.2f} | {(r['temp'] - r['stash']) / MiB:.2f} |")
    by = {(r["schedule"], r["M"]): r for r in results}
    ms = sorted({r["M"] for r in results})
    lo, hi = ms[0], ms[-1]
    growth = {name: (by[(name, hi)]["temp"] - by[(name, lo)]["temp"]) / MiB
              for name in ("gpipe", "1f1b", "1f1b_sync", "interleaved") if (name, lo) in by and (name, hi) in by}
    lines += [
        "",
        "**Reading it.** *idle, executed*: the executor records, while running one step "
        "(`make_grad_fn(..., trace=True)`), which branch of its forward and backward `lax.switch` "
        "each device ran in each tick; counting a forward and a backward as one unit of work each, "
        "and a tick as long as its busiest device, this is the share of device time spent idle. It "
        "equals the textbook bubble.",
        "",
        "*idle, lockstep by FLOPs* weighs the same executed trace by what each branch costs (its "
        "FLOPs, each branch compiled alone): the devices run ticks in lockstep (every tick ends with "
        "a `ppermute`), so a tick lasts as long as its most expensive branch, and a device doing "
        "less than that idles for the difference. A backward here costs "
        f"{first['bwd_over_fwd']:.1f}x a forward (it recomputes the stage's forward first), and stages "
        "differ (the first and last carry the embedding and the head). GPipe's ticks are all "
        "forwards or all backwards, so lockstep adds only the stages' imbalance. DeepSpeed's 1F1B "
        "order has neighbouring stages run a forward and a backward in the same tick, so in "
        "lockstep the forward stage waits for the backward: its advantage on this executor is "
        "memory, not time. `1f1b_sync` pairs a forward and a backward in every steady-state tick "
        "(2(S-s-1) warm-up forwards instead of S-s-1) and loses no more than GPipe to lockstep, for "
        "up to 2S-1 micro-batches in flight; interleaved is paired the same way. What remains above "
        "the bubble for all of them is the stages' imbalance: the `parameters` partition balances "
        "parameters, and the embedding's many parameters cost few FLOPs, so stages 0 and 3 run one "
        "block each and stages 1 and 2 two.",
        "",
        f"*temp per device* is `compiled.memory_analysis().temp_size_in_bytes` of the whole train step. "
        f"From M = {lo} to M = {hi} it grows by "
        + ", ".join(f"{growth[n]:.2f} MiB for {n}" for n in growth)
        + f": GPipe keeps every micro-batch's stage input until the backward phase (M slots), 1F1B at "
          f"most S = {s} (the slots column), so its activation memory is bounded by S micro-batches "
          f"whatever M is; `1f1b_sync` by 2S-1. Interleaved 1F1B lowers the bubble by the number of "
          f"chunks at the price of more slots (each device holds inputs for several chunks), and its "
          f"temp is lower here because each chunk is a single layer. *temp - slot bytes* is what the "
          f"step needs beside the slots: gradient accumulator, optimizer temporaries and the transient "
          f"activations of one stage's recomputed forward and backward; it does not depend on M.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    results = []
    for schedule in ("gpipe", "1f1b", "1f1b_sync", "interleaved"):
        for m in args.micro_batches:
            if schedule == "interleaved" and m % args.stages:
                continue
            results.append(measure(args, schedule, m))
            r = results[-1]
            print(f"{schedule:>11} M={m:<3} idle {100 * r['idle']:5.1f}% (theory {100 * r['theory']:5.1f}%) "
                  f"temp {r['temp'] / MiB:8.2f} MiB slots {r['slots']}", file=sys.stderr, flush=True)
    text = report(args, results, time.perf_counter() - start)
    print(text)
    if not args.no_write:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
