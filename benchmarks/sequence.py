"""Sequence parallelism (DeepSpeed-Ulysses): how long a sequence fits, and what a step costs, at
mesh.sequence 1, 2, 4 and 8 on 8 virtual CPU devices.

    python -m benchmarks.sequence          (or: python benchmarks/sequence.py)

The shipped Llama at a tiny width (`--d-model` 64, `--heads` 8 and `--kv-heads` 8 so that every
sequence size divides them, remat on), ZeRO-3 over data x sequence, fp32 AdamW.

* **Longest sequence under a memory budget.** One row per data shard (train_batch_size = 8 /
  sequence: each device holds seq_len / sequence tokens of one row). The budget is the compiled
  step's per-device peak (`memory_analysis()` arguments + temporaries) at sequence 1 and
  `--budget-len` tokens; at each sequence size seq_len doubles from `--budget-len` while the step fits,
  then bisects (to `--quantum` tokens, or 1/16 of the length). Only compiled, never run.
* **Step time at the same global tokens.** `--rows` rows of `--seq-len` tokens a step at every size
  (at sequence P each device holds P rows' chunks of seq_len / P tokens: the same tokens, the same
  FLOPs), median of `--rounds` interleaved steps after `--warmup`.

Writes the section between the `sequence` markers of docs/benchmarks.md (`--no-write` to print only).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import output_args, run_section  # noqa: E402

BEGIN, END = "<!-- sequence -->", "<!-- /sequence -->"
MiB = 2 ** 20
DEVICES = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--d-ff", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="mesh.sequence sizes")
    ap.add_argument("--budget-len", type=int, default=1024,
                    help="the budget is sequence 1's compiled peak at this many tokens a row")
    ap.add_argument("--quantum", type=int, default=64, help="the bisection's finest step in tokens")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens a row in the timed steps")
    ap.add_argument("--rows", type=int, default=8, help="global rows a step in the timed steps")
    ap.add_argument("--attentions", nargs="+", default=["dense", "blockwise"], choices=["dense", "blockwise"],
                    help="model.attention of each longest-sequence table (the budget is the first's)")
    ap.add_argument("--attention-block", type=int, default=256, help="model.attention_block for blockwise")
    output_args(ap, "benchmarks.md", warmup=1, rounds=5)
    return ap.parse_args(argv)


def config(args: argparse.Namespace, sequence: int, seq_len: int, rows: int, attention: str = "auto") -> Any:
    import zerojax
    return zerojax.load_config({
        "train_batch_size": rows, "gradient_accumulation_steps": 1, "sequence_parallel_size": sequence,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "model": {"name": "llama", "d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads,
                  "n_kv_heads": args.kv_heads, "d_ff": args.d_ff, "seq_len": seq_len,
                  "vocab_size": args.vocab, "remat": True, "attention": attention,
                  "attention_block": args.attention_block}})


def setup(args: argparse.Namespace, sequence: int, seq_len: int, rows: int,
          attention: str = "auto") -> tuple[Any, Any, Any, Any]:
    """(config, plan, loss_fn, params) on the 8 devices."""
    import zerojax
    from zerojax.models import llama
    cfg = config(args, sequence, seq_len, rows, attention)
    params, loss_fn = llama.build(cfg.model, seed=0)
    plan = zerojax.plan(cfg, zerojax.make_mesh(cfg), params)
    return cfg, plan, loss_fn, params


# ------------------------------------------------------------------------------------------------
# (a) the longest sequence under a budget: compiled, never run.

def compiled_peak(args: argparse.Namespace, sequence: int, seq_len: int, attention: str) -> dict:
    """Per-device bytes of the compiled train step at one row per data shard."""
    import zerojax
    from zerojax.core.state import abstract_state
    rows = DEVICES // sequence
    cfg, plan, loss_fn, _ = setup(args, sequence, seq_len, rows, attention)
    step = zerojax.make_train_step(cfg, plan, loss_fn)
    batch = {"tokens": jax.ShapeDtypeStruct((rows, seq_len + 1), jnp.int32, sharding=plan.batch_sharding)}
    t = time.perf_counter()
    mem = step.lower(abstract_state(plan), batch).compile().memory_analysis()
    return {"seq_len": seq_len, "args": mem.argument_size_in_bytes, "temp": mem.temp_size_in_bytes,
            "peak": mem.argument_size_in_bytes + mem.temp_size_in_bytes, "compile_s": time.perf_counter() - t}


def longest(args: argparse.Namespace, sequence: int, budget: float, known: dict, attention: str) -> dict:
    """The longest seq_len (a multiple of `--quantum`) whose compiled peak fits `budget`: doubling
    from `--budget-len` while it fits, then bisecting."""
    probes: dict[int, dict] = dict(known)

    def fits(n: int) -> bool:
        if n not in probes:
            probes[n] = compiled_peak(args, sequence, n, attention)
            print(f"{attention}, sequence {sequence}: seq_len {n} peak {probes[n]['peak'] / MiB:.1f} MiB "
                  f"({'fits' if probes[n]['peak'] <= budget else 'over'})", file=sys.stderr, flush=True)
        return probes[n]["peak"] <= budget

    lo = args.budget_len
    if not fits(lo):
        hi, lo = lo, 0
        while lo == 0 and hi > args.quantum:
            hi //= 2
            lo = hi if fits(hi) else 0
        hi *= 2
    else:
        hi = 2 * lo
        while fits(hi):
            lo, hi = hi, 2 * hi
    while hi - lo > max(args.quantum, lo // 16):
        mid = (lo + hi) // 2 // args.quantum * args.quantum
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"longest": lo, "over": hi, "at": probes.get(lo), "probes": probes}


# ------------------------------------------------------------------------------------------------
# (b) step time at the same global tokens.

def timed(args: argparse.Namespace) -> dict[int, dict]:
    import zerojax

    rng = np.random.default_rng(0)
    host = [rng.integers(0, args.vocab, (args.rows, args.seq_len + 1)).astype(np.int32)
            for _ in range(args.warmup + args.rounds)]
    runners: dict[int, list] = {}
    rows: dict[int, dict] = {}
    for sp in args.sizes:
        cfg, plan, loss_fn, params = setup(args, sp, args.seq_len, args.rows)
        state = zerojax.init_state(cfg, plan, params)
        step = zerojax.make_train_step(cfg, plan, loss_fn)
        data = [{"tokens": jax.device_put(b, plan.batch_sharding)} for b in host]
        t = time.perf_counter()
        compiled = step.lower(state, data[0]).compile()
        mem = compiled.memory_analysis()
        rows[sp] = {"mesh": dict(plan.mesh.shape), "compile_s": time.perf_counter() - t, "times": [], "losses": [],
                    "peak": mem.argument_size_in_bytes + mem.temp_size_in_bytes, "batch": plan.batch}
        runners[sp] = [compiled, state, data]
        print(f"sequence {sp}: step compiled in {rows[sp]['compile_s']:.1f}s", file=sys.stderr, flush=True)

    def run(sp: int, i: int) -> float:
        compiled, state, data = runners[sp]
        t = time.perf_counter()
        state, metrics = compiled(state, data[i])
        loss = float(metrics["loss"])
        jax.block_until_ready(state)
        runners[sp][1] = state
        rows[sp]["losses"].append(loss)
        return time.perf_counter() - t

    for i in range(args.warmup):
        for sp in runners:
            run(sp, i)
    for i in range(args.rounds):
        for sp in runners:
            rows[sp]["times"].append(run(sp, args.warmup + i))
    runners.clear()
    for r in rows.values():
        r["step_s"] = statistics.median(r["times"])
    return rows


def measure(args: argparse.Namespace) -> dict:
    for sp in args.sizes:
        if args.heads % sp or args.kv_heads % sp or args.budget_len % (sp * args.quantum // math.gcd(sp, args.quantum)):
            raise SystemExit(f"--sizes {sp}: must divide --heads {args.heads} and --kv-heads {args.kv_heads}, and "
                             f"--budget-len / --quantum must be multiples of it")
    first = args.attentions[0]
    base = compiled_peak(args, 1, args.budget_len, first)
    budget = base["peak"]
    print(f"budget: {budget / MiB:.1f} MiB a device ({first}, sequence 1, seq_len {args.budget_len})", file=sys.stderr,
          flush=True)
    modes = {mode: {sp: longest(args, sp, budget, {args.budget_len: base} if (sp, mode) == (1, first) else {}, mode)
                    for sp in args.sizes} for mode in args.attentions}
    return {"budget": budget, "modes": modes, "timed": timed(args)}


# ------------------------------------------------------------------------------------------------
# The section.

def _mib(b: float) -> str:
    return f"{b / MiB:.1f}"


def scores(args: argparse.Namespace, sequence: int, seq_len: int) -> float:
    """Bytes of one layer's float32 attention scores on a device: one row, its h/P heads, seq_len^2."""
    return args.heads // sequence * seq_len * seq_len * 4


