"""Batched generation with a KV cache, as one compiled program over the parameters where they lie.

`generate(decoder, params, prompts, lengths, max_new_tokens, plan=...)` runs a batch of right-padded
prompts of different lengths: the decoder's `prefill` (every prompt in one call, filling a
static-shape cache), then a loop of `max_new_tokens - 1` `decode_step`s (one token for every row):
a counted `fori_loop` when no `eos_id` can end a row, else a `lax.while_loop` that stops early only
when every row has met `eos_id`, a condition
computed inside the program from the whole batch, so every device and process takes the same
branch. Greedy at temperature 0, else sampled (`top_k`, `top_p`) from a key derived from `seed`.

Compilation: the program is jitted once per (decoder, batch, prompt-width bucket, max_new_tokens,
sampling settings, shardings) and cached across calls; prompts are padded to a power-of-two width
(at least 8), so prompts of nearby lengths share a program. The cache
[layers, batch, prompt width + max_new_tokens, kv_heads, head_dim] is made inside the program and
carried through the loop, so it is updated in place and, like a donated buffer, costs no copy and no
memory once the call returns (`cache_bytes` says how much it holds while the call runs).

Where the weights are: the parameters enter the program in the placement they are stored in (a
ZeRO-3 plan's shards included) and are constrained to replicated once, before the prefill, so at
ZeRO-3 each leaf is all-gathered once per call, not once per token; the gathered copy is a
temporary of the program, freed when it returns. Rows are split over the data axis when the batch
divides by it (data-parallel decoding); otherwise every device decodes the whole batch. The results
are replicated, so every process of a multi-process run reads all of them.

Several processes: each calls `generate` with the same prompts and settings (the whole batch, not
its own rows), and each places its devices' rows. Every process runs the same number of loop
iterations whatever its own rows do: a finished row is masked (it keeps emitting `eos_id` at log-prob
0), and the early stop reads `all(done)` over the global batch, a value the program reduces over
every device, so all of them leave the loop at the same iteration. A process whose rows all ended
keeps stepping with the others instead of leaving its peers waiting in a collective (the hang of
DeepSpeed issue 8262, where each rank stopped on its own rows).

Nothing here reads a config: the decoder and plan carry everything (docs/architecture.md).
Relies on: the plan's mesh and its data axes (`core.mesh.data_axes`: rows split over them when the
batch divides); every other axis sees the weights replicated inside the program.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.core.layout import Plan
from zerojax.core.mesh import data_axes


class Decoder(Protocol):
    """A model's KV-cache forward, as pure functions over its training params pytree.

    `init_cache(params, batch, max_len)` -> a cache pytree (arrays whose dimension 1 is the batch;
    the shipped models use {"k", "v"}: [layers, batch, max_len, kv_heads, head_dim]).
    `prefill(params, cache, tokens [B, T], lengths [B])` -> (float32 logits [B, vocab] of the token
    after each row's first `lengths` tokens, cache).
    `decode_step(params, cache, tokens [B], positions [B])` -> (float32 logits [B, vocab] of the
    token after `tokens`, placed at `positions`, cache).
    `max_positions`: the longest sequence the model can place, or None for no bound.
    `zerojax.models.decode` has the GPT's and the Llama's.
    """

    max_positions: int | None

    def init_cache(self, params: Any, batch: int, max_len: int) -> Any: ...

    def prefill(self, params: Any, cache: Any, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, Any]: ...

    def decode_step(self, params: Any, cache: Any, tokens: jax.Array,
                    positions: jax.Array) -> tuple[jax.Array, Any]: ...


class Generation(NamedTuple):
    """What `generate` returns (device arrays).

    tokens [B, max_new_tokens] int32: the new tokens; after a row's eos, `eos_id` again.
    logprobs [B, max_new_tokens] float32: log p(token | everything before it) under the model's own
        distribution at temperature 1 (log_softmax of the logits, before temperature, top-k or top-p),
        what RLHF losses need; 0 after a row's eos.
    lengths [B] int32: new tokens per row, its eos included.
    """
    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array


def pad_prompts(prompts: Any, lengths: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(right-padded int32 [B, T], lengths [B]) from a list of token lists, or from an array and its
    lengths (None: every row is whole)."""
    if lengths is None and not isinstance(prompts, np.ndarray) and not isinstance(prompts, jax.Array):
        rows = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        width = max((len(r) for r in rows), default=0)
        out = np.zeros((len(rows), max(width, 1)), np.int32)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return out, np.asarray([len(r) for r in rows], np.int32)
    arr = np.asarray(prompts, np.int32)
    if arr.ndim != 2:
        raise ValueError(f"generate: prompts must be [batch, time] token ids (got shape {arr.shape})")
    lens = np.full((arr.shape[0],), arr.shape[1], np.int32) if lengths is None else np.asarray(lengths, np.int32)
    return arr, lens


def bucket(longest: int, max_new_tokens: int, max_positions: int | None) -> int:
    """The padded prompt width: the next power of two of `longest` (at least 8), within the model's
    positions when it has a bound."""
    width = max(8, 1 << max(0, longest - 1).bit_length())
    if max_positions is not None:
        if longest + max_new_tokens > max_positions:
            raise ValueError(f"generate: the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) "
                             f"exceeds the model's {max_positions} positions; shorten the prompt or generate fewer")
        width = min(width, max_positions - max_new_tokens)
    return width


def generate(decoder: Decoder, params: Any, prompts: Any, lengths: Any, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_id: int | None = None, plan: Plan | None = None) -> Generation:
    """`max_new_tokens` new tokens after each prompt (module docstring); `prompts` [B, T] right-padded
    with `lengths` [B] (or a list of token lists and lengths None). `plan`: the plan the params are laid
    out by (their gather and the rows' split follow it); None for params on one device."""
    tokens, lens = pad_prompts(prompts, lengths)
    b = tokens.shape[0]
    if max_new_tokens <= 0:
        raise ValueError(f"generate: max_new_tokens must be positive (got {max_new_tokens})")
    if b == 0 or lens.min() < 1 or lens.max() > tokens.shape[1]:
        raise ValueError(f"generate: every prompt needs between 1 and {tokens.shape[1]} tokens (lengths {lens.tolist()})")
    if top_k is not None and top_k < 1 or top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"generate: top_k must be >= 1 and top_p in (0, 1] (got {top_k}, {top_p})")
    width = bucket(int(lens.max()), max_new_tokens, decoder.max_positions)
    padded = np.zeros((b, width), np.int32)
    keep = min(width, tokens.shape[1])
    padded[:, :keep] = tokens[:, :keep]
    rows, replicated = _shardings(plan, b)
    if rows is not None:
        padded, lens = _place(padded, rows), _place(lens, rows)
    return _program(decoder, params, padded, lens, jnp.uint32(seed), max_new_tokens,
                    float(temperature), top_k, top_p, eos_id, rows, replicated)


