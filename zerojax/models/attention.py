"""Causal grouped-query attention: dense, or blockwise with an online softmax (memory linear in T).

`dense` materializes the [heads, T, T] score matrix, so a device's attention memory grows as T². Under
DeepSpeed-Ulysses every device attends over the whole sequence for H/P heads, so with dense attention
the longest sequence that fits grows only as sqrt(P). `blockwise` never holds more than one
[block, block] tile of scores per head: queries are taken a block at a time (an outer `lax.scan`),
and for each, the key/value blocks are folded in one at a time (an inner `lax.scan`) into a running
softmax state (max, denominator, weighted sum of values), the online softmax of Milakov & Gimelshein
(2018) that flash attention (Dao et al. 2022) is built on. Both scan bodies are rematerialized, so the
backward pass keeps one query block's inputs per outer step and recomputes the tiles: memory linear
in T, and the longest sequence grows about linearly with the sequence axis, as DeepSpeed's ALST has
it with flash attention.

`fused` hands the attention to `jax.nn.dot_product_attention`: cuDNN's flash attention on a GPU when
the dtype (bf16, fp16) and head width allow, XLA's dense form elsewhere. cuDNN's kernel never writes
the score matrix to memory, so on a GPU it is both the fast and the small form, and `auto` takes it
there too; on a CPU `fused` is `dense`. It cannot express Gemma's soft-capping or a window that changes
per layer (a traced scalar): those run as `auto` without cuDNN (blockwise past one block, else dense).

`dense` and `blockwise` are written with plain `lax` primitives (einsums, elementwise ops, scans, checkpoints), so the
tensor-parallel evaluator (zerojax.rewrite.tensor_slices) runs them on a tensor slice's heads and
Ulysses (zerojax.models.ulysses) wraps either as its `attend`.

The blockwise form computes every (query block, key block) tile, the ones above the diagonal masked
out, so it does the dense form's arithmetic; it trades no flops for its memory.

`window` (Mistral's sliding window, `model.sliding_window`): a query at position i sees only the keys
at i - window + 1 .. i, as transformers' sliding-window mask has it (key j visible when i - j < window).
It may be a traced scalar: Gemma's layers alternate a window and the whole context inside one scan.

`scale` (Gemma's query_pre_attn_scalar ** -0.5; default 1 / sqrt(head width)) multiplies the scores and
`softcap` (Gemma 2's attn_logit_softcapping) bends them to softcap * tanh(score / softcap), before the
mask, as transformers' eager attention does.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from zerojax.core.mesh import tensor_axis

MODES = ("auto", "dense", "blockwise", "fused")
_MASKED = -1e30


def visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """[queries, keys] mask: key position at or before the query's, and within `window` of it."""
    seen = q_pos[:, None] >= k_pos[None, :]
    return seen if window is None else seen & (q_pos[:, None] - k_pos[None, :] < window)


def scaled(scores: jax.Array, head_dim: int, scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """Float32 scores q.k scaled (by `scale`, else 1 / sqrt(head_dim)) and soft-capped where asked."""
    scores = scores / jnp.sqrt(jnp.float32(head_dim)) if scale is None else scores * jnp.float32(scale)
    if softcap is not None:
        scores = jnp.tanh(scores / jnp.float32(softcap)) * jnp.float32(softcap)
    return scores


def dense(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None = None, scale: float | None = None,
          softcap: float | None = None) -> jax.Array:
    """Causal grouped-query attention: q [b, t, h, d], k and v [b, t, kv, d] -> [b, t, h, d]."""
    b, t, h, hd = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, hd)  # query heads grouped under the key/value head they share
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    scores = scaled(scores, hd, scale, softcap)
    mask = visible(jnp.arange(t), jnp.arange(t), window)
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1).astype(q.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, t, h, hd)


class _Softmax(NamedTuple):
    """A softmax over some keys, unnormalized: per query, the largest score `m`, the sum `l` of
    exp(score - m) and the sum `acc` of exp(score - m) times the values. Two of them over disjoint keys
    combine into the one over both (`_combine`)."""
    m: jax.Array    # [b, kv, g, q]
    l: jax.Array    # [b, kv, g, q]
    acc: jax.Array  # [b, kv, g, q, d], float32


def _combine(a: _Softmax, b: _Softmax) -> _Softmax:
    m = jnp.maximum(a.m, b.m)
    ca, cb = jnp.exp(a.m - m), jnp.exp(b.m - m)
    return _Softmax(m, a.l * ca + b.l * cb, a.acc * ca[..., None] + b.acc * cb[..., None])


