"""Expert- and sequence-parallel accounting for `zerojax estimate` (docs/estimate.md, "Expert and
sequence parallelism").

DeepSpeed's estimators have no rows for either axis, so these come from the ZeRO paper's formulas
(bytes per parameter: P for the parameters, G for the gradients, K for the fp32 master and the
optimizer's state), applied to each group of weights over the devices that divide it:

* Expert axis of size E over N data-parallel devices (DeepSpeed's `ep_size`, carved out of the data
  devices): the MoE layers' expert weights Ψ_e are split E ways by experts, and each slice is ZeRO-
  sharded over its expert-data-parallel group of N / E devices; every other weight Ψ_d is ZeRO-sharded
  over all N. Each MoE layer adds two all-to-alls of the dispatched tokens over the expert group
  forward, and their transposes backward.
* Sequence axis of size S (DeepSpeed-Ulysses) among the N devices: the rows are split over N / S of
  them and each row's tokens over S, so a device keeps 1/S of a micro-batch's activations (attention
  runs on the whole row for 1/S of the heads: the same bytes per token); ZeRO shards every weight
  over all N (data x sequence). Each attention layer adds two all-to-alls forward (q, k, v to the
  head split; the output back) and their transposes backward.

The functions are pure arithmetic on shapes and sizes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import jax

from zerojax.config import Config
from zerojax.errors import ConfigError
from zerojax.tools.estimate.memory import CHOICES, Choice, abstract_mesh, size_unit, variant
from zerojax.tools.estimate.shapes import ModelShape, fp32_shape
from zerojax.tools.estimate.timing import zero_comm_bytes
from zerojax.tools.estimate.tensor import Arch, activation_bytes

if TYPE_CHECKING:
    from zerojax.tools.estimate.command import Request


@dataclasses.dataclass(frozen=True)
class Bytes:
    """Bytes per parameter by role: P (parameters), G (gradients), K (master + optimizer state; a mean,
    not a whole number, for Muon)."""
    param: int
    grad: int
    optimizer: float


STAGE_SHARDS = {0: (False, False, False), 1: (False, False, True), 2: (False, True, True), 3: (True, True, True)}


def zero_state(psi: float, shards: int, stage: int, b: Bytes) -> float:
    """The ZeRO paper's per-device model state of Ψ parameters over `shards` devices."""
    p, g, o = STAGE_SHARDS[stage]
    return psi * (b.param / (shards if p else 1) + b.grad / (shards if g else 1) + b.optimizer / (shards if o else 1))


