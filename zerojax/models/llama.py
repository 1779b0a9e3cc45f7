"""A Llama-family decoder in Flax NNX: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

Written as a user writes an NNX model, and trained through the same public path a user's model
takes (`zerojax.from_nnx(constructor, loss)`): the layers are created with `nnx.vmap` (one leading
layer axis per parameter) and applied with `nnx.scan` over an `nnx.remat` body. Nothing in it
knows about ZeRO: under stage 3 the step gathers each parameter where the traced loss uses it
(zerojax.rewrite.gather_at_use), which for the scanned stack means one layer per scan iteration, forward
and again in the rematerialized backward pass.

The maths follows Hugging Face transformers' `LlamaForCausalLM` (rotate-half rotary embeddings,
RMSNorm scaling the input-dtype normalized activations), so its checkpoints load unchanged
(zerojax.models.hf). Kernels are stored [in, out], as `nnx.Linear` keeps them.

With `model.n_experts` set, the MLP of every `model.moe_every`-th layer is a mixture of experts
(zerojax.models.moe, DeepSpeed's MoE layer) and the loss adds `model.moe_aux_loss_coef` times the
layers' summed load-balancing losses. The layers are then scanned in groups of `moe_every`: the
group's `moe_every - 1` dense layers (`dense_layers`, stacked [groups, moe_every - 1, ...]) followed
by its MoE layer (`layers`, stacked [groups, ...]), which is Megatron-DeepSpeed's placement (layer i,
counted from 1, is MoE when i % expert_interval == 0). The dense model's parameters and maths are
untouched by any of this.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.config import ModelConfig
from zerojax.core.mesh import sequence_axis
from zerojax.models import attention as causal_attention
from zerojax.models import lora
from zerojax.models import ulysses
from zerojax.models.loss import inputs, next_token_loss
from zerojax.models.moe import MoE


def norm_eps(cfg: ModelConfig) -> float:
    """The RMSNorm epsilon (`model.norm_eps`, LlamaConfig's 1e-5 when unset): the layers' and the decoder's."""
    return cfg.norm_eps if cfg.norm_eps is not None else 1e-5


def kv_heads(cfg: ModelConfig) -> int:
    """Key/value heads (`model.n_kv_heads`; every query head's own when unset)."""
    return cfg.n_kv_heads or cfg.n_heads


def _d_ff(cfg: ModelConfig) -> int:
    return cfg.d_ff or -(-8 * cfg.d_model // 3 // 64) * 64


def head_width(cfg: ModelConfig) -> int:
    """Each attention head's width: `model.head_dim` (Qwen3's is independent of the model width), else
    d_model / n_heads."""
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def frequencies(cfg: ModelConfig) -> jax.Array:
    """The rotary embedding's inverse frequencies [head_dim / 2] in float32, scaled as `model.rope_scaling`
    says, computed as transformers' rope initializers compute them (`default`, `linear`, `llama3`): a
    long-context checkpoint's positions rotate by the angles it was trained with."""
    hd = head_width(cfg)
    inv = 1.0 / cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    if cfg.rope_scaling == "linear":  # position interpolation: every position divided by the factor
        return inv / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        # Llama 3.1: wavelengths longer than original / low_freq_factor are interpolated by the factor,
        # shorter than original / high_freq_factor kept, and the band between blended smoothly.
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        original = float(cfg.rope_original_max_positions)
        wavelen = 2 * jnp.pi / inv
        scaled = jnp.where(wavelen > original / low, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) & ~(wavelen > original / low)
        return jnp.where(medium, blended, scaled)
    return inv


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x / rms(x) * (offset + scale), the statistics in float32. Gemma stores its scales around 0 and
    multiplies by 1 + scale (`model.norm_offset: 1`): kept as stored, a checkpoint exports bit for bit."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    if offset:  # Gemma's order: (1 + w) in float32 times the float32 normalized x, then cast
        return (y * (offset + scale.astype(jnp.float32))).astype(x.dtype)
    return scale * y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """x / rms(x) * (offset + scale), the statistics in float32 (`rms_norm`)."""

    def __init__(self, d: int, eps: float, offset: float = 0.0):
        self.scale = nnx.Param(jnp.full((d,), 1.0 - offset, jnp.float32))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.offset)


def norm(cfg: ModelConfig, d: int) -> RMSNorm:
    """The model's RMSNorm of width `d` (its eps and Gemma's offset)."""
    return RMSNorm(d, norm_eps(cfg), cfg.norm_offset)


def embed_tokens(cfg: ModelConfig, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """The embedding rows of `tokens` in the table's own dtype (`nnx.Embed` fixes its compute dtype when
    the model is built, float32, so under bf16 it would cast the table back and every layer after it would
    compute in float32), times sqrt(d_model) with `model.embed_scale` (Gemma's, the factor rounded to the
    table's dtype as transformers' Gemma does)."""
    x = jnp.take(table, tokens, axis=0)
    return x * jnp.asarray(cfg.d_model ** 0.5, x.dtype) if cfg.embed_scale else x


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping), or the logits unchanged."""
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def attn_scale(cfg: ModelConfig) -> float | None:
    """The scores' scale: `model.query_scale` ** -0.5 (Gemma's query_pre_attn_scalar), else None (1/sqrt(hd))."""
    return None if cfg.query_scale is None else float(cfg.query_scale) ** -0.5


_WHOLE = 2 ** 30  # a window no sequence reaches: the layer attends to the whole causal context


def layer_windows(cfg: ModelConfig) -> jax.Array | None:
    """Each layer's window [n_layers] int32 where the layers differ (`model.global_every`: Gemma's local
    and global layers alternate inside one scan), else None (every layer `model.sliding_window`)."""
    if cfg.sliding_window is None or cfg.global_every is None:
        return None
    return jnp.asarray([_WHOLE if (i + 1) % cfg.global_every == 0 else cfg.sliding_window
                        for i in range(cfg.n_layers)], jnp.int32)


def activation(cfg: ModelConfig) -> Callable[[jax.Array], jax.Array]:
    """The gated MLP's activation: SiLU (SwiGLU) or the tanh-approximated GELU (Gemma's GeGLU)."""
    return functools.partial(jax.nn.gelu, approximate=True) if cfg.mlp_activation == "gelu_tanh" else jax.nn.silu


def rotary(t: int, head_dim: int, theta: float, offset: Any = 0,
           inv_freq: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin [t, head_dim] of the rotary embedding (the two halves repeat the frequencies) for
    positions offset .. offset + t - 1 (a sequence chunk's global positions). `inv_freq`: scaled
    frequencies (`frequencies`); default: theta's unscaled ones."""
    if inv_freq is None:
        inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    positions = jnp.arange(t, dtype=jnp.float32) + jnp.asarray(offset, jnp.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def chunk_offset(t: int) -> Any:
    """The global position of this device's first token: under a `sequence` axis (inside `shard_map`) a
    device holds chunk axis_index of each row, t tokens long; 0 without one."""
    axis = sequence_axis()
    return 0 if axis is None else jax.lax.axis_index(axis) * t


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + head_dim/2) of `x` [b, t, heads, head_dim] by the position's angle."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def is_moe(cfg: ModelConfig) -> bool:
    """The config asks for mixture-of-experts layers (`model.n_experts` set and not 0)."""
    return bool(cfg.n_experts)


