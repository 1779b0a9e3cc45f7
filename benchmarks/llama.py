"""The Llama workload: tokens/s and MFU of configs/llama.yaml at ZeRO stages 0-3, and the cost of
importing a Hugging Face checkpoint against its size.

    python -m benchmarks.llama          (or: python benchmarks/llama.py)

Training: for each stage, configs/llama.yaml (`--set zero_optimization.stage=S`) is built exactly as
train.py builds it (`trainer.build_model`, `trainer.build_engine`, the trainer's `compile_step`), on
its own byte batches of the embedded corpus, 8 virtual CPU devices. After `--warmup` steps, the
stages run interleaved, one step each per round (each waited for with block_until_ready), for
`--rounds` rounds; the median step gives tokens/s. FLOPs per step come from the compiled step's HLO
(`zerojax.measure.hlo.work`: every dot, loop bodies counted trip-count times; per device program x devices);
XLA's `cost_analysis()` counts the scanned layer stack once and is shown next to it. MFU is achieved
FLOP/s over a peak measured in the same run: the best of a large matmul on one device and a batch of
matmuls over all 8 devices, in float32 and bfloat16 (the cores are shared, so no published figure
applies to 8 virtual devices).

Import: synthetic Llama checkpoints of growing size (random weights, transformers' tensor names,
written with safetensors' numpy API into a temporary folder) are read with `model.hf_checkpoint`'s
loader (`zerojax.models.hf.load_params`, which train.py calls) under the ZeRO-3 layout, each import in a
fresh subprocess so that peaks do not accumulate; that subprocess reports the time and its peak
resident memory over what it held just before the import (the peak `ru_maxrss` reports, VmHWM,
reset to the current size through /proc/self/clear_refs first, so that start-up's own peak does not
hide a small import's). For contrast, the same
checkpoint read whole onto the host (`hf.read_params`) and then placed. Writes the section between
the `llama` markers of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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
from benchmarks.report import run_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- llama -->", "<!-- /llama -->"
CONFIG = ROOT / "configs" / "llama.yaml"
MIB = 2 ** 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--warmup", type=int, default=2, help="steps per stage before timing")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, one step of every stage each")
    p.add_argument("--matmul", type=int, default=2048, help="side of the one-device peak matmul")
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 1536],
                   help="d_model of each synthetic checkpoint (4 layers, vocabulary --vocab)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--no-write", action="store_true", help="print the section only")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Training throughput.

def _best(fn: Any, *args: Any, n: int = 5) -> float:
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times)


def peak_flops(side: int) -> dict[str, float]:
    """FLOP/s of large matmuls here: one device, and one per device over all devices at once."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("d",))
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        a = jnp.ones((side, side), dtype)
        out[f"{dtype.__name__}, one device"] = 2 * side ** 3 / _best(jax.jit(lambda x, y: x @ y), a, a)
        half = side // 2
        sharding = NamedSharding(mesh, P("d"))
        b = jax.device_put(jnp.ones((len(devices), half, half), dtype), sharding)
        batched = jax.jit(lambda x, y: jnp.einsum("bij,bjk->bik", x, y), out_shardings=sharding)
        out[f"{dtype.__name__}, {len(devices)} devices"] = len(devices) * 2 * half ** 3 / _best(batched, b, b)
    return out


