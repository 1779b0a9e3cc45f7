"""Activation checkpointing: DeepSpeed's `activation_checkpointing` section as JAX remat policies.

DeepSpeed's `deepspeed.checkpointing.checkpoint(layer, x)` keeps a layer's input and recomputes the
rest of its forward pass in the backward pass; `cpu_checkpointing` moves those kept inputs to CPU
memory. In JAX the same is `jax.checkpoint` over the layer with a *policy* that says which
intermediate values are kept (saved), moved to host memory (offloaded) or recomputed:

* `policy` (zerojax's key): `nothing` keeps only each layer's input (DeepSpeed's checkpoint),
  `dots_no_batch` also the outputs of matmuls without batch dimensions (the linear layers, not the
  attention scores), `dots` the outputs of every matmul, `everything` all of them (no
  recomputation: the same as no checkpointing). null: the model decides (the embedded GPT follows
  `model.remat`, a user's loss runs as written), unless `cpu_checkpointing` asks for offload, which
  implies `nothing`.
* `cpu_checkpointing`: what the policy keeps goes to host memory (`pinned_host`) instead of
  staying on the device, and comes back in the backward pass.

The checkpointed function is one layer of a scanned stack: the embedded GPT's block, and, for a
user's loss (`for_loss`), the body of every `lax.scan` in it - the form a stack of layers takes in
JAX (`nnx.scan`, `lax.scan` over stacked weights). A remat region the loss marks itself without a
policy (`jax.checkpoint(f)`, `nnx.remat(f)`) gets the configured one.

`partition_activations`, `contiguous_memory_optimization`, `number_checkpoints`,
`synchronize_checkpoint_boundary` and `profile` have no JAX counterpart (zerojax/config/status.py
says why for each). `zerojax.planner.settings.remat_policy` reads the section into a `Remat`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from zerojax.rewrite.jaxpr_eval import bind, interpret

__all__ = ["POLICIES", "LAYER_INPUT", "Remat", "for_loss"]

# What `activation_checkpointing.policy` may name (the config's choices are these).
POLICIES = ("nothing", "dots_no_batch", "dots", "everything")
# The name every checkpointed layer gives its input, so an offloading policy can move it to the host.
LAYER_INPUT = "zerojax_layer_input"
HOST = "pinned_host"


def _pe() -> Any:
    # Saveable / Offloadable / Recompute: the values a remat policy returns besides a bool; jax
    # exports them only through its own policies (jax.checkpoint_policies.save_and_offload_*).
    from jax._src.interpreters import partial_eval
    return partial_eval


def _is_dot(prim: Any, params: dict[str, Any], no_batch: bool) -> bool:
    if prim.name == "dot_general":
        if not no_batch:
            return True
        (_, _), (lhs_b, rhs_b) = params["dimension_numbers"]
        return not lhs_b and not rhs_b
    return not no_batch and prim.name == "conv_general_dilated"


@dataclasses.dataclass(frozen=True)
class _OffloadPolicy:
    """What `save` keeps, plus every layer's input, offloaded to host memory; the rest recomputed."""
    save: str

    def __call__(self, prim: Any, *_: Any, **params: Any) -> Any:
        pe = _pe()
        keep = (prim.name == "name" and params.get("name") == LAYER_INPUT) or (
            self.save in ("dots", "dots_no_batch") and _is_dot(prim, params, self.save == "dots_no_batch"))
        return pe.Offloadable(src="device", dst=HOST) if keep else pe.Recompute


