"""A Llama-family decoder in Flax NNX: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

Written as a user writes an NNX model, and trained through the same public path a user's model
takes (`zerojax.from_nnx(constructor, loss)`): the layers are created with `nnx.vmap` (one leading
layer axis per parameter) and applied with `nnx.scan` over an `nnx.remat` body. Nothing in it
knows about ZeRO: under stage 3 the step gathers each parameter where the traced loss uses it
(zerojax.core.gather_at_use), which for the scanned stack means one layer per scan iteration, forward
and again in the rematerialized backward pass.

The maths follows Hugging Face transformers' `LlamaForCausalLM` (rotate-half rotary embeddings,
RMSNorm scaling the input-dtype normalized activations), so its checkpoints load unchanged
(zerojax.models.hf). Kernels are stored [in, out], as `nnx.Linear` keeps them.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.config import ModelConfig
from zerojax.models.loss import next_token_loss


def _eps(cfg: ModelConfig) -> float:
    return cfg.norm_eps if cfg.norm_eps is not None else 1e-5


def _kv_heads(cfg: ModelConfig) -> int:
    return cfg.n_kv_heads or cfg.n_heads


def _d_ff(cfg: ModelConfig) -> int:
    return cfg.d_ff or -(-8 * cfg.d_model // 3 // 64) * 64


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, the statistics in float32."""

    def __init__(self, d: int, eps: float):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * y.astype(x.dtype)