def render(args: argparse.Namespace, results: dict, elapsed: float) -> str:
    modes, timed_rows, budget = results["modes"], results["timed"], results["budget"]
    hd = args.d_model // args.heads
    out = [BEGIN, "## Sequence parallelism (Ulysses): the longest sequence, and the step at sequence 1-8", "",
           f"`python -m benchmarks.sequence` ({elapsed:.0f} s here): the shipped Llama at a tiny width (d_model "
           f"{args.d_model}, {args.layers} layers, {args.heads} heads / {args.kv_heads} key-value heads of {hd}, "
           f"d_ff {args.d_ff}, vocabulary {args.vocab}, remat on), ZeRO-3 over data x sequence, fp32 AdamW, "
           f"{DEVICES} virtual CPU devices: `mesh.sequence` (`sequence_parallel_size`) x `data` = {DEVICES}.", "",
           "### Longest sequence under a fixed memory budget", "",
           f"One row per data shard (train_batch_size {DEVICES} / sequence), so a device holds seq_len / sequence "
           f"tokens of one row. Budget: **{_mib(budget)} MiB** a device, the compiled step's peak (`memory_analysis()` "
           f"arguments + temporaries) at sequence 1 and seq_len {args.budget_len} with `model.attention: "
           f"{args.attentions[0]}`, the same budget for every table. At each size seq_len doubles "
           f"from {args.budget_len} while the step fits, then bisects to {args.quantum} tokens (or 1/16 of the length); "
           "every probe is compiled, none is run. **peak at " + str(args.budget_len) + "** is the step's peak at "
           "that length (it must fall with the axis); **over** is the shortest length found not to fit; "
           "**4 x scores** (dense) is four float32 [h/P, seq_len, seq_len] buffers at the longest length (one row a "
           "device): what XLA's live-range report of the compiled dense step finds live at its peak (below)."]
    for mode, fitting in modes.items():
        one = fitting[min(fitting)]["longest"]
        what = ("the whole [h/P, seq_len, seq_len] scores of each layer" if mode == "dense" else
                f"tiles of {args.attention_block} keys with an online softmax (`model.attention_block: "
                f"{args.attention_block}`)")
        out += ["", f"`model.attention: {mode}`: {what}.", "",
                f"| sequence | mesh | peak at {args.budget_len} MiB | / sequence 1 | longest seq_len | / sequence 1 | "
                "target (x sequence) | over | args MiB | temp MiB | peak MiB | 4 x scores MiB | compiles |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        at_base = {sp: f["probes"][args.budget_len]["peak"] for sp, f in fitting.items()}
        for sp, f in fitting.items():
            at = f["at"]
            mesh = f"data {DEVICES // sp}" + (f" x sequence {sp}" if sp > 1 else "")
            four = _mib(4 * scores(args, sp, f["longest"])) if mode == "dense" else "-"
            out.append(f"| {sp} | {mesh} | {_mib(at_base[sp])} | {at_base[sp] / at_base[min(at_base)]:.2f} | "
                       f"{f['longest']} | {f['longest'] / one:.2f} | {sp} | {f['over']} | "
                       f"{_mib(at['args'])} | {_mib(at['temp'])} | {_mib(at['peak'])} | {four} | {len(f['probes'])} |")
    base = timed_rows[min(timed_rows)]["step_s"]
    tokens = args.rows * args.seq_len
    out += ["", "### Step time at the same global tokens", "",
            f"{args.rows} rows of {args.seq_len} tokens a step ({tokens:,} tokens) at every size: at sequence P, "
            f"`data` is {DEVICES}/P and each device holds the seq_len/P-token chunks of P rows, the same tokens and "
            f"matmul FLOPs as one whole row at sequence 1 (`model.attention: auto`: blockwise, the row being longer "
            f"than one block). Median of {args.rounds} steps, the sizes interleaved "
            f"round by round after {args.warmup} warm-up.", "",
            "| sequence | mesh | rows a device x tokens a row | step s | / sequence 1 | tokens/s | loss 1 | peak MiB | "
            "compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for sp, r in timed_rows.items():
        mesh = " x ".join(f"{a} {n}" for a, n in r["mesh"].items())
        out.append(f"| {sp} | {mesh} | {r['batch'].micro_batch_size} x {args.seq_len // sp} | {r['step_s']:.3f} | "
                   f"{r['step_s'] / base:.2f} | {tokens / r['step_s']:,.0f} | {r['losses'][0]:.6f} | "
                   f"{_mib(r['peak'])} | {r['compile_s']:.1f} |")
    out += [""] + notes(args, results) + [END]
    return "\n".join(out)


def notes(args: argparse.Namespace, results: dict) -> list[str]:
    out = ["### Reading the numbers", ""]
    for mode, fitting in results["modes"].items():
        one = fitting[min(fitting)]["longest"]
        last = max(fitting)
        grown = fitting[last]["longest"] / one
        longest = fitting[last]["longest"]
        if mode == "dense":
            out.append(
                f"- **Length, dense attention.** At sequence {last} the longest sequence is {grown:.2f}x sequence 1's "
                f"(sqrt({last}) = {math.sqrt(last):.2f}, linear {last}). The memory at a fixed length falls with the "
                "axis, but the peak is attention's: Ulysses divides every token-wise activation by P (a device holds "
                "seq_len / P tokens), while attention runs over the whole sequence for h/P heads and dense attention "
                "materializes the float32 scores [rows, h/P, seq_len, seq_len]. XLA's live-range report of the "
                "compiled step has four such buffers live at the peak, in the checkpointed layer's backward (the "
                "rematerialized scores and probabilities, and their gradients): 16 h/P seq_len^2 bytes a device, "
                f"{_mib(4 * scores(args, 1, one))} of the {_mib(fitting[1]['at']['peak'])} MiB peak at sequence 1 and "
                f"seq_len {one}, {_mib(4 * scores(args, last, longest))} of {_mib(fitting[last]['at']['peak'])} MiB at "
                f"sequence {last} and seq_len {longest}. A budget held by a term in h/P x seq_len^2 lets seq_len grow "
                "as sqrt(P), not P.")
        else:
            out.append(
                f"- **Length, blockwise attention.** At sequence {last} the longest sequence is {grown:.2f}x sequence "
                f"1's, against {last} for linear growth, and {longest / results['modes'][args.attentions[0]][1]['longest']:.1f}x "
                f"what {args.attentions[0]} attention fits at sequence 1 in the same budget. No [seq_len, seq_len] "
                "buffer exists: each query block meets the keys a block at a time with a running max and sum "
                "(both scans rematerialized in the backward), so attention's memory is h/P x seq_len x block, and "
                "the whole step's is linear in seq_len / P, as DeepSpeed-Ulysses' linear scaling assumes of "
                "FlashAttention.")
    out += [
           "- **Step time.** The same tokens and the same matmul FLOPs at every size (P rows' chunks, h/P heads "
           "each over the whole row), so the ratios stay within the machine's noise; what changes is Ulysses' "
           "two all-to-alls per layer (q, k, v out and the attention output back; their replay under remat and "
           "their transposes in the backward) and the loss of the same batch agrees across the sizes, as "
           "`tests/test_sequence_parallel.py` checks against one device.",
           "", "What a GPU would change: here the 8 devices are virtual devices of one process on this machine's 2 "
           "cores and an XLA:CPU all-to-all is a memory copy, so the step-time ratios weigh computation (each "
           "device's attention over the whole sequence for its heads, the token-wise work on its chunk, and "
           "what the sizes duplicate) and barely the exchange. On GPUs the sequence group sits inside a node "
           "and Ulysses' all-to-alls ride NVLink: per layer forward they move q, k, v and the output, about "
           "4 N d / P elements a device for N tokens of width d (the Ulysses paper's count), so the "
           "communication per device falls with P at a fixed length, which the CPU cannot show. The memory numbers are the "
           "compiler's for this program and carry over; a fused flash-attention kernel on a GPU would also skip "
           "the tiles above the diagonal, which the blockwise form computes and masks. Step times move by "
           "tens of percent between runs on a shared machine: read the lengths and memory, which are "
           "deterministic, over the times.", ""]
    return out


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "sequence")


if __name__ == "__main__":
    sys.exit(main())
