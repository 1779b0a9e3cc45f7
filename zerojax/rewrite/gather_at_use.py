"""ZeRO-3 for any loss: gather each parameter where the loss uses it, with no marking.

DeepSpeed's stage 3 hooks every `nn.Module` so a layer's weights are all-gathered just before the
layer runs and released after; DeepCompile (DeepSpeed's compiler path) inserts the same gathers into
the traced graph instead. This module does the latter for a JAX loss: it traces
`loss_fn(params, batch)` once to a jaxpr with whole-parameter shapes and the per-device batch,
then evaluates that jaxpr inside the step's `shard_map`, all-gathering a sharded parameter right
before the equation that reads it. The gather is `all_gather(tiled=True)`, whose transpose is
`psum_scatter`: gradients leave each use already reduce-scattered into the parameter's shard.

Invariants (each one is what keeps at most a few layers' weights whole on a device):

* A sharded parameter is a `Deferred` value until an equation with activation inputs consumes it.
  Equations that read only parameters (a dtype cast, a reshape) extend the recipe instead of
  running, so the cast copy of a weight is never a whole-model residual either.
* Each equation that consumes a parameter together with activations gathers it itself, under a
  custom VJP whose residuals are the shard and the activations only: the backward pass gathers
  the weight again, after its cotangent arrives, instead of keeping it from the forward pass. A
  parameter used by several such equations is gathered once per use.
* Inside a rematerialized region (`jax.checkpoint` / `nnx.remat`) within a scan or while body,
  gathers happen once per region, at first use, and are reused by every later equation of that
  region; the region's replay in the backward loop gathers them again.
* `scan` over a stacked parameter slices the local shard: the sharded dimension moves down by one
  and each iteration gathers one layer (forward, and again in the backward pass). A parameter
  sharded along the stacked axis itself is gathered whole before the scan (the layout shards a
  later dimension when it knows the layer axes, or the leaf has three or more dimensions; a
  stacked bias or norm scale is small).
* Scan, while and cond bodies are new regions (not rematerialized unless they say so); `jit`,
  `closed_call` calls are inlined into the current region. Custom-derivative calls
  (`custom_jvp_call`, `custom_vjp_call`) and any other primitive receive gathered inputs.
* The traced loss is the loss of the device's rows; the caller scales it exactly as it scales a
  whole-parameter loss (`step.make_grad_fn`), so gradients equal those of the plain loss.

Relies on: running inside the step's `shard_map` over the data axes (`core.mesh.data_axis`, or the
hpZ inner axis a `ParamShard` names), each sharded parameter arriving as a `ParamShard` of its
gather dimension; no other axis (tensor slices are `tensor_slices`' and run first, inside this).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from zerojax.core.collectives import PLAIN, ParamShard, Wire, gather_shard, reduce_scatter_shard
from zerojax.core.layout import Prefetch
from zerojax.core.mesh import data_axis
from zerojax.rewrite.jaxpr_eval import bind, interpret, scan_counts

# Primitives that commute with slicing a stacked leading axis (used to carry a parameter's
# cast into a scan body instead of casting the whole stack first).
_ELEMENTWISE = frozenset({"convert_element_type", "copy", "copy_p", "neg", "abs", "sign", "exp", "log",
                          "tanh", "logistic", "sqrt", "rsqrt", "square", "integer_pow", "mul", "add", "sub",
                          "div", "reduce_precision"})


class Deferred:
    """A whole parameter value not built yet.

    A leaf holds one local shard (`shard`, sharded along `dim` of the local array); an inner node
    holds the equation that reads only Deferred values and constants (`recipe`). Building one
    all-gathers its leaves and replays the recipe.
    """

    __slots__ = ("shard", "dim", "on_host", "recipe", "_leaves", "wire", "read", "layer")

    def __init__(self, shard: Any = None, dim: int = 0, on_host: bool = False,
                 recipe: tuple[Any, list[Any]] | None = None, wire: Wire = PLAIN, read: Any = None,
                 layer: Any = None):
        self.shard, self.dim, self.on_host, self.recipe, self.wire = shard, dim, on_host, recipe, wire
        # the shard is in files (`ParamShard.read`): `shard` is a placeholder, `read(shard, layer)` the
        # value, read where the leaf is gathered (so a rematerialised or re-gathering backward reads again)
        self.read, self.layer = read, layer
        self._leaves: list[Deferred] | None = None

    @property
    def is_leaf(self) -> bool:
        return self.recipe is None

    def leaves(self) -> list["Deferred"]:
        """The distinct leaf shards this value is built from, in a fixed order."""
        if self._leaves is None:
            if self.is_leaf:
                self._leaves = [self]
            else:
                seen: dict[int, Deferred] = {}
                for a in self.recipe[1]:
                    if isinstance(a, Deferred):
                        for leaf in a.leaves():
                            seen.setdefault(id(leaf), leaf)
                self._leaves = list(seen.values())
        return self._leaves

    def elementwise(self) -> bool:
        """Every recipe step acts element by element (so it commutes with slicing a stack)."""
        if self.is_leaf:
            return True
        eqn, args = self.recipe
        return eqn.primitive.name in _ELEMENTWISE and all(
            a.elementwise() if isinstance(a, Deferred) else _is_scalar(a) for a in args)

    def holding(self, shard: Any, dim: int | None = None, layer: Any = None) -> "Deferred":
        """A leaf like this one over another local shard (a traced copy, or one layer's slice of a
        stack, whose sharded dimension is then `dim` and which is `layer` of the stack in the files)."""
        return Deferred(shard, self.dim if dim is None else dim, self.on_host, wire=self.wire, read=self.read,
                        layer=self.layer if dim is None else layer)

    def rebased(self, new: dict[int, "Deferred"]) -> "Deferred":
        """The same recipe over other leaves (`new` maps id(old leaf) -> new leaf)."""
        if self.is_leaf:
            return new[id(self)]
        eqn, args = self.recipe
        return Deferred(recipe=(eqn, [a.rebased(new) if isinstance(a, Deferred) else a for a in args]))

    def build(self, gathered: Callable[["Deferred"], Any], tag: Callable[[Any], Any]) -> Any:
        if self.is_leaf:
            return gathered(self)
        eqn, args = self.recipe
        vals = [a.build(gathered, tag) if isinstance(a, Deferred) else a for a in args]
        return tag(bind(eqn, vals)[0])


def _is_scalar(x: Any) -> bool:
    return not getattr(x, "shape", ())


def _gather_leaf(leaf: Deferred) -> Any:
    """The whole value of one shard: `all_gather(tiled)`; its transpose is a reduce-scatter."""
    x = leaf.shard if leaf.read is None else leaf.read(leaf.shard, leaf.layer)  # in files: read it now
    if leaf.on_host:
        x = jax.device_put(x, jax.memory.Space.Device)
    return gather_shard(x, leaf.dim, leaf.wire)


def _axis_size(wire: Wire) -> int:
    return jax.lax.axis_size(data_axis() if wire.axis is None else wire.axis)


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


class _Region:
    """One region of evaluation.

    `remat`: the region is rematerialized; `in_loop`: it runs inside a scan or while body. A
    rematerialized region inside a loop gathers each parameter once, at first use, and its replay
    in the backward loop gathers again (the forward and backward loops are apart, so the compiler
    cannot merge them). Everywhere else each consuming equation gathers for itself (`_consume`).
    """

    def __init__(self, remat: bool, in_loop: bool, prefetch: Prefetch | None = None, forward_only: bool = False):
        self.remat, self.in_loop, self.prefetch, self.forward_only = remat, in_loop, prefetch, forward_only
        self.gather_once = remat and in_loop
        self._gathered: dict[int, Any] = {}
        self._built: dict[int, Any] = {}

    def inner(self, *, remat: bool, in_loop: bool) -> "_Region":
        return _Region(remat, in_loop, self.prefetch, self.forward_only)

    def whole(self, d: Deferred) -> Any:
        """The built value, reused within this region."""
        if id(d) not in self._built:
            def gathered(leaf: Deferred) -> Any:
                if id(leaf) not in self._gathered:
                    self._gathered[id(leaf)] = _gather_leaf(leaf)
                return self._gathered[id(leaf)]
            self._built[id(d)] = d.build(gathered, lambda x: x)
        return self._built[id(d)]


def _materialize(region: _Region, x: Any) -> Any:
    return region.whole(x) if isinstance(x, Deferred) else x


# -- the evaluator -------------------------------------------------------------------------------

def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], region: _Region) -> list[Any]:
    """Evaluate `jaxpr` on values that may be `Deferred`; outputs may be Deferred too."""
    return interpret(jaxpr, consts, args, lambda eqn, ins: _equation(eqn, ins, region))


def _equation(eqn: Any, ins: list[Any], region: _Region) -> list[Any]:
    rule = _RULES.get(eqn.primitive.name)
    if rule is not None:
        return rule(eqn, ins, region)
    if not any(isinstance(x, Deferred) for x in ins):
        return bind(eqn, ins)
    if not eqn.primitive.multiple_results and not any(_is_traced(x) for x in ins):
        # Reads only parameters and constants: part of the parameter's recipe.
        return [Deferred(recipe=(eqn, ins))]
    return _consume(eqn, ins, region)


def _consume(eqn: Any, ins: list[Any], region: _Region) -> list[Any]:
    """An equation that reads activations and (not yet gathered) parameters."""
    if region.gather_once:
        return bind(eqn, [_materialize(region, x) for x in ins])
    leaves = list({id(l): l for x in ins if isinstance(x, Deferred) for l in x.leaves()}.values())
    traced_pos = [i for i, x in enumerate(ins) if _is_traced(x)]

    # a shard in files is read by layer index: an argument of the custom VJP, not a closed-over value
    layers = [jnp.int32(-1) if l.layer is None else l.layer for l in leaves]

    def run(shards: list[Any], traced: list[Any], layers: list[Any]) -> list[Any]:
        # Gather after the activations exist: the compiler cannot hoist every layer's gather to
        # the start of the step (all weights whole at once).
        shards = _after(shards, traced)
        new = {id(l): l.holding(s) if l.read is None else l.holding(s, l.dim, k)
               for l, s, k in zip(leaves, shards, layers)}
        cache: dict[int, Any] = {}

        def gathered(leaf: Deferred) -> Any:
            if id(leaf) not in cache:
                cache[id(leaf)] = _gather_leaf(leaf)
            return cache[id(leaf)]

        vals = list(ins)
        for i, t in zip(traced_pos, traced):
            vals[i] = t
        vals = [x.rebased(new).build(gathered, lambda v: v) if isinstance(x, Deferred) else x for x in vals]
        return bind(eqn, vals)

    # The forward pass keeps only the shards and the activations; the backward pass gathers the
    # weight again. A `jax.checkpoint` would say the same, but XLA:CPU drops optimization barriers
    # and merges the two gathers back into one whole-model residual, so the re-gather is tied to
    # the incoming cotangent (`_after`) and cannot be merged with, or hoisted next to, the first.
    @jax.custom_vjp
    def consume(shards: list[Any], traced: list[Any], layers: list[Any]) -> list[Any]:
        return run(shards, traced, layers)

    def fwd(shards: list[Any], traced: list[Any], layers: list[Any]) -> tuple[list[Any], tuple[Any, ...]]:
        return run(shards, traced, layers), (shards, traced, layers)

    def bwd(res: tuple[Any, ...], ct: list[Any]) -> tuple[Any, ...]:
        shards, traced, layers = res
        _, vjp = jax.vjp(lambda s, t: run(s, t, layers), _after(shards, ct), traced)
        return (*vjp(ct), [None] * len(layers))

    consume.defvjp(fwd, bwd)
    return consume([l.shard for l in leaves], [ins[i] for i in traced_pos], layers)


def _in_space_of(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` in `like`'s memory space: a custom VJP must return each cotangent typed as its primal, and
    the gradient of an offloaded (host-typed) shard is computed on the device."""
    want = getattr(jax.typeof(like), "memory_space", None)
    if want is None or getattr(jax.typeof(x), "memory_space", None) == want:
        return x
    return jax.device_put(x, want)


