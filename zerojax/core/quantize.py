"""Block quantization for ZeRO++'s quantized collectives (Wang et al. 2023, "ZeRO++").

qwZ: a parameter shard is quantized to int8 in blocks of `BLOCK` elements, each with its own fp32
scale (symmetric: scale = max|x| / 127), all-gathered as int8 plus scales and dequantized on arrival,
so the gather moves about half the bytes of a bf16 gather (1 + 4/BLOCK bytes per element against 2).

qgZ: a gradient reduce-scatter written as DeepSpeed's all-to-all scheme
(runtime/comm/coalesced_collectives.py, `all_to_all_quant_reduce`): each device splits its full
gradient into the N chunks the devices will own, quantizes every chunk (int4, two values per byte,
with fp32 scales per block), sends chunk j to device j with one all-to-all, and device j dequantizes
the N chunks it received and sums them in fp32. Every value is quantized once, so errors do not
compound hop by hop as in a ring of re-quantizing reductions; a reduce-scatter of a bf16 gradient
moves 2 bytes per element, this one 0.5 + 4/BLOCK.

Rounding error: each element is off by at most scale/2 after a round trip (the tests check it).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

BLOCK = 256       # elements per quantization block of a parameter gather (one fp32 scale each)
GRAD_BLOCK = 64   # of a gradient: int4 codes are coarse, so smaller blocks (0.5 + 4/64 bytes per element)
INT8_MAX, INT4_MAX = 127, 7


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """x flattened into rows of `block` elements (the last row zero-padded)."""
    flat = x.reshape(-1)
    pad = -flat.size % block
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(-1, block)


def quantize(x: jax.Array, bits: int = 8, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """(codes, scales): symmetric per-block quantization of `x` (any shape) in fp32.

    bits=8: int8 codes in [-127, 127], one per element. bits=4: codes in [-7, 7] packed two per
    uint8 (offset by 8: low nibble the even element, high nibble the odd one), so `block` must be even.
    """
    qmax = {8: INT8_MAX, 4: INT4_MAX}[bits]
    rows = _blocks(x.astype(jnp.float32), block)
    scale = jnp.max(jnp.abs(rows), axis=1) / qmax
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(rows / safe[:, None]), -qmax, qmax).astype(jnp.int8)
    if bits == 4:
        u = (q + 8).astype(jnp.uint8).reshape(q.shape[0], -1, 2)
        q = u[..., 0] | (u[..., 1] << 4)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, shape: tuple[int, ...], bits: int = 8,
               dtype: Any = jnp.float32) -> jax.Array:
    """Inverse of `quantize` for one array of `shape` (leading batch dimensions of q/scale allowed:
    q [..., nblocks, width], scale [..., nblocks])."""
    if bits == 4:
        lo = (q & 0xF).astype(jnp.int8) - 8
        hi = (q >> 4).astype(jnp.int8) - 8
        q = jnp.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    vals = q.astype(jnp.float32) * scale[..., None]
    lead = vals.shape[:-2]
    vals = vals.reshape(*lead, -1)[..., :math.prod(shape)]
    return vals.reshape(*lead, *shape).astype(dtype)


def all_gather(x: jax.Array, axis: Any, dim: int, block: int = BLOCK) -> jax.Array:
    """Tiled all-gather of `x` along `dim` over mesh `axis`, sent as int8 codes + fp32 scales (qwZ).

    Returns the gathered array in x's dtype; each device's block is its dequantized shard.
    """
    q, scale = quantize(x, 8, block)
    q = jax.lax.all_gather(q, axis)            # [n, nblocks, block] int8
    scale = jax.lax.all_gather(scale, axis)    # [n, nblocks] fp32
    parts = dequantize(q, scale, x.shape, 8, x.dtype)  # [n, *x.shape]
    parts = jnp.moveaxis(parts, 0, dim)
    return parts.reshape(*x.shape[:dim], x.shape[dim] * parts.shape[dim], *x.shape[dim + 1:])


def reduce_scatter(g: jax.Array, axis: Any, dim: int, bits: int = 4, block: int = GRAD_BLOCK) -> jax.Array:
    """Tiled reduce-scatter (sum) of `g` along `dim` over mesh `axis` by one quantized all-to-all
    (qgZ): device j receives every device's quantized chunk j and sums their dequantized values in fp32.
    """
    n = jax.lax.axis_size(axis)
    size = g.shape[dim] // n
    chunks = jnp.moveaxis(g.reshape(*g.shape[:dim], n, size, *g.shape[dim + 1:]), dim, 0)  # [n, *chunk]
    shape = chunks.shape[1:]
    q, scale = jax.vmap(lambda c: quantize(c, bits, block))(chunks)   # [n, nblocks, w], [n, nblocks]
    q = jax.lax.all_to_all(q, axis, 0, 0, tiled=True)
    scale = jax.lax.all_to_all(scale, axis, 0, 0, tiled=True)
    return jnp.sum(dequantize(q, scale, shape, bits), axis=0).astype(g.dtype)
