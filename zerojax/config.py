"""DeepSpeed-compatible configuration as frozen dataclasses.

The schema *is* the documentation: every option carries its default and a short doc string in the
dataclass field metadata, `docs/config.md` is generated from it, and the loader walks it to reject
unknown keys ("did you mean ..."), wrong types and impossible values with the dotted key path.
DeepSpeed's own keys keep DeepSpeed's code defaults; zerojax adds `mesh`, `model`, `data`, `run`,
`checkpoint`, `distributed` and `kernels`.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import operator
import os
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from zerojax.errors import ConfigError

__all__ = ["Config", "ConfigError", "ConfigWarning", "BatchSize", "load_config", "resolve_batch", "unsupported_features"]

_MISSING = dataclasses.MISSING


class ConfigWarning(UserWarning):
    """A key that loads but means nothing here (DeepSpeed ignores it too, or it is not built)."""


def _warn(sources: dict[str, str], path: str, message: str, label: str) -> None:
    """One warning line per ignored key, and its source label for `config explain`."""
    sources[path] = label
    warnings.warn(f"{path}: {message}", ConfigWarning, stacklevel=4)

# DeepSpeed's batch triad: two of them fix the third for a given data-parallel size.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def option(default: Any = _MISSING, doc: str = "", *, choices: Sequence[Any] | None = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None,
           aliases: Sequence[str] = (), int_bool: bool = False, factory: Any = None) -> Any:
    """A schema field: default, doc string and the checks the loader applies."""
    meta = dict(doc=doc, choices=tuple(choices) if choices else None, ge=ge, gt=gt, le=le,
                aliases=tuple(aliases), int_bool=int_bool)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type) -> Any:
    """A nested section; its doc is the first line of the class docstring."""
    return field(default_factory=cls, metadata=dict(doc=(cls.__doc__ or "").strip().splitlines()[0]))


# ---------------------------------------------------------------------------------------------
# Activation checkpointing policies (zerojax/remat.py).
POLICY_CHOICES = ("nothing", "dots_no_batch", "dots", "everything")


# ---------------------------------------------------------------------------------------------
# Optimizers (DeepSpeed "optimizer": {"type", "params"}); one params class per type.

@dataclass(frozen=True)
class AdamParams:
    """Adam / AdamW (DeepSpeed FusedAdam; `torch_adam` selects torch's implementation)."""
    lr: float = option(1e-3, "Learning rate; the peak value of any schedule.", ge=0)
    betas: tuple[float, float] = option((0.9, 0.999), "Exponential decay rates (beta1, beta2).")
    eps: float = option(1e-8, "Added to the denominator.", gt=0)
    weight_decay: Optional[float] = option(
        None, "Default 0.0 (DeepSpeed FusedAdam); 0.01 with torch_adam (torch.optim.AdamW).", ge=0)
    adam_w_mode: bool = option(True, "True: decoupled weight decay (AdamW). False: L2 added to the "
                                     "gradient (classic Adam). Accepts 0/1.", int_bool=True)
    torch_adam: bool = option(False, "Implementation selector; changes only the weight_decay default.",
                              int_bool=True)
    fused: Optional[bool] = option(None, "Implementation selector; XLA fuses the update either way.",
                                   int_bool=True)
    bias_correction: bool = option(True, "Apply Adam's bias correction.", int_bool=True)
    amsgrad: bool = option(False, "Not supported (DeepSpeed's fused kernels reject it too).")


@dataclass(frozen=True)
class LambParams:
    """LAMB (DeepSpeed FusedLamb): Adam direction scaled by a clamped trust ratio."""
    lr: float = option(1e-3, "Learning rate.", ge=0)
    betas: tuple[float, float] = option((0.9, 0.999), "Exponential decay rates (beta1, beta2).")
    eps: float = option(1e-8, "Added to the denominator.", gt=0)
    weight_decay: float = option(0.0, "Decoupled weight decay inside the trust-ratio update.", ge=0)
    bias_correction: bool = option(True, "Apply Adam's bias correction.", int_bool=True)
    max_coeff: float = option(10.0, "Upper clamp of the trust ratio.", gt=0)
    min_coeff: float = option(0.01, "Lower clamp of the trust ratio.", ge=0)
    max_grad_norm: float = option(0.0, "Must be 0 (DeepSpeed rejects it too); use gradient_clipping.", ge=0)


@dataclass(frozen=True)
class AdagradParams:
    """Adagrad (DeepSpeed CPU Adagrad / torch.optim.Adagrad semantics)."""
    lr: float = option(1e-2, "Learning rate.", ge=0)
    eps: float = option(1e-10, "Added to the denominator.", gt=0)
    weight_decay: float = option(0.0, "L2 penalty added to the gradient.", ge=0)
    initial_accumulator_value: float = option(0.0, "Starting value of the squared-gradient sum.", ge=0)


@dataclass(frozen=True)
class LionParams:
    """Lion (DeepSpeed FusedLion)."""
    lr: float = option(1e-4, "Learning rate.", ge=0)
    betas: tuple[float, float] = option((0.9, 0.99), "Interpolation (beta1) and momentum (beta2) rates.")
    weight_decay: float = option(0.0, "Decoupled weight decay.", ge=0)


@dataclass(frozen=True)
class SGDParams:
    """SGD with momentum (torch.optim.SGD semantics)."""
    lr: float = option(1e-3, "Learning rate.", ge=0)
    momentum: float = option(0.0, "Momentum factor.", ge=0)
    dampening: float = option(0.0, "Dampening for momentum.", ge=0)
    weight_decay: float = option(0.0, "L2 penalty added to the gradient.", ge=0)
    nesterov: bool = option(False, "Nesterov momentum.", int_bool=True)


OPTIMIZER_PARAMS: dict[str, type] = {
    "adam": AdamParams, "adamw": AdamParams, "lamb": LambParams, "adagrad": AdagradParams,
    "lion": LionParams, "sgd": SGDParams,
}
# DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS; anything else needs zero_allow_untested_optimizer.
ZERO_TESTED_OPTIMIZERS = frozenset({"adam", "adamw", "lamb", "adagrad", "lion"})
ONE_BIT_OPTIMIZERS = frozenset({"onebitadam", "zerooneadam", "onebitlamb"})


@dataclass(frozen=True)
class ParamGroup:
    """One parameter group (DeepSpeed/torch param groups by name): its lr multiplier and weight decay."""
    match: tuple[str, ...] = ()
    lr_scale: float = 1.0
    weight_decay: Optional[float] = None


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer: {"type": ..., "params": {...}} as in DeepSpeed, with zerojax's parameter groups."""
    type: str = option("adam", "One of " + ", ".join(sorted(OPTIMIZER_PARAMS)) + " (case-insensitive).")
    params: Any = option(factory=AdamParams, doc="Keys depend on type; see the tables below.")
    no_decay: tuple[str, ...] = option((), "Parameters without weight decay, by name pattern (zerojax key): a "
                                           "word matches a part of the dotted name (`bias`; `norm` also "
                                           "matches `ln`, `ln1`, `ln_f`; `embed` also matches `pos`, `wte`, "
                                           "`wpe`), a pattern with `*` matches the whole name "
                                           "(`blocks.*.bias`). [bias, norm, embed] is Hugging Face's and "
                                           "Megatron's choice; empty: everything decays, as in DeepSpeed.")
    param_groups: tuple[ParamGroup, ...] = option((), "Parameter groups, first match wins (zerojax key): a "
                                                      "list of {match: pattern or list, lr_scale: 1.0, "
                                                      "weight_decay: null}; lr_scale multiplies the "
                                                      "scheduled lr, a weight_decay replaces params."
                                                      "weight_decay (and no_decay) for the group.")


# ---------------------------------------------------------------------------------------------
# LR schedulers (DeepSpeed "scheduler": {"type", "params"}).

_WARMUP_TYPES = ("log", "linear")
_WARMUP_STEPS_DOC = ("Warmup length in optimizer steps; 1 means 2 (DeepSpeed clamps it to >= 2); 0 is "
                     "rejected, as DeepSpeed rejects it.")


@dataclass(frozen=True)
class WarmupLRParams:
    """WarmupLR: warm up from warmup_min_lr to warmup_max_lr, then hold."""
    warmup_min_lr: float = option(0.0, "Learning rate at the start of warmup.", ge=0)
    warmup_max_lr: Optional[float] = option(
        None, "Learning rate after warmup (default: optimizer lr; 0.001 for WarmupDecayLR, as in DeepSpeed).",
        ge=0)
    warmup_num_steps: int = option(1000, _WARMUP_STEPS_DOC, gt=0)
    warmup_type: str = option("log", "Warmup curve.", choices=_WARMUP_TYPES)
    last_batch_iteration: int = option(-1, "Position to start from (-1: a new run).", ge=-1)


@dataclass(frozen=True)
class WarmupDecayLRParams(WarmupLRParams):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""
    total_num_steps: Optional[int] = option(None, "Required: step at which the lr reaches 0.", gt=0)


@dataclass(frozen=True)
class WarmupCosineLRParams:
    """WarmupCosineLR: ratios of the optimizer lr; warmup then cosine decay."""
    total_num_steps: Optional[int] = option(None, "Required: length of the whole schedule.", gt=0)
    warmup_min_ratio: float = option(0.0, "lr ratio at the start of warmup.", ge=0)
    warmup_num_steps: int = option(1000, _WARMUP_STEPS_DOC, gt=0)
    cos_min_ratio: float = option(1e-4, "lr ratio at the end of the cosine.", ge=0)
    warmup_type: str = option("log", "Warmup curve.", choices=_WARMUP_TYPES)
    last_batch_iteration: int = option(-1, "Position to start from (-1: a new run).", ge=-1)


@dataclass(frozen=True)
class OneCycleParams:
    """OneCycle: triangular lr (and momentum) cycle, then decay."""
    cycle_min_lr: Optional[float] = option(None, "Required: lr at the cycle's ends.", ge=0)
    cycle_max_lr: Optional[float] = option(None, "Required: lr at the cycle's peak.", ge=0)
    decay_lr_rate: float = option(0.0, "lr decay rate after the cycle.", ge=0)
    cycle_first_step_size: int = option(2000, "Steps in the rising half.", gt=0)
    cycle_second_step_size: Optional[int] = option(None, "Steps in the falling half (default: first).", gt=0)
    cycle_first_stair_count: int = option(0, "Stairs in the rising half (0: smooth).", ge=0)
    cycle_second_stair_count: Optional[int] = option(None, "Stairs in the falling half.", ge=0)
    decay_step_size: int = option(0, "Steps per decay interval after the cycle.", ge=0)
    cycle_momentum: bool = option(True, "Cycle beta1 between cycle_max_mom and cycle_min_mom.")
    cycle_min_mom: float = option(0.8, "beta1 at the cycle's peak lr.", ge=0, le=1)
    cycle_max_mom: float = option(0.9, "beta1 at the cycle's ends.", ge=0, le=1)
    decay_mom_rate: float = option(0.0, "Momentum decay rate after the cycle.", ge=0)
    last_batch_iteration: int = option(-1, "Position to start from (-1: a new run).", ge=-1)


@dataclass(frozen=True)
class LRRangeTestParams:
    """LRRangeTest: lr grows from lr_range_test_min_lr, to find a good lr."""
    lr_range_test_min_lr: float = option(1e-3, "Starting lr.", ge=0)
    lr_range_test_step_size: int = option(2000, "Steps per interval.", gt=0)
    lr_range_test_step_rate: float = option(1.0, "Growth per interval.", ge=0)
    lr_range_test_staircase: bool = option(False, "Grow in stairs instead of continuously.")
    last_batch_iteration: int = option(-1, "Position to start from (-1: a new run).", ge=-1)


SCHEDULER_PARAMS: dict[str, type] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams, "OneCycle": OneCycleParams, "LRRangeTest": LRRangeTestParams,
}
REQUIRED_SCHEDULER_PARAMS = {
    "WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
}


