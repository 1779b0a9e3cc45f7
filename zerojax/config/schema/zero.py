"""The `zero_optimization` section (stages, offload, buckets) and `activation_checkpointing`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zerojax.config.fields import option, section


# Activation checkpointing policies (zerojax/remat.py).
POLICY_CHOICES = ("nothing", "dots_no_batch", "dots", "everything")


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Where the fp32 master weights and optimizer state live between steps (docs/offload.md)."""
    device: str = option("none", "none | cpu (host memory; ZeRO stages 1-3) | nvme (files under nvme_path, "
                                 "streamed through buffer_count host buffers: ZeRO-Infinity; stages 1-3, "
                                 "elementwise optimizers).", choices=("none", "cpu", "nvme"))
    nvme_path: Optional[str] = option(None, "device nvme: a folder on a local disk; each run works in a fresh "
                                            "zerojax-swap-* subfolder, removed when it ends.")
    pin_memory: bool = option(True, "Pinned host memory (memory kind pinned_host; false: unpinned_host).")
    buffer_count: int = option(4, "device nvme: host buffers of sub_group_size fp32 elements the state streams "
                                  "through; at least the arrays of one tile (parameter, gradient and the "
                                  "optimizer's moments: 4 for Adam).", gt=0)
    pipeline_read: bool = option(False, "device nvme: read the next tile while this one updates (needs "
                                        "buffer_count for two tiles).")
    pipeline_write: bool = option(False, "device nvme: write a tile back while the next ones update.")
    fast_init: bool = option(False, "Accepted, no effect: the state is written to the files once at start.")
    ratio: float = option(1.0, "Fraction of the optimizer step run on the host (only 1.0 is supported).",
                          ge=0, le=1)
    compute: str = option("auto", "Where the update runs with device: cpu. host: on the host, next to the "
                                  "state (DeepSpeed's ZeRO-Offload; elementwise optimizers); device: the "
                                  "state is brought to the device for the update; auto: host where the "
                                  "backend supports it, else device. device nvme always updates on the host.",
                          choices=("auto", "host", "device"))


@dataclass(frozen=True)
class OffloadParamConfig:
    """Where stage-3 parameters live between uses (docs/offload.md)."""
    device: str = option("none", "none | cpu (host memory, each layer brought in where it is gathered; "
                                 "stage 3) | nvme (files under nvme_path between steps, streamed through "
                                 "buffer_count host buffers; on the device during the step; stage 3).",
                         choices=("none", "cpu", "nvme"))
    nvme_path: Optional[str] = option(None, "device nvme: a folder on a local disk; each run works in a fresh "
                                            "zerojax-swap-* subfolder, removed when it ends.")
    pin_memory: bool = option(True, "device cpu: pinned host memory (memory kind pinned_host; false: "
                                    "unpinned_host).")
    buffer_count: int = option(5, "device nvme: host buffers the partitions stream through (read ahead, "
                                  "written behind).", gt=0)
    buffer_size: int = option(100_000_000, "device nvme: elements per buffer (compute dtype); a larger "
                                           "partition streams through in pieces.", gt=0)
    max_in_cpu: int = option(1_000_000_000, "device nvme: elements per device kept in host memory instead of "
                                            "files (the first partitions, leaf order), as DeepSpeed keeps them.",
                             ge=0)


@dataclass(frozen=True)
class AioConfig:
    """DeepSpeed's asynchronous I/O settings for the NVMe tier (docs/offload.md)."""
    block_size: int = option(1_048_576, "libaio's request size; no effect: a tile is one read per array.", gt=0)
    queue_depth: int = option(8, "libaio's queue depth; no effect: thread_count reads are in flight.", gt=0)
    thread_count: int = option(1, "Threads reading and writing the swap files in parallel.", gt=0)
    single_submit: bool = option(False, "libaio's submission mode; no effect.")
    overlap_events: bool = option(True, "libaio's overlapped submission; no effect (the threads overlap).")
    use_gds: bool = option(False, "GPUDirect Storage; refused when true (reads go through host buffers).")