def moe_layer(cfg: ModelConfig, rngs: nnx.Rngs) -> MoE:
    """The MoE block of a layer, built from the `model.*` MoE keys (DeepSpeed's MoE arguments)."""
    return MoE(cfg.d_model, _d_ff(cfg), cfg.n_experts, k=cfg.experts_per_token,
               capacity_factor=cfg.capacity_factor, eval_capacity_factor=cfg.eval_capacity_factor,
               min_capacity=cfg.min_capacity, use_residual=cfg.use_residual,
               noisy_gate_policy=cfg.noisy_gate_policy, drop_tokens=cfg.drop_tokens, use_rts=cfg.use_rts,
               top2_2nd_expert_sampling=cfg.top2_2nd_expert_sampling, gating=cfg.gating,
               enable_expert_tensor_parallelism=cfg.expert_tensor_parallelism, init_std=cfg.init_std,
               out_init_std=cfg.init_std / (2 * cfg.n_layers) ** 0.5, rngs=rngs)


class Layer(nnx.Module):
    """Pre-norm decoder layer: grouped-query causal attention with rotary positions, then SwiGLU
    (or, with `moe=True`, a mixture of SwiGLU experts: see `MoELayer`). The families' options:
    `model.qkv_bias` (Qwen2: biased query, key and value projections), `model.qk_norm` (Qwen3: an
    RMSNorm over each head's queries and keys before the rotation), `model.head_dim`,
    `model.sliding_window` (Mistral: a query attends to the last `sliding_window` positions only)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        d, h, kv = cfg.d_model, cfg.n_heads, kv_heads(cfg)
        hd = head_width(cfg)
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)

        def linear(name: str, n_in: int, n_out: int, kernel_init: Callable = init, bias: bool = False) -> nnx.Linear:
            return lora.linear(cfg, name, n_in, n_out, use_bias=bias, kernel_init=kernel_init, rngs=rngs)

        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, hd
        self.attention_mode, self.attention_block = cfg.attention, cfg.attention_block
        self.sliding_window = cfg.sliding_window
        self.scale, self.softcap = attn_scale(cfg), cfg.attn_softcap
        self.act = activation(cfg)
        self.attn_norm = norm(cfg, d)
        self.q = linear("q", d, h * hd, bias=cfg.qkv_bias)
        self.k = linear("k", d, kv * hd, bias=cfg.qkv_bias)
        self.v = linear("v", d, kv * hd, bias=cfg.qkv_bias)
        self.o = linear("o", h * hd, d, out_init)
        if cfg.qk_norm:
            self.q_norm = norm(cfg, hd)
            self.k_norm = norm(cfg, hd)
        self.mlp_norm = norm(cfg, d)
        if cfg.post_norms:  # Gemma 2/3: the attention's and the MLP's outputs normed before the residual add
            self.post_attn_norm = norm(cfg, d)
            self.post_mlp_norm = norm(cfg, d)
        if moe:
            self.moe = moe_layer(cfg, rngs)
        else:
            self.gate = linear("gate", d, _d_ff(cfg))
            self.up = linear("up", d, _d_ff(cfg))
            self.down = linear("down", _d_ff(cfg), d, out_init)

    def attention(self, x: jax.Array, cos: jax.Array, sin: jax.Array, window: Any = None) -> jax.Array:
        """Causal attention of `x` [b, t, d]; under a `sequence` axis `x` is a chunk of each row and the
        heads meet the whole sequence through Ulysses' all-to-alls (zerojax.models.ulysses). `window`:
        this layer's (a traced scalar, `layer_windows`), else `model.sliding_window`."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        axis = sequence_axis()
        attend = causal_attention.attend(self.attention_mode, self.attention_block,
                                         self.sliding_window if window is None else window, self.scale, self.softcap)
        att = attend(q, k, v) if axis is None else ulysses.attention(attend, q, k, v, axis)
        return self.attn_out(att.reshape(b, t, self.n_heads * self.head_dim))

    def attn_out(self, att: jax.Array) -> jax.Array:
        """The output projection of the heads' attention [b, t, heads * hd] (Gemma's post-norm after it)."""
        out = self.o(att)
        return self.post_attn_norm(out) if hasattr(self, "post_attn_norm") else out

    def mlp_out(self, y: jax.Array) -> jax.Array:
        """The MLP block's output for the residual stream (Gemma's post-norm after it)."""
        return self.post_mlp_norm(y) if hasattr(self, "post_mlp_norm") else y

    def mlp(self, x: jax.Array) -> jax.Array:
        """The gated MLP of the residual stream `x`, normed in and (Gemma) out."""
        y = self.mlp_norm(x)
        return self.mlp_out(self.down(self.act(self.gate(y)) * self.up(y)))

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries [b, t, heads, hd], keys and values [b, t, kv_heads, hd] of the normed `x` [b, t, d],
        before the rotation (with `model.qk_norm` each head's queries and keys RMS-normed first); the
        training forward and the cached decoder (zerojax.models.decode) both take them from here."""
        b, t, _ = x.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q, k = self.q(x).reshape(b, t, h, hd), self.k(x).reshape(b, t, kv, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, self.v(x).reshape(b, t, kv, hd)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, window: Any = None) -> jax.Array:
        x = x + self.attention(self.attn_norm(x), cos, sin, window)
        return x + self.mlp(x)


class MoELayer(Layer):
    """The decoder layer with a mixture of experts for its MLP; returns (x, l_aux)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs, moe=True)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,  # type: ignore[override]
                 key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        x = x + self.attention(self.attn_norm(x), cos, sin)
        y, l_aux, _ = self.moe(self.mlp_norm(x), key)
        return x + self.mlp_out(y), l_aux