@dataclass(frozen=True)
class SchedulerConfig:
    """LR scheduler: {"type": ..., "params": {...}}; stepped once per applied optimizer step."""
    type: str = option("WarmupLR", "One of " + ", ".join(SCHEDULER_PARAMS) + ".")
    params: Any = option(factory=WarmupLRParams, doc="Keys depend on type; see the tables below.")


# ---------------------------------------------------------------------------------------------
# Precision, ZeRO, monitors.

@dataclass(frozen=True)
class FP16Config:
    """fp16 mixed precision with DeepSpeed's dynamic loss scaler."""
    enabled: bool = option(False, "Train with fp16 compute, fp32 master weights and optimizer state, "
                                  "and loss scaling.")
    auto_cast: bool = option(False, "Cast inputs to fp16 (accepted; the model decides its dtypes).")
    loss_scale: float = option(0.0, "0: dynamic loss scaling; > 0: this static scale.", ge=0)
    initial_scale_power: int = option(16, "Dynamic scaling starts at 2**initial_scale_power.", ge=0)
    loss_scale_window: int = option(1000, "Clean steps before the scale doubles.", gt=0)
    hysteresis: int = option(2, "Overflows tolerated before the scale halves.", gt=0)
    consecutive_hysteresis: bool = option(False, "Refill hysteresis on every clean step.")
    min_loss_scale: float = option(1.0, "Smallest scale; an overflow there is an error.", gt=0)
    fp16_master_weights_and_grads: bool = option(False, "Not supported: master weights stay fp32.")


@dataclass(frozen=True)
class BF16Config:
    """bf16 mixed precision: bf16 params and compute, fp32 master weights and optimizer state."""
    enabled: bool = option(False, "Train with bf16 compute and fp32 master weights.")
    check_grad_overflow: bool = option(False, "Skip steps whose gradients are not finite, as fp16 does "
                                              "(no loss scale).")
    immediate_grad_update: bool = option(True, "Accepted; gradients are always applied at the boundary.")


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Where the fp32 master weights and optimizer state live between steps (docs/offload.md)."""
    device: str = option("none", "none | cpu (host memory; ZeRO stages 1-3) | nvme (not supported; use cpu).",
                         choices=("none", "cpu", "nvme"))
    nvme_path: Optional[str] = option(None, "For device nvme (not supported).")
    pin_memory: bool = option(True, "Pinned host memory (memory kind pinned_host; false: unpinned_host).")
    buffer_count: int = option(4, "NVMe buffers (accepted, unused).", gt=0)
    fast_init: bool = option(False, "Accepted, unused.")
    ratio: float = option(1.0, "Fraction of the optimizer step run on the host (only 1.0 is supported).",
                          ge=0, le=1)
    compute: str = option("auto", "Where the update runs with device: cpu. host: on the host, next to the "
                                  "state (DeepSpeed's ZeRO-Offload; elementwise optimizers); device: the "
                                  "state is brought to the device for the update; auto: host where the "
                                  "backend supports it, else device.", choices=("auto", "host", "device"))


@dataclass(frozen=True)
class OffloadParamConfig:
    """Where stage-3 parameters live between uses (docs/offload.md)."""
    device: str = option("none", "none | cpu (host memory, each layer brought in where it is gathered; "
                                 "stage 3) | nvme (not supported; use cpu).", choices=("none", "cpu", "nvme"))
    nvme_path: Optional[str] = option(None, "For device nvme (not supported).")
    pin_memory: bool = option(True, "Pinned host memory (memory kind pinned_host; false: unpinned_host).")
    buffer_count: int = option(5, "NVMe buffers (accepted, unused).", gt=0)
    buffer_size: int = option(100_000_000, "NVMe buffer size (accepted, unused).", gt=0)
    max_in_cpu: int = option(1_000_000_000, "Accepted, unused.", ge=0)


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
        1, "ZeRO++ hpZ (stage 3): devices in the secondary parameter partition, the mesh's data_inner size; "
           "forward/backward gathers stay within that group. 1 disables.", gt=0)
    zero_quantized_weights: bool = option(
        False, "ZeRO++ qwZ (stage 3): parameter all-gathers send int8 blocks with fp32 scales.")
    zero_quantized_gradients: bool = option(
        False, "ZeRO++ qgZ (stage 3): gradient reduce-scatters of gathered parameters are one int4 all-to-all "
               "with fp32 scales, summed in fp32.")
    mics_shard_size: int = option(-1, "MiCS (not supported; -1 disables).")


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """Activation checkpointing (rematerialization) of each scanned layer: what its backward pass keeps."""
    partition_activations: bool = option(
        False, "Accepted; activations are already split over the data axis (each device holds its own rows).")
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


@dataclass(frozen=True)
class MonitorConfig:
    """A metrics writer (TensorBoard or CSV)."""
    enabled: bool = option(False, "Write Train/Samples/* events.")
    output_path: str = option("", "Directory (default: the run's output_dir).")
    job_name: str = option("DeepSpeedJobName", "Sub-directory per job.")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (not supported: it needs a network; use tensorboard or csv_monitor)."""
    enabled: bool = option(False, "Log to wandb (not supported).")
    group: Optional[str] = option(None, "wandb group.")
    team: Optional[str] = option(None, "wandb entity.")
    project: str = option("deepspeed", "wandb project.")


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """FLOPs profiler: FLOPs from the compiled step, latency and TFLOPS."""
    enabled: bool = option(False, "Print the profile once at profile_step.")
    recompute_fwd_factor: float = option(0.0, "Accepted, unused.")
    profile_step: int = option(1, "Step at which to profile.", ge=1)
    module_depth: int = option(-1, "Accepted, unused.")
    top_modules: int = option(1, "Accepted, unused.")
    detailed: bool = option(True, "Accepted, unused.")
    output_file: Optional[str] = option(None, "Write the profile here instead of stdout.")


@dataclass(frozen=True)
class CommsLoggerConfig:
    """DeepSpeed's communication logger: the train step's collectives, counted from its compiled HLO.

    Count and bytes per device per step; no per-op latency, as they run inside one program."""
    enabled: bool = option(False, "Print the step's collectives at the first print step and totals at "
                                  "the end of the run.")
    verbose: bool = option(False, "Also list every collective (kind, dtype, bytes, group, runs per step).")
    prof_all: bool = option(True, "Report every collective; false: only those named in prof_ops.")
    debug: bool = option(False, "With verbose: also name the HLO computation each collective sits in.")
    prof_ops: tuple[str, ...] = option((), "With prof_all false: the collectives to report (all_reduce, "
                                 "reduce_scatter, all_gather, all_to_all, collective_permute; DeepSpeed's "
                                 "torch names such as all_gather_into_tensor are accepted).")


@dataclass(frozen=True)
class DataTypesConfig:
    """Data types of intermediate buffers."""
    grad_accum_dtype: Optional[str] = option(
        None, "Gradient accumulator dtype (default: the parameters' compute dtype).",
        choices=("fp32", "fp16", "bf16"))


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
class CheckpointConfig:
    """Checkpointing: DeepSpeed's keys plus retention and async saving."""
    tag_validation: str = option("Warn", "A tag passed to save_checkpoint must be the same on every process: "
                                         "Ignore | Warn | Fail.", choices=("Ignore", "Warn", "Fail"))
    load_universal: bool = option(False, "Accepted; every checkpoint is universal.")
    use_node_local_storage: bool = option(False, "Accepted, unused.")
    async_save: bool = option(False, "Write checkpoints in the background (a save returns before it is "
                                     "durable; finished at exit).")
    max_to_keep: Optional[int] = option(None, "Keep at most this many checkpoints (None: all).", gt=0)
    keep_every_n_steps: Optional[int] = option(None, "Also keep every checkpoint at a multiple of this step.",
                                               gt=0)


# ---------------------------------------------------------------------------------------------
# zerojax's own sections.

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
class ModelConfig:
    """The model train.py builds: the embedded byte-level GPT, or a Llama-family model."""
    name: str = option("gpt", "Model family: gpt (learned positions, LayerNorm, GELU; GPT-2's shape) or llama "
                              "(RMSNorm, rotary positions, SwiGLU, grouped-query attention).",
                       choices=("gpt", "llama"))
    vocab_size: int = option(256, "Vocabulary (256: bytes).", gt=0)
    seq_len: int = option(128, "Context length in tokens.", gt=0)
    d_model: int = option(128, "Width.", gt=0)
    n_layers: int = option(4, "Transformer blocks (stacked and scanned).", gt=0)
    n_heads: int = option(4, "Attention heads; must divide d_model.", gt=0)
    d_ff: Optional[int] = option(None, "MLP width (default: 4 * d_model for gpt; for llama 8/3 * d_model "
                                       "rounded up to a multiple of 64).", gt=0)
    remat: bool = option(True, "Rematerialize each block in the backward pass (keeping its input only); "
                                "activation_checkpointing.policy or cpu_checkpointing, when set, decide instead.")
    init_std: float = option(0.02, "Std of the normal initializer.", gt=0)
    n_kv_heads: Optional[int] = option(None, "llama: key/value heads of grouped-query attention; must divide "
                                             "n_heads (default: n_heads, plain multi-head attention).", gt=0)
    rope_theta: float = option(10000.0, "llama: base of the rotary position embedding frequencies.", gt=0)
    norm_eps: Optional[float] = option(None, "Epsilon of the norms (default: 1e-6 for gpt, 1e-5 for llama; "
                                             "GPT-2 uses 1e-5).", gt=0)
    tie_embeddings: bool = option(False, "llama: the LM head is the transposed token embedding (no head "
                                         "parameter).")
    hf_checkpoint: Optional[str] = option(
        None, "A local Hugging Face transformers checkpoint folder (config.json + safetensors, sharded or "
              "not; Llama-family or GPT-2) to start from: its weights are read straight into the plan's "
              "shards, and model keys not given are taken from its config.json.")


@dataclass(frozen=True)
class DataConfig:
    """Training data: the embedded corpus (Python's standard library source), a text or JSONL file, or a token file."""
    source: str = option("stdlib", "stdlib: the embedded corpus, as bytes. file: a text file (bytes, or tokens "
                                   "with data.tokenizer). jsonl: one JSON document a line, tokenized with "
                                   "data.tokenizer. tokens: a flat array of token ids (nanoGPT/Megatron .bin), "
                                   "memory-mapped. Default with data.path: jsonl for *.jsonl, tokens for *.bin, "
                                   "else file.", choices=("stdlib", "file", "jsonl", "tokens"))
    path: Optional[str] = option(None, "The file to train on (implies data.source, see there).")
    max_bytes: int = option(4_000_000, "Read at most this many bytes of a text corpus (stdlib, file, jsonl).",
                            gt=0)
    val_fraction: float = option(0.05, "Fraction held out for validation (the end of the token stream).",
                                 gt=0, le=0.5)
    seed: int = option(0, "Seed of the batch order.")
    dtype: str = option("uint16", "Element type of a data.source: tokens file (uint16 for vocabularies up to "
                                  "65536, else uint32).", choices=("uint16", "uint32"))
    tokenizer: Optional[str] = option(None, "A Hugging Face `tokenizers` tokenizer.json that tokenizes text "
                                            "and JSONL files (needs `pip install zerojax[tokenizers]`).")
    text_key: str = option("text", "The field of each JSONL line that holds the document's text.")
    eos_id: Optional[int] = option(None, "Token id that ends each document: appended after every tokenized "
                                         "document, and where the loss stops (default: the tokenizer's "
                                         "end-of-text token; none for a tokens file: give it to mask its "
                                         "document boundaries).", ge=0)
    mask_boundaries: bool = option(True, "Packed windows: no loss for predicting a document's first token "
                                         "from the previous document's end (needs an eos_id).")


