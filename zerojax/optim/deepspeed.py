"""DeepSpeed's optimizer and scheduler sections as optax transformations.

Each optimizer reproduces the update of the implementation DeepSpeed's engine builds for the config
(`_configure_basic_optimizer`): FusedAdam (or torch's Adam/AdamW with `torch_adam`, which computes the
same update), FusedLamb, torch.optim.Adagrad, FusedLion, torch.optim.SGD and MuonWithAuxAdam. Where those differ from
optax's stock optimizers (torch's eps placement in Adagrad, SGD's first-step momentum buffer and
dampening, Adam without bias correction, Lamb's clamped trust ratio) the update is written out here.

The returned transformation takes gradients that are already averaged, unscaled and clipped; it needs
`params` in `update` (weight decay and Lamb read them). Everything but Muon is elementwise or a
per-leaf norm, so it runs unchanged on ZeRO-sharded fp32 master weights under `jax.jit`; Muon makes
each matrix whole inside the update (docs/zero.md).

Per-update hyperparameters come in as schedules of optax's update count (0 for the first update):
`lr(count)`, and for optimizers with betas `beta1(count)` / `beta2(count)` (DeepSpeed's OneCycle
rewrites the param group's betas each step). `optax.inject_hyperparams` evaluates them, so the values
used by the latest update are in `state.hyperparams`.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from zerojax.config import (CLIENT_OPTIMIZER, AdagradParams, Config, LambParams, LionParams, OptimizerConfig,
                            SGDParams)
from zerojax.config.schema.optimizer import MuonParams, base_lr
from zerojax.errors import ConfigError
from zerojax.optim.schedules import make_schedule
from zerojax.optim.groups import Groups, muon_labels
from zerojax.optim.transforms import (AdamSettings, LrSchedule, add_decay, scale_by_adagrad,
                                      scale_by_clamped_trust_ratio, scale_by_label, scale_by_moments,
                                      scale_by_muon_with_adam, scale_per_leaf, torch_momentum)

__all__ = ["make_optimizer", "param_groups", "update_rule", "adam_settings", "CLIENT", "has_betas", "is_elementwise",
           "PER_TENSOR_OPTIMIZERS", "ClientOptimizer", "ScheduleFn"]

log = logging.getLogger(__name__)

ScheduleFn = Callable[[jax.Array], jax.Array]


Factory = Callable[..., optax.GradientTransformation]


# Optimizers whose torch param groups carry `betas`: the only ones DeepSpeed's OneCycle cycles.
_WITH_BETAS = frozenset({"adam", "adamw", "lamb", "lion"})


# Optimizers whose update reads whole tensors (LAMB's trust ratio is a norm per parameter tensor, Muon
# orthogonalises whole matrices): they cannot run shard by shard on the host, nor on a pipeline's flat
# stage rows.
PER_TENSOR_OPTIMIZERS = frozenset({"lamb", "muon"})


def is_elementwise(optimizer_type: str) -> bool:
    """Whether the update is elementwise per parameter shard (every optimizer but LAMB; an optimizer
    passed in code is not known to be)."""
    return optimizer_type.lower() not in PER_TENSOR_OPTIMIZERS | {CLIENT}


def has_betas(optimizer_type: str) -> bool:
    """Whether a momentum schedule applies (DeepSpeed disables it for SGD and Adagrad)."""
    return optimizer_type.lower() in _WITH_BETAS


def _decay(weight_decay: float, groups: "Groups | None" = None) -> list[optax.GradientTransformation]:
    """`+ wd * p`; placed before the direction it is torch's L2 (into the gradient), after it the
    decoupled decay of AdamW/Lamb/Lion (the step becomes -lr * (direction + wd * p)). With parameter
    groups each parameter's wd comes from its name."""
    if groups is not None:
        return [add_decay(groups.decay(weight_decay))]
    return [optax.add_decayed_weights(weight_decay)] if weight_decay else []


def _lr_scales(groups: "Groups | None") -> list[optax.GradientTransformation]:
    return [scale_per_leaf(groups.lr_scales())] if groups is not None and groups.scales_lr else []


def param_groups(config: OptimizerConfig | None) -> Groups | None:
    """The config's groups, or None when it has neither no_decay nor param_groups (one rule for all)."""
    if config is None or not (getattr(config, "no_decay", ()) or getattr(config, "param_groups", ())):
        return None
    return Groups(tuple(config.no_decay), tuple(config.param_groups))


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


