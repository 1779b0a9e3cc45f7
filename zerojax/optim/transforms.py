"""Optimizer building blocks as small optax transformations over NamedTuple state.

What DeepSpeed's optimizers compute that optax's stock ones do not, in exactly torch's form: Adam's
moments with or without bias correction, LAMB's clamped trust ratio, torch's Adagrad and SGD
momentum, weight decay and lr scales per leaf, and DeepSpeed's Muon. Everything but Muon
is elementwise or a per-leaf norm, so it runs unchanged on ZeRO-sharded fp32 master weights under
`jax.jit`; Muon's Newton-Schulz iteration takes whole matrices (its `whole` hook gathers them). Which of them a
DeepSpeed config builds is `zerojax.optim.deepspeed`'s business, and which leaf gets which decay,
lr scale or Muon/Adam label (by name) is `zerojax.optim.groups`'; here each is a tree or a callable
(optax's `mask` convention), so nothing below the planner reads a name or the config.

Relies on: no mesh axis (the kernels and the step apply these on whatever shards they hold), except
Muon's `whole` hook, which the plan gives to gather a matrix.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax


__all__ = ["SKIP", "Keep", "kept", "PerLeaf", "add_decay", "scale_per_leaf", "bias_corrections", "AdamSettings",
           "LrSchedule", "ScaleByMomentsState", "ScaleByAdagradState", "TorchMomentumState", "scale_by_moments",
           "scale_by_clamped_trust_ratio", "scale_by_adagrad", "torch_momentum", "NS_COEFFS", "NS_METHODS",
           "newton_schulz", "MuonState", "scale_by_muon", "MuonAdamState",
           "scale_by_muon_with_adam", "scale_by_label"]

ScheduleFn = Callable[[jax.Array], jax.Array]

#: The extra argument (optax's `extra_args`) a step passes to `update` when it may throw the update
#: away: a `Keep`. The stateful transformations below hand it their new buffers, and compute their
#: direction from the buffers it returns; the step keeps everything else. So the buffer written to
#: the state is the one the direction reads: XLA writes it once, in place of the donated old one,
#: instead of computing it twice (once for the state, once inside the parameter update) from an old
#: buffer it must first copy so as not to read it after overwriting it - two copies of every moment
#: per step. Exact: on a step that is not skipped a kept buffer is the new one, bit for bit; on a
#: skipped step the direction is discarded.
SKIP = "skip_step"


class Keep:
    """The buffers of a step that may be skipped: `keep(old, new)` is `new`, or `old` where `skip`
    is true. It remembers what it kept, so that `select` (the step's, over the whole state) leaves
    those alone: a second select of the same buffer would be computed once more inside the
    parameter update, which then reads the old buffer again after it was overwritten."""

    def __init__(self, skip: jax.Array):
        self.skip = skip
        self._kept: dict[int, tuple[Any, Any]] = {}  # id(kept) -> (kept, the old leaf it keeps)

    def __call__(self, old: Any, new: Any) -> Any:
        def one(o: Any, n: Any) -> Any:
            if o is None:
                return n
            out = jnp.where(self.skip, o, n)
            self._kept[id(out)] = (out, o)
            return out
        return jax.tree.map(one, old, new, is_leaf=lambda x: x is None)

    def select(self, old: Any, new: Any) -> Any:
        """`new`, or `old` where `skip` is true, leaf by leaf; a leaf this Keep kept from the same
        old leaf is already that."""
        def one(o: Any, n: Any) -> Any:
            done = self._kept.get(id(n))
            return n if done is not None and done[0] is n and done[1] is o else jnp.where(self.skip, o, n)
        return jax.tree.map(one, old, new)


def kept(extra: dict[str, Any], old: Any, new: Any) -> Any:
    """A transformation's new buffers as the step keeps them (see `SKIP`); `new` outside such a step."""
    keep = extra.get(SKIP)
    return new if keep is None else keep(old, new)


# ---------------------------------------------------------------------------------------------
# Building blocks optax lacks in the exact form DeepSpeed/torch compute.

class ScaleByMomentsState(NamedTuple):
    """Adam's moments and the number of updates already folded into them."""
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def bias_corrections(b1: jax.Array | float, b2: jax.Array | float, count: jax.Array,
                     bias_correction: bool = True) -> tuple[jax.Array, jax.Array]:
    """(1 - b1**t, 1 - b2**t) for the t-th update (t counts from 1), or (1, 1) without correction.

    FusedAdam and FusedLamb use the *current* betas, so a cycled beta1 enters the correction.
    """
    if not bias_correction:
        one = jnp.ones((), jnp.float32)
        return one, one
    t = count.astype(jnp.float32)
    return 1 - b1 ** t, 1 - b2 ** t


def scale_by_moments(b1: jax.Array | float, b2: jax.Array | float, eps: float,
                     bias_correction: bool = True) -> optax.GradientTransformation:
    """Adam's direction m_hat / (sqrt(v_hat) + eps), bias correction optional.

    Shared by Adam and Lamb: FusedAdam and FusedLamb both divide m and v by (1 - beta**t) with the
    *current* betas (so a cycled beta1 enters the correction), or not at all when bias_correction is
    off, and add eps outside the square root.
    """
    def init_fn(params: optax.Params) -> ScaleByMomentsState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return ScaleByMomentsState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros)

    def update_fn(updates: optax.Updates, state: ScaleByMomentsState, params: optax.Params | None = None,
                  **extra: Any) -> tuple[optax.Updates, ScaleByMomentsState]:
        del params
        mu = kept(extra, state.mu, jax.tree.map(lambda g, m: b1 * m + (1 - b1) * g, updates, state.mu))
        nu = kept(extra, state.nu, jax.tree.map(lambda g, v: b2 * v + (1 - b2) * g * g, updates, state.nu))
        count = optax.safe_increment(state.count)
        c1, c2 = bias_corrections(b1, b2, count, bias_correction)
        direction = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        return direction, ScaleByMomentsState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _trust_ratio(w: jax.Array, u: jax.Array, min_coeff: float, max_coeff: float) -> jax.Array:
    """FusedLamb's coefficient ||w|| / ||u|| clamped to [min, max], 1 when either norm is 0."""
    w_norm = jnp.sqrt(jnp.sum(jnp.square(w.astype(jnp.float32))))
    u_norm = jnp.sqrt(jnp.sum(jnp.square(u.astype(jnp.float32))))
    usable = (w_norm != 0) & (u_norm != 0)
    ratio = w_norm / jnp.where(u_norm != 0, u_norm, 1.0)
    return jnp.where(usable, jnp.clip(ratio, min_coeff, max_coeff), 1.0)


