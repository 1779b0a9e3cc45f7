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
from typing import Any

import jax

from zerojax.tools.estimate_tensor import Arch, activation_bytes


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
