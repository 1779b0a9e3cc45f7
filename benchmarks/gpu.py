"""The GPU numbers in one command: training throughput and MFU against a hand-written `jax.jit` step,
the fused Adam update's bandwidth against a plain copy, and decode tokens/s against its bound.

    python -m benchmarks.gpu                      (one GPU: a ~1.1B Llama, a few minutes on an H100)
    python -m benchmarks.gpu --tiny --json r.json (any machine: the same path at a toy size, seconds)

Everything runs on one device, measured side by side in one process:

* Training. The embedded Llama at TinyLlama-1.1B's shapes (d_model 2048, 22 layers, 32 heads over
  4 key/value heads, d_ff 5632, vocabulary 32000, seq_len 2048, remat), bf16 parameters over fp32
  masters, AdamW with clipping at 1.0, built as train.py builds it at ZeRO stages 0 and 3. The
  baseline is what a JAX user writes without a library: the same NNX module split with `nnx.split`,
  fp32 parameters cast to bf16 inside the loss, `jax.value_and_grad` and `optax` (clip by global norm,
  AdamW) in one `jax.jit` with the state donated. Both start from the same initial weights and train
  on the same random batches; their first losses are printed side by side (they agree to bf16
  rounding). Each zerojax stage is timed interleaved with the baseline, step for step; tokens/s is
  tokens over the median step, MFU is 6·Ψ·tokens plus attention's 12·layers·T·d per token over the
  device's dense bf16 peak (its data sheet when the card is known, else a measured large matmul).
* The fused Adam update (Pallas, Triton on a GPU, interpret mode elsewhere) against a donated
  read+write copy of the same parameters: achieved GB/s of 28 bytes per parameter (read p, g, m, v;
  write p, m, v) over the copy's GB/s of 8 bytes per parameter (`benchmarks.kernels.measure_size`),
  and over one donated array of the same 28 bytes per parameter copied whole (the card's copy ceiling).
* Generation. `engine.generate` of the stage-3 engine, greedy, at batch 1 and `--batch`: new tokens/s
  over the median call, against the bound of reading every weight (bf16) and the KV cache written so
  far once per new token at the one-array copy's measured bandwidth (and at the card's nominal one when known).

`--json PATH` writes every number, after each section (a run cut short keeps what it measured; a
section that fails leaves its traceback there and the others still run); on a GPU the Markdown table
also goes into the section between the `gpu` markers of docs/benchmarks.md (`--no-write`: print only;
`--from-json PATH`: render a run brought back from a GPU machine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.report import DOCS, write_section  # noqa: E402

BEGIN, END = "<!-- gpu -->", "<!-- /gpu -->"

# Dense bf16 FLOP/s (no sparsity) and HBM bytes/s by device kind, from the vendors' data sheets;
# the first name that occurs in `device_kind` wins, so the more specific names come first.
CARDS = [("H200", 989e12, 4.8e12), ("GH200", 989e12, 4.0e12), ("H100 NVL", 835e12, 3.9e12),
         ("H100 PCIe", 756e12, 2.0e12), ("H100", 989e12, 3.35e12), ("A100-SXM4-80GB", 312e12, 2.039e12),
         ("A100", 312e12, 1.555e12), ("L40S", 362e12, 0.864e12), ("L4", 121e12, 0.3e12)]

SIZES = {  # (d_model, layers, heads, kv_heads, d_ff, vocab, seq_len, micro, prompt, new, adam parameters)
    "1b": (2048, 22, 32, 4, 5632, 32000, 2048, 4, 128, 128, 1_000_000_000),
    "tiny": (64, 2, 4, 2, 128, 256, 64, 2, 8, 8, 100_000),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a toy model (the default without a GPU)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per engine")
    ap.add_argument("--rounds", type=int, default=10, help="timed steps (and generate calls) per variant")
    ap.add_argument("--batch", type=int, default=64, help="the larger generate batch (the other is 1)")
    ap.add_argument("--adam-params", type=float, default=None, help="parameters of the Adam row (default 1e9; tiny 1e5)")
    ap.add_argument("--no-remat", action="store_true", help="keep activations instead of recomputing each layer")
    ap.add_argument("--attention", default="auto", help="model.attention of both steps (fused: cuDNN's flash attention)")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--out", default=os.path.join(DOCS, "benchmarks.md"), help="the docs page (GPU runs)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--from-json", default=None, help="render a saved run's numbers (and write its table) instead of measuring")
    return ap.parse_args(argv)


def card(device: Any) -> tuple[float | None, float | None]:
    """(bf16 FLOP/s, HBM bytes/s) of the card from its data sheet; (None, None) when unknown."""
    kind = getattr(device, "device_kind", "")
    for name, flops, hbm in CARDS:
        if name in kind:
            return flops, hbm
    return None, None


def measured_peak(side: int) -> float:
    """FLOP/s of a large bf16 matmul on the device: the peak when the data sheet is not known."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((side, side), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(f(a, a))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(f(a, a))
        best = min(best, time.perf_counter() - t)
    return 2 * side ** 3 / best