def _muon(p: MuonParams, groups: Groups | None, layer_axes: Any, relative: bool, whole: Any = None) -> Factory:
    """DeepSpeed's MuonWithAuxAdam: Muon for the hidden matrices, Adam (bias-corrected, decoupled decay)
    for the rest, each group at its own lr. `learning_rate` is the schedule of base_lr(p); each group
    runs at it times group lr / base when `relative` (no scheduler, or WarmupCosineLR, which scales
    each torch param group's own lr), else at it (DeepSpeed's other schedulers write one lr into every
    group)."""
    base = base_lr(p)
    muon_scale = p.muon_rate / base if relative and base else 1.0
    adam_scale = p.adam_rate / base if relative and base else 1.0
    b1, b2 = p.betas

    def labels(params: Any) -> Any:
        return muon_labels(params, layer_axes)

    def factory(learning_rate: jax.Array) -> optax.GradientTransformation:
        return optax.chain(scale_by_muon_with_adam(p.momentum, p.ns_method, b1, b2, p.eps, labels,
                                                   whole=whole),
                           *_decay(p.weight_decay, groups), optax.scale_by_learning_rate(learning_rate),
                           scale_by_label(labels, {"muon": muon_scale, "adam": adam_scale}), *_lr_scales(groups))
    return factory


def _factory(config: OptimizerConfig, layer_axes: Any = None, relative: bool = True, whole: Any = None) -> Factory:
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
    if kind == "muon":
        return _muon(p, groups, layer_axes, relative, whole)
    raise ConfigError(f"optimizer.type: unknown optimizer '{config.type}'")


def make_optimizer(config: OptimizerConfig, lr: ScheduleFn, beta1: ScheduleFn | None = None,
                   beta2: ScheduleFn | None = None, *, layer_axes: Any = None,
                   relative_lr: bool = True, whole: Any = None) -> optax.GradientTransformation:
    """The optax transformation for DeepSpeed's optimizer `config`, driven by per-update schedules.

    `lr(count)` replaces params.lr (the scheduler owns the lr, as in DeepSpeed). `beta1` / `beta2`,
    when given, replace betas[0] / betas[1] per update for optimizers with betas; SGD and Adagrad have
    none, so DeepSpeed's OneCycle leaves their momentum alone and so does this (with a warning).
    Muon only: `layer_axes` (plan's) tells a stacked layer axis from a matrix dimension, and
    `relative_lr` whether the schedule scales each group's own lr (see `_muon`), and `whole(x)` makes a
    ZeRO-sharded matrix whole before its Newton-Schulz iteration (`update_rule` builds it from the mesh).
    """
    factory = _factory(config, layer_axes, relative_lr, whole)
    kind = config.type.lower()
    wrap = optax.inject_hyperparams(factory, hyperparam_dtype=jnp.float32)
    if kind not in _WITH_BETAS:
        if beta1 is not None or beta2 is not None:
            log.warning("optimizer %s has no betas: the momentum schedule is ignored, as in DeepSpeed",
                        config.type)
        return wrap(learning_rate=lr)
    b1, b2 = config.params.betas
    return wrap(learning_rate=lr, b1=b1 if beta1 is None else beta1, b2=b2 if beta2 is None else beta2)


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
                lr_scheduler: ScheduleFn | None = None, layer_axes: Any = None, mesh: Any = None
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
        schedule = make_schedule(config.scheduler, base_lr(section.params), base_betas=betas)
        relative = config.scheduler is None or config.scheduler.type == "WarmupCosineLR"
        whole = None if mesh is None else functools.partial(_whole_matrices, mesh)
        return make_optimizer(section, schedule.lr, schedule.beta1, schedule.beta2, layer_axes=layer_axes,
                              relative_lr=relative, whole=whole), schedule, section
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


def _whole_matrices(mesh: Any, x: jax.Array) -> jax.Array:
    """x with its last two dimensions whole on every device (under jit XLA gathers them once, nothing
    when they already are); leading dimensions (stacked layers, experts) keep whatever split they have,
    so each device holds whole matrices, not the whole stack."""
    spec = PartitionSpec(*[PartitionSpec.UNCONSTRAINED] * (x.ndim - 2), None, None)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


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