def _after(shards: list[Any], values: Any) -> list[Any]:
    """`shards`, made data-dependent on `values` (activations, cotangents) without changing a
    finite value (a NaN still propagates)."""
    floats = [c for c in jax.tree.leaves(values) if jax.numpy.issubdtype(c.dtype, jax.numpy.floating)]
    if not floats:
        return shards
    probe = floats[0].reshape(-1)[0]
    # No gradient flows through the bump (it is zero): an offloaded shard is typed as host memory, and
    # the transpose of adding a device scalar to it would hand that scalar a host-typed cotangent,
    # which `vjp` refuses ("Expected cotangent type float32[] but got float32<host>[]").
    bump = jax.lax.stop_gradient(jax.numpy.where(jax.numpy.isnan(probe), probe, jax.numpy.zeros_like(probe)))
    return [s + bump.astype(s.dtype) for s in shards]


def _split_deferred(ins: Sequence[Any]) -> tuple[list[Any], Callable[[list[Any]], list[Any]]]:
    """Flatten values for a traced function boundary: every Deferred leaf's shard becomes an
    argument, and `rebuild` puts Deferreds (over the new shards) back in place."""
    leaves = list({id(l): l for x in ins if isinstance(x, Deferred) for l in x.leaves()}.values())
    pos = [i for i, x in enumerate(ins) if not isinstance(x, Deferred)]
    flat = [l.shard for l in leaves] + [ins[i] for i in pos]

    def rebuild(args: list[Any]) -> list[Any]:
        new = {id(l): l.holding(s) for l, s in zip(leaves, args[:len(leaves)])}
        out = [x.rebased(new) if isinstance(x, Deferred) else None for x in ins]
        for i, a in zip(pos, args[len(leaves):]):
            out[i] = a
        return out

    return flat, rebuild