def scale_by_clamped_trust_ratio(min_coeff: float, max_coeff: float) -> optax.GradientTransformation:
    """Scale each leaf's update by its Lamb trust ratio.

    One ratio per parameter tensor, as FusedLamb computes it per tensor it is handed. (Under ZeRO
    stages 1-2 DeepSpeed hands it each rank's flat partition instead, which makes the ratio depend on
    the data-parallel size; the per-tensor ratio does not.) optax.scale_by_trust_ratio has no clamp.
    """
    def update_fn(updates: optax.Updates, state: optax.EmptyState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, optax.EmptyState]:
        if params is None:
            raise ValueError("Lamb's trust ratio needs params: call update(grads, state, params)")
        scaled = jax.tree.map(lambda u, w: u * _trust_ratio(w, u, min_coeff, max_coeff).astype(u.dtype),
                              updates, params)
        return scaled, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


class ScaleByAdagradState(NamedTuple):
    """Running sum of squared gradients."""
    sum_of_squares: optax.Updates


def scale_by_adagrad(initial_accumulator_value: float, eps: float) -> optax.GradientTransformation:
    """torch.optim.Adagrad's g / (sqrt(sum g^2) + eps).

    optax.scale_by_rss puts eps inside the square root and zeroes the update while the sum is 0;
    torch adds eps outside, which matters with the tiny default eps (1e-10) and a zero accumulator.
    """
    def init_fn(params: optax.Params) -> ScaleByAdagradState:
        return ScaleByAdagradState(
            jax.tree.map(lambda p: jnp.full_like(p, initial_accumulator_value), params))

    def update_fn(updates: optax.Updates, state: ScaleByAdagradState, params: optax.Params | None = None,
                  **extra: Any) -> tuple[optax.Updates, ScaleByAdagradState]:
        del params
        sums = kept(extra, state.sum_of_squares,
                    jax.tree.map(lambda g, s: s + g * g, updates, state.sum_of_squares))
        direction = jax.tree.map(lambda g, s: g / (jnp.sqrt(s) + eps), updates, sums)
        return direction, ScaleByAdagradState(sums)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class TorchMomentumState(NamedTuple):
    """torch.optim.SGD's momentum buffer; count tells whether it has been seeded yet."""
    count: jax.Array
    buf: optax.Updates


