"""The fused Adam kernel against optax.adamw under jit: bandwidth, launches and bytes per parameter.

    python -m benchmarks.kernels            (or: python benchmarks/kernels.py)

On a GPU: for parameter counts from 1e8 to 1e9 (fp32 master weights, gradients and moments, split
into a model-like mix of large and small arrays), times one Adam/AdamW update with the fused Pallas
kernel (Triton) and with `optax.adamw` under `jax.jit`, both updating donated buffers, and reports
achieved GB/s (28 bytes per parameter: read p, g, m, v; write p, m, v) against the device's nominal
peak and against a measured read+write copy. On CPU it runs one small size with the kernel in
interpret mode; those timings mean nothing (the interpreter is a loop of XLA:CPU slices).

On both: kernel launches and bytes moved per parameter, read from the module lowered for CUDA (the
kernel's custom calls and their operand and result types), from XLA's compiled module and its cost
analysis (the optax path; on CPU these are XLA:CPU's, not a GPU's), and for a whole ZeRO train
step of the embedded GPT lowered for CUDA with `kernels: pallas`.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models import gpt  # noqa: E402
from zerojax.pallas import multi_tensor  # noqa: E402
from zerojax.optim.transforms import bias_corrections  # noqa: E402
from zerojax.pallas.adam import AdamScalars, adam_update_pallas  # noqa: E402

IDEAL = 28  # bytes per parameter of fp32 Adam: read p, g, m, v; write p, m, v
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01

# Nominal HBM bandwidth (bytes/s) by device kind, from the vendors' data sheets.
PEAK = [("H200", 4.8e12), ("GH200", 4.0e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
        ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
        ("L4", 0.3e12)]

TENSOR = re.compile(r"tensor<([0-9x]*?)x?(f64|f32|bf16|f16|i32|i1|ui32)>")
ELEM = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "i32": 4, "ui32": 4, "i1": 1}
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")
NOT_LAUNCHES = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-start", "copy-done",
                "after-all", "opt-barrier", "partition-id", "replica-id"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None,
                    help="comma-separated parameter counts (GPU default 1e8,3e8,1e9; CPU default 1e5)")
    ap.add_argument("--arrays", type=int, default=8, help="large arrays the parameters are split into")
    ap.add_argument("--small", type=int, default=16, help="small arrays (biases, norms) besides them")
    ap.add_argument("--rounds", type=int, default=10, help="timed updates per variant (interleaved)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--block", type=int, default=multi_tensor.BLOCK, help="elements per Triton program")
    ap.add_argument("--warps", type=int, default=multi_tensor.NUM_WARPS, help="warps per Triton program")
    ap.add_argument("--no-step", action="store_true", help="skip the whole-step section")
    ap.add_argument("--out", default=None, help="also write the Markdown report here")
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# HLO accounting.

def _tensor_bytes(signature: str) -> int:
    total = 0
    for dims, dtype in TENSOR.findall(signature):
        total += int(np.prod([int(d) for d in dims.split("x") if d], dtype=np.int64)) * ELEM[dtype]
    return total


def lowered_kernels(text: str) -> list[tuple[str, int]]:
    """(custom-call target, bytes of its operands and results) for every Pallas kernel in StableHLO.

    Each operand is read once and each result written once by these kernels (in-place outputs
    alias their operands and count as a write), so the sum is the bytes the launch moves."""
    out = []
    for line in text.splitlines():
        m = re.search(r"stablehlo\.custom_call @([\w$.]+)\(", line)
        if not m or ("triton" not in m.group(1) and "mosaic" not in m.group(1)):
            continue
        out.append((m.group(1), _tensor_bytes(line[line.rindex("} :") + 3:])))
    return out


def compiled_launches(text: str) -> int:
    """Instructions of the compiled entry computation that run on the device (fusions, custom
    calls, copies, collectives...); parameters, tuples and bitcasts cost nothing."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside and line.startswith("}"):
            break
        if inside:
            lines.append(line)
    ops = [m.group(1) for m in map(_HLO_OP.match, lines) if m]
    return sum(op not in NOT_LAUNCHES for op in ops)


