"""The step-time model: per-device FLOPs, HBM bytes and collective bytes over a device's peak numbers.

Counted from the model's shapes and the ZeRO paper's volumes (nothing compiled, an answer in seconds),
or, with `--compiled`, read from the embedded GPT's step compiled on the local devices with abstract
inputs (`zerojax.measure.hlo`, loops counted trip-count times: XLA's `cost_analysis()` counts a scanned
layer stack's body once).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import numpy as np

from zerojax.config import Config, load_config
from zerojax.tools.estimate.memory import GIB, Choice, variant
from zerojax.tools.estimate.shapes import ModelShape

if TYPE_CHECKING:
    from zerojax.tools.estimate.command import Request


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Peak numbers of one accelerator (vendor datasheets; override any with the CLI's options).

    flops: dense bf16 FLOP/s; hbm: memory bandwidth, bytes/s; intra: per-device link bandwidth
    within a host (one direction), bytes/s; inter: per-device bandwidth between hosts / slices."""
    name: str
    flops: float
    hbm: float
    intra: float
    inter: float
    memory: float


PRESETS: dict[str, DeviceSpec] = {
    # H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 900 GB/s both ways, one 400 Gb/s NIC per GPU.
    "h100": DeviceSpec("H100 SXM 80GB", 989e12, 3.35e12, 450e9, 50e9, 80 * GIB),
    # A100 SXM 80GB: 312 TFLOP/s bf16, 2.039 TB/s HBM2e, NVLink 600 GB/s both ways, one 200 Gb/s NIC per GPU.
    "a100": DeviceSpec("A100 SXM 80GB", 312e12, 2.039e12, 300e9, 25e9, 80 * GIB),
    # TPU v5p: 459 TFLOP/s bf16, 2.765 TB/s HBM, 4800 Gb/s ICI per chip, 95 GB HBM; DCN between slices.
    "tpu-v5p": DeviceSpec("TPU v5p", 459e12, 2.765e12, 600e9, 25e9, 95e9),
}


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Per-device work of one optimizer step and the time each part takes on a DeviceSpec."""
    flops: float
    hbm_bytes: float
    comm_bytes: float
    link: str
    compute_s: float
    memory_s: float
    comm_s: float
    source: str

    @property
    def seconds(self) -> float:
        """max(compute, memory) + communication: XLA overlaps compute with memory traffic within a
        kernel; collectives are counted as not overlapped (an upper bound for the comm part)."""
        return max(self.compute_s, self.memory_s) + self.comm_s

    @property
    def bound(self) -> float:
        """Perfect overlap of everything: a lower bound."""
        return max(self.compute_s, self.memory_s, self.comm_s)


def compiled_costs(config: Config) -> tuple[float, float, float, int]:
    """(FLOPs, memory bytes, collective bytes, data size) per device for one step of the embedded
    GPT, read from the step compiled on the local devices with abstract inputs (nothing is
    allocated): `zerojax.measure.hlo.work` (matmul FLOPs and kernel operand/result bytes) and
    `zerojax.measure.hlo.collectives` (ZeRO-paper volume accounting), both counting loop bodies trip-count
    times - XLA's `cost_analysis()` counts a scanned layer stack's body once."""
    from zerojax.measure import hlo
    from zerojax.core.mesh import row_size
    from zerojax.planner.plan import make_plan
    from zerojax.planner.mesh import make_mesh
    from zerojax.models import gpt
    from zerojax.core.state import abstract_state
    from zerojax.planner.api import make_train_step
    mesh = make_mesh(config)
    p = make_plan(config, mesh, gpt.abstract_params(config.model))
    rows = p.batch.micro_batch_size * p.batch.gradient_accumulation_steps * row_size(mesh)
    batch = {"tokens": jax.ShapeDtypeStruct((rows, config.model.seq_len + 1), np.int32, sharding=p.batch_sharding)}
    step = make_train_step(config, p, gpt.make_loss_fn(config.model))
    text = step.lower(abstract_state(p), batch).compile().as_text()
    done = hlo.work(text)
    comm = hlo.summarize(hlo.collectives(text))["bytes"]
    return done.flops, done.bytes, float(comm), p.data_size


def analytic_costs(config: Config, model: ModelShape, stage: int, devices: int) -> tuple[float, float, float]:
    """(FLOPs, HBM bytes, collective bytes) per device when the step cannot be compiled here:
    6 FLOPs per parameter per token (forward 2, backward 4; remat adds another forward, 2 more),
    HBM traffic of reading the parameters in each pass and the model state once, and the ZeRO
    paper's volume: Ψ (N-1)/N in the reduction dtype twice (stages 0-2), plus a parameter gather
    in the compute dtype per extra pass at stage 3."""
    from zerojax.planner.settings import policy
    pol = policy(config)
    psi = model.total_params
    b = config.batch(devices)
    tokens = b.micro_batch_size * b.gradient_accumulation_steps * config.model.seq_len
    passes = 4 if config.model.remat else 3
    flops = 2 * passes * psi * tokens
    hbm = psi * pol.param.itemsize * passes * b.gradient_accumulation_steps + psi * 16
    comm = zero_comm_bytes(psi, stage, devices, (pol.comm or pol.accum).itemsize, pol.param.itemsize)
    return float(flops), float(hbm), comm


def zero_comm_bytes(psi: int, stage: int, devices: int, comm_itemsize: int, param_itemsize: int) -> float:
    """The ZeRO paper's per-device volume for Ψ parameters over `devices`: a gradient all-reduce
    (2 x Ψ(N-1)/N) at stage 0; a reduce-scatter and a gather of the updated parameters at stages
    1-2; one more parameter gather at stage 3 (forward and backward each gather)."""
    frac = (devices - 1) / devices
    per_param = 2 * comm_itemsize if stage == 0 else comm_itemsize + (2 if stage == 3 else 1) * param_itemsize
    return float(psi * frac * per_param)


def step_time(flops: float, hbm_bytes: float, comm_bytes: float, device: DeviceSpec, devices: int,
              devices_per_host: int, source: str) -> StepTime:
    """Times from per-device work: FLOPs / peak, bytes / HBM bandwidth, and collective bytes over
    the slowest link the data axis crosses (between hosts when it spans more than one)."""
    across = devices > devices_per_host
    link, bw = ("between hosts", device.inter) if across else ("within a host", device.intra)
    return StepTime(flops, hbm_bytes, comm_bytes, link, flops / device.flops, hbm_bytes / device.hbm,
                    comm_bytes / bw if devices > 1 else 0.0, source)


def scale_comm(comm_bytes: float, compiled_n: int, devices: int) -> float:
    """Ring collectives move (N-1)/N of their payload per device: rescale from the compiled size."""
    if compiled_n <= 1:
        return 0.0 if devices <= 1 else float("nan")
    return comm_bytes * ((devices - 1) / devices) / ((compiled_n - 1) / compiled_n)



def step_time_lines(config: Config, model: ModelShape, req: Request) -> list[str]:
    dev = req.device
    lines = [f"step time on {dev.name} x {req.devices} (peak {dev.flops / 1e12:.0f} TFLOP/s, "
             f"HBM {dev.hbm / 1e12:.2f} TB/s, "
             f"links {dev.intra / 1e9:.0f} GB/s within / {dev.inter / 1e9:.0f} GB/s between hosts):"]
    for stage in range(4):
        cfg = variant(config, Choice(stage))
        if model.gpt is not None and req.compiled:
            local = load_config(config, [f"zero_optimization.stage={stage}"])
            flops, hbm, comm, n = compiled_costs(local)
            comm = scale_comm(comm, n, req.devices)
            source = f"compiled on {n} local {jax.devices()[0].platform} devices"
        else:
            flops, hbm, comm = analytic_costs(cfg, model, stage, req.devices)
            b = cfg.batch(req.devices)
            tokens = b.micro_batch_size * b.gradient_accumulation_steps * cfg.model.seq_len
            source = (f"analytic: {8 if cfg.model.remat else 6} FLOPs/parameter/token x {tokens} tokens per device "
                      f"(micro-batch x accumulation x model.seq_len), ZeRO volumes")
        t = step_time(flops, hbm, comm, dev, req.devices, req.devices_per_host, source)
        lines.append(f"  stage {stage}: {t.seconds * 1e3:9.2f} ms (compute {t.compute_s * 1e3:.2f}, memory "
                     f"{t.memory_s * 1e3:.2f}, comm {t.comm_s * 1e3:.2f} ms {t.link}; overlap bound "
                     f"{t.bound * 1e3:.2f} ms) - {t.flops / 1e9:.2f} GFLOP, {t.hbm_bytes / 2**20:.1f} MiB accessed, "
                     f"{t.comm_bytes / 2**20:.1f} MiB sent per device; {source}")
    lines.append("  time = max(matmul FLOPs / peak, kernel bytes / HBM bandwidth) + collective bytes / link bandwidth "
                 "(collectives not overlapped); docs/estimate.md")
    return lines
