"""KV-cache decoding of the shipped GPT and Llama (dense or MoE), as pure functions over the training params.

The params are the very pytree training uses (`gpt.init_params`, the Llama's `from_nnx` dict, an
engine's `state.params`); nothing is converted. Each decoder answers the protocol
`zerojax.models.generate.Decoder`:

    init_cache(params, batch, max_len) -> cache   {"k", "v"}: [layers, batch, max_len, kv_heads, head_dim]
    prefill(params, cache, tokens [B, T], lengths [B]) -> (logits [B, vocab] at position lengths - 1, cache)
    decode_step(params, cache, tokens [B], positions [B]) -> (logits [B, vocab], cache)
    max_positions: the longest sequence the model can place (the GPT's learned positions), or None

Each is one function, `_forward`: embed the tokens at their positions, and in each layer write
their keys and values into the cache at those positions and attend to every cached position at or
before the query's. The prefill runs the right-padded prompts in one call (positions 0..T-1); a
pad's keys sit beyond its row's length and are overwritten by the row's own next token before any
query reaches them, so they are never read. Layers run through the same NNX submodules training
uses (rebuilt per layer from its slice of the stacked params, as `gpt.apply` does), so the
projections and norms are the training ones; logits are float32.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.config import ModelConfig
from zerojax.models import gpt, llama
from zerojax.models.attention import scaled

Cache = dict[str, jax.Array]


def _rebuild(make: Callable[[], nnx.Module], layer: dict[str, Any]) -> Any:
    """An NNX module made abstractly by `make`, holding the parameter dict `layer` (trace-time only), in
    eval mode: generation draws no dropout mask (`lora.lora_dropout`), as PEFT's model.eval()."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    nnx.replace_by_pure_dict(state, layer)
    module = nnx.merge(graphdef, state)
    module.eval()
    return module


def attend(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, window: Any = None,
           scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """Causal attention of queries q [B, T, heads, hd] at `positions` [B, T] over a whole cache
    k, v [B, S, kv_heads, hd]: a query sees the cache slots at or before its position (and, with a
    sliding `window`, after position - window, as training's mask). Query heads are grouped under the
    key/value head they share (GPT: one each). `scale` and `softcap` as training's
    (zerojax.models.attention.scaled). Returns [B, T, heads * hd]."""
    b, t, h, hd = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scaled(scores, hd, scale, softcap)
    slots = jnp.arange(k.shape[1])[None, None, :]
    mask = slots <= positions[:, :, None]  # [B, T, S]
    if window is not None:
        mask = mask & (positions[:, :, None] - slots < window)
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -1e30), axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h * hd)


def _write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """cache [B, S, kv, hd] with new [B, T, kv, hd] written at `positions` [B, T]: one token per row at
    its own position (a select, which splits cleanly over rows sharded on the data axis), or, for
    T > 1, the prefill's positions 0..T-1 of every row."""
    new = new.astype(cache.dtype)
    if new.shape[1] == 1:
        at = jnp.arange(cache.shape[1])[None, :] == positions  # [B, S]
        return jnp.where(at[:, :, None, None], new, cache)
    return jax.lax.dynamic_update_slice_in_dim(cache, new, 0, axis=1)