def measure_training(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import zerojax
    from zerojax.runtime.data import make_batches
    from zerojax.measure.hlo import work
    from zerojax.planner.mesh import make_mesh
    from zerojax.app.trainer import build_engine, build_model, compile_step

    rows: dict[int, dict[str, Any]] = {}
    engines, batches = {}, None
    for stage in args.stages:
        config = zerojax.load_config(str(CONFIG), [f"zero_optimization.stage={stage}"])
        mesh = make_mesh(config)
        model = build_model(config, mesh)
        m = config.model
        if batches is None:  # the data does not depend on the stage
            batches, _ = make_batches(config.data, model.plan.batch.train_batch_size, m.seq_len, m.vocab_size)
        engine = build_engine(config, mesh, model)
        batch = batches.batch(0)
        t = time.perf_counter()
        compiled = compile_step(engine, batch)
        compile_s = time.perf_counter() - t
        n_dev = mesh.devices.size
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(engine.params))
        tokens = engine.plan.batch.train_batch_size * m.seq_len
        # 6 N D for the weights, plus attention's QK^T and PV (forward 4 T d per token per layer, x3)
        model_flops = 6 * params * tokens + 12 * m.n_layers * m.seq_len * m.d_model * tokens
        rows[stage] = {"flops": work(compiled.as_text()).flops * n_dev,
                       "xla_flops": float(cost.get("flops", 0.0)) * n_dev, "model_flops": model_flops,
                       "tokens": tokens, "params": params, "compile_s": compile_s, "times": []}
        for _ in range(args.warmup):
            jax.block_until_ready(engine.train_batch(batches.batch(engine.global_steps)))
        engines[stage] = engine
    for _ in range(args.rounds):
        for stage, engine in engines.items():
            batch = batches.batch(engine.global_steps)
            t = time.perf_counter()
            metrics = engine.train_batch(batch)
            jax.block_until_ready(metrics)
            rows[stage]["times"].append(time.perf_counter() - t)
            rows[stage]["loss"] = float(metrics["loss"])
    for stage in rows:
        rows[stage]["step_s"] = statistics.median(rows[stage]["times"])
    return rows


# ---------------------------------------------------------------------------------------------
# Checkpoint import.

def write_checkpoint(folder: Path, d: int, layers: int, vocab: int, seed: int = 0) -> int:
    """A random Llama checkpoint with transformers' names and config.json; returns its bytes."""
    from safetensors.numpy import save_file
    heads = max(d // 64, 1)
    kv = max(heads // 2, 1)
    ff = 64 * round(8 * d / 3 / 64)
    hd = d // heads
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape, dtype=np.float32))

    tensors = {"model.embed_tokens.weight": w(vocab, d), "model.norm.weight": np.ones(d, np.float32),
               "lm_head.weight": w(vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": np.ones(d, np.float32),
                        p + "post_attention_layernorm.weight": np.ones(d, np.float32),
                        p + "self_attn.q_proj.weight": w(heads * hd, d), p + "self_attn.k_proj.weight": w(kv * hd, d),
                        p + "self_attn.v_proj.weight": w(kv * hd, d), p + "self_attn.o_proj.weight": w(d, heads * hd),
                        p + "mlp.gate_proj.weight": w(ff, d), p + "mlp.up_proj.weight": w(ff, d),
                        p + "mlp.down_proj.weight": w(d, ff)})
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": d,
        "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "max_position_embeddings": 2048, "torch_dtype": "float32"}))
    return (folder / "model.safetensors").stat().st_size


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _reset_peak() -> int:
    """Start a fresh peak: Linux resets VmHWM (the peak ru_maxrss reports) to the current resident
    size on a write of 5 to clear_refs; returns that baseline in bytes. Without it (not Linux), the
    baseline is the peak so far, and smaller imports may not rise above it."""
    import resource
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmHWM") * 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak() -> int:
    import resource
    try:
        return _status_kib("VmHWM") * 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class AnonPeak:
    """The largest RssAnon (memory not backed by a file) seen by a thread polling /proc/self/status
    every millisecond: VmHWM also counts the checkpoint's memory-mapped pages, which the kernel
    drops under pressure, so it overstates what an import needs."""

    def __init__(self) -> None:
        import threading
        self.peak = _status_kib("RssAnon") * 1024
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kib("RssAnon") * 1024)
            self._stop.wait(0.001)

    def __enter__(self) -> "AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon") * 1024)