@dataclass(frozen=True)
class RunConfig:
    """The training job run by train.py."""
    steps: int = option(200, "Optimizer steps to run.", gt=0)
    output_dir: str = option("runs/zerojax", "Where metrics.jsonl and config.json are written.")
    seed: int = option(0, "Seed of the parameter initialization.")
    eval_batches: int = option(4, "Validation batches evaluated at the end.", ge=0)
    progress: bool = option(True, "Show a progress bar.")
    log_every: Optional[int] = option(None, "Steps between metrics lines (default: steps_per_print).", gt=0)
    checkpoint_dir: Optional[str] = option(
        None, "Where checkpoints go (default: <output_dir>/checkpoints of this run).")
    save_every: Optional[int] = option(None, "Steps between checkpoints (a final one is always saved; "
                                             "null: only the final one).", gt=0)
    non_finite: str = option("stop", "A non-finite loss or gradient norm in a bf16/fp32 run. stop: the run "
                                     "stops when the metrics are next fetched (print steps, saves), naming the "
                                     "step and the first non-finite gradients, saves nothing past it and exits 1. "
                                     "skip_step: the step is skipped as fp16 skips overflows (sets "
                                     "bf16.check_grad_overflow); the run stops only if the parameters themselves "
                                     "turn non-finite.", choices=("stop", "skip_step"))
    signal_save_seconds: int = option(120, "On SIGINT, SIGTERM or SIGUSR1: at most this many seconds to save a "
                                           "checkpoint before the run exits (130, 143, 138).", gt=0)
    sample_tokens: int = option(48, "Tokens of text generated from the trained model and printed at the end of "
                                    "the run (one process; the embedded GPT or the Llama); 0: none. `zerojax sample` makes "
                                    "more.", ge=0)


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


@dataclass(frozen=True)
class Config:
    """A resolved zerojax / DeepSpeed configuration."""
    train_batch_size: Optional[int] = option(None, "Global batch = micro * accumulation * data-parallel size.",
                                             gt=0)
    train_micro_batch_size_per_gpu: Optional[int] = option(None, "Rows per data shard per micro-step.", gt=0)
    gradient_accumulation_steps: Optional[int] = option(None, "Micro-steps per optimizer step.", gt=0)
    optimizer: Optional[OptimizerConfig] = option(
        None, "No optimizer section: the optimizer passed in code (initialize(optimizer=...) or "
              "plan(optimizer=...)), as DeepSpeed uses the one passed to deepspeed.initialize; with neither, "
              "an error.")
    scheduler: Optional[SchedulerConfig] = option(None, "No scheduler: constant optimizer lr.")
    gradient_clipping: float = option(1.0, "Clip the global L2 gradient norm to this (0 disables).", ge=0)
    fp16: FP16Config = section(FP16Config)
    bf16: BF16Config = option(factory=BF16Config, doc="bf16 mixed precision.", aliases=("bfloat16",))
    zero_optimization: ZeroConfig = section(ZeroConfig)
    zero_allow_untested_optimizer: bool = option(False, "Allow optimizers outside DeepSpeed's ZeRO list.")
    zero_force_ds_cpu_optimizer: bool = option(True, "Accepted; the offload path has one optimizer.")
    activation_checkpointing: ActivationCheckpointingConfig = section(ActivationCheckpointingConfig)
    data_types: DataTypesConfig = section(DataTypesConfig)
    communication_data_type: Optional[str] = option(
        None, "dtype of gradient collectives (default: the gradient dtype).", choices=("fp32", "fp16", "bf16"))
    prescale_gradients: bool = option(
        False, "Divide gradients by the data-parallel size before their all-reduce instead of after (stage 0, "
               "or reduce_scatter: false); matters when the sum runs in fp16.")
    gradient_predivide_factor: float = option(
        1.0, "Without prescale: divide gradients by this before the all-reduce and multiply by factor/dp "
             "after (stage 0, or reduce_scatter: false).", gt=0)
    steps_per_print: int = option(10, "Print a metrics line every this many steps.", gt=0)
    wall_clock_breakdown: bool = option(
        False, "Per step at each print: data wait, dispatch, device time (waits for every step) and logging; "
               "forward, backward and optimizer run inside one compiled program and are not separated.")
    memory_breakdown: bool = option(False, "Print each device's memory (arrays by role, allocator in-use and "
                                           "peak where the backend reports them, host RSS) at every print step.")
    dump_state: bool = option(False, "Print the resolved config at start.")
    tensorboard: MonitorConfig = section(MonitorConfig)
    csv_monitor: MonitorConfig = section(MonitorConfig)
    wandb: WandbConfig = section(WandbConfig)
    flops_profiler: FlopsProfilerConfig = section(FlopsProfilerConfig)
    comms_logger: CommsLoggerConfig = section(CommsLoggerConfig)
    pipeline: PipelineConfig = section(PipelineConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    kernels: str = option("auto", "Optimizer update: auto (Pallas kernels on GPU for Adam/AdamW, XLA "
                                  "elsewhere) | pallas (Triton on GPU, interpret mode on CPU) | xla (optax).",
                          choices=("auto", "pallas", "xla"))
    mesh: MeshConfig = section(MeshConfig)
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    run: RunConfig = section(RunConfig)
    distributed: DistributedConfig = section(DistributedConfig)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False,
                                       metadata=dict(internal=True))

    # -- derived views ------------------------------------------------------------------------
    @property
    def compute_dtype(self) -> str:
        return "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"

    def batch(self, dp_size: int) -> "BatchSize":
        return resolve_batch(self, dp_size)

    def to_dict(self) -> dict[str, Any]:
        """Every resolved value as plain JSON-able data (what `config.json` holds)."""
        return _to_plain(self)

    def explain(self, dp_size: int | None = None) -> str:
        """Every resolved value and where it came from (file, override, default, derived)."""
        rows = list(_flatten(self.to_dict()))
        if dp_size is not None:
            b = self.batch(dp_size)
            extra = dict(zip(BATCH_KEYS, b))
            rows = [(k, extra.get(k, v)) for k, v in rows]
        width = max(len(k) for k, _ in rows)
        lines = [f"{'key'.ljust(width)}  {'value':<24} source"]
        for key, value in rows:
            src = self.sources.get(key, "default")
            if dp_size is not None and key in BATCH_KEYS and getattr(self, key) is None:
                auto = "'auto', " if src == "derived ('auto')" else ""
                src = f"derived ({auto}data-parallel size {dp_size})"
            lines.append(f"{key.ljust(width)}  {json.dumps(value):<24} {src}")
        for key, src in self.sources.items():  # keys that loaded with a warning and do nothing
            if src.startswith("ignored"):
                lines.append(f"{key.ljust(width)}  {'-':<24} {src}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Batch triad.

class BatchSize(typing.NamedTuple):
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def resolve_batch(config: Config, dp_size: int) -> BatchSize:
    """DeepSpeed's triad: train_batch_size = micro * accumulation * dp_size; derive the missing one."""
    tb, mb, gas = (config.train_batch_size, config.train_micro_batch_size_per_gpu,
                   config.gradient_accumulation_steps)
    n = _positive_size(dp_size)

    def exact(total: int, div: int, what: str, formula: str) -> int:
        if total % div:
            raise ConfigError(
                f"{what}: {formula} = {total} / {div} is not a whole number; choose train_batch_size "
                f"as a multiple of {div}")
        return total // div

    if tb and mb and gas:
        if tb != mb * gas * n:
            raise ConfigError(
                f"train_batch_size: {tb} != train_micro_batch_size_per_gpu * gradient_accumulation_steps "
                f"* data-parallel size = {mb} * {gas} * {n} = {mb * gas * n}; fix one of the three or "
                f"leave one out to have it derived")
    elif tb and mb:
        gas = exact(tb, mb * n, "gradient_accumulation_steps",
                    f"train_batch_size / (micro {mb} * dp {n})")
    elif tb and gas:
        mb = exact(tb, gas * n, "train_micro_batch_size_per_gpu",
                   f"train_batch_size / (accumulation {gas} * dp {n})")
    elif mb and gas:
        tb = mb * gas * n
    elif tb:
        gas = 1
        mb = exact(tb, n, "train_micro_batch_size_per_gpu", f"train_batch_size / dp {n}")
    elif mb:
        gas, tb = 1, mb * n
    else:
        raise ConfigError("train_batch_size: give train_batch_size or train_micro_batch_size_per_gpu "
                          "(gradient_accumulation_steps alone cannot fix the batch)")
    return BatchSize(tb, mb, gas)


def _positive_size(dp_size: Any) -> int:
    """The data-parallel size as an int; 0 or a float would otherwise divide by zero or round silently."""
    try:
        n = operator.index(dp_size)
    except TypeError:
        n = 0
    if isinstance(dp_size, bool) or n < 1:
        raise ConfigError(f"data-parallel size: got {dp_size!r}; it must be a positive integer (the size "
                          f"of the mesh axes the batch is split over, e.g. mesh.data)")
    return n


# ---------------------------------------------------------------------------------------------
# Loading.

def load_config(src: "str | os.PathLike[str] | Mapping[str, Any] | Config",
                overrides: Sequence[str] = (), *, hidden_size: int | None = None) -> Config:
    """Load a config from a dict, a JSON/hjson/YAML file, or pass a Config through.

    `overrides` are `dotted.key=value` strings (value parsed as YAML) applied on top, as the CLI's
    `--set` does. `hidden_size` is the model's width, for the Hugging Face "auto" values the Trainer
    derives from it (default: model.d_model). Everything is checked here; nothing touches JAX devices.
    """
    origin: dict[str, str] = {}
    if isinstance(src, Config):
        if not overrides:
            return src
        raw = _given_values(src, "", src.sources, origin)
    elif isinstance(src, Mapping):
        raw = _deepcopy(src)
    elif isinstance(src, (str, os.PathLike)):
        raw = read_config_file(Path(src))
    else:
        raise ConfigError(f"config: expected a dict, a file path or a Config, got {type(src).__name__}")
    for item in overrides:
        key, value = _parse_override(item)
        path = _set_dotted(raw, key, value)
        for stale in [k for k in origin if k.startswith(path + ".")]:
            del origin[stale]  # the override replaced the whole section
        origin[path] = "override"
    sources: dict[str, str] = {}
    fills = _fill_auto(raw, hidden_size)
    config = _build(Config, raw, "", sources, origin)
    sources.update(fills)
    config = _derive(config, sources)
    _check(config, sources)
    return dataclasses.replace(config, sources=sources)


# The optimizer type a plan records when the optimizer came from code (`plan(..., optimizer=)`).
CLIENT_OPTIMIZER = "client"


def as_config(config: "Config | Mapping[str, Any] | str | os.PathLike[str]", plan_config: Config | None = None,
              where: str = "config") -> Config:
    """What the public functions take as `config` (a Config, a dict or a file path, as `initialize`
    does), loaded; given the config a plan was made from, the two must agree key for key."""
    config = load_config(config)
    if plan_config is not None and getattr(plan_config.optimizer, "type", None) == CLIENT_OPTIMIZER:
        # the plan records an optimizer passed in code where the config has its section (or none)
        plan_config = dataclasses.replace(plan_config, optimizer=config.optimizer)
    if plan_config is not None and config != plan_config:
        mine, theirs = dict(_flatten(config.to_dict())), dict(_flatten(plan_config.to_dict()))
        keys = [k for k in {**theirs, **mine} if mine.get(k) != theirs.get(k)]
        shown = ", ".join(f"{k} {_show(mine.get(k))} (plan: {_show(theirs.get(k))})" for k in keys[:4])
        raise ConfigError(f"{where}: the config differs from the one the plan was made from in "
                          f"{len(keys)} key(s): {shown}; pass plan.config, or make the plan from this config")
    return config


def read_config_file(path: Path) -> dict[str, Any]:
    """A config file's mapping; every failure names the file and says what to do."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise ConfigError(f"config file {path}: {what}; give the path of a .json, .hjson or .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: cannot read it ({e})") from None
    if not text.strip():
        raise ConfigError(f"config file {path}: the file is empty; write a mapping such as "
                          f'{{"train_batch_size": 32}}')
    try:
        data = _reject_duplicates(_parse_text(text, path.suffix.lower()))
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except Exception as e:  # parser errors carry line/column
        raise ConfigError(f"config file {path}: cannot parse: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of keys, "
                          f"got {type(data).__name__}")
    return data


def _parse_text(text: str, suffix: str) -> Any:
    """By extension: YAML, hjson, or JSON (then hjson: DeepSpeed configs often carry comments and
    trailing commas). Any other extension (.txt, .cfg, none) is JSON, else YAML, else hjson: a YAML
    file read as hjson would fail with a misleading message about keys or braces."""
    if suffix in (".yaml", ".yml"):
        return _load_yaml(text)
    if suffix == ".hjson":
        return _load_hjson(text)
    try:
        return json.loads(text, object_pairs_hook=_Pairs.of)
    except json.JSONDecodeError:
        if suffix == ".json":
            return _load_hjson(text)
    try:
        data = _load_yaml(text)
    except Exception as yaml_error:
        try:
            data = _load_hjson(text)
        except Exception:
            data = None
        if isinstance(data, dict):
            return data
        raise ConfigError(f"cannot parse it as JSON, YAML or hjson (YAML says: {yaml_error}); "
                          f"name the file .yaml, .json or .hjson to choose its format") from None
    if isinstance(data, dict):
        return data
    return _load_hjson(text)  # e.g. an hjson mapping without braces reads as one YAML string


class _Pairs(dict):
    """A parsed mapping that remembers keys written twice, so the error can name their full path."""
    duplicates: tuple[Any, ...] = ()

    @classmethod
    def of(cls, pairs: Sequence[tuple[Any, Any]], written: Sequence[Any] | None = None) -> "_Pairs":
        out = cls(pairs)
        keys = [k for k, _ in pairs] if written is None else list(written)
        out.duplicates = tuple(dict.fromkeys(k for i, k in enumerate(keys) if k in keys[:i]))
        return out


def _reject_duplicates(data: Any, prefix: str = "") -> Any:
    """Plain dicts and lists again; the first key written twice is an error naming its dotted path."""
    if isinstance(data, dict):
        for key in getattr(data, "duplicates", ()):
            raise ConfigError(f"{_join(prefix, str(key))}: key written twice; keep one of them")
        return {k: _reject_duplicates(v, _join(prefix, str(k))) for k, v in data.items()}
    if isinstance(data, list):
        return [_reject_duplicates(v, f"{prefix}[{i}]") for i, v in enumerate(data)]
    return data


def _load_hjson(text: str) -> Any:
    import hjson
    return hjson.loads(text, object_pairs_hook=_Pairs.of)


# YAML 1.1 (PyYAML) reads `1e-3` as a string; YAML 1.2 and JSON read it as a number, as users expect.
_YAML_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


@functools.lru_cache(maxsize=None)
def _yaml_loader() -> type:
    """A safe YAML loader that reads 1e-3 as a float and records keys written twice."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    merge_tag = "tag:yaml.org,2002:merge"

    def construct_mapping(loader: Any, node: Any, deep: bool = False) -> dict:
        written = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode) and k.tag != merge_tag]
        loader.flatten_mapping(node)  # `<<` merges first, so explicit keys win over merged ones
        pairs = [(loader.construct_object(k, deep=deep), loader.construct_object(v, deep=deep))
                 for k, v in node.value]
        return _Pairs.of(pairs, written)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_FLOAT, list("-+0123456789."))
    return Loader


