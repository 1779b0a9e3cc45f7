"""Dtype policy, and DeepSpeed's loss scaler as pure functions over a small state.

The policy says what the stored parameters, the master copy, the gradient accumulator and the
collectives hold. The loss scaler multiplies the loss before differentiation (fp16 gradients would
underflow otherwise) and adapts the scale exactly as DeepSpeed's `DynamicLossScaler` does; its state
is part of the train state, so checkpoints carry it and a resumed run scales identically.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


class Policy(NamedTuple):
    """`param` is what the forward pass reads; `master` is what the optimizer updates.

    With mixed precision (bf16/fp16) the two differ and the state keeps a separate fp32 master
    copy (the 4Ψ of ZeRO's K = 12); in fp32 training the parameters are their own master.
    """
    param: jnp.dtype
    master: jnp.dtype
    accum: jnp.dtype
    comm: jnp.dtype | None

    @property
    def mixed(self) -> bool:
        return self.param != self.master


# ---------------------------------------------------------------------------------------------
# Loss scaling.

class ScalerConfig(NamedTuple):
    """Static settings of the loss scaler (from the `fp16` section).

    dynamic:      DeepSpeed's DynamicLossScaler (fp16 with loss_scale 0); otherwise the scale is fixed.
    check_finite: skip steps whose loss or gradients are not finite (fp16, or bf16.check_grad_overflow).
    limit:        consecutive skipped steps after which training stops (`run.non_finite_limit`; 0: never;
                  a dynamic fp16 scaler stops at its minimum scale instead, as DeepSpeed does).
    """
    dynamic: bool
    check_finite: bool
    initial: float
    window: int
    hysteresis: int
    consecutive: bool
    min_scale: float
    limit: int = 0


class LossScaleState(NamedTuple):
    """DeepSpeed's scaler variables, plus what an error at the minimum scale needs to explain itself.

    scale:          the current loss scale (`cur_scale`).
    hysteresis:     overflows still tolerated before the scale halves (`cur_hysteresis`).
    last_overflow:  optimizer step of the latest overflow, -1 before any (`last_overflow_iter`).
    streak:         consecutive skipped steps up to now.
    first_bad:      per parameter leaf, whether it was non-finite at the first step of the streak.
    stuck:          an overflow happened with the scale already at its minimum (DeepSpeed stops the
                    run there); every later step is skipped until the caller reports it.
    """
    scale: jax.Array
    hysteresis: jax.Array
    last_overflow: jax.Array
    streak: jax.Array
    first_bad: jax.Array
    stuck: jax.Array


def init_loss_scale(cfg: ScalerConfig, n_leaves: int) -> LossScaleState:
    return LossScaleState(scale=jnp.asarray(cfg.initial, jnp.float32),
                          hysteresis=jnp.asarray(cfg.hysteresis, jnp.int32),
                          last_overflow=jnp.asarray(-1, jnp.int32), streak=jnp.asarray(0, jnp.int32),
                          first_bad=jnp.zeros((n_leaves,), jnp.bool_), stuck=jnp.asarray(False))


def update_loss_scale(cfg: ScalerConfig, s: LossScaleState, overflow: jax.Array, iteration: jax.Array,
                      bad_leaves: jax.Array) -> LossScaleState:
    """One step of DeepSpeed's `DynamicLossScaler.update_scale` (`iteration` is its `cur_iter`).

    Overflow: when hysteresis is used up (or configured as 1) the scale halves down to the minimum,
    and an overflow already at the minimum sets `stuck` (DeepSpeed raises there); otherwise one unit
    of hysteresis is spent. Clean step: after `window` clean steps since the last overflow (or the
    start) the scale doubles and hysteresis refills; `consecutive` refills it on every clean step.
    """
    streak = jnp.where(overflow, s.streak + 1, 0)
    first_bad = jnp.where(overflow & (s.streak == 0), bad_leaves, s.first_bad)
    if not cfg.dynamic:
        return s._replace(streak=streak, first_bad=first_bad)
    exhausted = (cfg.hysteresis == 1) | (s.hysteresis == 1)
    at_min = s.scale == cfg.min_scale
    scale_on_overflow = jnp.where(exhausted, jnp.maximum(s.scale / 2, cfg.min_scale), s.scale)
    hysteresis_on_overflow = jnp.where(exhausted, s.hysteresis, s.hysteresis - 1)

    stable = iteration - s.last_overflow - 1
    grow = (stable > 0) & (stable % cfg.window == 0)
    refill = grow | cfg.consecutive
    scale_clean = jnp.where(grow, s.scale * 2, s.scale)
    hysteresis_clean = jnp.where(refill, cfg.hysteresis, s.hysteresis)

    return LossScaleState(
        scale=jnp.where(overflow, scale_on_overflow, scale_clean).astype(jnp.float32),
        hysteresis=jnp.where(overflow, hysteresis_on_overflow, hysteresis_clean).astype(jnp.int32),
        last_overflow=jnp.where(overflow, iteration, s.last_overflow).astype(jnp.int32),
        streak=streak, first_bad=first_bad, stuck=s.stuck | (overflow & exhausted & at_min))


def leaf_finite(tree: Any) -> jax.Array:
    """One bool per leaf: all of its elements finite (reduced over every shard by the partitioner)."""
    leaves = jax.tree.leaves(tree)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.ones((0,), jnp.bool_)


def norm_and_finite(tree: Any) -> tuple[jax.Array, jax.Array]:
    """The global L2 norm of `tree` and one finiteness flag per leaf, from one reduction per leaf.

    Each leaf sums `x*x + x*0`. Where x is finite, x*0 is a zero and the term is x*x exactly, so
    the sums, and the norm, are `optax.tree.norm`'s bit for bit (same per-leaf sums, added in tree
    order). An inf or NaN element makes x*0 NaN, so that leaf's sum is NaN; and only then: squares
    of finite numbers are >= 0, so a sum that overflows is +inf, never NaN. A leaf is finite iff its
    sum is not NaN (what `leaf_finite` says), and a non-finite gradient gives a NaN norm.

    Why: `leaf_finite` beside the norm is a second reduction per leaf, and every reduction is a
    kernel XLA compiles (and a pass over the gradients at run time).
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32), jnp.ones((0,), jnp.bool_)
    sums = [jnp.sum(jnp.square(x) + x * 0) for x in leaves]
    total = functools.reduce(operator.add, sums, 0)  # optax.tree_utils.tree_sum's order
    return jnp.sqrt(total), ~jnp.isnan(jnp.stack(sums))  # one test over the stacked sums, not one per leaf
