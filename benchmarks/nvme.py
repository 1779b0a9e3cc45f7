"""ZeRO-Infinity's NVMe tier: host memory against the buffer budget, and the step's stall against the disk.

    python -m benchmarks.nvme          (or: python benchmarks/nvme.py)

A stack of `--layers` square `--d-model` weights (bf16 parameters, fp32 master and AdamW moments:
12 bytes of optimizer state per parameter) trains at ZeRO stage 3 on 8 CPU devices, once per
configuration, each in its own process (so each peak is its own):

* `in memory`: no offload;
* `cpu offload`: `offload_optimizer.device: cpu` (ZeRO-Offload: the update runs inside the compiled
  step, as a host computation where the backend compiles one);
* `nvme`: `offload_optimizer.device: nvme`, `sub_group_size` elements per tile, `buffer_count` buffers;
* `nvme, pipelined`: the same with `pipeline_read` and `pipeline_write`;
* `nvme + params`: the pipelined NVMe optimizer and `offload_param.device: nvme` (`buffer_size`
  `sub_group_size`, `buffer_count` as above, `max_in_cpu: 0`): the parameters' shards in files between
  steps; the stacked `w` read at use inside the step (each layer's read starting the next one's), the
  other leaves read onto the devices before each step, all written back after it;
* `nvme + params, no read-ahead`: the same with `overlap_comm: false` (no stage-3 prefetch), so each
  layer's block is read when its layer asks for it.

Per configuration: the process's resident set (RSS, /proc/self/statm) between steps and its peak
while `--rounds` steps run (a thread samples it every millisecond; freed heap is returned to the system
with `malloc_trim` first, in every run alike), the step time, and for NVMe the
host update's time (`stall_s`: the devices wait for it) with the part of it spent waiting on reads
and writes (and, with parameters on NVMe, the time the step spends reading and writing them, and for
the layers read at use the time the step's callbacks waited on the disk - the stall - against the
time the reads took; before each timed step the parameters' files are written out and dropped from the
page cache, so their reads come from the disk). The disk under `--nvme-path` is measured first: a file of the optimizer state's size
written in tiles with `pwritev` + `fsync`, evicted from the page cache (`posix_fadvise DONTNEED`) and
read back with `preadv`, with the same thread count. On CPU, device memory is host memory too, so
every configuration's RSS holds the parameters, gradients and activations; what the NVMe tier
removes from it is the optimizer state (and the parameters). Writes the section between the `nvme` markers of
docs/offload.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import output_args, run_section  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- nvme -->", "<!-- /nvme -->"
MiB = 2 ** 20

CONFIGS = {"in memory": "none", "cpu offload": "cpu", "nvme": "nvme", "nvme, pipelined": "nvme pipelined",
           "nvme + params": "nvme params pipelined", "nvme + params, no read-ahead": "nvme params noahead pipelined"}

_CHILD = r"""
import gc, json, os, sys, threading, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np
import zerojax
a = json.loads(sys.argv[1])
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
L, D = a["layers"], a["d_model"]
rng = np.random.default_rng(0)
params = {"w": (rng.standard_normal((L, D, D)) / np.sqrt(D)).astype(np.float32),
          "out": (rng.standard_normal((D, 8)) / np.sqrt(D)).astype(np.float32)}
def loss(p, batch):
    def layer(h, w):
        return jnp.tanh(h @ w), None
    h, _ = jax.lax.scan(layer, batch["x"], p["w"])
    return jnp.mean((h @ p["out"] - batch["y"]) ** 2)
zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": a["tile"]}
if a["mode"] == "cpu":
    zero["offload_optimizer"] = {"device": "cpu"}
elif a["mode"].startswith("nvme"):
    piped = a["mode"].endswith("pipelined")
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": a["path"], "buffer_count": a["buffers"],
                                 "pipeline_read": piped, "pipeline_write": piped}
    if "params" in a["mode"]:
        zero["offload_param"] = {"device": "nvme", "nvme_path": a["path"], "buffer_count": a["buffers"],
                                 "buffer_size": a["tile"], "max_in_cpu": 0}
    if "noahead" in a["mode"]:  # the stacked layers read at use, each read when its layer asks for it
        zero["overlap_comm"] = False
cfg = zerojax.load_config({"train_batch_size": 64, "bf16": {"enabled": True}, "zero_optimization": zero,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "kernels": "xla",
                           "aio": {"thread_count": a["threads"]}})
mesh = zerojax.make_mesh(cfg)
e = zerojax.initialize(cfg, params=params, loss_fn=loss, mesh=mesh)
del params
x = rng.standard_normal((64, D)).astype(np.float32)
batch = {"x": x, "y": rng.standard_normal((64, 8)).astype(np.float32)}
for _ in range(a["warmup"]):
    jax.block_until_ready(e.train_batch(batch))
