"""Fused loss-scale check: unscale, finite check and sum of squares in one read of the gradients.

Before an fp16 update the engine needs to know whether any gradient is inf/NaN (skip the step)
and the global L2 norm of the unscaled gradients (clipping). Both come from one pass here; the
unscaled gradients themselves are not written back: the multiplier (1/scale times the clipping
coefficient) travels as a scalar into the fused Adam kernel, which applies it as it reads the
gradient. That saves writing and re-reading a full fp32 gradient copy (8 bytes per parameter).

`grad_stats_reference` and `grad_stats_pallas` take a list of arrays and `inv_scale` and return
per-array (sum of squares of g * inv_scale, number of non-finite elements), both float32. Sums over
devices (for sharded gradients) are the caller's: these see only local arrays.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from zerojax.pallas import multi_tensor
from zerojax.pallas.backend import TRITON


def _nonfinite(x: jax.Array) -> jax.Array:
    """1.0 where x is inf or NaN: |x| <= max is false for both (no isfinite in every backend)."""
    return jnp.where(jnp.abs(x) <= jnp.finfo(jnp.float32).max, 0.0, 1.0)


def grad_stats_reference(grads: Sequence[jax.Array], inv_scale: jax.Array, *,
                         backend: str | None = None) -> tuple[list[jax.Array], list[jax.Array]]:
    """(sum of squares of the unscaled gradient, non-finite count) per array; plain jnp."""
    del backend
    sumsq, bad = [], []
    for g in grads:
        x = g.astype(jnp.float32) * inv_scale
        sumsq.append(jnp.sum(x * x))
        bad.append(jnp.sum(jnp.where(jnp.isfinite(x), 0.0, 1.0)))
    return sumsq, bad


def _body(s_ref: Any, ins: tuple, outs: tuple, stats_ref: Any, blk: multi_tensor.Block) -> None:
    del outs
    x = blk.load(ins[0]).astype(jnp.float32) * s_ref[0]
    sumsq = jnp.sum(x * x)
    bad = jnp.sum(_nonfinite(x))
    stats_ref[0] = sumsq
    stats_ref[1] = bad


def grad_stats_pallas(grads: Sequence[jax.Array], inv_scale: jax.Array, *, backend: str = TRITON,
                      block: int | None = None, interpret: bool = False) -> tuple[list[jax.Array], list[jax.Array]]:
    """The reference's statistics from one Pallas launch; per-block partial sums are added here.

    `backend` and `interpret` as for `adam_update_pallas`.
    """
    block = block or multi_tensor.default_block(backend)
    width = multi_tensor.scalar_width(backend, 1)
    scalars = jnp.zeros((width,), jnp.float32).at[0].set(jnp.asarray(inv_scale, jnp.float32))
    groups = [(g.reshape(-1),) for g in grads]
    _, parts = multi_tensor.launch(_body, groups, scalars, [], backend=backend, block=block, stats=True,
                                   name="grad_stats", interpret=interpret)
    return [jnp.sum(p[:, 0]) for p in parts], [jnp.sum(p[:, 1]) for p in parts]