def _load_yaml(text: str) -> Any:
    import yaml
    return yaml.load(text, Loader=_yaml_loader())


def _parse_override(item: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value parsed as YAML, so 2, true, null, 1e-3 and [0.9, 0.95] work)."""
    import yaml
    if "=" not in item:
        raise ConfigError(f"override '{item}': write it as key.path=value, e.g. zero_optimization.stage=2")
    key, _, value = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}': the key path before '=' has an empty part; write it as "
                          f"key.path=value, e.g. zero_optimization.stage=2")
    try:
        parsed = _load_yaml(value) if value.strip() else None
    except yaml.YAMLError:
        return key, value
    return key, _reject_duplicates(parsed, key)


def _set_dotted(raw: dict, key: str, value: Any) -> str:
    """Set a dotted key in the raw tree and return its canonical path (aliases resolved).

    An alias already in the tree (e.g. `bfloat16`) is renamed to its canonical key first, so an
    override of `bf16.enabled` lands in the same section instead of duplicating it.
    """
    parts = key.split(".")
    node, cls, canon = raw, Config, []
    for i, part in enumerate(parts):
        name, aliases, cls = _schema_step(cls, part)
        for alias in aliases:
            if alias in node and name not in node:
                node[name] = node.pop(alias)
        canon.append(name)
        if i == len(parts) - 1:
            node[name] = value
            break
        child = node.get(name)
        if child is None:
            child = node[name] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: '{'.'.join(canon)}' is a value, not a section")
        node = child
    return ".".join(canon)


def _schema_step(cls: type | None, part: str) -> tuple[str, tuple[str, ...], type | None]:
    """One step down the schema: canonical name of `part`, its aliases, and the section below it."""
    if cls is None:
        return part, (), None
    fields = {f.name: f for f in schema_fields(cls)}
    alias_of = {a: f.name for f in fields.values() for a in f.metadata.get("aliases", ())}
    name = alias_of.get(part, part)
    if name not in fields:
        return part, (), None
    return name, fields[name].metadata.get("aliases", ()), _dataclass_of(typing.get_type_hints(cls)[name])


def _given_values(obj: Any, prefix: str, sources: Mapping[str, str],
                  origin: dict[str, str]) -> dict[str, Any]:
    """The raw tree a loaded Config was built from, with each value's source recorded in `origin`.

    Derived values are left out so that overrides re-derive them (weight_decay after torch_adam
    changes, d_ff after d_model changes); values changed in Python count as "given".
    """
    out: dict[str, Any] = {}
    for f in schema_fields(type(obj)):
        path, value = _join(prefix, f.name), getattr(obj, f.name)
        if isinstance(value, (OptimizerConfig, SchedulerConfig)):
            origin[path + ".type"] = sources.get(path + ".type", "default")
            out[f.name] = {"type": value.type,
                           "params": _given_values(value.params, path + ".params", sources, origin)}
        elif dataclasses.is_dataclass(value):
            out[f.name] = _given_values(value, path, sources, origin)
        else:
            label = sources.get(path, "default")
            if "'auto'" in label:
                out[f.name] = "auto"
            elif label.startswith("default"):
                if value != _field_default(f):
                    out[f.name] = value
                    origin[path] = "given"
            elif not label.startswith("derived"):
                out[f.name] = value
                origin[path] = label
    return out


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is _MISSING else f.default


def _deepcopy(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _deepcopy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_deepcopy(v) for v in obj]
    return obj


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key



# ---------------------------------------------------------------------------------------------
# Hugging Face "auto". The Trainer fills these keys from its TrainingArguments and the model's
# config before DeepSpeed reads the file; zerojax fills what it can derive the same way and names
# every other one in a single error.

# zero_optimization keys the Trainer derives from the model's hidden size.
_HIDDEN_FILLS: dict[str, tuple[str, Callable[[int], int]]] = {
    "reduce_bucket_size": ("hidden^2", lambda h: h * h),
    "stage3_prefetch_bucket_size": ("0.9 * hidden^2", lambda h: int(0.9 * h * h)),
    "stage3_param_persistence_threshold": ("10 * hidden", lambda h: 10 * h),
}
# Keys only the Trainer's arguments can fill: (the argument it reads, an example value).
_TRAINER_ONLY: dict[str, tuple[str, str]] = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", "8"),
    "fp16.enabled": ("--fp16", "true"),
    "bf16.enabled": ("--bf16", "true"),
    "optimizer.params.lr": ("learning_rate", "5e-5"),
    "optimizer.params.betas": ("adam_beta1, adam_beta2", "[0.9,0.999]"),
    "optimizer.params.eps": ("adam_epsilon", "1e-8"),
    "optimizer.params.weight_decay": ("weight_decay", "0.0"),
    "scheduler.params.warmup_max_lr": ("learning_rate", "5e-5"),
    "scheduler.params.warmup_num_steps": ("warmup_steps", "100"),
    "scheduler.params.total_num_steps": ("max_steps", "1000"),
}
# The Trainer's TrainingArguments default for max_grad_norm.
_TRAINER_MAX_GRAD_NORM = 1.0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fill_auto(raw: dict[str, Any], hidden_size: int | None) -> dict[str, str]:
    """Replace the Trainer's "auto" placeholders that zerojax can derive, in place; returns the
    source label of each filled key. Every "auto" only the Trainer could fill is one error."""
    fills: dict[str, str] = {}
    pending: list[str] = []
    tb, mb = raw.get("train_batch_size"), raw.get("train_micro_batch_size_per_gpu")
    if (_is_auto(tb) or _is_auto(mb)) and not (_number(tb) or _number(mb)):
        pending.append("train_micro_batch_size_per_gpu")
    if _is_auto(raw.get("gradient_clipping")):
        raw["gradient_clipping"] = _TRAINER_MAX_GRAD_NORM
        fills["gradient_clipping"] = "derived ('auto': the Trainer's max_grad_norm default, 1.0)"
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        fields = {f.name: f for f in schema_fields(ZeroConfig)}
        for key in list(zero):
            name = next((n for n, f in fields.items() if key == n or key in f.metadata.get("aliases", ())), key)
            if name in _HIDDEN_FILLS and _is_auto(zero[key]):
                formula, fn = _HIDDEN_FILLS[name]
                h, whence = _hidden_size(raw, hidden_size)
                zero[key] = fn(h)
                fills[f"zero_optimization.{name}"] = f"derived ('auto': {formula}, hidden size {h} {whence})"
    for section in ("fp16", "bf16", "bfloat16"):
        if isinstance(raw.get(section), dict) and _is_auto(raw[section].get("enabled")):
            pending.append("bf16.enabled" if section == "bfloat16" else f"{section}.enabled")
    opt = raw.get("optimizer")
    opt_params = opt.get("params") if isinstance(opt, dict) else None
    if isinstance(opt_params, dict):
        pending += [f"optimizer.params.{k}" for k, v in opt_params.items() if _is_auto(v)]
    sched = raw.get("scheduler")
    params = sched.get("params") if isinstance(sched, dict) else None
    if isinstance(params, dict):
        lr = opt_params.get("lr") if isinstance(opt_params, dict) else None
        run = raw.get("run") if isinstance(raw.get("run"), dict) else {}
        for key, value in list(params.items()):
            if not _is_auto(value):
                continue
            if key == "warmup_min_lr":
                params[key] = 0.0
                fills[f"scheduler.params.{key}"] = "derived ('auto': 0, as the Trainer writes it)"
            elif key == "warmup_max_lr" and _number(lr):
                params[key] = lr
                fills[f"scheduler.params.{key}"] = "derived ('auto': optimizer.params.lr, the Trainer's " \
                                                   "learning_rate)"
            elif key == "total_num_steps" and _number(run.get("steps")):
                params[key] = run["steps"]
                fills[f"scheduler.params.{key}"] = "derived ('auto': run.steps, the Trainer's max_steps)"
            else:
                pending.append(f"scheduler.params.{key}")
    if pending:
        raise ConfigError(_auto_error(pending))
    return fills


def _hidden_size(raw: Mapping[str, Any], hidden_size: int | None) -> tuple[int, str]:
    """The hidden size the Trainer would read from the model's config, and where it came from."""
    if hidden_size is not None:
        if not _number(hidden_size) or hidden_size <= 0 or int(hidden_size) != hidden_size:
            raise ConfigError(f"hidden_size: {hidden_size!r} must be a positive integer (the model's width)")
        return int(hidden_size), "given as hidden_size"
    model = raw.get("model")
    if isinstance(model, Mapping) and _number(model.get("d_model")):
        return int(model["d_model"]), "from model.d_model"
    return ModelConfig().d_model, "from model.d_model, the embedded GPT's default"


