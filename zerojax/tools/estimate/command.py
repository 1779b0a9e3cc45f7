"""`zerojax estimate`: the request, the model source, and the text it prints."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import jax

from zerojax.config import Config, load_config
from zerojax.errors import ConfigError
from zerojax.tools.estimate.axes import expert_lines, expert_params, sequence_lines
from zerojax.tools.estimate.memory import (CHOICES, GIB, MemoryEstimate, deepspeed_estimate, plan_exact,
                                           recommend, size_unit, variant)
from zerojax.tools.estimate.shapes import ModelShape, counts_model, embedded_model, hf_model, with_adapters
from zerojax.tools.estimate.timing import PRESETS, DeviceSpec, step_time_lines
from zerojax.tools.estimate.tensor import tensor_lines


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str, what: str = "--device-memory") -> float:
    """"80GB" (10^9), "80GiB" (2^30), "80G" (2^30, as DeepSpeed prints GB), or a plain byte count."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{what} {text!r}: expected a size such as 80GiB, 80GB or 85899345920")
    value, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "b":
        return value
    power = "kmgt".index(unit[0]) + 1
    decimal = unit.endswith("b") and "i" not in unit
    return value * (1000 ** power if decimal else 1024 ** power)


def parse_tensor(value: str | int | Sequence[Any] | None) -> tuple[int, ...] | None:
    """`--tensor 8`, `--tensor 1,2,4` or `--tensor 1 2 4` as sizes (None: not given)."""
    if value is None:
        return None
    items = [value] if isinstance(value, (str, int)) else list(value)
    try:
        sizes = tuple(int(x) for item in items for x in str(item).replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"--tensor {value!r}: expected sizes such as 8 or 1,2,4,8") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--tensor {value!r}: sizes must be positive")
    return tuple(sorted(set(sizes)))


@dataclasses.dataclass(frozen=True)
class Request:
    """What `zerojax estimate` was asked (CLI arguments, resolved)."""
    devices: int
    devices_per_host: int
    device: DeviceSpec | None = None
    device_memory: float | None = None
    host_memory: float | None = None
    activations: int | None = None   # bytes per device beyond model state (None: the GPT's estimate or 0)
    zero_init: bool = True
    additional_buffer_factor: float = 1.5
    step_time: bool = True
    compiled: bool = False   # the embedded GPT's step time from its compiled step (compiles 4 steps)
    tensor: tuple[int, ...] | None = None   # tensor sizes to show (None: divisors of devices per host)


def choose_model(config: Config, model: str | None = None, hf_config: str | None = None,
                 params: int | None = None, largest_layer: int | None = None) -> ModelShape:
    """One model source: `--hf-config`, `--params`/`--largest-layer`, or the config's embedded model."""
    given = [name for name, v in (("--model", model), ("--hf-config", hf_config), ("--params", params)) if v]
    if len(given) > 1:
        raise ConfigError(f"estimate: give one model source, got {' and '.join(given)}")
    if (params is None) != (largest_layer is None):
        raise ConfigError("estimate: --params and --largest-layer go together (DeepSpeed's total_params and "
                          "largest_layer_params)")
    if hf_config:
        return with_adapters(hf_model(hf_config), config)
    if params is not None:
        return counts_model(int(params), int(largest_layer))
    if model not in (None, config.model.name):
        from zerojax.config import ModelConfig
        choices = dataclasses.fields(ModelConfig)[0].metadata.get("choices") or (config.model.name,)
        if model not in choices:
            raise ConfigError(f"estimate --model {model}: the embedded models are {', '.join(choices)}; for another "
                              f"model pass --hf-config path/config.json or --params N --largest-layer N")
        config = load_config(config, [f"model.name={model}"])
    return embedded_model(config)


def estimate_all(config: Config, model: ModelShape, req: Request) -> tuple[list[MemoryEstimate], list[MemoryEstimate]]:
    """Plan-exact and DeepSpeed estimates for every choice in CHOICES order."""
    exact = [plan_exact(config, model, req.devices, req.devices_per_host, c) for c in CHOICES]
    ds = [deepspeed_estimate(model, req.devices, req.devices_per_host, c, req.zero_init, req.additional_buffer_factor)
          for c in CHOICES]
    return exact, [d for d in ds if d is not None]


