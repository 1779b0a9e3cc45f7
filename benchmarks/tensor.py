"""Tensor parallelism: zerojax's Megatron slicing composed with ZeRO-3, against ZeRO-3 alone and
against XLA's own partitioner given the same shardings.

    python -m benchmarks.tensor          (or: python benchmarks/tensor.py)

The shipped Llama (`zerojax.models.llama`, built with `llama.build` as a user's NNX model goes) on 8
virtual CPU devices, AdamW with gradient clipping, per precision (fp32; bf16 with fp32 masters):

* `zerojax TP`: ZeRO-3 at tensor 2 x data 4 (`mesh.tensor: 2`): the loss runs inside `shard_map` on
  each device's weight slices with Megatron's collectives (zerojax.rewrite.tensor_slices);
* `zerojax DP`: ZeRO-3 at data 8 (tensor 1);
* `XLA (jit)`: what a user writes by hand: one `jax.jit` train step, `jax.value_and_grad` of the
  same loss on the global batch sharded over `data` + optax (clip, AdamW), with in/out shardings
  set to zerojax TP's plan (`plan.param_shardings` for the parameters, `plan.update_shardings` for
  masters and Adam moments) on the same (data 4, tensor 2) mesh; XLA's SPMD partitioner inserts
  every collective. It starts from zerojax TP's initial parameters.

Reported per variant: the first step's loss on the same batch (zerojax TP and XLA must agree before
the rest means anything), the median step time (the variants interleaved round by round) over the
XLA step's, the compiled step's memory per device (`memory_analysis()`), collective bytes per device
per step from the compiled HLO (zerojax.measure.hlo, ZeRO-paper accounting) split by mesh axis (from
each op's replica groups) and kind, and for the tensor-parallel variants the tensor-axis all-reduces
counted by phase against Megatron's per-layer count. Writes the section between the `tensor`
markers of docs/benchmarks.md (`--no-write` to print only).
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
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

BEGIN, END = "<!-- tensor -->", "<!-- /tensor -->"
TP, DP, XLA = "zerojax TP", "zerojax DP", "XLA (jit)"
MiB = 2 ** 20
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.999), 1e-8, 0.01, 1.0
SHORT = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A",
         "collective-permute": "CP"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4, help="the tensor size must divide it")
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--rows", type=int, default=8, help="global batch rows per step")
    ap.add_argument("--tensor", type=int, default=2, help="tensor size of the tensor-parallel variants")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    output_args(ap, "benchmarks.md", warmup=2, rounds=7)
    return ap.parse_args(argv)


def config(args: argparse.Namespace, tensor: int, precision: str) -> Any:
    import zerojax
    d = {"train_batch_size": args.rows, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
         "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
         "mesh": {"tensor": tensor},
         "model": {"name": "llama", "d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads,
                   "n_kv_heads": args.kv_heads, "d_ff": args.d_ff, "seq_len": args.seq_len,
                   "vocab_size": args.vocab}}
    if precision == "bf16":
        d["bf16"] = {"enabled": True}
    return zerojax.load_config(d)


# ------------------------------------------------------------------------------------------------
# The hand-written step: what XLA's partitioner makes of the same shardings.

def make_xla_step(plan: Any, state: Any, loss_fn: Any, precision: str) -> tuple[Any, Any]:
    """(state, jitted step) with zerojax's plan's shardings and a copy of its initial parameters:
    `value_and_grad(loss_fn)` + optax clip and AdamW, the partitioner inserts the collectives."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = plan.mesh
    replicated = NamedSharding(mesh, P())
    tx = optax.chain(optax.clip_by_global_norm(CLIP),
                     optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD))
    mixed = precision == "bf16"
    masters = state.master if mixed else state.params  # fp32, the plan's update (fp32) shardings

    def init(master: Any) -> dict:
        master = jax.tree.map(lambda x: jnp.copy(x.astype(jnp.float32)), master)  # not the donated buffers
        out = {"master": master, "opt": tx.init(master)}
        if mixed:
            out["params"] = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
        return out

    abstract = jax.eval_shape(init, masters)
    opt_sh = optax.tree_utils.tree_map_params(tx, lambda _, s: s, abstract["opt"], plan.update_shardings,
                                              transform_non_params=lambda _: replicated)
    master_sh = plan.param_shardings if not mixed else plan.update_shardings
    shardings = {"master": master_sh, "opt": opt_sh}
    if mixed:
        shardings["params"] = plan.param_shardings
    new = jax.jit(init, out_shardings=shardings)(masters)

    def step(state: dict, batch: dict) -> tuple[dict, jax.Array]:
        live = state["params"] if mixed else state["master"]
        loss, grads = jax.value_and_grad(loss_fn)(live, batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt = tx.update(grads, state["opt"], state["master"])
        master = optax.apply_updates(state["master"], updates)
        out = {"master": master, "opt": opt}
        if mixed:
            out["params"] = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
        return out, loss

    batch_sh = {"tokens": NamedSharding(mesh, P("data"))}
    return new, jax.jit(step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, replicated),
                        donate_argnums=0)