def _auto_error(pending: list[str]) -> str:
    sets = [f"{key}={_TRAINER_ONLY.get(key, ('', '<value>'))[1]}" for key in pending]
    lines = [f'"auto" is a Hugging Face Trainer placeholder, and {len(pending)} of them can only be filled '
             f"from the Trainer's arguments; set each one:"]
    for key, kv in zip(pending, sets):
        arg = _TRAINER_ONLY.get(key, ("", ""))[0]
        lines.append(f"  {kv}" + (f"   (the Trainer's {arg})" if arg else ""))
    lines.append(f"command line: --set {' '.join(sets)}; Python: load_config(path, {json.dumps(sets)})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# DeepSpeed keys zerojax does not build. Each is a real DeepSpeed key, not a typo: it loads with one
# warning line when it cannot change the result, and is refused, with the reason, when it would.

class Foreign(typing.NamedTuple):
    """A DeepSpeed key without a zerojax implementation."""
    what: str                    # what it does in DeepSpeed
    effect: str                  # why leaving it out does not change the result here
    alternative: str             # what to use in zerojax instead
    refuse: Callable[[Any], str | None] | None = None  # the reason to refuse this value, if any
    refused_when: str = ""       # the values `refuse` refuses, for the reference


def _enabled(value: Any) -> bool:
    """A section's `enabled` (or the value itself) is on; "auto" counts as off (the Trainer's default)."""
    if isinstance(value, Mapping):
        value = value.get("enabled", False)
    return value is True or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)


def _refuse_if_enabled(why: str) -> Callable[[Any], str | None]:
    return lambda value: why if _enabled(value) else None


def _find(value: Any, names: Sequence[str]) -> list[tuple[str, Any]]:
    """(name, value) of every key in `names` anywhere inside a nested section."""
    out: list[tuple[str, Any]] = []
    if isinstance(value, Mapping):
        for k, v in value.items():
            if k in names:
                out.append((k, v))
            out += _find(v, names)
    return out


def _refuse_tensor_parallel(value: Any) -> str | None:
    for name, size in _find(value, ("autotp_size", "tp_size")):
        if isinstance(size, (int, float)) and not isinstance(size, bool) and size > 1:
            return (f"{name}: {size} splits every layer over {size} devices, a different program; zerojax "
                    f"shards model state with ZeRO-3 (zero_optimization.stage: 3) and layers with pipeline "
                    f"stages (mesh.stage)")
    return None


def _refuse_above_one(why: str) -> Callable[[Any], str | None]:
    return lambda value: why if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and value > 1 else None


_NO_EFFECT = "none: it changes how fast or where DeepSpeed runs, not what it computes"
FOREIGN_KEYS: dict[str, Foreign] = {
    # top level
    "compile": Foreign("torch.compile of the model", "none: the whole step is always compiled by XLA "
                       "under jax.jit", "nothing to do"),
    "tensor_parallel": Foreign("AutoTP tensor parallelism", "none at tp size 1", "ZeRO-3 or mesh.stage",
                               _refuse_tensor_parallel, refused_when="autotp_size or tp_size above 1"),
    "autotuning": Foreign("the autotuner, which launches trial runs to pick batch size and ZeRO knobs",
                          "none on this run", "choose train_micro_batch_size_per_gpu and the stage yourself"),
    "data_efficiency": Foreign("curriculum learning and data routing", "none while disabled",
                               "order or filter the batches you pass to train_batch",
                               _refuse_if_enabled("enabled: it changes which tokens each step trains on"), refused_when="enabled"),
    "curriculum_learning": Foreign("legacy curriculum learning", "none while disabled",
                                   "order or filter the batches you pass to train_batch",
                                   _refuse_if_enabled("enabled: it changes which tokens each step trains on"), refused_when="enabled"),
    "aio": Foreign("async I/O for NVMe offload", "none: NVMe offload is refused anyway",
                   "zero_optimization.offload_*.device: cpu"),
    "seq_parallel_communication_data_type": Foreign("the dtype of sequence-parallel collectives",
                                                    "none: there is no sequence parallelism", "nothing to do"),
    "sequence_parallel_size": Foreign("Ulysses sequence parallelism", "none at size 1", "nothing to do",
                                      _refuse_above_one("it splits every sequence over several devices"), refused_when="above 1"),
    "disable_allgather": Foreign("broadcasts instead of all-gathers in ZeRO-1/2", _NO_EFFECT,
                                 "nothing to do: XLA picks the collectives"),
    "comms_config": Foreign("the communication logger's settings object", _NO_EFFECT, "comms_logger"),
    "monitor_config": Foreign("the monitors' settings object", "none", "tensorboard / csv_monitor"),
    "comet": Foreign("the Comet ML monitor", "none: monitors only record", "tensorboard or csv_monitor"),
    "sparse_gradients": Foreign("sparse all-reduce of embedding gradients", _NO_EFFECT, "nothing to do"),
    "graph_harvesting": Foreign("CUDA graph capture", _NO_EFFECT, "nothing to do: XLA compiles the step"),
    "timers": Foreign("throughput timers", "none", "wall_clock_breakdown"),
    "nebula": Foreign("the Nebula asynchronous checkpoint service", "none on training",
                      "checkpoint.async_save"),
    "datastates": Foreign("the DataStates asynchronous checkpoint engine", "none on training",
                          "checkpoint.async_save"),
    "eigenvalue": Foreign("Hessian eigenvalue estimation (for MoQ)", "none on the update", "nothing to do"),
    "hybrid_engine": Foreign("the RLHF inference/training hybrid engine", "none on training steps",
                             "nothing to do"),
    "weight_quantization": Foreign("post-training weight quantization for inference", "none on training",
                                   "nothing to do"),
    "dataloader_drop_last": Foreign("DeepSpeed's own data loader", "none: zerojax takes whole batches from "
                                    "you", "drop the last partial batch in your loader"),
    "use_data_before_expert_parallel_": Foreign("an expert-parallel data layout switch",
                                                "none without experts", "nothing to do"),
    "amp": Foreign("NVIDIA Apex AMP mixed precision", "none while disabled", "bf16.enabled or fp16.enabled",
                   _refuse_if_enabled("enabled: it would train in Apex's mixed precision"), refused_when="enabled"),
    "torch_autocast": Foreign("torch.autocast mixed precision", "none while disabled",
                              "bf16.enabled or fp16.enabled",
                              _refuse_if_enabled("enabled: it would compute in lower precision"), refused_when="enabled"),
    "sparse_attention": Foreign("DeepSpeed's sparse attention kernels", "none: the model defines attention",
                                "write the attention you want in the model",
                                lambda v: "it replaces the model's attention" if v else None, refused_when="given"),
    "progressive_layer_drop": Foreign("progressive layer dropping", "none while disabled", "nothing to do",
                                      _refuse_if_enabled("enabled: it skips layers during training"), refused_when="enabled"),
    "compression_training": Foreign("quantization-aware training and pruning", "none while empty",
                                    "nothing to do", lambda v: "it changes the model's weights during "
                                                               "training" if _find(v, ("enabled",)) and any(
                                        e is True for _, e in _find(v, ("enabled",))) else None, refused_when="any part enabled"),
    "quantize_training": Foreign("MoQ quantization during training", "none while disabled", "nothing to do",
                                 _refuse_if_enabled("enabled: it quantizes the weights"), refused_when="enabled"),
    "elasticity": Foreign("elastic training (batch size chosen for the GPU count)", "none while disabled",
                          "set the batch triad for your mesh",
                          _refuse_if_enabled("enabled: it chooses a different batch size"), refused_when="enabled"),
    "expert_parallel": Foreign("automatic expert parallelism", "none while disabled", "nothing to do",
                               _refuse_if_enabled("enabled: it shards experts over devices"), refused_when="enabled"),
    # zero_optimization
    "zero_optimization.use_multi_rank_bucket_allreduce": Foreign("one all-reduce for several ranks' "
                                                                 "buckets", _NO_EFFECT, "nothing to do"),
    "zero_optimization.legacy_stage1": Foreign("the old ZeRO-1 implementation", "none: same maths",
                                               "nothing to do"),
    "zero_optimization.stage3_model_persistence_threshold": Foreign(
        "a cap on unpartitioned parameter elements", "none on the result (memory only)",
        "zero_optimization.stage3_param_persistence_threshold"),
    "zero_optimization.model_persistence_threshold": Foreign(
        "a cap on unpartitioned parameter elements", "none on the result (memory only)",
        "zero_optimization.stage3_param_persistence_threshold"),
    "zero_optimization.stage3_module_granularity_threshold": Foreign(
        "fetching fine-grained modules as one unit", _NO_EFFECT, "nothing to do"),
    "zero_optimization.module_granularity_threshold": Foreign(
        "fetching fine-grained modules as one unit", _NO_EFFECT, "nothing to do"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": Foreign(
        "all-reduce instead of all-gather to fetch parameters", _NO_EFFECT, "nothing to do"),
    "zero_optimization.use_all_reduce_for_fetch_params": Foreign(
        "all-reduce instead of all-gather to fetch parameters", _NO_EFFECT, "nothing to do"),
    "zero_optimization.stage3_allgather_sequential": Foreign("unbucketed parameter all-gathers", _NO_EFFECT,
                                                             "nothing to do"),
    "zero_optimization.allgather_sequential": Foreign("unbucketed parameter all-gathers", _NO_EFFECT,
                                                      "nothing to do"),
    "zero_optimization.stage3_partition_stream_chunk_size": Foreign(
        "chunked partitioning at zero.Init", "none on the result (memory only)", "nothing to do"),
    "zero_optimization.partition_stream_chunk_size": Foreign(
        "chunked partitioning at zero.Init", "none on the result (memory only)", "nothing to do"),
    "zero_optimization.memory_efficient_linear": Foreign("a memory-saving linear layer for stage 3",
                                                         "none on the result", "nothing to do"),
    "zero_optimization.pipeline_loading_checkpoint": Foreign("loading a checkpoint into a pipeline at "
                                                             "stage 3", "none", "nothing to do"),
    "zero_optimization.override_module_apply": Foreign("a torch module hook for stage 3", "none",
                                                       "nothing to do"),
    "zero_optimization.log_trace_cache_warnings": Foreign("trace-cache logging", "none", "nothing to do"),
    "zero_optimization.enable_sanity_checks": Foreign("internal ZeRO-3 checks", "none", "nothing to do"),
    "zero_optimization.leaf_module": Foreign("modules fetched as one unit at stage 3", _NO_EFFECT,
                                             "nothing to do"),
    "zero_optimization.mics_hierarchical_params_gather": Foreign("MiCS's hierarchical all-gather",
                                                                 _NO_EFFECT, "nothing to do"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": Foreign("Muon buffers outside NVMe",
                                                                     "none", "nothing to do"),
    "zero_optimization.zero_quantized_nontrainable_weights": Foreign(
        "frozen weights stored quantized", "none while false", "nothing to do",
        _refuse_if_enabled("true: frozen weights would be stored quantized"), refused_when="true"),
    "zero_optimization.zeropp_loco_param": Foreign(
        "LoCo error feedback for ZeRO++ quantized gradients", "none while absent",
        "zero_quantized_gradients without error feedback",
        lambda v: "its error feedback would change the quantized gradients" if v else None,
        refused_when="given"),
    "zero_optimization.zenflow": Foreign("ZenFlow's stale, asynchronous optimizer updates",
                                         "none while absent", "nothing to do",
                                         lambda v: "it applies updates late, which changes the result"
                                         if v else None, refused_when="given"),
    "zero_optimization.offload_optimizer.pipeline_read": Foreign("NVMe read pipelining", "none", "nothing to do"),
    "zero_optimization.offload_optimizer.pipeline_write": Foreign("NVMe write pipelining", "none", "nothing to do"),
    "zero_optimization.offload_optimizer.pipeline": Foreign("NVMe pipelining", "none", "nothing to do"),
    "zero_optimization.offload_optimizer.super_offload": Foreign("SuperOffload's CPU optimizer pipeline",
                                                                 _NO_EFFECT, "compute: host"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": Foreign("CPU cores for the host Adam",
                                                                      _NO_EFFECT, "nothing to do"),
    # checkpoint
    "checkpoint.parallel_write": Foreign("parallel checkpoint writing by pipeline stage", _NO_EFFECT,
                                         "nothing to do: orbax writes shards in parallel"),
    "checkpoint.writer": Foreign("DeepSpeed's fast checkpoint writer", _NO_EFFECT,
                                 "checkpoint.async_save"),
    # bf16
    "bf16.bf16_master_weights_and_grads": Foreign(
        "bf16 master weights and gradients", "none while false", "nothing to do",
        _refuse_if_enabled("true: master weights would be bf16; zerojax keeps fp32 master weights"), refused_when="true"),
    "bf16.bf16_optimizer_states": Foreign(
        "bf16 optimizer state", "none while false", "nothing to do",
        _refuse_if_enabled("true: optimizer state would be bf16; zerojax keeps it in fp32"), refused_when="true"),
}


