"""What the config decides for the core, section by section, as the plain records the core takes.

Dtypes and the loss scaler (`fp16`, `bf16`, `data_types`), memory kinds (`offload_*`) and the
activation-checkpointing policy: each function reads one area of the config and returns a small
record of `zerojax.core`; the plan builder calls them once per run.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from zerojax.config import OPTIMIZER_PARAMS, ActivationCheckpointingConfig, Config
from zerojax.core.offload import Memory, host_update_supported
from zerojax.core.swap import Swap
from zerojax.core.precision import DTYPES, Policy, ScalerConfig
from zerojax.core.remat import Remat
from zerojax.errors import ConfigError
from zerojax.optim.deepspeed import PER_TENSOR_OPTIMIZERS, is_elementwise


def policy(config: Config) -> Policy:
    """The dtypes of a config, with DeepSpeed's rule for the gradient accumulator.

    `data_types.grad_accum_dtype` defaults to the model dtype (DeepSpeed's engine since 0.17.6;
    before, bf16 without ZeRO accumulated in fp32). Without ZeRO (stage 0) DeepSpeed accepts no other
    accumulator dtype (its optimizer sanity check raises "unsupported mix"); with ZeRO a different
    one is a separate accumulator, which zerojax keeps too.
    """
    param = DTYPES[config.compute_dtype]
    accum = DTYPES[config.data_types.grad_accum_dtype] if config.data_types.grad_accum_dtype else param
    if config.zero_optimization.stage == 0 and jnp.dtype(accum) != jnp.dtype(param):
        raise ConfigError(
            f"data_types.grad_accum_dtype: '{config.data_types.grad_accum_dtype}' differs from the model "
            f"dtype {config.compute_dtype} at zero_optimization.stage 0; without ZeRO DeepSpeed accumulates "
            f"gradients in the model dtype and rejects other mixes; remove the key to accumulate in "
            f"{config.compute_dtype}, or use zero_optimization.stage 1 or higher for a separate "
            f"{config.data_types.grad_accum_dtype} accumulator")
    comm = DTYPES[config.communication_data_type] if config.communication_data_type else None
    return Policy(param=jnp.dtype(param), master=jnp.dtype(jnp.float32), accum=jnp.dtype(accum),
                  comm=None if comm is None else jnp.dtype(comm))



def scaler_config(config: Config) -> ScalerConfig:
    fp16 = config.fp16
    dynamic = fp16.enabled and fp16.loss_scale == 0
    if dynamic:
        initial = 2.0 ** fp16.initial_scale_power
    else:
        initial = fp16.loss_scale if fp16.enabled else 1.0
    check = fp16.enabled or config.bf16.check_grad_overflow
    return ScalerConfig(dynamic=dynamic, check_finite=check,
                        initial=float(initial), window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                        consecutive=fp16.consecutive_hysteresis, min_scale=float(fp16.min_loss_scale),
                        limit=config.run.non_finite_limit if check and not dynamic else 0)


def _kind(pin_memory: bool) -> str:
    return "pinned_host" if pin_memory else "unpinned_host"



def _available_kinds(mesh: Mesh) -> set[str]:
    device = mesh.devices.flat[0]
    try:
        return {m.kind for m in device.addressable_memories()}
    except Exception:  # backends without the memories API
        return set()



def memory_plan(config: Config, mesh: Mesh, kernels: str = "xla") -> Memory:
    """Memory kinds from `zero_optimization.offload_*`, checked against the mesh's backend, and the
    parameters' swap files with `offload_param.device: nvme` (`core.param_swap`)."""
    memory = _memory_kinds(config, mesh, kernels)
    param_cfg = config.zero_optimization.offload_param
    if param_cfg.device != "nvme":
        return memory
    swap = Swap(path=str(param_cfg.nvme_path), buffer_count=param_cfg.buffer_count, tile=param_cfg.buffer_size,
                read_ahead=True, write_behind=True, threads=config.aio.thread_count, in_memory=param_cfg.max_in_cpu)
    return dataclasses.replace(memory, param_swap=swap)


