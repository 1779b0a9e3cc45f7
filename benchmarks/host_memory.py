"""Peak host memory (RSS) of a training run at ZeRO stage 0 and 3, with where it goes.

    python -m benchmarks.host_memory                 (or: python benchmarks/host_memory.py)

On 8 virtual CPU devices every device's arrays live in this one process, so the process's resident
memory is what the whole "cluster" needs. Each stage runs in a fresh process (a peak is per
process): the byte-level GPT (`--d-model`, `--layers`; 50M parameters by default) is built, placed
with `init_state`, its step compiled and run for `--steps` steps, with the same settings as
benchmarks/zero.py (bf16 with an fp32 master, AdamW, clipping, the default `run.non_finite`).
Printed per stage: the process's peak resident memory (VmHWM, `ru_maxrss`'s figure) over the whole
run and the peak reached within each phase (reset at its start through /proc/self/clear_refs), and
the live arrays after the last step by role (all 8 devices' shards: params, master, moments, batch;
gradients are temporaries of the step, so they appear in the step's compiled temp bytes, also
summed over the 8 devices). It writes the section between the `host-memory` markers of
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import gpt_args, output_args, run_section  # noqa: E402

BEGIN, END = "<!-- host-memory -->", "<!-- /host-memory -->"
STAGES = (0, 3)
PHASES = ("model", "init_state", "first step")
GIB = 2 ** 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gpt_args(ap, d_model=512, layers=16, heads=8, seq_len=128, micro=1)
    ap.add_argument("--steps", type=int, default=2, help="train steps after the compile")
    ap.add_argument("--against", default=None, help="another checkout of zerojax (e.g. main's) measured the same "
                    "way in the same run, for a before/after table")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--zerojax", default=None, help=argparse.SUPPRESS)
    output_args(ap, "benchmarks.md")
    return ap.parse_args(argv)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) * 1024


def _reset_peak() -> None:
    """Linux resets VmHWM to the current resident size on a write of 5 to clear_refs."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _all_shards(tree: Any) -> int:
    """Bytes of every device's shards of `tree`'s arrays (all of them live in this process)."""
    import jax
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)
               for s in x.addressable_shards)


def child(args: argparse.Namespace, stage: int) -> dict:
    """One stage in this process: the peak of each phase and of the whole run, the live arrays."""
    if args.zerojax:
        sys.path.insert(0, args.zerojax)
    import jax
    import numpy as np
    import zerojax
    from benchmarks.zero import config_dict
    from zerojax.models import gpt

    jax.config.update("jax_num_cpu_devices", 8)
    peaks: dict[str, int] = {}
    ends: dict[str, int] = {}
    overall = _status_bytes("VmHWM")

    def phase(name: str, fn: Any) -> Any:
        nonlocal overall
        overall = max(overall, _status_bytes("VmHWM"))
        _reset_peak()
        out = fn()
        peaks[name] = _status_bytes("VmHWM")
        ends[name] = _status_bytes("VmRSS")
        overall = max(overall, peaks[name])
        return out

    start = _status_bytes("VmRSS")
    cfg = zerojax.load_config(config_dict(args, stage))
    mesh = zerojax.make_mesh(cfg)
    params = phase("model", lambda: gpt.init_params(cfg.model, 0))
    psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    engine = phase("init_state", lambda: zerojax.initialize(cfg, params, gpt.make_loss_fn(cfg.model), mesh))
    del params
    rows = args.micro * 8
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 256, (rows, args.seq_len + 1)).astype(np.int32)}

    def train() -> None:
        for _ in range(args.steps):
            jax.block_until_ready(engine.train_batch(batch)["loss"])
    # The engine's first train_batch compiles the step and runs it: that is the peak users see.
    phase("first step", train)
    state = engine.state
    placed = engine.place_batch(batch, engine.plan.batch.train_batch_size)
    compiled = engine.train_step_fn.lower(state, placed).compile()  # cached: reads the step's temp
    mem = compiled.memory_analysis()
    live = {"params": _all_shards(state.params), "master": _all_shards(state.master),
            "moments": _all_shards(state.opt_state), "batch": _all_shards(placed),
            "step temp (8 devices)": 8 * mem.temp_size_in_bytes}
    return {"stage": stage, "psi": psi, "start": start, "peak": overall, "phases": peaks, "ends": ends, "live": live}


