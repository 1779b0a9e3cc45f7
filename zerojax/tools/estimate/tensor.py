"""Tensor-parallel accounting for `zerojax estimate` (docs/estimate.md, "Tensor parallelism").

Megatron-style slicing over a `tensor` mesh axis of size T, innermost (within a host), as zerojax's
planner slices the shipped models (`zerojax.planner.tensor`): each layer's query/key/value and
attention output projections, MLP projections and the vocabulary embedding / head are split T
ways; norms, positional embeddings and the biases of row-parallel layers stay whole on every
device, and so do the GPT's fused qkv projection and its attention output (their [q | k | v]
columns are not head-major). Key/value projections are split while T divides their heads and
kept whole otherwise. The functions here are pure arithmetic on shapes: what one device's
tensor slice holds, what activations it keeps, and what its all-reduces move.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Sequence

import jax

from zerojax.config import Config
from zerojax.tools.estimate.memory import CHOICES, GIB, Choice, plan_exact, size_unit, variant
from zerojax.tools.estimate.shapes import Arch, ModelShape
from zerojax.tools.estimate.timing import PRESETS, DeviceSpec, zero_comm_bytes

if TYPE_CHECKING:
    from zerojax.tools.estimate.command import Request

# Module names (the parent key of a kernel or bias) by how Megatron slices them. Covers the
# embedded GPT and Llama and the Hugging Face GPT-2 / Llama trees that `hf_model` builds.
COLUMN = frozenset({"q", "gate", "up", "fc", "c_fc"})                    # output dimension split
KV = frozenset({"k", "v"})                                               # output split by KV head
ROW = frozenset({"o", "down", "out", "mlp_proj"})                        # input dimension split
VOCAB_ROWS = frozenset({"embed", "wte"})                                 # [vocab, hidden] embedding
VOCAB_COLS = frozenset({"head", "lm_head"})                              # [hidden, vocab] head


def invalid(arch: Arch, t: int) -> str | None:
    """Why `t` cannot slice this model (None: it can). Heads and the MLP width must divide; KV
    heads that do not are kept whole. The vocabulary is padded
    to a multiple of T, as Megatron pads it, so it never blocks a size."""
    if t < 1:
        return f"T={t} is not a size"
    if arch.heads % t:
        return f"{arch.heads} attention heads do not divide by T={t}"
    if arch.intermediate % t:
        return f"MLP width {arch.intermediate} does not divide by T={t}"
    return None


def local_kv_heads(arch: Arch, t: int) -> int:
    """KV heads one device holds: split while T divides them, else all of them (kept whole)."""
    return arch.kv_heads // t if arch.kv_heads % t == 0 else arch.kv_heads


def _name(key: Any) -> str:
    return str(getattr(key, "key", getattr(key, "name", key)))


def local_shape(shape: tuple[int, ...], parent: str, leaf: str, arch: Arch, t: int) -> tuple[int, ...]:
    """One device's slice of a parameter of `shape` held by module `parent` as `leaf`."""
    s = list(shape)
    if parent in COLUMN:
        s[-1] //= t
    elif parent in KV:
        s[-1] = s[-1] * local_kv_heads(arch, t) // arch.kv_heads
    elif parent in ROW and leaf == "kernel":
        s[-2] //= t
    elif parent in VOCAB_ROWS and leaf == "embedding":
        s[0] = -(-s[0] // t)
    elif parent in VOCAB_COLS and leaf == "kernel":
        s[-1] = -(-s[-1] // t)
    return tuple(s)


def shard_params(abstract_params: Any, arch: Arch, t: int) -> Any:
    """The abstract parameter tree of one device's tensor slice (same structure and dtypes)."""
    def one(path: tuple, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        names = [_name(k) for k in path]
        parent = names[-2] if len(names) > 1 else ""
        return jax.ShapeDtypeStruct(local_shape(tuple(x.shape), parent, names[-1], arch, t), x.dtype)
    return jax.tree_util.tree_map_with_path(one, abstract_params)


def local_params(abstract_params: Any, arch: Arch, t: int) -> int:
    """Parameters one device's tensor slice holds: the split part / T plus the replicated part."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shard_params(abstract_params, arch, t)))


def activation_bytes(arch: Arch, rows: int, seq: int, width: int, remat: bool, t: int) -> int:
    """Activations one device keeps for one micro-batch of `rows` x `seq` tokens.

    Per token of a block: 6 hidden-wide tensors on the residual stream and norm inputs, whole on
    every device (no sequence parallelism); q, k, v and the attention output, the MLP's
    intermediate tensors (2 for GPT's fc + GeLU, 3 for gate, up and their product) and the
    attention scores and probabilities (2 per head per key) divided over T. With `remat` only each
    block's input is kept, plus one block live in full during its backward; the fp32 logits and
    their gradient are vocabulary-parallel. At T=1 and GPT's shapes this is the trainer's
    pre-flight estimate (`zerojax.runtime.preflight.activation_bytes`)."""
    tokens = rows * seq
    attn = 2 * arch.heads * arch.head_dim // t + 2 * local_kv_heads(arch, t) * arch.head_dim
    mlp = (3 if arch.gated else 2) * arch.intermediate // t
    scores = 2 * arch.heads * seq // t
    block = tokens * (6 * arch.hidden + attn + mlp + scores) * width
    kept = arch.layers * (tokens * arch.hidden * width if remat else block)
    return kept + block + tokens * -(-arch.vocab // t) * 4 * 2


def all_reduces(layers: int, remat: bool) -> int:
    """Megatron's activation all-reduces per micro-batch: 2 per block forward (after attention and
    after the MLP), 2 backward (the gradients of their column-parallel inputs), 2 more in the
    recomputed forward with activation checkpointing, and 2 for the vocabulary-parallel embedding
    (forward) and head (backward)."""
    return layers * (6 if remat else 4) + 2


def tensor_comm_bytes(arch: Arch, rows: int, seq: int, width: int, remat: bool, t: int,
                      micro_steps: int = 1) -> float:
    """Bytes one device sends per optimizer step over its tensor group: each all-reduce of a
    [rows, seq, hidden] activation moves 2(T-1)/T of it (ring)."""
    payload = rows * seq * arch.hidden * width
    return micro_steps * all_reduces(arch.layers, remat) * 2 * (t - 1) / t * payload


# ---------------------------------------------------------------------------------------------
# Rows of `zerojax estimate`: mesh data x tensor, tensor innermost (within a host), ZeRO over data.

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


def tensor_sizes(req: Request, arch: Arch) -> tuple[list[int], list[str]]:
    """The tensor sizes to show (`req.tensor`, else every divisor of the devices per host that
    divides the device count) and why any was left out."""
    per_host = min(req.devices_per_host, req.devices)
    asked = req.tensor or tuple(t for t in range(1, per_host + 1) if per_host % t == 0 and req.devices % t == 0)
    sizes, skipped = [], []
    for t in asked:
        why = invalid(arch, t)
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
                               abstract_params=shard_params(model.abstract_params, model.arch, t))


def tensor_row(config: Config, model: ModelShape, req: Request, t: int, choice: Choice,
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
        activation_bytes(model.arch, b.micro_batch_size, seq, width, remat, t)
    tensor_bytes = tensor_comm_bytes(model.arch, b.micro_batch_size, seq, width, remat, t,
                                        b.gradient_accumulation_steps)
    pol = policy(cfg)
    data_bytes = zero_comm_bytes(shard.total_params, choice.stage, data, (pol.comm or pol.accum).itemsize,
                                 pol.param.itemsize) if data > 1 else 0.0
    data_link = device.inter if req.devices > req.devices_per_host else device.intra
    tokens = data * b.micro_batch_size * b.gradient_accumulation_steps * seq
    return TensorRow(t, data, choice, state, act, tensor_bytes, data_bytes, tensor_bytes / device.intra,
                     data_bytes / data_link, tokens)


def tensor_rows(config: Config, model: ModelShape, req: Request) -> tuple[list[TensorRow], list[str]]:
    """Every shown tensor size with ZeRO stages 0-3 (no offload), and the sizes left out."""
    sizes, skipped = tensor_sizes(req, model.arch)
    device = req.device or PRESETS["h100"]
    return [tensor_row(config, model, req, t, c, device) for t in sizes for c in CHOICES[:4]], skipped


def recommend_tensor(rows: Sequence[TensorRow], device_memory: float) -> TensorRow | None:
    """Of the rows whose model state + activations fit `device_memory`, the least communication
    time per token; ties go to the cheaper ZeRO stage, then the smaller T."""
    fits = [r for r in rows if r.device_bytes <= device_memory]
    return min(fits, key=lambda r: (r.comm_s_per_token, r.choice.stage, r.tensor), default=None)


def tensor_lines(config: Config, model: ModelShape, req: Request, memory: float | None) -> list[str]:
    """The tensor-parallel table, its assumptions and its recommendation."""
    rows, skipped = tensor_rows(config, model, req)
    if not rows:
        return ["tensor parallelism: no tensor size applies" + (f" ({'; '.join(skipped)})" if skipped else "")]
    device = req.device or PRESETS["h100"]
    unit, scale = size_unit([r.device_bytes for r in rows] + [r.tensor_bytes + r.data_bytes for r in rows])
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