# ------------------------------------------------------------------------------------------------
# Reading the compiled HLO.

def axis_groups(mesh: Any) -> dict[frozenset, str]:
    """Replica groups (sets of partition ids, i.e. positions in the mesh) -> the mesh axes they span."""
    shape, names = mesh.devices.shape, mesh.axis_names
    pos = np.arange(mesh.devices.size).reshape(shape)
    out: dict[frozenset, str] = {}
    for k in range(len(names), 0, -1):
        for axes in itertools.combinations(range(len(names)), k):
            rest = [i for i in range(len(names)) if i not in axes]
            rows = pos.transpose(rest + list(axes)).reshape(-1, int(np.prod([shape[a] for a in axes])))
            label = "all" if k == len(names) and len(names) > 1 else "+".join(names[a] for a in axes)
            out[frozenset(frozenset(int(x) for x in r) for r in rows)] = label
    return out


def axis_of(c: Any, groups: dict[frozenset, str]) -> str:
    key = frozenset(frozenset(g) for g in c.groups)
    if c.group <= 1:
        return "none"
    return groups.get(key, "other")


_RESULT = re.compile(r"=\s*(.+?)\sall-reduce(?:-start)?\(")
_ARRAY = re.compile(r"\b[a-z]+\d*\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def phase(line: str) -> str:
    """Where a tensor all-reduce comes from, by the JAX op name XLA keeps in its metadata: the
    rematerialized forward (`rematted_computation`), the backward (`transpose(...)`), or the forward."""
    m = _OP_NAME.search(line)
    name = m.group(1) if m else ""
    if "rematted_computation" in name:
        return "remat"
    if "transpose(" in name:
        return "backward"
    return "forward"


def tensor_all_reduces(found: list, groups: dict[frozenset, str], act_elems: int, token_elems: int) -> dict:
    """Arrays all-reduced over the tensor axis per step (executions, each array of a combined (tuple)
    all-reduce counted as one), by phase and size: `act` activation-sized (rows x seq x d_model on a
    device), `token` one value per token (the loss's maxima and sums over the split vocabulary),
    `other` (scalars: gradient-norm partial sums, finiteness flags)."""
    out = {p: {"act": 0, "token": 0, "other": 0} for p in ("forward", "backward", "remat")}
    for c in found:
        if c.kind != "all-reduce" or axis_of(c, groups) != "tensor":
            continue
        m = _RESULT.search(c.line)
        sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in _ARRAY.findall(m.group(1))]
        where = out[phase(c.line)]
        for n in sizes:
            where["act" if n == act_elems else "token" if n == token_elems else "other"] += c.count
    return out


def traffic(found: list, groups: dict[frozenset, str]) -> dict[tuple[str, str], float]:
    """Bytes per device per step by (mesh axes, kind)."""
    out: dict[tuple[str, str], float] = {}
    for c in found:
        key = (axis_of(c, groups), c.kind)
        out[key] = out.get(key, 0.0) + c.bytes_per_device
    return out


# ------------------------------------------------------------------------------------------------
# The benchmark.

def measure(args: argparse.Namespace) -> dict:
    return {p: _measure(args, p) for p in args.precisions}


