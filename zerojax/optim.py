"""DeepSpeed's basic optimizers as optax transformations.

Each optimizer reproduces the update of the implementation DeepSpeed's engine builds for the config
(`_configure_basic_optimizer`): FusedAdam (or torch's Adam/AdamW with `torch_adam`, which computes the
same update), FusedLamb, torch.optim.Adagrad, FusedLion and torch.optim.SGD. Where those differ from
optax's stock optimizers (torch's eps placement in Adagrad, SGD's first-step momentum buffer and
dampening, Adam without bias correction, Lamb's clamped trust ratio) the update is written out here.

The returned transformation takes gradients that are already averaged, unscaled and clipped; it needs
`params` in `update` (weight decay and Lamb read them). Everything is elementwise or a per-leaf norm,
so it runs unchanged on ZeRO-sharded fp32 master weights under `jax.jit`.

Per-update hyperparameters come in as schedules of optax's update count (0 for the first update):
`lr(count)`, and for optimizers with betas `beta1(count)` / `beta2(count)` (DeepSpeed's OneCycle
rewrites the param group's betas each step). `optax.inject_hyperparams` evaluates them, so the values
used by the latest update are in `state.hyperparams`.
"""
from __future__ import annotations

import fnmatch
import logging
import re
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from zerojax.config import (CLIENT_OPTIMIZER, AdagradParams, Config, LambParams, LionParams, OptimizerConfig,
                            ParamGroup, SGDParams)
from zerojax.errors import ConfigError
from zerojax.names import dotted
from zerojax.schedules import LrSchedule, make_schedule

__all__ = ["make_optimizer", "param_groups", "Groups", "name_matches", "decay_by_name", "scale_lr_by_name", "update_rule", "CLIENT", "has_betas", "is_elementwise", "bias_corrections", "PER_TENSOR_OPTIMIZERS", "AdamSettings", "adam_settings", "ScaleByMomentsState", "ScaleByAdagradState",
           "TorchMomentumState", "scale_by_moments", "scale_by_clamped_trust_ratio",
           "scale_by_adagrad", "torch_momentum"]

log = logging.getLogger(__name__)

ScheduleFn = Callable[[jax.Array], jax.Array]
Factory = Callable[..., optax.GradientTransformation]

# Optimizers whose torch param groups carry `betas`: the only ones DeepSpeed's OneCycle cycles.
_WITH_BETAS = frozenset({"adam", "adamw", "lamb", "lion"})


# Optimizers whose update reads whole tensors (LAMB's trust ratio is a norm per parameter tensor):
# they cannot run shard by shard on the host, nor on a pipeline's flat stage rows.
PER_TENSOR_OPTIMIZERS = frozenset({"lamb"})


def is_elementwise(optimizer_type: str) -> bool:
    """Whether the update is elementwise per parameter shard (every optimizer but LAMB; an optimizer
    passed in code is not known to be)."""
    return optimizer_type.lower() not in PER_TENSOR_OPTIMIZERS | {CLIENT}


def has_betas(optimizer_type: str) -> bool:
    """Whether a momentum schedule applies (DeepSpeed disables it for SGD and Adagrad)."""
    return optimizer_type.lower() in _WITH_BETAS


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


def _decay(weight_decay: float, groups: "Groups | None" = None) -> list[optax.GradientTransformation]:
    """`+ wd * p`; placed before the direction it is torch's L2 (into the gradient), after it the
    decoupled decay of AdamW/Lamb/Lion (the step becomes -lr * (direction + wd * p)). With parameter
    groups each parameter's wd comes from its name."""
    if groups is not None:
        return [decay_by_name(weight_decay, groups)]
    return [optax.add_decayed_weights(weight_decay)] if weight_decay else []


def _lr_scales(groups: "Groups | None") -> list[optax.GradientTransformation]:
    return [scale_lr_by_name(groups)] if groups is not None and groups.scales_lr else []


# ---------------------------------------------------------------------------------------------
# Weight-decay masks and parameter groups, by parameter name (HF Trainer's no-decay list, Megatron's
# no-weight-decay-for-biases-and-norms, DeepSpeed/torch param groups with their own lr and decay).