def _foreign(path: str, value: Any, sources: dict[str, str]) -> bool:
    """Accept a DeepSpeed-only key with one warning, or refuse it; False when `path` is not one."""
    known = FOREIGN_KEYS.get(path)
    if known is None:
        return False
    reason = known.refuse(value) if known.refuse is not None else None
    if reason is not None:
        raise ConfigError(f"{path}: DeepSpeed's {known.what} is not built in zerojax, and {reason}; "
                          f"alternative: {known.alternative}; remove the key or turn it off")
    _warn(sources, path, f"DeepSpeed's {known.what}: not built in zerojax; effect: {known.effect}; "
                         f"alternative: {known.alternative}", "ignored (DeepSpeed-only key, not built)")
    return True


_SUGGEST_CUTOFF = 0.75


def _foreign_here(prefix: str) -> list[str]:
    """The DeepSpeed-only keys that live directly in section `prefix`, for suggestions."""
    depth = prefix.count(".") + 1 if prefix else 0
    return [p.rsplit(".", 1)[-1] for p in FOREIGN_KEYS
            if p.count(".") == depth and (not prefix or p.startswith(prefix + "."))]


def _did_you_mean(key: str, valid: Sequence[str], noun: str = "keys", where: str | None = None) -> str:
    """The nearest valid key; else, for a key that lives in another section, where it goes."""
    # 0.75: a slip of a letter or two, a missing word; not a different key sharing a prefix
    # (tensor_parallel is not tensorboard).
    close = difflib.get_close_matches(key, valid, n=1, cutoff=_SUGGEST_CUTOFF)
    if not close:
        lowered = {v.lower(): v for v in valid}
        close = [lowered[key.lower()]] if key.lower() in lowered else []
    if close:
        return f"; did you mean '{close[0]}'?"
    if where is not None:
        homes = [p for p in _schema_paths() if p.rsplit(".", 1)[-1] == key and p != _join(where, key)]
        if homes:
            return f"; it belongs elsewhere: did you mean '{homes[0]}'?"
    return f"; valid {noun}: {', '.join(sorted(valid))}"


@functools.lru_cache(maxsize=None)
def _schema_paths() -> tuple[str, ...]:
    """Every dotted key the schema knows (optimizer/scheduler params of every type), shallow first."""
    paths: list[str] = []
    queue: list[tuple[type, str]] = [(Config, "")]
    queue += [(c, "optimizer.params") for c in OPTIMIZER_PARAMS.values()]
    queue += [(c, "scheduler.params") for c in SCHEDULER_PARAMS.values()]
    while queue:
        cls, prefix = queue.pop(0)
        hints = typing.get_type_hints(cls)
        for f in schema_fields(cls):
            path = _join(prefix, f.name)
            if path not in paths:
                paths.append(path)
            nested = _dataclass_of(hints[f.name])
            if nested is not None:
                queue.append((nested, path))
    paths += ["optimizer.type", "optimizer.params", "optimizer.no_decay", "optimizer.param_groups",
              "scheduler.type", "scheduler.params"]
    return tuple(paths)


def _show(value: Any) -> str:
    """A value as the user wrote it (JSON where possible; YAML can also give dates and such)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def schema_fields(cls: type) -> list[dataclasses.Field]:
    """The user-facing fields of a schema dataclass (not the internal `sources`)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def _origin_of(path: str, origin: Mapping[str, str]) -> str:
    """Where a given value came from: the nearest overridden ancestor (a whole section can be
    overridden), else the file (or dict)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        label = origin.get(".".join(parts[:i]))
        if label is not None:
            return label
    return "file"


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _auto_is_a_value(tp: Any, meta: Mapping[str, Any]) -> bool:
    """Whether "auto" is an ordinary value of the field (a free string, or one of its choices)."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    choices = meta.get("choices")
    return str in args and (not choices or "auto" in choices)


def _build(cls: type, raw: Any, prefix: str, sources: dict[str, str], origin: Mapping[str, str]) -> Any:
    where = prefix or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a section (mapping of keys), got {_show(raw)}")
    fields = {f.name: f for f in schema_fields(cls)}
    alias_of = {a: f.name for f in fields.values() for a in f.metadata.get("aliases", ())}
    given: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key {key!r} must be a string")
        if key.startswith("_"):
            continue  # "_comment", "_read_the_docs": comments, as real configs write them
        name = alias_of.get(key, key)
        if name not in fields:
            if _foreign(_join(prefix, key), value, sources):
                continue
            if prefix == "optimizer.params" and key == "max_grad_norm":
                raise ConfigError("optimizer.params.max_grad_norm: not a parameter of DeepSpeed's "
                                  f"{cls.__doc__.split()[0]} optimizer; clip gradients with the top-level "
                                  "gradient_clipping (e.g. \"gradient_clipping\": 1.0)")
            hint = _did_you_mean(key, list(fields) + list(alias_of) + _foreign_here(prefix), where=prefix)
            if prefix in ("optimizer.params", "scheduler.params"):
                hint += f" ({cls.__doc__.splitlines()[0]})"
            raise ConfigError(f"unknown key '{_join(prefix, key)}'{hint}")
        if name in given:
            raise ConfigError(f"{_join(prefix, key)}: given twice (also as an alias); keep one")
        given[name] = value
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        path = _join(prefix, name)
        if cls is Config and name in ("optimizer", "scheduler"):
            if name in given and given[name] is not None:
                kwargs[name] = _build_typed(name, given[name], sources, origin)
            continue
        tp = hints[name]
        nested = _dataclass_of(tp)
        if nested is not None:
            kwargs[name] = _build(nested, given.get(name), path, sources, origin)
            continue
        if name not in given:
            continue
        value = given[name]
        if _is_auto(value) and not _auto_is_a_value(tp, f.metadata):
            # Hugging Face's placeholder: the batch triad derives it, everything else takes its default.
            sources[path] = "derived ('auto')" if path in BATCH_KEYS else "default ('auto')"
            continue
        kwargs[name] = _coerce(value, tp, path, f.metadata)
        sources[path] = _origin_of(path, origin)
    return cls(**kwargs)


def _build_typed(name: str, raw: Any, sources: dict[str, str], origin: Mapping[str, str]) -> Any:
    """optimizer / scheduler: the params schema depends on `type`."""
    example = "AdamW" if name == "optimizer" else "WarmupLR"
    if not isinstance(raw, Mapping):
        raise ConfigError(f'{name}: expected {{"type": "{example}", "params": {{...}}}}, got {_show(raw)}')
    raw = {k: v for k, v in raw.items() if not (isinstance(k, str) and k.startswith("_"))}
    allowed = ["type", "params"] + (["no_decay", "param_groups"] if name == "optimizer" else [])
    extra = set(raw) - set(allowed)
    if extra:
        key = sorted(map(str, extra))[0]
        raise ConfigError(f"unknown key '{name}.{key}'{_did_you_mean(key, allowed)}")
    if "type" not in raw or not isinstance(raw["type"], str):
        raise ConfigError(f'{name}.type: required, a string such as "{example}"')
    given_type = raw["type"]
    params = raw.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{name}.params: expected a mapping of keys, got {_show(params)}")
    for key, value in params.items():
        if _is_auto(value):
            raise ConfigError(f"{name}.params.{key}: 'auto' is a Hugging Face Trainer placeholder and "
                              f"there is no Trainer to fill it in; write the number")
    if name == "optimizer":
        canon = given_type.lower()
        if canon in ONE_BIT_OPTIMIZERS:
            raise ConfigError(f"optimizer.type: {given_type} (1-bit communication compression) is out of "
                              f"scope for zerojax; use Adam or Lamb")
        if canon not in OPTIMIZER_PARAMS:
            raise ConfigError(f"optimizer.type: unknown optimizer '{given_type}'"
                              f"{_did_you_mean(canon, list(OPTIMIZER_PARAMS), 'types')}")
        params_cls = OPTIMIZER_PARAMS[canon]
        built = _build(params_cls, params, "optimizer.params", sources, origin)
        sources["optimizer.type"] = _origin_of("optimizer.type", origin)
        groups = {}
        for key in ("no_decay", "param_groups"):
            if raw.get(key) is not None:
                groups[key] = _parse_group_key(key, raw[key])
                sources[f"optimizer.{key}"] = _origin_of(f"optimizer.{key}", origin)
        return OptimizerConfig(type=canon, params=built, **groups)
    canon_map = {k.lower(): k for k in SCHEDULER_PARAMS}
    canon = canon_map.get(given_type.lower())
    if canon is None:
        raise ConfigError(f"scheduler.type: unknown scheduler '{given_type}'"
                          f"{_did_you_mean(given_type, list(SCHEDULER_PARAMS), 'types')}")
    built = _build(SCHEDULER_PARAMS[canon], params, "scheduler.params", sources, origin)
    for req in REQUIRED_SCHEDULER_PARAMS.get(canon, ()):
        if getattr(built, req) is None:
            raise ConfigError(f"scheduler.params.{req}: required by {canon}; add it")
    sources["scheduler.type"] = _origin_of("scheduler.type", origin)
    return SchedulerConfig(type=canon, params=built)