def _import_child(directory: str, mode: str) -> None:
    """In a fresh process: import `directory` under configs/llama.yaml's ZeRO-3 layout; print JSON."""
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import yaml
    import zerojax
    from zerojax.models import hf
    from zerojax.planner.mesh import make_mesh
    from zerojax.app.trainer import build_model

    raw = yaml.safe_load(CONFIG.read_text())
    raw["model"] = {"hf_checkpoint": directory, "seq_len": raw["model"]["seq_len"]}
    config = zerojax.load_config(raw)
    mesh = make_mesh(config)
    shardings = build_model(config, mesh).plan.update_shardings
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32)))  # the runtime is up before the baseline
    anon_before = _status_kib("RssAnon") * 1024
    before = _reset_peak()
    with AnonPeak() as anon:
        t = time.perf_counter()
        if mode == "sliced":
            params = hf.load_params(directory, config.model, shardings)
        else:  # the whole checkpoint on the host, then placed
            params = jax.device_put(hf.read_params(directory, config.model), shardings)
        jax.block_until_ready(params)
        seconds = time.perf_counter() - t
    peak = _peak()
    leaves = jax.tree.leaves(params)
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    device0 = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    print(json.dumps({"seconds": seconds, "peak_increase": peak - before, "held": held,
                      "anon_increase": anon.peak - anon_before, "device0": device0,
                      "largest": max(x.nbytes for x in leaves), "params": sum(int(x.size) for x in leaves)}))