#: What the words of `optimizer.no_decay` also match besides their own text (a part of the name).
NAME_ALIASES = {"norm": re.compile(r"ln(\d+|_\w+)?"), "embed": re.compile(r"pos|wte|wpe|pos_emb\w*")}


def name_matches(pattern: str, name: str) -> bool:
    """Whether a group pattern picks the parameter with dotted `name` (case-insensitive).

    A pattern with `*`, `?` or `[` matches the whole name (fnmatch: `blocks.*.bias`); a word matches
    when it is part of one of the name's parts (`bias` matches `blocks.qkv.bias`), and `norm` / `embed`
    also match the usual short names of norms and embeddings (`ln1`, `ln_f`; `pos`, `wte`, `wpe`).
    """
    pattern, name = pattern.lower(), name.lower()
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
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


def param_groups(config: OptimizerConfig | None) -> Groups | None:
    """The config's groups, or None when it has neither no_decay nor param_groups (one rule for all)."""
    if config is None or not (getattr(config, "no_decay", ()) or getattr(config, "param_groups", ())):
        return None
    return Groups(tuple(config.no_decay), tuple(config.param_groups))


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


def adam_settings(config: OptimizerConfig) -> AdamSettings | None:
    """Adam's constants, or None for other optimizers.

    DeepSpeed: type AdamW forces decoupled decay; type Adam follows adam_w_mode (default true).
    """
    kind, p = config.type.lower(), config.params
    if kind not in ("adam", "adamw") or p is None:
        return None
    return AdamSettings(decoupled=kind == "adamw" or bool(p.adam_w_mode), weight_decay=p.weight_decay or 0.0,
                        eps=p.eps, bias_correction=p.bias_correction)


def _adam(s: AdamSettings, groups: Groups | None = None) -> Factory:
    """FusedAdam: adam_w_mode adds wd*p to the direction (AdamW), otherwise to the gradient (L2)."""
    def factory(learning_rate: jax.Array, b1: jax.Array, b2: jax.Array) -> optax.GradientTransformation:
        moments = scale_by_moments(b1, b2, s.eps, s.bias_correction)
        if s.decoupled:
            parts = [moments, *_decay(s.weight_decay, groups)]
        else:
            parts = [*_decay(s.weight_decay, groups), moments]
        return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate), *_lr_scales(groups))
    return factory


def _lamb(p: LambParams, groups: Groups | None = None) -> Factory:
    """FusedLamb: bias-corrected Adam direction + wd*p, times the clamped per-tensor trust ratio."""
    def factory(learning_rate: jax.Array, b1: jax.Array, b2: jax.Array) -> optax.GradientTransformation:
        return optax.chain(scale_by_moments(b1, b2, p.eps, p.bias_correction), *_decay(p.weight_decay, groups),
                           scale_by_clamped_trust_ratio(p.min_coeff, p.max_coeff),
                           optax.scale_by_learning_rate(learning_rate), *_lr_scales(groups))
    return factory


def _lion(p: LionParams, groups: Groups | None = None) -> Factory:
    """FusedLion: p = p*(1 - lr*wd) - lr*sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g.

    At c = b1*m + (1-b1)*g exactly 0 DeepSpeed's CUDA kernel steps by +lr and its CPU kernel by -lr;
    sign(0) = 0 (the paper's rule, optax's) keeps untouched parameters where they are.
    """
    def factory(learning_rate: jax.Array, b1: jax.Array, b2: jax.Array) -> optax.GradientTransformation:
        return optax.chain(optax.scale_by_lion(b1, b2), *_decay(p.weight_decay, groups),
                           optax.scale_by_learning_rate(learning_rate), *_lr_scales(groups))
    return factory


def _adagrad(p: AdagradParams, groups: Groups | None = None) -> Factory:
    """torch.optim.Adagrad (lr_decay 0): L2 into the gradient, then g / (sqrt(sum) + eps)."""
    def factory(learning_rate: jax.Array) -> optax.GradientTransformation:
        return optax.chain(*_decay(p.weight_decay, groups), scale_by_adagrad(p.initial_accumulator_value, p.eps),
                           optax.scale_by_learning_rate(learning_rate), *_lr_scales(groups))
    return factory


