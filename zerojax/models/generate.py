"""Batched generation with a KV cache, as one compiled program over the parameters where they lie.

`generate(decoder, params, prompts, lengths, max_new_tokens, plan=...)` runs a batch of prompts of
different lengths: the decoder's `prefill` (every prompt in one call, filling a static-shape cache),
then a `lax.while_loop` of up to `max_new_tokens - 1` `decode_step`s (one token for every row) that
stops early only when every row has met a stop token (`eos_id` or any of `stop_ids`), a condition
computed inside the program from the whole batch, so every device and process takes the same
branch. Greedy at temperature 0, else sampled (temperature, then `top_k`, then `top_p`, as
transformers' processors) from a key derived from `seed`; each token comes with its log-probability
under the model at temperature 1 and under the distribution it was drawn from (`Generation`).

Prompts come as people have them (`pad_prompts`): a list of token lists, a right-padded array with
lengths, or an array with an attention mask, left-padded as transformers' tokenizers pad for
`generate`. They are moved to the right inside each row, so every row's first token sits at position
0, which is what transformers' `generate` computes for a left-padded row (its position ids count the
mask's ones).

Compilation: the program is jitted once per (decoder, batch, prompt-width bucket, new-token bucket,
sampling settings, stop ids, shardings) and cached across calls. Prompts are padded to a
power-of-two width (at least 8) and the new-token count rounds up to a power of two (at least 8) for
the arrays and the cache, the count itself being an argument the loop stops at, so prompts of nearby
lengths and nearby token counts share a program (a small slice of the results is all that differs).
The cache [layers, batch, prompt width + new-token bucket, kv_heads, head_dim] is made inside the
program and carried through the loop, so it is updated in place and, like a donated buffer, costs no
copy and no memory once the call returns (`cache_bytes` says how much it holds while the call runs).

Where the weights are: the parameters enter the program in the placement they are stored in (a
ZeRO-3 plan's shards included) and stay in a layout chosen per call (`zerojax.models.decode_layout`):
weight-stationary tensor-parallel decoding from the plan's blocks, or each shard gathered where a
layer uses it; neither holds the whole model on a device (`layout="gathered"`, the one gather per
call, does). A batch the row shards do not divide is padded with done rows. `memory_report` reads
which layout a call takes and its compiled peak. The results are replicated, so every process of a
multi-process run reads all of them.

Several processes: each calls `generate` with the same prompts and settings (the whole batch, not
its own rows), and each places its devices' rows. Every process runs the same number of loop
iterations whatever its own rows do: a finished row is masked (it keeps emitting `pad_id` at log-prob
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
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.core.layout import Plan
from zerojax.models import decode_layout
from zerojax.models.decode_layout import Layout


class Decoder(Protocol):
    """A model's KV-cache forward, as pure functions over its training params pytree.

    `init_cache(params, batch, max_len)` -> a cache pytree (arrays whose dimension 1 is the batch;
    the shipped models use {"k", "v"}: [layers, batch, max_len, kv_heads, head_dim]).
    `prefill(params, cache, tokens [B, T], lengths [B])` -> (float32 logits [B, vocab] of the token
    after each row's first `lengths` tokens, cache).
    `decode_step(params, cache, tokens [B], positions [B])` -> (float32 logits [B, vocab] of the
    token after `tokens`, placed at `positions`, cache).
    `max_positions`: the longest sequence the model can place, or None for no bound.
    Optional `rolled()` -> the same decoder with a decode step's layers run as a loop, one layer's
    slice of the stacked weights read per iteration (what the `tensor` layout runs: no copy of every
    layer's weights at once; a decoder without it runs as it is).
    `zerojax.models.decode` has the GPT's and the Llama's.
    """

    max_positions: int | None

    def init_cache(self, params: Any, batch: int, max_len: int) -> Any: ...

    def prefill(self, params: Any, cache: Any, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, Any]: ...

    def decode_step(self, params: Any, cache: Any, tokens: jax.Array,
                    positions: jax.Array) -> tuple[jax.Array, Any]: ...


class _Generated(NamedTuple):
    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array


class Generation(_Generated):
    """What `generate` returns (device arrays). It unpacks as (tokens, logprobs, lengths); the log-probs
    of the distribution actually sampled from are the attribute `sampled_logprobs` beside them.

    tokens [B, max_new_tokens] int32: the new tokens; after a row's stop, `pad_id` (by default `eos_id`).
    logprobs [B, max_new_tokens] float32: log p(token | everything before it) under the model's own
        distribution at temperature 1 (log_softmax of the logits, before temperature, top-k or top-p),
        what a KL to a reference and PPO's ratio against a trainer's forward need; 0 after a row's stop.
    lengths [B] int32: new tokens per row, its stop token included.
    sampled_logprobs [B, max_new_tokens] float32: log q(token), q the distribution the token was drawn
        from (the logits over `temperature`, then top-k, then top-p, renormalised: transformers'
        processors in that order); 0 at temperature 0 (greedy: a point mass) and after a row's stop.
    """

    sampled_logprobs: jax.Array

    def __new__(cls, tokens: jax.Array, logprobs: jax.Array, lengths: jax.Array,
                sampled_logprobs: jax.Array | None = None) -> "Generation":
        self = super().__new__(cls, tokens, logprobs, lengths)
        self.sampled_logprobs = logprobs if sampled_logprobs is None else sampled_logprobs
        return self


def pad_prompts(prompts: Any, lengths: Any = None, attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(right-padded int32 [B, T], lengths [B]) from the forms prompts come in: a list of token lists;
    an array [B, T] with its `lengths` (None: every row is whole); or an array with an `attention_mask`
    [B, T] of 0/1, as transformers' tokenizers and `generate` have them (left-padded or right-padded:
    each row's ones must be one run)."""
    if attention_mask is not None:
        if lengths is not None:
            raise ValueError("generate: give lengths= or attention_mask=, not both (the mask says where each "
                             "prompt's tokens are)")
        arr, mask = np.asarray(prompts), np.asarray(attention_mask)
        if arr.ndim != 2 or mask.shape != arr.shape:
            raise ValueError(f"generate: attention_mask must have the prompts' shape [batch, time] (prompts "
                             f"{arr.shape}, attention_mask {mask.shape})")
        keep = mask != 0
        first = np.argmax(keep, axis=1)
        lens = keep.sum(axis=1).astype(np.int32)
        span = np.arange(arr.shape[1])[None, :]
        one_run = (keep == ((span >= first[:, None]) & (span < (first + lens)[:, None]))).all(axis=1)
        if not one_run.all():
            bad = int(np.flatnonzero(~one_run)[0])
            raise ValueError(f"generate: attention_mask row {bad} has ones in more than one run ({mask[bad].tolist()}); "
                             f"a prompt is its tokens padded on the left or on the right, not holes inside it")
        out = np.zeros(arr.shape, np.int32)
        for r in range(arr.shape[0]):
            out[r, :lens[r]] = arr[r, first[r]:first[r] + lens[r]]
        return out, lens
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


def new_token_bucket(max_new_tokens: int) -> int:
    """How many new tokens a program has room for: the next power of two of `max_new_tokens` (at least
    8), so counts near each other share one program (the loop stops at the count asked for)."""
    return max(8, 1 << max(0, max_new_tokens - 1).bit_length())


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
             eos_id: int | None = None, plan: Plan | None = None, attention_mask: Any = None,
             stop_ids: Sequence[int] | None = None, pad_id: int | None = None, layout: str | None = None,
             _lower: Callable[[tuple], Any] | None = None) -> Generation:
    """`max_new_tokens` new tokens after each prompt (module docstring). `prompts`: [B, T] right-padded
    with `lengths` [B], or [B, T] with an `attention_mask` (left- or right-padded), or a list of token
    lists (`pad_prompts`). A row stops after `eos_id` or any of `stop_ids`; what follows is `pad_id`
    (default `eos_id`, else 0). `plan`: the plan the params are laid out by (where the weights and rows
    lie while decoding follows it); None for params on one device. `layout`: "tensor", "layers" or
    "gathered" to force one (`zerojax.models.decode_layout`); None chooses. `_lower`: `memory_report`'s
    hook, handed the program's arguments instead of running it."""
    tokens, lens = pad_prompts(prompts, lengths, attention_mask)
    b = tokens.shape[0]
    if max_new_tokens <= 0:
        raise ValueError(f"generate: max_new_tokens must be positive (got {max_new_tokens})")
    if b == 0 or lens.min() < 1 or lens.max() > tokens.shape[1]:
        raise ValueError(f"generate: every prompt needs between 1 and {tokens.shape[1]} tokens (lengths {lens.tolist()})")
    vocab = decoder.embedding(params).shape[0] if hasattr(decoder, "embedding") else None
    real = np.arange(tokens.shape[1])[None, :] < lens[:, None]
    if vocab is not None and real.any() and not (0 <= tokens[real].min() and tokens[real].max() < vocab):
        bad = tokens[real][(tokens[real] < 0) | (tokens[real] >= vocab)][0]
        raise ValueError(f"generate: prompt token id {int(bad)} is outside the model's vocabulary [0, {vocab}); "
                         f"tokenize with the model's own tokenizer")
    if top_k is not None and top_k < 1 or top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"generate: top_k must be >= 1 and top_p in (0, 1] (got {top_k}, {top_p})")
    stops = tuple(sorted({int(t) for t in (stop_ids or ())} | ({int(eos_id)} if eos_id is not None else set())))
    pad = int(pad_id) if pad_id is not None else int(eos_id) if eos_id is not None else 0
    width = bucket(int(lens.max()), max_new_tokens, decoder.max_positions)
    padded = np.zeros((b, width), np.int32)
    keep = min(width, tokens.shape[1])
    padded[:, :keep] = tokens[:, :keep]
    room = new_token_bucket(max_new_tokens)
    route = decode_layout.choose(plan, decoder, params, b, width + room, layout, cache_bytes)
    padded, lens = _rows(padded, lens, route)
    # numpy scalars, not jnp ones: each eager jnp op would be a program of its own
    args = (decoder, params, padded, lens, np.uint32(seed), np.int32(max_new_tokens), room, float(temperature),
            top_k, top_p, stops, pad, route)
    if _lower is not None:
        return _lower(args)
    out = _program(*args)
    if room == max_new_tokens and len(lens) == b:
        return Generation(*out)
    return Generation(*_trim(out, b, max_new_tokens))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _trim(out: tuple[jax.Array, ...], b: int, n: int) -> tuple[jax.Array, ...]:
    """The first `b` rows and `n` new tokens of the program's outputs: one program, where eager slicing
    is one per array."""
    toks, logps, count, sampled = out
    return toks[:b, :n], logps[:b, :n], count[:b], sampled[:b, :n]


