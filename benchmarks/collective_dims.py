"""Why `choose_dim` shards the most major dimension: the same collectives along dimension 0 and
along an inner dimension, side by side.

    python -m benchmarks.collective_dims      (or: python benchmarks/collective_dims.py)

Each device holds `--count` fp32 matrices of `--shape`; the benchmark times, on 8 virtual CPU
devices, a tiled all-gather that builds them from 1/8 blocks and a reduce-scatter that splits
them into 1/8 blocks, once with the blocks along dimension 0 (each block one contiguous run of
rows) and once along dimension 1 (a strided block), and writes the section between the
`collective-dims` markers of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
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
from benchmarks.report import output_args, run_section  # noqa: E402

BEGIN, END = "<!-- collective-dims -->", "<!-- /collective-dims -->"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=2, default=[1024, 2048], help="one whole matrix")
    ap.add_argument("--count", type=int, default=12, help="matrices per device")
    output_args(ap, "benchmarks.md", warmup=1, rounds=5)
    return ap.parse_args(argv)


def _timed(fn: Any, args: Any, warmup: int, rounds: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(args))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(fn(args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(args: argparse.Namespace) -> dict:
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    rows, cols = args.shape
    per_device = NamedSharding(mesh, P("data"))

    def mapped(fn: Any) -> Any:
        return jax.jit(jax.shard_map(lambda xs: [fn(x) for x in xs], mesh=mesh, in_specs=P("data"),
                                     out_specs=P("data"), check_vma=False))

    def inputs(shape: tuple[int, int]) -> list[jax.Array]:
        # One (shape) array per device, stacked along dimension 0 of the global array.
        return jax.device_put([jnp.ones((n * shape[0], shape[1]), jnp.float32)] * args.count, per_device)

    out: dict = {}
    for dim in (0, 1):
        block = (rows // n, cols) if dim == 0 else (rows, cols // n)
        gather = mapped(lambda x, d=dim: jax.lax.all_gather(x, "data", axis=d, tiled=True))
        scatter = mapped(lambda x, d=dim: jax.lax.psum_scatter(x, "data", scatter_dimension=d, tiled=True))
        out[dim] = {"all-gather": _timed(gather, inputs(block), args.warmup, args.rounds),
                    "reduce-scatter": _timed(scatter, inputs((rows, cols)), args.warmup, args.rounds)}
    whole = mapped(lambda x: jax.lax.psum(x, "data"))
    out["all-reduce"] = _timed(whole, inputs((rows, cols)), args.warmup, args.rounds)
    return out


def render(args: argparse.Namespace, r: dict, elapsed: float) -> str:
    n = jax.device_count()
    rows, cols = args.shape
    lines = [BEGIN, "## Collectives along dimension 0 and along an inner dimension", "",
             f"`python -m benchmarks.collective_dims` ({elapsed:.0f} s here): {n} virtual CPU devices, each "
             f"with {args.count} fp32 matrices of {rows}x{cols}; median of {args.rounds} runs. The blocks are "
             f"1/{n} of each matrix along the dimension named. This is why `choose_dim` shards the most "
             "major dimension outside the layer axes (docs/zero.md).", "",
             "| collective | along dimension 0 (s) | along dimension 1 (s) | dimension 1 / dimension 0 |",
             "|---|---|---|---|"]
    for kind in ("all-gather", "reduce-scatter"):
        lines.append(f"| {kind} | {r[0][kind]:.3f} | {r[1][kind]:.3f} | {r[1][kind] / r[0][kind]:.1f} |")
    lines += ["", f"An all-reduce of the same whole matrices took {r['all-reduce']:.3f} s.", "", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "collective-dims")


if __name__ == "__main__":
    sys.exit(main())
