"""ZeRO stages 0-3 against the ZeRO paper's formulas and a hand-written JAX FSDP baseline.

    python -m benchmarks.zero            (or: python benchmarks/zero.py)

For one GPT (>= 20M parameters, bf16 mixed precision, AdamW) on 8 virtual CPU devices, and for
each ZeRO stage plus the FSDP baseline (benchmarks/fsdp_baseline.py), measures

* model-state bytes per device, summed over the real state arrays' first addressable shard
  (gradients: zero arrays materialized in the plan's gradient-accumulator shardings), against
  the plan's ZeRO formula (`Plan.report()`, this run's dtypes, K = 12);
* collective bytes per device per step, parsed from HLO text (zerojax/hlo.py): once from the
  compiled executable, and once from the module right after SPMD partitioning (the collectives
  the program asks for, before the backend rewrites them: XLA:CPU widens bf16 collectives to
  f32); against the ideal 2Ψ (stages 0-2) or 3Ψ (stage 3, FSDP) in the policy's dtypes;
* the compiled step's temp and peak bytes (`memory_analysis()`);
* step time: median over rounds that run every configuration once, in one process.

Writes docs/benchmarks.md and prints the same Markdown.
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

_T0 = time.perf_counter()
_DUMP = ""
if __name__ == "__main__":  # XLA reads its flags once, before JAX starts: only when run as the benchmark
    _DUMP = tempfile.mkdtemp(prefix="zerojax-bench-hlo-")
    _MODULES = "jit_(fsdp_)?step"  # zerojax's step and the baseline's; nothing else is dumped
    # The module right after SPMD partitioning: collectives as the program and partitioner ask for them.
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={_DUMP}", f"--xla_dump_hlo_module_re={_MODULES}",
        "--xla_dump_hlo_pass_re=^spmd-partitioning$"]))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_compilation_cache", False)  # a cache hit would skip the HLO dump

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import zerojax.config  # noqa: E402
import zerojax.core.mesh  # noqa: E402
import zerojax.planner.mesh  # noqa: E402
import zerojax.planner.plan  # noqa: E402
from zerojax.measure import hlo  # noqa: E402
from zerojax.core.measure import array_bytes  # noqa: E402
from benchmarks.fsdp_baseline import make_fsdp  # noqa: E402
from benchmarks.report import gpt_args, output_args, write_head  # noqa: E402
from zerojax.models import gpt  # noqa: E402

MiB = 2 ** 20
FSDP = "FSDP"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpt_args(ap, d_model=512, layers=7, heads=8, seq_len=128, micro=1)
    output_args(ap, "benchmarks.md", warmup=1, rounds=5)
    return ap.parse_args(argv)


def config_dict(args: argparse.Namespace, stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
        "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads,
                  "seq_len": args.seq_len, "vocab_size": 256},
    }


def materialized_bytes(abstract, shardings, dtype) -> int:
    """Bytes per device of zero arrays created in `shardings` (the gradient accumulator)."""
    make = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, dtype), abstract), out_shardings=shardings)
    arrays = make()
    n = array_bytes(arrays)
    jax.tree.map(lambda x: x.delete(), arrays)
    return n


def new_dump_file(before: set[str], module: str) -> str:
    if not _DUMP:
        raise RuntimeError("run the benchmark as `python -m benchmarks.zero`: the HLO dump is set up "
                           "before JAX starts, only when this module is the main program")
    files = sorted(set(glob.glob(os.path.join(_DUMP, f"*.{module}.*after_spmd-partitioning*.txt"))) - before)
    if len(files) != 1:
        raise RuntimeError(f"expected one SPMD-partitioned dump of {module} in {_DUMP}, found {files}")
    return files[0]


def dumped() -> set[str]:
    return set(glob.glob(os.path.join(_DUMP, "*.txt")))


def collective_stats(text: str, theory_bytes: float, theory_elems: float) -> dict:
    found = hlo.collectives(text)
    s = hlo.summarize(found)
    s["ratio"] = s["bytes"] / theory_bytes
    s["elem_ratio"] = s["elems"] / theory_elems
    s["list"] = found
    return s


def batches(n: int, rows: int, seq_len: int, sharding) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"tokens": jax.device_put(rng.integers(0, 256, (rows, seq_len + 1)).astype(np.int32), sharding)}
            for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict = {}
    runners: dict = {}
    base_cfg = zerojax.config.load_config(config_dict(args, 0))
    mesh = zerojax.planner.mesh.make_mesh(base_cfg)
    n = zerojax.core.mesh.data_size(mesh)
    params = gpt.init_params(base_cfg.model, 0)
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    rows = args.micro * n
    data = batches(args.warmup + args.rounds, rows, args.seq_len,
                   jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    frac = (n - 1) / n

    for stage in (0, 1, 2, 3):
        cfg = zerojax.config.load_config(config_dict(args, stage))
        plan = zerojax.planner.plan.make_plan(cfg, mesh, params)
        rep = plan.report()
        pol = plan.policy
        state = zerojax.init_state(cfg, plan, params)
        step = zerojax.make_train_step(cfg, plan, gpt.make_loss_fn(cfg.model))
        before = dumped()
        t = time.perf_counter()
        compiled = step.lower(state, data[0]).compile()
        compile_s = time.perf_counter() - t
        partitioned = open(new_dump_file(before, "jit_step")).read()
        comm = pol.comm or pol.accum  # dtype of gradient reductions
        k = 3 if stage == 3 else 2    # ideal volume in units of Ψ
        # Ideal: gradients reduced once in `comm`; parameters gathered (k - 1) times in `param`
        # (stage 0: one all-reduce = reduce-scatter + all-gather, both of gradients).
        theory = psi * frac * (2 * comm.itemsize if stage == 0
                               else comm.itemsize + (k - 1) * pol.param.itemsize)
        mem = compiled.memory_analysis()
        results[stage] = dict(
            params=array_bytes(state.params),
            grads=materialized_bytes(plan.abstract_params, plan.grad_shardings, pol.accum),
            optimizer=array_bytes(state.master) + array_bytes(state.opt_state),
            formula=rep.formula_total, formula_parts=(rep.formula_params, rep.formula_grads, rep.formula_optimizer),
            replicated=rep.replicated_fraction, k=k, theory=theory,
            compiled=collective_stats(compiled.as_text(), theory, k * psi * frac),
            program=collective_stats(partitioned, theory, k * psi * frac),
            args_bytes=mem.argument_size_in_bytes, temp=mem.temp_size_in_bytes,
            peak=mem.peak_memory_in_bytes, compile_s=compile_s, times=[])
        runners[stage] = [compiled, state, lambda c, s, b: c(s, b), None]
        print(f"stage {stage}: compiled in {compile_s:.1f}s", file=sys.stderr, flush=True)

    # The hand-written FSDP baseline: same model, data, optimizer settings and clipping.
    opt = base_cfg.optimizer.params
    state, step, shardings = make_fsdp(base_cfg.model, mesh, params, lr=opt.lr, betas=tuple(opt.betas),
                                       eps=opt.eps, weight_decay=opt.weight_decay,
                                       clip=base_cfg.gradient_clipping)
    before = dumped()
    t = time.perf_counter()
    compiled = step.lower(state, data[0]).compile()
    compile_s = time.perf_counter() - t
    partitioned = open(new_dump_file(before, "jit_fsdp_step")).read()
    theory = psi * frac * 3 * 2  # bf16 gathers fwd + bwd, bf16 gradient reduce-scatter
    mem = compiled.memory_analysis()
    grad_sh = shardings["params"]
    results[FSDP] = dict(
        params=array_bytes(state["params"]),
        grads=materialized_bytes(params, grad_sh, jnp.bfloat16),
        optimizer=array_bytes(state["master"]) + array_bytes(state["opt"]),
        formula=16 * psi / n, formula_parts=(2 * psi / n, 2 * psi / n, 12 * psi / n),
        replicated=0.0, k=3, theory=theory,
        compiled=collective_stats(compiled.as_text(), theory, 3 * psi * frac),
        program=collective_stats(partitioned, theory, 3 * psi * frac),
        args_bytes=mem.argument_size_in_bytes, temp=mem.temp_size_in_bytes,
        peak=mem.peak_memory_in_bytes, compile_s=compile_s, times=[])
    runners[FSDP] = [compiled, state, lambda c, s, b: c(s, b), None]
    print(f"FSDP baseline: compiled in {compile_s:.1f}s", file=sys.stderr, flush=True)

    # Timing: warm-up, then rounds that run every configuration once (drift hits all alike).
    def run_one(key, batch) -> float:
        c, s, call, _ = runners[key]
        t = time.perf_counter()
        s, out = call(c, s, batch)
        jax.block_until_ready((s, out))
        runners[key][1] = s
        runners[key][3] = out
        return time.perf_counter() - t

    for i in range(args.warmup):
        for key in runners:
            run_one(key, data[i])
    for i in range(args.rounds):
        for key in runners:
            results[key]["times"].append(run_one(key, data[args.warmup + i]))
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for key, (_, _, _, out) in runners.items():
        loss = out["loss"] if isinstance(out, dict) else out
        results[key]["loss"] = float(loss)
        results[key]["step_s"] = statistics.median(results[key]["times"])

    elapsed = time.perf_counter() - _T0
    text = render(args, psi, n, results, elapsed)
    print(text)
    if not args.no_write:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        write_head(args.out, text)  # the sections other benchmarks wrote stay
        print(f"wrote the head of {args.out}", file=sys.stderr)
    shutil.rmtree(_DUMP, ignore_errors=True)
    print(f"benchmark took {elapsed:.0f}s", file=sys.stderr)
    return 0


def _name(key) -> str:
    return "FSDP (hand-written JAX)" if key == FSDP else f"ZeRO-{key}"


def _dtypes(stats: dict) -> str:
    total = stats["bytes"] or 1
    parts = sorted(stats["by_dtype"].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{d} {100 * b / total:.0f}%" for d, b in parts if b / total >= 0.005) or "-"


def _kinds(stats: dict) -> str:
    short = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A",
             "collective-permute": "CP"}
    parts = sorted(stats["by_kind"].items(), key=lambda kv: -kv[1])
    return " + ".join(f"{short[k]} {b / MiB:.1f}" for k, b in parts if b >= 0.05 * MiB) or "-"


def render(args, psi: int, n: int, results: dict, elapsed: float) -> str:
    s0, fsdp = results[0]["step_s"], results[FSDP]["step_s"]
    fp32_grads = 4 * psi
    L = []
    L.append("# Benchmarks: ZeRO stages on 8 virtual CPU devices\n")
    L.append("Generated by `python -m benchmarks.zero` (see `benchmarks/README.md` for what each column "
             "means). Everything except the step times is deterministic; the times come from 8 virtual "
             f"devices sharing this machine's {os.cpu_count()} CPU cores, so only their ratios within "
             "this one run mean anything.\n")
    L.append(f"Model: byte-level GPT, d_model {args.d_model}, {args.layers} layers (stacked, scanned, "
             f"rematerialized), {args.heads} heads, seq_len {args.seq_len}: **Ψ = {psi:,} parameters**. "
             f"bf16 parameters and gradients, fp32 master copy and AdamW moments (K = 12); "
             f"{args.micro} row(s) per device per step ({args.micro * n} x {args.seq_len} tokens), "
             f"N = {n} data-parallel devices, jax {jax.__version__}. "
             f"Run time of the whole benchmark: {elapsed:.0f} s.\n")
    L.append("## Summary\n")
    L.append("| config | model state / formula | collective bytes / ideal (compiled) | "
             "(as partitioned) | volume / ideal | temp / fp32 grads | step time vs ZeRO-0 | vs FSDP |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in results.items():
        total = r["params"] + r["grads"] + r["optimizer"]
        L.append(f"| {_name(key)} | {total / r['formula']:.3f} | {r['compiled']['ratio']:.2f} | "
                 f"{r['program']['ratio']:.2f} | {r['compiled']['elem_ratio']:.2f} | "
                 f"{r['temp'] / fp32_grads:.2f} | {r['step_s'] / s0:.2f} | {r['step_s'] / fsdp:.2f} |")
    L.append("")
    L.append("## Model state per device (MiB)\n")
    L.append("Measured from the state arrays (first addressable shard of every leaf); gradients are the "
             "accumulator's layout, materialized. Formula: params P·Ψ, gradients G·Ψ, optimizer K·Ψ, each "
             "/N where the stage partitions it (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N).\n")
    L.append("| config | params | grads | optimizer (master+m+v) | total | formula | ratio | "
             "left replicated |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in results.items():
        total = r["params"] + r["grads"] + r["optimizer"]
        fp, fg, fo = r["formula_parts"]
        L.append(f"| {_name(key)} | {r['params'] / MiB:.2f} ({r['params'] / fp:.3f}) | "
                 f"{r['grads'] / MiB:.2f} ({r['grads'] / fg:.3f}) | {r['optimizer'] / MiB:.2f} "
                 f"({r['optimizer'] / fo:.3f}) | {total / MiB:.2f} | {r['formula'] / MiB:.2f} | "
                 f"{total / r['formula']:.3f} | {100 * r['replicated']:.2f}% |")
    L.append("")
    L.append("## Collectives per device per step\n")
    L.append("Bytes each device sends, counted as in the ZeRO paper (all-reduce 2S(N-1)/N, "
             "reduce-scatter S_in(N-1)/N, all-gather S_out(N-1)/N), with ops inside while loops "
             "(the layer scan) multiplied by the trip count. Ideal: Ψ(N-1)/N per reduction of gradients "
             "in the gradient dtype (bf16) plus Ψ(N-1)/N per gather of parameters in the parameter "
             "dtype (bf16): 2Ψ in all for stages 0-2, 3Ψ for stage 3 and FSDP. *Compiled* reads "
             "`compiled.as_text()`; *as partitioned* reads the module right after SPMD partitioning, "
             "before XLA:CPU's backend passes (`all-reduce-promotion`, `float-normalization-bf16`) "
             "widen bf16 collectives to f32. *Volume* counts elements, not bytes "
             "(compiled / (2 or 3)·Ψ(N-1)/N).\n")
    L.append("| config | ideal MiB | compiled MiB (AR/RS/AG) | dtypes | ratio | as partitioned MiB | "
             "dtypes | ratio | volume ratio | executions |")
    L.append("|---|---:|---:|---|---:|---:|---|---:|---:|---:|")
    for key, r in results.items():
        c, p = r["compiled"], r["program"]
        L.append(f"| {_name(key)} | {r['theory'] / MiB:.1f} | {c['bytes'] / MiB:.1f} ({_kinds(c)}) | "
                 f"{_dtypes(c)} | {c['ratio']:.2f} | {p['bytes'] / MiB:.1f} | {_dtypes(p)} | "
                 f"{p['ratio']:.2f} | {c['elem_ratio']:.3f} | {c['ops']} |")
    L.append("")
    L.append("## Compiled memory and step time\n")
    L.append(f"Per device, from `compiled.memory_analysis()`; full fp32 gradients = 4Ψ = "
             f"{fp32_grads / MiB:.1f} MiB. On XLA:CPU the reported peak equals the (donated, aliased) "
             "arguments and leaves temp out, so arguments + temp bounds the step's footprint. Step time: "
             f"median of {args.rounds} steps after {args.warmup} warm-up step(s), the configurations "
             "interleaved round by round so that load from other processes hits all of them alike.\n")
    L.append("| config | arguments MiB | temp MiB | temp / fp32 grads | peak (reported) MiB | compile s | "
             "step s (median) | vs ZeRO-0 | vs FSDP | loss at last step |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in results.items():
        L.append(f"| {_name(key)} | {r['args_bytes'] / MiB:.1f} | {r['temp'] / MiB:.1f} | "
                 f"{r['temp'] / fp32_grads:.3f} | {r['peak'] / MiB:.1f} | {r['compile_s']:.1f} | "
                 f"{r['step_s']:.2f} | {r['step_s'] / s0:.2f} | {r['step_s'] / fsdp:.2f} | {r['loss']:.4f} |")
    L.append("")
    L.append("## Targets\n")
    L.append("| target | measured | |")
    L.append("|---|---|---|")

    def check(ok: bool) -> str:
        return "met" if ok else "**missed**"

    state = {k: (results[k]["params"] + results[k]["grads"] + results[k]["optimizer"]) / results[k]["formula"]
             for k in (1, 2, 3)}
    L.append(f"| model state <= 1.05 x formula, stages 1-3 | "
             f"{', '.join(f'{v:.3f}' for v in state.values())} | {check(max(state.values()) <= 1.05)} |")
    for label, which in (("compiled", "compiled"), ("as partitioned", "program")):
        vals = [results[k][which]["ratio"] for k in (0, 1, 2, 3)]
        L.append(f"| collective bytes <= 1.1 x ideal, stages 0-3 ({label}) | "
                 f"{', '.join(f'{v:.2f}' for v in vals)} | {check(max(vals) <= 1.1)} |")
    z3 = results[3]["step_s"] / fsdp
    L.append(f"| ZeRO-3 step time <= 1.10 x FSDP | {z3:.2f} | {check(z3 <= 1.10)} |")
    L.append("")
    return "\n".join(L)


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        shutil.rmtree(_DUMP, ignore_errors=True)