def _memory_kinds(config: Config, mesh: Mesh, kernels: str = "xla") -> Memory:
    """Memory kinds from `zero_optimization.offload_*`, checked against the mesh's backend.

    `kernels` is the plan's update backend: fused Pallas kernels run on the device, so with them
    the update stays there (the state still lives on the host between steps).

    Every failure is a ConfigError naming the key, raised before anything is compiled (the probe
    for `compute: auto` compiles an 8-element function once per backend).
    """
    zero = config.zero_optimization
    opt_cfg, param_cfg = zero.offload_optimizer, zero.offload_param
    if opt_cfg.device == "nvme":
        return _nvme_plan(config, mesh)
    optimizer = _kind(opt_cfg.pin_memory) if opt_cfg.device == "cpu" else None
    params = _kind(param_cfg.pin_memory) if param_cfg.device == "cpu" else None
    if optimizer is None and params is None:
        return Memory()
    if isinstance(mesh, jax.sharding.AbstractMesh):  # byte counting only: no backend to ask
        return Memory(params=params, optimizer=optimizer, update="host" if opt_cfg.compute == "host" else "device")
    available = _available_kinds(mesh)
    platform = mesh.devices.flat[0].platform
    for key, kind in (("offload_optimizer", optimizer), ("offload_param", params)):
        if kind is not None and kind not in available:
            raise ConfigError(
                f"zero_optimization.{key}.device: cpu needs the '{kind}' memory kind, but the {platform} "
                f"backend's devices offer {sorted(available) or 'none'}; set zero_optimization.{key}.device: "
                f"none" + (" (or pin_memory: false)" if kind == "pinned_host" and "unpinned_host" in available
                           else ""))
    update = "device"
    if optimizer is not None:
        elementwise = is_elementwise(config.optimizer.type)
        if opt_cfg.compute == "host":
            if kernels != "xla":
                raise ConfigError(f"zero_optimization.offload_optimizer.compute: host runs the optax update on the "
                                  f"host, but kernels resolve to {kernels} (fused on the device); use compute: "
                                  f"device (or auto), or kernels: xla")
            if not elementwise:
                others = sorted(set(OPTIMIZER_PARAMS) - PER_TENSOR_OPTIMIZERS)
                raise ConfigError(f"zero_optimization.offload_optimizer.compute: host runs elementwise optimizers "
                                  f"only ({', '.join(others)}); {config.optimizer.type} "
                                  f"needs norms across shards: use compute: device (or auto)")
            if not host_update_supported(platform, optimizer):
                raise ConfigError(f"zero_optimization.offload_optimizer.compute: host - the {platform} backend "
                                  f"cannot compile the update on the host here; use compute: device (or auto)")
            update = "host"
        elif (opt_cfg.compute == "auto" and kernels == "xla" and elementwise
              and host_update_supported(platform, optimizer)):
            update = "host"
    return Memory(params=params, optimizer=optimizer, update=update)


def _nvme_plan(config: Config, mesh: Mesh) -> Memory:
    """`offload_optimizer.device: nvme` (ZeRO-Infinity): the master copy and optimizer moments in files,
    updated on the host tile by tile (`core.swap`, `core.nvme_step`). A whole state (at start, in a
    checkpoint) passes through host memory when the backend has it. Parameters stay where
    `offload_param` puts them (nvme: in their own files, `memory_plan`)."""
    zero = config.zero_optimization
    opt_cfg, param_cfg = zero.offload_optimizer, zero.offload_param
    if config.optimizer is not None and not is_elementwise(config.optimizer.type):
        others = sorted(set(OPTIMIZER_PARAMS) - PER_TENSOR_OPTIMIZERS)
        raise ConfigError(f"zero_optimization.offload_optimizer.device: nvme updates the state tile by tile on "
                          f"the host, which needs an elementwise optimizer ({', '.join(others)}); "
                          f"{config.optimizer.type} needs whole tensors: use device: cpu")
    swap = Swap(path=str(opt_cfg.nvme_path), buffer_count=opt_cfg.buffer_count, tile=zero.sub_group_size,
                read_ahead=opt_cfg.pipeline_read, write_behind=opt_cfg.pipeline_write,
                threads=config.aio.thread_count)
    kinds = set() if isinstance(mesh, jax.sharding.AbstractMesh) else _available_kinds(mesh)
    staging = _kind(opt_cfg.pin_memory)
    optimizer = staging if staging in kinds or isinstance(mesh, jax.sharding.AbstractMesh) else None
    params = _kind(param_cfg.pin_memory) if param_cfg.device == "cpu" else None
    if params is not None and not isinstance(mesh, jax.sharding.AbstractMesh) and params not in kinds:
        raise ConfigError(f"zero_optimization.offload_param.device: cpu needs the '{params}' memory kind, which "
                          f"this backend lacks; set zero_optimization.offload_param.device: none")
    return Memory(params=params, optimizer=optimizer, update="host", swap=swap)


def _section(config: Config | ActivationCheckpointingConfig) -> ActivationCheckpointingConfig:
    return config.activation_checkpointing if isinstance(config, Config) else config


def remat_policy(config: Config | ActivationCheckpointingConfig, model_remat: bool | None = None) -> Remat | None:
    """The checkpointing to apply, or None for "as the model is written".

    `model_remat`: the model's own default (the GPT's `model.remat`); with `policy: null` and no
    `cpu_checkpointing` it decides: True keeps layer inputs only (`nothing`), False no remat.
    """
    ac = _section(config)
    save = ac.policy
    if save is None:
        if ac.cpu_checkpointing:
            save = "nothing"
        elif model_remat:
            return Remat("nothing")
        else:
            return None
    if save == "everything" and ac.cpu_checkpointing:
        raise ConfigError("activation_checkpointing.cpu_checkpointing: policy 'everything' keeps every "
                          "intermediate on the device and recomputes nothing, so there is nothing to offload; "
                          "choose policy nothing, dots_no_batch or dots, or set cpu_checkpointing: false")
    return Remat(save, bool(ac.cpu_checkpointing))


def checkpoint(fn: Callable[..., Any], config: Config | ActivationCheckpointingConfig,
               **kwargs: Any) -> Callable[..., Any]:
    """DeepSpeed's `deepspeed.checkpointing.checkpoint`, as a function transform: `fn(x, *rest)`
    checkpointed with the configured policy (`nothing` when the config sets none)."""
    return remat_policy(config, model_remat=True).wrap(fn, **kwargs)