def _remat(eqn: Any, ins: list[Any], region: _Region) -> list[Any]:
    """A rematerialized region: gathers inside it are replayed by its backward pass."""
    p = eqn.params
    flat, rebuild = _split_deferred(ins)

    def fn(*args: Any) -> list[Any]:
        inner = region.inner(remat=True, in_loop=region.in_loop)
        return [_materialize(inner, o) for o in eval_jaxpr(p["jaxpr"], (), rebuild(list(args)), inner)]

    return jax.checkpoint(fn, prevent_cse=p["prevent_cse"], policy=p["policy"])(*flat)


def _inline(key: str) -> Callable[[Any, list[Any], _Region], list[Any]]:
    def rule(eqn: Any, ins: list[Any], region: _Region) -> list[Any]:
        closed = eqn.params[key]
        return eval_jaxpr(closed.jaxpr, closed.consts, ins, region)
    return rule


def _scan(eqn: Any, ins: list[Any], region: _Region) -> list[Any]:
    """A scan: stacked parameters are sliced shard-wise, so each iteration gathers one layer."""
    filed = any(l.read is not None for x in ins if isinstance(x, Deferred) for l in x.leaves())
    if region.prefetch is not None and not filed:
        out = _scan_prefetch(eqn, ins, region)
        if out is not None:
            return out
    p = eqn.params
    nc, ncarry = scan_counts(p)
    consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    init = [_materialize(region, x) for x in init]
    sliced: list[Deferred | None] = []
    scanned: list[Any] = []
    for x in xs:
        if isinstance(x, Deferred) and x.elementwise() and all(l.dim > 0 for l in x.leaves()):
            sliced.append(x)
            scanned.append([l.shard for l in x.leaves()])
        else:  # a plain array, or a parameter sharded along the stacked axis: whole before the scan
            sliced.append(None)
            scanned.append(_materialize(region, x))
    body = p["jaxpr"]
    scanned.append(jnp.arange(p["length"], dtype=jnp.int32))  # the layer index, for shards read from files

    def step(carry: list[Any], xs_slice: list[Any]) -> tuple[list[Any], list[Any]]:
        args = []
        *xs_slice, layer = xs_slice
        for d, s in zip(sliced, xs_slice):
            if d is None:
                args.append(s)
            else:
                new = {id(l): l.holding(v, l.dim - 1, layer) for l, v in zip(d.leaves(), s)}
                args.append(d.rebased(new))
        inner = region.inner(remat=False, in_loop=True)
        outs = [_materialize(inner, o) for o in eval_jaxpr(body.jaxpr, body.consts, [*consts, *carry, *args], inner)]
        return outs[:ncarry], outs[ncarry:]

    carry, ys = jax.lax.scan(step, init, scanned, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


def _stacked_operand(x: Any) -> bool:
    return isinstance(x, Deferred) and x.elementwise() and all(l.dim > 0 for l in x.leaves())


def _inexact(x: Any) -> bool:
    return jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact)