class GenerateMemory(NamedTuple):
    """The memory report of one generate program, per device (`memory_report`).

    layout, why: which layout ran (`zerojax.models.decode_layout`) and why it was chosen.
    weights: the most weight bytes the layout holds at once; planned: the parameters as the plan stores them.
    peak: the compiled program's arguments + temporaries + outputs (`memory_analysis`): its peak,
        the KV cache and any gathered weights included (they are temporaries of the program).
    cache: the KV cache's bytes on one device.
    prefetch: the layout gathers layer i+1 while layer i computes (`layers` with the plan's prefetch),
        so `weights` counts two gathered layers.
    """
    layout: str
    why: str
    weights: int
    planned: int
    peak: int
    cache: int
    prefetch: bool = False

    def line(self) -> str:
        mib = 2 ** 20
        ahead = ", prefetching the next layer's gather (2 layers gathered at most)" if self.prefetch else ""
        return (f"generate ({self.layout} layout{ahead}: {self.why}): peak {self.peak / mib:.2f} MiB per device, weights "
                f"{self.weights / mib:.2f} MiB (the plan stores {self.planned / mib:.2f} MiB), KV cache "
                f"{self.cache / mib:.2f} MiB")


def memory_report(decoder: Decoder, params: Any, prompts: Any, lengths: Any, max_new_tokens: int, *,
                  plan: Plan | None = None, layout: str | None = None, **sampling: Any) -> GenerateMemory:
    """What `generate` with these arguments would hold per device, read from its compiled program
    (compiling it; nothing runs)."""
    found: dict[str, Any] = {}

    def lower(args: tuple) -> Any:
        found["route"], found["compiled"] = args[-1], _program.lower(*args).compile()
        found["batch"], found["max_len"] = args[2].shape[0], args[2].shape[1] + args[6]  # prompt width + new-token bucket

    generate(decoder, params, prompts, lengths, max_new_tokens, plan=plan, layout=layout, _lower=lower, **sampling)
    route, stats = found["route"], found["compiled"].memory_analysis()
    stats = stats[0] if isinstance(stats, (list, tuple)) else stats
    peak = int(stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes
               - stats.alias_size_in_bytes)
    cache = cache_bytes(decoder, params, found["batch"], found["max_len"]) // route.row_shards
    return GenerateMemory(route.name, route.why, route.weight_bytes, route.planned_bytes, peak, cache, route.prefetch)


