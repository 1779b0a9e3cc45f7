"""A mixture-of-experts layer in Flax NNX with DeepSpeed's `deepspeed.moe.layer.MoE` semantics.

The gate is DeepSpeed's `TopKGate` (top-1 Switch and top-2 GShard routing, and its top-k gate for
k >= 3): softmax of fp32 router logits, a per-expert `capacity` of token slots, tokens over capacity
dropped, and the load-balancing loss `l_aux`. Dispatch and combine are the einsum formulation of
GShard's Algorithm 2 (DeepSpeed's `MOELayer`): a dispatch mask and combine weights [tokens, experts,
capacity] place every kept (token, expert) route in one slot of an [experts, capacity, model] buffer,
each expert runs on its own rows, and the combine weights gather the results back.

Everything random (Jitter, RSample, Random Token Selection, top-2's sampled second expert) is drawn
from an explicit key and only in training mode: `module.eval()` (what zerojax's evaluation does) or a
call without a key runs the gate deterministically. DeepSpeed keeps RTS and the second-expert
sampling on in evaluation too; here evaluation is reproducible instead.

Expert weights are stacked with a leading expert dimension ([experts, ...], logical name `expert`),
so an expert mesh axis can split dimension 0. With expert parallelism (a mesh `expert` axis, the plan
splitting the expert dimension over it) each device holds its experts' slice, and `moe_apply` runs
DeepSpeed's two all-to-alls around them (after the dispatch einsum, before the combine).

With a tensor axis, `enable_expert_tensor_parallelism` chooses between DeepSpeed's two layouts: True
(zerojax's default) slices each expert's MLP Megatron-style like the dense MLP; False (DeepSpeed's
default) keeps each expert whole on every tensor device, and since the tokens entering the layer are
the same on every device of a tensor group, each device sends only its 1/T of the dispatched
capacity through the experts and the results are gathered back (DeepSpeed's `drop_tokens` and
`gather_tokens`, here layout hints the tensor-parallel evaluator takes).

`MoE` takes zerojax's constructor (`d_ff`, SwiGLU experts); `DeepSpeedMoE` takes DeepSpeed's, argument
for argument (a user's expert module, copied per expert, and DeepSpeed's defaults), for code that ports.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax.core.mesh import expert_axis, tensor_axis
from zerojax.rewrite.tensor_slices import split_hint, whole_hint

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")  # DeepSpeed's topkgating: which tokens an over-full expert keeps
GATINGS = ("auto", "topk")  # auto: DeepSpeed's TopKGate choice by k; topk: its topkgating for every k
JITTER_EPS = 1e-2  # DeepSpeed's multiplicative_jitter epsilon


class Gating(NamedTuple):
    """The gate's decisions for S tokens over E experts with C slots each."""
    combine: jax.Array     # [S, E, C] float32: the weight of each token's result in each slot
    dispatch: jax.Array    # [S, E, C] bool: which slot each kept token is copied into
    l_aux: jax.Array       # scalar float32: the load-balancing loss
    exp_counts: jax.Array  # [E] int32: tokens routed to each expert, before capacity drops


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's `_capacity`: ceil(tokens / experts * factor), at least `min_capacity`.

    The product is taken in float32, as torch does it there (a Python float times a float32
    tensor), so a factor such as 1.2 rounds to the same number of slots as DeepSpeed's."""
    c = math.ceil(float(np.float32(num_tokens / num_experts) * np.float32(capacity_factor)))
    return max(c, int(min_capacity))


def _one_hot(idx: jax.Array, n: int) -> jax.Array:
    return jax.nn.one_hot(idx, n, dtype=jnp.int32)


def _slots(mask: jax.Array, locations: jax.Array, cap: int) -> jax.Array:
    """[S, E, C] one-hot of each kept (token, expert) pair's slot; zero rows for dropped pairs.

    Per pair, so a token may hold slots with several experts (top-k's mask has k ones a row)."""
    return mask[:, :, None] * _one_hot(locations * mask, cap)


