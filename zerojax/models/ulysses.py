"""DeepSpeed-Ulysses attention (deepspeed/sequence/layer.py `DistributedAttention`) for a `sequence` axis.

Each device holds its chunk of every row's tokens, with all heads: q [b, s/P, h, d], k and v
[b, s/P, kv, d]. One all-to-all over `sequence` trades the token split for a head split (q, k and v
travel together), the ordinary attention runs over the whole sequence (its causal mask too) for the
device's heads, and a second all-to-all brings the output back to the token split [b, s/P, h, d].

With a `tensor` axis of size T as well, the heads are laid out [T, P, h/(T P)]: tensor slice t holds
heads [t h/T, (t+1) h/T) (a column-parallel q, k, v projection splits them so), and sequence device p
takes block p of each slice's heads. The all-to-all splits the P dimension only, so run on a
tensor slice's own heads (what `zerojax.rewrite.tensor_slices` does with a head-split activation) it
is Ulysses over that slice's heads, and run on whole heads it is Ulysses too: either way every device
ends with whole-sequence q, k and v for a set of heads, and each query head stays with the key/value
head it shares (grouped-query attention), because both counts are split the same way.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from zerojax.core.mesh import tensor_axis


def check_heads(n_heads: int, n_kv_heads: int, sequence: int, tensor: int = 1) -> None:
    """Ulysses splits the heads over the sequence axis (within each tensor slice's heads): sequence x tensor
    must divide both head counts."""
    by = f"mesh.sequence: {sequence} (sequence_parallel_size)"
    if tensor > 1:
        by += f" x mesh.tensor: {tensor} = {sequence * tensor}"
    which = "each tensor slice's heads" if tensor > 1 else "the heads"
    for name, n in (("query heads (model.n_heads)", n_heads), ("key/value heads (model.n_kv_heads)", n_kv_heads)):
        if n % (sequence * tensor):
            raise ValueError(f"{by} does not divide the {n} {name}; Ulysses attention splits {which} over the "
                             f"sequence axis, so choose sizes whose product divides both {n_heads} query and "
                             f"{n_kv_heads} key/value heads")


def tensor_group_size() -> int:
    """The tensor axis's size in the mesh being traced (1 without one)."""
    axis = tensor_axis()
    return 1 if axis is None else jax.lax.axis_size(axis)


def attention(attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array], q: jax.Array, k: jax.Array,
              v: jax.Array, axis: str) -> jax.Array:
    """`attend(q, k, v) -> [b, s, heads, d]` run on the whole sequence for this device's share of the heads,
    from and back to sequence chunks; q [b, s/P, h, d], k and v [b, s/P, kv, d] -> [b, s/P, h, d]."""
    n, tp = jax.lax.axis_size(axis), tensor_group_size()
    b, t, h, d = q.shape
    kv = k.shape[2]
    check_heads(h, kv, n, tp)
    hq, hk = h // (tp * n), kv // (tp * n)
    # one all-to-all for q, k, v: [b, t, T, P, hq + 2 hk, d], the P blocks sent one to each device
    packed = jnp.concatenate([x.reshape(b, t, tp, n, x.shape[2] // (tp * n), d) for x in (q, k, v)], axis=4)
    packed = jax.lax.all_to_all(packed, axis, split_axis=3, concat_axis=1, tiled=True)  # [b, t P, T, 1, ., d]

    def heads(lo: int, hi: int) -> jax.Array:  # [b, s, T (hi - lo), d]: slice-major, as the projections
        return packed[:, :, :, :, lo:hi].reshape(b, t * n, tp * (hi - lo), d)

    out = attend(heads(0, hq), heads(hq, hq + hk), heads(hq + hk, hq + 2 * hk))  # [b, s, T hq, d]
    out = jax.lax.all_to_all(out.reshape(b, t * n, tp, 1, hq, d), axis, split_axis=1, concat_axis=3, tiled=True)
    return out.reshape(b, t, h, d)  # [b, s/P, h, d]