def _stack(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs, **vmap: Any) -> Any:
    """`n` modules made by `make`, stacked on a leading axis of every parameter."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, **vmap)
    def stacked(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return stacked(rngs)


class Llama(nnx.Module):
    """Token embedding, `n_layers` stacked decoder layers, final RMSNorm, LM head (or tied embedding)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.normal(cfg.init_std)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, rngs=rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(rngs: nnx.Rngs) -> Layer:
            return Layer(cfg, rngs=rngs)

        if not is_moe(cfg):
            self.layers = stacked(rngs)
        else:
            groups, every = cfg.n_layers // cfg.moe_every, cfg.moe_every
            if every > 1:
                self.dense_layers = _stack(lambda r: _stack(lambda q: Layer(cfg, rngs=q), every - 1, r), groups, rngs)
            # the expert weights' annotations ("expert", ...) gain the stacked axis's name
            self.layers = _stack(lambda r: MoELayer(cfg, rngs=r), groups, rngs,
                                 transform_metadata={nnx.PARTITION_NAME: "layers"})
            self.deterministic = False  # module.eval() sets it: no gate noise, no auxiliary loss
        self.norm = norm(cfg, cfg.d_model)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Float32 logits [batch, time, vocab] for `tokens` [batch, time]."""
        return self.forward(tokens)[0]

    def forward(self, tokens: jax.Array, key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(logits, l_aux): the logits and the MoE layers' summed load-balancing loss (0 for the dense
        model). `key` draws the gates' noise in training (none without it)."""
        cfg = self.cfg
        axis = sequence_axis()
        if axis is not None:  # `tokens` is chunk axis_index of each row (positions from chunk_offset)
            ulysses.check_heads(cfg.n_heads, kv_heads(cfg), jax.lax.axis_size(axis), ulysses.tensor_group_size())
        cos, sin = rotary(tokens.shape[1], head_width(cfg), cfg.rope_theta, chunk_offset(tokens.shape[1]),
                          frequencies(cfg))
        x = embed_tokens(cfg, self.embed.embedding[...], tokens)
        if is_moe(cfg):
            x, l_aux = self._moe_stack(x, cos, sin, key)
            return self._logits(x), l_aux
        windows = layer_windows(cfg)

        def body(layer: Layer, x: jax.Array, window: Any) -> jax.Array:
            return layer(x, cos, sin, window)

        if cfg.remat:
            body = nnx.remat(body)
        scan = nnx.scan(body, in_axes=(0, nnx.Carry, None if windows is None else 0), out_axes=nnx.Carry)
        x = scan(self.layers, x, windows)
        return self._logits(x), jnp.zeros((), jnp.float32)

    def _moe_stack(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                   key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """The groups of (moe_every - 1 dense layers, one MoE layer), scanned; l_aux summed over them."""
        cfg = self.cfg
        groups = cfg.n_layers // cfg.moe_every
        dense = getattr(self, "dense_layers", None)
        keys = None if key is None or self.deterministic else jax.random.split(key, groups)

        def dense_body(layer: Layer, x: jax.Array) -> jax.Array:
            return layer(x, cos, sin)

        def body(mods: tuple[Any, MoELayer], x: jax.Array, k: jax.Array | None) -> tuple[jax.Array, jax.Array]:
            dense_run, moe = mods
            if dense_run is not None:
                x = nnx.scan(dense_body, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(dense_run, x)
            return moe(x, cos, sin, k)

        if cfg.remat:
            body = nnx.remat(body)
        scan = nnx.scan(body, in_axes=(0, nnx.Carry, None if keys is None else 0), out_axes=(nnx.Carry, 0))
        x, l_aux = scan((dense, self.layers), x, keys)
        return x, jnp.sum(l_aux)

    def _logits(self, x: jax.Array) -> jax.Array:
        return head_logits(self.cfg, self.norm(x), self.embed.embedding[...],
                           None if self.cfg.tie_embeddings else self.head.kernel[...])


def head_logits(cfg: ModelConfig, x: jax.Array, embedding: jax.Array, head: jax.Array | None) -> jax.Array:
    """Float32 logits of the normed `x`: the head's, or the tied embedding's, soft-capped where asked."""
    if head is None:
        logits = jnp.einsum("btd,vd->btv", x, embedding.astype(x.dtype), preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("btd,dv->btv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)
    return softcap(logits, cfg.final_softcap)


def loss(model: Llama, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy; `batch["tokens"]` is [rows, seq_len + 1] int32, and an optional
    `batch["loss_mask"]` [rows, seq_len] drops predictions (e.g. across a document boundary). Under a
    sequence axis the step hands it `inputs` and `labels` chunks instead (zerojax.core.sequence)."""
    return next_token_loss(model(inputs(batch)), batch)


# ---------------------------------------------------------------------------------------------
# The same model as pipeline layers (train.py with mesh.stage > 1): embedding, decoder layers, head.

class Embedding(nnx.Module):
    """The token embedding: the first pipeline layer, reading the batch itself. A MoE model's stages pass
    (hidden states, summed load-balancing loss), so its embedding starts the sum at 0."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nnx.initializers.normal(cfg.init_std),
                               rngs=rngs)
        self.carries_aux = is_moe(cfg)
        self.cfg = cfg

    def __call__(self, batch: dict[str, jax.Array]) -> Any:
        # under a sequence axis, this device's chunk of each row
        x = embed_tokens(self.cfg, self.embed.embedding[...], inputs(batch))
        return (x, jnp.zeros((), jnp.float32)) if self.carries_aux else x


class PipelineLayer(Layer):
    """A decoder layer that makes its own rotary table (a stage passes only the hidden states, under a
    `sequence` axis a chunk of each row's: the table is then for the chunk's global positions). In a
    MoE model it passes the load-balancing loss beside the hidden states on unchanged."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        super().__init__(cfg, rngs=rngs, moe=moe)
        self.cfg = cfg

    def rotary(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rotary(x.shape[1], self.head_dim, self.cfg.rope_theta, chunk_offset(x.shape[1]),
                      frequencies(self.cfg))

    def __call__(self, x: Any) -> Any:  # type: ignore[override]
        if isinstance(x, tuple):
            h, aux = x
            return super().__call__(h, *self.rotary(h)), aux
        return super().__call__(x, *self.rotary(x))


class MoEPipelineLayer(PipelineLayer):
    """The MoE decoder layer as a pipeline layer: (hidden states, l_aux so far) -> the same with this
    layer's load-balancing loss added in training (none in evaluation, as `moe_loss`). `rng` draws the
    gate's noise (the pipeline hands every layer that takes one its key)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs, moe=True)

    def __call__(self, x: tuple[jax.Array, jax.Array], rng: jax.Array | None = None  # type: ignore[override]
                 ) -> tuple[jax.Array, jax.Array]:
        h, aux = x
        h = h + self.attention(self.attn_norm(h), *self.rotary(h))
        y, l_aux, _ = self.moe(self.mlp_norm(h), rng)
        return h + self.mlp_out(y), aux if self.moe.deterministic else aux + l_aux


class Head(nnx.Module):
    """Final RMSNorm and LM head: the last pipeline layer, giving float32 logits (and, in a MoE model, the
    summed load-balancing loss it received)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.norm = norm(cfg, cfg.d_model)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                               kernel_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.cfg = cfg

    def __call__(self, x: Any) -> Any:
        if isinstance(x, tuple):
            h, aux = x
            return self(h), aux
        return head_logits(self.cfg, self.norm(x), self.head.kernel[...], self.head.kernel[...])


def _is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    """Decoder layer i (from 0) is a MoE layer: every `moe_every`-th, counted from 1 (Megatron-DeepSpeed's)."""
    return is_moe(cfg) and (i + 1) % cfg.moe_every == 0


def pipeline_module(cfg: ModelConfig, partition_method: str = "parameters", num_stages: int | None = None) -> Any:
    """A PipelineModule of the Llama (untied head) with its loss; a MoE Llama's MoE layers are
    `MoEPipelineLayer`s and its loss adds `moe_aux_loss_coef` times the summed load-balancing loss."""
    from zerojax.pipeline import LayerSpec, PipelineModule
    if cfg.tie_embeddings:
        raise ValueError("llama.pipeline_module: tied embeddings are not pipelined; set model.tie_embeddings: false")
    if cfg.global_every is not None and cfg.sliding_window is not None:
        raise ValueError("llama.pipeline_module: alternating local and global layers (model.global_every, Gemma's) "
                         "are not pipelined; remove model.global_every or mesh.stage")
    method = "parameters" if partition_method == "best" else partition_method
    decoder = [LayerSpec(MoEPipelineLayer if _is_moe_layer(cfg, i) else PipelineLayer, cfg) for i in range(cfg.n_layers)]
    layers = [LayerSpec(Embedding, cfg), *decoder, LayerSpec(Head, cfg)]
    loss_fn = functools.partial(moe_pipeline_loss, cfg.moe_aux_loss_coef) if is_moe(cfg) else next_token_loss
    return PipelineModule(layers, num_stages=num_stages, loss_fn=loss_fn, partition_method=method)


def moe_pipeline_loss(coef: float, out: tuple[jax.Array, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """The MoE pipeline's loss: next-token cross-entropy plus `coef` times the layers' summed l_aux (0 in
    evaluation), as `moe_loss`."""
    logits, aux = out
    return next_token_loss(logits, batch) + coef * aux


def pipeline_params(cfg: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
    """`build`-shaped parameters (a dict of arrays) -> the pipeline module's logical parameters (a MoE
    Llama's groups of `moe_every - 1` dense layers and one MoE layer unstacked in layer order)."""
    width = max(2, len(str(cfg.n_layers + 1)))
    out = {f"layer_{0:0{width}d}": {"embed": params["embed"]}}
    for i in range(cfg.n_layers):
        if not is_moe(cfg):
            layer = jax.tree.map(lambda x, i=i: x[i], params["layers"])
        elif _is_moe_layer(cfg, i):
            layer = jax.tree.map(lambda x, g=i // cfg.moe_every: x[g], params["layers"])
        else:
            g, j = divmod(i, cfg.moe_every)
            layer = jax.tree.map(lambda x, g=g, j=j: x[g, j], params["dense_layers"])
        out[f"layer_{i + 1:0{width}d}"] = layer
    out[f"layer_{cfg.n_layers + 1:0{width}d}"] = {"norm": params["norm"], "head": params["head"]}
    return out


def moe_loss(model: Llama, batch: dict[str, jax.Array], rngs: nnx.Rngs) -> jax.Array:
    """`loss` plus `model.moe_aux_loss_coef` times the MoE layers' load-balancing loss, in training
    (as Megatron-DeepSpeed adds it); evaluation (`model.eval()`) reports the language-model loss alone."""
    if model.deterministic:
        return loss(model, batch)
    logits, l_aux = model.forward(inputs(batch), rngs())
    return next_token_loss(logits, batch) + model.cfg.moe_aux_loss_coef * l_aux


def constructor(cfg: ModelConfig, seed: int = 0) -> Callable[[], Llama]:
    """`() -> Llama`: what `zerojax.from_nnx` takes to build the model straight into its shards."""
    return lambda: Llama(cfg, rngs=nnx.Rngs(params=seed))


def build(cfg: ModelConfig, seed: int = 0) -> tuple[Any, Callable[[Any, Any], jax.Array]]:
    """(unbuilt params, loss_fn) through the public `zerojax.from_nnx`, as a user's model goes."""
    from zerojax.models.nnx import from_nnx
    return from_nnx(constructor(cfg, seed), moe_loss if is_moe(cfg) else loss)


def apply(cfg: ModelConfig, params: Any, tokens: jax.Array) -> jax.Array:
    """Logits of `tokens` under a params dict (e.g. `engine.params` or an imported checkpoint)."""
    from zerojax.models.nnx import to_nnx
    model = to_nnx(constructor(cfg), params)
    model.eval()  # a MoE gate at eval_capacity_factor, without noise; the dense model has no mode
    return model(tokens)
