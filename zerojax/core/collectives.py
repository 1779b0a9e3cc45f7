"""The few collectives a ZeRO step needs, as moves between placements over the `data` axis.

Everything here runs inside `jax.shard_map` over the data axis. A gradient (or any array) is in one
of three placements:

* `PARTIAL`     every device holds a full-size array; the true value is the *sum* over devices
                (a gradient computed from the device's own rows).
* `REPLICATED`  every device holds the same full-size array (the reduced value).
* `Shard(dim)`  device i holds block i of the reduced value along `dim`.
* `PartialShard(dim, axis)`  block i over `axis` only, still a sum over the data axis's other axes
                (ZeRO++ hpZ's gradients after the within-host reduce-scatter).

A ZeRO stage is then just a choice of placements per leaf (see layout.py), and `move` turns one
placement into another with the cheapest collective: PARTIAL -> Shard is a reduce-scatter (Ψ bytes),
PARTIAL -> REPLICATED an all-reduce (2Ψ), Shard -> REPLICATED an all-gather (Ψ).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp

from zerojax.core import quantize
from zerojax.core.mesh import DataAxis, data_axis


class _Partial:
    """Singleton placement; compares by identity."""

    def __repr__(self) -> str:
        return "PARTIAL"


class _Replicated:
    """Singleton placement; compares by identity."""

    def __repr__(self) -> str:
        return "REPLICATED"


class Shard(NamedTuple):
    """Block-sharded over the data axis along `dim` (a non-negative dimension index).

    `axis`: the mesh axis, or axes (major first), the block is split over; None is the whole data
    axis. ZeRO++'s hpZ places its parameters' secondary copy over the group's axes inside one host only
    (`Shard(dim, "data_inner")`, or `("data_inner", "expert", "sequence")` on a mesh with those axes;
    replicated over the outer one) and the primary partition inner-major (`Shard(dim, ("data_inner",
    "data_outer"))`, `("data_inner", "expert", "sequence", "data_outer")`), so a gather over the outer
    axis turns one into the other.
    """
    dim: int
    axis: Any = None


class PartialShard(NamedTuple):
    """Block `axis` of a value that is still a sum over the data axis's other axes: the gradient of a
    parameter gathered within a host only (hpZ) leaves the backward pass reduce-scattered over those
    axes; a reduce-scatter over the rest (`data_outer`) finishes it."""
    dim: int
    axis: Any


PARTIAL = _Partial()
REPLICATED = _Replicated()
Placement = Union[_Partial, _Replicated, Shard, PartialShard]


def _axes(axis: DataAxis) -> tuple:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _rest(whole: DataAxis, part: DataAxis) -> DataAxis:
    """The axes of `whole` after its leading `part` (a Shard over `whole` refines one over `part`)."""
    w, p = _axes(whole), _axes(part)
    if w[:len(p)] != p or len(w) == len(p):
        raise ValueError(f"no move between shards over {w} and {p}: the second must lead the first")
    rest = w[len(p):]
    return rest[0] if len(rest) == 1 else rest


def _times(y: jax.Array, factor: float) -> jax.Array:
    """`y * factor` computed in fp32 and rounded once to y's dtype (how torch applies a Python
    scalar to a half-precision tensor); exactly `y` when the factor is 1."""
    if factor == 1.0:
        return y
    return (y.astype(jnp.float32) * factor).astype(y.dtype)


def move(x: jax.Array, src: Placement, dst: Placement, *, comm_dtype: Any = None,
         axis: DataAxis | None = None, pre: float = 1.0, post: float = 1.0, quantized: bool = False) -> jax.Array:
    """Change `x`'s placement; `comm_dtype` casts the payload of reductions (then casts back).

    `axis`: the mesh's data axis by default (`zerojax.core.mesh.data_axis`). A reduction (from PARTIAL)
    multiplies its payload by `pre` before the sum and by `post` after it, both in the communication
    dtype: DeepSpeed's gradient averaging around its all-reduce / reduce-scatter
    (`prescale_gradients`, `gradient_predivide_factor`), where the order decides whether a
    half-precision sum overflows.
    `quantized`: the reduce-scatter that finishes a `PartialShard` (hpZ's cross-host one) is ZeRO++
    qgZ's int4 all-to-all (`zerojax.core.quantize.reduce_scatter`).
    """
    if src == dst:
        return x
    axis = data_axis() if axis is None else axis
    if isinstance(dst, Shard) and dst.axis is not None:
        if isinstance(src, PartialShard) and src.dim == dst.dim:
            # the rest of the reduction: a reduce-scatter over the axes src is not split over yet
            y = x.astype(comm_dtype) if comm_dtype is not None else x
            rest = _rest(dst.axis, src.axis)
            if quantized:
                y = quantize.reduce_scatter(_times(y, pre), rest, dst.dim)
            else:
                y = jax.lax.psum_scatter(_times(y, pre), rest, scatter_dimension=dst.dim, tiled=True)
            return _times(y, post).astype(x.dtype)
        if isinstance(src, Shard) and src.dim == dst.dim:
            # a finer shard to a coarser one (hpZ's secondary copy): all-gather over the axes dropped
            return jax.lax.all_gather(x, _rest(src.axis or axis, dst.axis), axis=src.dim, tiled=True,
                                      to="invarying")
        axis = dst.axis
    elif isinstance(src, Shard) and src.axis is not None:
        axis = src.axis
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


class Wire(NamedTuple):
    """How a stage-3 parameter travels between its shard and its whole value.

    axis: the mesh axis (or axes) it is gathered over; None is the data axis (hpZ: the inner one).
    quantize_weights: the gather sends int8 blocks with scales (ZeRO++ qwZ, `zerojax.core.quantize`).
    quantize_gradients: the gather's transpose, the gradient reduce-scatter, is a quantized
    all-to-all (ZeRO++ qgZ) instead of a reduce-scatter in the gradient's dtype.
    """
    axis: Any = None
    quantize_weights: bool = False
    quantize_gradients: bool = False


PLAIN = Wire()


def _gather_plain(x: jax.Array, axis: DataAxis, dim: int) -> jax.Array:
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def gather_shard(x: jax.Array, dim: int, wire: Wire = PLAIN) -> jax.Array:
    """All-gather a local shard (sharded along non-negative `dim`) into the whole value, as `wire` says.

    The transpose is a reduce-scatter of the cotangent over the same axis: gradients leave the
    gather reduced and sharded (quantized when `wire.quantize_gradients`).
    """
    axis = data_axis() if wire.axis is None else wire.axis
    if not (wire.quantize_weights or wire.quantize_gradients):
        return _gather_plain(x, axis, dim)

    def forward(v: jax.Array) -> jax.Array:
        return quantize.all_gather(v, axis, dim) if wire.quantize_weights else _gather_plain(v, axis, dim)

    @jax.custom_vjp
    def gathered(v: jax.Array) -> jax.Array:
        return forward(v)

    def fwd(v: jax.Array) -> tuple[jax.Array, None]:
        return forward(v), None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:
        return (reduce_scatter_shard(ct, dim, wire),)

    gathered.defvjp(fwd, bwd)
    return gathered(x)


def reduce_scatter_shard(g: jax.Array, dim: int, wire: Wire = PLAIN) -> jax.Array:
    """The sum over `wire`'s axis of `g`, block i along `dim` on device i (the gather's transpose)."""
    axis = data_axis() if wire.axis is None else wire.axis
    if wire.quantize_gradients:
        return quantize.reduce_scatter(g, axis, dim)
    return jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)


@jax.tree_util.register_pytree_node_class
class ParamShard:
    """A parameter's local block inside a ZeRO-3 step, to be gathered where it is used.

    `dim` counts from the end (negative), so slicing leading axes - as `lax.scan` over stacked
    layers does - keeps it valid. Models call `gather` on a layer's parameters inside the scanned
    (and rematerialized) body, so only one layer is ever whole on a device. `on_host`: the block
    is stored in host memory (parameter offload) and `gather` brings it to the device first.
    `wire`: the axis the gather runs over and whether it is quantized (ZeRO++). `read`: the block is
    in files (`offload_param.device: nvme`, read at use): `value` is a zero placeholder of its shape
    and `read(value, layer)` returns layer `layer`'s block (the whole block for None) from the files,
    its cotangent flowing to `value` (the evaluator `rewrite.gather_at_use` calls it).
    """

    def __init__(self, value: jax.Array, dim: int, on_host: bool = False, wire: Wire = PLAIN,
                 read: Any = None):
        self.value, self.dim, self.on_host, self.wire, self.read = value, dim, on_host, wire, read

    def tree_flatten(self) -> tuple[tuple[jax.Array], tuple[Any, ...]]:
        return (self.value,), (self.dim, self.on_host, self.wire, self.read)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[jax.Array]) -> "ParamShard":
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        return f"ParamShard(shape={getattr(self.value, 'shape', None)}, dim={self.dim}, on_host={self.on_host})"


def _is_shard(x: Any) -> bool:
    return isinstance(x, ParamShard)


def gather(tree: Any, axis: DataAxis | None = None) -> Any:
    """All-gather every `ParamShard` in `tree` into a whole array; other leaves pass through.

    Outside a ZeRO-3 step the tree holds no `ParamShard`, so models can call this unconditionally.
    Its transpose is a reduce-scatter: gradients of gathered parameters come back reduced and
    sharded, which is exactly the ZeRO-3 gradient placement. Each shard is gathered as its `wire`
    says (`axis`, when given, overrides the wire's axis).
    """

    def one(x: Any) -> Any:
        if not _is_shard(x):
            return x
        value = jax.device_put(x.value, jax.memory.Space.Device) if x.on_host else x.value
        wire = x.wire if axis is None else x.wire._replace(axis=axis)
        return gather_shard(value, value.ndim + x.dim, wire)

    return jax.tree.map(one, tree, is_leaf=_is_shard)


def unwrap(tree: Any) -> Any:
    """Replace every `ParamShard` by its local block."""
    return jax.tree.map(lambda x: x.value if _is_shard(x) else x, tree, is_leaf=_is_shard)


def to_varying(x: jax.Array, axis: DataAxis | None = None) -> jax.Array:
    """Mark a replicated input as per-device, so its gradient stays PARTIAL.

    Without this, shard_map's autodiff sums the gradient of a replicated input over the axis by
    itself, and a reduction of our own would count it N times. Axes over which `x` already varies
    (hpZ: a parameter gathered over the inner axis varies over it) are left as they are.
    """
    axes = _axes(data_axis() if axis is None else axis)
    try:
        return jax.lax.pcast(x, axes if len(axes) > 1 else axes[0], to="varying")
    except ValueError:
        if len(axes) == 1:
            return x  # varies over it already
    for a in axes:
        try:
            x = jax.lax.pcast(x, a, to="varying")
        except ValueError:
            pass  # varies over `a` already
    return x


def zeros_like_local(shape: tuple[int, ...], dtype: Any, placement: Placement, n: int) -> jax.Array:
    """Zeros of the local (per-device) shape of an array of global `shape` in `placement`."""
    if isinstance(placement, Shard):
        shape = tuple(s // n if i == placement.dim else s for i, s in enumerate(shape))
    return jnp.zeros(shape, dtype)


def gathers_params(loss_fn: Any) -> Any:
    """Mark a loss function that calls `gather` itself, layer by layer (see `ParamShard`).

    An expert option: unmarked loss functions are evaluated with each sharded parameter gathered
    where it is used (`zerojax.rewrite.gather_at_use`), which already keeps one layer of a scanned stack
    whole at a time. A marked loss places its gathers itself.
    """
    loss_fn.__zerojax_gathers__ = True
    return loss_fn


def is_gathering(loss_fn: Any) -> bool:
    return bool(getattr(loss_fn, "__zerojax_gathers__", False))