def _sgd(p: SGDParams, groups: Groups | None = None) -> Factory:
    """torch.optim.SGD: L2 into the gradient, optional momentum (torch's buffer rules), -lr step."""
    momentum = [torch_momentum(p.momentum, p.dampening, p.nesterov)] if p.momentum else []

    def factory(learning_rate: jax.Array) -> optax.GradientTransformation:
        return optax.chain(*_decay(p.weight_decay, groups), *momentum, optax.scale_by_learning_rate(learning_rate),
                           *_lr_scales(groups))
    return factory


def _factory(config: OptimizerConfig) -> Factory:
    kind, p = config.type.lower(), config.params
    adam = adam_settings(config)
    groups = param_groups(config)
    if adam is not None:
        return _adam(adam, groups)
    if kind == "lamb":  # load_config has rejected max_grad_norm
        return _lamb(p, groups)
    if kind == "lion":
        return _lion(p, groups)
    if kind == "adagrad":
        return _adagrad(p, groups)
    if kind == "sgd":
        return _sgd(p, groups)
    raise ConfigError(f"optimizer.type: unknown optimizer '{config.type}'")


def make_optimizer(config: OptimizerConfig, lr: ScheduleFn, beta1: ScheduleFn | None = None,
                   beta2: ScheduleFn | None = None) -> optax.GradientTransformation:
    """The optax transformation for DeepSpeed's optimizer `config`, driven by per-update schedules.

    `lr(count)` replaces params.lr (the scheduler owns the lr, as in DeepSpeed). `beta1` / `beta2`,
    when given, replace betas[0] / betas[1] per update for optimizers with betas; SGD and Adagrad have
    none, so DeepSpeed's OneCycle leaves their momentum alone and so does this (with a warning).
    """
    factory = _factory(config)
    kind = config.type.lower()
    wrap = optax.inject_hyperparams(factory, hyperparam_dtype=jnp.float32)
    if kind not in _WITH_BETAS:
        if beta1 is not None or beta2 is not None:
            log.warning("optimizer %s has no betas: the momentum schedule is ignored, as in DeepSpeed",
                        config.type)
        return wrap(learning_rate=lr)
    b1, b2 = config.params.betas
    return wrap(learning_rate=lr, b1=b1 if beta1 is None else beta1, b2=b2 if beta2 is None else beta2)


# ---------------------------------------------------------------------------------------------
# The update rule of a run: the config's optimizer section, or the optimizer passed in code.

# The optimizer type a plan records when the optimizer came from code (DeepSpeed's client optimizer).
CLIENT = CLIENT_OPTIMIZER
ClientOptimizer = Union[optax.GradientTransformation, Callable[..., optax.GradientTransformation]]

_NO_OPTIMIZER = (
    "optimizer: the config has no optimizer section and no optimizer was passed in code. DeepSpeed then "
    "trains with the optimizer given to deepspeed.initialize; pass one the same way: "
    "zerojax.initialize(config, params=..., loss_fn=..., optimizer=optax.adamw(3e-4)) (or "
    "zerojax.plan(config, mesh, params, optimizer=...)), or add a section such as "
    '"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}')


