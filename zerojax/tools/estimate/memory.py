"""Plan-exact bytes: the real `zerojax.plan` for each ZeRO stage and offload choice on an abstract mesh.

`jax.sharding.AbstractMesh` gives the mesh's names and sizes without devices, so the plan of a cluster
of any size is made here and counted by its own `memory_report`: every leaf's shard shape in its dtype
and memory kind. What the layout replicates (small leaves, dimensions that do not divide) and what
offload moves to the host are counted as they will be. DeepSpeed's estimate of the same choice sits
beside it, and `recommend` picks the cheapest choice that fits.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax

from zerojax.config import Config, load_config
from zerojax.tools.estimate.deepspeed import deepspeed_zero2, deepspeed_zero3
from zerojax.tools.estimate.shapes import ModelShape

GIB = 2 ** 30


OFFLOADS = ("none", "cpu optimizer", "nvme optimizer", "cpu params", "nvme params")
NVME_PATH = "/local_nvme"  # what a recommendation names for nvme_path when the config gives none


@dataclasses.dataclass(frozen=True)
class Choice:
    """A ZeRO stage and an offload choice ("cpu params" offloads the optimizer too, as DeepSpeed's
    ZeRO-Infinity CPU setting does; "nvme params" puts both in NVMe files, its NVMe setting)."""
    stage: int
    offload: str = "none"

    def overrides(self, nvme_path: str | None = None) -> list[str]:
        opt = "nvme" if self.offload.startswith("nvme") else "cpu" if self.offload != "none" else "none"
        par = self.offload.split()[0] if self.offload.endswith("params") else "none"
        path = [f"zero_optimization.offload_optimizer.nvme_path={nvme_path or NVME_PATH}"] if opt == "nvme" else []
        if par == "nvme":
            path.append(f"zero_optimization.offload_param.nvme_path={nvme_path or NVME_PATH}")
        return [f"zero_optimization.stage={self.stage}", f"zero_optimization.offload_optimizer.device={opt}",
                *path, f"zero_optimization.offload_param.device={par}"]

    @property
    def label(self) -> str:
        return f"stage {self.stage}, offload {self.offload}"


# Cheapest first: more sharding costs communication (stage 3 gathers parameters once more), and
# offload costs host transfers and a host-side update on top, parameter offload most.
CHOICES: tuple[Choice, ...] = (
    Choice(0), Choice(1), Choice(2), Choice(3),
    Choice(1, "cpu optimizer"), Choice(2, "cpu optimizer"), Choice(3, "cpu optimizer"), Choice(3, "nvme optimizer"),
    Choice(3, "cpu params"), Choice(3, "nvme params"))


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of model state for one choice: per device in device memory, per host in host memory."""
    choice: Choice
    mode: str                 # "plan-exact" or "deepspeed"
    device_bytes: int
    host_bytes: int           # per host (DeepSpeed: per node)
    note: str = ""
    report: Any = None        # the plan's MemoryReport (plan-exact)
    nvme_bytes: int = 0       # per host, in NVMe swap files (offload_optimizer / offload_param device nvme)


def variant(config: Config, choice: Choice) -> Config:
    """`config` with the choice's stage and offload keys; the batch follows the micro-batch (and
    accumulation) so that any device count resolves; a config that gives only train_batch_size
    keeps it, and the batch triad says which device counts divide it."""
    free = ["train_batch_size=null"] if config.train_micro_batch_size_per_gpu is not None else []
    if choice.stage != 3 or choice.offload.endswith("params"):
        # ZeRO++ changes stage 3's parameter gathers only (hpZ: not with offloaded parameters); the
        # other choices are estimated without it, and a stage-3 row shows hpZ's secondary copy.
        free += ["zero_optimization.zero_hpz_partition_size=1", "zero_optimization.zero_quantized_weights=false",
                 "zero_optimization.zero_quantized_gradients=false"]
    return load_config(config, choice.overrides(config.zero_optimization.offload_optimizer.nvme_path) + free)


