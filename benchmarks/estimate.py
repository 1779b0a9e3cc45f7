"""Plan-exact estimates (`zerojax estimate`) against the compiled step, for every stage and offload choice.

    python -m benchmarks.estimate            (or: python benchmarks/estimate.py)

For one GPT (bf16 mixed precision, AdamW) on 8 virtual CPU devices and each choice the estimate
table lists, compares

* the plan-exact estimate (`zerojax.tools.estimate.plan_exact`: the plan on an 8-device abstract mesh,
  nothing allocated) of parameters + master copy + optimizer state per device,
* the compiled step's argument bytes per device (`memory_analysis()`, device + host arguments,
  less this device's rows of the batch: the state the step takes, counters and key included),
* the bytes the real state arrays hold on device 0 (`init_state`, first addressable shards),

and the gradient accumulator the plan gives against DeepSpeed's ZeRO formula. Writes the table
into its section of docs/estimate.md.
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
MiB = 2 ** 20


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


def main(argv: list[str] | None = None) -> int:
    from benchmarks.report import run_section
    return run_section(argv, parse_args, measure, render, BEGIN, END, "plan-exact estimate")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
