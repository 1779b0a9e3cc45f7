"""DeepSpeed's learning-rate schedulers as pure functions of optax's update count.

DeepSpeed builds its scheduler at position `last_batch_iteration` (-1 for a new run) and steps it
*after* each applied optimizer step; an fp16-overflow-skipped step steps nothing. So the k-th applied
update (optax `count` = k, from 0) runs with the lr the scheduler wrote at position
`last_batch_iteration + k`, except the first one, which runs with whatever the constructor left in the
optimizer:

* `last_batch_iteration == -1`: the constructor writes its start value (WarmupLR/WarmupDecayLR:
  warmup_min_lr; WarmupCosineLR: 0; OneCycle: cycle_min_lr and beta1 = cycle_min_mom, beta2 = 0.99;
  LRRangeTest: lr_range_test_min_lr).
* `last_batch_iteration >= 0`: the constructor writes nothing, so the first update uses the optimizer's
  own lr (and betas).

Because count 0 and count 1 both sit "before" position 0 in the -1 case, the start value is used
twice by WarmupLR (position 0 is warmup_min_lr again) — DeepSpeed's well-known off-by-one, kept here.
Every function is jit-traceable and returns float32.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from zerojax.config import (LRRangeTestParams, OneCycleParams, SchedulerConfig, WarmupCosineLRParams,
                            WarmupDecayLRParams, WarmupLRParams)
from zerojax.errors import ConfigError
from zerojax.optim.transforms import LrSchedule

__all__ = ["LrSchedule", "Schedule", "make_schedule", "schedule_extent"]

ScheduleFn = Callable[["jax.Array | int"], jax.Array]

# DeepSpeed's WarmupDecayLR signature default; its constructor never falls back to the optimizer lr.
_WARMUP_DECAY_DEFAULT_MAX_LR = 1e-3
# OneCycle overwrites beta2 with this whenever it cycles momentum.
_ONE_CYCLE_BETA2 = 0.99


Schedule = LrSchedule  # the name before pipeline schedules took it; kept for existing imports


def make_schedule(config: SchedulerConfig | None, base_lr: float, *,
                  base_betas: tuple[float, float] | None = (0.9, 0.999)) -> LrSchedule:
    """Build the DeepSpeed scheduler `config` describes for an optimizer whose lr is `base_lr`.

    `base_betas` are the optimizer's (beta1, beta2), or None for optimizers without betas (SGD,
    Adagrad), for which DeepSpeed's OneCycle silently stops cycling momentum. They matter only where
    DeepSpeed leaves the optimizer untouched (the first update when resuming via last_batch_iteration).
    """
    if config is None:
        return LrSchedule(lr=_constant(base_lr))
    p = config.params
    if config.type == "WarmupLR" or config.type == "WarmupDecayLR":
        return LrSchedule(lr=_warmup_lr(p, base_lr))
    if config.type == "WarmupCosineLR":
        return LrSchedule(lr=_warmup_cosine_lr(p, base_lr))
    if config.type == "OneCycle":
        return _one_cycle(p, base_lr, base_betas)
    if config.type == "LRRangeTest":
        return LrSchedule(lr=_lr_range_test(p, base_lr))
    raise ConfigError(f"scheduler.type: unknown scheduler '{config.type}'")


def schedule_extent(config: SchedulerConfig | None) -> dict[str, int]:
    """The keys that size the schedule, in steps, shortest first: a run shorter than one of them stops
    before that part of the schedule ends (mid-warmup, or at the peak lr of a decay it never runs).
    Empty for a schedule with no end (LRRangeTest) or none."""
    if config is None:
        return {}
    p, key = config.params, "scheduler.params."
    if config.type == "WarmupLR":
        return {key + "warmup_num_steps": p.warmup_num_steps}
    if config.type in ("WarmupDecayLR", "WarmupCosineLR"):
        return {key + "warmup_num_steps": p.warmup_num_steps, key + "total_num_steps": p.total_num_steps}
    if config.type == "OneCycle":
        second = p.cycle_second_step_size or p.cycle_first_step_size
        return {key + "cycle_first_step_size": p.cycle_first_step_size,
                key + "cycle_first_step_size + cycle_second_step_size": p.cycle_first_step_size + second}
    return {}


# ---------------------------------------------------------------------------------------------
# Shared pieces.

def _constant(value: float) -> ScheduleFn:
    def fn(count: jax.Array | int) -> jax.Array:
        del count
        return jnp.float32(value)
    return fn


def _positioned(at_position: Callable[[jax.Array], jax.Array], start: float,
                last_batch_iteration: int) -> ScheduleFn:
    """Map update count -> scheduler position, with the constructor's value for the first update.

    `at_position` gets an int32 position >= 0 (a clamped, unused value for count 0) and returns the
    value the scheduler writes there; `start` is what the optimizer holds before the first step.
    """
    def fn(count: jax.Array | int) -> jax.Array:
        count = jnp.asarray(count, jnp.int32)
        position = jnp.maximum(count + last_batch_iteration, 0)
        return jnp.where(count == 0, jnp.float32(start), at_position(position).astype(jnp.float32))
    return fn


def _warmup_fraction(position: jax.Array, warmup_steps: int, warmup_type: str) -> jax.Array:
    """0 at position 0, rising to (about) 1 at warmup_steps; log is DeepSpeed's default curve."""
    t = position.astype(jnp.float32)
    if warmup_type == "linear":
        return t / warmup_steps
    return jnp.log(t + 1.0) / math.log(warmup_steps)


