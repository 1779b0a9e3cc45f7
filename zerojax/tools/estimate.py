"""Memory and step-time estimates before anything runs (`zerojax estimate`, docs/estimate.md).

Two memory modes, for every ZeRO stage and offload choice:

* DeepSpeed's own estimators, transcribed from `deepspeed.runtime.zero.stage_1_and_2.
  estimate_zero2_model_states_mem_needs` and `deepspeed.runtime.zero.stage3.
  estimate_zero3_model_states_mem_needs` (same arguments, same arithmetic, same integer results),
  so a number can be compared with what DeepSpeed's `*_all_cold` tables print.
* plan-exact: the real `zerojax.plan` for the config on an abstract mesh of the asked size
  (`jax.sharding.AbstractMesh`: names and sizes, no devices, nothing allocated), counted by the
  plan's own `memory_report` - every leaf's shard shape in its dtype and memory kind. What the
  layout replicates (small leaves, dimensions that do not divide) and what offload moves to the
  host are counted as they will be.

The step-time estimate counts work from the model's shapes and the ZeRO volumes (nothing is compiled,
so it answers in seconds); with `--compiled` it compiles the step for the embedded GPT on the local
devices with abstract inputs instead, reads matmul FLOPs, kernel memory traffic and collective bytes
from the compiled HLO (`zerojax.measure.hlo`, loops counted trip-count times). Either is divided by a
device's peak FLOP/s, HBM and link bandwidths.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from zerojax.config import Config, load_config
from zerojax.errors import ConfigError
from zerojax.tools import estimate_axes as ax, estimate_tensor as tp
from zerojax.tools.estimate_tensor import Arch

GIB = 2 ** 30


# ---------------------------------------------------------------------------------------------
# DeepSpeed's estimators (model states only: parameters, gradients, optimizer state).

def deepspeed_zero2(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                    cpu_offload: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(cpu_mem per node, gpu_mem per GPU) in bytes, as DeepSpeed's
    `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/stage_1_and_2.py) computes them
    for ZeRO stages 1 and 2 with mixed-precision Adam.

    On the GPU: 2 bytes/param of 16-bit parameters, plus - without offload - 18 bytes/param split
    over all GPUs (16-bit and 32-bit gradients, fp32 master, two Adam moments). On the CPU: the
    offloaded 16 bytes/param (at least 4 per GPU of the node) times the buffer factor; without
    offload, 4 bytes/param per GPU for loading the model.
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def deepspeed_zero3(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                    num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                    zero_init: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(cpu_mem per node, gpu_mem per GPU, largest_layer_memory) in bytes, as DeepSpeed's
    `estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py) computes them.

    The GPU always holds the largest layer gathered (4 bytes/param: 16-bit parameters and
    gradients), plus the 16-bit parameter shard (2/N bytes/param) unless parameters are offloaded,
    plus the 18/N bytes/param of gradients and optimizer state unless the optimizer is offloaded.
    The CPU (per node: `1/num_nodes` of the offloaded 18 or 16 bytes/param) is scaled by the
    buffer factor; without `zero_init` every GPU process first loads the whole model (4 bytes/param).
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


# ---------------------------------------------------------------------------------------------
# Models: abstract parameter trees (shapes only).

@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A model as abstract fp32 parameters (ShapeDtypeStructs), enough for plan-exact counting.

    `layer_axes` is the plan's argument (leading axes that stack layers; None: not known);
    `exact_shapes` is False
    for a model known only by its parameter counts (synthetic leaves of the right sizes);
    `gpt` is the embedded GPT's config when the step itself can be compiled;
    `arch` the sizes tensor-parallel rows need (None: not known, no such rows)."""
    name: str
    abstract_params: Any
    layer_axes: Any = None
    exact_shapes: bool = True
    gpt: Any = None
    arch: Arch | None = None

    @property
    def total_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_params))

    @property
    def largest_leaf_params(self) -> int:
        """Elements of the largest parameter (one layer's slice of a stacked one): what the stage-3
        persistence threshold is compared with."""
        axes = _per_leaf(0 if self.layer_axes is None else self.layer_axes, self.abstract_params)
        return max(math.prod(x.shape[k:]) for x, k in zip(jax.tree.leaves(self.abstract_params),
                                                         jax.tree.leaves(axes)))

    @property
    def largest_layer_params(self) -> int:
        """The most parameters one module holds itself (DeepSpeed's `model_to_params`: a module's
        own parameters, without its children's): leaves are grouped by their parent, and a
        stacked leaf counts one layer's slice."""
        groups: dict[tuple, int] = {}
        axes = _per_leaf(0 if self.layer_axes is None else self.layer_axes, self.abstract_params)
        for (path, x), k in zip(jax.tree_util.tree_leaves_with_path(self.abstract_params), jax.tree.leaves(axes)):
            groups[tuple(path[:-1])] = groups.get(tuple(path[:-1]), 0) + math.prod(x.shape[k:])
        return max(groups.values())