class _Decoder:
    """What both models share: the cache, prefill and decode_step over `_forward`."""

    cfg: ModelConfig
    n_kv_heads: int
    max_positions: int | None = None
    #: A decode step's layers unrolled into one straight program (one token per row is launch-bound on an
    #: accelerator: a loop would be stepped by the host every layer). `rolled()` turns it off.
    unroll_decode: bool = True
    #: `_Decoder._forward`'s layer scan views a rolled decoder's 16-bit cache as floats per layer
    #: (`_stored`); a decoder with a forward of its own keeps its cache in the compute dtype.
    cache_as_bits: bool = True

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.head_dim = cfg.d_model // cfg.n_heads

    def __eq__(self, other: object) -> bool:  # one compiled program per model config, not per object
        return type(other) is type(self) and other.cfg == self.cfg and other.unroll_decode == self.unroll_decode

    def __hash__(self) -> int:
        return hash((type(self), self.cfg, self.unroll_decode))

    def rolled(self) -> "_Decoder":
        """This decoder with a decode step's layers run as a loop, each iteration reading its layer's slice
        of the stacked weights: at most one layer's slice is copied out at a time. (XLA:CPU's matmuls read
        a slice of a stack as a copy of it; unrolled, every layer's copy is scheduled at the top of the
        step, a second copy of the weights.) What weight-stationary decoding runs
        (`zerojax.models.decode_layout`'s `tensor`), whose point is holding the plan's bytes."""
        out = copy.copy(self)
        out.unroll_decode = False
        return out

    def cache_shape(self, batch: int, max_len: int) -> tuple[int, ...]:
        """[layers, batch, max_len, kv_heads, head_dim], of each of "k" and "v"."""
        return (self.cfg.n_layers, batch, max_len, self.n_kv_heads, self.head_dim)

    def init_cache(self, params: Any, batch: int, max_len: int) -> Cache:
        """A zero cache in the params' compute dtype (the embedding's), or its bits (`_stored`)."""
        dtype = self._stored(self.embedding(params).dtype)
        shape = self.cache_shape(batch, max_len)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def _stored(self, dtype: Any) -> Any:
        """The dtype the cache is kept in: a `rolled()` decoder keeps a 16-bit float cache as the unsigned
        integers of its bits, each layer's slice viewed as floats where it is used. XLA:CPU has no
        16-bit float dynamic-slice: a layer loop over a bf16 cache would convert the whole cache to f32
        and back in every decode step (a third slower at 16 rows); integers it slices as they are."""
        dtype = jnp.dtype(dtype)
        if self.unroll_decode or not self.cache_as_bits:
            return dtype
        return jnp.dtype(jnp.uint16) if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) else dtype

    def prefill(self, params: Any, cache: Cache, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, Cache]:
        """Run the right-padded prompts `tokens` [B, T] (row b's first `lengths[b]` are real) into the
        cache; float32 logits [B, vocab] of the next token after each prompt."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x, cache = self._forward(params, cache, tokens, positions)
        last = jnp.take_along_axis(x, (lengths.astype(jnp.int32) - 1)[:, None, None], axis=1)
        return self._logits(params, last)[:, 0], cache

    def decode_step(self, params: Any, cache: Cache, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Cache]:
        """One token per row, `tokens` [B] at `positions` [B]: float32 logits [B, vocab] of the next."""
        x, cache = self._forward(params, cache, tokens[:, None], positions[:, None].astype(jnp.int32))
        return self._logits(params, x)[:, 0], cache

    def _forward(self, params: Any, cache: Cache, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Cache]:
        x = self._embed(params, tokens, positions)
        extra = self._extra(positions)

        dtype = jnp.dtype(self.embedding(params).dtype)

        def body(x: jax.Array, xs: tuple[Any, jax.Array, jax.Array, Any]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            layer, k_cache, v_cache, window = xs
            k_cache, v_cache = _view(k_cache, dtype), _view(v_cache, dtype)
            x, k_cache, v_cache = self._layer(layer, x, k_cache, v_cache, positions, (extra, window))
            return x, (_view(k_cache, self._stored(dtype)), _view(v_cache, self._stored(dtype)))

        # One token per row is launch-bound on an accelerator: the layers unrolled run as one straight
        # program, not a loop whose every iteration the host steps (the prompt's prefill keeps the loop).
        unroll = tokens.shape[1] == 1 and self.unroll_decode
        xs = (self.layers(params), cache["k"], cache["v"], self._windows())
        x, (k, v) = jax.lax.scan(body, x, xs, unroll=unroll)
        return x, {"k": k, "v": v}

    def _extra(self, positions: jax.Array) -> Any:
        return None

    def _windows(self) -> Any:
        """Each layer's attention window where the layers differ (Gemma's), else None."""
        return None

    # per model: embedding(params), layers(params), _embed, _layer, _logits


class GPTDecoder(_Decoder):
    """The embedded GPT (`zerojax.models.gpt`): learned positions, so at most `seq_len` of them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.n_kv_heads = cfg.n_heads
        self.max_positions = cfg.seq_len
        self._make = lambda: gpt.Block(cfg, rngs=nnx.Rngs(0))

    def embedding(self, params: Any) -> jax.Array:
        return params["embed"]["embedding"]

    def layers(self, params: Any) -> Any:
        return params["blocks"]

    def _embed(self, params: Any, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        pos = jnp.take(params["pos"], jnp.minimum(positions, self.cfg.seq_len - 1), axis=0)
        return jnp.take(params["embed"]["embedding"], tokens, axis=0) + pos

    def _layer(self, layer: Any, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
               extra: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        blk = _rebuild(self._make, layer)
        b, t, d = x.shape
        h = self.cfg.n_heads
        q, k, v = (y.reshape(b, t, h, d // h) for y in jnp.split(blk.qkv(blk.ln1(x)), 3, axis=-1))
        del extra  # learned positions; no per-layer window
        k_cache, v_cache = _write(k_cache, k, positions), _write(v_cache, v, positions)
        x = x + blk.proj(attend(q, k_cache, v_cache, positions))
        return x + blk.out(jax.nn.gelu(blk.fc(blk.ln2(x)))), k_cache, v_cache

    def _logits(self, params: Any, x: jax.Array) -> jax.Array:
        x = gpt.layer_norm(params["ln_f"], x, gpt.norm_eps(self.cfg))
        return gpt.logits(params, x)


class LlamaDecoder(_Decoder):
    """The Llama (`zerojax.models.llama`): rotary positions (no length bound), grouped-query cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.n_kv_heads = llama.kv_heads(cfg)
        self.head_dim = llama.head_width(cfg)
        self._make = lambda: llama.Layer(cfg, rngs=nnx.Rngs(0))

    def embedding(self, params: Any) -> jax.Array:
        return params["embed"]["embedding"]

    def layers(self, params: Any) -> Any:
        return params["layers"]

    def _embed(self, params: Any, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        return llama.embed_tokens(self.cfg, params["embed"]["embedding"], tokens)

    def _windows(self) -> Any:
        return llama.layer_windows(self.cfg)

    def _extra(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos and sin [B, T, head_dim] at each token's position (llama.rotary's maths, its scaled frequencies)."""
        inv_freq = llama.frequencies(self.cfg)
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb), jnp.sin(emb)

    def _layer(self, layer: Any, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
               extra: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        lay = _rebuild(self._make, layer)
        x, k_cache, v_cache = self._attention(lay, x, k_cache, v_cache, positions, extra)
        return x + lay.mlp(x), k_cache, v_cache

    def _attention(self, lay: llama.Layer, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                   positions: jax.Array, extra: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The layer's residual attention block over the cache, which it first writes x's keys and values to.
        `extra`: (cos and sin at the positions, this layer's window or None)."""
        (cos, sin), window = extra
        b, t, _ = x.shape
        q, k, v = lay.qkv(lay.attn_norm(x))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_cache, v_cache = _write(k_cache, k, positions), _write(v_cache, v, positions)
        att = attend(q, k_cache, v_cache, positions, self.cfg.sliding_window if window is None else window,
                     lay.scale, lay.softcap)
        return x + lay.attn_out(att.reshape(b, t, -1)), k_cache, v_cache

    def _logits(self, params: Any, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = llama.rms_norm(x, params["norm"]["scale"], llama.norm_eps(cfg), cfg.norm_offset)
        head = None if cfg.tie_embeddings else params["head"]["kernel"]
        return llama.head_logits(cfg, x, params["embed"]["embedding"], head)


class MoELlamaDecoder(LlamaDecoder):
    """The MoE Llama (`model.n_experts`): `LlamaDecoder`'s attention and cache, and in every
    `moe_every`-th layer the model's mixture of experts for the MLP, gated as the model's evaluation
    forward gates (`llama.apply`: no noise, `eval_capacity_factor`).

    The params follow `llama.Llama._moe_stack`: `layers` holds the groups' MoE layers [groups, ...]
    and `dense_layers` the `moe_every - 1` dense layers before each [groups, moe_every - 1, ...]; the
    cache stays one [n_layers, ...] array, viewed as [groups, moe_every, ...] (layer g * moe_every + j
    is group g's j-th).

    The gate routes the tokens of one call together, as the model routes a batch: the prefill's
    batch x prompt width (pads included), a decode step's batch (one token per row). So with
    `drop_tokens` the capacity, and which tokens an expert drops, depend on that count, and the
    cached decode can differ from a forward over the whole window; with `drop_tokens: false`
    (Mixtral's setting) no token is dropped in either and the two agree. DeepSpeed's top-1 gate
    refuses fewer tokens than `min_capacity`; a call that routes fewer (a small batch's decode step)
    gates with `min_capacity` lowered to its token count, which still leaves room for every token, so
    the routing and the outputs are those of the configured gate.

    With an expert mesh axis the generation program runs the layer on the experts where the plan
    stores them (`zerojax.models.decode_layout`); the layer's maths is the same either way.
    """

    cache_as_bits = False  # its `_forward` scans the cache itself, in the compute dtype

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.groups, self.every = cfg.n_layers // cfg.moe_every, cfg.moe_every

    def _forward(self, params: Any, cache: Cache, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Cache]:
        x = self._embed(params, tokens, positions)
        extra = self._extra(positions)
        unroll = tokens.shape[1] == 1 and self.unroll_decode  # as `_Decoder._forward`
        cfg = dataclasses.replace(self.cfg, min_capacity=min(self.cfg.min_capacity, tokens.size))

        def make_moe() -> llama.MoELayer:
            return llama.MoELayer(cfg, rngs=nnx.Rngs(0))

        def dense(x: jax.Array, xs: tuple[Any, jax.Array, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            layer, k_cache, v_cache = xs
            x, k_cache, v_cache = self._layer(layer, x, k_cache, v_cache, positions, (extra, None))
            return x, (k_cache, v_cache)

        def group(x: jax.Array, xs: tuple[Any, Any, jax.Array, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            dense_run, moe_layer, k_cache, v_cache = xs  # caches [moe_every, B, S, kv, hd]
            if dense_run is not None:
                x, (k_dense, v_dense) = jax.lax.scan(dense, x, (dense_run, k_cache[:-1], v_cache[:-1]), unroll=unroll)
            lay = _rebuild(make_moe, moe_layer)
            lay.moe.eval()  # no gate noise, eval_capacity_factor
            x, k_moe, v_moe = self._attention(lay, x, k_cache[-1], v_cache[-1], positions, (extra, None))
            y, _, _ = lay.moe(lay.mlp_norm(x))
            y = lay.mlp_out(y)
            if dense_run is None:
                return x + y, (k_moe[None], v_moe[None])
            return x + y, (jnp.concatenate([k_dense, k_moe[None]]), jnp.concatenate([v_dense, v_moe[None]]))

        def grouped(c: jax.Array) -> jax.Array:
            return c.reshape(self.groups, self.every, *c.shape[1:])

        xs = (params.get("dense_layers"), params["layers"], grouped(cache["k"]), grouped(cache["v"]))
        x, (k, v) = jax.lax.scan(group, x, xs, unroll=unroll)
        return x, {"k": k.reshape(cache["k"].shape), "v": v.reshape(cache["v"].shape)}


def _view(a: jax.Array, dtype: Any) -> jax.Array:
    """`a`'s bits as `dtype` (of the same width), or `a` when it is one already."""
    return a if a.dtype == dtype else jax.lax.bitcast_convert_type(a, dtype)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """llama._rotate with a per-row angle: x [B, T, heads, hd], cos and sin [B, T, hd]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def decoder(cfg: ModelConfig) -> GPTDecoder | LlamaDecoder:
    """The decoder of the model `cfg.name` names (what train.py hands its engine as `decode=`):
    the GPT's, the dense Llama's or the MoE Llama's."""
    if llama.is_moe(cfg):
        return MoELlamaDecoder(cfg)
    return LlamaDecoder(cfg) if cfg.name == "llama" else GPTDecoder(cfg)
