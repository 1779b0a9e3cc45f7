"""Dotted names of pytree leaves ("blocks.fc.kernel"): the same on every mesh, stage and pipeline
shape, so checkpoints and exports name arrays by what they are, not by where they were."""
from __future__ import annotations

from typing import Any, Sequence


def key_name(key: Any) -> str:
    """DictKey.key, GetAttrKey.name, SequenceKey.idx (FlattenedIndexKey.key) as text."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def join(*parts: str) -> str:
    """Non-empty parts joined with '.'."""
    return ".".join(p for p in parts if p != "")


def dotted(path: Sequence[Any], prefix: str = "") -> str:
    """The dotted name of one key path (as `jax.tree_util.tree_flatten_with_path` gives it)."""
    return join(prefix, *(key_name(k) for k in path))