def _per_leaf(layer_axes: Any, tree: Any) -> Any:
    return jax.tree.map(lambda k, sub: jax.tree.map(lambda _: int(k), sub), layer_axes, tree)


def _sds(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), np.float32)


def embedded_model(config: Config) -> ModelShape:
    """The embedded model of `config.model` (GPT or Llama), shapes from `jax.eval_shape` of its
    initializer (nothing allocated)."""
    m = config.model
    llama = m.name == "llama"
    arch = Arch(m.n_layers, m.d_model, m.n_heads, (m.n_kv_heads or m.n_heads) if llama else m.n_heads,
                (m.head_dim or m.d_model // m.n_heads) if llama else m.d_model // m.n_heads,  # Qwen3: head_dim
                m.d_ff or 4 * m.d_model, m.vocab_size, gated=llama)
    if llama:
        from zerojax.models import abstract_params
        return ModelShape(f"embedded Llama (d_model {m.d_model}, {m.n_layers} layers)", abstract_params(m),
                          arch=arch)
    from zerojax.models import gpt
    return ModelShape(f"embedded GPT (d_model {m.d_model}, {m.n_layers} layers)", gpt.abstract_params(m),
                      gpt=m, arch=arch)


def _get(cfg: Mapping[str, Any], path: str, *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is not None:
        return default
    raise ConfigError(f"--hf-config {path}: needs one of {', '.join(names)}")


def hf_model(source: str | os.PathLike[str] | Mapping[str, Any]) -> ModelShape:
    """A Hugging Face `config.json` as abstract parameters: GPT-2 (`model_type: gpt2`) or the
    Llama family (llama, mistral, qwen2 and other gated-MLP decoders with grouped-query attention).

    Llama: embedding V x H; per layer q H x (heads·d), k and v H x (kv_heads·d), o (heads·d) x H
    (biases with `attention_bias`), gate and up H x I, down I x H (biases with `mlp_bias`), two
    RMSNorm scales H; final norm H; lm_head H x V unless `tie_word_embeddings`.
    GPT-2: wte V x H, wpe P x H; per layer two LayerNorms (2H each), c_attn H x 3H + 3H, c_proj
    H x H + H, c_fc H x I + I, c_proj I x H + H (I = n_inner or 4H); ln_f 2H; lm_head tied.
    """
    if isinstance(source, Mapping):
        cfg, path = dict(source), "<dict>"
    else:
        path = str(source)
        try:
            cfg = json.loads(Path(source).read_text())
        except FileNotFoundError:
            raise ConfigError(f"--hf-config {path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--hf-config {path}: not JSON ({e})") from None
    kind = str(cfg.get("model_type", "llama"))
    vocab = _get(cfg, path, "vocab_size")
    if kind == "gpt2":
        h = _get(cfg, path, "n_embd", "hidden_size")
        layers = _get(cfg, path, "n_layer", "num_hidden_layers")
        inner = _get(cfg, path, "n_inner", default=4 * h)
        positions = _get(cfg, path, "n_positions", "max_position_embeddings")
        block = {"ln_1": {"scale": _sds(layers, h), "bias": _sds(layers, h)},
                 "c_attn": {"kernel": _sds(layers, h, 3 * h), "bias": _sds(layers, 3 * h)},
                 "attn_proj": {"kernel": _sds(layers, h, h), "bias": _sds(layers, h)},
                 "ln_2": {"scale": _sds(layers, h), "bias": _sds(layers, h)},
                 "c_fc": {"kernel": _sds(layers, h, inner), "bias": _sds(layers, inner)},
                 "mlp_proj": {"kernel": _sds(layers, inner, h), "bias": _sds(layers, h)}}
        params = {"wte": {"embedding": _sds(vocab, h)}, "wpe": {"embedding": _sds(positions, h)},
                  "layers": block, "ln_f": {"scale": _sds(h), "bias": _sds(h)}}
        if not cfg.get("tie_word_embeddings", True):
            params["lm_head"] = {"kernel": _sds(h, vocab)}
        heads = _get(cfg, path, "n_head", "num_attention_heads")
        arch = Arch(layers, h, heads, heads, h // heads, inner, vocab, gated=False)
    else:
        h = _get(cfg, path, "hidden_size")
        layers = _get(cfg, path, "num_hidden_layers")
        inter = _get(cfg, path, "intermediate_size")
        heads = _get(cfg, path, "num_attention_heads")
        kv = _get(cfg, path, "num_key_value_heads", default=heads)
        d = _get(cfg, path, "head_dim", default=h // heads)
        attn_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))

        def linear(n_in: int, n_out: int, bias: bool) -> dict[str, Any]:
            out = {"kernel": _sds(layers, n_in, n_out)}
            if bias:
                out["bias"] = _sds(layers, n_out)
            return out
        block = {"q": linear(h, heads * d, attn_bias), "k": linear(h, kv * d, attn_bias),
                 "v": linear(h, kv * d, attn_bias), "o": linear(heads * d, h, attn_bias),
                 "gate": linear(h, inter, mlp_bias), "up": linear(h, inter, mlp_bias),
                 "down": linear(inter, h, mlp_bias),
                 "input_norm": {"scale": _sds(layers, h)}, "post_attention_norm": {"scale": _sds(layers, h)}}
        params = {"embed": {"embedding": _sds(vocab, h)}, "layers": block, "norm": {"scale": _sds(h)}}
        if not cfg.get("tie_word_embeddings", False):
            params["lm_head"] = {"kernel": _sds(h, vocab)}
        arch = Arch(layers, h, heads, kv, d, inter, vocab, gated=True)
    axes = {k: (1 if k == "layers" else 0) for k in params}
    name = Path(path).parent.name if path != "<dict>" else kind
    return ModelShape(f"Hugging Face {kind} ({name}, {layers} layers, hidden {h})", params, axes, arch=arch)


def counts_model(total_params: int, largest_layer_params: int) -> ModelShape:
    """A model known only by DeepSpeed's two numbers: synthetic leaves (`k` stacked layers of
    `largest_layer_params` as one [k, largest] leaf, and the remainder as one flat leaf), so the
    plan shards them as it would a real stack; replication from odd shapes is not modelled."""
    if largest_layer_params <= 0 or total_params < largest_layer_params:
        raise ConfigError(f"--params {total_params} --largest-layer {largest_layer_params}: need "
                          f"0 < largest layer <= total parameters")
    k, rest = divmod(total_params, largest_layer_params)
    params = {"layers": {"kernel": _sds(k, largest_layer_params)}}
    if rest:
        params["rest"] = {"kernel": _sds(rest)}
    return ModelShape("a model given by its parameter counts", params,
                      {"layers": 1, "rest": 0} if rest else {"layers": 1}, exact_shapes=False)


# ---------------------------------------------------------------------------------------------
# Layout choices and plan-exact bytes.

OFFLOADS = ("none", "cpu optimizer", "cpu params")


@dataclasses.dataclass(frozen=True)
class Choice:
    """A ZeRO stage and an offload choice ("cpu params" offloads the optimizer too, as DeepSpeed's
    ZeRO-Infinity CPU setting does)."""
    stage: int
    offload: str = "none"

    def overrides(self) -> list[str]:
        opt = "cpu" if self.offload != "none" else "none"
        par = "cpu" if self.offload == "cpu params" else "none"
        return [f"zero_optimization.stage={self.stage}", f"zero_optimization.offload_optimizer.device={opt}",
                f"zero_optimization.offload_param.device={par}"]

    @property
    def label(self) -> str:
        return f"stage {self.stage}, offload {self.offload}"


# Cheapest first: more sharding costs communication (stage 3 gathers parameters once more), and
# offload costs host transfers and a host-side update on top, parameter offload most.
CHOICES: tuple[Choice, ...] = (
    Choice(0), Choice(1), Choice(2), Choice(3),
    Choice(1, "cpu optimizer"), Choice(2, "cpu optimizer"), Choice(3, "cpu optimizer"), Choice(3, "cpu params"))


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of model state for one choice: per device in device memory, per host in host memory."""
    choice: Choice
    mode: str                 # "plan-exact" or "deepspeed"
    device_bytes: int
    host_bytes: int           # per host (DeepSpeed: per node)
    note: str = ""
    report: Any = None        # the plan's MemoryReport (plan-exact)


def variant(config: Config, choice: Choice) -> Config:
    """`config` with the choice's stage and offload keys; the batch follows the micro-batch (and
    accumulation) so that any device count resolves; a config that gives only train_batch_size
    keeps it, and the batch triad says which device counts divide it."""
    free = ["train_batch_size=null"] if config.train_micro_batch_size_per_gpu is not None else []
    if choice.stage != 3 or choice.offload == "cpu params":
        # ZeRO++ changes stage 3's parameter gathers only (hpZ: not with offloaded parameters); the
        # other choices are estimated without it, and a stage-3 row shows hpZ's secondary copy.
        free += ["zero_optimization.zero_hpz_partition_size=1", "zero_optimization.zero_quantized_weights=false",
                 "zero_optimization.zero_quantized_gradients=false"]
    return load_config(config, choice.overrides() + free)


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
    return MemoryEstimate(choice, "plan-exact", rep.device, rep.host * min(devices_per_host, devices),
                          report=rep)


def deepspeed_estimate(model: ModelShape, devices: int, devices_per_host: int, choice: Choice,
                       zero_init: bool = True, additional_buffer_factor: float = 1.5) -> MemoryEstimate | None:
    """DeepSpeed's number for the choice: the ZeRO-2 estimator for stages 1 and 2 (its file covers
    both), the ZeRO-3 one for stage 3; None for stage 0, which DeepSpeed does not estimate."""
    per_node = min(devices_per_host, devices)
    nodes = math.ceil(devices / per_node)
    if choice.stage == 0:
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


# ---------------------------------------------------------------------------------------------
# Step time.

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


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: mesh data x tensor, tensor innermost (within a host), ZeRO over data.

@dataclasses.dataclass(frozen=True)
class TensorRow:
    """One (T, ZeRO stage) layout: bytes per device and what one device sends per optimizer step,
    over its tensor group (within a host) and its data group (between hosts when it spans them)."""
    tensor: int
    data: int
    choice: Choice
    state_bytes: int          # plan-exact model state of one tensor slice, ZeRO-sharded over data
    activation_bytes: int
    tensor_bytes: float
    data_bytes: float
    tensor_s: float
    data_s: float
    tokens: int               # tokens the whole mesh trains per optimizer step

    @property
    def device_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    @property
    def comm_s(self) -> float:
        return self.tensor_s + self.data_s

    @property
    def comm_s_per_token(self) -> float:
        """Communication time per token trained: with the micro-batch per model replica fixed, a
        T-way row's step trains 1/T of the tokens, so per-step times compare layouts unfairly."""
        return self.comm_s / self.tokens

    @property
    def label(self) -> str:
        return f"T={self.tensor} x data {self.data}, stage {self.choice.stage}"