# ---------------------------------------------------------------------------------------------
# Training.

def config_for(size: tuple, stage: int, attention: str = "auto", remat: bool = True) -> Any:
    import zerojax
    d, layers, heads, kv, ff, vocab, seq, micro, prompt, new, _ = size
    return zerojax.load_config({
        "train_batch_size": micro, "train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
        "hybrid_engine": {"max_out_tokens": prompt + new},
        "model": {"name": "llama", "vocab_size": vocab, "seq_len": seq, "d_model": d, "n_layers": layers,
                  "n_heads": heads, "n_kv_heads": kv, "d_ff": ff, "tie_embeddings": False, "remat": remat,
                  "attention": attention}})


def baseline_step(config: Any) -> tuple[Any, Callable[[Any, Any], tuple[Any, Any]]]:
    """A hand-written mixed-precision step of the same module: (state, jitted step(state, batch))."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from zerojax.models import llama

    graphdef, params, rest = nnx.split(llama.constructor(config.model, config.run.seed)(), nnx.Param, ...)
    p = config.optimizer.params
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(p.lr, b1=p.betas[0], b2=p.betas[1], eps=p.eps, weight_decay=p.weight_decay))

    def loss(params: Any, batch: Any) -> jax.Array:
        half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        return llama.loss(nnx.merge(graphdef, half, rest), batch)

    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), value

    return (params, tx.init(params)), jax.jit(step, donate_argnums=0)


def measure_training(size: tuple, args: argparse.Namespace, device: Any) -> tuple[dict[str, Any], Any]:
    import jax
    from benchmarks.kernels import time_interleaved
    from zerojax.app.trainer import build_engine, build_model
    from zerojax.planner.mesh import make_mesh

    d, layers, heads, kv, ff, vocab, seq, micro, *_ = size
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, vocab, (micro, seq + 1), dtype=np.int32)} for _ in range(4)]
    config = config_for(size, 0, args.attention, not args.no_remat)
    state, step = baseline_step(config)
    box = {"base": state, "i": 0}
    base_first = None

    def run_base() -> Any:
        box["base"], value = step(box["base"], batches[box["i"] % len(batches)])
        box["i"] += 1
        return value

    base_first = float(run_base())
    rows: dict[str, Any] = {}
    engine = None
    for stage in (0, 3):
        config = config_for(size, stage, args.attention, not args.no_remat)
        mesh = make_mesh(config, devices=[device])
        engine = None  # the previous stage's state is freed before this one is built
        engine = build_engine(config, mesh, build_model(config, mesh))
        first = float(engine.train_batch(batches[0])["loss"])
        eng = engine
        times = time_interleaved(
            {"zerojax": lambda: eng.train_batch(batches[eng.global_steps % len(batches)])["loss"],
             "baseline": run_base}, args.warmup, args.rounds)
        rows[f"stage {stage}"] = {"step_s": times["zerojax"], "baseline_step_s": times["baseline"],
                                  "first_loss": first, "baseline_first_loss": base_first}
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(engine.params))
    tokens = micro * seq
    flops = 6 * params * tokens + 12 * layers * seq * d * tokens
    return {"params": params, "tokens_per_step": tokens, "flops_per_step": flops, "stages": rows}, engine


# ---------------------------------------------------------------------------------------------
# The fused Adam update and generation.

def measure_adam(n: int, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    from benchmarks import kernels
    backend = "triton" if device.platform == "gpu" else "interpret"
    knobs = argparse.Namespace(arrays=8, small=16, block=kernels.multi_tensor.BLOCK, warmup=args.warmup,
                               rounds=args.rounds)
    row = kernels.measure_size(n, knobs, backend, device)
    t = row["times"]
    return {"backend": backend, "parameters": n, "fused_s": t["fused"], "copy_s": t["copy"], "optax_s": t["optax"],
            "fused_gbps": kernels.IDEAL * n / t["fused"] / 1e9, "copy_gbps": 8 * n / t["copy"] / 1e9,
            "optax_gbps": kernels.IDEAL * n / t["optax"] / 1e9, "one_copy_gbps": one_copy_gbps(n, args)}


def one_copy_gbps(n: int, args: argparse.Namespace) -> float:
    """Read+write GB/s of one donated float32 array of Adam's bytes (28 per parameter: 14 read, 14
    written): the device's copy ceiling, free of the per-leaf launches of the 24-leaf copy beside it."""
    import jax
    import jax.numpy as jnp
    from benchmarks.kernels import time_interleaved
    elements = n * 28 // 8
    box = {"x": jnp.ones((elements,), jnp.float32)}
    copy = jax.jit(lambda x: x * 1.0000001, donate_argnums=0)

    def run() -> Any:
        box["x"] = copy(box["x"])
        return box["x"]

    seconds = time_interleaved({"copy": run}, args.warmup, args.rounds)["copy"]
    box.clear()
    return 8 * elements / seconds / 1e9


