"""Optimizer building blocks as small optax transformations over NamedTuple state.

What DeepSpeed's optimizers compute that optax's stock ones do not, in exactly torch's form: Adam's
moments with or without bias correction, LAMB's clamped trust ratio, torch's Adagrad and SGD
momentum, weight decay and lr scales per parameter name, and DeepSpeed's Muon. Everything but Muon
is elementwise or a per-leaf norm, so it runs unchanged on ZeRO-sharded fp32 master weights under
`jax.jit`; Muon's Newton-Schulz iteration takes whole matrices (its `whole` hook gathers them). Which of them a
DeepSpeed config builds is `zerojax.optim.deepspeed`'s business.
"""
from __future__ import annotations

import fnmatch
import re
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zerojax.core.names import dotted
from zerojax.errors import ConfigError

if TYPE_CHECKING:
    from zerojax.config import ParamGroup

__all__ = ["Groups", "name_matches", "decay_by_name", "scale_lr_by_name", "bias_corrections", "AdamSettings",
           "LrSchedule", "ScaleByMomentsState", "ScaleByAdagradState", "TorchMomentumState", "scale_by_moments",
           "scale_by_clamped_trust_ratio", "scale_by_adagrad", "torch_momentum", "NS_COEFFS", "NS_METHODS",
           "newton_schulz", "MuonState", "scale_by_muon", "muon_labels", "MuonAdamState",
           "scale_by_muon_with_adam", "scale_by_label"]

ScheduleFn = Callable[[jax.Array], jax.Array]


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

    def update_fn(updates: optax.Updates, state: ScaleByMomentsState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, ScaleByMomentsState]:
        del params
        mu = jax.tree.map(lambda g, m: b1 * m + (1 - b1) * g, updates, state.mu)
        nu = jax.tree.map(lambda g, v: b2 * v + (1 - b2) * g * g, updates, state.nu)
        count = optax.safe_increment(state.count)
        c1, c2 = bias_corrections(b1, b2, count, bias_correction)
        direction = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        return direction, ScaleByMomentsState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


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

    def update_fn(updates: optax.Updates, state: ScaleByAdagradState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, ScaleByAdagradState]:
        del params
        sums = jax.tree.map(lambda g, s: s + g * g, updates, state.sum_of_squares)
        direction = jax.tree.map(lambda g, s: g / (jnp.sqrt(s) + eps), updates, sums)
        return direction, ScaleByAdagradState(sums)

    return optax.GradientTransformation(init_fn, update_fn)


class TorchMomentumState(NamedTuple):
    """torch.optim.SGD's momentum buffer; count tells whether it has been seeded yet."""
    count: jax.Array
    buf: optax.Updates