def _measure(args: argparse.Namespace, precision: str) -> dict:
    import zerojax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from zerojax.measure import hlo
    from zerojax.models import llama

    rng = np.random.default_rng(0)
    host = [{"tokens": rng.integers(0, args.vocab, (args.rows, args.seq_len + 1)).astype(np.int32)}
            for _ in range(args.warmup + args.rounds)]
    runners: dict = {}
    rows: dict = {}
    meshes: dict = {}
    for key, tensor in ((TP, args.tensor), (DP, 1)):
        cfg = config(args, tensor, precision)
        params, loss_fn = llama.build(cfg.model, seed=0)
        mesh = zerojax.make_mesh(cfg)
        plan = zerojax.plan(cfg, mesh, params)
        state = zerojax.init_state(cfg, plan, params)
        step = zerojax.make_train_step(cfg, plan, loss_fn)
        data = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in host]
        if key == TP:
            tp_plan = plan
            # XLA's step on the same mesh and shardings, from a copy of the same initial parameters
            xla_state, xla_step = make_xla_step(plan, state, loss_fn, precision)
        t = time.perf_counter()
        compiled = step.lower(state, data[0]).compile()
        rows[key] = {"compile_s": time.perf_counter() - t, "mesh": dict(mesh.shape), "psi":
                     sum(int(np.prod(x.shape)) for x in jax.tree.leaves(plan.abstract_params))}
        runners[key] = [compiled, state, data, lambda out: out["loss"]]
        meshes[key] = mesh
        print(f"{precision} {key}: compiled in {rows[key]['compile_s']:.1f}s", file=sys.stderr, flush=True)
    t = time.perf_counter()
    data = runners[TP][2]
    compiled = xla_step.lower(xla_state, data[0]).compile()
    rows[XLA] = {"compile_s": time.perf_counter() - t, "mesh": dict(tp_plan.mesh.shape), "psi": rows[TP]["psi"]}
    runners[XLA] = [compiled, xla_state, data, lambda out: out]
    meshes[XLA] = tp_plan.mesh
    print(f"{precision} {XLA}: compiled in {rows[XLA]['compile_s']:.1f}s", file=sys.stderr, flush=True)

    act_elems = args.rows // tp_plan.data_size * args.seq_len * args.d_model
    for key, (compiled, *_rest) in runners.items():
        mem = compiled.memory_analysis()
        text = compiled.as_text()
        found = hlo.collectives(text)
        groups = axis_groups(meshes[key])
        rows[key].update(
            args=mem.argument_size_in_bytes, temp=mem.temp_size_in_bytes,
            peak=(mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                  - mem.alias_size_in_bytes),
            traffic=traffic(found, groups), ops=sum(c.count for c in found),
            tensor_ar=tensor_all_reduces(found, groups, act_elems, act_elems // args.d_model),
            work=hlo.work(text), times=[], losses=[])

    def run(key: str, i: int) -> float:
        compiled, state, data, loss_of = runners[key]
        t = time.perf_counter()
        state, out = compiled(state, data[i])
        loss = loss_of(out)
        jax.block_until_ready((state, loss))
        runners[key][1] = state
        rows[key]["losses"].append(float(loss))
        return time.perf_counter() - t

    for i in range(args.warmup):
        for key in runners:
            run(key, i)
    first = {key: rows[key]["losses"][0] for key in runners}
    print(f"{precision} first-step loss on the same batch: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()),
          file=sys.stderr, flush=True)
    for i in range(args.rounds):
        for key in runners:
            rows[key]["times"].append(run(key, args.warmup + i))
    for key in rows:
        rows[key]["step_s"] = statistics.median(rows[key]["times"])
    runners.clear()
    return {"rows": rows, "tensor_plan": tp_plan.tensor_plan, "act_elems": act_elems}


def _mib(b: float) -> str:
    return f"{b / MiB:.2f}"


def render(args: argparse.Namespace, results: dict, elapsed: float) -> str:
    L = args.layers
    out = [BEGIN, "## Tensor parallelism: Megatron slicing + ZeRO-3 against XLA's partitioner", "",
           f"`python -m benchmarks.tensor` ({elapsed:.0f} s here): the shipped Llama (d_model {args.d_model}, "
           f"{L} layers, {args.heads} heads / {args.kv_heads} key-value heads, d_ff {args.d_ff}, seq_len "
           f"{args.seq_len}, vocabulary {args.vocab}, remat on), global batch {args.rows} rows, AdamW with "
           f"clipping at {CLIP}, 8 virtual CPU devices, ZeRO-3 (`stage3_param_persistence_threshold` 0).", "",
           f"- **{TP}**: `mesh.tensor: {args.tensor}` x data {8 // args.tensor}; the loss runs on each device's "
           "weight slices with Megatron's all-reduces (`zerojax.rewrite.tensor_slices`).",
           f"- **{DP}**: `mesh.tensor: 1`, data 8.",
           f"- **{XLA}**: one `jax.jit` step (`value_and_grad` of the same loss on the batch sharded over "
           f"`data`, optax clip + AdamW) with in/out shardings from {TP}'s plan (`plan.param_shardings`, "
           "`plan.update_shardings`) on the same mesh: XLA's SPMD partitioner places every collective.",
           "", "Columns: **loss 1** is the first step's loss on the same batch from the same parameters "
           f"({TP} and {XLA} must agree), **loss last** the loss of the last timed step (every variant trains "
           "on the same batches); **step / XLA** is the median step time over {XLA}'s, the three "
           "steps run interleaved; memory is per device from `compiled.memory_analysis()` (**peak** = "
           "arguments + temp + outputs not aliased to donated arguments); collective MiB are sent per "
           "device per step (compiled HLO, ZeRO-paper accounting: all-reduce 2S(N-1)/N, all-gather and "
           "reduce-scatter S(N-1)/N), by the mesh axes of each op's replica groups (**all**: both axes at "
           "once); **GFLOP** is the compiled step's matmul work per device (`zerojax.measure.hlo.work`).", ""]
    for precision, res in results.items():
        rows = res["rows"]
        base = rows[XLA]["step_s"]
        kinds = sorted({k for r in rows.values() for k, b in r["traffic"].items() if b >= 0.005 * MiB},
                       key=lambda k: ({"tensor": 0, "data": 1, "all": 2}.get(k[0], 3), k[1]))
        name = "fp32" if precision == "fp32" else "bf16 parameters, fp32 masters and Adam moments"
        out += [f"### {name}", "",
                "| variant | mesh | loss 1 | loss last | step s | step / XLA | args MiB | temp MiB | peak MiB | "
                + " | ".join(f"{a} {SHORT[k]} MiB" for a, k in kinds) + " | total MiB | GFLOP | compile s |",
                "|---|---|---|---|---|---|---|---|---|" + "---|" * len(kinds) + "---|---|---|"]
        for key, r in rows.items():
            mesh = " x ".join(f"{a} {n}" for a, n in r["mesh"].items())
            cells = " | ".join(_mib(r["traffic"].get(k, 0.0)) for k in kinds)
            out.append(f"| {key} | {mesh} | {r['losses'][0]:.6f} | {r['losses'][-1]:.6f} | {r['step_s']:.3f} | {r['step_s'] / base:.2f} | "
                       f"{_mib(r['args'])} | {_mib(r['temp'])} | {_mib(r['peak'])} | {cells} | "
                       f"{_mib(sum(r['traffic'].values()))} | {r['work'].flops / 1e9:.2f} | {r['compile_s']:.1f} |")
        out.append("")
        tp = rows[TP]["tensor_ar"]
        fwd, bwd, remat = tp["forward"]["act"], tp["backward"]["act"], tp["remat"]["act"]
        token = sum(p["token"] for p in tp.values())
        other = sum(p["other"] for p in tp.values())
        out += [f"Tensor-axis all-reduces per step in {TP} (activation-sized: {res['act_elems']:,} elements a "
                f"device; executions, loops counted trip-count times), against Megatron's count for {L} layers:", "",
                "| phase | compiled | Megatron | what |", "|---|---|---|---|",
                f"| forward | {fwd} | {2 * L + 1} | 2 per layer (attention output, MLP down) + 1 vocabulary-parallel "
                "embedding |",
                f"| backward | {bwd} | {2 * L + 1} | 2 per layer (cotangent of the attention input shared by q, k, v; "
                "of the MLP input shared by gate, up) + 1 (the head's input) |",
                f"| rematerialized forward | {remat} | {2 * L} ({L} live) | Megatron's full recompute re-runs both "
                "per layer; the MLP's only makes the layer output, which the layer's backward does not read, so "
                "XLA drops it as dead code: 1 per layer is live |",
                f"| loss, one value per token | {token} | 3 | cross-entropy over the split vocabulary: max, sum of "
                "exponentials, target logit |",
                f"| scalars | {other} | - | not Megatron's: partial sums of squares for the gradient norm and "
                "finiteness flags, combined by XLA into a few ops |", "",
                "Each array of a combined (tuple) all-reduce counts once; the phase is read from the JAX op "
                "name XLA keeps on each op (`rematted_computation`: rematerialized forward; `transpose(...)`: "
                "backward).", ""]
    out += notes(results)
    out.append(END)
    return "\n".join(out)


def notes(results: dict) -> list[str]:
    """The target, what the numbers show about XLA's step, and what the CPU cannot show."""
    out = ["### Against the target, and what XLA's partitioner does", "",
           f"The target: {TP} at or below the compiler's ({XLA}'s) step time and memory on the same mesh "
           "and shardings. In this run:", ""]
    for precision, res in results.items():
        r = res["rows"]
        t, x = r[TP], r[XLA]
        ok = t["step_s"] <= x["step_s"] and t["peak"] <= x["peak"]
        out.append(f"- {precision}: step {t['step_s'] / x['step_s']:.2f}x, peak {t['peak'] / x['peak']:.2f}x, "
                   f"temp {t['temp'] / x['temp']:.2f}x, collective bytes "
                   f"{sum(t['traffic'].values()) / sum(x['traffic'].values()):.2f}x {XLA}'s: "
                   f"{'met' if ok else 'not met'}.")
    x = next(iter(results.values()))["rows"][XLA]
    t = next(iter(results.values()))["rows"][TP]
    data_ar = x["traffic"].get(("data", "all-reduce"), 0.0)
    data_ag = x["traffic"].get(("data", "all-gather"), 0.0)
    out.append("")
    if data_ar > data_ag:
        out += [f"Where {XLA}'s step loses (read from its compiled HLO): given weights sharded over both axes "
                "and no constraint inside the loss, the partitioner keeps the weights where they are and moves "
                "activations instead of gathering weights over `data` as ZeRO-3 does: it gathers the batch "
                "over `data` (activations of the whole global batch on every device), multiplies each "
                "device's weight block and all-reduces the partial products over `data`, forward, "
                f"rematerialized forward and backward. That is {data_ar / MiB:.1f} MiB of data-axis "
                f"all-reduces a step against {data_ag / MiB:.2f} MiB of weight gathers, "
                f"{x['work'].flops / t['work'].flops:.2f}x {TP}'s matmul FLOPs per device (work on the whole "
                "batch repeated across `data`), and larger temporaries. "
                f"{TP}'s data-axis traffic is ZeRO-3's: each weight slice gathered over `data` in the forward "
                "and rematerialized backward passes and its gradient reduce-scattered, less than half of "
                f"{DP}'s (each device's slice is half as large, and gathered over 4 devices instead of 8); its tensor-axis all-reduces "
                "are Megatron's, counted above.", ""]
    out += ["What the CPU cannot show: the 8 devices are virtual devices of one process sharing this "
            "machine's cores, and XLA:CPU collectives are memory copies, so the step times weigh "
            "computation (and duplicated computation) and barely collectives; there is no difference "
            "between a fast and a slow link. On GPUs the tensor axis is innermost so that its all-reduces, "
            "one activation-sized all-reduce per phase per Megatron pair on every layer, ride NVLink inside "
            "a node while ZeRO's data-axis gathers and reduce-scatters cross the network; how much a step "
            "gains from tensor parallelism there depends on that split, which no CPU number here measures. "
            "XLA:CPU also widens bf16 collectives to f32 (`all-reduce-promotion`), so the bf16 table's "
            "collective bytes equal the fp32 table's; GPU backends keep them bf16 (half). Step times move by "
            "tens of percent between runs on a shared machine (the other sessions' load hits the variants "
            "unevenly even interleaved): read ratios within one table, and the memory, bytes and counts, "
            "which are deterministic, over the times.", ""]
    return out


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "tensor")


if __name__ == "__main__":
    sys.exit(main())
