"""Host memory of `zerojax export --format hf` against the model's size.

    python -m benchmarks.hf_export          (or: python benchmarks/hf_export.py)

A random Llama checkpoint with transformers' names (`benchmarks.llama.write_checkpoint`: float32,
one model.safetensors, a few hundred MB at the defaults) is imported with `model.hf_checkpoint` on one
CPU device and saved as a zerojax checkpoint (SGD at learning rate 0: the master weights are the
source's). Then, each in a fresh process, `zerojax.models.hf.export_checkpoint` writes it back as one
model.safetensors and as shards of `--shard-size` with an index. The export process reports its time
and how far its resident memory rose above what it held just before the export: **RSS peak +**
(VmHWM, the peak `ru_maxrss` reports, reset first through /proc/self/clear_refs) and **anon peak +**
(RssAnon polled every millisecond: memory not backed by a file). The output is checked bit for bit
against the source. Writes the section between the `hf_export` markers of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from benchmarks.llama import AnonPeak, _peak, _reset_peak, _status_kib, write_checkpoint  # noqa: E402
from benchmarks.report import DOCS, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- hf_export -->", "<!-- /hf_export -->"
MIB = 2 ** 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="768x8x32000,512x24x4000", metavar="DxLxV,...",
                   help="Llama models to export: d_model x layers x vocabulary, comma-separated")
    p.add_argument("--shard-size", default="100MB", help="--max-shard-size of the sharded export")
    p.add_argument("--out", default=os.path.join(DOCS, "benchmarks.md"))
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _config(source: str) -> Any:
    import zerojax
    return zerojax.load_config({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
                                "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3},
                                "mesh": {"cpu_devices": 8},
                                "model": {"hf_checkpoint": source, "seq_len": 16}})


def _save_child(source: str, ckpt: str) -> None:
    """Import `source` and save it as a zerojax checkpoint (ZeRO-3 over 8 CPU devices)."""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    from zerojax.models import hf, llama
    from zerojax.planner.mesh import make_mesh
    import zerojax
    config = _config(source)
    mesh = make_mesh(config)
    from zerojax.planner.plan import make_plan
    plan = make_plan(config, mesh, hf.abstract_params(config.model))
    params = hf.load_params(source, config.model, plan.update_shardings)
    engine = zerojax.initialize(config, params=params, loss_fn=llama.build(config.model)[1], mesh=mesh)
    engine.save_checkpoint(ckpt)
    engine.wait_for_checkpoint()


def _export_child(ckpt: str, out: str, shard_size: str) -> None:
    """Export in this fresh process; print time and memory as JSON."""
    import orbax.checkpoint  # noqa: F401  (the libraries the export uses are loaded before the baseline)
    import tensorstore  # noqa: F401
    from safetensors import safe_open  # noqa: F401
    from zerojax import checkpoint  # noqa: F401
    from zerojax.models import hf
    anon_before = _status_kib("RssAnon") * 1024
    before = _reset_peak()
    with AnonPeak() as anon:
        t = time.perf_counter()
        hf.export_checkpoint(ckpt, None, out, max_shard_size=shard_size)
        seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "peak_increase": _peak() - before, "anon_increase": anon.peak - anon_before,
                      "files": len(list(Path(out).glob("*.safetensors")))}))


def _child(*args: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.hf_export", "--child", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def _same(source: Path, out: Path) -> bool:
    from zerojax.models.hf import Checkpoint
    with Checkpoint(source) as a, Checkpoint(out) as b:
        return sorted(a.where) == sorted(b.where) and all(
            a.read(n, ()).tobytes() == b.read(n, ()).tobytes() for n in a.where)


def measure_one(args: argparse.Namespace, d: int, layers: int, vocab: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zerojax-hf-export-") as tmp:
        source = Path(tmp) / "source"
        size = write_checkpoint(source, d, layers, vocab)
        from zerojax.models.hf import Checkpoint
        with Checkpoint(source) as ck:
            shapes = {n: ck.shape(n) for n in ck.where}
        n_params = sum(int(np.prod(s)) for s in shapes.values())
        largest = max(int(np.prod(s)) for s in shapes.values()) * 4
        stacked = max(layers * int(np.prod(s)) * 4 for n, s in shapes.items() if ".layers.0." in n)
        _child("save", str(source), str(Path(tmp) / "ckpt"))
        rows = []
        for label, shard in (("one file", "5GB"), (f"shards of {args.shard_size}", args.shard_size)):
            out = Path(tmp) / label.replace(" ", "_")
            row = json.loads(_child("export", str(Path(tmp) / "ckpt"), str(out), shard).strip().splitlines()[-1])
            row.update(label=label, exact=_same(source, out))
            rows.append(row)
    return {"model": f"{d} x {layers} x {vocab}", "bytes": size, "params": n_params, "largest": largest,
            "stacked": stacked, "rows": rows}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [measure_one(args, *map(int, spec.split("x"))) for spec in args.models.split(",")]


def render(args: argparse.Namespace, ms: list[dict[str, Any]], seconds: float) -> str:
    lines = [BEGIN, "## Exporting to Hugging Face: host memory (`python -m benchmarks.hf_export`)", "",
             "Random float32 Llama checkpoints with transformers' names (`benchmarks.llama.write_checkpoint`, "
             "d_model x layers x vocabulary; heads d_model / 64, key/value heads half of them), imported with "
             "`model.hf_checkpoint` under ZeRO-3 over 8 CPU devices and saved as zerojax checkpoints (SGD at "
             "learning rate 0), then exported with `hf.export_checkpoint` (`zerojax export --format hf`) in a "
             "fresh process, as one file and as shards. **largest tensor**: the largest tensor written; **largest "
             "leaf**: the largest zerojax leaf (a stacked layer weight, all layers, or the embedding). **RSS peak "
             "+**: the export process's peak resident memory (VmHWM, `ru_maxrss`'s figure, reset just before) over "
             "its resident memory just before the export (its libraries already imported); **anon peak +**: the "
             "same for memory not backed by a file (RssAnon, polled every millisecond). **exact**: every tensor "
             "name, dtype and value equal to the source's.", "",
             "| model | parameters | model bytes | largest tensor | largest leaf | export | files | time | RSS peak + "
             "| anon peak + | RSS peak + / model | exact |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in ms:
        for r in m["rows"]:
            lines.append(f"| {m['model']} | {m['params'] / 1e6:.1f}M | {m['bytes'] / MIB:.1f} MiB | "
                         f"{m['largest'] / MIB:.1f} MiB | {max(m['stacked'], m['largest']) / MIB:.1f} MiB | "
                         f"{r['label']} | {r['files']} | {r['seconds']:.2f} s | {r['peak_increase'] / MIB:.1f} MiB | "
                         f"{r['anon_increase'] / MIB:.1f} MiB | {r['peak_increase'] / m['bytes']:.2f} | "
                         f"{'yes' if r['exact'] else 'NO'} |")
    lines += ["", "Each tensor is written as it is made, in blocks of rows of about 16 MiB, read from the zerojax "
                  "checkpoint with tensorstore one storage chunk at a time (a ZeRO-3 checkpoint's chunk is one "
                  "device's shard of a leaf, all layers of a stacked one): the peak follows a chunk, a block and a "
                  "fixed part (JAX, tensorstore), not the model's size or its stacked leaves, and sharding the "
                  "output does not change it. The deep model's export stays well under one stacked leaf; it "
                  "decodes each stacked leaf once per layer, the time it pays for that. The large-vocabulary "
                  "model's peak comes from its embedding and LM head: a block of the head's rows is columns of "
                  "the stored [d_model, vocab] leaf, so every chunk of it is decoded for every block, and the "
                  "freed buffers stay resident until the tensor is done (then handed back with malloc_trim). "
                  f"Whole run {seconds:.0f} s on a 2-core CPU machine.", "", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        kind, *rest = args.child
        (_save_child if kind == "save" else _export_child)(*rest)
        return 0
    t = time.perf_counter()
    m = measure(args)
    section = render(args, m, time.perf_counter() - t)
    print(section)
    if not args.no_write:
        write_section(args.out, section, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
