"""How the work is spread: the device `mesh`, the `pipeline` section and multi-process `distributed`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zerojax.config.fields import option


@dataclass(frozen=True)
class HybridEngineConfig:
    """DeepSpeed's hybrid engine (train and generate in one engine, for RLHF). zerojax's engine always
    generates on its training weights (`engine.generate`); these keys say how."""
    enabled: bool = option(False, "Accepted: engine.generate works on every engine whose model brings a decoder.")
    max_out_tokens: int = option(512, "Prompt plus new tokens one generate call may hold (the KV cache's length "
                                      "bound): a longer request is one error naming both numbers.", gt=0)
    inference_tp_size: int = option(1, "Tensor-parallel degree of generation: 1 (generation runs on the "
                                       "training layout; ZeRO-3 shards are gathered once per call).", ge=1)
    release_inference_cache: bool = option(False, "Accepted: the KV cache and the gathered weights live only "
                                                  "inside one generate call, so they are always released.")
    pin_parameters: bool = option(True, "Accepted: there is no separate inference copy of the weights to pin.")
    tp_gather_partition_size: int = option(8, "Accepted: weights are gathered once per call, whole.", ge=1)


@dataclass(frozen=True)
class PipelineConfig:
    """DeepSpeed's pipeline section; the stage count comes from mesh.stage."""
    stages: str = option("auto", "Accepted; set mesh.stage instead.")
    partition: str = option("best", "How train.py cuts the embedded GPT: parameters | uniform | type:REGEX "
                                    "('best' means parameters); see PipelineModule.partition_method.")
    seed_layers: bool = option(False, "Accepted, unused.")
    activation_checkpoint_interval: int = option(
        0, "Layers per rematerialized segment inside a stage's backward (0: none); a PipelineModule's "
           "own activation_checkpoint_interval wins.", ge=0)
    pipe_partitioned: bool = option(True, "Accepted, unused.")
    grad_partitioned: bool = option(True, "Accepted, unused.")
    schedule: str = option("1f1b", "Micro-batch schedule: 1f1b (DeepSpeed's TrainSchedule: at most S "
                                   "micro-batches in flight), gpipe, 1f1b_sync (a forward and a backward per "
                                   "tick in the steady state: no lockstep idling, up to 2S-1 in flight), or "
                                   "interleaved (1F1B over `chunks` model chunks per stage).",
                           choices=("1f1b", "gpipe", "1f1b_sync", "interleaved"))
    chunks: int = option(1, "Model chunks per stage; more than 1 needs schedule: interleaved.", gt=0)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh: a `data` axis (ZeRO shards over it; optionally data_outer x data_inner) and a `stage`
    axis (pipeline)."""
    data: Optional[int] = option(None, "Data-parallel size (default: all devices / stage).", gt=0)
    stage: int = option(1, "Pipeline stages (more than 1 needs a PipelineModule: "
                           "initialize(config, model=...)).", gt=0)
    data_outer: Optional[int] = option(None, "Split the data axis into data_outer (across hosts or slices: slow "
                                             "links) x data_inner (within one: fast links); ZeRO shards over "
                                             "both. With several processes or slices it must equal their "
                                             "number. null: one flat data axis.", gt=0)
    data_inner: Optional[int] = option(None, "Devices per data_outer group (default: data-parallel devices / "
                                             "data_outer); setting it alone also splits the data axis.", gt=0)
    cpu_devices: Optional[int] = option(8, "On a CPU-only machine, this many virtual devices for the job, "
                                           "split evenly over the processes of a multi-process run (set "
                                           "before JAX starts; null leaves JAX's default).", gt=0)


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process start-up through jax.distributed (see docs/distributed.md)."""
    coordinator_address: Optional[str] = option(
        None, "host:port of process 0 (default: ZEROJAX_COORDINATOR_ADDRESS, MASTER_ADDR:MASTER_PORT, "
              "or the cluster's).")
    num_processes: Optional[int] = option(None, "Number of processes (default: ZEROJAX_NUM_PROCESSES, "
                                                "WORLD_SIZE, or the cluster's).", gt=0)
    process_id: Optional[int] = option(None, "This process's id (default: ZEROJAX_PROCESS_ID, RANK, "
                                             "or the cluster's).", ge=0)
    join: str = option("auto", "auto: join when coordinates are given or a launcher is detected (zerojax "
                               "launch, SLURM srun, Open MPI mpirun, a Kubernetes indexed Job, a multi-host "
                               "Cloud TPU slice); always: call jax.distributed.initialize and let JAX detect "
                               "the rest; never: run as one process.", choices=("auto", "always", "never"))
    initialization_timeout: int = option(300, "Seconds to wait for every process to join.", gt=0)
    check_consistency: bool = option(False, "Debug: check at start-up that every process holds the same "
                                            "config and model structure (two small all-gathers).")
    hang_timeout: Optional[float] = option(
        300.0, "Seconds without progress (a step, save or evaluation finishing) after which train.py dumps "
               "every process's Python stack and fails (the first step, which compiles, gets 3x; "
               "ZEROJAX_HANG_TIMEOUT or zerojax launch --hang-timeout override it; null or 0: off).", ge=0)
