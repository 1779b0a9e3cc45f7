"""DeepSpeed sections zerojax does not build: loaded with one warning, or refused with the reason.
"""
from __future__ import annotations

import typing
from typing import Any, Callable, Mapping, Sequence

from zerojax.errors import ConfigError
from zerojax.config.fields import warn_ignored


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


def _refuse_above_one(why: str) -> Callable[[Any], str | None]:
    return lambda value: why if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and value > 1 else None


def _refuse_given(why: str) -> Callable[[Any], str | None]:
    return lambda value: why if value is not None else None


_NO_EFFECT = "none: it changes how fast or where DeepSpeed runs, not what it computes"


FOREIGN_KEYS: dict[str, Foreign] = {
    # top level
    "compile": Foreign("torch.compile of the model", "none: the whole step is always compiled by XLA "
                       "under jax.jit", "nothing to do"),
    "autotuning": Foreign("the autotuner, which launches trial runs to pick batch size and ZeRO knobs",
                          "none on this run", "choose train_micro_batch_size_per_gpu and the stage yourself"),
    "data_efficiency": Foreign("curriculum learning and data routing", "none while disabled",
                               "order or filter the batches you pass to train_batch",
                               _refuse_if_enabled("enabled: it changes which tokens each step trains on"), refused_when="enabled"),
    "curriculum_learning": Foreign("legacy curriculum learning", "none while disabled",
                                   "order or filter the batches you pass to train_batch",
                                   _refuse_if_enabled("enabled: it changes which tokens each step trains on"), refused_when="enabled"),
    "seq_parallel_communication_data_type": Foreign("the dtype of sequence-parallel collectives",
                                                    "none: the all-to-alls move the compute dtype", "nothing to do"),
    "disable_allgather": Foreign("broadcasts instead of all-gathers in ZeRO-1/2", _NO_EFFECT,
                                 "nothing to do: XLA picks the collectives"),
    "comms_config": Foreign("the communication logger's settings object", _NO_EFFECT, "comms_logger"),
    "monitor_config": Foreign("the monitors' settings object", "none", "tensorboard / csv_monitor / wandb / comet"),
    "sparse_gradients": Foreign("sparse all-reduce of embedding gradients", _NO_EFFECT, "nothing to do"),
    "graph_harvesting": Foreign("CUDA graph capture", _NO_EFFECT, "nothing to do: XLA compiles the step"),
    "timers": Foreign("throughput timers", "none", "wall_clock_breakdown"),
    "nebula": Foreign("the Nebula asynchronous checkpoint service", "none on training",
                      "checkpoint.async_save"),
    "datastates": Foreign("the DataStates asynchronous checkpoint engine", "none on training",
                          "checkpoint.async_save"),
    "eigenvalue": Foreign("Hessian eigenvalue estimation (for MoQ)", "none on the update", "nothing to do"),
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
    # tensor_parallel: Python objects that deepspeed.initialize fills in, never a JSON value
    "tensor_parallel.tp.mpu": Foreign("model-parallel unit (an mpu object)", "none while null",
                                      "mesh.tensor: the mesh's tensor axis is the tensor group",
                                      _refuse_given("it is a Python object of torch process groups"),
                                      refused_when="not null"),
    "tensor_parallel.tp.tp_group": Foreign("tensor-parallel process group", "none while null",
                                           "mesh.tensor: the mesh's tensor axis is the tensor group",
                                           _refuse_given("it is a torch process group"), refused_when="not null"),
    "tensor_parallel.injection_policy_tuple": Foreign(
        "AutoTP injection policy (torch module classes to replace)", "none while null",
        "tensor_parallel.partition_config.layer_specs or preset_model",
        _refuse_given("it names torch module classes"), refused_when="not null"),
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
    "zero_optimization.leaf_module": Foreign("modules fetched as one unit at stage 3 (DeepSpeed's fix for MoE "
                                             "hangs: ranks whose experts differ fetch different parameters)",
                                             "none by design: stage-3 gathers follow the loss's jaxpr, whose order "
                                             "is fixed and the same on every process (and processes whose programs "
                                             "differ are refused before step 0)", "nothing to do"),
    "zero_optimization.mics_hierarchical_params_gather": Foreign("MiCS's hierarchical all-gather",
                                                                 _NO_EFFECT, "nothing to do"),
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
    "zero_optimization.offload_optimizer.pipeline": Foreign("NVMe pipelining", "none", "nothing to do"),
    "zero_optimization.offload_optimizer.super_offload": Foreign("SuperOffload's CPU optimizer pipeline",
                                                                 _NO_EFFECT, "compute: host"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": Foreign("CPU cores for the host Adam",
                                                                      _NO_EFFECT, "nothing to do"),
    "zero_optimization.grad_hooks": Foreign("backward hooks that reduce ZeRO-1 gradients during the backward "
                                            "pass instead of after it", _NO_EFFECT,
                                            "nothing to do: XLA overlaps the reductions itself"),
    # optimizer
    "optimizer.legacy_fusion": Foreign("legacy fused-Adam kernel in its fp16 optimizer (FP16_Optimizer's "
                                       "fused_adam_legacy)", "none: an implementation selector; the update is "
                                       "the configured optimizer's either way", "nothing to do"),
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


def accept_foreign(path: str, value: Any, sources: dict[str, str]) -> bool:
    """Accept a DeepSpeed-only key with one warning, or refuse it; False when `path` is not one."""
    known = FOREIGN_KEYS.get(path)
    if known is None:
        return False
    reason = known.refuse(value) if known.refuse is not None else None
    if reason is not None:
        raise ConfigError(f"{path}: DeepSpeed's {known.what} is not built in zerojax, and {reason}; "
                          f"alternative: {known.alternative}; remove the key or turn it off")
    warn_ignored(sources, path, f"DeepSpeed's {known.what}: not built in zerojax; effect: {known.effect}; "
                         f"alternative: {known.alternative}", "ignored (DeepSpeed-only key, not built)")
    return True


def foreign_keys_in(prefix: str) -> list[str]:
    """The DeepSpeed-only keys that live directly in section `prefix`, for suggestions."""
    depth = prefix.count(".") + 1 if prefix else 0
    return [p.rsplit(".", 1)[-1] for p in FOREIGN_KEYS
            if p.count(".") == depth and (not prefix or p.startswith(prefix + "."))]