def blockwise(q: jax.Array, k: jax.Array, v: jax.Array, block: int, window: int | None = None,
              scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """`dense`'s result, computed a [block, block] tile of scores at a time (see the module docstring).

    A length that `block` does not divide is padded at the end: the padded keys come after every real
    query, so the causal mask already hides them, and the padded queries' rows are dropped."""
    b, t, h, hd = q.shape
    kv = k.shape[2]
    g = h // kv
    block = min(block, t)
    n = -(-t // block)
    if n * block != t:
        pad = [(0, 0), (0, n * block - t), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    # [n, b, block, heads..., d]: the blocks on a leading axis, for the scans to walk
    qb = jnp.moveaxis(q.reshape(b, n, block, kv, g, hd), 1, 0)
    kb = jnp.moveaxis(k.reshape(b, n, block, kv, hd), 1, 0)
    vb = jnp.moveaxis(v.reshape(b, n, block, kv, hd), 1, 0)
    starts = jnp.arange(n, dtype=jnp.int32) * block
    offsets = jnp.arange(block, dtype=jnp.int32)

    def query_block(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        qi, q0 = xs

        def tile(k0: jax.Array, kj: jax.Array, vj: jax.Array) -> _Softmax:
            s = scaled(jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32), hd, scale, softcap)
            s = jnp.where(visible(q0 + offsets, k0 + offsets, window), s, _MASKED)
            m = jnp.max(s, axis=-1)
            p = jnp.exp(s - m[..., None])
            acc = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
            return _Softmax(m, jnp.sum(p, axis=-1), acc)

        def fold(state: _Softmax, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[_Softmax, None]:
            return _combine(state, tile(*xs)), None

        # Key block 0 holds position 0, which every query sees: starting from it keeps `m` finite, so a
        # block wholly above the diagonal adds exp(-1e30 - m) = 0 of itself. Under a sliding window a
        # query may not see block 0: its all-masked start (m = -1e30) is then scaled by exp(-1e30 - m)
        # = 0 once the query's own block, which it always sees, is folded in.
        first = tile(starts[0], kb[0], vb[0])
        state, _ = jax.lax.scan(jax.checkpoint(fold, prevent_cse=False), first, (starts[1:], kb[1:], vb[1:]))
        out = state.acc / state.l[..., None]  # [b, kv, g, block, d]
        return None, out.astype(q.dtype)

    _, out = jax.lax.scan(jax.checkpoint(query_block, prevent_cse=False), None, (qb, starts))
    # [n, b, kv, g, block, d] -> [b, n block, kv g, d], less the padding
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(b, n * block, h, hd)
    return out[:, :t]


def uses_blockwise(mode: str, block: int, t: int) -> bool:
    """Whether `mode` (model.attention) takes the blockwise form at sequence length `t`: `auto` does
    once the sequence is longer than one block."""
    if mode not in MODES:
        raise ValueError(f"model.attention: {mode!r} is not one of {', '.join(MODES)}")
    return mode == "blockwise" or (mode == "auto" and t > block)


def _library(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None, scale: float | None,
             implementation: str) -> jax.Array:
    left = None if window is None else (int(window) - 1, 0)  # key j visible when i - j < window
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, local_window_size=left,
                                        implementation=implementation)


def cudnn(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None = None,
          scale: float | None = None) -> jax.Array | None:
    """`dense`'s result from cuDNN's flash attention, or None where it does not apply or refuses."""
    if not cudnn_applies(q.dtype, q.shape[-1]):
        return None
    try:
        return _library(q, k, v, window, scale, "cudnn")
    except (NotImplementedError, ValueError, RuntimeError):  # this cuDNN refuses the shape
        return None


def fused(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None = None,
          scale: float | None = None) -> jax.Array:
    """`dense`'s result through `jax.nn.dot_product_attention`: cuDNN's kernel where it applies, XLA's form
    elsewhere."""
    out = cudnn(q, k, v, window, scale)
    return _library(q, k, v, window, scale, "xla") if out is None else out


def cudnn_applies(dtype: Any, head_dim: int, backend: str | None = None) -> bool:
    """Whether to ask for cuDNN's kernel: a GPU, 16-bit inputs, a head width it takes (JAX's own
    default is XLA's form everywhere)."""
    backend = backend or jax.default_backend()
    return backend in ("gpu", "cuda") and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and (
        head_dim <= 128 and head_dim % 8 == 0)


def expressible_fused(window: int | None, softcap: float | None) -> bool:
    """Whether `fused` computes this attention: no soft-capping, and a window fixed at trace time."""
    return softcap is None and not isinstance(window, jax.Array)


def library_form(q: jax.Array, k: jax.Array, v: jax.Array, mode: str, window: int | None = None,
                 scale: float | None = None, softcap: float | None = None) -> jax.Array | None:
    """The attention from `jax.nn.dot_product_attention` where `mode` takes it here (`fused` always;
    `auto` when cuDNN's kernel applies), else None. Under a tensor axis the slice evaluator has no rule
    for cuDNN's call and would gather its heads, so `auto` keeps the plain forms there."""
    if not expressible_fused(window, softcap):
        return None
    if mode == "fused":
        return fused(q, k, v, window, scale)
    return cudnn(q, k, v, window, scale) if mode == "auto" and tensor_axis() is None else None


def causal(q: jax.Array, k: jax.Array, v: jax.Array, mode: str = "auto", block: int = 512,
           window: int | None = None, scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """Causal grouped-query attention in the form `mode` picks for this length (q's whole sequence)."""
    out = library_form(q, k, v, mode, window, scale, softcap)
    if out is not None:
        return out
    if uses_blockwise("auto" if mode == "fused" else mode, block, q.shape[1]):
        return blockwise(q, k, v, block, window, scale, softcap)
    return dense(q, k, v, window, scale, softcap)


def attend(mode: str, block: int, window: int | None = None, scale: float | None = None,
           softcap: float | None = None) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """`causal` with the model's choice bound: the `attend(q, k, v)` that Ulysses wraps."""
    return functools.partial(causal, mode=mode, block=block, window=window, scale=scale, softcap=softcap)
