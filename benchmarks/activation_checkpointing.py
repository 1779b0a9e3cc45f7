"""Activation checkpointing policies: compiled temp memory and step time per policy.

    python -m benchmarks.activation_checkpointing      (or: python benchmarks/activation_checkpointing.py)

For the embedded GPT (its `gathers_params` loss, blocks checkpointed by `gpt.apply`) and for a
user's loss over a `lax.scan` of stacked MLP layers with no remat of its own (checkpointed by the
step, `zerojax.rewrite.remat.for_loss`), at ZeRO stages 0 and 3, one train step is compiled per
`activation_checkpointing` setting: none (no checkpointing at all), policy nothing / dots_no_batch /
dots / everything, and nothing with cpu_checkpointing. The report gives the compiled step's temp
bytes per device (`memory_analysis().temp_size_in_bytes`), that over the no-checkpointing temp, and
the median step time, all from one run; it writes the section between the `remat` markers of
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import dataclasses
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchmarks.report import output_args, run_section  # noqa: E402

BEGIN, END = "<!-- remat -->", "<!-- /remat -->"
# (label, activation_checkpointing section or None for no checkpointing at all)
SETTINGS: list[tuple[str, Any]] = [
    ("none (no checkpointing)", None),
    ("nothing", {"policy": "nothing"}),
    ("dots_no_batch", {"policy": "dots_no_batch"}),
    ("dots", {"policy": "dots"}),
    ("everything", {"policy": "everything"}),
    ("nothing + cpu_checkpointing", {"policy": "nothing", "cpu_checkpointing": True}),
]
STAGES = ("0", "3", "3+prefetch")
NOTES = ("*everything* compiles to the step without checkpointing (the same temp). The scanned MLP's "
         "matmuls have no batch dimensions, so *dots_no_batch* keeps what *dots* keeps; the GPT's attention "
         "einsums (`bqhd,bkhd->bhqk`) have batch dimensions, which *dots_no_batch* recomputes. Under "
         "`overlap_comm` prefetching the stack's backward pass is the prefetching scan's own, which keeps each "
         "layer's input carry whatever the policy (docs/zero.md, \"Activation checkpointing\").")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpt-rows", type=int, default=16, help="GPT global batch rows")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--gpt-layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mlp-rows", type=int, default=4096, help="scanned MLP global batch rows")
    ap.add_argument("--mlp-width", type=int, default=128)
    ap.add_argument("--mlp-layers", type=int, default=8)
    output_args(ap, "benchmarks.md", warmup=1, rounds=3)
    return ap.parse_args(argv)


def scanned_mlp(width: int, layers: int) -> tuple[Any, Any, Any]:
    """A user's loss: stacked MLP blocks applied with `lax.scan`, no `jax.checkpoint` of its own."""
    from benchmarks.user_models import SHAPES, _block
    params, _, make_batch = SHAPES["lax_scan"](width=width, layers=layers)

    def loss_fn(params: dict, batch: dict) -> jax.Array:
        h = batch["x"].astype(params["w_in"].dtype) @ params["w_in"]
        h, _ = jax.lax.scan(lambda h, p: (_block(h, p), None), h, params["layers"])
        return jnp.mean(((h @ params["w_out"]).astype(jnp.float32) - batch["y"]) ** 2)

    return params, loss_fn, make_batch


def _config(rows: int, stage: str, ac: Any) -> Any:
    import zerojax
    return zerojax.load_config({
        "train_batch_size": rows, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "activation_checkpointing": ac or {},
        "zero_optimization": {"stage": int(stage[0]), "stage3_param_persistence_threshold": 0,
                              "overlap_comm": stage == "3+prefetch"}})