class _Operands(NamedTuple):
    """A scan's inputs sorted for prefetching: the stacked parameters (still sharded), the rest
    materialized (consts, the initial carry, the other scanned operands)."""
    consts: list[Any]
    init: list[Any]
    xs: list[Any]           # every scanned operand as it came (a stacked one is a Deferred recipe)
    stacked: list[int]      # which scanned operands are stacked parameters
    others: list[int]       # the remaining scanned operands ...
    other_xs: list[Any]     # ... materialized
    leaves: list[Any]       # the distinct parameter shards the stacked operands are built from


def prefetches(prefetch: Prefetch | None, layer: int) -> bool:
    """Whether a scan whose one layer gathers to `layer` elements on a device is prefetched: one
    layer within the bucket and two within the live limit (DeepSpeed's stage-3 settings)."""
    return prefetch is not None and layer <= prefetch.bucket and 2 * layer <= prefetch.max_live


def _prefetch_operands(eqn: Any, ins: list[Any], region: _Region) -> _Operands | None:
    """The scan's operands when prefetching applies: some stacked parameter, a forward scan of two
    layers or more, `prefetches` the layer, and, unless nothing differentiates it (`forward_only`),
    floating-point state only (the custom VJP below differentiates every carry and output); else None."""
    p = eqn.params
    (nc, ncarry), length = scan_counts(p), p["length"]
    consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    stacked = [j for j, x in enumerate(xs) if _stacked_operand(x)]
    if not stacked or p["reverse"] or length < 2:
        return None
    leaves = list({id(l): l for j in stacked for l in xs[j].leaves()}.values())
    layer = sum(math.prod(l.shard.shape[1:]) * _axis_size(l.wire) for l in leaves)
    if not prefetches(region.prefetch, layer):
        return None
    consts = [_materialize(region, x) for x in consts]
    init = [_materialize(region, x) for x in init]
    others = [j for j in range(len(xs)) if j not in stacked]
    other_xs = [_materialize(region, xs[j]) for j in others]
    if not region.forward_only and (not all(_inexact(x) for x in [*consts, *init, *other_xs]) or not all(
            jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact) for v in p["jaxpr"].jaxpr.outvars)):
        return None
    return _Operands(consts, init, xs, stacked, others, other_xs, leaves)


