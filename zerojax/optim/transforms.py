"""Optimizer building blocks as small optax transformations over NamedTuple state.

What DeepSpeed's optimizers compute that optax's stock ones do not, in exactly torch's form: Adam's
moments with or without bias correction, LAMB's clamped trust ratio, torch's Adagrad and SGD
momentum, weight decay and lr scales per parameter name. Everything is elementwise or a per-leaf
norm, so it runs unchanged on ZeRO-sharded fp32 master weights under `jax.jit`. Which of them a
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
           "scale_by_clamped_trust_ratio", "scale_by_adagrad", "torch_momentum"]

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