def report(config: Config, model: ModelShape, req: Request) -> str:
    """The whole text `zerojax estimate` prints."""
    if config.mesh.stage > 1:
        raise ConfigError(f"estimate: mesh.stage {config.mesh.stage} (pipeline) is not estimated; set mesh.stage=1")
    if config.mesh.tensor > 1:  # the config's tensor size is one of the rows; the data-parallel table is T=1
        req = dataclasses.replace(req, tensor=req.tensor or tuple(sorted({1, config.mesh.tensor})))
        config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, tensor=1))
    # the data-parallel table is every device ZeRO shards over; the expert and sequence tables follow it
    sequence = config.mesh.sequence > 1
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, expert=1, sequence=1))
    if req.devices < 1 or req.devices_per_host < 1:
        raise ConfigError("estimate: --devices and --devices-per-host must be positive")
    exact, ds = estimate_all(config, model, req)
    ds_by = {d.choice: d for d in ds}
    hosts = math.ceil(req.devices / req.devices_per_host)
    unit, scale = size_unit([e.device_bytes for e in exact] + [e.host_bytes for e in exact + ds])

    def num(b: float) -> str:
        return f"{b / scale:11.2f}"
    lines = [f"model: {model.name}: {model.total_params:,} parameters, largest layer {model.largest_layer_params:,}"
             + ("" if model.exact_shapes else " (synthetic shapes from the two counts)"),
             f"cluster: {req.devices} devices, {min(req.devices_per_host, req.devices)} per host ({hosts} hosts); "
             f"precision {config.compute_dtype}, optimizer {config.optimizer.type}",
             "",
             f"model states (parameters, gradients, optimizer state), {unit}:",
             f"{'':<31}{'plan-exact':^23}   {'DeepSpeed estimator':^23}",
             f"{'choice':<31}{'per device':>11} {'per host':>11}   {'per device':>11} {'per host':>11}"]
    for e in exact:
        d = ds_by.get(e.choice)
        theirs = f"{num(d.device_bytes)} {num(d.host_bytes)}" if d else f"{'-':>11} {'-':>11}"
        lines.append(f"{e.choice.label:<31}{num(e.device_bytes)} {num(e.host_bytes)}   {theirs}")
    lines += ["",
              "plan-exact: zerojax's plan on an abstract mesh of that size, every leaf's shard in its dtype and memory "
              "kind (Plan.report()).",
              f"DeepSpeed: estimate_zero2_model_states_mem_needs (stages 1, 2) and "
              f"estimate_zero3_model_states_mem_needs "
              f"(stage 3, zero_init={int(req.zero_init)}), additional_buffer_factor={req.additional_buffer_factor}; "
              f"no estimator for stage 0, and none takes NVMe (their offload_optimizer=cpu rows count the same "
              f"bytes in CPU memory)."]
    for e in exact:
        if e.nvme_bytes:
            params = e.report.params_nvme if e.report is not None else 0
            at_use = e.report.params_at_use if e.report is not None else 0
            during = ("on the device during the step, except the stacked layers the step reads layer by layer, of "
                      "which it counts two layers (the one in use and the next)" if at_use else
                      "on the device during the step")
            what = (f"the fp32 master and moments, and the parameter partitions; its per-device figure counts the "
                    f"partitions too, {during}; its per-host figure above is host memory: the "
                    "buffers' share (offload_optimizer's buffer_count x sub_group_size x 4 bytes and offload_param's "
                    "buffer_count x buffer_size elements per device)" if params else
                    "the fp32 master and moments); its per-host figure above is host memory: the parameters' and "
                    "buffers' share (buffer_count x sub_group_size x 4 bytes per device")
            lines.append(f"{e.choice.label}: {num(e.nvme_bytes).strip()} {unit} per host in NVMe swap files ({what})")
    frozen = exact[0].report.n_frozen
    if frozen:
        lines += ["", f"frozen: {frozen:,} of {model.total_params:,} parameters ({'lora' if config.lora.enabled else 'model.trainable / model.frozen'}): "
                      f"plan-exact counts them as stored parameters only, in the compute dtype (P x frozen / N at "
                      f"stage 3, P x frozen on every device at stages 0-2), with no gradient, master or optimizer "
                      f"state; DeepSpeed's estimators count every parameter as trained"]
    threshold = config.zero_optimization.stage3_param_persistence_threshold
    if model.largest_leaf_params < threshold:
        lines += ["", f"note: every parameter has fewer than zero_optimization.stage3_param_persistence_threshold = "
                      f"{threshold:,} elements (the largest: {model.largest_leaf_params:,}), so ZeRO-3 keeps them all "
                      f"whole on every device, as DeepSpeed does, and its parameters cost what stage 2's do; set "
                      f"zero_optimization.stage3_param_persistence_threshold=0 to partition them"]
    activations = req.activations
    act_note = "given"
    if activations is None:
        if model.gpt is not None:
            from zerojax.runtime.preflight import activation_bytes
            activations = activation_bytes(config, variant(config, CHOICES[0]).batch(req.devices).micro_batch_size)
            act_note = "the embedded GPT's estimate (zerojax.runtime.preflight.activation_bytes)"
        else:
            activations, act_note = 0, "not known for this model: model states only (add --activations)"
    memory = req.device_memory if req.device_memory is not None else (req.device.memory if req.device else None)
    if memory is not None:
        best = recommend(exact, memory, activations, req.host_memory)
        lines += ["", f"activations per device: {activations / GIB:.2f} GiB ({act_note})"]
        if best is None:
            lines.append(f"recommendation: nothing fits {memory / GIB:.2f} GiB per device"
                         + (f" and {req.host_memory / GIB:.2f} GiB per host" if req.host_memory else "")
                         + "; use more devices or a smaller micro-batch")
        else:
            lines.append(f"recommendation: {best.choice.label} - the cheapest layout whose model state + activations "
                         f"({(best.device_bytes + activations) / GIB:.2f} GiB) fits {memory / GIB:.2f} GiB per device; "
                         f"set {' '.join(best.choice.overrides())}")
    if model.arch is not None and req.tensor != (1,):
        lines += [""] + tensor_lines(config, model, req, memory)
    if config.model.n_experts and expert_params(model.abstract_params):
        lines += [""] + expert_lines(config, model, req, memory)
    if sequence and model.arch is not None:
        lines += [""] + sequence_lines(config, model, req, memory)
    if req.step_time and req.device is not None:
        lines += [""] + step_time_lines(config, model, req)
    return "\n".join(lines)


