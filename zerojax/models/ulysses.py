"""DeepSpeed-Ulysses attention (deepspeed/sequence/layer.py `DistributedAttention`) for a `sequence` axis.

Each device holds its chunk of every row's tokens, with all heads: q [b, s/P, h, d], k and v
[b, s/P, kv, d]. One all-to-all over `sequence` trades the token split for a head split (q, k and v
travel together: [b, s, h/P, d] and [b, s, kv/P, d]), the ordinary attention runs over the whole
sequence (its causal mask too) for the device's heads, and a second all-to-all brings the output
back to the token split [b, s/P, h, d]. Device p keeps query heads [p h/P, (p+1) h/P) and key/value
heads [p kv/P, (p+1) kv/P), so grouped-query attention keeps each query head with its key/value head.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def check_heads(n_heads: int, n_kv_heads: int, sequence: int) -> None:
    """Ulysses splits the heads over the sequence axis: it must divide both head counts."""
    for name, n in (("query heads (model.n_heads)", n_heads), ("key/value heads (model.n_kv_heads)", n_kv_heads)):
        if n % sequence:
            raise ValueError(f"mesh.sequence: {sequence} (sequence_parallel_size) does not divide the {n} {name}; "
                             f"Ulysses attention splits the heads over the sequence axis, so choose a sequence size "
                             f"that divides both {n_heads} query and {n_kv_heads} key/value heads")


def attention(attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], q: jax.Array, k: jax.Array,
              v: jax.Array, axis: str) -> jax.Array:
    """`attend(q, k, v) -> [b, s, heads, d]` run on the whole sequence for this device's share of the heads,
    from and back to sequence chunks; q [b, s/P, h, d], k and v [b, s/P, kv, d] -> [b, s/P, h, d]."""
    n = jax.lax.axis_size(axis)
    b, t, h, d = q.shape
    kv = k.shape[2]
    check_heads(h, kv, n)
    # one all-to-all for q, k, v: [b, t, P, (h + 2 kv) / P, d], the P groups sent one to each device
    packed = jnp.concatenate([x.reshape(b, t, n, x.shape[2] // n, d) for x in (q, k, v)], axis=3)
    packed = jax.lax.all_to_all(packed, axis, split_axis=2, concat_axis=1, tiled=True)  # [b, t P, 1, ., d]
    packed = packed.reshape(b, t * n, (h + 2 * kv) // n, d)
    hq, hk = h // n, kv // n
    out = attend(packed[:, :, :hq], packed[:, :, hq:hq + hk], packed[:, :, hq + hk:])  # [b, s, h/P, d]
    return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)  # [b, s/P, h, d]