def import_once(directory: Path, mode: str) -> dict[str, Any]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.llama", "--import-child", str(directory), mode],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"import of {directory} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_imports(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory(prefix="zerojax-llama-bench-") as tmp:
        for d in args.sizes:
            folder = Path(tmp) / f"d{d}"
            size = write_checkpoint(folder, d, args.layers, args.vocab)
            row = {"d_model": d, "bytes": size, "sliced": import_once(folder, "sliced"),
                   "whole": import_once(folder, "whole")}
            out.append(row)
            for f in folder.iterdir():
                f.unlink()
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    peak = peak_flops(args.matmul)
    training = measure_training(args)
    return {"peak": peak, "training": training, "imports": measure_imports(args)}


# ---------------------------------------------------------------------------------------------
# The report.

def render(args: argparse.Namespace, m: dict[str, Any], seconds: float) -> str:
    import yaml
    raw = yaml.safe_load(CONFIG.read_text())
    mc = raw["model"]
    peak_name, peak = max(m["peak"].items(), key=lambda kv: kv[1])
    first = next(iter(m["training"].values()))
    out = [BEGIN, "## The Llama workload: throughput, MFU and checkpoint import", "",
           f"`python -m benchmarks.llama` ({seconds:.0f} s here; `--help` for the knobs). 8 virtual CPU devices on "
           f"this machine's {os.cpu_count()} cores.", "",
           "### Training `configs/llama.yaml` at each ZeRO stage", "",
           f"The Llama of `configs/llama.yaml` ({first['params'] / 1e6:.2f}M parameters: d_model {mc['d_model']}, "
           f"{mc['n_layers']} scanned, rematerialized layers, {mc['n_heads']} heads / {mc['n_kv_heads']} KV heads, "
           f"seq_len {mc['seq_len']}), global batch {raw['train_batch_size']} ({first['tokens']} tokens per step), "
           f"bf16 with fp32 master weights, AdamW, on byte batches of the embedded corpus; each stage built as "
           f"train.py builds it (`trainer.build_model` / `build_engine` / `compile_step`) with only "
           f"`zero_optimization.stage` changed. Median step of {args.rounds} rounds after {args.warmup} warm-up "
           f"steps, the stages interleaved round by round.", "",
           "- **FLOPs/step (HLO)**: `zerojax.measure.hlo.work` over the compiled step's text, every dot counted, the scanned "
           "layer loop trip-count times, per device program x 8 devices. It includes the rematerialized forward "
           "pass, so it is hardware FLOPs.",
           "- **XLA cost_analysis**: the same executable's `cost_analysis()['flops']` x 8: it counts a while "
           "body once, so the layer stack reads as one layer (and it counts elementwise work too).",
           "- **6ND + attn**: 6 x parameters x tokens + 12 x layers x seq_len x d_model x tokens, the model "
           "FLOPs of the usual MFU definition (no recomputation).",
           f"- **MFU**: HLO FLOPs per second over the peak measured in this run: {peak / 1e9:.1f} GFLOP/s "
           f"({peak_name} matmul, the best of the matmuls below). **model MFU**: the same with 6ND + attn.", "",
           "| stage | step (s) | tokens/s | FLOPs/step (HLO) | XLA cost_analysis | 6ND + attn | achieved GFLOP/s "
           "| MFU | model MFU | compile (s) | loss at last step |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for stage, r in m["training"].items():
        rate = r["flops"] / r["step_s"]
        out.append(f"| {stage} | {r['step_s']:.3f} | {r['tokens'] / r['step_s']:,.0f} | {r['flops'] / 1e9:.2f} G "
                   f"| {r['xla_flops'] / 1e9:.2f} G | {r['model_flops'] / 1e9:.2f} G | {rate / 1e9:.1f} "
                   f"| {100 * rate / peak:.1f}% | {100 * r['model_flops'] / r['step_s'] / peak:.1f}% "
                   f"| {r['compile_s']:.1f} | {r['loss']:.4f} |")
    out += ["", "Peak matmul throughput measured in the same run (`--matmul` side on one device; half that side, "
            "one matmul per device, on all 8 at once):", "",
            "| matmul | GFLOP/s |", "|---|---|"]
    out += [f"| {name} | {v / 1e9:.1f} |" for name, v in m["peak"].items()]
    out += ["", "A model this small (d_model 128) keeps its matmuls far from the peak's shapes, and the "
            "8 virtual devices share the cores with the optimizer update and the collectives (memory copies "
            "here); stage 0 runs the whole AdamW update on every device. The numbers say how the stages "
            "compare on one machine, not what a GPU would do.", "",
            "### Importing a Hugging Face checkpoint", "",
            f"Random Llama checkpoints ({args.layers} layers, vocabulary {args.vocab}, KV heads half the heads, "
            f"float32, one model.safetensors each) imported under the ZeRO-3 layout of `configs/llama.yaml` over 8 "
            f"devices, each import in a fresh process. **sliced**: `model.hf_checkpoint`'s loader "
            f"(`hf.load_params`): every device's block read with safetensors' lazy slices. **whole, then placed**: "
            f"`hf.read_params` (the whole model on the host) then `jax.device_put`. **RSS peak +**: the "
            f"process's peak resident memory during the import (VmHWM, `ru_maxrss`'s figure, reset just before it) "
            f"over its resident memory just before it; it counts the pages of the memory-mapped safetensors file "
            f"the reads touched, which are page cache the kernel can drop. **anon peak +**: the same for memory "
            f"not backed by a file (RssAnon, polled every millisecond): what the import really allocates. On CPU "
            f"the 8 devices live in this one process, so the imported arrays themselves (**held**: all 8 devices' "
            f"shards, the size of the model) are part of both; **anon beyond held** is the rest, the host buffers "
            f"the import needed on the way. **per device**: bytes device 0 holds; **largest leaf**: the largest "
            f"parameter (a stacked layer weight, all layers).", "",
            "| d_model | parameters | checkpoint | per device | held | largest leaf | sliced: time | sliced: RSS peak + "
            "| sliced: anon peak + | sliced: anon beyond held | whole: time | whole: RSS peak + | whole: anon beyond "
            "held |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in m["imports"]:
        s, w = r["sliced"], r["whole"]
        out.append(f"| {r['d_model']} | {s['params'] / 1e6:.1f}M | {r['bytes'] / MIB:.1f} MiB "
                   f"| {s['device0'] / MIB:.1f} MiB | {s['held'] / MIB:.1f} MiB | {s['largest'] / MIB:.1f} MiB "
                   f"| {s['seconds']:.2f} s | {s['peak_increase'] / MIB:.1f} MiB | {s['anon_increase'] / MIB:.1f} MiB "
                   f"| {(s['anon_increase'] - s['held']) / MIB:.1f} MiB | {w['seconds']:.2f} s "
                   f"| {w['peak_increase'] / MIB:.1f} MiB | {(w['anon_increase'] - w['held']) / MIB:.1f} MiB |")
    out += ["", "Read whole, an import needs the checkpoint's size again on top of the model (the host copy); "
            "read in slices, the extra is about one leaf: this process builds the blocks of all 8 devices of "
            "a leaf before placing them, so a process that drives one device of a multi-host run would need an "
            "eighth of that. Times include placing the arrays; the first import of a file also reads it from "
            "disk (here it was just written, so it sits in the page cache)."]
    out += ["", END]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--import-child"]:
        _import_child(argv[1], argv[2])
        return 0
    return run_section(argv, parse_args, measure, render, BEGIN, END, "llama")


if __name__ == "__main__":
    sys.exit(main())