def update_rule(config: Config, optimizer: ClientOptimizer | None = None,
                lr_scheduler: ScheduleFn | None = None
                ) -> tuple[optax.GradientTransformation, LrSchedule, OptimizerConfig]:
    """The transformation, its schedule and the optimizer config a plan records.

    Without `optimizer` the config's section builds DeepSpeed's optimizer. With it, as DeepSpeed's
    client optimizer, `optimizer` is an optax transformation (its lr is its own business), or a factory
    taking `learning_rate` (`optax.adamw`, `functools.partial(optax.adamw, weight_decay=0.1)`) driven
    by `lr_scheduler` (an optax schedule of the update count) or by the config's scheduler section.
    """
    section = config.optimizer
    if optimizer is None:
        if lr_scheduler is not None:
            raise ConfigError("lr_scheduler: given without optimizer=; the config's optimizer section is "
                              "driven by its scheduler section, so pass optimizer= too or write a scheduler "
                              "section")
        if section is None:
            raise ConfigError(_NO_OPTIMIZER)
        betas = section.params.betas if has_betas(section.type) else None
        schedule = make_schedule(config.scheduler, section.params.lr, base_betas=betas)
        return make_optimizer(section, schedule.lr, schedule.beta1, schedule.beta2), schedule, section
    if section is not None:
        log.warning("optimizer: the config's %s section is not used: the optimizer passed in code is, as "
                    "DeepSpeed uses its client optimizer", section.type)
    schedule = _client_schedule(config, lr_scheduler)
    client = OptimizerConfig(type=CLIENT, params=None)
    if isinstance(optimizer, optax.GradientTransformation):
        if schedule is not None:
            where = "lr_scheduler=" if lr_scheduler is not None else f"scheduler section ({config.scheduler.type})"
            raise ConfigError(f"optimizer: a built optax transformation cannot be driven by the {where}; "
                              f"pass a factory that takes learning_rate instead (optimizer=optax.adamw, or "
                              f"functools.partial(optax.adamw, weight_decay=0.1)), or build the schedule "
                              f"into the transformation and drop the scheduler")
        return optimizer, LrSchedule(lr=_unknown_lr), client
    if not callable(optimizer):
        raise TypeError(f"optimizer: expected an optax GradientTransformation or a factory taking "
                        f"learning_rate, got {type(optimizer).__name__}")
    if schedule is None:
        raise ConfigError("optimizer: a factory needs a learning rate: pass lr_scheduler= (an optax schedule, "
                          "e.g. optax.constant_schedule(3e-4)) or write a scheduler section, or pass the "
                          "transformation itself (optimizer=optax.adamw(3e-4))")
    tx = optax.inject_hyperparams(optimizer, hyperparam_dtype=jnp.float32)(learning_rate=schedule.lr)
    return tx, schedule, client


def _unknown_lr(count: jax.Array | int) -> jax.Array:
    """A built transformation keeps its lr to itself: reported as NaN."""
    del count
    return jnp.full((), jnp.nan, jnp.float32)


def _client_schedule(config: Config, lr_scheduler: ScheduleFn | None) -> LrSchedule | None:
    """The schedule for an optimizer passed in code: lr_scheduler=, else the config's section."""
    sched = config.scheduler
    if lr_scheduler is not None:
        if sched is not None:
            log.warning("lr_scheduler: not used: the config's %s section drives the lr, as DeepSpeed prefers "
                        "its configured scheduler", sched.type)
        else:
            return LrSchedule(lr=lambda count: jnp.asarray(lr_scheduler(count), jnp.float32))
    if sched is None:
        return None
    p = sched.params
    if sched.type == "WarmupCosineLR":
        raise ConfigError("scheduler.type: WarmupCosineLR scales the optimizer's lr, and an optimizer passed "
                          "in code has none zerojax can read; pass lr_scheduler= (e.g. "
                          "optax.warmup_cosine_decay_schedule) or use WarmupDecayLR")
    if getattr(p, "warmup_max_lr", 0.0) is None:
        raise ConfigError("scheduler.params.warmup_max_lr: required when the optimizer is passed in code "
                          "(there is no optimizer.params.lr to default to); write the peak lr")
    if p.last_batch_iteration != -1:
        raise ConfigError("scheduler.params.last_batch_iteration: resuming a schedule reads the optimizer's "
                          "own lr, which an optimizer passed in code keeps to itself; use -1 and restore a "
                          "checkpoint instead")
    if sched.type == "OneCycle" and p.cycle_momentum:
        raise ConfigError("scheduler.params.cycle_momentum: OneCycle cycles the optimizer's beta1, which an "
                          "optimizer passed in code keeps to itself; set cycle_momentum: false")
    return make_schedule(sched, float("nan"), base_betas=None)
