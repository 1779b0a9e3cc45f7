"""Generation: decode tokens/s with the KV cache against recomputing the window per token.

    python -m benchmarks.generate          (or: python benchmarks/generate.py)

The embedded GPT at configs/zero3.yaml's size (d_model 128, 4 layers, 4 heads, seq_len 128, bf16
parameters over fp32 masters, ZeRO-3 over 8 virtual CPU devices), built as train.py builds it
(`trainer.build_model`, `trainer.build_engine`; untrained weights, which decode as fast as trained
ones). Prompts of 16 tokens, `--new` new tokens each, greedy, at batch 1 and 16:

* `KV cache, engine.generate`: `engine.generate` on the live state (the bf16 compute copy, ZeRO-3
  shards gathered once per call inside the one program, rows split over the data axis when the
  batch divides by 8).
* `KV cache, fp32 master`: `zerojax.core.generate` on the fp32 master copy, also sharded: the
  weights `zerojax sample` and the end-of-run sample now read.
* `KV cache, one device`: the same program with the master weights gathered to the host and put on
  one device (as the recompute path has them), for what 8 virtual devices sharing the CPU cost.
* `recompute window`: `zerojax.app.sample.generate_recompute`, the path before: the master weights
  gathered to the host, one prompt at a time, a [1, seq_len] forward per new token, sampled on the
  host (its forward is jitted once per model config; the first call holds the compile).

Each path is called once untimed (its compile), then `--rounds` times; tokens/s is batch x new
tokens over the median call. It writes the section between the `generate` markers of
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from benchmarks.report import output_args, run_section  # noqa: E402

BEGIN, END = "<!-- generate -->", "<!-- /generate -->"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    output_args(p, "benchmarks.md", rounds=3)
    return p.parse_args(argv)


def _timed(fn: Callable[[], Any], rounds: int) -> tuple[float, float, Any]:
    """(first call's seconds, median seconds of `rounds` more calls, the last call's result)."""
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - t
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return first, statistics.median(times), out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import zerojax
    from zerojax.app import sample, trainer
    from zerojax.core.generate import generate

    config = zerojax.load_config(os.path.join(ROOT, "configs", "zero3.yaml"), ["run.progress=false"])
    mesh = trainer.make_mesh(config)
    engine = trainer.build_engine(config, mesh, trainer.build_model(config, mesh))
    cfg = config.model
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for b in args.batches:
        prompts = [list(rng.integers(0, cfg.vocab_size, args.prompt)) for _ in range(b)]

        def recompute() -> list[list[int]]:
            host = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(engine.params))
            return [sample.generate_recompute(cfg, host, p, args.new, temperature=0.0) for p in prompts]

        def one_device() -> Any:
            host = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(engine.params))
            return generate(engine.decoder, jax.device_put(host, jax.devices()[0]), prompts, None, args.new).tokens

        paths = [("KV cache, engine.generate", lambda: engine.generate(prompts, args.new).tokens),
                 ("KV cache, fp32 master", lambda: generate(engine.decoder, engine.params, prompts, None, args.new,
                                                           plan=engine.plan).tokens),
                 ("KV cache, one device", one_device),
                 ("recompute window", recompute)]
        got = {}
        for name, fn in paths:
            first, median, out = _timed(fn, args.rounds)
            got[name] = np.asarray(out, np.int32)
            rows.append(dict(batch=b, path=name, first=first, median=median, tps=b * args.new / median))
        # the fp32 paths decode the same greedy tokens (the bf16 copy may part from them on a near-tie)
        rows[-1]["same"] = bool(np.array_equal(got["recompute window"], got["KV cache, fp32 master"]))
    n_params = sum(x.size for x in jax.tree.leaves(engine.params))
    return dict(rows=rows, params=n_params, cfg=cfg)


def render(args: argparse.Namespace, res: dict[str, Any], seconds: float) -> str:
    cfg = res["cfg"]
    lines = [BEGIN, "## Generation: KV cache against recomputing the window", "",
             f"`python -m benchmarks.generate` ({seconds:.0f} s here): the embedded GPT at configs/zero3.yaml's size "
             f"({res['params'] / 1e6:.2f}M parameters: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
             f"seq_len {cfg.seq_len}), bf16 parameters over fp32 masters, ZeRO-3 over 8 virtual CPU devices, built as "
             f"train.py builds it. Prompts of {args.prompt} tokens, {args.new} new tokens each, greedy; median of "
             f"{args.rounds} calls after one untimed call.", "",
             "- **KV cache, engine.generate**: the live bf16 compute copy, ZeRO-3 shards gathered once per call inside "
             "one compiled program (prefill, then a `while_loop` of decode steps); rows split over the 8 devices "
             "when the batch divides by 8, else every device decodes the whole batch.",
             "- **KV cache, fp32 master**: the same program on the fp32 master copy (what `zerojax sample` and the "
             "end-of-run sample read now).",
             "- **KV cache, one device**: the same program with the master weights gathered to the host and put on "
             "one device, as the recompute path has them (the gather is in the timed call).",
             "- **recompute window**: the path before (`app.sample.generate_recompute`): master weights gathered to "
             "the host, one prompt at a time, a [1, seq_len] forward per token, sampled on the host (its forward compiled "
             "once, in the first call; before this change it was recompiled in every call).", "",
             "| batch | path | tokens/s | vs recompute | call (s) | first call (s) |", "|---|---|---|---|---|---|"]
    rows = res["rows"]
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["path"] == "recompute window")
        lines.append(f"| {r['batch']} | {r['path']} | {r['tps']:.0f} | {r['tps'] / base['tps']:.1f}x | "
                     f"{r['median']:.3f} | {r['first']:.2f} |")
    same = all(r.get("same", True) for r in rows)
    lines += ["", f"The fp32 KV-cache path and the recompute path gave {'the same' if same else 'different'} greedy "
              "tokens at every batch. The 8 virtual devices share this machine's CPU cores: a batch that does not "
              "divide by 8 is decoded whole by each of them, so on the mesh a row costs about 8 times its "
              "one-device work, and a batch of 16 gives each device 2 rows; the one-device row shows the program "
              "without that. On real accelerators the devices run side by side and the replicated work costs no "
              "wall time; no GPU run is measured here.", "", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "generate")


if __name__ == "__main__":
    sys.exit(main())