def _l_aux(gates: jax.Array, mask1: jax.Array) -> jax.Array:
    """GShard's auxiliary loss: E * sum_e(mean gate_e * fraction of tokens whose first choice is e).

    DeepSpeed writes it as sum(me*ce)*E (top-1) and mean(me*ce)*E*E (top-2), the same number."""
    num_experts = gates.shape[1]
    me = jnp.mean(gates, axis=0)
    ce = jnp.mean(mask1.astype(jnp.float32), axis=0)
    return jnp.sum(me * ce) * num_experts


def _keep_first(mask: jax.Array, cap: int) -> jax.Array:
    """Keep each expert's first `cap` tokens in token order (position-based dropping)."""
    locations = jnp.cumsum(mask, axis=0) - 1
    return mask * (locations < cap)


def _keep_highest(mask: jax.Array, priority: jax.Array, cap: int) -> jax.Array:
    """Each expert keeps the `cap` of its routed tokens with the highest `priority` [S, E] (DeepSpeed's
    `torch.topk(..., dim=0)` over tokens, then `mask &`): with fewer routed tokens than `cap` it keeps
    them all, the rest of the selection landing on unrouted entries that the mask clears. At equal
    priorities the earlier token wins (torch's ties are unspecified)."""
    k = min(cap, mask.shape[0])  # topk cannot pick more tokens than there are; C may still be larger
    _, top = jax.lax.top_k(priority.T, k)  # [E, k] token indices
    chosen = jnp.zeros(mask.shape[::-1], jnp.int32).at[jnp.arange(mask.shape[1])[:, None], top].set(1).T
    return mask * chosen


def _keep_random(mask: jax.Array, cap: int, key: jax.Array) -> jax.Array:
    """Random Token Selection: each expert keeps `cap` of its tokens chosen by a uniform priority
    (DeepSpeed's `mask1 * uniform` then `topk` over tokens), so the sequence's end is not always
    the part dropped."""
    return _keep_highest(mask, mask * jax.random.uniform(key, mask.shape, jnp.float32), cap)


def _keep_most_probable(mask: jax.Array, gates: jax.Array, cap: int) -> jax.Array:
    """Top-k's `drop_policy="probs"`: each expert keeps the `cap` routed tokens with the largest raw
    softmax probability for it.

    DeepSpeed ranks its top-k-masked *gates* (the softmax probabilities of each token's k experts,
    zeros elsewhere), not the renormalized weights and, since its #7986, not the logits (before it, a
    routed negative logit ranked below the unrouted zeros and its route was dropped even with room to
    spare). Quirks kept: the probability is not comparable across tokens of different sharpness (a
    token spread over its k experts loses to a confident one), and the survivors then take their
    slots in token order, not in rank order."""
    return _keep_highest(mask, gates * mask, cap)