def _patterns(value: Any, path: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(p, str) and p for p in items):
        raise ConfigError(f"{path}: expected a name pattern or a list of them (e.g. [bias, norm, embed]), "
                          f"got {_show(value)}")
    return tuple(items)


def _parse_group_key(key: str, value: Any) -> Any:
    """optimizer.no_decay (patterns) and optimizer.param_groups (a list of groups), checked."""
    if key == "no_decay":
        return () if value == [] else _patterns(value, "optimizer.no_decay")
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"optimizer.param_groups: expected a list of groups such as "
                          f'[{{"match": "embed", "lr_scale": 0.1}}], got {_show(value)}')
    groups = []
    for i, g in enumerate(value):
        path = f"optimizer.param_groups[{i}]"
        if not isinstance(g, Mapping):
            raise ConfigError(f"{path}: expected a mapping with match, lr_scale and/or weight_decay, got {_show(g)}")
        unknown = sorted(set(map(str, g)) - {"match", "lr_scale", "weight_decay"})
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}: unknown key; a group has match, lr_scale and weight_decay")
        if "match" not in g:
            raise ConfigError(f"{path}.match: required: the name pattern(s) of the group's parameters")
        lr_scale = _coerce(g.get("lr_scale", 1.0), float, f"{path}.lr_scale", {})
        wd = g.get("weight_decay")
        wd = None if wd is None else _coerce(wd, float, f"{path}.weight_decay", {})
        if lr_scale < 0 or (wd is not None and wd < 0):
            raise ConfigError(f"{path}: lr_scale and weight_decay must be >= 0")
        if lr_scale == 1.0 and wd is None:
            raise ConfigError(f"{path}: sets neither lr_scale nor weight_decay, so it changes nothing; "
                              f"give one or remove the group")
        groups.append(ParamGroup(_patterns(g["match"], f"{path}.match"), lr_scale, wd))
    return tuple(groups)


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    return None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        return "a list of " + _type_name(typing.get_args(tp)[0]) + "s"
    if origin is tuple:
        return "a list of " + str(len(typing.get_args(tp))) + " numbers"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, path: str, meta: Mapping[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return _coerce(value, inner, path, meta)

    def bad() -> ConfigError:
        zero_one = " (or 0/1)" if meta.get("int_bool") else ""
        return ConfigError(f"{path}: expected {_type_name(tp)}{zero_one}, got {_show(value)}")

    if tp is bool:
        if isinstance(value, bool):
            out: Any = value
        elif meta.get("int_bool") and isinstance(value, int) and value in (0, 1):
            out = bool(value)
        else:
            raise bad()
    elif tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise bad()
        out = value
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        out = float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise bad()
        out = value
    elif origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        if not isinstance(value, (list, tuple)):
            raise bad()
        out = tuple(_coerce(v, typing.get_args(tp)[0], f"{path}[{i}]", {}) for i, v in enumerate(value))
    elif origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad()
        out = tuple(_coerce(v, a, f"{path}[{i}]", {}) for i, (v, a) in enumerate(zip(value, args)))
    else:  # pragma: no cover - schema types are the ones above
        out = value
    choices = meta.get("choices")
    if choices:
        if isinstance(out, str):
            match = {str(c).lower(): c for c in choices}.get(out.lower())
            if match is None:
                raise ConfigError(f"{path}: '{out}' is not one of {', '.join(map(str, choices))}")
            out = match
        elif out not in choices:
            raise ConfigError(f"{path}: {_show(out)} is not one of {', '.join(map(str, choices))}")
    if isinstance(out, float) and out != out:
        raise ConfigError(f"{path}: NaN is not a usable value; write a number")
    for bound, ok, word in (("ge", lambda x, b: x >= b, ">="), ("gt", lambda x, b: x > b, ">"),
                            ("le", lambda x, b: x <= b, "<=")):
        b = meta.get(bound)
        if b is not None and isinstance(out, (int, float)) and not ok(out, b):
            raise ConfigError(f"{path}: {_show(out)} must be {word} {b}")
    return out


def _derive(config: Config, sources: dict[str, str]) -> Config:
    """Fill values DeepSpeed derives from other keys, and mark them 'derived'."""
    opt = config.optimizer
    if opt is not None and isinstance(opt.params, AdamParams) and opt.params.weight_decay is None:
        torch_adamw = opt.params.torch_adam and (opt.type == "adamw" or opt.params.adam_w_mode)
        wd = 0.01 if torch_adamw else 0.0
        why = ("torch_adam: torch.optim.AdamW default" if torch_adamw else
               "torch_adam: torch.optim.Adam default" if opt.params.torch_adam else "FusedAdam default")
        opt = dataclasses.replace(opt, params=dataclasses.replace(opt.params, weight_decay=wd))
        sources["optimizer.params.weight_decay"] = f"derived ({why})"
    if opt is not None and opt.type == "adamw" and isinstance(opt.params, AdamParams):
        if sources.get("optimizer.params.adam_w_mode") and not opt.params.adam_w_mode:
            raise ConfigError("optimizer.params.adam_w_mode: false contradicts type AdamW; "
                              "use type Adam for L2-style weight decay")
    config = dataclasses.replace(config, optimizer=opt)

    sched = config.scheduler
    if sched is not None:
        p = sched.params
        if type(p) is WarmupLRParams and p.warmup_max_lr is None and config.optimizer is not None:
            # WarmupDecayLR keeps 0.001; with the optimizer from code there is no lr to default to
            p = dataclasses.replace(p, warmup_max_lr=config.optimizer.params.lr)
            sources["scheduler.params.warmup_max_lr"] = "derived (optimizer.params.lr)"
        if isinstance(p, OneCycleParams):
            if p.cycle_second_step_size is None:
                p = dataclasses.replace(p, cycle_second_step_size=p.cycle_first_step_size)
                sources["scheduler.params.cycle_second_step_size"] = "derived (cycle_first_step_size)"
            if p.cycle_second_stair_count is None:
                p = dataclasses.replace(p, cycle_second_stair_count=p.cycle_first_stair_count)
                sources["scheduler.params.cycle_second_stair_count"] = "derived (cycle_first_stair_count)"
        config = dataclasses.replace(config, scheduler=dataclasses.replace(sched, params=p))

    zero = config.zero_optimization
    if zero.overlap_comm is None:
        zero = dataclasses.replace(zero, overlap_comm=zero.stage == 3)
        sources["zero_optimization.overlap_comm"] = "derived (true for stage 3)"
    if zero.cpu_offload:
        if zero.offload_optimizer.device not in ("none", "cpu"):
            raise ConfigError("zero_optimization.cpu_offload: true contradicts offload_optimizer.device="
                              f"{zero.offload_optimizer.device}; keep only offload_optimizer")
        zero = dataclasses.replace(zero, offload_optimizer=dataclasses.replace(zero.offload_optimizer,
                                                                               device="cpu"))
        sources["zero_optimization.offload_optimizer.device"] = "derived (cpu_offload: true)"
    if zero.cpu_offload_param:
        if zero.offload_param.device not in ("none", "cpu"):
            raise ConfigError("zero_optimization.cpu_offload_param: true contradicts offload_param.device="
                              f"{zero.offload_param.device}; keep only offload_param")
        zero = dataclasses.replace(zero, offload_param=dataclasses.replace(zero.offload_param, device="cpu"))
        sources["zero_optimization.offload_param.device"] = "derived (cpu_offload_param: true)"
    if zero.offload_param.device != "none" and zero.stage != 3:
        # DeepSpeed reads offload_param only in stage 3; stages 0-2 keep parameters on the device.
        _warn(sources, "zero_optimization.offload_param",
              f"ignored at stage {zero.stage}, as DeepSpeed ignores it (parameter offload is a stage-3 "
              f"feature); effect: none, parameters stay on the device; set zero_optimization.stage=3 to "
              f"offload them", f"ignored (stage {zero.stage}; DeepSpeed reads it at stage 3 only)")
        zero = dataclasses.replace(zero, offload_param=OffloadParamConfig())
    config = dataclasses.replace(config, zero_optimization=zero)

    config = _derive_model(config, sources)
    if config.run.log_every is None:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run,
                                                                     log_every=config.steps_per_print))
        sources["run.log_every"] = "derived (steps_per_print)"
    return _derive_non_finite(_derive_data_source(config, sources), sources)


