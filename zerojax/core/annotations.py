"""The logical axis names a Flax NNX model annotated its parameters with (`nnx.with_partitioning`,
`sharding_names`): read once here, for `from_nnx`'s parameters and for a pipeline's layers alike, so
a name such as `expert` places a leaf wherever the model comes from."""
from __future__ import annotations

from typing import Any

import jax
from flax import nnx


def _names(variable: Any) -> tuple[Any, ...] | None:
    meta = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if names is None:
        return None
    return tuple(n if n is None or isinstance(n, str) else tuple(n) for n in names)


def logical_axes(param_state: Any) -> Any:
    """The names as a tree shaped like the params dict (`nnx.to_pure_dict`): a tuple per annotated
    leaf, None for the others; None when no leaf is annotated."""
    axes = jax.tree.map(_names, param_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    names = nnx.to_pure_dict(axes) if isinstance(axes, nnx.State) else axes
    annotated = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    return names if any(isinstance(x, tuple) for x in annotated) else None