def top1_gating(logits: jax.Array, capacity_factor: float, min_capacity: int, *, drop_tokens: bool = True,
                rts_key: Optional[jax.Array] = None, rsample_key: Optional[jax.Array] = None,
                used_token: Optional[jax.Array] = None) -> Gating:
    """DeepSpeed's `top1gating` on fp32 logits [S, E].

    The expert is the argmax of the softmax (of logits plus Gumbel noise with `rsample_key`, the
    RSample policy); l_aux and exp_counts count every token; an expert over capacity keeps a random
    `capacity` of its tokens with `rts_key` (use_rts), else its first ones. The combine weight is the
    raw softmax probability of the chosen expert. Without dropping the capacity is every token (S);
    DeepSpeed sizes it to the busiest expert, which leaves the same slots filled and the rest empty.

    `used_token` [S] (DeepSpeed's argument: 1 for a real token, 0 for padding) zeroes an unused token's
    route before anything is counted: it takes no slot, adds nothing to exp_counts or to l_aux's
    fractions, though its softmax still enters l_aux's mean gate, as in DeepSpeed.
    """
    logits = logits.astype(jnp.float32)
    s, e = logits.shape
    if s < min_capacity:
        raise ValueError(f"top-1 gating: {s} tokens, fewer than min_capacity {min_capacity} (DeepSpeed asserts "
                         f"the same); lower min_capacity or route more tokens")
    gates = jax.nn.softmax(logits, axis=1)
    choose = logits + jax.random.gumbel(rsample_key, logits.shape) if rsample_key is not None else gates
    mask1 = _one_hot(jnp.argmax(choose, axis=1), e)
    if used_token is not None:
        mask1 = mask1 * used_token.astype(jnp.int32)[:, None]
    exp_counts = jnp.sum(mask1, axis=0)
    l_aux = _l_aux(gates, mask1)
    cap = capacity(s, e, capacity_factor, min_capacity) if drop_tokens else s
    mask1 = _keep_random(mask1, cap, rts_key) if rts_key is not None else _keep_first(mask1, cap)
    locations1 = jnp.cumsum(mask1, axis=0) - 1
    slots = _slots(mask1, locations1, cap)
    combine = (gates * mask1)[:, :, None] * slots
    return Gating(combine, slots.astype(bool), l_aux, exp_counts)


def top2_gating(logits: jax.Array, capacity_factor: float, min_capacity: int, *, drop_tokens: bool = True,
                second_key: Optional[jax.Array] = None) -> Gating:
    """DeepSpeed's `top2gating` on fp32 logits [S, E].

    First expert: the argmax of the softmax; second: the argmax of the other logits (plus Gumbel noise
    with `second_key`, DeepSpeed's `top2_2nd_expert_sampling`). Slots are taken in token order, every
    first choice before any second one; a choice past capacity (2 * factor) is dropped. The two kept
    gates are renormalized to sum to one. l_aux counts first choices only, exp_counts both.
    """
    logits = logits.astype(jnp.float32)
    s, e = logits.shape
    gates = jax.nn.softmax(logits, axis=1)
    mask1 = _one_hot(jnp.argmax(gates, axis=1), e)
    noisy = logits + jax.random.gumbel(second_key, logits.shape) if second_key is not None else logits
    mask2 = _one_hot(jnp.argmax(jnp.where(mask1 > 0, -jnp.inf, noisy), axis=1), e)
    locations1 = jnp.cumsum(mask1, axis=0) - 1
    locations2 = jnp.cumsum(mask2, axis=0) - 1 + jnp.sum(mask1, axis=0, keepdims=True)
    l_aux = _l_aux(gates, mask1)
    exp_counts = jnp.sum(mask1 + mask2, axis=0)
    cap = capacity(s, e, 2 * capacity_factor, min_capacity) if drop_tokens else s
    mask1 = mask1 * (locations1 < cap)
    mask2 = mask2 * (locations2 < cap)
    g1 = jnp.sum(gates * mask1, axis=1)
    g2 = jnp.sum(gates * mask2, axis=1)
    denom = jnp.maximum(g1 + g2, jnp.finfo(jnp.float32).eps)
    slots1, slots2 = _slots(mask1, locations1, cap), _slots(mask2, locations2, cap)
    combine = (g1 / denom)[:, None, None] * slots1 + (g2 / denom)[:, None, None] * slots2
    return Gating(combine, (slots1 + slots2).astype(bool), l_aux, exp_counts)