def _rows(tokens: np.ndarray, lengths: np.ndarray, route: Layout) -> tuple[Any, Any]:
    """The prompts and lengths padded to a batch the row shards divide (pad rows: length 0, which the
    program treats as done from the start) and placed in the rows' sharding."""
    if route.rows is None:
        return tokens, lengths
    b = decode_layout.pad_rows(len(lengths), route.row_shards)
    tokens = np.pad(tokens, ((0, b - len(tokens)), (0, 0)))
    lengths = np.pad(lengths, (0, b - len(lengths)))
    return _place(tokens, route.rows), _place(lengths, route.rows)


def _place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The host array `host`, which every process holds whole, as one global array in `sharding`:
    each process places only its own devices' slices (device_put would need every device local)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def cache_bytes(decoder: Decoder, params: Any, batch: int, max_len: int) -> int:
    """Bytes of the cache `generate` builds for `batch` rows and `max_len` positions."""
    abstract = jax.eval_shape(lambda p: decoder.init_cache(p, batch, max_len), params)
    return sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(abstract))


def _cache_sharding(rows: NamedSharding | None, ndim: int) -> NamedSharding | None:
    if rows is None:
        return None
    return NamedSharding(rows.mesh, P(None, *rows.spec, *([None] * (ndim - 1 - len(rows.spec)))))