def torch_momentum(momentum: float, dampening: float, nesterov: bool) -> optax.GradientTransformation:
    """torch.optim.SGD's momentum: buf = g on the first step, then momentum*buf + (1-dampening)*g.

    optax.trace starts from a zero buffer and has no dampening, so its steps differ from torch's
    whenever dampening is non-zero (the first step is undampened in torch).

    It does not take `SKIP`: the step's select keeps its buffer. Read back from the kept buffer,
    Nesterov's g + momentum * buf comes out an ulp away from today's steps on XLA:CPU (which fuses,
    and contracts, the recomputed buffer differently), and the results are kept bit for bit.
    """
    def init_fn(params: optax.Params) -> TorchMomentumState:
        return TorchMomentumState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates: optax.Updates, state: TorchMomentumState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, TorchMomentumState]:
        del params
        first = state.count == 0
        buf = jax.tree.map(lambda g, b: jnp.where(first, g, momentum * b + (1 - dampening) * g),
                           updates, state.buf)
        if nesterov:
            direction = jax.tree.map(lambda g, b: g + momentum * b, updates, buf)
        else:
            direction = buf
        return direction, TorchMomentumState(optax.safe_increment(state.count), buf)

    return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------------------------
# Muon (DeepSpeed's deepspeed/runtime/zero/muon/original_muon.py: muon_update and its two
# Newton-Schulz forms). Unlike everything above it reads whole matrices: see docs/zero.md for how a
# ZeRO shard gets one.

#: The quintic's coefficients (Keller Jordan's; DeepSpeed's and optax.contrib.muon's default).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
_NS_EPS = 1e-7  # DeepSpeed's X / (||X||_F + 1e-7)


def _mT(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def newton_schulz(g: jax.Array, steps: int = 5, method: str = "standard") -> jax.Array:
    """Orthogonalise the trailing two dimensions of `g` (leading ones are a batch), as DeepSpeed's
    zeropower_via_newtonschulz5 ("standard") or zeropower_via_gram_newtonschulz ("gram").

    Both iterate X <- aX + (bA + cA^2)X with A = XX^T on the wide orientation after dividing by the
    Frobenius norm; "gram" carries the small Gram matrix and one accumulated left factor instead of
    X (restarting at step 2 as DeepSpeed does), the same map in exact arithmetic. DeepSpeed runs them
    in bf16 / fp16 on a GPU; here they run in the dtype of `g` (the fp32 master's).
    """
    if method not in NS_METHODS:
        raise ValueError(f"ns_method: '{method}' is not one of {', '.join(NS_METHODS)}")
    a, b, c = NS_COEFFS
    tall = g.shape[-2] > g.shape[-1]
    x = _mT(g) if tall else g
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + _NS_EPS)
    n, m = x.shape[-2:]
    if method == "standard" or m <= n:
        for _ in range(steps):
            A = x @ _mT(x)
            x = a * x + (b * A + c * A @ A) @ x
        return _mT(x) if tall else x
    eye = jnp.eye(n, dtype=x.dtype)
    R, Q, restart = x @ _mT(x), None, 2
    for i in range(steps):
        if i == restart:
            x = Q @ x
            R, Q = x @ _mT(x), None
        Z = b * R + c * R @ R
        Q = Z + a * eye if Q is None else a * Q + Z @ Q
        if i < steps - 1 and i + 1 != restart:
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    x = Q @ x
    return _mT(x) if tall else x


