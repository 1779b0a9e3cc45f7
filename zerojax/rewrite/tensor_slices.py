"""Tensor slicing (Megatron-LM) for any loss: its jaxpr re-run on each device's slice of the weights.

The plan splits some weights over the `tensor` mesh axis: a column-parallel kernel along its output
dimension, a row-parallel one along its input, a vocabulary-parallel embedding along its rows. This
module traces the user's loss once with whole weights and evaluates that jaxpr inside the step's
`shard_map` on each device's slices, keeping every activation in one of two forms:

* replicated: every device of a tensor group holds the same whole value;
* `Split(local, dim)`: the value is the concatenation of the group's `local` blocks along `dim`.

Each equation runs on local blocks when its inputs' forms allow (a column kernel makes a split
activation, elementwise ops, reshapes, transposes and attention's batched contractions keep it split),
and the forms only change through four collectives, each a custom VJP so that the backward pass is
Megatron's and not the transpose rules' (Shoeybi et al. 2019, section 3):

    enter  (Megatron's f): identity forward, all-reduce of the cotangent backward. A replicated value
           that a device uses for its slice only gets a partial cotangent there.
    reduce (Megatron's g): all-reduce forward, identity backward. A contraction over a split
           dimension leaves partial sums.
    whole:  all-gather forward, each device's block of the (replicated) cotangent backward.
    block:  each device's block forward, all-gather of the cotangents backward.

Invariant: a replicated value is bit-identical across the tensor group and so is its cotangent, so
gradients of replicated weights need no reduction over `tensor`; a split weight's gradient is
exactly its slice of the whole gradient. Any equation without a rule gathers its split inputs and
runs as written (correct, and slower): `fallbacks` counts those, so a plan can say where they are.
A custom JVP keeps its rule either way (`_custom_jvp`): it is never differentiated through its body.
A column -> row pair per block then costs one all-reduce forward and one backward, as Megatron's.

A model may also leave layout hints in its loss (`split_hint`, `whole_hint`: the identity wherever
this evaluator does not run). A split hint says that the rows of a replicated activation along one
dimension are computed independently of each other, so each device may keep its block of them
instead of the copy every device of the group would compute; a whole hint says where the value is
wanted whole again. They are `block` and `whole` above, which are also DeepSpeed-MoE's
`drop_tokens` and `gather_tokens`: a MoE layer whose experts are whole on every tensor device
splits its dispatched capacity this way. A whole weight the split rows meet `enter`s, so its
gradient is summed over the group's blocks and stays replicated.

Relies on: running inside a `shard_map` over `tensor` (the step's, or a pipeline stage's) with each
split weight arriving as this device's block of the dimension `dims` names; the other axes are the
caller's (a collective over one of them runs on each slice as written).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from zerojax.rewrite.jaxpr_eval import bind, interpret, scan_counts

_log = logging.getLogger(__name__)


class Split:
    """A value split over the tensor axis: this device's `local` block of dimension `dim`."""

    __slots__ = ("local", "dim", "origin")

    def __init__(self, local: Any, dim: int, origin: frozenset = frozenset()):
        self.local, self.dim, self.origin = local, dim, origin

    def __repr__(self) -> str:
        return f"Split({getattr(self.local, 'shape', '?')}, dim={self.dim})"


# -- the four collectives (the invariant of each in its docstring) ------------------------------

def _block_of(x: jax.Array, axis: str, dim: int, size: int) -> jax.Array:
    n = x.shape[dim] // size
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * n, n, dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def enter(x: jax.Array, axis: str) -> jax.Array:
    """Replicated in, replicated out; the cotangents of the group's slices are summed."""
    return x