def measure(args: argparse.Namespace) -> dict:
    import zerojax
    from zerojax.config import ModelConfig
    from zerojax.models import gpt

    model = ModelConfig(d_model=args.d_model, n_layers=args.gpt_layers, n_heads=4, seq_len=args.seq_len)
    rng = np.random.default_rng(0)
    gpt_batches = [{"tokens": rng.integers(0, 256, size=(args.gpt_rows, args.seq_len + 1), dtype=np.int32)}
                   for _ in range(args.warmup + args.rounds)]
    mlp_params, mlp_loss, mlp_batch = scanned_mlp(args.mlp_width, args.mlp_layers)
    mlp_batches = [mlp_batch(args.mlp_rows, i) for i in range(args.warmup + args.rounds)]

    def gpt_case(ac: Any) -> tuple[Any, Any]:
        cfg_model = dataclasses.replace(model, remat=ac is not None)
        section = _config(8, "0", ac).activation_checkpointing
        return gpt.init_params(model, 0), gpt.make_loss_fn(cfg_model, section)

    models = {
        "gpt": (args.gpt_rows, gpt_batches, gpt_case, ("0", "3")),
        "mlp": (args.mlp_rows, mlp_batches, lambda ac: (mlp_params, mlp_loss), STAGES),
    }
    results: dict = {}
    for name, (rows, batches, case, stages) in models.items():
        for stage in stages:
            runners: dict = {}
            # With prefetch the stack's backward is the prefetching scan's own: a few settings show it.
            settings = SETTINGS if stage != "3+prefetch" else [SETTINGS[i] for i in (0, 1, 3, 5)]
            for label, ac in settings:
                params, loss_fn = case(ac)
                cfg = _config(rows, stage, ac)
                mesh = zerojax.make_mesh(cfg)
                plan = zerojax.plan(cfg, mesh, params)
                state = zerojax.init_state(cfg, plan, params)
                step = zerojax.make_train_step(cfg, plan, loss_fn)
                t = time.perf_counter()
                compiled = step.lower(state, batches[0]).compile()
                compile_s = time.perf_counter() - t
                temp = compiled.memory_analysis().temp_size_in_bytes
                runners[label] = [compiled, state, {"temp": temp, "compile_s": compile_s, "times": []}]
            for i in range(args.warmup + args.rounds):
                for label, r in runners.items():  # interleaved, so load on the machine hits all alike
                    t = time.perf_counter()
                    r[1], out = r[0](r[1], batches[i])
                    jax.block_until_ready(out)
                    if i >= args.warmup:
                        r[2]["times"].append(time.perf_counter() - t)
            results[(name, stage)] = {label: {**r[2], "step_s": statistics.median(r[2]["times"])}
                                      for label, r in runners.items()}
            print(f"{name} stage {stage}: measured", file=sys.stderr, flush=True)
    return results


def render(args: argparse.Namespace, results: dict, elapsed: float) -> str:
    n = jax.device_count()
    out = [BEGIN, "## Activation checkpointing: temp memory and step time per policy", "",
           f"`python -m benchmarks.activation_checkpointing` ({elapsed:.0f} s here): {n} virtual CPU devices, "
           "fp32 AdamW, one compiled train step per `activation_checkpointing` setting.", "",
           f"- **GPT**: the embedded GPT, d_model {args.d_model}, {args.gpt_layers} blocks, seq_len "
           f"{args.seq_len}, global batch {args.gpt_rows}; *none* is `model.remat: false` with no policy.",
           f"- **scanned MLP**: a user's loss, `lax.scan` over {args.mlp_layers} stacked MLP blocks of width "
           f"{args.mlp_width} (hidden {2 * args.mlp_width}) with no remat of its own, global batch "
           f"{args.mlp_rows}; the step checkpoints each scan body (`zerojax.rewrite.remat.for_loss`).",
           "- **temp**: `compiled.memory_analysis().temp_size_in_bytes` per device; **/ none**: over the "
           "no-checkpointing step's. **step s**: median step time (eight devices share two cores here: read "
           "times as relative).",
           "- `cpu_checkpointing` on the CPU backend: host and device are the same RAM and XLA:CPU lowers a "
           "placement inside the computation as a no-op, so its row measures the program, not the saving "
           "(on a GPU the kept layer inputs move to `pinned_host`; tests/test_remat.py checks the "
           "annotations in the step lowered for CUDA).", ""]
    titles = {("gpt", "0"): "GPT, ZeRO-0", ("gpt", "3"): "GPT, ZeRO-3",
              ("mlp", "0"): "scanned MLP, ZeRO-0", ("mlp", "3"): "scanned MLP, ZeRO-3 (overlap_comm false)",
              ("mlp", "3+prefetch"): "scanned MLP, ZeRO-3 (overlap_comm true: prefetch)"}
    for key, rows in results.items():
        base = rows["none (no checkpointing)"]["temp"]
        out += [f"### {titles[key]}", "", "| setting | temp MiB | / none | step s | compile s |",
                "|---|---|---|---|---|"]
        for label, r in rows.items():
            out.append(f"| {label} | {r['temp'] / 2**20:.2f} | {r['temp'] / base:.2f} | {r['step_s']:.3f} | "
                       f"{r['compile_s']:.1f} |")
        out.append("")
    out += [NOTES, "", END]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "remat")


if __name__ == "__main__":
    sys.exit(main())