@dataclasses.dataclass(frozen=True)
class Remat:
    """A resolved activation-checkpointing choice: `save` (one of POLICIES) and `offload`."""
    save: str = "nothing"
    offload: bool = False

    @property
    def policy(self) -> Callable[..., Any]:
        """The `jax.checkpoint` policy."""
        if self.offload:
            return _OffloadPolicy(self.save)
        cp = jax.checkpoint_policies
        return {"nothing": cp.nothing_saveable, "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
                "dots": cp.dots_saveable, "everything": cp.everything_saveable}[self.save]

    def wrap(self, layer: Callable[..., Any], *, prevent_cse: bool = True) -> Callable[..., Any]:
        """`layer(x, *rest)` checkpointed with this policy; its first argument is named LAYER_INPUT."""
        if self.save == "everything" and not self.offload:
            return layer

        def named(x: Any, *rest: Any) -> Any:
            return layer(name_layer_input(x), *rest)

        return jax.checkpoint(named, policy=self.policy, prevent_cse=prevent_cse)


def name_layer_input(x: Any) -> Any:
    """Name the floating-point leaves of `x` LAYER_INPUT (what an offloading policy moves)."""
    def one(v: Any) -> Any:
        return checkpoint_name(v, LAYER_INPUT) if jax.numpy.issubdtype(v.dtype, jax.numpy.inexact) else v
    return jax.tree.map(one, x)


# -- a user's loss: every scan body becomes a checkpointed layer ---------------------------------

def for_loss(remat: Remat | None, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`loss_fn` with `remat` applied to each `lax.scan` body in it (and to its own policy-less
    remat regions); `loss_fn` itself when `remat` is None.

    The loss is traced once per call to a jaxpr (on the values it is given, so shard_map's types
    are kept) and evaluated again with each scan body wrapped in `jax.checkpoint`. The result has
    the same value and gradients; only what the backward pass keeps changes. Under ZeRO-3
    `gather_at_use` then sees each scan body as a rematerialized region (one gather per layer,
    replayed in the backward pass).
    """
    if remat is None:
        return loss_fn

    @functools.wraps(loss_fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree.flatten((args, kwargs))

        def flat(*xs: Any) -> Any:
            a, kw = jax.tree.unflatten(tree, xs)
            return loss_fn(*a, **kw)

        closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
        outs = _eval(closed.jaxpr, closed.consts, leaves, remat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


def _eval(jaxpr: Any, consts: Any, args: Any, remat: Remat) -> list[Any]:
    return interpret(jaxpr, consts, args, lambda eqn, ins: _equation(eqn, ins, remat))


def _equation(eqn: Any, ins: list[Any], remat: Remat) -> list[Any]:
    name = eqn.primitive.name
    if name == "scan":
        return _scan(eqn, ins, remat)
    if name in ("checkpoint", "remat2"):
        return _region(eqn, ins, remat)
    if name in ("pjit", "jit"):
        sub = eqn.params["jaxpr"]
        return _eval(sub.jaxpr, sub.consts, ins, remat)
    if name in ("closed_call", "core_call"):
        sub = eqn.params["call_jaxpr"]
        return _eval(sub.jaxpr, getattr(sub, "consts", ()), ins, remat)
    return bind(eqn, ins)


def _scan(eqn: Any, ins: list[Any], remat: Remat) -> list[Any]:
    """The scan with its body checkpointed: one iteration is one layer; its carry is the layer input."""
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    body = p["jaxpr"]

    def layer(carry: list[Any], cs: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = _eval(body.jaxpr, body.consts, [*cs, *carry, *x], remat)
        return outs[:ncarry], outs[ncarry:]

    # Consts (often the weights) are arguments, not closed over, so the policy sees them as inputs.
    ckpt = remat.wrap(layer)

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        return ckpt(carry, consts, x)

    carry, ys = jax.lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


def _region(eqn: Any, ins: list[Any], remat: Remat) -> list[Any]:
    """A remat region of the loss's own: its policy if it set one, the configured one otherwise."""
    p = eqn.params
    policy = p["policy"] if p["policy"] is not None else remat.policy

    def fn(*args: Any) -> list[Any]:
        return _eval(p["jaxpr"], (), list(args), remat)

    return list(jax.checkpoint(fn, policy=policy, prevent_cse=p["prevent_cse"])(*ins))