def _at(tree: Any, index: Any) -> Any:
    return jax.tree.map(lambda v: v[index], tree)


class _Layer:
    """One iteration of a prefetched scan: its layer gathered out of the stacked shards, the body
    run on it, and the body's VJP with the layer's weight gradients reduce-scattered into shards."""

    def __init__(self, eqn: Any, ops: _Operands, region: _Region):
        self.body, self.ncarry = eqn.params["jaxpr"], scan_counts(eqn.params)[1]
        self.ops, self.region = ops, region

    def gather(self, stacks: list[Any], i: Any, after: Any = None) -> list[Any]:
        """Layer `i` of every stacked shard, brought to the device and all-gathered whole (once
        `after` exists, when given: `_after`)."""
        out = []
        for l, stack in zip(self.ops.leaves, stacks):
            x = jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False)
            if l.on_host:
                x = jax.device_put(x, jax.memory.Space.Device)
            if after is not None:
                x = _after([x], after)[0]
            out.append(gather_shard(x, l.dim - 1, l.wire))
        return out

    def __call__(self, cs: list[Any], carry: list[Any], other: list[Any],
                 gathered: list[Any]) -> tuple[list[Any], list[Any]]:
        """The scan body on one layer's gathered weights: (new carry, outputs)."""
        ops = self.ops
        whole = {id(l): g for l, g in zip(ops.leaves, gathered)}
        args: list[Any] = [None] * len(ops.xs)
        for j in ops.stacked:
            args[j] = ops.xs[j].build(lambda leaf: whole[id(leaf)], lambda v: v)
        for j, o in zip(ops.others, other):
            args[j] = o
        inner = self.region.inner(remat=False, in_loop=True)
        body = self.body
        outs = [_materialize(inner, o) for o in eval_jaxpr(body.jaxpr, body.consts, [*cs, *carry, *args], inner)]
        return outs[:self.ncarry], outs[self.ncarry:]

    def vjp(self, cs: list[Any], d_carry: Any, current: Any, other: Any, carry: Any, ct_y: Any) -> tuple[Any, ...]:
        """The layer replayed from its input `carry` and differentiated: the cotangents of the consts,
        the carry and the other operands, and the layer's weight gradients as shards."""
        _, vjp = jax.vjp(self, cs, carry, other, current)
        g_cs, g_carry, g_other, g_layer = vjp((d_carry, ct_y))
        shards = [reduce_scatter_shard(g, l.dim - 1, l.wire) for l, g in zip(self.ops.leaves, g_layer)]
        return g_cs, g_carry, g_other, shards


def _prefetch_forward(layer: _Layer, length: int, unroll: Any, cs: list[Any], carry0: list[Any],
                      stacks: list[Any], other_xs: list[Any]) -> tuple[Any, Any, Any]:
    """Layers 0..L-2 in a scan that gathers the next layer ahead; layer L-1 after it (peeled, so no
    gather runs past the end of the stack). Returns the last carry, the outputs and every layer's
    input carry (what the backward pass replays from)."""
    def step(c: tuple[list[Any], list[Any]], x: tuple[Any, list[Any]]) -> tuple[Any, Any]:
        carry, current = c
        i, other = x
        # The next layer's gather reads only the shards: it can run while this layer computes.
        ahead = layer.gather(stacks, i + 1)
        new, ys = layer(cs, carry, other, current)
        return (new, ahead), (ys, carry)

    (carry, current), (ys, carries) = jax.lax.scan(
        step, (carry0, layer.gather(stacks, 0)), (jnp.arange(length - 1), _at(other_xs, slice(0, -1))),
        unroll=unroll)
    last, y = layer(cs, carry, _at(other_xs, -1), current)
    join = lambda a, b: jnp.concatenate([a, b[None]])  # noqa: E731
    return last, jax.tree.map(join, ys, y), jax.tree.map(join, carries, carry)