def _place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The host array `host`, which every process holds whole, as one global array in `sharding`:
    each process places only its own devices' slices (device_put would need every device local)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def cache_bytes(decoder: Decoder, params: Any, batch: int, max_len: int) -> int:
    """Bytes of the cache `generate` builds for `batch` rows and `max_len` positions."""
    abstract = jax.eval_shape(lambda p: decoder.init_cache(p, batch, max_len), params)
    return sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(abstract))


def _shardings(plan: Plan | None, batch: int) -> tuple[NamedSharding | None, NamedSharding | None]:
    """(rows' sharding, replicated) on the plan's mesh; rows replicated when the batch does not divide."""
    if plan is None:
        return None, None
    replicated = NamedSharding(plan.mesh, P())
    if batch % plan.data_size == 0:
        return NamedSharding(plan.mesh, P(data_axes(plan.mesh))), replicated
    return replicated, replicated


def _cache_sharding(rows: NamedSharding | None, ndim: int) -> NamedSharding | None:
    if rows is None:
        return None
    return NamedSharding(rows.mesh, P(None, *rows.spec, *([None] * (ndim - 1 - len(rows.spec)))))


def _constrain(x: Any, sharding: NamedSharding | None) -> Any:
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def pick(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None,
         top_p: float | None) -> tuple[jax.Array, jax.Array]:
    """(token [B], its log-probability at temperature 1 [B]) from float32 logits [B, vocab]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    if temperature <= 0:
        token = jnp.argmax(logits, axis=-1)
    else:
        z = logits / temperature
        if top_k is not None and top_k < z.shape[-1]:
            kth = jax.lax.top_k(z, top_k)[0][:, -1:]
            z = jnp.where(z < kth, -jnp.inf, z)
        if top_p is not None and top_p < 1:
            ordered = -jnp.sort(-z, axis=-1)
            probs = jax.nn.softmax(ordered, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly likelier tokens
            cut = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
            z = jnp.where(z < cut, -jnp.inf, z)
        token = jax.random.categorical(key, z, axis=-1)
    token = token.astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8, 9, 10, 11))
def _program(decoder: Decoder, params: Any, prompts: jax.Array, lengths: jax.Array, seed: jax.Array,
             n: int, temperature: float, top_k: int | None, top_p: float | None, eos_id: int | None,
             rows: NamedSharding | None, replicated: NamedSharding | None) -> Generation:
    params = jax.tree.map(lambda x: _constrain(x, replicated), params)  # ZeRO-3: the one gather of the call
    key = jax.random.key(seed)
    b, width = prompts.shape
    cache = decoder.init_cache(params, b, width + n)
    cache = jax.tree.map(lambda c: _constrain(c, _cache_sharding(rows, c.ndim)), cache)
    logits, cache = decoder.prefill(params, cache, prompts, lengths)
    pad = jnp.int32(0 if eos_id is None else eos_id)

    def emit(i: jax.Array, logits: jax.Array, out: jax.Array, logps: jax.Array, done: jax.Array,
             count: jax.Array) -> tuple[jax.Array, ...]:
        token, logp = pick(logits, jax.random.fold_in(key, i), temperature, top_k, top_p)
        live = ~done
        out = jax.lax.dynamic_update_index_in_dim(out, jnp.where(live, token, pad), i, axis=1)
        logps = jax.lax.dynamic_update_index_in_dim(logps, jnp.where(live, logp, 0.0), i, axis=1)
        count = count + live.astype(jnp.int32)
        if eos_id is not None:
            done = done | (live & (token == eos_id))
        return token, out, logps, done, count

    out = _constrain(jnp.full((b, n), pad, jnp.int32), rows)
    logps = _constrain(jnp.zeros((b, n), jnp.float32), rows)
    done, count = _constrain(jnp.zeros((b,), jnp.bool_), rows), _constrain(jnp.zeros((b,), jnp.int32), rows)
    token, out, logps, done, count = emit(jnp.int32(0), logits, out, logps, done, count)

    def cond(carry: tuple[Any, ...]) -> jax.Array:
        i, _, _, _, _, done, _ = carry
        return (i < n) & ~jnp.all(done)

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        i, token, cache, out, logps, done, count = carry
        logits, cache = decoder.decode_step(params, cache, token, lengths + i - 1)  # token i-1 sits at length + i-1
        token, out, logps, done, count = emit(i, logits, out, logps, done, count)
        return i + 1, token, cache, out, logps, done, count

    carry = (jnp.int32(1), token, cache, out, logps, done, count)
    if eos_id is None:  # no row can end early: a counted loop, whose trip count XLA knows (no per-token test)
        carry = jax.lax.fori_loop(1, n, lambda _, c: body(c), carry)
    else:
        carry = jax.lax.while_loop(cond, body, carry)
    _, _, _, out, logps, _, count = carry
    # every process can read the whole result (a few bytes a row), not only its devices' rows
    return Generation(*(_constrain(x, replicated) for x in (out, logps, count)))