def topk_gating(logits: jax.Array, k: int, capacity_factor: float, min_capacity: int, *,
                drop_tokens: bool = True, drop_policy: str = "probs") -> Gating:
    """DeepSpeed's `topkgating` on fp32 logits [S, E] (its `TopKGate` uses it for k >= 3).

    Each token is routed to the k experts of largest softmax probability; l_aux and exp_counts count
    all k routes before any drop (l_aux = mean(me * ce) * E * E / k). With dropping, capacity is
    `_capacity` with factor `capacity_factor * k`; an over-full expert keeps its most probable tokens
    (`drop_policy="probs"`, DeepSpeed's default and the only one its layer uses) or its first ones
    (`"position"`). The kept routes' probabilities are renormalized to sum to one per token (at k = 1
    a kept token's weight is 1). Slots are taken in token order. Without dropping the capacity is
    every token (S); DeepSpeed sizes it to the busiest expert, which leaves the same slots filled and
    the rest empty.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"top-k gating: drop_policy {drop_policy!r}; choose one of {DROP_POLICIES}")
    logits = logits.astype(jnp.float32)
    s, e = logits.shape
    gates = jax.nn.softmax(logits, axis=1)
    _, top = jax.lax.top_k(gates, k)  # [S, k]; at equal probabilities the lower expert index first
    mask = jnp.sum(_one_hot(top, e), axis=1)  # [S, E], k ones a row
    exp_counts = jnp.sum(mask, axis=0)
    me, ce = jnp.mean(gates, axis=0), jnp.mean(mask.astype(jnp.float32), axis=0)
    l_aux = jnp.mean(me * ce) * e * e / k
    if drop_tokens:
        cap = capacity(s, e, capacity_factor * k, min_capacity)
        mask = _keep_most_probable(mask, gates, cap) if drop_policy == "probs" else _keep_first(mask, cap)
    else:
        cap = s
    locations = jnp.cumsum(mask, axis=0) - 1
    kept = gates * mask
    weights = kept / jnp.maximum(jnp.sum(kept, axis=1, keepdims=True), jnp.finfo(jnp.float32).eps)
    slots = _slots(mask, locations, cap)
    return Gating(weights[:, :, None] * slots, slots.astype(bool), l_aux, exp_counts)


def moe_apply(x: jax.Array, gating: Gating, experts: Callable[[jax.Array], jax.Array],
              axis: Optional[str] = None, tensor: Optional[str] = None) -> jax.Array:
    """Dispatch tokens x [S, M] into [E, C, M], run `experts` on it, combine back to [S, M].

    `axis`: the expert mesh axis (inside `shard_map`; None: every expert is local). With it this is
    where DeepSpeed's two all-to-alls go: after the dispatch each device holds [E, C, M] for its own
    tokens, viewed as [ep, E/ep, C, M], and sends expert block j to device j of its expert group
    (first all-to-all: [ep, E/ep, C, M] from every device of the group, DeepSpeed's `gecm`); the
    experts run on their own rows; the second all-to-all sends the results back ([ep, E/ep, C, M] ->
    [E, C, M]) before the combine. Capacity C is per device, as in DeepSpeed; it stays a dimension
    of its own through both all-to-alls.

    `tensor`: the tensor axis when the experts are whole on every tensor device (DeepSpeed's
    `enable_expert_tensor_parallelism=False`). The tokens are then the same on every device of a
    tensor group, so the capacity is split over it around the all-to-alls and the experts
    (DeepSpeed's `drop_tokens(dispatched, dim=1)`) and gathered back before the combine
    (`gather_tokens(expert_output, dim=1)`), padded to a multiple of the group's size with empty
    slots (DeepSpeed pads its no-drop capacity so; an empty slot changes nothing).
    """
    dispatched = jnp.einsum("sec,sm->ecm", gating.dispatch.astype(x.dtype), x)
    e, cap, m = dispatched.shape
    if tensor is not None:
        dispatched = split_hint(_pad_capacity(dispatched, jax.lax.axis_size(tensor)), 1)
    if axis is not None:
        ep = jax.lax.axis_size(axis)
        # invariant: block j of dim 0 holds the tokens for device j's experts; after the exchange block j
        # holds this device's experts' rows from device j, the capacity dimension untouched
        dispatched = jax.lax.all_to_all(dispatched.reshape(ep, e // ep, -1, m), axis, 0, 0, tiled=True)
    out = experts(dispatched)
    if axis is not None:
        out = jax.lax.all_to_all(out, axis, 0, 0, tiled=True).reshape(e, -1, m)  # the inverse exchange
    if tensor is not None:
        out = whole_hint(out)[:, :cap]
    combined = jnp.einsum("sec,ecm->sm", gating.combine, out.astype(jnp.float32))
    return combined.astype(x.dtype)


def _pad_capacity(dispatched: jax.Array, size: int) -> jax.Array:
    """[E, C, M] with empty slots appended up to a capacity that `size` devices divide."""
    extra = -dispatched.shape[1] % size
    return jnp.pad(dispatched, ((0, 0), (0, extra), (0, 0))) if extra else dispatched


class SwiGLUExperts(nnx.Module):
    """E SwiGLU MLPs (the Llama's MLP) with weights stacked [E, ...]; applied to [..., E, C, d_model]
    (with an expert axis [ep, E/ep, C, d_model], DeepSpeed's `gecm`)."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int, *, init: Callable, out_init: Callable,
                 rngs: nnx.Rngs):
        def param(shape: tuple[int, ...], fn: Callable, names: tuple[str, ...]) -> nnx.Param:
            # annotated, never placed here: zerojax (or a later expert axis) decides where it lives
            return nnx.Param(fn(rngs.params(), shape, jnp.float32), out_sharding=names, eager_sharding=False)

        self.gate = param((num_experts, d_model, d_ff), init, ("expert", "embed", "mlp"))
        self.up = param((num_experts, d_model, d_ff), init, ("expert", "embed", "mlp"))
        self.down = param((num_experts, d_ff, d_model), out_init, ("expert", "mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        g = jnp.einsum("...ecm,emf->...ecf", x, self.gate[...].astype(dt))
        u = jnp.einsum("...ecm,emf->...ecf", x, self.up[...].astype(dt))
        return jnp.einsum("...ecf,efm->...ecm", jax.nn.silu(g) * u, self.down[...].astype(dt))


class DenseMLP(nnx.Module):
    """One SwiGLU MLP: PR-MoE's residual branch (DeepSpeed's `MoE.mlp`, a copy of the expert)."""

    def __init__(self, d_model: int, d_ff: int, *, init: Callable, out_init: Callable, rngs: nnx.Rngs):
        def linear(n_in: int, n_out: int, fn: Callable) -> nnx.Linear:
            return nnx.Linear(n_in, n_out, use_bias=False, kernel_init=fn, rngs=rngs)

        self.gate, self.up, self.down = linear(d_model, d_ff, init), linear(d_model, d_ff, init), \
            linear(d_ff, d_model, out_init)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class MoE(nnx.Module):
    """DeepSpeed's `MoE(hidden_size, expert, num_experts, ep_size=1, k, capacity_factor, ...)` with
    SwiGLU experts; `__call__(x, key)` returns (output, l_aux, exp_counts) as DeepSpeed's forward does.

    `k` is any number of experts up to `num_experts`: as DeepSpeed's `TopKGate`, k = 1 gates with
    `top1gating`, k = 2 with `top2gating`, k >= 3 with `topkgating` (drop policy "probs": DeepSpeed's
    layer passes no other). `gating="topk"` (not a DeepSpeed argument) takes `topkgating` for every
    k: at k = 1 that renormalizes the kept weight to 1 (transformers' Mixtral with one expert a token)
    where `top1gating` weights by the raw probability. `topkgating` has no RSample, RTS or sampled
    second expert; Jitter applies to every gate.

    `use_residual` is PR-MoE (Residual MoE): a dense MLP beside the experts, mixed per token by a
    softmax over a learned 2-way coefficient. `deterministic` (set by `module.eval()`) selects
    `eval_capacity_factor` and turns every noise source off.

    `enable_expert_tensor_parallelism` (DeepSpeed's argument; DeepSpeed defaults it to False, zerojax
    to True, what its plans did before the choice existed) says how the experts meet a tensor axis:
    True, sliced like the dense MLP (the plan splits their `d_ff`); False, whole on every tensor
    device, each device running its 1/T of the dispatched tokens (`moe_apply`'s `tensor`). The plan
    must agree (`model.expert_tensor_parallelism`). Where it does not the result is still exact, only
    slower: sliced experts meeting split tokens are run on gathered inputs (the tensor-parallel
    evaluator logs it), whole experts given every token compute the same thing on every tensor device.
    """

    def __init__(self, hidden_size: int, d_ff: int, num_experts: int, *, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, top2_2nd_expert_sampling: bool = True, gating: str = "auto",
                 enable_expert_tensor_parallelism: bool = True, init_std: float = 0.02,
                 out_init_std: Optional[float] = None, rngs: nnx.Rngs):
        if not 1 <= k <= num_experts:
            raise ValueError(f"MoE: k={k}; each token is routed to between 1 and num_experts ({num_experts}) "
                             f"experts")
        if gating not in GATINGS:
            raise ValueError(f"MoE: gating {gating!r}; choose one of {GATINGS}")
        if noisy_gate_policy == "None":
            noisy_gate_policy = None
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"MoE: noisy_gate_policy {noisy_gate_policy!r}; choose one of {NOISY_GATE_POLICIES}")
        init = nnx.initializers.normal(init_std)
        out_init = nnx.initializers.normal(out_init_std if out_init_std is not None else init_std)
        self.num_experts, self.k = num_experts, k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.drop_tokens, self.use_rts = min_capacity, drop_tokens, use_rts
        self.noisy_gate_policy, self.top2_2nd_expert_sampling = noisy_gate_policy, top2_2nd_expert_sampling
        self.use_residual, self.gating = use_residual, gating
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.deterministic = False
        self.router = nnx.Linear(hidden_size, num_experts, use_bias=False, kernel_init=init, rngs=rngs)
        self.experts = SwiGLUExperts(num_experts, hidden_size, d_ff, init=init, out_init=out_init, rngs=rngs)
        if use_residual:
            self.mlp = DenseMLP(hidden_size, d_ff, init=init, out_init=out_init, rngs=rngs)
            self.coefficient = nnx.Linear(hidden_size, 2, kernel_init=init, rngs=rngs)

    def _expert_axis(self) -> Optional[str]:
        """The expert mesh axis when this device holds only its slice of the experts (expert
        parallelism: the plan split the weights' expert dimension over it), else None."""
        local = self._local_experts()
        if local == self.num_experts:
            return None
        axis = expert_axis()
        if axis is None or local * jax.lax.axis_size(axis) != self.num_experts:
            raise ValueError(f"MoE: this device holds {local} of the {self.num_experts} experts, but the mesh being "
                             f"traced has no expert axis that many devices share (axis {axis!r}); expert weights are "
                             f"split over the mesh's expert axis only")
        return axis

    def _local_experts(self) -> int:
        """How many experts this device holds (all of them, or its slice under expert parallelism)."""
        return self.experts.gate[...].shape[0]

    def _tensor_axis(self) -> Optional[str]:
        """The tensor axis this layer splits its dispatched tokens over: the one of the mesh being traced
        when the experts are whole on every tensor device, else None."""
        return None if self.enable_expert_tensor_parallelism else tensor_axis()

    def gate(self, x: jax.Array, key: Optional[jax.Array] = None, used_token: Optional[jax.Array] = None) -> Gating:
        """The routing of tokens x [S, M] (DeepSpeed's `TopKGate.forward`); `used_token` [S] as in
        `top1_gating`, which alone takes it (DeepSpeed's top-2 and top-k gates ignore it silently;
        here they refuse it)."""
        if used_token is not None and (self.k != 1 or self.gating == "topk"):
            raise ValueError(f"MoE: used_token with k={self.k} (gating {self.gating!r}); DeepSpeed masks unused "
                             f"tokens in its top-1 gate only and ignores the mask otherwise; use k=1 or drop "
                             f"used_token")
        training = not self.deterministic
        keys = list(jax.random.split(key, 4)) if training and key is not None else [None] * 4
        gate_in = x.astype(jnp.float32)
        if self.noisy_gate_policy == "Jitter" and keys[0] is not None:
            gate_in = gate_in * jax.random.uniform(keys[0], gate_in.shape, jnp.float32,
                                                   1.0 - JITTER_EPS, 1.0 + JITTER_EPS)
        logits = gate_in @ self.router.kernel[...].astype(jnp.float32)
        factor = self.capacity_factor if training else self.eval_capacity_factor
        if self.k >= 3 or self.gating == "topk":
            return topk_gating(logits, self.k, factor, self.min_capacity, drop_tokens=self.drop_tokens)
        if self.k == 1:
            return top1_gating(logits, factor, self.min_capacity, drop_tokens=self.drop_tokens,
                               rts_key=keys[1] if self.use_rts else None,
                               rsample_key=keys[2] if self.noisy_gate_policy == "RSample" else None,
                               used_token=used_token)
        return top2_gating(logits, factor, self.min_capacity, drop_tokens=self.drop_tokens,
                           second_key=keys[3] if self.top2_2nd_expert_sampling else None)

    def __call__(self, x: jax.Array, key: Optional[jax.Array] = None,
                 used_token: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [..., hidden] -> (output like x, l_aux, exp_counts [E]); all tokens are routed together.
        `used_token` [...] (x's shape less hidden) masks tokens out of the gate (`top1_gating`)."""
        tokens = x.reshape(-1, x.shape[-1])
        used = None if used_token is None else jnp.reshape(used_token, (-1,))
        gating = self.gate(tokens, key, used)
        out = moe_apply(tokens, gating, self.experts, self._expert_axis(), self._tensor_axis()).reshape(x.shape)
        if self.use_residual:
            coef = jax.nn.softmax(self.coefficient(x).astype(jnp.float32), axis=-1)
            out = (out * coef[..., 0:1] + self._residual(x) * coef[..., 1:]).astype(x.dtype)
        return out, gating.l_aux, gating.exp_counts

    def _residual(self, x: jax.Array) -> jax.Array:
        """PR-MoE's dense branch on x [..., hidden]."""
        return self.mlp(x)



class ExpertCopies(nnx.Module):
    """DeepSpeed's `Experts`: `num_experts` copies of one user module, each starting with its weights
    (DeepSpeed deep-copies the module). The copies' parameters are stacked [E, ...] with the logical
    name `expert` in front of the module's own names, so the plan splits them over an expert axis as it
    splits `SwiGLUExperts`; one copy runs on each expert's rows ([..., E, C, M]) under `jax.vmap`.
    A module returning a tuple gives its first element, as DeepSpeed's experts do (the bias term)."""

    def __init__(self, expert: nnx.Module, num_experts: int):
        graphdef, params, rest = nnx.split(expert, nnx.Param, ...)

        def stack(v: nnx.Variable) -> nnx.Variable:
            names = v.get_metadata().get("out_sharding") or (None,) * v[...].ndim
            value = jnp.broadcast_to(v[...], (num_experts, *v[...].shape))
            return v.replace(value=value, out_sharding=("expert", *names), eager_sharding=False)

        stacked = jax.tree.map(stack, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.stack = nnx.merge(graphdef, stacked, rest)

    def count(self) -> int:
        return jax.tree.leaves(nnx.state(self.stack, nnx.Param))[0].shape[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        graphdef, params, rest = nnx.split(self.stack, nnx.Param, ...)
        axis = x.ndim - 3  # [E, C, M], or [ep, E/ep, C, M] behind the expert all-to-all

        def one(p: nnx.State, rows: jax.Array) -> jax.Array:
            out = nnx.merge(graphdef, p, rest)(rows)
            return out[0] if isinstance(out, tuple) else out

        return jax.vmap(one, in_axes=(0, axis), out_axes=axis)(params, x)


class DeepSpeedMoE(MoE):
    """DeepSpeed's `deepspeed.moe.layer.MoE`, argument for argument, for code that ports: the experts are
    copies of the user's `expert` module, the defaults are DeepSpeed's, and `__call__(hidden_states,
    used_token=None, key=None)` returns `(output, l_aux, exp_counts)`.

    The gates, dispatch, expert all-to-alls and the residual branch are `MoE`'s. `ep_size` is checked
    (it must divide `num_experts`, as DeepSpeed asserts) but the experts are split by the mesh's
    `expert` axis (`mesh.expert`), not by this number. `use_tutel` is accepted and refused when True
    (no Tutel kernels here). With `use_residual` the dense branch is one more copy of `expert`
    (`nnx.clone`; DeepSpeed's `self.mlp = expert`, the original beside its copies) and the mixing coefficient a `nnx.Linear(hidden_size, 2)`.
    Randomness (RTS, RSample, Jitter, top-2's sampled second expert) is drawn from `key` in training
    only (`MoE`); without a key the gate is deterministic. Initial router and coefficient weights are
    Flax's `nnx.Linear` defaults, not torch's.
    """

    def __init__(self, hidden_size: int, expert: nnx.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True, *, rngs: nnx.Rngs):
        if not isinstance(expert, nnx.Module):
            raise TypeError(f"DeepSpeedMoE: expert is a {type(expert).__name__}; pass one Flax NNX module (its "
                            f"copies become the experts, as DeepSpeed deep-copies its torch module)")
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"DeepSpeedMoE: ep_size {ep_size} does not divide num_experts {num_experts} (DeepSpeed "
                             f"asserts the same); choose an ep_size dividing it")
        if use_tutel:
            raise ValueError("DeepSpeedMoE: use_tutel=True; zerojax has no Tutel kernels, its dispatch is the einsum "
                             "one; leave use_tutel False")
        if not 1 <= k <= num_experts:
            raise ValueError(f"DeepSpeedMoE: k={k}; each token is routed to between 1 and num_experts "
                             f"({num_experts}) experts")
        if noisy_gate_policy == "None":
            noisy_gate_policy = None
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"DeepSpeedMoE: noisy_gate_policy {noisy_gate_policy!r}; choose one of "
                             f"{NOISY_GATE_POLICIES}")
        self.num_experts, self.k, self.ep_size = num_experts, k, ep_size
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.drop_tokens, self.use_rts = min_capacity, drop_tokens, use_rts
        self.noisy_gate_policy, self.top2_2nd_expert_sampling = noisy_gate_policy, top2_2nd_expert_sampling
        self.use_residual, self.gating = use_residual, "auto"
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.deterministic = False
        self.router = nnx.Linear(hidden_size, num_experts, use_bias=False, rngs=rngs)
        self.experts = ExpertCopies(expert, num_experts)
        if use_residual:
            self.mlp = nnx.clone(expert)
            self.coefficient = nnx.Linear(hidden_size, 2, rngs=rngs)

    def _local_experts(self) -> int:
        return self.experts.count()

    def _residual(self, x: jax.Array) -> jax.Array:
        out = self.mlp(x)
        return out[0] if isinstance(out, tuple) else out

    def __call__(self, hidden_states: jax.Array, used_token: Optional[jax.Array] = None,
                 key: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """DeepSpeed's `MoE.forward(hidden_states, used_token)`: (output, l_aux, exp_counts)."""
        return super().__call__(hidden_states, key, used_token)