def build_request(config: Config, args: Any) -> Request:
    """A Request from the CLI's arguments (argparse namespace)."""
    if args.devices is not None:
        devices = args.devices
    else:  # every device ZeRO shards over: the rows' data-parallel devices times the sequence axis
        devices = config.mesh.data_parallel(jax.device_count()) * config.mesh.sequence
    per_host = args.devices_per_host or devices
    device = None
    if args.device is not None:
        key = args.device.lower()
        if key not in PRESETS:
            raise ConfigError(f"estimate --device {args.device}: presets are {', '.join(PRESETS)}; or give "
                              f"--device-memory and the bandwidth options with a preset to start from")
        device = PRESETS[key]
        changes = {f: v for f, v in (("flops", args.peak_flops), ("hbm", args.hbm_bandwidth),
                                     ("intra", args.link_bandwidth), ("inter", args.inter_host_bandwidth))
                   if v is not None}
        device = dataclasses.replace(device, **changes)
    elif any(v is not None for v in (args.peak_flops, args.hbm_bandwidth, args.link_bandwidth,
                                     args.inter_host_bandwidth)):
        raise ConfigError("estimate: the bandwidth and FLOP/s options change a preset: add --device h100, a100 "
                          "or tpu-v5p")
    return Request(devices=devices, devices_per_host=per_host, device=device,
                   device_memory=parse_bytes(args.device_memory) if args.device_memory else None,
                   host_memory=parse_bytes(args.host_memory, "--host-memory") if args.host_memory else None,
                   activations=int(parse_bytes(args.activations, "--activations")) if args.activations else None,
                   zero_init=not args.no_zero_init, additional_buffer_factor=args.buffer_factor,
                   step_time=not args.no_step_time, compiled=bool(getattr(args, "compiled", False)), tensor=parse_tensor(getattr(args, "tensor", None)))