def _muon_direction(g: jax.Array, m: jax.Array, momentum: float, ns_steps: int, ns_method: str,
                    nesterov: bool = True, whole: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    u = (1 - momentum) * g + momentum * m if nesterov else m
    if whole is not None:  # one all-gather of the matrix instead of collectives inside every NS product
        u = whole(u)
    scale = max(1.0, g.shape[-1] / g.shape[-2]) ** 0.5
    x = newton_schulz(u, ns_steps, ns_method)
    if whole is not None:  # and the iteration stays whole: XLA would otherwise pull the shard's layout into it
        x = whole(x)
    return (x * scale).astype(g.dtype)


class MuonState(NamedTuple):
    """Muon's one buffer per matrix: the momentum (DeepSpeed's state["momentum_buffer"])."""
    momentum: optax.Updates


def scale_by_muon(momentum: float, ns_method: str = "gram", ns_steps: int = 5,
                  nesterov: bool = True) -> optax.GradientTransformation:
    """DeepSpeed's muon_update: m = beta*m + (1-beta)*g; u = (1-beta)*g + beta*m (Nesterov, always on
    in DeepSpeed; off: u = m); orthogonalise u; times sqrt(max(1, fan_out / fan_in)).

    The shape factor is DeepSpeed's max(1, rows / cols)**0.5 of torch's [out, in] weight, read off a
    JAX [..., in, out] kernel as its last two dimensions: the same number for the same layer.
    """
    def init_fn(params: optax.Params) -> MuonState:
        return MuonState(momentum=jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates: optax.Updates, state: MuonState, params: optax.Params | None = None,
                  **extra: Any) -> tuple[optax.Updates, MuonState]:
        del params
        mom = kept(extra, state.momentum,
                   jax.tree.map(lambda g, m: momentum * m + (1 - momentum) * g, updates, state.momentum))
        return (jax.tree.map(lambda g, m: _muon_direction(g, m, momentum, ns_steps, ns_method, nesterov),
                             updates, mom), MuonState(momentum=mom))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class MuonAdamState(NamedTuple):
    """MuonWithAuxAdam's state, every tree shaped like the parameters: `momentum` holds the Muon
    matrices' buffers, `mu` / `nu` the Adam leaves' moments, and a leaf of the other group holds None
    (no bytes; the plan places the others as their parameters' update shards)."""
    count: jax.Array
    momentum: optax.Updates
    mu: optax.Updates
    nu: optax.Updates


def scale_by_muon_with_adam(momentum: float, ns_method: str, b1: float, b2: float, eps: float,
                            labels: Callable[[Any], Any], ns_steps: int = 5,
                            whole: Callable[[jax.Array], jax.Array] | None = None) -> optax.GradientTransformation:
    """DeepSpeed's MuonWithAuxAdam direction: Muon's for the leaves `labels(params)` calls "muon",
    bias-corrected Adam's (eps outside the square root, as its adam_update) for the others. One
    transformation with parameter-shaped state (rather than optax.multi_transform's masked trees), so
    the plan places every buffer as its parameter's update shard. `whole(u)` (the plan's: a
    replicated sharding constraint) makes each ZeRO shard's matrix whole before the iteration."""
    def init_fn(params: optax.Params) -> MuonAdamState:
        lab = labels(params)
        mine = lambda want: lambda x, l: jnp.zeros_like(x) if l == want else None  # noqa: E731
        return MuonAdamState(count=jnp.zeros([], jnp.int32), momentum=jax.tree.map(mine("muon"), params, lab),
                             mu=jax.tree.map(mine("adam"), params, lab), nu=jax.tree.map(mine("adam"), params, lab))

    def update_fn(updates: optax.Updates, state: MuonAdamState, params: optax.Params | None = None,
                  **extra: Any) -> tuple[optax.Updates, MuonAdamState]:
        del params
        lab = labels(updates)
        count = optax.safe_increment(state.count)
        c1, c2 = bias_corrections(b1, b2, count)

        def muon(g: jax.Array, m: jax.Array, l: str) -> jax.Array:
            return momentum * m + (1 - momentum) * g if l == "muon" else m
        mom = kept(extra, state.momentum, jax.tree.map(muon, updates, state.momentum, lab))
        mu = kept(extra, state.mu, jax.tree.map(lambda g, m, l: b1 * m + (1 - b1) * g if l == "adam" else m,
                                               updates, state.mu, lab))
        nu = kept(extra, state.nu, jax.tree.map(lambda g, v, l: b2 * v + (1 - b2) * g * g if l == "adam" else v,
                                               updates, state.nu, lab))

        def direction(g: jax.Array, m: jax.Array, a: jax.Array, v: jax.Array, l: str) -> jax.Array:
            if l == "muon":
                return _muon_direction(g, m, momentum, ns_steps, ns_method, whole=whole)
            return (a / c1) / (jnp.sqrt(v / c2) + eps)
        out = jax.tree.map(direction, updates, mom, mu, nu, lab)
        return out, MuonAdamState(count=count, momentum=mom, mu=mu, nu=nu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_label(labels: Callable[[Any], Any], scales: dict[str, Any]) -> optax.GradientTransformation:
    """Each leaf's update times the scale of its label (Muon's and Adam's lr relative to the schedule)."""
    def update_fn(updates: optax.Updates, state: optax.EmptyState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        return jax.tree.map(lambda u, l: u * jnp.asarray(scales[l], u.dtype), updates, labels(updates)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


# ---------------------------------------------------------------------------------------------
# Per-leaf weight decay and lr scales. Which leaf gets what (by name, from the config's groups) is
# `zerojax.optim.groups`' business; these take the answer as a tree.

#: A value per leaf: a pytree of floats shaped like the parameters, or a callable from the
#: parameters (or updates) to that pytree, as optax's `mask` arguments are.
PerLeaf = Any


def _per_leaf(values: PerLeaf, tree: Any) -> Any:
    return values(tree) if callable(values) else values


def add_decay(weight_decay: PerLeaf) -> optax.GradientTransformation:
    """`+ wd * p` with each leaf's own wd (constants: nothing is stored); a leaf at 0 is left as is."""
    def update_fn(updates: optax.Updates, state: optax.EmptyState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, optax.EmptyState]:
        if params is None:
            raise ValueError("add_decay: the update needs params")
        return jax.tree.map(lambda u, p, wd: u + wd * p if wd else u, updates, params,
                            _per_leaf(weight_decay, params)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def scale_per_leaf(scales: PerLeaf) -> optax.GradientTransformation:
    """Each leaf's step times its own scale (after the lr: a parameter group's lr_scale)."""
    def update_fn(updates: optax.Updates, state: optax.EmptyState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        return jax.tree.map(lambda u, k: u if k == 1.0 else u * jnp.asarray(k, u.dtype), updates,
                            _per_leaf(scales, updates)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


# ---------------------------------------------------------------------------------------------
# One factory per optimizer; hyperparameters that may be scheduled are the factory's arguments.

class AdamSettings(NamedTuple):
    """The constants of DeepSpeed's Adam for a config (what a fused kernel needs besides state)."""
    decoupled: bool        # AdamW's decay (True) or L2 into the gradient (adam_w_mode false)
    weight_decay: float
    eps: float
    bias_correction: bool


class LrSchedule(NamedTuple):
    """Per-update hyperparameters; each callable maps optax's update count to a float32 scalar."""
    lr: ScheduleFn
    beta1: ScheduleFn | None = None  # OneCycle's cycled momentum, else None (optimizer's own beta1)
    beta2: ScheduleFn | None = None  # 0.99 while OneCycle cycles momentum, else None
