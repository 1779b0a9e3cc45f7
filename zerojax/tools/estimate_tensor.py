"""Tensor-parallel accounting for `zerojax estimate` (docs/estimate.md, "Tensor parallelism").

Megatron-style slicing over a `tensor` mesh axis of size T, innermost (within a host), as zerojax's
planner slices the shipped models (`zerojax.planner.tensor`): each layer's query/key/value and
attention output projections, MLP projections and the vocabulary embedding / head are split T
ways; norms, positional embeddings and the biases of row-parallel layers stay whole on every
device, and so do the GPT's fused qkv projection and its attention output (their [q | k | v]
columns are not head-major). Key/value projections are split while T divides their heads and
kept whole otherwise. The functions here are pure arithmetic on shapes: what one device's
tensor slice holds, what activations it keeps, and what its all-reduces move.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

# Module names (the parent key of a kernel or bias) by how Megatron slices them. Covers the
# embedded GPT and Llama and the Hugging Face GPT-2 / Llama trees that `hf_model` builds.
COLUMN = frozenset({"q", "gate", "up", "fc", "c_fc"})                    # output dimension split
KV = frozenset({"k", "v"})                                               # output split by KV head
ROW = frozenset({"o", "down", "out", "mlp_proj"})                        # input dimension split
VOCAB_ROWS = frozenset({"embed", "wte"})                                 # [vocab, hidden] embedding
VOCAB_COLS = frozenset({"head", "lm_head"})                              # [hidden, vocab] head


@dataclasses.dataclass(frozen=True)
class Arch:
    """The sizes tensor slicing depends on, beyond parameter shapes."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated: bool               # Llama's gate/up MLP (three intermediate tensors live) vs GPT's fc


def invalid(arch: Arch, t: int) -> str | None:
    """Why `t` cannot slice this model (None: it can). Heads and the MLP width must divide; KV
    heads that do not are kept whole. The vocabulary is padded
    to a multiple of T, as Megatron pads it, so it never blocks a size."""
    if t < 1:
        return f"T={t} is not a size"
    if arch.heads % t:
        return f"{arch.heads} attention heads do not divide by T={t}"
    if arch.intermediate % t:
        return f"MLP width {arch.intermediate} does not divide by T={t}"
    return None


def local_kv_heads(arch: Arch, t: int) -> int:
    """KV heads one device holds: split while T divides them, else all of them (kept whole)."""
    return arch.kv_heads // t if arch.kv_heads % t == 0 else arch.kv_heads


def _name(key: Any) -> str:
    return str(getattr(key, "key", getattr(key, "name", key)))


def local_shape(shape: tuple[int, ...], parent: str, leaf: str, arch: Arch, t: int) -> tuple[int, ...]:
    """One device's slice of a parameter of `shape` held by module `parent` as `leaf`."""
    s = list(shape)
    if parent in COLUMN:
        s[-1] //= t
    elif parent in KV:
        s[-1] = s[-1] * local_kv_heads(arch, t) // arch.kv_heads
    elif parent in ROW and leaf == "kernel":
        s[-2] //= t
    elif parent in VOCAB_ROWS and leaf == "embedding":
        s[0] = -(-s[0] // t)
    elif parent in VOCAB_COLS and leaf == "kernel":
        s[-1] = -(-s[-1] // t)
    return tuple(s)


def shard_params(abstract_params: Any, arch: Arch, t: int) -> Any:
    """The abstract parameter tree of one device's tensor slice (same structure and dtypes)."""
    def one(path: tuple, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        names = [_name(k) for k in path]
        parent = names[-2] if len(names) > 1 else ""
        return jax.ShapeDtypeStruct(local_shape(tuple(x.shape), parent, names[-1], arch, t), x.dtype)
    return jax.tree_util.tree_map_with_path(one, abstract_params)


def local_params(abstract_params: Any, arch: Arch, t: int) -> int:
    """Parameters one device's tensor slice holds: the split part / T plus the replicated part."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shard_params(abstract_params, arch, t)))


def activation_bytes(arch: Arch, rows: int, seq: int, width: int, remat: bool, t: int) -> int:
    """Activations one device keeps for one micro-batch of `rows` x `seq` tokens.

    Per token of a block: 6 hidden-wide tensors on the residual stream and norm inputs, whole on
    every device (no sequence parallelism); q, k, v and the attention output, the MLP's
    intermediate tensors (2 for GPT's fc + GeLU, 3 for gate, up and their product) and the
    attention scores and probabilities (2 per head per key) divided over T. With `remat` only each
    block's input is kept, plus one block live in full during its backward; the fp32 logits and
    their gradient are vocabulary-parallel. At T=1 and GPT's shapes this is the trainer's
    pre-flight estimate (`zerojax.runtime.preflight.activation_bytes`)."""
    tokens = rows * seq
    attn = 2 * arch.heads * arch.head_dim // t + 2 * local_kv_heads(arch, t) * arch.head_dim
    mlp = (3 if arch.gated else 2) * arch.intermediate // t
    scores = 2 * arch.heads * seq // t
    block = tokens * (6 * arch.hidden + attn + mlp + scores) * width
    kept = arch.layers * (tokens * arch.hidden * width if remat else block)
    return kept + block + tokens * -(-arch.vocab // t) * 4 * 2


def all_reduces(layers: int, remat: bool) -> int:
    """Megatron's activation all-reduces per micro-batch: 2 per block forward (after attention and
    after the MLP), 2 backward (the gradients of their column-parallel inputs), 2 more in the
    recomputed forward with activation checkpointing, and 2 for the vocabulary-parallel embedding
    (forward) and head (backward)."""
    return layers * (6 if remat else 4) + 2


def tensor_comm_bytes(arch: Arch, rows: int, seq: int, width: int, remat: bool, t: int,
                      micro_steps: int = 1) -> float:
    """Bytes one device sends per optimizer step over its tensor group: each all-reduce of a
    [rows, seq, hidden] activation moves 2(T-1)/T of it (ring)."""
    payload = rows * seq * arch.hidden * width
    return micro_steps * all_reduces(arch.layers, remat) * 2 * (t - 1) / t * payload