def measure_generate(engine: Any, size: tuple, args: argparse.Namespace, copy_bw: float,
                     nominal_bw: float | None) -> list[dict[str, Any]]:
    import jax
    from benchmarks.kernels import time_interleaved
    m = engine.config.model
    *_, vocab, seq, micro, prompt, new, _ = size
    weights = sum(int(np.prod(x.shape)) * 2 for x in jax.tree.leaves(engine.params))  # bf16
    head_dim = m.d_model // m.n_heads
    rows = []
    for batch in (1, args.batch):
        prompts = np.random.default_rng(batch).integers(0, vocab, (batch, prompt), dtype=np.int32)
        lengths = np.full((batch,), prompt, np.int32)
        call = lambda: engine.generate(prompts, new, lengths=lengths).tokens  # noqa: E731
        seconds = time_interleaved({"generate": call}, 1, max(args.rounds // 2, 2))["generate"]
        # per new token: every weight once, and the keys and values written so far (mean context)
        kv = 2 * m.n_layers * m.n_kv_heads * head_dim * 2 * batch * (prompt + new / 2)
        row = {"batch": batch, "prompt": prompt, "new": new, "seconds": seconds,
               "tokens_per_s": batch * new / seconds, "bytes_per_step": weights + kv,
               "bound_tokens_per_s": batch * copy_bw / (weights + kv)}
        if nominal_bw:
            row["nominal_bound_tokens_per_s"] = batch * nominal_bw / (weights + kv)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# The command.

def measure(args: argparse.Namespace, save: Callable[[dict[str, Any]], None] = lambda r: None) -> dict[str, Any]:
    """Every number, section by section; `save` gets the result after each one, so a run cut short (a
    lease that ends, a card that runs out of memory) still leaves what it measured, and a section that
    fails leaves its traceback under "errors" while the others run."""
    import traceback
    import jax
    device = jax.devices()[0]
    tiny = args.tiny or device.platform != "gpu"
    size = SIZES["tiny" if tiny else "1b"]
    peak, hbm = card(device)
    out: dict[str, Any] = {"device": getattr(device, "device_kind", device.platform), "platform": device.platform,
                           "size": "tiny" if tiny else "1b", "jax": jax.__version__, "attention": args.attention, "remat": not args.no_remat,
                           "errors": {}}
    if peak is None:
        peak = measured_peak(512 if tiny else 8192)
        out["peak_source"] = "measured bf16 matmul"
    else:
        out["peak_source"] = "data sheet"
    out["peak_flops"], out["nominal_hbm"] = peak, hbm
    t0 = time.perf_counter()
    engine = None

    def training() -> None:
        nonlocal engine
        out["training"], engine = measure_training(size, args, device)
        for row in out["training"]["stages"].values():
            row["tokens_per_s"] = out["training"]["tokens_per_step"] / row["step_s"]
            row["baseline_tokens_per_s"] = out["training"]["tokens_per_step"] / row["baseline_step_s"]
            row["ratio"] = row["baseline_step_s"] / row["step_s"]
            row["mfu"] = out["training"]["flops_per_step"] / row["step_s"] / peak
            row["baseline_mfu"] = out["training"]["flops_per_step"] / row["baseline_step_s"] / peak

    def adam() -> None:
        out["adam"] = measure_adam(int(args.adam_params or size[-1]), args, device)

    def generate() -> None:
        copy = out["adam"].get("one_copy_gbps", out["adam"]["copy_gbps"]) * 1e9 if "adam" in out else hbm
        out["generate"] = measure_generate(engine, size, args, copy, hbm)

    for name, section in (("training", training), ("adam", adam), ("generate", generate)):
        if name == "generate" and engine is None:
            continue
        try:
            section()
        except Exception:  # noqa: BLE001 - recorded, and the next section still runs
            out["errors"][name] = traceback.format_exc()
            print(out["errors"][name], file=sys.stderr)
        out["seconds"] = time.perf_counter() - t0
        save(out)
    return out


def render(r: dict[str, Any]) -> str:
    lines = [BEGIN, f"### On a GPU: {r['device']} ({r['size']} model, `python -m benchmarks.gpu`, jax {r.get('jax', '?')})", ""]
    t = r.get("training")
    if t:
        lines += [f"Training: {t['params']:,} parameters, {t['tokens_per_step']:,} tokens per step, bf16 over fp32 "
                  f"masters, AdamW, model.attention {r.get('attention', 'auto')}, "
                  f"remat {'on' if r.get('remat', True) else 'off'}; peak {r['peak_flops'] / 1e12:.3g} TFLOP/s "
                  f"({r['peak_source']}).", "",
                  "| layout | tokens/s | MFU | baseline tokens/s | baseline MFU | zerojax / baseline | first loss (zerojax, baseline) |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for name, row in t["stages"].items():
            lines.append(f"| ZeRO {name} | {row['tokens_per_s']:,.0f} | {row['mfu']:.1%} | {row['baseline_tokens_per_s']:,.0f} "
                         f"| {row['baseline_mfu']:.1%} | {row['ratio']:.3f} | {row['first_loss']:.4f}, "
                         f"{row['baseline_first_loss']:.4f} |")
        lines.append("")
    a = r.get("adam")
    if a:
        lines += [f"Fused Adam ({a['backend']}), {a['parameters']:.3g} parameters: {a['fused_gbps']:.0f} GB/s against a "
                  f"read+write copy's {a['copy_gbps']:.0f} GB/s ({a['fused_gbps'] / a['copy_gbps']:.0%}); optax.adamw under "
                  f"jit {a['optax_gbps']:.0f} GB/s."
                  + (f" One array of the same bytes copies at {a['one_copy_gbps']:.0f} GB/s: fused "
                     f"{a['fused_gbps'] / a['one_copy_gbps']:.0%} of it, optax {a['optax_gbps'] / a['one_copy_gbps']:.0%}."
                     if a.get("one_copy_gbps") else ""), ""]
    if r.get("generate"):
        bound = "the one-array copy's bandwidth" if a else "the card's nominal bandwidth"
        lines += ["| generate batch | prompt + new | tokens/s | bound at " + bound + " | share of bound |"
                  + (" nominal bound |" if r["nominal_hbm"] else ""),
                  "|---:|---|---:|---:|---:|" + ("---:|" if r["nominal_hbm"] else "")]
        for g in r["generate"]:
            lines.append(f"| {g['batch']} | {g['prompt']} + {g['new']} | {g['tokens_per_s']:,.0f} | "
                         f"{g['bound_tokens_per_s']:,.0f} | {g['tokens_per_s'] / g['bound_tokens_per_s']:.0%} |"
                         + (f" {g['nominal_bound_tokens_per_s']:,.0f} |" if r["nominal_hbm"] else ""))
        lines.append("")
    for name in r.get("errors", {}):
        lines.append(f"Not measured: {name} failed ({r['errors'][name].strip().splitlines()[-1]}).")
    lines += [f"Measured in {r.get('seconds', 0):.0f} s.", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def save(result: dict[str, Any]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    if args.from_json:  # a GPU run's numbers, brought back: render them here
        with open(args.from_json) as f:
            result = json.load(f)
    else:
        result = measure(args, save)
    text = render(result)
    print(text)
    if result["platform"] == "gpu" and not args.no_write:
        write_section(args.out, text, BEGIN, END)
        print(f"wrote the gpu section of {args.out}", file=sys.stderr)
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
