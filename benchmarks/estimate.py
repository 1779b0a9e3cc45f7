"""Plan-exact estimates (`zerojax estimate`) against the compiled step, for every stage and offload choice.

    python -m benchmarks.estimate            (or: python benchmarks/estimate.py)
    python -m benchmarks.estimate --llama-70b   (the tensor-parallel table only; no compiling)

For one GPT (bf16 mixed precision, AdamW) on 8 virtual CPU devices and each choice the estimate
table lists, compares

* the plan-exact estimate (`zerojax.tools.estimate.plan_exact`: the plan on an 8-device abstract mesh,
  nothing allocated) of parameters + master copy + optimizer state per device,
* the compiled step's argument bytes per device (`memory_analysis()`, device + host arguments,
  less this device's rows of the batch: the state the step takes, counters and key included),
* the bytes the real state arrays hold on device 0 (`init_state`, first addressable shards),

and the gradient accumulator the plan gives against DeepSpeed's ZeRO formula. Writes the table
into its section of docs/estimate.md.

With `--llama-70b`, writes instead the tensor-parallel rows `zerojax estimate` gives for a 70B
Llama on 64 H100s (8 hosts x 8) into their own section of docs/estimate.md: shapes only, seconds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import gpt_args, output_args  # noqa: E402

BEGIN = "<!-- benchmarks.estimate:begin -->"
END = "<!-- benchmarks.estimate:end -->"
TP_BEGIN = "<!-- benchmarks.estimate.tensor:begin -->"
TP_END = "<!-- benchmarks.estimate.tensor:end -->"
MiB = 2 ** 20
GiB = 2 ** 30
# Llama-2-70B's config.json sizes; Llama-3-70B differs only in its 128,256-token vocabulary.
LLAMA_70B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpt_args(ap, d_model=512, layers=7, heads=8, seq_len=128, micro=1)
    output_args(ap, "estimate.md")
    return ap.parse_args(argv)


def config_dict(args: argparse.Namespace) -> dict:
    return {"train_micro_batch_size_per_gpu": args.micro, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads,
                      "seq_len": args.seq_len, "vocab_size": 256}}


def measure(args: argparse.Namespace) -> list[dict]:
    import jax
    import numpy as np

    from zerojax.tools import estimate as E
    from zerojax.config import load_config
    from zerojax.planner.plan import make_plan
    from zerojax.planner.mesh import make_mesh
    from zerojax.models import gpt
    from zerojax.core.state import abstract_state
    from zerojax.planner.api import init_state
    from zerojax.planner.api import make_train_step
    from zerojax.core.measure import array_bytes

    base = load_config(config_dict(args))
    params = gpt.init_params(base.model, 0)
    rows = []
    for choice in E.CHOICES:
        cfg = E.variant(base, choice)
        est = E.plan_exact(cfg, E.embedded_model(cfg), 8, 8, choice)
        rep = est.report
        p = make_plan(cfg, make_mesh(cfg), gpt.abstract_params(cfg.model))
        n_rows = p.batch.micro_batch_size * p.data_size
        batch = {"tokens": jax.ShapeDtypeStruct((n_rows, cfg.model.seq_len + 1), np.int32,
                                                sharding=p.batch_sharding)}
        t = time.perf_counter()
        mem = make_train_step(cfg, p, gpt.make_loss_fn(cfg.model)).lower(abstract_state(p), batch).compile() \
            .memory_analysis()
        compile_s = time.perf_counter() - t
        per_device_batch = p.batch.micro_batch_size * (cfg.model.seq_len + 1) * 4
        compiled = mem.argument_size_in_bytes + mem.host_argument_size_in_bytes - per_device_batch
        state = init_state(cfg, p, params)
        real = array_bytes((state.params, state.master, state.opt_state))
        jax.tree.map(lambda x: x.delete(), jax.tree.leaves(state))
        rows.append(dict(choice=choice.label, n_params=rep.n_params, estimate=rep.params + rep.optimizer,
                         device=est.device_bytes, host=rep.host, grads=rep.grads, formula_grads=rep.formula_grads,
                         compiled=compiled, real=real))
        print(f"{choice.label}: compiled in {compile_s:.1f}s", file=sys.stderr, flush=True)
    return rows


def render(args: argparse.Namespace, rows: list[dict], elapsed: float) -> str:
    out = [BEGIN, "",
           "## Measured: plan-exact against the compiled step", "",
           f"`python -m benchmarks.estimate`: GPT d_model {args.d_model}, {args.layers} layers, "
           f"{rows[0]['n_params']:,} parameters, bf16 + AdamW, micro-batch {args.micro} x {args.seq_len} tokens, "
           f"8 virtual CPU devices ({elapsed:.0f} s). State = parameters + fp32 master + optimizer state per device; "
           "compiled = the step's argument bytes (`memory_analysis()`, device + host) less the batch rows; "
           "arrays = what `init_state`'s arrays hold on device 0. On CPU host and device memory are the same RAM, "
           "so offloaded bytes count in both.", "",
           "| choice | estimate MiB | of it on host | compiled MiB | estimate / compiled | arrays MiB | "
           "gradients MiB (plan) | ZeRO formula |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['choice']} | {r['estimate'] / MiB:.3f} | {r['host'] / MiB:.3f} | {r['compiled'] / MiB:.3f} | "
                   f"{r['estimate'] / r['compiled']:.4f} | {r['real'] / MiB:.3f} | {r['grads'] / MiB:.3f} | "
                   f"{r['formula_grads'] / MiB:.3f} |")
    out += ["", END]
    return "\n".join(out)


def tensor_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="tensor-parallel estimate of a 70B Llama")
    ap.add_argument("--llama-70b", action="store_true", required=True)
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--devices-per-host", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=1, help="rows per model replica per micro-step")
    output_args(ap, "estimate.md")
    return ap.parse_args(argv)


def tensor_config(args: argparse.Namespace) -> dict:
    return {"train_micro_batch_size_per_gpu": args.micro, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
            "model": {"seq_len": args.seq_len, "remat": True}}


def tensor_measure(args: argparse.Namespace) -> dict:
    """The rows and recommendation for Llama-2-70B, and the recommendation for Llama-3-70B."""
    from zerojax.config import load_config
    from zerojax.tools import estimate as E
    cfg = load_config(tensor_config(args))
    req = E.Request(devices=args.devices, devices_per_host=args.devices_per_host, device=E.PRESETS["h100"])
    out = {}
    for vocab in (32000, 128256):
        model = E.hf_model(dict(LLAMA_70B, vocab_size=vocab))
        rows, skipped = E.tensor_rows(cfg, model, req)
        out[vocab] = dict(model=model, rows=rows, skipped=skipped,
                          best=E.recommend_tensor(rows, E.PRESETS["h100"].memory))
    return out


def tensor_render(args: argparse.Namespace, results: dict, elapsed: float) -> str:
    main_, other = results[32000], results[128256]
    best, best3 = main_["best"], other["best"]
    out = [TP_BEGIN, "",
           "## Estimated: a 70B Llama with tensor parallelism on 64 H100s", "",
           f"`python -m benchmarks.estimate --llama-70b`: Llama-2-70B sizes (80 layers, hidden 8192, 64 heads, "
           f"8 KV heads, MLP 28672, vocabulary 32,000: {main_['model'].total_params:,} parameters), "
           f"{args.devices} H100 80GB ({args.devices // args.devices_per_host} hosts x {args.devices_per_host}), "
           f"sequence {args.seq_len}, micro-batch {args.micro} per model replica, no accumulation, bf16 + AdamW, "
           "activation checkpointing on (`model.remat`), the `h100` preset's links (450 GB/s NVLink for the tensor "
           "group, 50 GB/s per GPU between hosts for the data group). Per device; bytes sent per device per "
           f"optimizer step; comm per 1k tokens = (tensor + data time) / tokens the mesh trains per step x 1000. "
           f"Shapes only ({elapsed:.1f} s).", "",
           "| layout | model state GiB | activations GiB | total GiB | fits 80 GiB | tensor GiB sent | data GiB sent "
           "| tensor ms | data ms | tokens / step | comm ms / 1k tokens |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in main_["rows"]:
        mark = "**" if r is best else ""
        out.append(f"| {mark}{r.label}{mark} | {r.state_bytes / GiB:.2f} | {r.activation_bytes / GiB:.2f} | "
                   f"{r.device_bytes / GiB:.2f} | {'yes' if r.device_bytes <= 80 * GiB else 'no'} | "
                   f"{r.tensor_bytes / GiB:.2f} | {r.data_bytes / GiB:.2f} | {r.tensor_s * 1e3:.1f} | "
                   f"{r.data_s * 1e3:.1f} | {r.tokens:,} | {r.comm_s_per_token * 1e6:.3f} |")
    out += ["", f"Recommendation: **{best.label}** (`mesh.tensor={best.tensor}`, DeepSpeed "
                f"`tensor_parallel.autotp_size={best.tensor}`, `zero_optimization.stage={best.choice.stage}`): "
                f"{best.device_bytes / GiB:.2f} GiB per device, {best.comm_s_per_token * 1e6:.3f} ms of "
                f"communication per 1k tokens. With Llama-3-70B's 128,256-token vocabulary "
                f"({other['model'].total_params:,} parameters) the recommendation is {best3.label} "
                f"({best3.device_bytes / GiB:.2f} GiB, {best3.comm_s_per_token * 1e6:.3f} ms per 1k tokens).",
            "", TP_END]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.report import run_section
    if "--llama-70b" in (sys.argv[1:] if argv is None else argv):
        return run_section(argv, tensor_args, tensor_measure, tensor_render, TP_BEGIN, TP_END,
                           "tensor-parallel estimate")
    return run_section(argv, parse_args, measure, render, BEGIN, END, "plan-exact estimate")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