def _enter_fwd(x: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return x, None


def _enter_bwd(axis: str, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.psum(ct, axis),)


enter.defvjp(_enter_fwd, _enter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce(x: jax.Array, axis: str) -> jax.Array:
    """Partial sums in, their (replicated) total out; the replicated cotangent goes back to each."""
    return jax.lax.psum(x, axis)


def _reduce_fwd(x: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return jax.lax.psum(x, axis), None


def _reduce_bwd(axis: str, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (ct,)


reduce.defvjp(_reduce_fwd, _reduce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def whole(x: jax.Array, axis: str, dim: int, size: int) -> jax.Array:
    """A split value made whole on every device; each takes its block of the replicated cotangent."""
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def _whole_fwd(x: jax.Array, axis: str, dim: int, size: int) -> tuple[jax.Array, None]:
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True), None


def _whole_bwd(axis: str, dim: int, size: int, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (_block_of(ct, axis, dim, size),)


whole.defvjp(_whole_fwd, _whole_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def block(x: jax.Array, axis: str, dim: int, size: int) -> jax.Array:
    """A replicated value's block for this device; the blocks' cotangents are gathered back whole."""
    return _block_of(x, axis, dim, size)


def _block_fwd(x: jax.Array, axis: str, dim: int, size: int) -> tuple[jax.Array, None]:
    return _block_of(x, axis, dim, size), None


def _block_bwd(axis: str, dim: int, size: int, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.all_gather(ct, axis, axis=dim, tiled=True),)


block.defvjp(_block_fwd, _block_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def maximum(x: jax.Array, axis: str) -> jax.Array:
    """The group's elementwise maximum; the cotangent goes to the devices holding it."""
    return jax.lax.pmax(x, axis)


def _maximum_fwd(x: jax.Array, axis: str) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    out = jax.lax.pmax(x, axis)
    return out, (x, out)


def _maximum_bwd(axis: str, res: tuple[jax.Array, jax.Array], ct: jax.Array) -> tuple[jax.Array]:
    x, out = res
    hit = (x == out).astype(ct.dtype)
    return (ct * hit / jnp.maximum(jax.lax.psum(hit, axis), 1),)


maximum.defvjp(_maximum_fwd, _maximum_bwd)


# -- layout hints a model may leave in its loss ----------------------------------------------------

_hint = jcore.Primitive("tensor_hint")  # params: dim (int: may be split along it; None: wanted whole)
_hint.def_impl(lambda x, *, dim: x)
_hint.def_abstract_eval(lambda x, *, dim: x)
ad.deflinear2(_hint, lambda ct, x, *, dim: [ct])  # the identity, so its own transpose
mlir.register_lowering(_hint, lambda ctx, x, *, dim: [x])


def _hint_batched(args: Sequence[Any], dims: Sequence[Any], *, dim: int | None) -> tuple[Any, Any]:
    (x,), (b,) = args, dims
    moved = dim if dim is None or b is None else dim + (b <= dim)
    return _hint.bind(x, dim=moved), b


batching.primitive_batchers[_hint] = _hint_batched


def split_hint(x: jax.Array, dim: int) -> jax.Array:
    """`x`, whose rows along `dim` are computed independently of one another (a MoE layer's capacity
    slots). Evaluated on tensor slices, each device of the group keeps its block of them there instead
    of the copy every device would compute (DeepSpeed's `drop_tokens`); anywhere else the identity."""
    return _hint.bind(x, dim=dim)


def whole_hint(x: jax.Array) -> jax.Array:
    """`x`, wanted whole on every device of the tensor group from here on: gathered there if it was kept
    in blocks (DeepSpeed's `gather_tokens`); anywhere else the identity."""
    return _hint.bind(x, dim=None)


# -- the evaluator ---------------------------------------------------------------------------------

class Group:
    """The tensor axis the evaluation runs over, and a count of equations run on gathered inputs."""

    def __init__(self, axis: str, size: int, partition: bool = False):
        self.axis, self.size, self.partition = axis, size, partition
        self.fallbacks: dict[str, int] = {}
        # Per traced scope, the forms already made of a replicated value (keyed by its id; the
        # value is kept so the id stays its own): a value several column kernels read enters once,
        # so its cotangents add up before a single all-reduce.
        self._made: list[dict[tuple[int, Any], tuple[Any, Any]]] = [{}]

    def scope(self) -> "_Scope":
        return _Scope(self._made)

    def _memo(self, x: Any, key: Any, make: Callable[[], Any]) -> Any:
        made = self._made[-1]
        hit = made.get((id(x), key))
        if hit is None:
            hit = made[(id(x), key)] = (x, make())
        return hit[1]

    # Hooks for a group that also learns from the evaluation (`tensor_pairs`); no-ops here.
    def before(self, eqn: Any, ins: list[Any]) -> list[Any]:
        return ins

    def after(self, eqn: Any, ins: list[Any], outs: list[Any]) -> list[Any]:
        return outs

    def follows(self, ins: list[Any]) -> bool:
        """Whether to evaluate a call or loop's body even when no input is split."""
        return False

    def inside(self, outer: Sequence[Any], inner: Sequence[Any]) -> None:
        """`inner` are the values a traced body receives for `outer` (a scan's slices: `outer[i]` sliced)."""

    def whole(self, x: Any) -> Any:
        if not isinstance(x, Split):
            return x
        if not _differentiable(x.local):
            return jax.lax.all_gather(x.local, self.axis, axis=x.dim, tiled=True)
        return whole(x.local, self.axis, x.dim, self.size)

    def block(self, x: Any, dim: int) -> Any:
        """`x` (any form) as this device's block of `dim`."""
        if isinstance(x, Split):
            if x.dim == dim:
                return x.local
            x = self.whole(x)
        if not _differentiable(x):
            return _block_of(jnp.asarray(x), self.axis, dim, self.size)
        return self._memo(x, dim, lambda: block(x, self.axis, dim, self.size))

    def enter(self, x: Any) -> Any:
        return self._memo(x, "enter", lambda: enter(x, self.axis)) if _differentiable(x) else x

    def reduce(self, x: jax.Array) -> jax.Array:
        return reduce(x, self.axis)

    def maximum(self, x: jax.Array) -> jax.Array:
        return maximum(x, self.axis)


class _Scope:
    """A traced scope (a body being traced) gets its own memo: tracers do not outlive their trace."""

    def __init__(self, stack: list[dict[Any, Any]]):
        self.stack = stack

    def __enter__(self) -> None:
        self.stack.append({})

    def __exit__(self, *exc: Any) -> None:
        self.stack.pop()


def _differentiable(x: Any) -> bool:
    """A traced or concrete float array (a cotangent can flow to it); literals and integers are not."""
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", ()))


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], group: Group) -> list[Any]:
    """The outputs of `jaxpr` (whole-weight shapes) on `args` holding `Split` weights."""
    def step(eqn: Any, ins: list[Any]) -> list[Any]:
        ins = group.before(eqn, ins)
        name = eqn.primitive.name
        if (not any(isinstance(x, Split) for x in ins) and not (name in _BODIES and group.follows(ins))
                and eqn.primitive is not _hint):
            return group.after(eqn, ins, bind(eqn, ins))
        rule = _RULES.get(name) or (_elementwise if name in _ELEMENTWISE else None)
        out = rule(eqn, ins, group) if rule is not None else None
        if out is None:
            group.fallbacks[name] = group.fallbacks.get(name, 0) + 1
            out = bind(eqn, [group.whole(x) for x in ins])
        return group.after(eqn, ins, out)
    return interpret(jaxpr, consts, args, step)


def _rebind(eqn: Any, args: Sequence[Any], **overrides: Any) -> list[Any]:
    """The equation with some parameters changed (the local block's shape)."""
    params = {**eqn.primitive.get_bind_params(eqn.params), **overrides}
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


# -- rules: each returns the outputs, or None to run the equation on gathered inputs ---------------

_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "neg", "sign", "floor", "ceil", "round",
    "is_finite", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin",
    "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "abs",
    "integer_pow", "square", "erf", "erfc", "erf_inv", "lgamma", "digamma", "convert_element_type",
    "reduce_precision", "select_n", "and", "or", "not", "xor", "eq", "ne", "lt", "le", "gt", "ge", "clamp",
    "nextafter", "copy", "copy_p", "stop_gradient", "real", "imag", "conj", "shift_left",
    "shift_right_logical", "shift_right_arithmetic", "population_count",
})


def _elementwise(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    """Same-shape operands: every one as this device's block of the first split operand's dimension."""
    out_shape = eqn.outvars[0].aval.shape
    dim = next(x.dim for x in ins if isinstance(x, Split))
    args = []
    for x in ins:
        shape = _shape(x)
        if isinstance(x, Split) or (len(shape) == len(out_shape) and shape[dim] == out_shape[dim]):
            args.append(group.block(x, dim))
        elif shape == () or (len(shape) == len(out_shape) and shape[dim] == 1):
            args.append(group.enter(x))  # broadcast over the split dimension: every block uses it
        else:
            return None
    return [Split(o, dim) for o in bind(eqn, args)]


def _broadcast_in_dim(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    x = ins[0]
    if len(ins) != 1:
        return None
    dims = eqn.params["broadcast_dimensions"]
    out = dims[x.dim]
    shape = list(eqn.params["shape"])
    if eqn.invars[0].aval.shape[x.dim] != shape[out]:
        return None
    shape[out] //= group.size
    return [Split(_rebind(eqn, [x.local], shape=tuple(shape))[0], out)]


def _reshape(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    """A split dimension's block stays one block of the output dimension that starts where it does
    (same product of the dimensions before it) and that the group divides."""
    x = ins[0]
    if len(ins) != 1 or eqn.params.get("dimensions") is not None:
        return None
    in_shape, new = eqn.invars[0].aval.shape, list(eqn.params["new_sizes"])
    prefix = math.prod(in_shape[:x.dim])
    acc = 1
    for j, s in enumerate(new):
        if acc == prefix and s % group.size == 0 and s > 1:
            new[j] //= group.size
            return [Split(_rebind(eqn, [x.local], new_sizes=tuple(new))[0], j)]
        acc *= s
        if acc > prefix:
            return None
    return None


def _transpose(eqn: Any, ins: list[Any], group: Group) -> list[Any]:
    x = ins[0]
    perm = tuple(eqn.params["permutation"])
    return [Split(bind(eqn, [x.local])[0], perm.index(x.dim))]


def _squeeze(eqn: Any, ins: list[Any], group: Group) -> list[Any]:
    x = ins[0]
    gone = eqn.params["dimensions"]
    return [Split(bind(eqn, [x.local])[0], x.dim - sum(d < x.dim for d in gone))]


def _reduction(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    x = ins[0]
    axes = tuple(eqn.params["axes"])
    name = eqn.primitive.name
    if x.dim not in axes:
        return [Split(bind(eqn, [x.local])[0], x.dim - sum(a < x.dim for a in axes))]
    if name == "reduce_sum":
        return [group.reduce(bind(eqn, [x.local])[0])]
    if name == "reduce_max" and jnp.issubdtype(x.local.dtype, jnp.inexact):
        return [group.maximum(bind(eqn, [x.local])[0])]
    return None


def _cumulative(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    x = ins[0]
    if eqn.params["axis"] == x.dim:
        return None
    return [Split(bind(eqn, [x.local])[0], x.dim)]


def _dims_kept(eqn: Any, ins: list[Any], group: Group, key: str) -> list[Any] | None:
    x = ins[0]
    if x.dim in tuple(eqn.params[key]):
        return None
    return [Split(bind(eqn, [x.local])[0], x.dim)]


def _slice(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    x = ins[0]
    p = eqn.params
    full = eqn.invars[0].aval.shape[x.dim]
    strides = p.get("strides")
    if p["start_indices"][x.dim] != 0 or p["limit_indices"][x.dim] != full or (strides and strides[x.dim] != 1):
        return None
    limit = list(p["limit_indices"])
    limit[x.dim] = full // group.size
    return [Split(_rebind(eqn, [x.local], limit_indices=tuple(limit))[0], x.dim)]


def _dynamic_slice(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    x, *idx = ins
    if not isinstance(x, Split) or any(isinstance(i, Split) for i in idx):
        return None
    sizes = list(eqn.params["slice_sizes"])
    if sizes[x.dim] != eqn.invars[0].aval.shape[x.dim]:
        return None
    sizes[x.dim] //= group.size
    return [Split(_rebind(eqn, [x.local, *idx], slice_sizes=tuple(sizes))[0], x.dim)]


def _concatenate(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    dim = next(x.dim for x in ins if isinstance(x, Split))
    if dim == eqn.params["dimension"]:
        return None
    return [Split(bind(eqn, [group.block(x, dim) for x in ins])[0], dim)]


def _split(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    x = ins[0]
    if eqn.params["axis"] == x.dim:
        return None
    return [Split(o, x.dim) for o in bind(eqn, [x.local])]


def _pad(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    x, value = ins
    if not isinstance(x, Split) or isinstance(value, Split) or tuple(eqn.params["padding_config"][x.dim]) != (0, 0, 0):
        return None
    return [Split(bind(eqn, [x.local, group.enter(value)])[0],
                  x.dim)]


def _dot_general(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    """Megatron's cases: a split contracted dimension gives partial sums (`reduce`); a split batch
    dimension (attention's heads) stays split; a split free dimension (a column kernel, or the
    activations it made) stays split while the other operand, replicated, `enter`s."""
    a, b = ins
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ndim_a, ndim_b = len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)
    free_a = [d for d in range(ndim_a) if d not in lc and d not in lb]
    free_b = [d for d in range(ndim_b) if d not in rc and d not in rb]
    for x, mine in ((a, lc), (b, rc)):
        if isinstance(x, Split) and x.dim in mine:  # contracted over the split: partial sums
            i = mine.index(x.dim)
            da, db = (lc[i], rc[i])
            out = bind(eqn, [group.block(a, da), group.block(b, db)])[0]
            return [group.reduce(out)]
    for x, mine in ((a, lb), (b, rb)):
        if isinstance(x, Split) and x.dim in mine:  # a batch dimension: stays split
            i = mine.index(x.dim)
            out = bind(eqn, [group.block(a, lb[i]), group.block(b, rb[i])])[0]
            return [Split(out, i)]
    if isinstance(a, Split) and isinstance(b, Split):
        return None  # both split along free dimensions: one would have to be gathered
    if isinstance(a, Split):
        out = bind(eqn, [a.local, group.enter(b)])[0]
        return [Split(out, len(lb) + free_a.index(a.dim))]
    out = bind(eqn, [group.enter(a), b.local])[0]
    return [Split(out, len(lb) + len(free_a) + free_b.index(b.dim))]


def _gather(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    """Lookups in a split table. Split along the looked-up dimension (a vocabulary-parallel embedding,
    or picking the label's logit): each device looks up the rows it holds, zeros the others, and the
    group sums. Split along a dimension taken whole (an embedding split by columns): stays split."""
    x, idx = ins
    if not isinstance(x, Split):
        return None
    idx = group.whole(idx)
    dn = eqn.params["dimension_numbers"]
    sizes = list(eqn.params["slice_sizes"])
    if x.dim in dn.operand_batching_dims:
        return None
    n = x.local.shape[x.dim]
    if x.dim in dn.start_index_map and x.dim in dn.collapsed_slice_dims:
        k = dn.start_index_map.index(x.dim)
        at = idx[..., k] - jax.lax.axis_index(group.axis).astype(idx.dtype) * n
        held = (at >= 0) & (at < n)
        local_idx = idx.at[..., k].set(jnp.clip(at, 0, n - 1))
        out = bind(eqn, [x.local, local_idx])[0]
        batch = [d for d in range(out.ndim) if d not in dn.offset_dims]
        mask = jax.lax.broadcast_in_dim(held, out.shape, tuple(batch))
        return [group.reduce(jnp.where(mask, out, jnp.zeros((), out.dtype)))]
    if x.dim not in dn.start_index_map and sizes[x.dim] == eqn.invars[0].aval.shape[x.dim]:
        sizes[x.dim] = n
        kept = [d for d in range(x.local.ndim) if d not in dn.collapsed_slice_dims
                and d not in dn.operand_batching_dims]
        out = _rebind(eqn, [x.local, idx], slice_sizes=tuple(sizes))[0]
        return [Split(out, dn.offset_dims[kept.index(x.dim)])]
    return None


def _all_to_all(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    """An all-to-all over another mesh axis (Ulysses' over `sequence`) that neither splits nor joins the
    tensor-split dimension acts on each device's block alone: it stays split there."""
    x = ins[0]
    p = eqn.params
    if group.axis in _axes(p["axis_name"]) or x.dim in (p["split_axis"], p["concat_axis"]):
        return None
    return [Split(bind(eqn, [x.local])[0], x.dim)]


def _axes(name: Any) -> tuple:
    return tuple(name) if isinstance(name, (tuple, list)) else (name,)


def _layout_hint(eqn: Any, ins: list[Any], group: Group) -> list[Any]:
    """A model's hint (`split_hint`, `whole_hint`), taken with the forms' own collectives: `block` (the
    rows' cotangents gathered back whole) and `whole` (each device takes its block of the cotangent).
    A dimension the group does not divide stays whole: the hint is a permission, never a change of
    the value."""
    x, dim = ins[0], eqn.params["dim"]
    if dim is None:
        return [group.whole(x)]
    if isinstance(x, Split) and x.dim == dim:
        return [x]
    if _shape(x)[dim] % group.size:
        return [group.whole(x)]
    return [Split(group.block(x, dim), dim)]


def _optimization_barrier(eqn: Any, ins: list[Any], group: Group) -> list[Any]:
    outs = bind(eqn, [x.local if isinstance(x, Split) else x for x in ins])
    return [Split(o, x.dim) if isinstance(x, Split) else o for o, x in zip(outs, ins)]


def _inline(key: str) -> Callable[[Any, list[Any], Group], list[Any]]:
    """Calls (`jit`, `closed_call`) run their body here: a call's derivative is its body's."""
    def rule(eqn: Any, ins: list[Any], group: Group) -> list[Any]:
        closed = eqn.params[key]
        if isinstance(closed, jcore.ClosedJaxpr):
            return evaluate(closed.jaxpr, closed.consts, ins, group)
        return evaluate(closed, (), ins, group)
    return rule


class _NotLocal(Exception):
    """A custom JVP's body or rule would need a collective: it runs as written on gathered inputs."""

    def __str__(self) -> str:
        return ("a jax.custom_jvp rule evaluated on tensor slices needs a collective it was not checked for "
                "(a rule calling its own function on other inputs)")


class _Local(Group):
    """A custom JVP evaluated on the blocks, body and rule alike. JAX differentiates it by its rule,
    never by transposing what runs inside, so no collective may run there (its backward would be
    lost): wherever one would, `_NotLocal` sends the call back to `evaluate`'s fallback."""

    def __init__(self, outer: Group):
        super().__init__(outer.axis, outer.size)
        self.outer = outer

    def before(self, eqn: Any, ins: list[Any]) -> list[Any]:
        return self.outer.before(eqn, ins)

    def after(self, eqn: Any, ins: list[Any], outs: list[Any]) -> list[Any]:
        return self.outer.after(eqn, ins, outs)

    def follows(self, ins: list[Any]) -> bool:
        return self.outer.follows(ins)

    def inside(self, outer: Sequence[Any], inner: Sequence[Any]) -> None:
        self.outer.inside(outer, inner)

    def whole(self, x: Any) -> Any:
        if isinstance(x, Split):
            raise _NotLocal
        return x

    def block(self, x: Any, dim: int) -> Any:
        if isinstance(x, Split):
            if x.dim != dim:
                raise _NotLocal
            return x.local
        # a replicated value here depends on no differentiable input (`_custom_jvp` admits none), so
        # its block needs no cotangent: a plain slice
        return _block_of(jnp.asarray(x), self.axis, dim, self.size)

    def enter(self, x: Any) -> Any:
        return x  # replicated values here carry no cotangent: `_custom_jvp` admits no differentiable one

    def reduce(self, x: jax.Array) -> jax.Array:
        raise _NotLocal

    def maximum(self, x: jax.Array) -> jax.Array:
        raise _NotLocal


_CHECKING: set[Any] = set()  # the custom JVP rules being traced on the blocks (where defined, on which shapes)


def _custom_jvp(eqn: Any, ins: list[Any], group: Group) -> list[Any] | None:
    """A `jax.custom_jvp` call (`jax.nn.relu`, `softmax`, a straight-through estimator, a NaN-safe
    root) keeps its rule. Where its body and its rule both run on the blocks without a collective
    (every split input split alike, each block's outputs and tangents computed from that block alone:
    elementwise functions, softmax over a dimension that is not split), it is a custom JVP of the
    blocks whose rule is the user's, evaluated on the blocks. Otherwise (a collective would be needed,
    a differentiable input is replicated, or nothing is split) it returns None: `evaluate` runs the
    call as written on gathered inputs and reports it, so JAX still differentiates it by its rule."""
    p = eqn.params
    nc = p["num_consts"]
    if (not any(isinstance(x, Split) for x in ins[nc:]) or any(isinstance(x, Split) for x in ins[:nc])
            or any(_differentiable(x) for x in ins if not isinstance(x, Split))):
        return None
    local = _Local(group)
    consts, (args, forms) = ins[:nc], _flatten(ins[nc:])
    moving = [_differentiable(a) for a in args]
    jvp_jaxpr, jvp_consts, out_zeros = p["jvp_jaxpr_fun"].call_wrapped(*[not m for m in moving])
    body = p["call_jaxpr"]
    out_forms: list[Form] = []

    def primal_of(consts: Sequence[Any], *xs: Any) -> list[Any]:
        with local.scope():
            flat, of = _flatten(evaluate(body.jaxpr, body.consts, [*consts, *_rebuild(xs, forms)], local))
        out_forms[:] = of
        return flat

    def rule(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        moved = [t for t, m in zip(tangents, moving) if m]
        with local.scope():
            outs = evaluate(jvp_jaxpr, jvp_consts,
                            [*_rebuild(primals, forms), *_rebuild(moved, [f for f, m in zip(forms, moving) if m])],
                            local)
        (ys, y_forms), (dys, dy_forms) = _flatten(outs[:len(out_zeros)]), _flatten(outs[len(out_zeros):])
        dims = _dims(out_forms)
        if _dims(y_forms) != dims or _dims(dy_forms) != [d for d, z in zip(dims, out_zeros) if not z]:
            raise _NotLocal  # the rule's outputs are split otherwise than the body's
        dys_ = iter(dys)
        return ys, [_zero_tangent(y) if z else next(dys_) for y, z in zip(ys, out_zeros)]

    # Both traced once on the blocks' shapes now, since JAX traces the rule only when it differentiates.
    # A rule that calls its own function (`y = f(x)` inside f's rule) is checked once, not forever.
    info = p["jvp_jaxpr_fun"].debug_info
    key = (info.func_src_info, str(body.in_avals)) if info is not None else id(p["jvp_jaxpr_fun"])
    check_rule = key not in _CHECKING
    _CHECKING.add(key)
    try:
        avals = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in [*consts, *args]]
        jax.make_jaxpr(lambda *cx: (primal_of(cx[:nc], *cx[nc:]),
                                    check_rule and rule(cx[nc:], [_zero_tangent(x) for x in cx[nc:]])))(*avals)
    except _NotLocal:
        return None
    finally:
        if check_rule:
            _CHECKING.discard(key)
    call = jax.custom_jvp(functools.partial(primal_of, consts))
    call.defjvp(lambda xs, ts: rule(xs, ts))
    return _rebuild(call(*args), out_forms)


def _dims(forms: Sequence[Form]) -> list[int | None]:
    return [None if f is None else f[0] for f in forms]


def _zero_tangent(x: Any) -> Any:
    """The zero tangent of a primal value (float0 for integers, as JAX's rules expect)."""
    if _differentiable(x) or not hasattr(x, "dtype"):
        return jnp.zeros_like(x)
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


Form = tuple[int, frozenset] | None  # a value's form across a traced boundary: (split dim, origin), or replicated


def _flatten(values: Sequence[Any]) -> tuple[list[Any], list[Form]]:
    return ([x.local if isinstance(x, Split) else x for x in values],
            [(x.dim, x.origin) if isinstance(x, Split) else None for x in values])


def _rebuild(arrays: Sequence[Any], forms: Sequence[Form]) -> list[Any]:
    return [a if f is None else Split(a, *f) for a, f in zip(arrays, forms)]


def _shifted(forms: Sequence[Form], by: int) -> list[Form]:
    """The forms of slices along a leading axis (by -1) or of values stacked on one (by +1)."""
    return [None if f is None else (f[0] + by, f[1]) for f in forms]


def _as(x: Any, form: Form, group: Group) -> Any:
    """`x` in `form` (None: replicated)."""
    return group.whole(x) if form is None else group.block(x, form[0])


def _partitionable(x: Any, size: int) -> int | None:
    """The most major dimension of a replicated activation input that the group divides (None: keep
    whole). Activations are the inputs of three or more dimensions ([batch, sequence, features]); a
    layer's weights and tables (rotary, masks) have fewer and stay as they are."""
    if isinstance(x, Split) or not _differentiable(x) or x.ndim < 3:
        return None
    return next((d for d, n in enumerate(x.shape) if n % size == 0 and n >= size), None)


def _checkpoint(eqn: Any, ins: list[Any], group: Group) -> list[Any]:
    """A rematerialized region stays one, with its policy: its body is evaluated inside it.

    With `partition_activations` (DeepSpeed's / Megatron's activation partitioning), what the region
    keeps for its backward pass - its inputs, which tensor devices hold in copies - is kept as each
    device's block and all-gathered where the region runs (forward and recomputation): 1/size of the
    kept activations per device, for one all-gather per region and pass."""
    kept = [(_partitionable(x, group.size) if group.partition else None) for x in ins]
    ins = [x if d is None else Split(group.block(x, d), d) for x, d in zip(ins, kept)]
    arrays, forms = _flatten(ins)
    out_forms: list[Form] = []

    def body(*xs: Any) -> list[Any]:
        group.inside(arrays, xs)
        with group.scope():
            vals = [group.whole(v) if d is not None else v for v, d in zip(_rebuild(xs, forms), kept)]
            outs = evaluate(eqn.params["jaxpr"], (), vals, group)
        flat, of = _flatten(outs)
        out_forms[:] = of
        return flat

    outs = jax.checkpoint(body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])(*arrays)
    return _rebuild(outs, out_forms)


def _scan(eqn: Any, ins: list[Any], group: Group) -> list[Any]:
    """A scan over stacked weights: each iteration sees one layer's slices. Carries keep the form
    they entered with (a carry the body returns in another form is converted)."""
    p = eqn.params
    nc, ncarry = scan_counts(p)
    consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    xs = [group.whole(x) if isinstance(x, Split) and x.dim == 0 else x for x in xs]
    carry_arrays, carry_forms = _flatten(carry)
    xs_arrays, xs_forms = _flatten(xs)
    y_forms: list[Form] = []
    closed = p["jaxpr"]

    def body(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        group.inside(xs_arrays, x)
        with group.scope():
            outs = evaluate(closed.jaxpr, closed.consts,
                            [*consts, *_rebuild(c, carry_forms), *_rebuild(x, _shifted(xs_forms, -1))], group)
            new_carry = [_as(o, f, group) for o, f in zip(outs[:ncarry], carry_forms)]
        ys, forms = _flatten(outs[ncarry:])
        y_forms[:] = forms
        return [x.local if isinstance(x, Split) else x for x in new_carry], ys

    final, ys = jax.lax.scan(body, carry_arrays, xs_arrays, length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
    return [*_rebuild(final, carry_forms), *_rebuild(ys, _shifted(y_forms, 1))]


_RULES: dict[str, Callable[[Any, list[Any], Group], list[Any] | None]] = {
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "reduce_sum": _reduction, "reduce_max": _reduction, "reduce_min": _reduction, "reduce_prod": _reduction,
    "reduce_and": _reduction, "reduce_or": _reduction, "argmax": _reduction, "argmin": _reduction,
    "cumsum": _cumulative, "cumprod": _cumulative, "cummax": _cumulative, "cummin": _cumulative,
    "cumlogsumexp": _cumulative,
    "rev": functools.partial(_dims_kept, key="dimensions"),
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "concatenate": _concatenate,
    "split": _split,
    "pad": _pad,
    "dot_general": _dot_general,
    "gather": _gather,
    "optimization_barrier": _optimization_barrier,
    "all_to_all": _all_to_all,
    "tensor_hint": _layout_hint,
    "pjit": _inline("jaxpr"), "jit": _inline("jaxpr"),
    "closed_call": _inline("call_jaxpr"), "core_call": _inline("call_jaxpr"),
    "custom_jvp_call": _custom_jvp,
    "checkpoint": _checkpoint, "remat2": _checkpoint,
    "scan": _scan,
}


# Rules that evaluate a body (calls, remat, loops).
_BODIES = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "checkpoint", "remat2", "scan"})


# -- the entry point -----------------------------------------------------------------------------

def warn_fallbacks(fallbacks: dict[str, int]) -> None:
    """Log, once per trace, the equations that had to run on gathered activations (a split to reconsider)."""
    if fallbacks:
        listed = ", ".join(f"{name} x{n}" for name, n in sorted(fallbacks.items()))
        _log.warning("tensor parallel: %d equations ran on gathered activations (%s); the weights' splits do not "
                     "form Megatron's column -> row pairs there", sum(fallbacks.values()), listed)


def tensor_parallel(loss_fn: Callable[..., Any], dims: Any, axis: str, size: int,
                    report: Callable[[dict[str, int]], None] = warn_fallbacks, *,
                    partition_activations: bool = False) -> Callable[..., Any]:
    """`loss_fn(params, *args)` written for whole weights, callable inside `shard_map` with each
    weight's slice over `axis` (`dims`: per parameter leaf, the split dimension or None).

    The loss is traced once per call with whole weight shapes and evaluated on the slices.
    `report` receives the equations that ran on gathered inputs (none for Megatron's patterns); by
    default they are logged.
    `partition_activations`: rematerialized regions keep their inputs split over `axis` (`_checkpoint`).
    """
    def wrapped(params: Any, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree.flatten(params)
        split = tree.flatten_up_to(dims)
        others, other_tree = jax.tree.flatten((args, kwargs))

        def global_shape(x: Any, d: int | None) -> jax.ShapeDtypeStruct:
            shape = tuple(s * size if i == d else s for i, s in enumerate(x.shape))
            return jax.ShapeDtypeStruct(shape, x.dtype)

        def flat_loss(*flat: Any) -> Any:
            a, kw = jax.tree.unflatten(other_tree, flat[len(leaves):])
            return loss_fn(jax.tree.unflatten(tree, flat[:len(leaves)]), *a, **kw)

        abstract = ([global_shape(x, d) for x, d in zip(leaves, split)]
                    + [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in others])
        closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(*abstract)
        group = Group(axis, size, partition_activations)
        inputs = [x if d is None else Split(x, d) for x, d in zip(leaves, split)]
        outs = evaluate(closed.jaxpr, closed.consts, inputs + list(others), group)
        report(dict(group.fallbacks))
        return jax.tree.unflatten(jax.tree.structure(out_shape), [group.whole(o) for o in outs])

    return wrapped