def measure(args: argparse.Namespace) -> dict:
    """Each stage in its own process, one after the other (never two large runs at once); with
    `--against`, the other checkout's run of each stage right after this one's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": root, **({"against": os.path.abspath(args.against)} if args.against else {})}
    results: dict = {key: {} for key in trees}
    for stage in STAGES:
        for key, tree in trees.items():
            cmd = [sys.executable, "-m", "benchmarks.host_memory", "--child", str(stage), "--zerojax", tree,
                   "--d-model", str(args.d_model), "--layers", str(args.layers), "--heads", str(args.heads),
                   "--seq-len", str(args.seq_len), "--micro", str(args.micro), "--steps", str(args.steps)]
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root, env=env).stdout
            results[key][stage] = json.loads(out.strip().splitlines()[-1])
            print(f"{key}, stage {stage}: peak {results[key][stage]['peak'] / GIB:.2f} GiB", file=sys.stderr, flush=True)
    return results


def render(args: argparse.Namespace, results: dict, elapsed: float) -> str:
    psi = results["this"][STAGES[0]]["psi"]
    lines = [BEGIN, "## Host memory: peak resident memory of a training run by stage", "",
             f"`python -m benchmarks.host_memory` ({elapsed:.0f} s here): the byte-level GPT, d_model {args.d_model}, "
             f"{args.layers} layers, Ψ = {psi / 1e6:.1f}M parameters, {args.micro} row(s) of {args.seq_len} tokens per "
             f"device, bf16 with an fp32 master, AdamW, 8 virtual CPU devices in one process (so the process holds "
             f"every device's arrays), each stage in a fresh process through `zerojax.initialize` and {args.steps} `train_batch` call(s) (the first compiles the step). "
             "**peak**: the process's peak resident memory (VmHWM) over the run; the phase columns are the peak "
             "reached within each phase (reset at its start); **live** is what the arrays hold after the last "
             "step, all 8 devices' shards, by role; **step temp** is the compiled step's temp bytes times 8; "
             "**baseline** is the process's resident memory before the model is built (Python, jaxlib, the XLA "
             "runtime); **unexplained** is peak - baseline - live - step temp.", "",
             "| stage | peak GiB | model | initialize | first steps | params | master | moments | batch | step temp "
             "| baseline | unexplained |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    labels = {"this": "", "against": f" (`{args.against}`)"}
    for key, res in results.items():
        for stage in STAGES:
            r = res[stage]
            ph = " | ".join(f"{r['phases'][p] / GIB:.2f}" for p in PHASES)
            lv = " | ".join(f"{v / GIB:.2f}" for v in r["live"].values())
            rest = r["peak"] - r["start"] - sum(r["live"].values())
            lines.append(f"| {stage}{labels[key]} | {r['peak'] / GIB:.2f} | {ph} | {lv} | {r['start'] / GIB:.2f} "
                         f"| {rest / GIB:.2f} |")
    lines.append("")
    for key, res in results.items():
        lines.append(f"Stage 0 / stage 3 peak host memory{labels[key]}: **{res[0]['peak'] / res[3]['peak']:.2f}x** "
                     f"({res[0]['peak'] / GIB:.2f} / {res[3]['peak'] / GIB:.2f} GiB); above each process's baseline: "
                     f"**{(res[0]['peak'] - res[0]['start']) / (res[3]['peak'] - res[3]['start']):.2f}x**.")
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args, args.child)))
        return 0
    return run_section(argv, parse_args, measure, render, BEGIN, END, "host-memory")


if __name__ == "__main__":
    t0 = time.perf_counter()
    sys.exit(main())