def bytes_accessed(compiled: Any) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return float(cost.get("bytes accessed", float("nan"))) if cost else float("nan")


# ------------------------------------------------------------------------------------------------
# The update under test.

def leaf_sizes(n: int, arrays: int, small: int) -> list[int]:
    """A model-like split: `arrays` large arrays holding 99.9% of `n`, then `small` odd-sized ones."""
    small_total = max(small, n // 1000)
    sizes = [(small_total // small) + 7 * i for i in range(small)]
    large = n - sum(sizes)
    sizes = [large // arrays + (1 if i < large % arrays else 0) for i in range(arrays)] + sizes
    assert sum(sizes) == n
    return sizes


def make_arrays(sizes: list[int], seed: int) -> tuple[list[jax.Array], ...]:
    keys = jax.random.split(jax.random.key(seed), 4 * len(sizes))

    def one(i: int, n: int, scale: float, positive: bool = False) -> jax.Array:
        x = jax.random.normal(keys[i], (n,), jnp.float32) * scale
        return jnp.abs(x) if positive else x

    k = len(sizes)
    p = [one(i, n, 0.02) for i, n in enumerate(sizes)]
    g = [one(k + i, n, 1e-3) for i, n in enumerate(sizes)]
    m = [one(2 * k + i, n, 1e-4) for i, n in enumerate(sizes)]
    v = [one(3 * k + i, n, 1e-6, True) for i, n in enumerate(sizes)]
    return p, g, m, v


def scalars(count: int = 10) -> AdamScalars:
    b1, b2 = jnp.float32(B1), jnp.float32(B2)
    c1, c2 = bias_corrections(b1, b2, jnp.int32(count), True)
    return AdamScalars(lr=jnp.float32(LR), b1=b1, b2=b2, eps=jnp.float32(EPS), weight_decay=jnp.float32(WD),
                       c1=c1, c2=c2, grad_scale=jnp.float32(1.0), apply=jnp.float32(1.0))


def fused_fn(backend: str, block: int) -> Callable:
    def update(p: list, g: list, m: list, v: list, s: AdamScalars) -> tuple:
        return adam_update_pallas(p, g, m, v, s, decoupled=True, backend=backend, block=block)[:3]
    return update


def optax_fn() -> tuple[Callable, optax.GradientTransformation]:
    tx = optax.adamw(LR, B1, B2, EPS, weight_decay=WD)

    def update(p: list, g: list, state: Any) -> tuple:
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state
    return update, tx


def time_interleaved(runners: dict[str, Callable[[], Any]], warmup: int, rounds: int) -> dict[str, float]:
    """Median seconds per call; every round runs each variant once, so load hits them alike."""
    for _ in range(warmup):
        for run in runners.values():
            jax.block_until_ready(run())
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            t = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def peak_bandwidth(device: Any) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, bw in PEAK:
        if name in kind:
            return bw
    return None


def measure_size(n: int, args: argparse.Namespace, backend: str, device: Any) -> dict:
    sizes = leaf_sizes(n, args.arrays, args.small)
    s = scalars()
    fused = fused_fn(backend, args.block)
    opt_update, tx = optax_fn()
    fused_jit = jax.jit(fused, donate_argnums=(0, 2, 3))
    optax_jit = jax.jit(opt_update, donate_argnums=(0, 2))
    copy_jit = jax.jit(lambda xs: [x * 1.0000001 for x in xs], donate_argnums=0)

    p, g, m, v = make_arrays(sizes, 0)
    # Counting happens on the CUDA lowering whatever runs the timings.
    cuda_text = jax.jit(fused_fn("triton", args.block)).trace(p, g, m, v, s).lower(
        lowering_platforms=("cuda",)).as_text()
    kernels = lowered_kernels(cuda_text)
    fused_compiled = fused_jit.lower(p, g, m, v, s).compile()
    q, g2, _, _ = make_arrays(sizes, 1)
    opt_state = tx.init(q)
    optax_compiled = optax_jit.lower(q, g2, opt_state).compile()
    c = [jnp.ones((k,), jnp.float32) for k in sizes]

    box = {"fused": (p, m, v), "optax": (q, opt_state), "copy": c}

    def run_fused() -> Any:
        p, m, v = box["fused"]
        box["fused"] = fused_compiled(p, g, m, v, s)
        return box["fused"]

    def run_optax() -> Any:
        q, st = box["optax"]
        box["optax"] = optax_compiled(q, g2, st)
        return box["optax"]

    def run_copy() -> Any:
        box["copy"] = copy_jit(box["copy"])
        return box["copy"]

    times = time_interleaved({"fused": run_fused, "optax": run_optax, "copy": run_copy}, args.warmup, args.rounds)
    finite = all(bool(jnp.all(jnp.isfinite(x[:4096]))) for x in (*box["fused"][0], *box["optax"][0]))
    if not finite:
        raise RuntimeError(f"{n:.3g} parameters: the updated parameters are not finite")
    box.clear()  # free the device buffers before the next size
    return dict(n=n, leaves=len(sizes), times=times, kernels=kernels,
                fused_launches_compiled=compiled_launches(fused_compiled.as_text()),
                optax_launches=compiled_launches(optax_compiled.as_text()),
                optax_bytes=bytes_accessed(optax_compiled))


def check_agreement(args: argparse.Namespace, backend: str) -> float:
    """Largest difference (relative to each array's scale) between the kernel and optax.adamw after
    3 updates from zero moments (small arrays)."""
    sizes = leaf_sizes(50_000, 3, 4)
    p, g, _, _ = make_arrays(sizes, 3)
    m, v = [jnp.zeros_like(x) for x in p], [jnp.zeros_like(x) for x in p]
    opt_update, tx = optax_fn()
    q, st = list(p), tx.init(p)
    fused, optax_step = jax.jit(fused_fn(backend, args.block)), jax.jit(opt_update)
    for count in (1, 2, 3):
        q, st = optax_step(q, g, st)
        p, m, v = fused(p, g, m, v, scalars(count))
    return max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(p, q))


# ------------------------------------------------------------------------------------------------
# A whole ZeRO step, lowered for CUDA.

def step_section(devices: int) -> dict:
    raw = {"train_batch_size": 8 * devices, "bf16": {"enabled": True}, "kernels": "pallas",
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3}, "model": {"seq_len": 128, "d_model": 128, "n_layers": 4,
                                                        "n_heads": 4}}
    cfg = zerojax.load_config(raw)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
    params = gpt.init_params(cfg.model, 0)
    plan = zerojax.plan(cfg, mesh, params)
    plan = plan.with_kernels("triton")
    state = zerojax.init_state(cfg, plan, params)
    tokens = np.zeros((cfg.batch(devices).train_batch_size, cfg.model.seq_len + 1), np.int32)
    step = zerojax.make_train_step(cfg, plan, gpt.make_loss_fn(cfg.model))
    text = step.trace(state, {"tokens": tokens}).lower(lowering_platforms=("cuda",)).as_text()
    local = sum(int(np.prod(s.shard_shape(x.shape))) for x, s in
                zip(jax.tree.leaves(plan.abstract_params), jax.tree.leaves(plan.update_shardings)))
    psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return dict(devices=devices, psi=psi, local=local, leaves=len(jax.tree.leaves(params)),
                kernels=lowered_kernels(text))


# ------------------------------------------------------------------------------------------------

def report(args: argparse.Namespace, device: Any, backend: str, rows: list[dict], agreement: float,
           step: dict | None) -> str:
    on_gpu = backend == "triton"
    peak = peak_bandwidth(device) if on_gpu else None
    out = ["# Fused Adam kernel benchmark", "",
           f"Device: {device.device_kind} ({device.platform}); kernel backend: {backend}; "
           f"block {args.block} elements, {args.warps} warps; jax {jax.__version__}.", ""]
    if not on_gpu:
        out += ["**No GPU: the kernel runs in interpret mode on CPU. The times and GB/s below mean nothing "
                "about the kernel's speed** (the interpreter runs each program as XLA:CPU slices); they only "
                "show the benchmark runs. Launch and byte counts come from the module lowered for CUDA and "
                "are what a GPU would run.", ""]
    out += [f"Kernel vs optax.adamw after 3 updates: max relative difference {agreement:.1e}.", ""]
    out += ["## One Adam/AdamW update (fp32 master, gradients and moments, donated buffers)", "",
            "| parameters | arrays | fused ms | optax ms | fused GB/s | optax GB/s | copy GB/s | fused/peak | "
            "optax/peak | fused vs optax |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["times"]
        gbs = {k: IDEAL * r["n"] / t[k] / 1e9 for k in ("fused", "optax")}
        copy = 8 * r["n"] / t["copy"] / 1e9
        ref = peak / 1e9 if peak else copy
        out.append(f"| {r['n']:.3g} | {r['leaves']} | {1e3 * t['fused']:.3f} | {1e3 * t['optax']:.3f} | "
                   f"{gbs['fused']:.1f} | {gbs['optax']:.1f} | {copy:.1f} | {gbs['fused'] / ref:.2f} | "
                   f"{gbs['optax'] / ref:.2f} | {t['optax'] / t['fused']:.2f}x |")
    out += ["", f"GB/s = {IDEAL} bytes per parameter / time. Peak: "
            + (f"{peak / 1e9:.0f} GB/s nominal for this device." if peak else
               "no nominal figure for this device; the ratio columns use the measured copy "
               "(read + write, 8 bytes per element)."), ""]
    out += ["## Launches and bytes per parameter", "",
            "| parameters | fused launches (CUDA lowering) | fused bytes/param (kernel operands + results) | "
            f"ideal | fused launches (compiled, {device.platform}) | optax launches (compiled, {device.platform}) | "
            f"optax bytes/param (XLA cost analysis, {device.platform}) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        kb = sum(b for _, b in r["kernels"]) / r["n"]
        out.append(f"| {r['n']:.3g} | {len(r['kernels'])} | {kb:.2f} | {IDEAL} | {r['fused_launches_compiled']} | "
                   f"{r['optax_launches']} | {r['optax_bytes'] / r['n']:.2f} |")
    out += ["", "Fused bytes include the runtime-scalar operand (64 bytes per launch). `compiled` launches count "
            "the device instructions of the compiled entry computation (fusions, custom calls, copies)"
            + ("; on CPU the fused path's are the interpreter's, not a GPU's." if not on_gpu else "."), ""]
    if step:
        k = step["kernels"]
        per = [b / step["local"] for _, b in k]
        out += ["## A ZeRO-3 train step with `kernels: pallas`, lowered for CUDA", "",
                f"Embedded GPT, {step['psi']:,} parameters in {step['leaves']} arrays, bf16 compute with fp32 master "
                f"weights and AdamW, {step['devices']} data shards: {step['local']:,} parameters of optimizer "
                "state per device.", "",
                "| kernel launches per step | bytes per local parameter, per launch | total |", "|---|---|---|",
                f"| {len(k)} | {', '.join(f'{b:.2f}' for b in per)} | {sum(per):.2f} |", "",
                "The launches are the gradient-statistics kernel (reads the bf16 gradient: 2 B, plus 8 B of "
                f"partial sums per {multi_tensor.BLOCK} elements) and the fused Adam kernel (reads fp32 p, m, v and the bf16 "
                "gradient, writes p, m, v and the bf16 copy the all-gather sends: 28 B).", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    jax.config.update("jax_num_cpu_devices", 8)  # the ZeRO-step section's mesh on a CPU-only machine
    args = parse_args(argv)
    multi_tensor.NUM_WARPS = args.warps
    device = jax.devices()[0]
    backend = "triton" if device.platform == "gpu" else "interpret"
    default = "1e8,3e8,1e9" if backend == "triton" else "1e5"
    sizes = [int(float(x)) for x in (args.sizes or default).split(",")]
    if backend != "triton":
        print("No GPU found: running the kernel in interpret mode on CPU. Timings here mean nothing.",
              file=sys.stderr)
    agreement = check_agreement(args, backend)
    rows = []
    for n in sizes:
        print(f"measuring {n:.3g} parameters ...", file=sys.stderr)
        rows.append(measure_size(n, args, backend, device))
    step = None if args.no_step else step_section(min(8, len(jax.devices())))
    text = report(args, device, backend, rows, agreement, step)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
