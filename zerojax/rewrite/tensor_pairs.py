"""Megatron's column -> row pairs read off an unannotated loss.

A kernel whose output reaches another kernel's contracted dimension only through ops that keep a
split (elementwise ops, reshapes, transposes, attention's per-head contractions) is a column ->
row pair: split the first by its output features and the second by its input features, and the
activations between them never need gathering.

The search is the tensor-parallel evaluator itself (`tensor_parallel.evaluate`), run on shapes only
with every weight whole. Where a contraction reads a whole weight, this group proposes a split:
a weight contracted against a split activation along that split is a row; a weight contracted
against a replicated activation is a column, split along its most major output dimension that the
tensor size divides.
Each split activation remembers the columns it came from (`Split.origin`); a column stays only if
its activations end in a row's contraction or a reduction over the split (a vocabulary-parallel head's
softmax), never in a gather (a rule that had to make them whole). Rejected columns are excluded and the search runs again until nothing changes.

Relies on: no mesh (shapes only, traced outside any `shard_map`); the tensor size only to choose a
dimension it divides.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from zerojax.rewrite.tensor_slices import Group, Split, evaluate


class _Search(Group):
    """A group that proposes splits for whole weights and records which proposals hold."""

    def __init__(self, axis: str, size: int, where: dict[int, tuple[Any, int, int]], rejected: set[int]):
        super().__init__(axis, size)
        self.where = where          # id(traced value) -> (value, leaf index, leading axes sliced off)
        self.rejected = rejected    # leaves no longer proposed as columns
        self.columns: dict[int, int] = {}
        self.rows: dict[int, tuple[int, frozenset]] = {}
        self.closed: set[int] = set()
        self.broken: set[int] = set()

    def _leaf(self, x: Any) -> tuple[int, int] | None:
        hit = self.where.get(id(x))
        return None if hit is None or hit[0] is not x else hit[1:]

    def follows(self, ins: list[Any]) -> bool:
        return any(self._leaf(x) is not None for x in ins)

    def inside(self, outer: Sequence[Any], inner: Sequence[Any]) -> None:
        for o, i in zip(outer, inner):
            hit = self._leaf(o)
            if hit is not None:
                sliced = jnp.ndim(i) == jnp.ndim(o) - 1
                self.where[id(i)] = (i, hit[0], hit[1] + sliced)

    def whole(self, x: Any) -> Any:
        if isinstance(x, Split):
            self.broken |= x.origin
        return super().whole(x)

    def _decided(self, x: Any) -> Any:
        """A weight already given a split is read split at every later use, as the real run reads it."""
        hit = self._leaf(x)
        if hit is None:
            return x
        leaf, off = hit
        if leaf in self.columns:
            d = self.columns[leaf] - off
            return Split(self.block(x, d), d, frozenset({leaf}))
        if leaf in self.rows:
            d = self.rows[leaf][0] - off
            return Split(self.block(x, d), d)
        return x

    def before(self, eqn: Any, ins: list[Any]) -> list[Any]:
        ins = [self._decided(x) for x in ins]
        if eqn.primitive.name != "dot_general" or len(ins) != 2:
            return ins
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        out = list(ins)
        for i, (contract, batch) in enumerate(((lc, lb), (rc, rb))):
            x, other = ins[i], ins[1 - i]
            hit = self._leaf(x)
            if hit is None:  # not a weight, or one already split (`_decided`)
                continue
            leaf = hit[0]
            other_contract = (rc, lc)[i]
            if isinstance(other, Split) and other.dim in other_contract:  # a row: its input features
                d = contract[other_contract.index(other.dim)]
                if x.shape[d] % self.size == 0:
                    self.rows[leaf] = (d + hit[1], other.origin)
                    out[i] = Split(self.block(x, d), d)
                continue
            free = [d for d in range(x.ndim) if d not in contract and d not in batch and x.shape[d] % self.size == 0]
            if not isinstance(other, Split) and self._leaf(other) is None and leaf not in self.rejected and free:
                d = free[0]  # the most major output dimension (heads, for a [features, heads, head_dim] kernel)
                self.columns[leaf] = d + hit[1]
                out[i] = Split(self.block(x, d), d, frozenset({leaf}))
        return out

    def after(self, eqn: Any, ins: list[Any], outs: list[Any]) -> list[Any]:
        origin = frozenset().union(*(x.origin for x in ins if isinstance(x, Split)))
        if origin and not any(isinstance(o, Split) for o in outs):
            self.closed |= origin  # contracted or reduced over the split (a gather also breaks it: `whole`)
        if len(ins) == 1 and len(outs) == 1 and eqn.primitive.name in ("convert_element_type", "copy"):
            hit = self._leaf(ins[0])
            if hit is not None:
                self.where[id(outs[0])] = (outs[0], *hit)
        for o in outs:
            if isinstance(o, Split) and origin and not o.origin:
                o.origin = origin
        return outs


def find_tensor_splits(loss_fn: Callable[..., Any], params: Any, *args: Any, size: int = 2,
                       axis: str = "tensor", **kwargs: Any) -> Any:
    """Per parameter leaf, the dimension a tensor axis of `size` devices should split (None: whole),
    derived from the loss: Megatron's column -> row pairs (see the module docstring).

    `params` and `args` may be arrays or `jax.ShapeDtypeStruct`s (only shapes are read), `args` the
    batch as the loss receives it. Pass the result as `zerojax.plan(..., tensor_dims=...)` or
    `zerojax.initialize(..., tensor_dims=...)`.
    """
    from zerojax.core.sharded_init import abstract_params
    leaves, tree = jax.tree.flatten(abstract_params(params))
    others, other_tree = jax.tree.flatten((args, kwargs))
    sds = [jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) for x in [*leaves, *others]]

    def flat_loss(*flat: Any) -> Any:
        a, kw = jax.tree.unflatten(other_tree, flat[len(leaves):])
        return loss_fn(jax.tree.unflatten(tree, flat[:len(leaves)]), *a, **kw)

    closed = jax.make_jaxpr(flat_loss)(*sds)
    rejected: set[int] = set()
    for _ in range(len(leaves) + 1):
        found: list[_Search] = []

        def search(*flat: Any) -> Any:
            where = {id(x): (x, i, 0) for i, x in enumerate(flat[:len(leaves)])}
            group = _Search(axis, size, where, rejected)
            found.append(group)
            outs = evaluate(closed.jaxpr, closed.consts, list(flat), group)
            return [group.whole(o) for o in outs]

        jax.make_jaxpr(search, axis_env=[(axis, size)])(*sds)
        group = found[-1]
        failed = {leaf for leaf in group.columns if leaf not in group.closed or leaf in group.broken}
        if not failed:
            break
        rejected |= failed
    assert not failed, "the search rejects at least one column per pass, so it ends within len(leaves) passes"
    keep = {**{leaf: d for leaf, (d, origin) in group.rows.items() if origin}, **group.columns}
    return jax.tree.unflatten(tree, [keep.get(i) for i in range(len(leaves))])