def expert_params(abstract_params: Any) -> int:
    """Parameters of the MoE layers' experts (leaves under an `experts` module)."""
    return sum(math.prod(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(abstract_params)
               if any(getattr(k, "key", None) == "experts" for k in path))


def expert_state(psi_dense: float, psi_expert: float, devices: int, ep: int, stage: int, b: Bytes) -> float:
    """Per device: the other weights ZeRO-sharded over all devices, one device's 1/ep of the experts
    ZeRO-sharded over its expert-data-parallel group (devices / ep)."""
    return zero_state(psi_dense, devices, stage, b) + zero_state(psi_expert / ep, devices // ep, stage, b)


def expert_all_to_all_bytes(tokens: int, hidden: int, top_k: int, capacity_factor: float, moe_layers: int,
                            width: int, remat: bool, ep: int, micro_steps: int = 1) -> float:
    """Bytes one device sends per optimizer step over its expert group: each MoE layer's dispatched
    buffer holds about k x capacity_factor slots per local token of `hidden` values, and an all-to-all
    sends (ep - 1)/ep of it; 2 forward, 2 backward, 2 more in the recomputed forward with remat."""
    buffer = tokens * top_k * capacity_factor * hidden * width
    return micro_steps * moe_layers * (6 if remat else 4) * (ep - 1) / ep * buffer


def sequence_activation_bytes(arch: Arch, rows: int, seq: int, width: int, remat: bool, sp: int) -> float:
    """Activations one device keeps for `rows` rows of which it holds 1/sp of the tokens: every term of
    the dense estimate is per token (attention's scores too: 1/sp of the heads over the whole row)."""
    return activation_bytes(arch, rows, seq, width, remat, 1) / sp


def sequence_all_to_all_bytes(arch: Arch, rows: int, seq: int, width: int, remat: bool, sp: int,
                              micro_steps: int = 1) -> float:
    """Bytes one device sends per optimizer step over its sequence group: per attention layer q, k, v
    (query and key/value heads) and the output, each of the device's rows x seq / sp tokens, (sp-1)/sp
    of each sent; forward, backward, and the recomputed forward with remat."""
    per_token = (2 * arch.heads + 2 * arch.kv_heads) * arch.head_dim * width
    return micro_steps * arch.layers * (3 if remat else 2) * (sp - 1) / sp * rows * seq / sp * per_token


# ---------------------------------------------------------------------------------------------
# Rows of `zerojax estimate`: ZeRO's formulas per group of weights, for each axis size and stage.

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


def _role_bytes(cfg: Config, model: ModelShape | None = None) -> tuple[Bytes, int]:
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
        k = round(make_plan(cfg, abstract_mesh(1), {"w": fp32_shape(psi)}).report().formula_optimizer / psi)
    return Bytes(pol.param.itemsize, pol.accum.itemsize, k), (pol.comm or pol.accum).itemsize


def _divisors(n: int, *also: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and all(a % d == 0 for a in also)]


def expert_rows(config: Config, model: ModelShape, req: Request) -> list[AxisRow]:
    """Every expert size dividing the devices and the experts, with ZeRO stages 0-3 (no offload); none
    for a model without experts."""
    psi_e = expert_params(model.abstract_params)
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
            state = expert_state(psi_d, psi_e, req.devices, ep, choice.stage, bytes_)
            a2a = expert_all_to_all_bytes(b.micro_batch_size * m.seq_len, m.d_model, m.experts_per_token,
                                             m.capacity_factor, moe_layers, width, bool(m.remat), ep,
                                             b.gradient_accumulation_steps)
            data = zero_comm_bytes(psi_d, choice.stage, req.devices, comm, bytes_.param) + (
                zero_comm_bytes(psi_e // ep, choice.stage, req.devices // ep, comm, bytes_.param)
                if req.devices > ep else 0.0)
            act = req.activations or 0
            rows.append(AxisRow("expert", ep, req.devices, choice, state, act, a2a, data))
    return rows


def sequence_rows(config: Config, model: ModelShape, req: Request) -> tuple[list[AxisRow], list[str]]:
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
            state = zero_state(model.total_params, req.devices, choice.stage, bytes_)
            act = (req.activations / sp if req.activations is not None else
                   sequence_activation_bytes(arch, b.micro_batch_size, seq, width, remat, sp))
            a2a = sequence_all_to_all_bytes(arch, b.micro_batch_size, seq, width, remat, sp,
                                               b.gradient_accumulation_steps)
            data = zero_comm_bytes(model.total_params, choice.stage, req.devices, comm, bytes_.param)
            rows.append(AxisRow("sequence", sp, req.devices, choice, state, act, a2a, data))
    return rows, skipped


def axis_lines(title: str, rows: list[AxisRow], notes: list[str], memory: float | None) -> list[str]:
    """One axis's table: states, activations, all-to-all and ZeRO bytes per device, whether it fits."""
    unit, scale = size_unit([r.device_bytes for r in rows] + [r.all_to_all_bytes + r.data_bytes for r in rows])
    lines = [f"{title}, {unit} per device, bytes sent per device per step:",
             f"{'layout':<28}{'states':>9}{'activ.':>9}{'total':>9}{'all-to-all ' + unit:>16}{'ZeRO ' + unit:>10}"
             + ("  fits" if memory is not None else "")]
    for r in rows:
        fits = ("   yes" if r.device_bytes <= memory else "    no") if memory is not None else ""
        lines.append(f"{r.label:<28}{r.state_bytes / scale:9.2f}{r.activation_bytes / scale:9.2f}"
                     f"{r.device_bytes / scale:9.2f}{r.all_to_all_bytes / scale:16.2f}{r.data_bytes / scale:10.2f}{fits}")
    return lines + notes


def expert_lines(config: Config, model: ModelShape, req: Request, memory: float | None) -> list[str]:
    rows = expert_rows(config, model, req)
    if not rows:
        return []
    m = config.model
    return axis_lines(
        "expert parallelism (mesh data x expert, DeepSpeed's ep_size: experts split E ways, ZeRO over data; "
        "every other weight ZeRO over data x expert)", rows,
        [f"from ZeRO's formulas: {expert_params(model.abstract_params):,} expert parameters / E, ZeRO over the "
         f"{req.devices} / E devices of an expert-data-parallel group; all-to-alls of top-{m.experts_per_token} x "
         f"capacity_factor {m.capacity_factor} slots per token, 2 forward and 2 backward per MoE layer; "
         f"activations {'given (--activations)' if req.activations else 'not counted (add --activations)'}; "
         f"docs/estimate.md"], memory)


def sequence_lines(config: Config, model: ModelShape, req: Request, memory: float | None) -> list[str]:
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