def _constrain(x: Any, sharding: NamedSharding | None) -> Any:
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def pick(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None,
         top_p: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(token [B], its log-probability at temperature 1 [B], its log-probability under the distribution
    it was drawn from [B]) from float32 logits [B, vocab]. The draw is from softmax of the logits over
    `temperature`, cut to the `top_k` likeliest, then to the smallest set of them whose mass reaches
    `top_p` (transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper in that order)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    if temperature <= 0:
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0], jnp.zeros(token.shape, jnp.float32)
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
    token = jax.random.categorical(key, z, axis=-1).astype(jnp.int32)
    sampled = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), token[:, None], axis=-1)[:, 0]
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0], sampled


def _route(decoder: Decoder, params: Any, layout: Layout) -> tuple[Any, Callable[..., Any], Callable[..., Any]]:
    """(params, prefill, decode_step) as the program runs them in `layout`: the weights constrained to
    where the layout holds them (`tensor`: weight-stationary, the decoder `rolled()`; `gathered`: whole),
    or the decoder run inside `shard_map` on each device's rows with each shard gathered where a layer
    uses it (`layers`)."""
    if layout.name == "layers":
        return params, _at_use(decoder.prefill, layout), _at_use(decoder.decode_step, layout)
    if layout.name == "tensor" and hasattr(decoder, "rolled"):  # the plan's bytes + one layer's slice, not 2x
        decoder = decoder.rolled()
    if layout.weights is not None:
        held = jax.tree.unflatten(jax.tree.structure(params), layout.weights)
        params = jax.tree.map(jax.lax.with_sharding_constraint, params, held)
    return params, decoder.prefill, decoder.decode_step


