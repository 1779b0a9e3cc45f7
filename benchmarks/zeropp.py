"""ZeRO++ (hpZ, qwZ, qgZ) against plain ZeRO-3 on a (2 hosts x 4) CPU mesh.

    python -m benchmarks.zeropp            (or: python benchmarks/zeropp.py)

For the embedded GPT (bf16 mixed precision, AdamW, stage3_param_persistence_threshold 0 so every
parameter is partitioned) on 8 virtual CPU devices arranged as `mesh.data_outer: 2` x `data_inner: 4`:

* collective bytes per device per step, parsed (zerojax/hlo.py, ZeRO-paper accounting) from the step's
  module right after SPMD partitioning (the collectives and dtypes the program asks for; XLA:CPU later
  widens bf16 collectives to f32), split by whether an op's replica groups stay within one inner group
  ("intra") or span the outer axis ("cross"): parameter all-gathers, and gradient reductions
  (reduce-scatter + all-to-all);
* the training loss over `--steps` steps on one synthetic corpus, each configuration from the same
  initial parameters and batches; final loss = mean of the last 10 steps.

Writes its section of docs/benchmarks.md and prints the same Markdown.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

_DUMP = ""
if __name__ == "__main__":  # XLA reads its flags once, before JAX starts
    _DUMP = tempfile.mkdtemp(prefix="zerojax-zeropp-hlo-")
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={_DUMP}", "--xla_dump_hlo_module_re=jit_step",
        "--xla_dump_hlo_pass_re=^spmd-partitioning$"]))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_compilation_cache", False)  # a cache hit would skip the HLO dump

import numpy as np  # noqa: E402

import zerojax  # noqa: E402
from benchmarks.report import gpt_args, output_args, run_section  # noqa: E402
from zerojax.measure import hlo  # noqa: E402
from zerojax.models import gpt  # noqa: E402

BEGIN, END = "<!-- zeropp:begin -->", "<!-- zeropp:end -->"
HOSTS = ((0, 1, 2, 3), (4, 5, 6, 7))  # partition ids of each inner group on the (2 x 4) mesh
CONFIGS = {  # label -> (hpz, quantized weights, quantized gradients)
    "ZeRO-3": (1, False, False),
    "hpZ": (4, False, False),
    "qwZ": (1, True, False),
    "qgZ": (1, False, True),
    "qwZ + qgZ": (1, True, True),
    "hpZ + qwZ + qgZ": (4, True, True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpt_args(ap, d_model=128, layers=4, heads=4, seq_len=64, micro=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated rows to run (ZeRO-3, the reference, always runs)")
    output_args(ap, "benchmarks.md")
    return ap.parse_args(argv)


def config(args: argparse.Namespace, hpz: int, qw: bool, qg: bool) -> zerojax.Config:
    return zerojax.load_config({
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "zero_hpz_partition_size": hpz, "zero_quantized_weights": qw,
                              "zero_quantized_gradients": qg},
        "mesh": {"data_outer": 2},
        "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads,
                  "seq_len": args.seq_len, "vocab_size": 256},
    })


def corpus(steps: int, rows: int, seq_len: int) -> np.ndarray:
    """Learnable token streams: each row counts up from a random start by a random stride (1-7)
    modulo 256, with 5% of tokens replaced by noise."""
    rng = np.random.default_rng(0)
    start = rng.integers(0, 256, (steps, rows, 1))
    stride = rng.integers(1, 8, (steps, rows, 1))
    tokens = (start + stride * np.arange(seq_len + 1)) % 256
    noise = rng.random(tokens.shape) < 0.05
    tokens = np.where(noise, rng.integers(0, 256, tokens.shape), tokens)
    return tokens.astype(np.int32)


def traffic(text: str) -> dict[str, float]:
    """Bytes per device per step: gathers and gradient reductions, within an inner group or across."""
    out = {k: 0.0 for k in ("gather_intra", "gather_cross", "reduce_intra", "reduce_cross")}
    for c in hlo.collectives(text):
        kind = {"all-gather": "gather", "reduce-scatter": "reduce", "all-to-all": "reduce"}.get(c.kind)
        if kind:
            out[f"{kind}_{'cross' if c.crosses(HOSTS) else 'intra'}"] += c.bytes_per_device
    return out


def measure(args: argparse.Namespace) -> dict:
    results = {}
    base = config(args, 1, False, False)
    params = gpt.init_params(base.model, 0)
    tokens = corpus(args.steps, args.micro * 8, args.seq_len)
    chosen = ["ZeRO-3"] + [c.strip() for c in args.configs.split(",") if c.strip() and c.strip() != "ZeRO-3"]
    for label in chosen:
        hpz, qw, qg = CONFIGS[label]
        cfg = config(args, hpz, qw, qg)
        mesh = zerojax.make_mesh(cfg)
        plan = zerojax.plan(cfg, mesh, params)
        state = zerojax.init_state(cfg, plan, params)
        step = zerojax.make_train_step(cfg, plan, gpt.make_loss_fn(cfg.model))
        before = set(glob.glob(os.path.join(_DUMP, "*after_spmd-partitioning*.txt")))
        t = time.perf_counter()
        compiled = step.lower(state, {"tokens": tokens[0]}).compile()
        compile_s = time.perf_counter() - t
        files = sorted(set(glob.glob(os.path.join(_DUMP, "*after_spmd-partitioning*.txt"))) - before)
        if len(files) != 1:
            raise RuntimeError(f"run as `python -m benchmarks.zeropp` (the HLO dump is set up before JAX "
                               f"starts); expected one partitioned module in {_DUMP}, found {files}")
        comm = traffic(open(files[0]).read())
        losses = []
        t = time.perf_counter()
        for i in range(args.steps):
            state, m = compiled(state, {"tokens": tokens[i]})
            # one step in flight: hundreds of queued 8-device steps can starve XLA:CPU's collective
            # rendezvous on a 2-core machine
            losses.append(float(m["loss"]))
        results[label] = dict(comm=comm, losses=losses, final=float(np.mean(losses[-10:])),
                              step_s=(time.perf_counter() - t) / args.steps, compile_s=compile_s,
                              params_bytes=plan.report().params)
        print(f"{label}: final loss {results[label]['final']:.4f}, {comm}", file=sys.stderr, flush=True)
    results["_psi"] = sum(x.size for x in jax.tree.leaves(params))
    return results


def render(args: argparse.Namespace, results: dict, seconds: float) -> str:
    psi = results.pop("_psi")
    ref = results["ZeRO-3"]
    kib = lambda b: f"{b / 2**10:,.1f}"  # noqa: E731
    out = [BEGIN, "## ZeRO++: hpZ, qwZ, qgZ (`python -m benchmarks.zeropp`)", "",
           f"GPT d_model {args.d_model}, {args.layers} layers, {args.heads} heads, seq_len {args.seq_len}, "
           f"vocab 256 ({psi:,} parameters), bf16 mixed precision, AdamW, every parameter partitioned "
           f"(persistence threshold 0), {args.micro} rows per device per step, on 8 CPU devices as "
           f"2 hosts x 4 (`mesh.data_outer: 2`); {seconds:.0f} s in all.", "",
           "Collective KiB per device per step (ZeRO accounting, from the module after SPMD partitioning: "
           "the program's dtypes). *intra*: replica groups within one host's inner group; *cross*: groups "
           "spanning hosts. Gathers: parameter all-gathers (forward, backward and - hpZ - the one that builds "
           "the secondary copy after the update); reductions: gradient reduce-scatters and all-to-alls.", "",
           "| config | gather intra | gather cross | gather total / ZeRO-3 | reduce intra | reduce cross | "
           "reduce total / ZeRO-3 | params KiB/device | final loss | / ZeRO-3 | step ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    g0 = ref["comm"]["gather_intra"] + ref["comm"]["gather_cross"]
    r0 = ref["comm"]["reduce_intra"] + ref["comm"]["reduce_cross"]
    for label, r in results.items():
        c = r["comm"]
        g = c["gather_intra"] + c["gather_cross"]
        red = c["reduce_intra"] + c["reduce_cross"]
        out.append(f"| {label} | {kib(c['gather_intra'])} | {kib(c['gather_cross'])} | {g / g0:.3f} | "
                   f"{kib(c['reduce_intra'])} | {kib(c['reduce_cross'])} | {red / r0:.3f} | "
                   f"{kib(r['params_bytes'])} | {r['final']:.4f} | {r['final'] / ref['final']:.4f} | "
                   f"{1e3 * r['step_s']:.0f} |")
    out.append("")
    if "hpZ" in results:
        hp = results["hpZ"]["comm"]
        out.append(f"- hpZ's cross-host parameter gathers: {kib(hp['gather_cross'])} KiB against ZeRO-3's "
                   f"{kib(ref['comm']['gather_cross'])} KiB ({hp['gather_cross'] / ref['comm']['gather_cross']:.3f}x); "
                   f"the secondary copy costs params/4 per device instead of params/8.")
    out += [
            "- qwZ compares int8 codes + one fp32 scale per 256 elements with ZeRO-3's bf16 gathers; qgZ compares "
            "packed int4 codes + one fp32 scale per 64 elements in one all-to-all with the bf16 reduce-scatters. Gradients of "
            "parameters gathered before the loss (1-D leaves sharded on their only axis) keep a plain "
            "reduce-scatter.",
            f"- Loss: mean of the last 10 of {args.steps} steps on a synthetic counting corpus, same initial "
            "parameters and batches for every row. Step ms: mean over the steps, run one at a time; eight "
            "virtual devices share two CPU cores (with whatever else runs on the machine), quantizing costs "
            "compute and the links cost nothing: not a speed comparison.",
            "", END]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "ZeRO++")


if __name__ == "__main__":
    sys.exit(main())