def torch_momentum(momentum: float, dampening: float, nesterov: bool) -> optax.GradientTransformation:
    """torch.optim.SGD's momentum: buf = g on the first step, then momentum*buf + (1-dampening)*g.

    optax.trace starts from a zero buffer and has no dampening, so its steps differ from torch's
    whenever dampening is non-zero (the first step is undampened in torch).
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

    def update_fn(updates: optax.Updates, state: MuonState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, MuonState]:
        del params
        mom = jax.tree.map(lambda g, m: momentum * m + (1 - momentum) * g, updates, state.momentum)
        return (jax.tree.map(lambda g, m: _muon_direction(g, m, momentum, ns_steps, ns_method, nesterov),
                             updates, mom), MuonState(momentum=mom))

    return optax.GradientTransformation(init_fn, update_fn)


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

    def update_fn(updates: optax.Updates, state: MuonAdamState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, MuonAdamState]:
        del params
        lab = labels(updates)
        count = optax.safe_increment(state.count)
        c1, c2 = bias_corrections(b1, b2, count)

        def muon(g: jax.Array, m: jax.Array, l: str) -> jax.Array:
            return momentum * m + (1 - momentum) * g if l == "muon" else m
        mom = jax.tree.map(muon, updates, state.momentum, lab)
        mu = jax.tree.map(lambda g, m, l: b1 * m + (1 - b1) * g if l == "adam" else m, updates, state.mu, lab)
        nu = jax.tree.map(lambda g, v, l: b2 * v + (1 - b2) * g * g if l == "adam" else v, updates, state.nu, lab)

        def direction(g: jax.Array, m: jax.Array, a: jax.Array, v: jax.Array, l: str) -> jax.Array:
            if l == "muon":
                return _muon_direction(g, m, momentum, ns_steps, ns_method, whole=whole)
            return (a / c1) / (jnp.sqrt(v / c2) + eps)
        out = jax.tree.map(direction, updates, mom, mu, nu, lab)
        return out, MuonAdamState(count=count, momentum=mom, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_label(labels: Callable[[Any], Any], scales: dict[str, Any]) -> optax.GradientTransformation:
    """Each leaf's update times the scale of its label (Muon's and Adam's lr relative to the schedule)."""
    def update_fn(updates: optax.Updates, state: optax.EmptyState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        return jax.tree.map(lambda u, l: u * jnp.asarray(scales[l], u.dtype), updates, labels(updates)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


#: Name words that keep a matrix on Adam: DeepSpeed's "embed" and "lm_head" (set_optimizer_flags), as
#: zerojax's name words (`embed` also matches pos, wte, wpe; `head` also the bare `head` of its models).
ADAM_WORDS = ("embed", "head")


def muon_labels(params: Any, layer_axes: Any = None) -> Any:
    """"muon" or "adam" per leaf: Muon for a matrix (two or more dimensions besides the leading
    `layer_axes` that stack layers) whose name has none of ADAM_WORDS; Adam for the rest (embeddings,
    the head, norms, biases), as DeepSpeed's set_optimizer_flags decides."""
    if not jax.tree.leaves(params):  # optax.tree_utils.tree_map_params' placeholder
        return params
    stacked = jax.tree.map(lambda _: 0, params) if layer_axes is None else jax.tree.map(
        lambda k, sub: jax.tree.map(lambda _: max(int(k), 0), sub), layer_axes, params)

    def one(path: Any, x: Any, k: int) -> str:
        name = dotted(path)
        matrix = len(x.shape) - k >= 2
        return "muon" if matrix and not any(name_matches(w, name) for w in ADAM_WORDS) else "adam"
    return jax.tree_util.tree_map_with_path(one, params, stacked)


# ---------------------------------------------------------------------------------------------
# Weight-decay masks and parameter groups, by parameter name (HF Trainer's no-decay list, Megatron's
# no-weight-decay-for-biases-and-norms, DeepSpeed/torch param groups with their own lr and decay).

#: What the words of `optimizer.no_decay` also match besides their own text (a part of the name).
NAME_ALIASES = {"norm": re.compile(r"ln(\d+|_\w+)?"), "embed": re.compile(r"pos|wte|wpe|pos_emb\w*")}


def name_matches(pattern: str, name: str) -> bool:
    """Whether a group pattern picks the parameter with dotted `name` (case-insensitive).

    A pattern with `*`, `?` or `[` matches the whole name (fnmatch: `blocks.*.bias`); a word matches
    when it is part of one of the name's parts (`bias` matches `blocks.qkv.bias`), dotted words are
    whole consecutive parts (`qkv.bias` matches `blocks.qkv.bias`, not `blocks.qkv.bias2`), and `norm` / `embed`
    also match the usual short names of norms and embeddings (`ln1`, `ln_f`; `pos`, `wte`, `wpe`).
    """
    pattern, name = pattern.lower(), name.lower()
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    if "." in pattern:  # dotted words: a run of whole parts (`layers.b` matches `model.layers.b`)
        return f".{pattern}." in f".{name}."
    alias = NAME_ALIASES.get(pattern)
    return any(pattern in part or (alias is not None and alias.fullmatch(part)) for part in name.split("."))


class Groups(NamedTuple):
    """The config's no-decay patterns and parameter groups, answering per parameter name."""
    no_decay: tuple[str, ...]
    param_groups: tuple[ParamGroup, ...]

    def group(self, name: str) -> ParamGroup | None:
        return next((g for g in self.param_groups if any(name_matches(p, name) for p in g.match)), None)

    def weight_decay(self, name: str, default: float) -> float:
        """The group's weight_decay, else 0 for a no-decay name, else the optimizer's."""
        group = self.group(name)
        if group is not None and group.weight_decay is not None:
            return group.weight_decay
        if any(name_matches(p, name) for p in self.no_decay):
            return 0.0
        return default

    def lr_scale(self, name: str) -> float:
        group = self.group(name)
        return 1.0 if group is None else group.lr_scale

    @property
    def scales_lr(self) -> bool:
        return any(g.lr_scale != 1.0 for g in self.param_groups)

    def table(self, params: Any, default: float) -> list[tuple[str, float, float]]:
        """(name, weight decay, lr scale) of every parameter: what the update will use."""
        return [(name, self.weight_decay(name, default), self.lr_scale(name)) for name in _names(params)]

    def check(self, params: Any) -> None:
        """Every pattern must pick at least one parameter: a pattern that matches none is a typo."""
        names = _names(params)
        keyed = [("optimizer.no_decay", p) for p in self.no_decay]
        keyed += [(f"optimizer.param_groups[{i}].match", p) for i, g in enumerate(self.param_groups) for p in g.match]
        for key, pattern in keyed:
            if not any(name_matches(pattern, n) for n in names):
                shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
                raise ConfigError(f"{key}: '{pattern}' matches no parameter of the model; its parameters "
                                  f"are {shown}")


def _names(params: Any) -> list[str]:
    return [dotted(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def decay_by_name(default: float, groups: Groups) -> optax.GradientTransformation:
    """`+ wd * p` with each parameter's wd from its name (constants: nothing is stored)."""
    def update_fn(updates: optax.Updates, state: optax.EmptyState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, optax.EmptyState]:
        if params is None:
            raise ValueError("decay_by_name: the update needs params")

        def one(path: Any, u: jax.Array, p: jax.Array) -> jax.Array:
            wd = groups.weight_decay(dotted(path), default)
            return u + wd * p if wd else u
        return jax.tree_util.tree_map_with_path(one, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def scale_lr_by_name(groups: Groups) -> optax.GradientTransformation:
    """Each parameter's step times its group's lr_scale (after the lr: the lr is scaled, per group)."""
    def update_fn(updates: optax.Updates, state: optax.EmptyState,
                  params: optax.Params | None = None) -> tuple[optax.Updates, optax.EmptyState]:
        del params

        def one(path: Any, u: jax.Array) -> jax.Array:
            scale = groups.lr_scale(dotted(path))
            return u if scale == 1.0 else u * jnp.asarray(scale, u.dtype)
        return jax.tree_util.tree_map_with_path(one, updates), state

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
