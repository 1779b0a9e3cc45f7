"""LoRA: per-device bytes at each ZeRO stage against the formula, step time against full fine-tuning, and the
largest Llama-shaped model whose LoRA fine-tune fits a device, per the estimator.

    python -m benchmarks.lora          (or: python benchmarks/lora.py)

Three parts, written to the section between the `lora` markers of docs/benchmarks.md:

* **Bytes**: the shipped Llama (`--d-model`, `--layers`, bf16, AdamW) with rank-`--r` adapters on its
  seven projections, built by `zerojax.initialize` on 8 CPU devices at each ZeRO stage. Per device:
  the bytes the engine's state holds on device 0 (parameters, fp32 masters, Adam moments: every shard
  read off the arrays), the plan's count (`memory_report`), and the formula of docs/lora.md, which at
  stage 3 is 2Ψ_f/N + 16Ψ_t/N (bf16 parameters, then 2 + 4 + 4 + 4 bytes of gradient, master and moments
  per trainable one).
* **Step time**: the same model's train step at stage 3, LoRA against full fine-tuning (medians of
  `--rounds` steps after `--warmup`), on the CPU devices: what the smaller update and the missing
  base gradients buy there.
* **Fit**: Llama-shaped models (Llama 2 7B/13B/70B, Llama 3.1 8B/405B shapes) at ZeRO-3 on `--devices`
  devices of `--device-memory`: the plan-exact model-state bytes of a rank-`--fit-r` LoRA fine-tune
  (`zerojax.tools.estimate.plan_exact`, nothing allocated), and DeepSpeed's
  `estimate_zero3_model_states_mem_needs` for the same model (it counts every parameter as trained: a
  full fine-tune). Activations are not counted in either.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import output_args, run_section  # noqa: E402

BEGIN, END = "<!-- lora -->", "<!-- /lora -->"
GIB = 2 ** 30
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, d_model, layers, heads, kv heads, d_ff, vocab): the published shapes
LLAMAS = [("Llama 2 7B", 4096, 32, 32, 32, 11008, 32000), ("Llama 3.1 8B", 4096, 32, 32, 8, 14336, 128256),
          ("Llama 2 13B", 5120, 40, 40, 40, 13824, 32000), ("Llama 2 70B", 8192, 80, 64, 8, 28672, 32000),
          ("Llama 3.1 405B", 16384, 126, 128, 8, 53248, 128256)]


def parse_args(argv: list[str] | None) -> Any:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--r", type=int, default=8, help="adapter rank of the measured model")
    ap.add_argument("--fit-r", type=int, default=16, help="adapter rank of the fit table")
    ap.add_argument("--devices", type=int, default=8, help="devices of the fit table")
    ap.add_argument("--device-memory", type=float, default=80.0, help="GiB per device of the fit table")
    output_args(ap, "benchmarks.md", warmup=2, rounds=5)
    return ap.parse_args(argv)


def config(args: Any, stage: int, lora: bool, model: dict | None = None) -> Any:
    import zerojax
    model = model or dict(name="llama", vocab_size=256, seq_len=64, d_model=args.d_model, n_layers=args.layers,
                          n_heads=4, n_kv_heads=2, d_ff=3 * args.d_model)
    return zerojax.load_config({
        "train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "model": model,
        **({"lora": {"enabled": True, "r": args.r if model.get("vocab_size") == 256 else args.fit_r,
                     "target_modules": TARGETS}} if lora else {})})


def device0_bytes(tree: Any) -> int:
    """Bytes of every array's shard on device 0 (None leaves: frozen leaves' master and moments)."""
    import jax
    dev = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards")
               for s in x.addressable_shards if s.device == dev)


def measure(args: Any) -> dict[str, Any]:
    import jax
    import numpy as np
    import zerojax
    from zerojax.models import llama
    from zerojax.tools.estimate import Choice, deepspeed_zero3, embedded_model, plan_exact

    batch = {"tokens": np.random.default_rng(0).integers(0, 256, size=(16, 65), dtype=np.int32)}
    out: dict[str, Any] = {"bytes": [], "time": {}, "fit": []}
    for stage in (0, 1, 2, 3):
        cfg = config(args, stage, True)
        params, loss_fn = llama.build(cfg.model)
        engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn)
        rep = engine.memory_report()
        st = engine.state
        psi_f, psi_t, n = rep.n_frozen, rep.n_params - rep.n_frozen, rep.data_size
        formula = (2 * psi_f + (2 + 2 + 12) * psi_t) / n if stage == 3 else \
            2 * (psi_f + psi_t) + 2 * psi_t / (n if stage == 2 else 1) + 12 * psi_t / (n if stage >= 1 else 1)
        out["bytes"].append(dict(stage=stage, psi_f=psi_f, psi_t=psi_t, n=n,
                                 state=device0_bytes((st.params, st.master, st.opt_state)),
                                 plan=rep.params + rep.grads + rep.optimizer, grads=rep.grads, formula=formula))
    for name, lora in (("full", False), ("lora", True)):
        cfg = config(args, 3, lora)
        params, loss_fn = llama.build(cfg.model)
        engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn)
        for _ in range(args.warmup):
            jax.block_until_ready(engine.train_batch(batch))
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            jax.block_until_ready(engine.train_batch(batch))
            times.append(time.perf_counter() - t0)
        out["time"][name] = statistics.median(times)
    for name, d, layers, heads, kv, ff, vocab in LLAMAS:
        shape = dict(name="llama", vocab_size=vocab, seq_len=4096, d_model=d, n_layers=layers, n_heads=heads,
                     n_kv_heads=kv, d_ff=ff)
        cfg = config(args, 3, True, shape)
        model = embedded_model(cfg)
        est = plan_exact(cfg, model, args.devices, args.devices, Choice(3))
        rep = est.report
        _, ds_gpu, _ = deepspeed_zero3(model.total_params, model.largest_layer_params, args.devices, 1, False, False)
        out["fit"].append(dict(name=name, total=rep.n_params, trainable=rep.n_params - rep.n_frozen,
                               lora=est.device_bytes, deepspeed=ds_gpu))
    return out


def render(args: Any, res: dict[str, Any], seconds: float) -> str:
    mib = 2 ** 20
    b0 = res["bytes"][0]
    lines = [BEGIN, "## LoRA (`benchmarks/lora.py`)", "",
             f"The shipped Llama (d_model {args.d_model}, {args.layers} layers, bf16, AdamW) with rank-{args.r} "
             f"adapters on its seven projections: Ψ_f = {b0['psi_f']:,} frozen, Ψ_t = {b0['psi_t']:,} trained "
             f"parameters, N = {b0['n']} devices (8 CPU devices). Model-state bytes per device: read off the "
             f"engine's state on device 0, the plan's count, and the formula of docs/lora.md (stage 3: "
             f"2Ψ_f/N + 16Ψ_t/N).", "",
             "| stage | state on device 0 (MiB) | plan less gradients (MiB) | plan (MiB) | formula (MiB) |",
             "|---|---|---|---|---|"]
    for row in res["bytes"]:
        lines.append(f"| {row['stage']} | {row['state'] / mib:.3f} | {(row['plan'] - row['grads']) / mib:.3f} | "
                     f"{row['plan'] / mib:.3f} | {row['formula'] / mib:.3f} |")
    lines += ["", "The state holds no gradients (they live inside the step): it is the plan less its gradient "
              "bytes."]
    t = res["time"]
    lines += ["", f"Stage-3 train step, median of {args.rounds}: full fine-tuning {t['full'] * 1e3:.1f} ms, LoRA "
              f"{t['lora'] * 1e3:.1f} ms ({t['full'] / t['lora']:.2f}x; CPU devices, so a ratio, not a speed).", "",
              f"Largest Llama-shaped model whose rank-{args.fit_r} LoRA fine-tune fits {args.devices} devices of "
              f"{args.device_memory:g} GiB at ZeRO-3 (model state only, per device; DeepSpeed's estimator counts "
              f"every parameter as trained):", "",
              "| model | parameters | trained | LoRA, plan-exact (GiB) | DeepSpeed ZeRO-3 full (GiB) | LoRA fits |",
              "|---|---|---|---|---|---|"]
    fits = [r for r in res["fit"] if r["lora"] <= args.device_memory * GIB]
    for r in res["fit"]:
        lines.append(f"| {r['name']} | {r['total'] / 1e9:.2f}B | {r['trainable'] / 1e6:.1f}M | {r['lora'] / GIB:.2f} | "
                     f"{r['deepspeed'] / GIB:.2f} | {'yes' if r['lora'] <= args.device_memory * GIB else 'no'} |")
    largest = fits[-1]["name"] if fits else "none"
    lines += ["", f"Largest that fits: {largest}. Measured in {seconds:.0f} s.", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "lora")


if __name__ == "__main__":
    sys.exit(main())
