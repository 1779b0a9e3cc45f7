"""The few collectives a ZeRO step needs, as moves between placements over the `data` axis.

Everything here runs inside `jax.shard_map` over the data axis. A gradient (or any array) is in one
of three placements:

* `PARTIAL`     every device holds a full-size array; the true value is the *sum* over devices
                (a gradient computed from the device's own rows).
* `REPLICATED`  every device holds the same full-size array (the reduced value).
* `Shard(dim)`  device i holds block i of the reduced value along `dim`.

A ZeRO stage is then just a choice of placements per leaf (see layout.py), and `move` turns one
placement into another with the cheapest collective: PARTIAL -> Shard is a reduce-scatter (Ψ bytes),
PARTIAL -> REPLICATED an all-reduce (2Ψ), Shard -> REPLICATED an all-gather (Ψ).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp

from zerojax.mesh import DataAxis, data_axis


class _Partial:
    """Singleton placement; compares by identity."""

    def __repr__(self) -> str:
        return "PARTIAL"


class _Replicated:
    """Singleton placement; compares by identity."""

    def __repr__(self) -> str:
        return "REPLICATED"


class Shard(NamedTuple):
    """Block-sharded over the data axis along `dim` (a non-negative dimension index)."""
    dim: int


PARTIAL = _Partial()
REPLICATED = _Replicated()
Placement = Union[_Partial, _Replicated, Shard]


def _times(y: jax.Array, factor: float) -> jax.Array:
    """`y * factor` computed in fp32 and rounded once to y's dtype (how torch applies a Python
    scalar to a half-precision tensor); exactly `y` when the factor is 1."""
    if factor == 1.0:
        return y
    return (y.astype(jnp.float32) * factor).astype(y.dtype)


def move(x: jax.Array, src: Placement, dst: Placement, *, comm_dtype: Any = None,
         axis: DataAxis | None = None, pre: float = 1.0, post: float = 1.0) -> jax.Array:
    """Change `x`'s placement; `comm_dtype` casts the payload of reductions (then casts back).

    `axis`: the mesh's data axis by default (`zerojax.mesh.data_axis`). A reduction (from PARTIAL)
    multiplies its payload by `pre` before the sum and by `post` after it, both in the communication
    dtype: DeepSpeed's gradient averaging around its all-reduce / reduce-scatter
    (`prescale_gradients`, `gradient_predivide_factor`), where the order decides whether a
    half-precision sum overflows.
    """
    if src == dst:
        return x
    axis = data_axis() if axis is None else axis
    if src == PARTIAL:
        dtype = x.dtype
        y = x.astype(comm_dtype) if comm_dtype is not None else x
        y = _times(y, pre)
        if dst == REPLICATED:
            y = jax.lax.psum(y, axis)  # invariant: every device now holds the sum
        else:
            # invariant: device i holds block i of the sum along dst.dim (a reduce-scatter)
            y = jax.lax.psum_scatter(y, axis, scatter_dimension=dst.dim, tiled=True)
        return _times(y, post).astype(dtype)
    if src == REPLICATED and isinstance(dst, Shard):
        n = jax.lax.axis_size(axis)
        size = x.shape[dst.dim] // n
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * size, size, dst.dim)
    if isinstance(src, Shard) and dst == REPLICATED:
        # invariant: every device holds the whole value, typed as replicated (not per-device)
        return jax.lax.all_gather(x, axis, axis=src.dim, tiled=True, to="invarying")
    raise ValueError(f"no move from {src} to {dst}")


@jax.tree_util.register_pytree_node_class
class ParamShard:
    """A parameter's local block inside a ZeRO-3 step, to be gathered where it is used.

    `dim` counts from the end (negative), so slicing leading axes - as `lax.scan` over stacked
    layers does - keeps it valid. Models call `gather` on a layer's parameters inside the scanned
    (and rematerialized) body, so only one layer is ever whole on a device. `on_host`: the block
    is stored in host memory (parameter offload) and `gather` brings it to the device first.
    """

    def __init__(self, value: jax.Array, dim: int, on_host: bool = False):
        self.value, self.dim, self.on_host = value, dim, on_host

    def tree_flatten(self) -> tuple[tuple[jax.Array], tuple[int, bool]]:
        return (self.value,), (self.dim, self.on_host)

    @classmethod
    def tree_unflatten(cls, aux: tuple[int, bool], children: tuple[jax.Array]) -> "ParamShard":
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        return f"ParamShard(shape={getattr(self.value, 'shape', None)}, dim={self.dim}, on_host={self.on_host})"


def _is_shard(x: Any) -> bool:
    return isinstance(x, ParamShard)


def gather(tree: Any, axis: DataAxis | None = None) -> Any:
    """All-gather every `ParamShard` in `tree` into a whole array; other leaves pass through.

    Outside a ZeRO-3 step the tree holds no `ParamShard`, so models can call this unconditionally.
    Its transpose is a reduce-scatter: gradients of gathered parameters come back reduced and
    sharded, which is exactly the ZeRO-3 gradient placement.
    """
    axis = data_axis() if axis is None else axis

    def one(x: Any) -> Any:
        if not _is_shard(x):
            return x
        value = jax.device_put(x.value, jax.memory.Space.Device) if x.on_host else x.value
        return jax.lax.all_gather(value, axis, axis=value.ndim + x.dim, tiled=True)

    return jax.tree.map(one, tree, is_leaf=_is_shard)


def unwrap(tree: Any) -> Any:
    """Replace every `ParamShard` by its local block."""
    return jax.tree.map(lambda x: x.value if _is_shard(x) else x, tree, is_leaf=_is_shard)


def to_varying(x: jax.Array, axis: DataAxis | None = None) -> jax.Array:
    """Mark a replicated input as per-device, so its gradient stays PARTIAL.

    Without this, shard_map's autodiff sums the gradient of a replicated input over the axis by
    itself, and a reduction of our own would count it N times.
    """
    return jax.lax.pcast(x, data_axis() if axis is None else axis, to="varying")


def zeros_like_local(shape: tuple[int, ...], dtype: Any, placement: Placement, n: int) -> jax.Array:
    """Zeros of the local (per-device) shape of an array of global `shape` in `placement`."""
    if isinstance(placement, Shard):
        shape = tuple(s // n if i == placement.dim else s for i, s in enumerate(shape))
    return jnp.zeros(shape, dtype)


def gathers_params(loss_fn: Any) -> Any:
    """Mark a loss function that calls `gather` itself, layer by layer (see `ParamShard`).

    An expert option: unmarked loss functions are evaluated with each sharded parameter gathered
    where it is used (`zerojax.gather_at_use`), which already keeps one layer of a scanned stack
    whole at a time. A marked loss places its gathers itself.
    """
    loss_fn.__zerojax_gathers__ = True
    return loss_fn


def is_gathering(loss_fn: Any) -> bool:
    return bool(getattr(loss_fn, "__zerojax_gathers__", False))