gc.collect()
import ctypes
ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system, in every run alike
between = rss()
live = sum(sh.data.nbytes for x in jax.live_arrays() for sh in x.addressable_shards)  # arrays JAX holds
peak = [between]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.001)
t = threading.Thread(target=sample, daemon=True)
t.start()
times, stalls, rw, ww, pin, pout, at = [], [], [], [], [], [], []
def evict():  # the parameters' files out of the page cache (written first): read from the disk
    files = getattr(e._train_step, "files", None) if hasattr(e._train_step, "inner") else None
    for fd in ([] if files is None else files._fds):
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
for _ in range(a["rounds"]):
    evict()
    t0 = time.perf_counter()
    jax.block_until_ready(e.train_batch(batch))
    times.append(time.perf_counter() - t0)
    step = e._train_step
    if hasattr(step, "inner"):  # parameters on NVMe around the optimizer's NVMe step
        pin.append(step.params.load_s)
        pout.append(step.params.store_s)
        at.append(step.params.last)
        step = step.inner
    if hasattr(step, "files"):
        stalls.append(step.stall_s)
        rw.append(step.files.last.read_wait_s)
        ww.append(step.files.last.write_wait_s)
stop.set()
t.join()
out = {"between": between, "live": live, "peak": peak[0], "step": float(np.median(times)),
       "opt_bytes": int(L * D * D + D * 8) * 12}
if stalls:
    files = getattr(e._train_step, "inner", e._train_step).files
    out.update(stall=float(np.median(stalls)), read_wait=float(np.median(rw)), write_wait=float(np.median(ww)),
               buffer_bytes=files.buffer_bytes, file_bytes=files.file_bytes, moved=files.last.bytes_read)
if pin:
    pf = e._train_step.files
    out.update(param_in=float(np.median(pin)), param_out=float(np.median(pout)), moved=out["moved"] + pf.file_bytes,
               buffer_bytes=out["buffer_bytes"] + pf.buffer_bytes, file_bytes=out["file_bytes"] + pf.file_bytes,
               param_file_bytes=pf.file_bytes)
    if at[-1].reads:  # the stacked layers read at use, inside the step
        blocks = e._train_step.params
        per = int(np.prod(e.plan.abstract_params["w"].shape[1:])) // 8 * 2  # one layer's bf16 block, per device
        out.update(at_reads=at[-1].reads, at_ahead=at[-1].ahead, at_bytes=at[-1].reads * per,
                   at_wait=float(np.median([s.wait_s for s in at])), at_read=float(np.median([s.read_s for s in at])),
                   read_ahead=blocks.read_ahead)
print("NVME " + json.dumps(out), flush=True)
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--tile", type=int, default=1 << 19, help="sub_group_size: elements per tile")
    ap.add_argument("--buffers", type=int, default=8, help="buffer_count")
    ap.add_argument("--threads", type=int, default=2, help="aio.thread_count")
    ap.add_argument("--nvme-path", default=None, help="a folder on the disk to measure (default: a temp folder)")
    output_args(ap, "offload.md", warmup=2, rounds=3)
    return ap.parse_args(argv)


def disk_bandwidth(path: str, nbytes: int, tile_bytes: int, threads: int) -> tuple[float, float]:
    """(write, read) bytes per second of `nbytes` in `tile_bytes` pieces under `path`, from the disk."""
    import numpy as np
    buf = np.ones(tile_bytes // 4, np.float32)
    view = memoryview(buf).cast("B")
    offsets = list(range(0, nbytes, tile_bytes))
    with tempfile.NamedTemporaryFile(dir=path) as f, ThreadPoolExecutor(threads) as pool:
        fd = f.fileno()
        t0 = time.perf_counter()
        list(pool.map(lambda o: os.pwritev(fd, [view], o), offsets))
        os.fsync(fd)
        write = len(offsets) * tile_bytes / (time.perf_counter() - t0)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        outs = [np.empty_like(buf) for _ in range(threads)]
        t0 = time.perf_counter()
        list(pool.map(lambda io: os.preadv(fd, [memoryview(outs[io[0] % threads]).cast("B")], io[1]),
                      enumerate(offsets)))
        read = len(offsets) * tile_bytes / (time.perf_counter() - t0)
    return write, read


def measure(args: argparse.Namespace) -> dict:
    if args.nvme_path is None:
        with tempfile.TemporaryDirectory(prefix="zerojax-bench-nvme-") as path:
            return _measure(args, path)
    return _measure(args, args.nvme_path)


def _measure(args: argparse.Namespace, path: str) -> dict:
    opt_bytes = (args.layers * args.d_model * args.d_model + args.d_model * 8) * 12
    write_bw, read_bw = disk_bandwidth(path, opt_bytes, args.tile * 4, args.threads)
    rows = {}
    for name, mode in CONFIGS.items():
        child = {"layers": args.layers, "d_model": args.d_model, "tile": args.tile, "buffers": args.buffers,
                 "threads": args.threads, "path": path, "mode": mode, "warmup": args.warmup,
                 "rounds": args.rounds}
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
        run = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(child)], capture_output=True, text=True,
                             env=env, cwd=ROOT)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("NVME ")), None)
        if line is None:
            raise RuntimeError(f"{name}: {run.stderr[-2000:]}")
        rows[name] = json.loads(line[5:])
    return {"write_bw": write_bw, "read_bw": read_bw, "rows": rows, "opt_bytes": opt_bytes}