_BUCKET_DOC = "Accepted for compatibility; XLA schedules collectives itself, so buckets have no effect."


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO: which of optimizer state, gradients and parameters are partitioned over `data`."""
    stage: int = option(0, "0: replicate all; 1: partition optimizer state; 2: + gradients; "
                           "3: + parameters.", choices=(0, 1, 2, 3))
    contiguous_gradients: bool = option(True, _BUCKET_DOC)
    reduce_scatter: bool = option(
        True, "Stages 1-3 divide gradients by the data-parallel size before the sum (DeepSpeed's reduce-"
              "scatter path); false: prescale_gradients / gradient_predivide_factor decide, as in its "
              "all-reduce path. The collective is a reduce-scatter either way.")
    reduce_bucket_size: int = option(500_000_000, _BUCKET_DOC, ge=0)
    allgather_partitions: bool = option(True, _BUCKET_DOC)
    allgather_bucket_size: int = option(500_000_000, _BUCKET_DOC, ge=0)
    overlap_comm: Optional[bool] = option(
        None, "Default: true for stage 3. Stage 3: a scanned stack of layers gathers layer i+1 while "
              "layer i computes (forward and backward); otherwise XLA overlaps on its own.")
    load_from_fp32_weights: bool = option(True, "Restore master weights from the fp32 copy.")
    elastic_checkpoint: bool = option(False, "Accepted; every checkpoint restores onto any mesh.")
    offload_optimizer: OffloadOptimizerConfig = section(OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = section(OffloadParamConfig)
    cpu_offload: Optional[bool] = option(None, "Deprecated: true means offload_optimizer.device=cpu.")
    cpu_offload_param: Optional[bool] = option(None, "Deprecated: true means offload_param.device=cpu.")
    cpu_offload_use_pin_memory: Optional[bool] = option(
        None, "Deprecated: true means pin_memory in offload_param / offload_optimizer.")
    sub_group_size: int = option(1_000_000_000, _BUCKET_DOC, ge=0)
    stage3_param_persistence_threshold: int = option(
        100_000, "Stage 3: parameters with fewer elements stay replicated.", ge=0,
        aliases=("param_persistence_threshold",))
    stage3_prefetch_bucket_size: int = option(
        50_000_000, "Stage 3 with overlap_comm: a layer is gathered ahead only if its whole size (elements) "
                    "fits; 0 turns prefetching off.", ge=0, aliases=("prefetch_bucket_size",))
    stage3_max_live_parameters: int = option(
        1_000_000_000, "Stage 3: prefetching (two layers whole at once) only when two layers' elements fit; "
                       "otherwise one layer is gathered at a time.", ge=0, aliases=("max_live_parameters",))
    stage3_max_reuse_distance: int = option(1_000_000_000, _BUCKET_DOC, ge=0, aliases=("max_reuse_distance",))
    stage3_gather_16bit_weights_on_model_save: bool = option(
        False, "Accepted; saved parameters are always whole.",
        aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"))
    round_robin_gradients: bool = option(False, _BUCKET_DOC)
    ignore_unused_parameters: bool = option(
        True, "Unused parameters get zero gradients; false (DeepSpeed: an error for a parameter without a "
              "gradient) is refused.")
    zero_hpz_partition_size: int = option(
        1, "ZeRO++ hpZ (stage 3): devices of one host sharing the secondary parameter partition, the mesh's "
           "data_inner x expert x sequence (data_inner alone without those axes); forward/backward gathers "
           "stay within that group. 1 disables.", gt=0)
    zero_quantized_weights: bool = option(
        False, "ZeRO++ qwZ (stage 3): parameter all-gathers send int8 blocks with fp32 scales.")
    zero_quantized_gradients: bool = option(
        False, "ZeRO++ qgZ (stage 3): gradient reduce-scatters of gathered parameters are one int4 all-to-all "
               "with fp32 scales, summed in fp32.")
    mics_shard_size: int = option(-1, "MiCS (not supported; -1 disables).")
    save_muon_momentum_buffer_in_memory: bool = option(
        False, "Muon at stage 3 with NVMe offload: keep the momentum in memory. Accepted; NVMe offload is "
               "refused, so it always is.", int_bool=True)


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """Activation checkpointing (rematerialization) of each scanned layer: what its backward pass keeps."""
    partition_activations: bool = option(
        False, "With a tensor axis (mesh.tensor > 1): what each rematerialized layer keeps for its backward "
               "pass (its input, which tensor devices hold in copies) is split over the tensor axis and "
               "all-gathered where the layer runs, as DeepSpeed and Megatron partition activations. "
               "Without one it has no effect: activations are already split over the data axis.")
    cpu_checkpointing: bool = option(
        False, "Keep what the policy saves (at least each layer's input) in host memory (pinned_host) "
               "instead of device memory; implies policy nothing when policy is null.")
    contiguous_memory_optimization: bool = option(False, "Accepted; XLA allocates buffers at compile time.")
    number_checkpoints: Optional[int] = option(
        None, "Accepted; it sized DeepSpeed's contiguous buffers, which XLA does not need.")
    synchronize_checkpoint_boundary: bool = option(False, "Accepted; the step is one compiled program.")
    profile: bool = option(False, "Accepted; see the compiled step's memory analysis and timings instead.")
    policy: Optional[str] = option(
        None, "zerojax: what each checkpointed layer keeps for its backward pass. nothing: its input only "
              "(DeepSpeed's checkpoint); dots_no_batch: also matmul outputs without batch dimensions; dots: "
              "also every matmul output; everything: all (no recomputation). null: the model decides "
              "(model.remat for the embedded GPT; a user's loss as written). Applies to the embedded GPT's "
              "blocks and to every lax.scan body of a user's loss.", choices=POLICY_CHOICES)