def _prefetch_ahead(layer: _Layer, length: int, cs: list[Any], carry0: list[Any], stacks: list[Any],
                    other_xs: list[Any], ys_like: list[Any]) -> tuple[Any, Any]:
    """The forward-only prefetching scan (nothing differentiates it, so its state may be integer: a
    decode step's positions and KV cache): (last carry, outputs).

    Layer i computes on the weights gathered before it while layer i+1's are gathered, so at most
    two layers are gathered at once and a gather is in flight while a layer computes. The loop runs
    two layers per iteration, the gathered weights in two buffers that take turns: with one layer per
    iteration the next layer's weights and the current one's would share one slot of the loop's
    state, and XLA copies both each iteration (a third and fourth layer live). The last one or two
    layers run after the loop, so no gather runs past the end of the stack, and each layer writes its
    outputs (a KV cache) into place. Each gather waits for its layer's input carry (`_after`, through
    its first floating-point value: a decode step's activations): a
    shard-only gather inside an enclosing loop (the decode loop, over which the shards do not change)
    would otherwise be loop-invariant, free to be hoisted out of it with every other layer's (the
    whole model gathered at once).
    """
    def run(i: Any, carry: list[Any], current: list[Any], ys: list[Any]) -> tuple[list[Any], list[Any]]:
        other = jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(jnp.asarray(v), i, 0, keepdims=False), other_xs)
        new, y = layer(cs, carry, other, current)
        return new, [jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0) for b, v in zip(ys, y)]

    def pair(c: tuple[list[Any], list[Any], list[Any]], k: Any) -> tuple[Any, None]:
        carry, first, ys = c
        i = 2 * k
        second = layer.gather(stacks, i + 1, after=carry)  # in flight while layer i computes
        carry, ys = run(i, carry, first, ys)
        first = layer.gather(stacks, i + 2, after=carry)  # into the buffer layer i no longer reads
        carry, ys = run(i + 1, carry, second, ys)
        return (carry, first, ys), None

    ys = [jnp.zeros((length, *y.shape), y.dtype) for y in ys_like]
    pairs = (length - 1) // 2
    c = (carry0, layer.gather(stacks, 0, after=carry0), ys)
    if pairs:
        c, _ = jax.lax.scan(pair, c, jnp.arange(pairs))
    carry, current, ys = c
    if length - 2 * pairs == 2:
        last = layer.gather(stacks, length - 1, after=carry)
        carry, ys = run(length - 2, carry, current, ys)
        current = last
    return run(length - 1, carry, current, ys)


def _prefetch_backward(layer: _Layer, length: int, unroll: Any, res: Any, ct: Any) -> tuple[Any, Any, Any, Any]:
    """Layers L-1..1 in a reversed scan that gathers the layer below ahead; layer 0 after it."""
    cs, stacks, other_xs, carries = res
    ct_last, ct_ys = ct

    def step(c: tuple[Any, Any, Any, Any], x: tuple[Any, Any, Any, Any]) -> tuple[Any, Any]:
        d_carry, current, d_cs, d_stacks = c
        i, other, carry, ct_y = x
        below = layer.gather(stacks, i - 1)  # the layer below, ahead of its turn
        g_cs, g_carry, g_other, shards = layer.vjp(cs, d_carry, current, other, carry, ct_y)
        d_stacks = [jax.lax.dynamic_update_index_in_dim(d, s.astype(d.dtype), i, 0)
                    for d, s in zip(d_stacks, shards)]
        return (g_carry, below, jax.tree.map(jnp.add, d_cs, g_cs), d_stacks), g_other

    # Nothing of the backward pass may start before its cotangent arrives: the top layer's
    # gather and the gradient shards' buffer are tied to it (`_after`), else the compiler
    # hoists them next to the forward loop (one more layer whole, and every gradient shard,
    # live through the whole forward pass).
    late = _after([*stacks, *[jnp.zeros_like(s) for s in stacks]], ct)
    top = layer.gather(late[:len(stacks)], length - 1)
    rest = slice(1, None)
    (d_carry, current, d_cs, d_stacks), d_other = jax.lax.scan(
        step, (ct_last, top, jax.tree.map(jnp.zeros_like, cs), late[len(stacks):]),
        (jnp.arange(1, length), _at(other_xs, rest), _at(carries, rest), _at(ct_ys, rest)),
        reverse=True, unroll=unroll)
    g_cs, d_carry0, g_other, shards = layer.vjp(cs, d_carry, current, _at(other_xs, 0), _at(carries, 0),
                                                _at(ct_ys, 0))
    d_stacks = [jax.lax.dynamic_update_index_in_dim(d, s.astype(d.dtype), 0, 0) for d, s in zip(d_stacks, shards)]
    join = lambda a, b: jnp.concatenate([a[None], b])  # noqa: E731
    d_stacks = [_in_space_of(d, s) for d, s in zip(d_stacks, stacks)]  # offloaded shards: host-typed
    return (jax.tree.map(jnp.add, d_cs, g_cs), d_carry0, d_stacks, jax.tree.map(join, g_other, d_other))


