"""Offload and multi-process runs, measured side by side.

    python -m benchmarks.distributed          (or: python benchmarks/distributed.py)

For the embedded GPT (bf16 parameters, fp32 master weights, AdamW) on 8 virtual CPU devices:

* **offload**, in one process: every ZeRO stage 1-3 without offload, with optimizer offload (update
  on the host, `compute: host`, and on the device, `compute: device`) and, for stage 3, with
  parameters offloaded too. Per device: model-state bytes in device and in host memory (the plan's
  report), the host bytes the compiled step really takes (its entry layout), and the step time,
  median over rounds that run every configuration once. On CPU host and device memory are the same
  RAM, so the times show the cost of the extra program structure, not of PCIe transfers.
* **processes**: the same model and config trained by 1 process x 8 devices and by
  `zerojax launch -n 2` (2 processes x 4 devices, gloo collectives), alternating, each reporting its
  median step time after warm-up, plus the wall time of the whole command.

Writes docs/benchmarks-distributed.md and prints the same Markdown.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4, help="rows per device per step")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8, help="offload: timed rounds (each runs every config)")
    ap.add_argument("--steps", type=int, default=12, help="processes: timed steps per run")
    ap.add_argument("--runs", type=int, default=2, help="processes: runs of each launch, alternating")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks-distributed.md"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def config_dict(args: argparse.Namespace, stage: int, offload: dict | None = None) -> dict:
    zero = {"stage": stage, **(offload or {})}
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
            "bf16": {"enabled": True}, "zero_optimization": zero, "mesh": {"cpu_devices": 8},
            "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 4, "seq_len": args.seq_len}}


OFFLOADS = {
    "none": None,
    "optimizer, update on host": {"offload_optimizer": {"device": "cpu", "compute": "host"}},
    "optimizer, update on device": {"offload_optimizer": {"device": "cpu", "compute": "device"}},
    "optimizer + parameters": {"offload_optimizer": {"device": "cpu", "compute": "host"},
                               "offload_param": {"device": "cpu"}},
}


def tokens(rows: int, seq_len: int, seed: int):
    import numpy as np
    return {"tokens": np.random.default_rng(seed).integers(0, 256, (rows, seq_len + 1)).astype(np.int32)}


# ---------------------------------------------------------------------------------------------
# Offload, in this process.

def offload_rows(args: argparse.Namespace) -> list[dict]:
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import zerojax
    from zerojax.models import gpt
    from zerojax.core.measure import step_memory

    runs = []
    for stage in (1, 2, 3):
        for name, offload in OFFLOADS.items():
            if "parameters" in name and stage != 3:
                continue
            cfg = zerojax.load_config(config_dict(args, stage, offload))
            engine = zerojax.initialize(cfg, params=gpt.init_params(cfg.model, 0), loss_fn=gpt.make_loss_fn(cfg.model))
            batch = engine.place_batch(tokens(engine.train_batch_size(), args.seq_len, 0), engine.train_batch_size())
            t = time.perf_counter()
            compiled = engine.train_step_fn.lower(engine.state, batch).compile()
            rep = engine.memory_report()
            runs.append(dict(stage=stage, offload=name, engine=engine, batch=batch, times=[],
                             compile_s=time.perf_counter() - t, device=rep.device, host=rep.host,
                             hlo_host=step_memory(compiled).host_arguments, update=engine.plan.memory.update,
                             n_params=rep.n_params))
            print(f"stage {stage}, {name}: compiled", file=sys.stderr, flush=True)
    for _ in range(args.warmup):
        for r in runs:
            jax.block_until_ready(r["engine"].train_batch(r["batch"]))
    for i in range(args.rounds):
        for r in runs:
            t = time.perf_counter()
            jax.block_until_ready(r["engine"].train_batch(r["batch"]))
            r["times"].append(time.perf_counter() - t)
        print(f"offload round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
    for r in runs:
        r["step_s"] = statistics.median(r["times"])
        r["params"] = jax.tree.map(lambda x: jax.device_get(x), r["engine"].params)
    return runs


# ---------------------------------------------------------------------------------------------
# One process of a timed training run (`--worker`), and the launches.

def worker(args: argparse.Namespace) -> int:
    import zerojax
    from zerojax.runtime.distributed import is_primary, local_rows, start
    cfg = zerojax.load_config(config_dict(args, 3))
    start(cfg)
    import jax
    from zerojax.models import gpt
    engine = zerojax.initialize(cfg, params=gpt.init_params(cfg.model, 0), loss_fn=gpt.make_loss_fn(cfg.model))
    rows = engine.train_batch_size()
    mine = local_rows(engine.plan.batch_sharding, rows)
    times = []
    for i in range(args.warmup + args.steps):
        batch = {k: v[mine] for k, v in tokens(rows, args.seq_len, i).items()}
        t = time.perf_counter()
        metrics = engine.train_batch(batch)
        loss = float(metrics["loss"])  # waits for the step
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    if is_primary():
        print("RESULT " + json.dumps({"processes": jax.process_count(), "devices": jax.device_count(),
                                      "step_s": statistics.median(times), "loss": loss}), flush=True)
    return 0


def launch_rows(args: argparse.Namespace) -> list[dict]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    knobs = [f"--d-model={args.d_model}", f"--layers={args.layers}", f"--seq-len={args.seq_len}",
             f"--micro={args.micro}", f"--warmup={args.warmup}", f"--steps={args.steps}", "--worker"]
    script = os.path.join(ROOT, "benchmarks", "distributed.py")
    commands = {1: [sys.executable, script, *knobs],
                2: [sys.executable, "-m", "zerojax.cli", "launch", "-n", "2", script, *knobs]}
    results: dict[int, list[dict]] = {1: [], 2: []}
    for run in range(args.runs):
        for n, cmd in commands.items():
            t = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            wall = time.perf_counter() - t
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
            line = next(l for l in proc.stdout.splitlines() if "RESULT " in l)
            results[n].append({**json.loads(line.split("RESULT ", 1)[1]), "wall_s": wall})
            print(f"processes: run {run + 1}, {n} process(es) done in {wall:.0f}s", file=sys.stderr, flush=True)
    return [dict(processes=n, step_s=statistics.median(r["step_s"] for r in rs),
                 wall_s=statistics.median(r["wall_s"] for r in rs), loss=rs[-1]["loss"],
                 devices=rs[-1]["devices"], runs=len(rs)) for n, rs in results.items()]


# ---------------------------------------------------------------------------------------------

def render(args: argparse.Namespace, off: list[dict], procs: list[dict], elapsed: float) -> str:
    import numpy as np
    out = ["# Distributed and offload benchmarks", "",
           "<!-- Written by `python -m benchmarks.distributed`; do not edit by hand. -->", "",
           f"Embedded GPT, {off[0]['n_params']:,} parameters (d_model {args.d_model}, {args.layers} layers, "
           f"seq_len {args.seq_len}), bf16 parameters with fp32 master weights and AdamW, "
           f"{args.micro} rows per device, 8 virtual CPU devices on a {os.cpu_count()}-core machine. "
           f"The whole benchmark took {elapsed:.0f} s. The machine may be shared: absolute times move with "
           f"its load, so compare rows within one table (each table's rows were run interleaved).", "",
           "## Offload (one process)", "",
           "Bytes are per device. *host (HLO)* is what the compiled step's entry layout puts in host memory "
           "(`S(5)`); it must equal the plan's host bytes. *max diff* is the largest parameter difference "
           "to the same stage without offload after the same steps. On CPU, host and device memory are the "
           "same RAM: the times show what the offload program costs here, not PCIe.", "",
           "| stage | offload | update on | device MiB | host MiB | host (HLO) MiB | step ms | vs none | max diff |",
           "|---|---|---|---|---|---|---|---|---|"]
    base = {r["stage"]: r for r in off if r["offload"] == "none"}
    for r in off:
        b = base[r["stage"]]
        diff = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                   for x, y in zip(_leaves(r["params"]), _leaves(b["params"])))
        out.append(f"| {r['stage']} | {r['offload']} | {r['update'] if r['offload'] != 'none' else '-'} | "
                   f"{r['device'] / MIB:.2f} | {r['host'] / MIB:.2f} | {r['hlo_host'] / MIB:.2f} | "
                   f"{1e3 * r['step_s']:.1f} | {r['step_s'] / b['step_s']:.2f}x | {diff:.1e} |")
    one = next(p for p in procs if p["processes"] == 1)
    out += ["", "## One process x 8 devices against `zerojax launch -n 2` (2 x 4 devices)", "",
            f"ZeRO stage 3, the same config and batches; median step time over {args.steps} steps after "
            f"{args.warmup} warm-up steps, median over {one['runs']} runs of each, run alternately. *wall* is "
            f"the whole command (start-up, compile, steps).", "",
            "| processes | devices | step ms | vs 1 process | wall s | last loss |", "|---|---|---|---|---|---|"]
    for p in procs:
        out.append(f"| {p['processes']} | {p['devices']} | {1e3 * p['step_s']:.1f} | "
                   f"{p['step_s'] / one['step_s']:.2f}x | {p['wall_s']:.1f} | {p['loss']:.5f} |")
    out += ["", "Two processes on one 2-core machine exchange gradients and parameters through gloo over "
                "loopback instead of shared memory, so a slowdown here is expected; the point of the "
                "multi-process path is hosts that each bring their own devices.", ""]
    return "\n".join(out)


def _leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    t0 = time.perf_counter()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    procs = launch_rows(args)   # before this process starts JAX: the runs get the machine to themselves
    off = offload_rows(args)
    text = render(args, off, procs, time.perf_counter() - t0)
    print(text)
    if not args.no_write:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