def abstract_mesh(devices: int, devices_per_host: int | None = None) -> jax.sharding.AbstractMesh:
    """An abstract mesh of `devices`: a hierarchical data axis (hosts x devices per host, as
    `mesh.data_outer` builds) when the devices span several hosts evenly, one flat axis otherwise.
    Byte counts are the same either way (a shard is split over both axes)."""
    from zerojax.core.mesh import DATA, HIERARCHICAL
    if devices_per_host and devices > devices_per_host and devices % devices_per_host == 0:
        return jax.sharding.AbstractMesh((devices // devices_per_host, devices_per_host), HIERARCHICAL)
    return jax.sharding.AbstractMesh((devices,), (DATA,))


def plan_exact(config: Config, model: ModelShape, devices: int, devices_per_host: int,
               choice: Choice) -> MemoryEstimate:
    """The plan's own per-device bytes (`Plan.report()`) on an abstract mesh of `devices`."""
    from zerojax.planner.plan import make_plan
    p = make_plan(variant(config, choice), abstract_mesh(devices, devices_per_host), model.abstract_params,
             layer_axes=model.layer_axes)
    rep = p.report()
    per_host = min(devices_per_host, devices)  # one process per device: each streams through its own buffers
    # Parameters on NVMe are on the device during the step (core.param_swap): whole, or a layer and the
    # next for the stacked layers read at use.
    return MemoryEstimate(choice, "plan-exact", rep.device_in_step,
                          (rep.host + rep.nvme_buffers + rep.param_buffers) * per_host,
                          report=rep, nvme_bytes=(rep.optimizer_nvme + rep.params_nvme) * per_host)


def deepspeed_estimate(model: ModelShape, devices: int, devices_per_host: int, choice: Choice,
                       zero_init: bool = True, additional_buffer_factor: float = 1.5) -> MemoryEstimate | None:
    """DeepSpeed's number for the choice: the ZeRO-2 estimator for stages 1 and 2 (its file covers
    both), the ZeRO-3 one for stage 3; None for stage 0, which DeepSpeed does not estimate."""
    per_node = min(devices_per_host, devices)
    nodes = math.ceil(devices / per_node)
    if choice.stage == 0 or choice.offload.startswith("nvme"):  # DeepSpeed's estimators take no NVMe argument
        return None
    if choice.stage in (1, 2):
        cpu, gpu = deepspeed_zero2(model.total_params, per_node, nodes, choice.offload != "none",
                                   additional_buffer_factor)
        note = "estimate_zero2_model_states_mem_needs"
    else:
        cpu, gpu, _ = deepspeed_zero3(model.total_params, model.largest_layer_params, per_node, nodes,
                                      choice.offload != "none", choice.offload == "cpu params", zero_init,
                                      additional_buffer_factor)
        note = f"estimate_zero3_model_states_mem_needs, zero_init={int(zero_init)}"
    return MemoryEstimate(choice, "deepspeed", gpu, cpu, note)


def recommend(estimates: Sequence[MemoryEstimate], device_memory: float, activations: int = 0,
              host_memory: float | None = None) -> MemoryEstimate | None:
    """The first estimate in `CHOICES` order (cheapest first) whose model state plus `activations`
    fits `device_memory` per device (and its host share `host_memory` per host, when given)."""
    by_choice = {e.choice: e for e in estimates}
    for choice in CHOICES:
        e = by_choice.get(choice)
        if e is None:
            continue
        if e.device_bytes + activations <= device_memory and (host_memory is None or e.host_bytes <= host_memory):
            return e
    return None



def size_unit(values: Sequence[float]) -> tuple[str, float]:
    """GiB for models whose largest number reaches 1 GiB, MiB below."""
    return ("GiB", GIB) if max(values, default=0) >= GIB else ("MiB", 2 ** 20)

