"""DeepSpeed-Ulysses sequence parallelism: how the step hands each device its chunk of every row.

With a `sequence` mesh axis (`mesh.sequence`, DeepSpeed's `sequence_parallel_size`) the batch's rows
are split over `data` as always, and each row's tokens over `sequence`. A batch dict holding
`tokens` [rows, seq_len + 1] is first turned into `inputs` (tokens[:, :-1]) and `labels`
(tokens[:, 1:]), each [rows, seq_len], so the next-token shift never crosses a chunk; then every
leaf with a second dimension (inputs, labels, loss_mask, anything else [rows, seq_len, ...]) is split
along it, and a leaf [rows] is whole on every device of a sequence group.

The loss on one device then sees chunk `axis_index("sequence")` of each of its rows: it must return
its share of the mean, `sequence_size x (its chunk's summed losses) / (the group's prediction count)`,
so that the mean over data x sequence devices - what the step averages - is the global mean loss
(`zerojax.models.loss.masked_mean` does this). Attention is the one place a token needs the others:
`zerojax.models.ulysses.attention`.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from zerojax.core.mesh import SEQUENCE, DataAxis


def split_tokens(batch: Any, sequence: int) -> Any:
    """The batch the step splits over `sequence`: `tokens` -> `inputs`, `labels`; each leaf's dimension 1
    must be a multiple of `sequence` (checked here, before anything compiles)."""
    if sequence == 1:
        return batch
    if isinstance(batch, dict) and "tokens" in batch:
        tokens = batch["tokens"]
        batch = {**{k: v for k, v in batch.items() if k != "tokens"},
                 "inputs": tokens[:, :-1], "labels": tokens[:, 1:]}
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        if x.ndim >= 2 and x.shape[1] % sequence:
            raise ValueError(f"batch{jax.tree_util.keystr(path)}: sequence length {x.shape[1]} is not a multiple of "
                             f"mesh.sequence {sequence} (sequence_parallel_size); every device of a sequence group "
                             f"takes an equal chunk of each row (tokens hold seq_len + 1 per row)")
    return batch


def batch_specs(batch: Any, rows: DataAxis, lead: int, sequence: int, micro: bool = False) -> Any:
    """Per leaf, its PartitionSpec: `lead` unsplit leading dimensions, the rows' dimension over `rows`
    (then, with `micro`, the rows within a micro-batch), and (with a sequence axis) the next dimension -
    the tokens - over `sequence`."""
    head = (*[None] * lead, rows, *((None,) if micro else ()))
    if sequence == 1:
        return P(*head)
    return jax.tree.map(lambda x: P(*head, *((SEQUENCE,) if x.ndim > len(head) else ())), batch)