def _scan_prefetch(eqn: Any, ins: list[Any], region: _Region) -> list[Any] | None:
    """A scan over stacked parameters that gathers layer i+1 while layer i computes; None when it
    does not apply (no stacked parameter, a reversed scan, a layer over the limits, integer state
    where the result is differentiated). Forward only, it is `_prefetch_ahead`.

    The forward scan carries the gathered next layer; the backward pass is written out (a custom
    VJP): a reversed scan that carries the gathered layer below, replays one layer from its saved
    input carry (what a rematerialized body saves), and reduce-scatters that layer's weight
    gradients into their shards. Residuals are the shards and the per-layer input carries only, as
    with a rematerialized body gathered in place.
    """
    ops = _prefetch_operands(eqn, ins, region)
    if ops is None:
        return None
    layer, length, unroll = _Layer(eqn, ops, region), eqn.params["length"], eqn.params["unroll"]
    if region.forward_only:
        ys_like = [v.aval for v in eqn.params["jaxpr"].jaxpr.outvars[scan_counts(eqn.params)[1]:]]
        last, ys = _prefetch_ahead(layer, length, ops.consts, ops.init, [l.shard for l in ops.leaves], ops.other_xs,
                                   ys_like)
        return [*last, *ys]
    offload = region.prefetch.offload_carries

    @jax.custom_vjp
    def run(cs: list[Any], carry0: list[Any], stacks: list[Any], other_xs: list[Any]) -> tuple[Any, Any]:
        last, ys, _ = _prefetch_forward(layer, length, unroll, cs, carry0, stacks, other_xs)
        return last, ys

    def fwd(cs: list[Any], carry0: list[Any], stacks: list[Any], other_xs: list[Any]) -> tuple[Any, Any]:
        last, ys, carries = _prefetch_forward(layer, length, unroll, cs, carry0, stacks, other_xs)
        if offload:  # the per-layer input carries wait in host memory for the backward pass
            carries = jax.device_put(carries, jax.memory.Space.Host)
        return (last, ys), (cs, stacks, other_xs, carries)

    def bwd(res: Any, ct: Any) -> tuple[Any, Any, Any, Any]:
        cs, stacks, other_xs, carries = res
        if offload:
            carries = jax.device_put(carries, jax.memory.Space.Device)
        return _prefetch_backward(layer, length, unroll, (cs, stacks, other_xs, carries), ct)

    run.defvjp(fwd, bwd)
    last, ys = run(ops.consts, ops.init, [l.shard for l in ops.leaves], ops.other_xs)
    return [*last, *ys]


def _while(eqn: Any, ins: list[Any], region: _Region) -> list[Any]:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], [_materialize(region, x) for x in ins[cn + bn:]]
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]

    def cond(carry: list[Any]) -> Any:
        inner = region.inner(remat=False, in_loop=True)
        return _materialize(inner, eval_jaxpr(cj.jaxpr, cj.consts, [*cconsts, *carry], inner)[0])

    def body(carry: list[Any]) -> list[Any]:
        inner = region.inner(remat=False, in_loop=True)
        return [_materialize(inner, o) for o in eval_jaxpr(bj.jaxpr, bj.consts, [*bconsts, *carry], inner)]

    return list(jax.lax.while_loop(cond, body, init))


def _cond(eqn: Any, ins: list[Any], region: _Region) -> list[Any]:
    """Each branch gathers what it uses (parameters enter the branches as closed-over shards)."""
    index, ops = _materialize(region, ins[0]), ins[1:]
    pos = [i for i, x in enumerate(ops) if not isinstance(x, Deferred)]

    def branch(closed: Any) -> Callable[..., list[Any]]:
        def fn(*arrays: Any) -> list[Any]:
            vals = list(ops)
            for i, a in zip(pos, arrays):
                vals[i] = a
            inner = region.inner(remat=region.remat, in_loop=region.in_loop)
            return [_materialize(inner, o) for o in eval_jaxpr(closed.jaxpr, closed.consts, vals, inner)]
        return fn

    return list(jax.lax.switch(index, [branch(b) for b in eqn.params["branches"]], *[ops[i] for i in pos]))


_RULES: dict[str, Callable[[Any, list[Any], _Region], list[Any]]] = {
    "scan": _scan,
    "remat2": _remat,
    "checkpoint": _remat,
    "jit": _inline("jaxpr"),
    "pjit": _inline("jaxpr"),
    "closed_call": _inline("call_jaxpr"),
    "core_call": _inline("call_jaxpr"),
    "while": _while,
    "cond": _cond,
}


# -- the entry point -----------------------------------------------------------------------------

def _is_shard(x: Any) -> bool:
    return isinstance(x, ParamShard)


def has_shards(params: Any) -> bool:
    return any(_is_shard(x) for x in jax.tree.leaves(params, is_leaf=_is_shard))


