"""Build a model straight into its shards (DeepSpeed's `zero.Init`).

A model bigger than one device cannot be created whole and then split. `init_params(fn, ...)`
records the initializer and its output shapes (`jax.eval_shape`, nothing is computed); `plan`
reads the shapes, and `init_state` runs the initializer inside the same `jit` that creates the
train state, with every parameter constrained to its sharded placement as soon as it is made. The
partitioner then computes each device's block only (random initializers included: JAX's PRNG is
partitionable), so no device ever holds a whole parameter that the stage shards.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax


class ParamsInit:
    """Parameters not built yet: `fn()` makes them; `abstract` holds their shapes and dtypes."""

    def __init__(self, fn: Callable[[], Any], abstract: Any):
        self.fn, self.abstract = fn, abstract

    def __repr__(self) -> str:
        n = sum(int(x.size) for x in jax.tree.leaves(self.abstract))
        return f"ParamsInit({n:,} parameters in {len(jax.tree.leaves(self.abstract))} arrays)"


def init_params(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ParamsInit:
    """`fn(*args, **kwargs)` -> parameter pytree, to be run later under the plan's shardings.

    Pass the result wherever parameters go (`zerojax.plan`, `zerojax.init_state`,
    `zerojax.initialize(params=...)`). `fn` must be traceable (no host-side numpy randomness).
    """
    bound = functools.partial(fn, *args, **kwargs)
    return ParamsInit(bound, jax.eval_shape(bound))


def abstract_params(params: Any) -> Any:
    """Shapes of `params`, whether built (arrays) or not (`ParamsInit`)."""
    return params.abstract if isinstance(params, ParamsInit) else params


def build(params: Any, shardings: Any) -> Any:
    """Inside a traced function: the parameters, each constrained to `shardings` as it is made."""
    if not isinstance(params, ParamsInit):
        return params
    return jax.tree.map(jax.lax.with_sharding_constraint, params.fn(), shardings)
