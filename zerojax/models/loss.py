"""The language-model loss the shipped models share: next-token cross-entropy over kept predictions."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def masked_mean(losses: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """The mean of per-token `losses` over the predictions `batch["loss_mask"]` keeps (all without one)."""
    mask = batch.get("loss_mask") if isinstance(batch, dict) else None
    if mask is None:
        return losses.mean()
    mask = mask.astype(losses.dtype)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def next_token_loss(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean cross-entropy of `logits` [rows, seq_len, vocab] against `batch["tokens"][:, 1:]`, over the
    predictions `batch["loss_mask"]` keeps (e.g. none across a document boundary)."""
    return masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]), batch)