def _warmup_steps(params: WarmupLRParams | WarmupCosineLRParams) -> int:
    """DeepSpeed rejects a non-positive count and clamps the rest to >= 2 (log(1) would be 0)."""
    if params.warmup_num_steps <= 0:
        raise ConfigError("scheduler.params.warmup_num_steps: must be a positive integer "
                          f"(DeepSpeed rejects {params.warmup_num_steps}); use 1 for no warmup")
    return max(2, params.warmup_num_steps)


# ---------------------------------------------------------------------------------------------
# WarmupLR / WarmupDecayLR: absolute lrs.

def _warmup_lr(p: WarmupLRParams, base_lr: float) -> ScheduleFn:
    """warmup_min_lr -> warmup_max_lr over the warmup, then hold (WarmupLR) or fall linearly to 0
    at total_num_steps (WarmupDecayLR)."""
    decay = isinstance(p, WarmupDecayLRParams)
    max_lr = p.warmup_max_lr
    if max_lr is None:
        max_lr = _WARMUP_DECAY_DEFAULT_MAX_LR if decay else base_lr
    min_lr, steps = p.warmup_min_lr, _warmup_steps(p)

    def after_warmup(position: jax.Array) -> jax.Array:
        if not decay:
            return jnp.float32(1.0)
        remaining = (p.total_num_steps - position).astype(jnp.float32)
        return jnp.maximum(0.0, remaining / max(1, p.total_num_steps - steps))

    def at_position(position: jax.Array) -> jax.Array:
        gamma = jnp.where(position < steps, _warmup_fraction(position, steps, p.warmup_type),
                          after_warmup(position))
        return min_lr + (max_lr - min_lr) * gamma

    start = min_lr if p.last_batch_iteration == -1 else base_lr
    return _positioned(at_position, start, p.last_batch_iteration)


# ---------------------------------------------------------------------------------------------
# WarmupCosineLR: ratios of the optimizer lr.

def _warmup_cosine_lr(p: WarmupCosineLRParams, base_lr: float) -> ScheduleFn:
    """warmup_min_ratio -> 1 over the warmup, then a cosine down to cos_min_ratio, held at the end.

    A new run starts at lr 0 (not warmup_min_ratio): DeepSpeed's constructor writes its
    "not started yet" value.
    """
    steps = _warmup_steps(p)
    decay_len = max(1, p.total_num_steps - steps)

    def at_position(position: jax.Array) -> jax.Array:
        warm = p.warmup_min_ratio + (1.0 - p.warmup_min_ratio) * _warmup_fraction(
            position, steps, p.warmup_type)
        # (1 + cos(pi * progress)) / 2 written as sin^2 of the remaining fraction, which float32
        # keeps accurate near the end of the decay, where the lr is small.
        remaining = jnp.maximum(0, decay_len - (position - steps + 1)).astype(jnp.float32) / decay_len
        cosine = p.cos_min_ratio + (1.0 - p.cos_min_ratio) * jnp.sin(jnp.pi / 2 * remaining) ** 2
        ratio = jnp.where(position < steps, warm, jnp.maximum(0.0, cosine))
        return base_lr * ratio

    start = 0.0 if p.last_batch_iteration == -1 else base_lr
    return _positioned(at_position, start, p.last_batch_iteration)


# ---------------------------------------------------------------------------------------------
# OneCycle: lr and beta1 move together through one triangle, then decay.