def _at_use(fn: Callable[..., Any], layout: Layout) -> Callable[..., Any]:
    """`fn(params, cache, tokens, positions) -> (logits, cache)` on each device's rows, its ZeRO-3 shards
    gathered layer by layer where they are used (and run on tensor slices, as the train step runs a loss)."""
    from zerojax.core.step import local_params
    from zerojax.rewrite.gather_at_use import gather_at_use
    from zerojax.rewrite.prepare import on_tensor_slices
    plan = layout.plan
    rows = layout.rows.spec

    def local(params: Any, cache: Any, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Any]:
        shards = local_params(plan, params, for_grad=False, marked=False)
        sliced = on_tensor_slices(fn, plan.tensor_dims, plan.tensor_size)
        return gather_at_use(sliced, plan.step.prefetch, forward_only=True)(shards, cache, tokens, positions)

    def run(params: Any, cache: Any, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Any]:
        specs = jax.tree.map(lambda c: _cache_sharding(layout.rows, c.ndim).spec, cache)
        mapped = jax.shard_map(local, mesh=plan.mesh, in_specs=(plan.param_specs, specs, rows, rows),
                               out_specs=(rows, specs), check_vma=False)
        return mapped(params, cache, tokens, positions)

    return run


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8, 9, 10, 11, 12))
def _program(decoder: Decoder, params: Any, prompts: jax.Array, lengths: jax.Array, seed: jax.Array,
             n: jax.Array, room: int, temperature: float, top_k: int | None, top_p: float | None,
             stops: tuple[int, ...], pad_id: int, layout: Layout) -> tuple[jax.Array, ...]:
    """`n` (traced) new tokens in arrays of `room` (static) columns: one program for every count up to
    `room`, the loop running `n - 1` decode steps, the weights where `layout` holds them."""
    rows = layout.rows
    replicated = None if rows is None else NamedSharding(rows.mesh, P())
    params, prefill, decode_step = _route(decoder, params, layout)
    key = jax.random.key(seed)
    b, width = prompts.shape
    cache = decoder.init_cache(params, b, width + room)
    cache = jax.tree.map(lambda c: _constrain(c, _cache_sharding(rows, c.ndim)), cache)
    logits, cache = prefill(params, cache, prompts, lengths)
    pad = jnp.int32(pad_id)

    def emit(i: jax.Array, logits: jax.Array, out: jax.Array, logps: jax.Array, sampled: jax.Array,
             done: jax.Array, count: jax.Array) -> tuple[jax.Array, ...]:
        token, logp, logq = pick(logits, jax.random.fold_in(key, i), temperature, top_k, top_p)
        live = ~done
        out = jax.lax.dynamic_update_index_in_dim(out, jnp.where(live, token, pad), i, axis=1)
        logps = jax.lax.dynamic_update_index_in_dim(logps, jnp.where(live, logp, 0.0), i, axis=1)
        sampled = jax.lax.dynamic_update_index_in_dim(sampled, jnp.where(live, logq, 0.0), i, axis=1)
        count = count + live.astype(jnp.int32)
        if stops:
            done = done | (live & jnp.isin(token, jnp.asarray(stops, jnp.int32)))
        return token, out, logps, sampled, done, count

    out = _constrain(jnp.full((b, room), pad, jnp.int32), rows)
    logps = _constrain(jnp.zeros((b, room), jnp.float32), rows)
    sampled = _constrain(jnp.zeros((b, room), jnp.float32), rows)
    done = _constrain(lengths < 1, rows)  # the rows padding the batch to the row shards: done from the start
    count = _constrain(jnp.zeros((b,), jnp.int32), rows)
    token, out, logps, sampled, done, count = emit(jnp.int32(0), logits, out, logps, sampled, done, count)

    def cond(carry: tuple[Any, ...]) -> jax.Array:
        i, done = carry[0], carry[-2]
        if not stops:  # no row can end early: the count alone, no reduction over the batch per token
            return i < n
        return (i < n) & ~jnp.all(done)

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        i, token, cache, out, logps, sampled, done, count = carry
        logits, cache = decode_step(params, cache, token, lengths + i - 1)  # token i-1 sits at length + i-1
        token, out, logps, sampled, done, count = emit(i, logits, out, logps, sampled, done, count)
        return i + 1, token, cache, out, logps, sampled, done, count

    carry = (jnp.int32(1), token, cache, out, logps, sampled, done, count)
    # The early stop reads all(done) over the global batch (module docstring).
    _, _, _, out, logps, sampled, _, count = jax.lax.while_loop(cond, body, carry)
    # every process can read the whole result (a few bytes a row), not only its devices' rows
    return tuple(_constrain(x, replicated) for x in (out, logps, count, sampled))
