"""The language-model loss the shipped models share: next-token cross-entropy over kept predictions."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from zerojax.core.mesh import sequence_axis


def masked_mean(losses: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """The mean of per-token `losses` over the predictions `batch["loss_mask"]` keeps (all without one).

    Under a `sequence` axis (Ulysses: `losses` and the mask are this device's chunk of each row) it is
    this device's share: sequence size x its chunk's kept losses / the kept predictions of the whole
    group's rows, so that the step's mean over the sequence devices is the mean over the full rows."""
    mask = batch.get("loss_mask") if isinstance(batch, dict) else None
    axis = sequence_axis()
    if axis is not None:
        n = jax.lax.axis_size(axis)
        if mask is None:
            return losses.mean()  # equal chunks: n x sum / (n x chunk size)
        mask = mask.astype(losses.dtype)
        count = jax.lax.psum(jax.lax.stop_gradient(mask.sum()), axis)
        return n * (losses * mask).sum() / jnp.maximum(count, 1.0)
    if mask is None:
        return losses.mean()
    mask = mask.astype(losses.dtype)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def inputs(batch: dict[str, jax.Array]) -> jax.Array:
    """The tokens a language model reads: `batch["inputs"]` where the step split the rows over a sequence
    axis (zerojax.core.sequence), else `batch["tokens"][:, :-1]`."""
    return batch["inputs"] if "inputs" in batch else batch["tokens"][:, :-1]


def labels(batch: dict[str, jax.Array]) -> jax.Array:
    """The tokens it predicts: `batch["labels"]`, else `batch["tokens"][:, 1:]`."""
    return batch["labels"] if "labels" in batch else batch["tokens"][:, 1:]


def next_token_loss(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean cross-entropy of `logits` [rows, seq_len, vocab] against `labels(batch)` (`tokens[:, 1:]`), over
    the predictions `batch["loss_mask"]` keeps (e.g. none across a document boundary)."""
    return masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels(batch)), batch)