def _derive_model(config: Config, sources: dict[str, str]) -> Config:
    """Model keys not given: from `model.hf_checkpoint`'s config.json, then each family's defaults."""
    m = config.model
    if m.hf_checkpoint is not None:
        from zerojax.hf import model_keys  # reads config.json only
        found, where = model_keys(m.hf_checkpoint, m.seq_len if "model.seq_len" in sources else None)
        changes = {}
        for key, value in found.items():
            path = f"model.{key}"
            if path in sources and getattr(m, key) != value:
                raise ConfigError(f"{path}: {getattr(m, key)} given, but the checkpoint model.hf_checkpoint "
                                  f"names has {value} ({where}); remove {path} from the config to take the "
                                  f"checkpoint's value, or choose a checkpoint of that size")
            if path not in sources:
                changes[key] = value
                sources[path] = f"derived (model.hf_checkpoint {where})"
        m = dataclasses.replace(m, **changes)
    if m.d_ff is None:
        if m.name == "llama":
            d_ff, why = -(-8 * m.d_model // 3 // 64) * 64, "8/3 * d_model rounded up to a multiple of 64"
        else:
            d_ff, why = 4 * m.d_model, "4 * d_model"
        m = dataclasses.replace(m, d_ff=d_ff)
        sources["model.d_ff"] = f"derived ({why})"
    if m.n_kv_heads is None:
        m = dataclasses.replace(m, n_kv_heads=m.n_heads)
        sources["model.n_kv_heads"] = "derived (n_heads)"
    if m.norm_eps is None:
        m = dataclasses.replace(m, norm_eps=1e-5 if m.name == "llama" else 1e-6)
        sources["model.norm_eps"] = f"derived ({m.name}'s default)"
    return dataclasses.replace(config, model=m)


def _derive_non_finite(config: Config, sources: dict[str, str]) -> Config:
    """`run.non_finite: skip_step` is bf16's skip-on-overflow, for bf16 and fp32 alike."""
    if config.run.non_finite != "skip_step" or config.bf16.check_grad_overflow:
        return config
    sources["bf16.check_grad_overflow"] = "derived (run.non_finite: skip_step)"
    return dataclasses.replace(config, bf16=dataclasses.replace(config.bf16, check_grad_overflow=True))


def _derive_data_source(config: Config, sources: dict[str, str]) -> Config:
    """A `data.path` means "train on this file": it implies `data.source` (jsonl for *.jsonl, tokens for
    *.bin, else file) unless the source is written; a written `stdlib` next to a path would silently
    ignore the file, so that is an error."""
    data = config.data
    if data.path is None:
        return config
    if "data.source" not in sources:
        suffix = Path(data.path).suffix.lower()
        source = {".jsonl": "jsonl", ".bin": "tokens"}.get(suffix, "file")
        sources["data.source"] = f"derived (data.path is given{f', {suffix}' if source != 'file' else ''})"
        return dataclasses.replace(config, data=dataclasses.replace(data, source=source))
    if data.source == "stdlib":
        raise ConfigError(f"data.path: {data.path} is given but data.source is '{data.source}', which "
                          f"ignores it; set data.source: file (or jsonl, tokens) to train on the file, or "
                          f"remove data.path")
    return config


def _check(config: Config, sources: Mapping[str, str] | None = None) -> None:
    """Cross-key rules that need no devices."""
    if config.fp16.enabled and config.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled: both true; choose one precision")
    _check_batch_keys(config, sources or {})
    if config.optimizer is not None:
        _check_optimizer(config)
    _check_sections(config)


def _check_optimizer(config: Config) -> None:
    opt = config.optimizer
    if config.zero_optimization.stage > 0 and opt.type not in ZERO_TESTED_OPTIMIZERS \
            and not config.zero_allow_untested_optimizer:
        raise ConfigError(f"optimizer.type: {opt.type} is not among DeepSpeed's ZeRO-tested optimizers "
                          f"({', '.join(sorted(ZERO_TESTED_OPTIMIZERS))}); set "
                          f"zero_allow_untested_optimizer: true to use it with ZeRO stage "
                          f"{config.zero_optimization.stage}")
    if isinstance(opt.params, AdamParams) and opt.params.amsgrad:
        raise ConfigError("optimizer.params.amsgrad: not supported (DeepSpeed's fused Adam rejects it "
                          "too); remove it")
    for i, b in enumerate(getattr(opt.params, "betas", ())):
        if not 0.0 <= b < 1.0:
            raise ConfigError(f"optimizer.params.betas[{i}]: {b} must be in [0, 1)")
    if isinstance(opt.params, LambParams) and opt.params.max_grad_norm:
        raise ConfigError("optimizer.params.max_grad_norm: not supported in the optimizer (DeepSpeed "
                          "rejects it too); use the top-level gradient_clipping")
    if isinstance(opt.params, SGDParams) and opt.params.nesterov and (
            opt.params.momentum <= 0 or opt.params.dampening != 0):
        raise ConfigError("optimizer.params.nesterov: needs momentum > 0 and dampening 0 (as in torch)")
    if isinstance(opt.params, LambParams) and opt.params.min_coeff > opt.params.max_coeff:
        raise ConfigError("optimizer.params.min_coeff: larger than max_coeff; swap them")


def _check_averaging(config: Config) -> None:
    """DeepSpeed's rules for prescale_gradients / gradient_predivide_factor (see step.grad_average)."""
    zero = config.zero_optimization
    keys = [k for k, on in (("prescale_gradients", config.prescale_gradients),
                            ("gradient_predivide_factor", config.gradient_predivide_factor != 1.0)) if on]
    if not keys:
        return
    key = keys[0]
    if config.mesh.stage > 1:
        raise ConfigError(f"{key}: not built for pipeline runs (mesh.stage {config.mesh.stage}), whose "
                          f"gradients are averaged in the loss; remove it")
    if zero.stage >= 2 and zero.reduce_scatter:
        # DeepSpeed's stage_1_and_2.py / stage3.py assert the same with reduce-scatter enabled.
        raise ConfigError(f"{key}: not supported with ZeRO stage {zero.stage} and reduce_scatter (DeepSpeed "
                          f"asserts the same: its reduce-scatter divides by the data-parallel size before "
                          f"the sum); remove it, or set zero_optimization.reduce_scatter: false"
                          + (" at stage 2" if zero.stage == 3 else ""))
    if zero.stage == 3:
        raise ConfigError(f"{key}: not supported at ZeRO stage 3: the gradient reduce-scatter is the "
                          f"transpose of the parameter gather inside the backward pass, so nothing can "
                          f"run between a gradient and its sum; remove it, or use stage 2 with "
                          f"reduce_scatter: false")
    if zero.stage == 1 and zero.reduce_scatter:
        warnings.warn(f"{key}: ignored at ZeRO stage 1 with reduce_scatter (DeepSpeed's reduce-scatter path "
                      f"divides by the data-parallel size before the sum and ignores it too); set "
                      f"zero_optimization.reduce_scatter: false to use it", ConfigWarning, stacklevel=4)


def _check_sections(config: Config) -> None:
    _check_averaging(config)
    from zerojax.hlo import OP_NAMES
    for i, name in enumerate(config.comms_logger.prof_ops):
        if name not in OP_NAMES:
            raise ConfigError(f"comms_logger.prof_ops[{i}]: '{name}' is not a collective; use one of "
                              f"all_reduce, reduce_scatter, all_gather, all_to_all, collective_permute")
    zero = config.zero_optimization
    ac = config.activation_checkpointing
    if ac.cpu_checkpointing and ac.policy == "everything":
        raise ConfigError("activation_checkpointing.cpu_checkpointing: policy 'everything' keeps every "
                          "intermediate on the device and recomputes nothing, so there is nothing to offload; "
                          "choose policy nothing, dots_no_batch or dots, or set cpu_checkpointing: false")
    if config.mesh.stage > 1 and (ac.policy is not None or ac.cpu_checkpointing):
        key = "policy" if ac.policy is not None else "cpu_checkpointing"
        raise ConfigError(f"activation_checkpointing.{key}: not applied to pipeline stages (mesh.stage is "
                          f"{config.mesh.stage}); remove it and use pipeline.activation_checkpoint_interval, "
                          "which rematerializes runs of layers inside each stage")
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer.device: offload needs ZeRO stage 1, 2 or 3 "
                          "(stage is 0); set zero_optimization.stage or remove offload_optimizer")
    for key in ("offload_optimizer", "offload_param"):
        if getattr(zero, key).device == "nvme":
            raise ConfigError(_NVME_REFUSED.format(key=key))
    pipe = config.pipeline
    if pipe.chunks > 1 and pipe.schedule != "interleaved":
        raise ConfigError(f"pipeline.chunks: {pipe.chunks} chunks per stage need pipeline.schedule: "
                          f"interleaved (got {pipe.schedule}); set the schedule or chunks: 1")
    if pipe.schedule == "interleaved" and pipe.chunks < 2:
        raise ConfigError("pipeline.chunks: the interleaved schedule needs at least 2 chunks per stage; "
                          "set pipeline.chunks: 2 (or more)")
    sched = config.scheduler
    if sched is not None and sched.type == "OneCycle":
        p = sched.params
        if p.cycle_min_lr > p.cycle_max_lr:
            raise ConfigError("scheduler.params.cycle_min_lr: larger than cycle_max_lr; swap them")
    m = config.model
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.n_heads: {m.n_heads} does not divide model.d_model {m.d_model}; "
                          f"choose a divisor such as {next(h for h in (8, 4, 2, 1) if m.d_model % h == 0)}")
    if m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: {m.n_kv_heads} does not divide model.n_heads {m.n_heads}; "
                          f"each key/value head serves a whole group of query heads, so choose a divisor")
    if m.name == "gpt" and m.n_kv_heads not in (None, m.n_heads):
        raise ConfigError(f"model.n_kv_heads: {m.n_kv_heads} differs from n_heads, but the gpt model has "
                          f"plain multi-head attention; remove it, or set model.name: llama")
    if m.name == "gpt" and m.tie_embeddings:
        raise ConfigError("model.tie_embeddings: the gpt model keeps its own LM head; remove it, or set "
                          "model.name: llama")
    data = config.data
    if data.source != "stdlib" and not data.path:
        kind = {"file": "a text file", "jsonl": "a JSONL file", "tokens": "a token file"}[data.source]
        raise ConfigError(f"data.path: required when data.source is '{data.source}'; give {kind}")
    if data.source == "jsonl" and not data.tokenizer:
        raise ConfigError("data.tokenizer: data.source: jsonl needs a tokenizer; give the path of a "
                          "tokenizer.json (Hugging Face `tokenizers` format)")
    if data.source == "tokens" and data.tokenizer:
        raise ConfigError("data.tokenizer: a data.source: tokens file is already tokenized; remove "
                          "data.tokenizer (the model's vocab_size must cover its ids)")


def _check_batch_keys(config: Config, sources: Mapping[str, str]) -> None:
    """The triad rules that hold for any data-parallel size: one of the two batch sizes is needed."""
    if config.train_batch_size is not None or config.train_micro_batch_size_per_gpu is not None:
        return
    auto = [k for k in BATCH_KEYS if sources.get(k) == "derived ('auto')"]
    if auto:
        raise ConfigError(f"{auto[0]}: 'auto' has nothing to be derived from; write "
                          f"train_micro_batch_size_per_gpu (rows per device per micro-step) or "
                          f"train_batch_size as a number ('auto' may stay on the others)")
    if config.gradient_accumulation_steps is not None:
        raise ConfigError("train_batch_size: gradient_accumulation_steps alone cannot fix the batch; "
                          "also give train_batch_size or train_micro_batch_size_per_gpu")
    raise ConfigError("train_batch_size: give train_batch_size or train_micro_batch_size_per_gpu")


_NVME_REFUSED = ("zero_optimization.{key}.device: nvme is not supported (DeepSpeed's ZeRO-Infinity NVMe "
                 "swapping is not built in zerojax); use cpu (host memory, docs/offload.md) or none")


def unsupported_features(config: Config) -> list[str]:
    """Keys that parse and validate but whose feature is not built yet: using them is an error."""
    out = []
    zero = config.zero_optimization
    if config.fp16.fp16_master_weights_and_grads:
        out.append("fp16.fp16_master_weights_and_grads: not supported; master weights stay fp32")
    for key in ("offload_optimizer", "offload_param"):
        if getattr(zero, key).device == "nvme":
            out.append(_NVME_REFUSED.format(key=key))
    if zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.ratio < 1.0:
        out.append(f"zero_optimization.offload_optimizer.ratio: {zero.offload_optimizer.ratio} (partial "
                   f"offload) is not supported; use 1.0")
    if not zero.ignore_unused_parameters:
        out.append("zero_optimization.ignore_unused_parameters: false is not supported (DeepSpeed raises for a "
                   "parameter that received no gradient; JAX differentiates every parameter, giving unused ones "
                   "zero gradients, so none can be told apart); remove the key, or drop the unused parameters "
                   "from the model")
    if zero.mics_shard_size > 0:
        out.append("zero_optimization.mics_shard_size: MiCS is not supported; use -1")
    if config.wandb.enabled:
        out.append("wandb.enabled: not supported (no network access); use tensorboard or csv_monitor")
    return out


def check_supported(config: Config) -> None:
    problems = unsupported_features(config)
    if problems:
        raise ConfigError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


# ---------------------------------------------------------------------------------------------

def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        out = {}
        if isinstance(obj, (OptimizerConfig, SchedulerConfig)):
            out = {"type": obj.type, "params": _to_plain(obj.params)}
            for key in ("no_decay", "param_groups"):  # written only when set: DeepSpeed has neither
                if getattr(obj, key, ()):
                    out[key] = _to_plain(getattr(obj, key))
            return out
        for f in schema_fields(type(obj)):
            out[f.name] = _to_plain(getattr(obj, f.name))
        return out
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    return obj


def _flatten(d: Mapping[str, Any], prefix: str = "") -> Any:
    for k, v in d.items():
        path = _join(prefix, k)
        if isinstance(v, Mapping) and v:
            yield from _flatten(v, path)
        else:
            yield path, v
