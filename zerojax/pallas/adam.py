"""Fused Adam/AdamW: one pass over master weights, gradients and both moments, in place.

`adam_update_reference` is the update written plainly with jnp; `adam_update_pallas` is the same
function as one Pallas kernel launch over all arrays (multi_tensor.launch). Both take lists of
arrays of any shapes and return new lists, so either can stand in for the other.

Per element, in float32 (the order of operations is optax's in zerojax.optim.transforms, so the two paths
agree to rounding):

    g = grad * grad_scale                 (loss-scale unscaling and clipping folded in)
    g = g + wd * p                        (adam_w_mode false: L2 into the gradient)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / c1) / (sqrt(v / c2) + eps)   (c = 1 - beta**t, or 1 without bias correction)
    u = u + wd * p                        (decoupled, AdamW)
    p = p - lr * u

and where `apply` is 0 (a step skipped for non-finite gradients) p, m and v keep their values.
Every hyperparameter is a runtime scalar (`AdamScalars`), so schedules never recompile.
With `emit`, the kernel also writes p cast to the compute dtype: the copy the parameter
all-gather sends, produced without reading the master weights a second time.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from zerojax.pallas import multi_tensor
from zerojax.pallas.backend import MOSAIC_GPU, TRITON


class AdamScalars(NamedTuple):
    """Per-step values, float32 scalars (bias corrections c1, c2 already computed)."""
    lr: jax.Array
    b1: jax.Array
    b2: jax.Array
    eps: jax.Array
    weight_decay: jax.Array
    c1: jax.Array
    c2: jax.Array
    grad_scale: jax.Array
    apply: jax.Array


def adam_update_reference(params: Sequence[jax.Array], grads: Sequence[jax.Array],
                          mu: Sequence[jax.Array], nu: Sequence[jax.Array], s: AdamScalars, *,
                          decoupled: bool, emit: Any = None, backend: str | None = None,
                          ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], list[jax.Array] | None]:
    """(params, mu, nu, params cast to `emit` or None) after one update; plain jnp."""
    del backend
    new_p, new_m, new_v = [], [], []
    keep = s.apply == 0
    for p, g, m, v in zip(params, grads, mu, nu):
        g = g.astype(jnp.float32) * s.grad_scale
        if not decoupled:
            g = g + s.weight_decay * p
        m1 = s.b1 * m + (1 - s.b1) * g
        v1 = s.b2 * v + (1 - s.b2) * g * g
        u = (m1 / s.c1) / (jnp.sqrt(v1 / s.c2) + s.eps)
        if decoupled:
            u = u + s.weight_decay * p
        p1 = p + -s.lr * u
        new_p.append(jnp.where(keep, p, p1).astype(p.dtype))
        new_m.append(jnp.where(keep, m, m1))
        new_v.append(jnp.where(keep, v, v1))
    emitted = [p.astype(emit) for p in new_p] if emit is not None else None
    return new_p, new_m, new_v, emitted


def _sqrt(x: jax.Array, backend: str) -> jax.Array:
    """Mosaic GPU has no sqrt: x * rsqrt(x) (0 at 0, where rsqrt is inf)."""
    if backend == MOSAIC_GPU:
        return jnp.where(x > 0, x * jax.lax.rsqrt(jnp.where(x > 0, x, 1.0)), 0.0)
    return jnp.sqrt(x)


def _body(decoupled: bool, emit: bool, backend: str):
    def body(s_ref: Any, ins: tuple, outs: tuple, stats_ref: Any, blk: multi_tensor.Block) -> None:
        del stats_ref
        p_ref, g_ref, m_ref, v_ref = ins
        lr, b1, b2, eps, wd, c1, c2, grad_scale, apply = (s_ref[i] for i in range(9))
        p = blk.load(p_ref).astype(jnp.float32)
        g = blk.load(g_ref).astype(jnp.float32) * grad_scale
        m = blk.load(m_ref)
        v = blk.load(v_ref)
        if not decoupled:
            g = g + wd * p
        m1 = b1 * m + (1 - b1) * g
        v1 = b2 * v + (1 - b2) * g * g
        u = (m1 / c1) / (_sqrt(v1 / c2, backend) + eps)
        if decoupled:
            u = u + wd * p
        p1 = p + -lr * u
        keep = apply == 0
        p1 = jnp.where(keep, p, p1)
        blk.store(outs[0], p1)
        blk.store(outs[1], jnp.where(keep, m, m1))
        blk.store(outs[2], jnp.where(keep, v, v1))
        if emit:
            blk.store(outs[3], p1)
    return body


def adam_update_pallas(params: Sequence[jax.Array], grads: Sequence[jax.Array],
                       mu: Sequence[jax.Array], nu: Sequence[jax.Array], s: AdamScalars, *,
                       decoupled: bool, emit: Any = None, backend: str = TRITON,
                       block: int | None = None, interpret: bool = False,
                       ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], list[jax.Array] | None]:
    """The reference's update as Pallas launches; params, mu, nu are updated in place.

    params and the moments must be float32; grads may be any float dtype (read and upcast in the
    kernel, never copied). `backend`: "triton" or "mosaic_gpu" on GPU, "interpret" anywhere;
    `interpret` runs a GPU backend's own kernel in the interpreter (tests).
    """
    for name, xs in (("params", params), ("mu", mu), ("nu", nu)):
        if any(x.dtype != jnp.float32 for x in xs):
            raise ValueError(f"adam_update_pallas: {name} must be float32 (fp32 master weights and moments)")
    shapes = [p.shape for p in params]
    groups = [tuple(x.reshape(-1) for x in four) for four in zip(params, grads, mu, nu)]
    values = jnp.stack([jnp.asarray(x, jnp.float32) for x in s])
    width = multi_tensor.scalar_width(backend, len(values))
    scalars = jnp.zeros((width,), jnp.float32).at[:len(values)].set(values)
    outputs = [multi_tensor.Output(alias=0), multi_tensor.Output(alias=2), multi_tensor.Output(alias=3)]
    if emit is not None:
        outputs.append(multi_tensor.Output(dtype=jnp.dtype(emit)))
    outs, _ = multi_tensor.launch(_body(decoupled, emit is not None, backend), groups, scalars, outputs,
                                  backend=backend, block=block, name="fused_adam", interpret=interpret)
    new_p = [o[0].reshape(shape) for o, shape in zip(outs, shapes)]
    new_m = [o[1].reshape(shape) for o, shape in zip(outs, shapes)]
    new_v = [o[2].reshape(shape) for o, shape in zip(outs, shapes)]
    emitted = [o[3].reshape(shape) for o, shape in zip(outs, shapes)] if emit is not None else None
    return new_p, new_m, new_v, emitted