def tensor_sizes(req: "Request", arch: Arch) -> tuple[list[int], list[str]]:
    """The tensor sizes to show (`req.tensor`, else every divisor of the devices per host that
    divides the device count) and why any was left out."""
    per_host = min(req.devices_per_host, req.devices)
    asked = req.tensor or tuple(t for t in range(1, per_host + 1) if per_host % t == 0 and req.devices % t == 0)
    sizes, skipped = [], []
    for t in asked:
        why = tp.invalid(arch, t)
        if why is None and (req.devices % t or per_host % t):
            why = (f"T={t} must divide --devices {req.devices} and --devices-per-host {per_host} "
                   f"(tensor stays in a host)")
        if why is None:
            sizes.append(t)
        else:
            skipped.append(why)
    return sizes, skipped


def shard_model(model: ModelShape, t: int) -> ModelShape:
    """One device's tensor slice as a model of its own, for the plan-exact counter."""
    if t == 1:
        return model
    return dataclasses.replace(model, name=f"{model.name}, one of {t} tensor slices",
                               abstract_params=tp.shard_params(model.abstract_params, model.arch, t))


def tensor_row(config: Config, model: ModelShape, req: "Request", t: int, choice: Choice,
               device: DeviceSpec) -> TensorRow:
    """The model state from the plan of one tensor slice on an abstract data mesh of devices / T
    (so T=1 is exactly the plan-exact table), activations and bytes moved from the formulas of
    `zerojax.tools.estimate_tensor`, ZeRO's volumes on the slice's Ψ over the data group."""
    from zerojax.planner.settings import policy
    data = req.devices // t
    shard = shard_model(model, t)
    state = plan_exact(config, shard, data, max(min(req.devices_per_host, req.devices) // t, 1), choice).device_bytes
    cfg = variant(config, choice)
    b = cfg.batch(data)
    width = {"bf16": 2, "fp16": 2}.get(config.compute_dtype, 4)
    seq, remat = config.model.seq_len, bool(config.model.remat)
    act = req.activations if req.activations is not None else \
        tp.activation_bytes(model.arch, b.micro_batch_size, seq, width, remat, t)
    tensor_bytes = tp.tensor_comm_bytes(model.arch, b.micro_batch_size, seq, width, remat, t,
                                        b.gradient_accumulation_steps)
    pol = policy(cfg)
    data_bytes = zero_comm_bytes(shard.total_params, choice.stage, data, (pol.comm or pol.accum).itemsize,
                                 pol.param.itemsize) if data > 1 else 0.0
    data_link = device.inter if req.devices > req.devices_per_host else device.intra
    tokens = data * b.micro_batch_size * b.gradient_accumulation_steps * seq
    return TensorRow(t, data, choice, state, act, tensor_bytes, data_bytes, tensor_bytes / device.intra,
                     data_bytes / data_link, tokens)


def tensor_rows(config: Config, model: ModelShape, req: "Request") -> tuple[list[TensorRow], list[str]]:
    """Every shown tensor size with ZeRO stages 0-3 (no offload), and the sizes left out."""
    sizes, skipped = tensor_sizes(req, model.arch)
    device = req.device or PRESETS["h100"]
    return [tensor_row(config, model, req, t, c, device) for t in sizes for c in CHOICES[:4]], skipped


def recommend_tensor(rows: Sequence[TensorRow], device_memory: float) -> TensorRow | None:
    """Of the rows whose model state + activations fit `device_memory`, the least communication
    time per token; ties go to the cheaper ZeRO stage, then the smaller T."""
    fits = [r for r in rows if r.device_bytes <= device_memory]
    return min(fits, key=lambda r: (r.comm_s_per_token, r.choice.stage, r.tensor), default=None)


def tensor_lines(config: Config, model: ModelShape, req: "Request", memory: float | None) -> list[str]:
    """The tensor-parallel table, its assumptions and its recommendation."""
    rows, skipped = tensor_rows(config, model, req)
    if not rows:
        return ["tensor parallelism: no tensor size applies" + (f" ({'; '.join(skipped)})" if skipped else "")]
    device = req.device or PRESETS["h100"]
    unit, scale = _unit([r.device_bytes for r in rows] + [r.tensor_bytes + r.data_bytes for r in rows])
    lines = [f"tensor parallelism (mesh data x tensor, tensor innermost within a host; Megatron slicing; "
             f"ZeRO over data on each device's slice), {unit} per device, bytes sent per device per step:",
             f"{'layout':<28}{'states':>9}{'activ.':>9}{'total':>9}{'tensor ' + unit:>12}{'data ' + unit:>10}"
             f"{'tensor ms':>11}{'data ms':>10}{'tokens/step':>13}{'comm ms/1k tok':>16}"
             + ("  fits" if memory is not None else "")]
    for r in rows:
        fits = ("   yes" if r.device_bytes <= memory else "    no") if memory is not None else ""
        lines.append(f"{r.label:<28}{r.state_bytes / scale:9.2f}{r.activation_bytes / scale:9.2f}"
                     f"{r.device_bytes / scale:9.2f}{r.tensor_bytes / scale:12.2f}{r.data_bytes / scale:10.2f}"
                     f"{r.tensor_s * 1e3:11.1f}{r.data_s * 1e3:10.1f}{r.tokens:13,}"
                     f"{r.comm_s_per_token * 1e6:16.3f}{fits}")
    across = req.devices > req.devices_per_host
    act = "given (--activations), the same for every T" if req.activations is not None else \
        "per micro-batch, attention and MLP tensors split over T, residual stream whole"
    lines += [f"links: tensor {device.intra / 1e9:.0f} GB/s within a host, data "
              f"{(device.inter if across else device.intra) / 1e9:.0f} GB/s "
              f"{'between hosts' if across else 'within a host'} per device ({device.name}"
              f"{'' if req.device else ' preset, assumed: pass --device to choose'}); activations {act}; "
              f"no sequence parallelism, pipeline or offload in these rows; docs/estimate.md"]
    if skipped:
        lines.append("left out: " + "; ".join(skipped))
    if memory is not None:
        best = recommend_tensor(rows, memory)
        if best is None:
            lines.append(f"tensor-parallel recommendation: no row fits {memory / GIB:.2f} GiB per device")
        else:
            lines.append(f"tensor-parallel recommendation: {best.label} - fits ({best.device_bytes / scale:.2f} {unit}) "
                         f"with the least communication per token; set mesh.tensor={best.tensor} "
                         f"(DeepSpeed: tensor_parallel.autotp_size={best.tensor}) "
                         f"zero_optimization.stage={best.choice.stage}")
    return lines


# ---------------------------------------------------------------------------------------------
# Expert and sequence parallelism: ZeRO's formulas per group of weights (estimate_axes).

@dataclasses.dataclass(frozen=True)
class AxisRow:
    """One (axis size, ZeRO stage) layout of the expert or sequence axis: bytes per device and what
    one device sends per optimizer step over that axis's groups and over ZeRO's."""
    axis: str                 # "expert" or "sequence"
    size: int
    devices: int
    choice: Choice
    state_bytes: float
    activation_bytes: float
    all_to_all_bytes: float
    data_bytes: float

    @property
    def device_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def label(self) -> str:
        inner = self.devices // self.size
        return f"{'E' if self.axis == 'expert' else 'S'}={self.size} x data {inner}, stage {self.choice.stage}"


def _role_bytes(cfg: Config, model: ModelShape | None = None) -> tuple[ax.Bytes, int]:
    """(P, G, K) of the config's precision and optimizer, and the gradients' communication itemsize.
    K is read off the plan of one small leaf (its fp32 master and the optimizer's state per parameter,
    as `Plan.report()` counts them), so any optimizer gets its own. Muon's K depends on the leaf (one
    momentum for a hidden matrix, two Adam moments for the rest), so with Muon and a `model` it is the
    mean over that model's own plan."""
    from zerojax.planner.plan import make_plan
    from zerojax.planner.settings import policy
    pol = policy(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, trainable=(), frozen=()))  # K per trained parameter
    if model is not None and cfg.optimizer is not None and cfg.optimizer.type == "muon":
        rep = make_plan(cfg, abstract_mesh(1), model.abstract_params, layer_axes=model.layer_axes).report()
        k = rep.formula_optimizer / model.total_params
    else:
        psi = 64
        k = round(make_plan(cfg, abstract_mesh(1), {"w": _sds(psi)}).report().formula_optimizer / psi)
    return ax.Bytes(pol.param.itemsize, pol.accum.itemsize, k), (pol.comm or pol.accum).itemsize


def _divisors(n: int, *also: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and all(a % d == 0 for a in also)]


def expert_rows(config: Config, model: ModelShape, req: "Request") -> list[AxisRow]:
    """Every expert size dividing the devices and the experts, with ZeRO stages 0-3 (no offload); none
    for a model without experts."""
    psi_e = ax.expert_params(model.abstract_params)
    m = config.model
    if not psi_e or not m.n_experts:
        return []
    psi_d = model.total_params - psi_e
    width = {"bf16": 2, "fp16": 2}.get(config.compute_dtype, 4)
    moe_layers = m.n_layers // max(m.moe_every, 1)
    rows = []
    for ep in _divisors(req.devices, m.n_experts):
        for choice in CHOICES[:4]:
            cfg = variant(config, choice)
            b, (bytes_, comm) = cfg.batch(req.devices), _role_bytes(cfg, model)
            state = ax.expert_state(psi_d, psi_e, req.devices, ep, choice.stage, bytes_)
            a2a = ax.expert_all_to_all_bytes(b.micro_batch_size * m.seq_len, m.d_model, m.experts_per_token,
                                             m.capacity_factor, moe_layers, width, bool(m.remat), ep,
                                             b.gradient_accumulation_steps)
            data = zero_comm_bytes(psi_d, choice.stage, req.devices, comm, bytes_.param) + (
                zero_comm_bytes(psi_e // ep, choice.stage, req.devices // ep, comm, bytes_.param)
                if req.devices > ep else 0.0)
            act = req.activations or 0
            rows.append(AxisRow("expert", ep, req.devices, choice, state, act, a2a, data))
    return rows


def sequence_rows(config: Config, model: ModelShape, req: "Request") -> tuple[list[AxisRow], list[str]]:
    """Every sequence size within a host dividing the devices, the heads and the sequence, with ZeRO
    stages 0-3 (no offload), and the sizes left out (the batch's rows not dividing, say)."""
    arch, seq = model.arch, config.model.seq_len
    per_host = min(req.devices_per_host, req.devices)
    rows, skipped = [], []
    width = {"bf16": 2, "fp16": 2}.get(config.compute_dtype, 4)
    remat = bool(config.model.remat)
    for sp in _divisors(per_host, req.devices):
        why = next((f"S={sp} does not divide the {n} {what}" for n, what in (
            (arch.heads, "query heads"), (arch.kv_heads, "key/value heads"), (seq, "tokens of a row")) if n % sp), None)
        if why:
            skipped.append(why)
            continue
        for choice in CHOICES[:4]:
            cfg = variant(config, choice)
            try:
                b = cfg.batch(req.devices // sp)
            except ConfigError as e:
                skipped.append(f"S={sp}: {e}")
                break
            bytes_, comm = _role_bytes(cfg, model)
            state = ax.zero_state(model.total_params, req.devices, choice.stage, bytes_)
            act = (req.activations / sp if req.activations is not None else
                   ax.sequence_activation_bytes(arch, b.micro_batch_size, seq, width, remat, sp))
            a2a = ax.sequence_all_to_all_bytes(arch, b.micro_batch_size, seq, width, remat, sp,
                                               b.gradient_accumulation_steps)
            data = zero_comm_bytes(model.total_params, choice.stage, req.devices, comm, bytes_.param)
            rows.append(AxisRow("sequence", sp, req.devices, choice, state, act, a2a, data))
    return rows, skipped


def axis_lines(title: str, rows: list[AxisRow], notes: list[str], memory: float | None) -> list[str]:
    """One axis's table: states, activations, all-to-all and ZeRO bytes per device, whether it fits."""
    unit, scale = _unit([r.device_bytes for r in rows] + [r.all_to_all_bytes + r.data_bytes for r in rows])
    lines = [f"{title}, {unit} per device, bytes sent per device per step:",
             f"{'layout':<28}{'states':>9}{'activ.':>9}{'total':>9}{'all-to-all ' + unit:>16}{'ZeRO ' + unit:>10}"
             + ("  fits" if memory is not None else "")]
    for r in rows:
        fits = ("   yes" if r.device_bytes <= memory else "    no") if memory is not None else ""
        lines.append(f"{r.label:<28}{r.state_bytes / scale:9.2f}{r.activation_bytes / scale:9.2f}"
                     f"{r.device_bytes / scale:9.2f}{r.all_to_all_bytes / scale:16.2f}{r.data_bytes / scale:10.2f}{fits}")
    return lines + notes


def expert_lines(config: Config, model: ModelShape, req: "Request", memory: float | None) -> list[str]:
    rows = expert_rows(config, model, req)
    if not rows:
        return []
    m = config.model
    return axis_lines(
        "expert parallelism (mesh data x expert, DeepSpeed's ep_size: experts split E ways, ZeRO over data; "
        "every other weight ZeRO over data x expert)", rows,
        [f"from ZeRO's formulas: {ax.expert_params(model.abstract_params):,} expert parameters / E, ZeRO over the "
         f"{req.devices} / E devices of an expert-data-parallel group; all-to-alls of top-{m.experts_per_token} x "
         f"capacity_factor {m.capacity_factor} slots per token, 2 forward and 2 backward per MoE layer; "
         f"activations {'given (--activations)' if req.activations else 'not counted (add --activations)'}; "
         f"docs/estimate.md"], memory)


def sequence_lines(config: Config, model: ModelShape, req: "Request", memory: float | None) -> list[str]:
    rows, skipped = sequence_rows(config, model, req)
    if not rows:
        return ["sequence parallelism: no sequence size applies" + (f" ({'; '.join(skipped)})" if skipped else "")]
    notes = [f"from ZeRO's formulas: every weight ZeRO over all {req.devices} devices (data x sequence); "
             f"activations of 1/S of each row's {config.model.seq_len} tokens; all-to-alls of q, k, v and the "
             f"attention output, 2 forward and 2 backward per layer (and remat's replay); docs/estimate.md"]
    if skipped:
        notes.append("left out: " + "; ".join(skipped))
    return axis_lines("sequence parallelism (DeepSpeed-Ulysses: rows over data, each row's tokens over S, "
                      "ZeRO over data x sequence)", rows, notes, memory)


# ---------------------------------------------------------------------------------------------
# Text.

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


def _unit(values: Sequence[float]) -> tuple[str, float]:
    """GiB for models whose largest number reaches 1 GiB, MiB below."""
    return ("GiB", GIB) if max(values, default=0) >= GIB else ("MiB", 2 ** 20)


# ---------------------------------------------------------------------------------------------
# The command.

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
        return hf_model(hf_config)
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
    unit, scale = _unit([e.device_bytes for e in exact] + [e.host_bytes for e in exact + ds])

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
              f"no estimator for stage 0."]
    frozen = exact[0].report.n_frozen
    if frozen:
        lines += ["", f"frozen: {frozen:,} of {model.total_params:,} parameters (model.trainable / model.frozen): "
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
    if config.model.n_experts and ax.expert_params(model.abstract_params):
        lines += [""] + expert_lines(config, model, req, memory)
    if sequence and model.arch is not None:
        lines += [""] + sequence_lines(config, model, req, memory)
    if req.step_time and req.device is not None:
        lines += [""] + step_time_lines(config, model, req)
    return "\n".join(lines)


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
