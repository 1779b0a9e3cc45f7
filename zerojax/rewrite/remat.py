"""Activation checkpointing for a user's loss: every `lax.scan` body becomes a checkpointed layer.

The policy itself (`Remat`: what is saved, offloaded or recomputed) is `zerojax.core.remat`; this
module re-evaluates the loss's jaxpr to apply it where a stack of layers takes its JAX form
(`nnx.scan`, `lax.scan` over stacked weights), and gives a policy-less remat region of the loss's
own (`jax.checkpoint(f)`, `nnx.remat(f)`) the configured policy.

Relies on: no mesh axis (it runs wherever the loss runs: inside the step's `shard_map` before
`gather_at_use`); the result has the loss's value and gradients, only what the backward pass keeps
changes.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from zerojax.core.remat import Remat
from zerojax.rewrite.jaxpr_eval import bind, interpret, scan_counts

__all__ = ["for_loss"]


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
    nc, ncarry = scan_counts(p)
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