def _cycle_scale(position: jax.Array, p: OneCycleParams) -> jax.Array:
    """0 at the cycle's ends, 1 at its peak; stairs hold it flat in stair_count equal steps.

    The cycle is read one batch ahead (position + 1), as DeepSpeed does, so position 0 is already
    one step up the ramp.
    """
    first, second = p.cycle_first_step_size, p.cycle_second_step_size
    total = first + second
    offset = (position + 1) % total  # position + 1 == total wraps to the cycle's start: scale 0
    rising = offset <= first
    smooth = jnp.where(rising, offset.astype(jnp.float32) / first,
                       (total - offset).astype(jnp.float32) / second)
    stairs = jnp.where(rising, p.cycle_first_stair_count, p.cycle_second_stair_count)
    steps_up = jnp.where(rising, offset, total - offset)
    size = jnp.where(rising, first, second)
    stair = jnp.floor_divide(steps_up * stairs, size).astype(jnp.float32) / jnp.maximum(stairs, 1)
    return jnp.where(stairs > 0, stair, smooth)


def _one_cycle(p: OneCycleParams, base_lr: float, base_betas: tuple[float, float] | None) -> LrSchedule:
    """cycle_min_lr -> cycle_max_lr -> cycle_min_lr, then cycle_min_lr / (1 + rate * k / decay_step_size).

    beta1 mirrors the lr (cycle_max_mom at the ends, cycle_min_mom at the peak) and afterwards grows
    as cycle_max_mom * (1 + decay_mom_rate * k / decay_step_size) — DeepSpeed multiplies, so a
    positive decay_mom_rate raises beta1. Decay needs both a rate and decay_step_size > 0.
    A new run's first update uses cycle_min_lr with beta1 = cycle_min_mom (the constructor's value,
    not the cycle's cycle_max_mom).
    """
    total = p.cycle_first_step_size + p.cycle_second_step_size
    decays = p.decay_step_size > 0
    lbi = p.last_batch_iteration

    def decay_interval(position: jax.Array) -> jax.Array:
        return (position - total + 1).astype(jnp.float32) / max(p.decay_step_size, 1)

    def lr_at(position: jax.Array) -> jax.Array:
        cycle = p.cycle_min_lr + (p.cycle_max_lr - p.cycle_min_lr) * _cycle_scale(position, p)
        after = jnp.float32(p.cycle_min_lr)
        if decays and p.decay_lr_rate != 0:
            after = p.cycle_min_lr / (1.0 + p.decay_lr_rate * decay_interval(position))
        return jnp.where(position < total, cycle, after)

    def beta1_at(position: jax.Array) -> jax.Array:
        cycle = p.cycle_max_mom - (p.cycle_max_mom - p.cycle_min_mom) * _cycle_scale(position, p)
        after = jnp.float32(p.cycle_max_mom)
        if decays and p.decay_mom_rate != 0:
            after = p.cycle_max_mom * (1.0 + p.decay_mom_rate * decay_interval(position))
        return jnp.where(position < total, cycle, after)

    new_run = lbi == -1
    lr = _positioned(lr_at, p.cycle_min_lr if new_run else base_lr, lbi)
    if not p.cycle_momentum or base_betas is None:
        return LrSchedule(lr=lr)
    beta1 = _positioned(beta1_at, p.cycle_min_mom if new_run else base_betas[0], lbi)
    beta2 = _positioned(lambda position: jnp.float32(_ONE_CYCLE_BETA2),
                        _ONE_CYCLE_BETA2 if new_run else base_betas[1], lbi)
    return LrSchedule(lr=lr, beta1=beta1, beta2=beta2)


# ---------------------------------------------------------------------------------------------
# LRRangeTest: lr grows without bound, to find where training diverges.

def _lr_range_test(p: LRRangeTestParams, base_lr: float) -> ScheduleFn:
    """lr_range_test_min_lr * (1 + step_rate * (position + 1) / step_size), optionally floored."""
    def at_position(position: jax.Array) -> jax.Array:
        if p.lr_range_test_staircase:
            interval = jnp.floor_divide(position + 1, p.lr_range_test_step_size).astype(jnp.float32)
        else:
            interval = (position + 1).astype(jnp.float32) / p.lr_range_test_step_size
        return p.lr_range_test_min_lr * (1.0 + p.lr_range_test_step_rate * interval)

    start = p.lr_range_test_min_lr if p.last_batch_iteration == -1 else base_lr
    return _positioned(at_position, start, p.last_batch_iteration)