def rotary(t: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin [t, head_dim] of the rotary embedding (the two halves repeat the frequencies)."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + head_dim/2) of `x` [b, t, heads, head_dim] by the position's angle."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class Layer(nnx.Module):
    """Pre-norm decoder layer: grouped-query causal attention with rotary positions, then SwiGLU."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, kv = cfg.d_model, cfg.n_heads, _kv_heads(cfg)
        hd = d // h
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)

        def linear(n_in: int, n_out: int, kernel_init: Callable = init) -> nnx.Linear:
            return nnx.Linear(n_in, n_out, use_bias=False, kernel_init=kernel_init, rngs=rngs)

        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, hd
        self.attn_norm = RMSNorm(d, _eps(cfg))
        self.q = linear(d, h * hd)
        self.k = linear(d, kv * hd)
        self.v = linear(d, kv * hd)
        self.o = linear(h * hd, d, out_init)
        self.mlp_norm = RMSNorm(d, _eps(cfg))
        self.gate = linear(d, _d_ff(cfg))
        self.up = linear(d, _d_ff(cfg))
        self.down = linear(_d_ff(cfg), d, out_init)

    def attention(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = _rotate(self.q(x).reshape(b, t, h, hd), cos, sin)
        k = _rotate(self.k(x).reshape(b, t, kv, hd), cos, sin)
        v = self.v(x).reshape(b, t, kv, hd)
        q = q.reshape(b, t, kv, h // kv, hd)  # query heads grouped under the key/value head they share
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
        scores = scores / jnp.sqrt(jnp.float32(hd))
        mask = jnp.tril(jnp.ones((t, t), jnp.bool_))
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(x.dtype)
        att = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, t, h * hd)
        return self.o(att)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attention(self.attn_norm(x), cos, sin)
        y = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(y)) * self.up(y))


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

        self.layers = stacked(rngs)
        self.norm = RMSNorm(cfg.d_model, _eps(cfg))
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Float32 logits [batch, time, vocab] for `tokens` [batch, time]."""
        cfg = self.cfg
        cos, sin = rotary(tokens.shape[1], cfg.d_model // cfg.n_heads, cfg.rope_theta)
        x = self.embed(tokens)

        def body(layer: Layer, x: jax.Array) -> jax.Array:
            return layer(x, cos, sin)

        if cfg.remat:
            body = nnx.remat(body)
        x = nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.layers, x)
        x = self.norm(x)
        if cfg.tie_embeddings:
            w = self.embed.embedding[...]
            return jnp.einsum("btd,vd->btv", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
        return jnp.einsum("btd,dv->btv", x, self.head.kernel[...].astype(x.dtype),
                          preferred_element_type=jnp.float32)


def loss(model: Llama, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy; `batch["tokens"]` is [rows, seq_len + 1] int32, and an optional
    `batch["loss_mask"]` [rows, seq_len] drops predictions (e.g. across a document boundary)."""
    return next_token_loss(model(batch["tokens"][:, :-1]), batch)


# ---------------------------------------------------------------------------------------------
# The same model as pipeline layers (train.py with mesh.stage > 1): embedding, decoder layers, head.

class Embedding(nnx.Module):
    """The token embedding: the first pipeline layer, reading the batch itself."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nnx.initializers.normal(cfg.init_std),
                               rngs=rngs)

    def __call__(self, batch: dict[str, jax.Array]) -> jax.Array:
        return self.embed(batch["tokens"][:, :-1])


class PipelineLayer(Layer):
    """A decoder layer that makes its own rotary table (a stage passes only the hidden states)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.theta = cfg.rope_theta

    def __call__(self, x: jax.Array) -> jax.Array:  # type: ignore[override]
        cos, sin = rotary(x.shape[1], self.head_dim, self.theta)
        return super().__call__(x, cos, sin)


class Head(nnx.Module):
    """Final RMSNorm and LM head: the last pipeline layer, giving float32 logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.d_model, _eps(cfg))
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                               kernel_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm(x)
        return jnp.einsum("btd,dv->btv", x, self.head.kernel[...].astype(x.dtype), preferred_element_type=jnp.float32)


def pipeline_module(cfg: ModelConfig, partition_method: str = "parameters", num_stages: int | None = None) -> Any:
    """A PipelineModule of the Llama (untied head) with its loss."""
    from zerojax.pipeline import LayerSpec, PipelineModule
    if cfg.tie_embeddings:
        raise ValueError("llama.pipeline_module: tied embeddings are not pipelined; set model.tie_embeddings: false")
    method = "parameters" if partition_method == "best" else partition_method
    layers = [LayerSpec(Embedding, cfg), *[LayerSpec(PipelineLayer, cfg) for _ in range(cfg.n_layers)],
              LayerSpec(Head, cfg)]
    return PipelineModule(layers, num_stages=num_stages, loss_fn=next_token_loss, partition_method=method)


def pipeline_params(cfg: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
    """`build`-shaped parameters (a dict of arrays) -> the pipeline module's logical parameters."""
    width = max(2, len(str(cfg.n_layers + 1)))
    out = {f"layer_{0:0{width}d}": {"embed": params["embed"]}}
    for i in range(cfg.n_layers):
        out[f"layer_{i + 1:0{width}d}"] = jax.tree.map(lambda x, i=i: x[i], params["layers"])
    out[f"layer_{cfg.n_layers + 1:0{width}d}"] = {"norm": params["norm"], "head": params["head"]}
    return out


def constructor(cfg: ModelConfig, seed: int = 0) -> Callable[[], Llama]:
    """`() -> Llama`: what `zerojax.from_nnx` takes to build the model straight into its shards."""
    return lambda: Llama(cfg, rngs=nnx.Rngs(params=seed))


def build(cfg: ModelConfig, seed: int = 0) -> tuple[Any, Callable[[Any, Any], jax.Array]]:
    """(unbuilt params, loss_fn) through the public `zerojax.from_nnx`, as a user's model goes."""
    from zerojax.models.nnx import from_nnx
    return from_nnx(constructor(cfg, seed), loss)


def apply(cfg: ModelConfig, params: Any, tokens: jax.Array) -> jax.Array:
    """Logits of `tokens` under a params dict (e.g. `engine.params` or an imported checkpoint)."""
    from zerojax.models.nnx import to_nnx
    return to_nnx(constructor(cfg), params)(tokens)
