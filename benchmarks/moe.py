"""Expert parallelism: the MoE Llama at mesh.expert 1, 2 and 4 on 8 virtual CPU devices.

    python -m benchmarks.moe          (or: python benchmarks/moe.py)

The model of configs/moe.yaml (`--config`; its ZeRO stage unless `--stage`), built as train.py builds
it (`trainer.build_model` / `build_engine`), at each `--experts` size (DeepSpeed's `ep_size`; the rest
of the 8 devices is `data`), on the same random batches. Reported per size:

* the median step time, the sizes' steps interleaved round by round, and the first step's loss
  (each device gates its own tokens whatever the expert size, so it must not move);
* the compiled step's memory per device (`memory_analysis()`) and collective bytes per device per
  step by mesh axis and kind (compiled HLO, zerojax.measure.hlo, ZeRO-paper accounting);
* the expert all-to-alls against theory: per MoE layer, forward and backward, two all-to-alls of the
  dispatched [E, C, M] buffer, of which (ep - 1) / ep leaves the device; plus the two the
  rematerialized forward replays when the layers are checkpointed;
* per ZeRO stage (`--memory-stages`), the bytes one device holds of the expert weights and of their
  optimizer state (fp32 masters and Adam moments), read from the live arrays' shard shapes, against
  whole / (ep x the data shards ZeRO splits that state over).

Writes the section between the `moe` markers of docs/benchmarks.md (`--no-write` to print only).
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
import numpy as np  # noqa: E402

from benchmarks.report import output_args, run_section  # noqa: E402

BEGIN, END = "<!-- moe -->", "<!-- /moe -->"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2 ** 20
SHORT = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A",
         "collective-permute": "CP"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "moe.yaml"))
    ap.add_argument("--experts", type=int, nargs="+", default=[1, 2, 4], help="mesh.expert sizes")
    ap.add_argument("--stage", type=int, default=None, help="ZeRO stage (default: the config's)")
    ap.add_argument("--memory-stages", type=int, nargs="*", default=[0, 1, 2, 3],
                    help="ZeRO stages of the expert-bytes table (engines built, no step compiled)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    output_args(ap, "benchmarks.md", warmup=1, rounds=5)
    return ap.parse_args(argv)


def load(args: argparse.Namespace, ep: int, stage: int | None) -> Any:
    import zerojax
    over = [f"mesh.expert={ep}", *args.set] + ([] if stage is None else [f"zero_optimization.stage={stage}"])
    return zerojax.load_config(args.config, over)


def build(cfg: Any) -> Any:
    from zerojax.app.trainer import build_engine, build_model
    from zerojax.planner.mesh import make_mesh
    mesh = make_mesh(cfg)
    return build_engine(cfg, mesh, build_model(cfg, mesh))


# ------------------------------------------------------------------------------------------------
# What the live arrays hold, and what the formulas say.

def expert_bytes(engine: Any) -> dict[str, tuple[int, int, float]]:
    """(whole, on one device, formula) bytes of the expert leaves: of the parameters, and of their
    optimizer state (fp32 masters where they exist, and every optimizer-state leaf under `experts`).

    The formula per leaf: 1/ep of the experts on each device (of a pipeline, of its stage's experts:
    1/(stages x ep)), and of that 1/(the expert-data-parallel devices) where ZeRO shards the state over
    them (DeepSpeed's expert-data-parallel group): parameters at stage 3 unless under
    `stage3_param_persistence_threshold`, optimizer state from stage 1."""
    from zerojax.core.mesh import axes_size, expert_data_axes
    cfg, mesh = engine.config, engine.plan.mesh
    ep, stages = int(mesh.shape.get("expert", 1)), int(mesh.shape.get("stage", 1))
    edp = axes_size(mesh, expert_data_axes(mesh))
    zero = cfg.zero_optimization
    out = {"params": [0, 0, 0.0], "optimizer": [0, 0, 0.0]}
    state = engine.state
    for part, tree in (("params", state.params), ("optimizer", (state.master, state.opt_state))):
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            name = jax.tree_util.keystr(path)
            if "'experts'" not in name and "'expert_stages'" not in name:  # a pipeline's expert rows
                continue
            sharded = (zero.stage >= 1 if part == "optimizer"
                       else zero.stage >= 3 and x.size > zero.stage3_param_persistence_threshold)
            out[part][0] += x.nbytes
            out[part][1] += math.prod(x.addressable_shards[0].data.shape) * x.dtype.itemsize
            out[part][2] += x.nbytes / stages / ep / (edp if sharded else 1)
    return {k: (int(a), int(b), c) for k, (a, b, c) in out.items()}


def a2a_theory(cfg: Any, ep: int, batch: Any, itemsize: int, per_layer: int) -> dict[str, float]:
    """Bytes one device sends in the expert all-to-alls per step: `per_layer` all-to-alls of the
    dispatched [E, C, M] buffer per MoE layer (of its pipeline stage) and micro-batch, (ep - 1) / ep of
    each leaving the device."""
    from zerojax.models.moe import capacity
    m = cfg.model
    tokens = batch.micro_batch_size * m.seq_len  # each device gates its own micro-batch
    factor = m.capacity_factor * m.experts_per_token  # DeepSpeed's gates: factor x k slots (top-1: x 1)
    cap = capacity(tokens, m.n_experts, factor, m.min_capacity) if m.drop_tokens else tokens
    moe_layers = m.n_layers // m.moe_every // cfg.mesh.stage  # a pipeline stage runs its own MoE layers
    buffer = m.n_experts * cap * m.d_model * itemsize
    gas = batch.gradient_accumulation_steps
    return {"tokens": tokens, "capacity": cap, "buffer": buffer, "moe_layers": moe_layers, "gas": gas,
            "bytes": gas * moe_layers * per_layer * buffer * (ep - 1) / ep}


# ------------------------------------------------------------------------------------------------
# The benchmark.

def measure(args: argparse.Namespace) -> dict:
    from zerojax.app.reports import compile_step
    from zerojax.measure import hlo

    rows: dict[int, dict] = {}
    runners: dict[int, list] = {}
    host: list = []
    for ep in args.experts:
        cfg = load(args, ep, args.stage)
        engine = build(cfg)
        plan, m = engine.plan, cfg.model
        if not host:  # the same batches for every size
            rng = np.random.default_rng(0)
            host = [{"tokens": rng.integers(0, m.vocab_size, (plan.batch.train_batch_size, m.seq_len + 1))
                     .astype(np.int32)} for _ in range(args.warmup + args.rounds)]
        t = time.perf_counter()
        compiled = compile_step(engine, host[0])
        compile_s = time.perf_counter() - t
        found = hlo.collectives(compiled.as_text())
        mesh = plan.mesh
        traffic: dict[tuple[str, str], float] = {}
        for c in found:
            key = (hlo.mesh_axes(c.groups, mesh) if c.group > 1 else "none", c.kind)
            traffic[key] = traffic.get(key, 0.0) + c.bytes_per_device
        a2a = [c for c in found if c.kind == "all-to-all"]
        mem = compiled.memory_analysis()
        rows[ep] = dict(
            cfg=cfg, mesh=dict(mesh.shape), stage=cfg.zero_optimization.stage, compile_s=compile_s,
            batch=plan.batch, args=mem.argument_size_in_bytes, temp=mem.temp_size_in_bytes,
            traffic=traffic, a2a_ops=sum(c.count for c in a2a), a2a_bytes=sum(c.bytes_per_device for c in a2a),
            a2a_dtypes=sorted({d for c in a2a for d in c.dtypes}),
            a2a_axes=sorted({hlo.mesh_axes(c.groups, mesh) for c in a2a}),
            a2a_result=sorted({c.result_bytes for c in a2a}), experts=expert_bytes(engine),
            times=[], losses=[])
        placed = [engine.place_batch(b, plan.batch.train_batch_size) for b in host]
        runners[ep] = [compiled, engine.state, placed]
        print(f"expert {ep}: mesh {rows[ep]['mesh']}, compiled in {compile_s:.1f}s, {rows[ep]['a2a_ops']} "
              f"all-to-alls", file=sys.stderr, flush=True)

    def run(ep: int, i: int) -> float:
        compiled, state, placed = runners[ep]
        t = time.perf_counter()
        state, metrics = compiled(state, placed[i])
        loss = float(metrics["loss"])
        jax.block_until_ready(state)
        runners[ep][1] = state
        rows[ep]["losses"].append(loss)
        return time.perf_counter() - t

    for i in range(args.warmup):
        for ep in runners:
            run(ep, i)
    for i in range(args.rounds):
        for ep in runners:
            rows[ep]["times"].append(run(ep, args.warmup + i))
    runners.clear()
    for ep, r in rows.items():
        r["step_s"] = statistics.median(r["times"])
        cfg = r["cfg"]
        itemsize = 4 if "f32" in r["a2a_dtypes"] or not r["a2a_dtypes"] else 2
        r["theory4"] = a2a_theory(cfg, ep, r["batch"], itemsize, 4)
        r["theory6"] = a2a_theory(cfg, ep, r["batch"], itemsize, 6)
        r["itemsize"] = itemsize

    # the expert weights' bytes per device at each ZeRO stage, from live arrays
    memory: dict[tuple[int, int], dict] = {}
    for stage in args.memory_stages:
        for ep in args.experts:
            if rows[ep]["stage"] == stage:
                memory[(stage, ep)] = rows[ep]["experts"]
                continue
            engine = build(load(args, ep, stage))
            memory[(stage, ep)] = expert_bytes(engine)
            del engine
    print("expert bytes measured at stages " + ", ".join(map(str, args.memory_stages)), file=sys.stderr, flush=True)
    return {"rows": rows, "memory": memory}


# ------------------------------------------------------------------------------------------------
# The section.

def _mib(b: float) -> str:
    return f"{b / MiB:.2f}"


def render(args: argparse.Namespace, results: dict, elapsed: float) -> str:
    rows, memory = results["rows"], results["memory"]
    first = next(iter(rows.values()))
    cfg = first["cfg"]
    m, n_dev = cfg.model, jax.device_count()
    base = rows[min(rows)]["step_s"]
    t4 = first["theory4"]
    precision = "bf16 parameters over fp32 masters" if cfg.bf16.enabled else "fp32"
    out = [BEGIN, "## Expert parallelism: the MoE Llama at mesh.expert 1, 2, 4", "",
           f"`python -m benchmarks.moe` ({elapsed:.0f} s here): `{os.path.relpath(args.config, ROOT)}`'s model "
           f"(d_model {m.d_model}, {m.n_layers} layers, layers "
           f"{', '.join(str(i) for i in range(m.moe_every, m.n_layers + 1, m.moe_every))} a mixture of "
           f"{m.n_experts} SwiGLU experts (d_ff {m.d_ff}), top-{m.experts_per_token} gating, capacity factor "
           f"{m.capacity_factor}, seq_len {m.seq_len}, vocabulary {m.vocab_size}, remat "
           f"{'on' if m.remat else 'off'}), global batch {first['batch'].train_batch_size} rows "
           f"({first['batch'].micro_batch_size} per device), {precision}, AdamW, ZeRO stage {first['stage']}, "
           f"built as train.py builds it, on {n_dev} virtual CPU devices: `mesh.expert` (DeepSpeed's `ep_size`) "
           f"x `data` = {n_dev}. Every size trains on the same random batches.", "",
           "Columns: **step s** is the median over the sizes' steps run interleaved round by round "
           f"({args.rounds} rounds after {args.warmup} warm-up), **/ ep 1** that over expert 1's; **loss 1** the "
           "first step's loss (each device gates its own tokens whatever the expert size, as DeepSpeed's ranks "
           "do, so it must not move); memory per device from `compiled.memory_analysis()`; collective MiB sent "
           "per device per step from the compiled HLO (`zerojax.measure.hlo`, ZeRO-paper accounting: all-to-all "
           "S(N-1)/N, all-gather and reduce-scatter S(N-1)/N, all-reduce 2S(N-1)/N), by the mesh axes of each "
           "op's replica groups (**data+expert**: both at once, ZeRO's group for every weight but the experts).", ""]
    kinds = sorted({k for r in rows.values() for k, b in r["traffic"].items() if b >= 0.005 * MiB},
                   key=lambda k: ({"expert": 0, "data": 1, "all": 2}.get(k[0], 3), k[1]))
    out += ["| expert | mesh | step s | / ep 1 | loss 1 | args MiB | temp MiB | "
            + " | ".join(f"{a} {SHORT[k]} MiB" for a, k in kinds) + " | total MiB | compile s |",
            "|---|---|---|---|---|---|---|" + "---|" * len(kinds) + "---|---|"]
    for ep, r in rows.items():
        mesh = " x ".join(f"{a} {n}" for a, n in r["mesh"].items())
        cells = " | ".join(_mib(r["traffic"].get(k, 0.0)) for k in kinds)
        out.append(f"| {ep} | {mesh} | {r['step_s']:.3f} | {r['step_s'] / base:.2f} | {r['losses'][0]:.6f} | "
                   f"{_mib(r['args'])} | {_mib(r['temp'])} | {cells} | {_mib(sum(r['traffic'].values()))} | "
                   f"{r['compile_s']:.1f} |")
    b = first["itemsize"]
    out += ["", "### The all-to-alls against theory", "",
            f"Theory, per device per step: **4 x L x E x C x M x b x (ep-1)/ep** (x the micro-batches of a step, "
            f"{t4['gas']} here), L = {t4['moe_layers']} MoE "
            f"layers, E = {m.n_experts} experts, C = {t4['capacity']} slots per expert (DeepSpeed's `_capacity`: "
            f"ceil({t4['tokens']} tokens a device gates / {m.n_experts} x {m.capacity_factor}"
            f"{f' x {m.experts_per_token} for top-{m.experts_per_token}' if m.experts_per_token > 1 else ''}), "
            f"M = {m.d_model}, b = {b} bytes "
            f"(the dtype the compiled all-to-alls carry, {', '.join(first['a2a_dtypes']) or 'none at ep 1'}: see "
            f"below): per MoE layer two all-to-alls of the dispatched [E, C, M] buffer "
            f"({t4['buffer']:,} B) forward (tokens to their experts, results back) and their two transposes "
            "backward, each sending the (ep-1)/ep of the buffer that belongs to other devices of the expert "
            f"group. The rematerialized forward (remat {'on' if m.remat else 'off'}) replays the forward's two: "
            "**6 x L x ...** with checkpointed layers."
            + (" **With pipeline stages the measured column is an upper bound**: the executor's `lax.switch` "
               "holds every virtual stage's branch, the HLO count takes each branch as run at every tick, and a "
               "device runs its own stage's branch only at its M forward and M backward ticks."
               if cfg.mesh.stage > 1 else ""), "",
            "| expert | all-to-alls a step | over | bytes each (result) | sent MiB | theory 4/layer MiB | "
            "measured / theory | theory 6/layer (remat) MiB | measured / theory |",
            "|---|---|---|---|---|---|---|---|---|"]
    for ep, r in rows.items():
        t4, t6 = r["theory4"]["bytes"], r["theory6"]["bytes"]
        ratio4 = f"{r['a2a_bytes'] / t4:.3f}" if t4 else ("-" if not r["a2a_bytes"] else "inf")
        ratio6 = f"{r['a2a_bytes'] / t6:.3f}" if t6 else ("-" if not r["a2a_bytes"] else "inf")
        out.append(f"| {ep} | {r['a2a_ops']} | {', '.join(r['a2a_axes']) or '-'} | "
                   f"{', '.join(f'{int(x):,}' for x in r['a2a_result']) or '-'} | {_mib(r['a2a_bytes'])} | "
                   f"{_mib(t4)} | {ratio4} | {_mib(t6)} | {ratio6} |")
    out += ["", "### Expert weights and their optimizer state per device", "",
            "Bytes one device holds of the experts' weights (`params`, the compute dtype) and of their optimizer "
            "state (fp32 masters and Adam's two moments), read from the live arrays' shard shapes "
            "(`addressable_shards[0]`), against **whole / ep / Z**, Z = the data shards "
            f"({n_dev}/ep) where ZeRO shards that state (parameters at stage 3 above "
            "`stage3_param_persistence_threshold`, optimizer state from stage 1), else 1. One engine per cell, its state initialized, no step compiled.", "",
            "| stage | expert | params whole MiB | params / device MiB | formula | measured / formula | "
            "optimizer whole MiB | optimizer / device MiB | formula | measured / formula |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for (stage, ep), e in sorted(memory.items()):
        (pw, pd, pf), (ow, od, of) = e["params"], e["optimizer"]
        out.append(f"| {stage} | {ep} | {_mib(pw)} | {pd / MiB:.3f} | 1/{pw / pf:.0f} | {pd / pf:.3f} | "
                   f"{_mib(ow)} | {od / MiB:.3f} | 1/{ow / of:.0f} | {od / of:.3f} |")
    out += [""] + notes(rows, memory, n_dev) + [END]
    return "\n".join(out)


def notes(rows: dict, memory: dict, n_dev: int) -> list[str]:
    """What the numbers say, and what a GPU would change."""
    eps = sorted(rows)
    gathers = {ep: sum(b for (axes, kind), b in rows[ep]["traffic"].items() if kind == "all-gather") for ep in eps}
    out = ["### Reading the numbers", "",
           f"- **Memory.** Per device the experts are 1/ep of the whole and ZeRO shards that over the remaining "
           f"{n_dev}/ep data devices, so where ZeRO shards a state the device holds 1/{n_dev} of the experts "
           "whatever ep is: the expert axis moves the experts' split from ZeRO's `data` sharding to whole experts "
           "per device. What it saves at ZeRO-3 is the gather: each layer's experts are gathered over `data` only, "
           f"1/ep of them (the step's temp falls from {_mib(rows[eps[0]]['temp'])} to {_mib(rows[eps[-1]]['temp'])} MiB, "
           f"and ZeRO's all-gathers, over `data` for the experts and over data+expert for the rest, from "
           f"{_mib(gathers[eps[0]])} to {_mib(gathers[eps[-1]])} MiB a step). "
           "Where ZeRO does not shard a state (parameters below stage 3, everything at stage 0) the device holds "
           "exactly 1/ep of the experts, DeepSpeed's ep_size saving.",
           "- **All-to-alls.** Two per MoE layer forward and two backward is the count of DeepSpeed's MoE "
           "layer; with the layers checkpointed the backward pass replays the forward's two, so the compiled step "
           "holds six per layer and sends 1.5x the 4-per-layer theory, exactly the 6-per-layer figure. There is "
           "none at expert 1.",
           f"- **Loss.** The first-step losses agree across the sizes (each device gates its own "
           f"{rows[eps[0]]['theory4']['tokens']} tokens: the same capacity and drops), as they must.", ""]
    if "f32" in rows[eps[-1]]["a2a_dtypes"] and rows[eps[-1]]["cfg"].bf16.enabled:
        out += ["**The all-to-alls carry float32 here, bf16 on a GPU.** The step sends the dispatched [E, C, M] "
                "buffer in the compute dtype (the all-to-alls of the lowered module are bf16), but XLA:CPU widens "
                "bf16 all-to-alls to float32 as it does all-reduces, so the compiled CPU step moves b = 4 bytes an "
                "element; GPU backends keep bf16, half the bytes above.", ""]
    out += ["What a GPU would change: here the 8 devices are virtual devices of one process sharing this "
            "machine's 2 cores, and an XLA:CPU all-to-all is a memory copy, so step times weigh computation "
            "(and the work each virtual device duplicates: every device gates, dispatches and combines its own "
            "tokens, and at expert 1 runs all E experts on its own buffer while at expert ep it runs E/ep experts on "
            "ep times the rows: the same FLOPs) and barely the exchange. On GPUs the expert group is consecutive "
            "devices, inside a node for ep <= 8, so its all-to-alls ride NVLink while ZeRO's gathers and "
            "reduce-scatters over `data` cross the network; the step time then trades the all-to-all bytes above "
            "against the 1/ep smaller expert gathers, which no CPU number here measures. Step times move by tens "
            "of percent between runs on a shared machine: read the bytes, counts and memory, which are "
            "deterministic, over the times.", ""]
    return out


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "moe")


if __name__ == "__main__":
    sys.exit(main())