def gather_at_use(loss_fn: Callable[..., Any], prefetch: Prefetch | None = None, *,
                  forward_only: bool = False) -> Callable[..., Any]:
    """`loss_fn(params, *args, **kwargs)` written for whole parameters, callable with a parameter
    tree holding `ParamShard`s inside the step's `shard_map`: each one is gathered where it is used.

    Trees without `ParamShard`s (stages 0-2, replicated leaves only) call `loss_fn` directly.
    `prefetch`: scans over stacked parameters gather layer i+1 while layer i computes (`_scan`).
    `forward_only`: nothing differentiates the result (decoding), so a prefetched scan may carry
    integer state and runs as `_prefetch_ahead`.
    """
    def wrapped(params: Any, *args: Any, **kwargs: Any) -> Any:
        if not has_shards(params):
            return loss_fn(params, *args, **kwargs)
        p_leaves, p_tree = jax.tree.flatten(params, is_leaf=_is_shard)
        o_leaves, o_tree = jax.tree.flatten((args, kwargs))

        def whole_shape(x: Any) -> jax.ShapeDtypeStruct:
            if not _is_shard(x):
                return jax.ShapeDtypeStruct(x.shape, x.dtype)
            v = x.value
            dim = v.ndim + x.dim
            shape = tuple(s * _axis_size(x.wire) if i == dim else s for i, s in enumerate(v.shape))
            return jax.ShapeDtypeStruct(shape, v.dtype)

        def flat_loss(*flat: Any) -> Any:
            p = jax.tree.unflatten(p_tree, flat[:len(p_leaves)])
            a, kw = jax.tree.unflatten(o_tree, flat[len(p_leaves):])
            return loss_fn(p, *a, **kw)

        abstract = [whole_shape(x) for x in p_leaves] + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in o_leaves]
        closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(*abstract)
        inputs = [Deferred(x.value, x.value.ndim + x.dim, x.on_host, wire=x.wire, read=x.read) if _is_shard(x) else x
                  for x in p_leaves]
        top = _Region(remat=False, in_loop=False, prefetch=prefetch, forward_only=forward_only)
        outs = eval_jaxpr(closed.jaxpr, closed.consts, inputs + o_leaves, top)
        return jax.tree.unflatten(jax.tree.structure(out_shape), [_materialize(top, o) for o in outs])

    return wrapped


def find_layer_axes(loss_fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> Any:
    """Per parameter leaf, how many leading axes the loss scans over (0: used whole).

    Traces `loss_fn(params, *args)` (shapes only) and follows each parameter into `scan`s as a
    scanned operand, through `jit`, `remat` and nested scans. Pass the result to
    `zerojax.plan(..., layer_axes=...)` so `stage3_param_persistence_threshold` compares with one
    layer's slice of a stacked parameter.
    """
    from zerojax.core.sharded_init import abstract_params
    params = abstract_params(params)
    p_leaves, p_tree = jax.tree.flatten(params)
    o_leaves, o_tree = jax.tree.flatten((args, kwargs))

    def flat_loss(*flat: Any) -> Any:
        a, kw = jax.tree.unflatten(o_tree, flat[len(p_leaves):])
        return loss_fn(jax.tree.unflatten(p_tree, flat[:len(p_leaves)]), *a, **kw)

    sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in [*p_leaves, *o_leaves]]
    closed = jax.make_jaxpr(flat_loss)(*sds)
    depth: dict[Any, int] = {}

    def walk(jaxpr: Any, inputs: list[Any], level: int) -> None:
        """`inputs[i]`: the parameter index (or None) the jaxpr's i-th input is, at `level` axes."""
        env = {v: x for v, x in zip(jaxpr.invars, inputs) if x is not None}
        for eqn in jaxpr.eqns:
            ins = [env.get(v) if not isinstance(v, jcore.Literal) else None for v in eqn.invars]
            if not any(x is not None for x in ins):
                continue
            name = eqn.primitive.name
            if name == "scan":
                p = eqn.params
                nc, ncarry = scan_counts(p)
                inner = [x if i < nc or i >= nc + ncarry else None for i, x in enumerate(ins)]
                for i in range(nc + ncarry, len(ins)):
                    if ins[i] is not None:
                        depth[ins[i]] = max(depth.get(ins[i], 0), level + 1)
                walk(p["jaxpr"].jaxpr, inner, level + 1)
            elif name in ("jit", "pjit", "closed_call", "core_call"):
                sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                walk(sub.jaxpr, ins, level)
            elif name in ("remat2", "checkpoint"):
                walk(eqn.params["jaxpr"], ins, level)
            elif name in _ELEMENTWISE and len(eqn.outvars) == 1:
                src = [x for x in ins if x is not None]
                env[eqn.outvars[0]] = src[0]  # a cast of the parameter is still the parameter

    walk(closed.jaxpr, list(range(len(p_leaves))) + [None] * len(o_leaves), 0)
    return jax.tree.unflatten(p_tree, [depth.get(i, 0) for i in range(len(p_leaves))])