def render(args: argparse.Namespace, res: dict, seconds: float) -> str:
    rows, base = res["rows"], res["rows"]["in memory"]
    params = args.layers * args.d_model * args.d_model + args.d_model * 8
    lines = [BEGIN, "",
             f"`python -m benchmarks.nvme` ({params / 1e6:.1f}M parameters, ZeRO-3 over 8 CPU devices, bf16 "
             f"with fp32 AdamW state: {res['opt_bytes'] / MiB:.0f} MiB of optimizer state; `sub_group_size` "
             f"{args.tile:,}, `buffer_count` {args.buffers}, `aio.thread_count` {args.threads}; medians of "
             f"{args.rounds} steps; {seconds:.0f} s). Disk under the swap folder: writes "
             f"{res['write_bw'] / MiB:,.0f} MiB/s, reads {res['read_bw'] / MiB:,.0f} MiB/s.", "",
             "| run | arrays held between steps MiB | RSS between steps MiB | peak RSS in a step MiB | host buffers MiB "
             "| state in files MiB | step s | host update (stall) s | of it waiting on reads / writes s "
             "| parameters read / written s | disk floor s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "stall" in r:
            floor = r["moved"] / res["read_bw"] + r["moved"] / res["write_bw"]
            swapped = f"{r['param_in']:.2f} / {r['param_out']:.2f}" if "param_in" in r else "-"
            extra = (f"{r['buffer_bytes'] / MiB:.1f} | {r['file_bytes'] / MiB:.1f} | {r['step']:.2f} | "
                     f"{r['stall']:.2f} | {r['read_wait']:.2f} / {r['write_wait']:.2f} | {swapped} | {floor:.2f}")
        else:
            extra = f"- | - | {r['step']:.2f} | - | - | - | -"
        lines.append(f"| {name} | {r['live'] / MiB:,.1f} | {r['between'] / MiB:,.0f} | {r['peak'] / MiB:,.0f} | {extra} |")
    nv, both = rows["nvme, pipelined"], rows["nvme + params"]
    lines += ["",
              f"With the parameters on NVMe too, the arrays held between steps are {(base['live'] - both['live']) / MiB:,.1f} "
              f"MiB less than in memory ({both['param_file_bytes'] / MiB:.1f} MiB of bf16 parameters in their own "
              f"files). The stacked layers (`w`) are read at use, inside the step; the other leaves are read onto the "
              f"devices before it, and every shard is written back after the update (`parameters read / written`: "
              f"{both['param_in']:.2f} s and {both['param_out']:.2f} s of its {both['step']:.2f} s step).",
              "",
              "Reads at use, per step (the last step's counts; times are medians): the step's stall is the time its "
              "callbacks waited on the disk, against the time the reads took and the measured read bandwidth's floor "
              "for the same bytes.",
              "",
              "| run | blocks read | of them read ahead | MiB read | read time s | callbacks waited (stall) s "
              "| disk floor at the measured read bandwidth s |",
              "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "at_reads" in r:
            lines.append(f"| {name} | {r['at_reads']} | {r['at_ahead']} | {r['at_bytes'] / MiB:.1f} | "
                         f"{r['at_read']:.3f} | {r['at_wait']:.3f} | {r['at_bytes'] / res['read_bw']:.3f} |")
    lines += ["",
              "`no read-ahead`: the same run with the plan's stage-3 prefetch off (`overlap_comm: false`), so each "
              "layer's callback reads its block when the layer asks for it. With read-ahead a callback waits only "
              "for a read that is not yet done (a device's first read of the step, or one that found no free pool "
              "buffer: `buffer_count` buffers are shared by the 8 devices).",
              "",
              f"Between steps the pipelined NVMe run's arrays hold {(base['live'] - nv['live']) / MiB:,.1f} MiB less "
              f"than the in-memory run's (the optimizer state is {res['opt_bytes'] / MiB:.0f} MiB); its host "
              f"buffers are {nv['buffer_bytes'] / MiB:.1f} MiB, {nv['file_bytes'] / nv['buffer_bytes']:.1f}x less "
              f"than the state in its files. On CPU the devices' arrays are host memory too, and RSS also holds "
              f"what XLA's and the C library's allocators keep after freeing, so its differences are smaller and "
              f"vary from run to run. `disk floor`: the bytes one step reads and writes over the measured "
              f"bandwidths, read then write. The swap files go through the page cache (no O_DIRECT), so a "
              f"state that fits in free memory is read from RAM: the waits stay under the floor here. Step times on "
              f"this shared 2-core machine vary by 2-3x from run to run.", "", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "nvme")


if __name__ == "__main__":
    sys.exit(main())
