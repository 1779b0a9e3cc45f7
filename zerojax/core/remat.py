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
user's loss (`zerojax.rewrite.remat.for_loss`, which re-evaluates its jaxpr), the body of every `lax.scan` in it - the form a stack of layers takes in
JAX (`nnx.scan`, `lax.scan` over stacked weights). A remat region the loss marks itself without a
policy (`jax.checkpoint(f)`, `nnx.remat(f)`) gets the configured one.

`partition_activations`, `contiguous_memory_optimization`, `number_checkpoints`,
`synchronize_checkpoint_boundary` and `profile` have no JAX counterpart (zerojax/config/status.py
says why for each). `zerojax.planner.settings.remat_policy` reads the section into a `Remat`.

Relies on: no mesh axis; only JAX's public checkpoint policies and their return values
(`jax.ad_checkpoint.Offloadable` / `Recompute`), no jaxpr internals.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.ad_checkpoint import Offloadable, Recompute, checkpoint_name

__all__ = ["POLICIES", "LAYER_INPUT", "Remat", "name_layer_input"]

# What `activation_checkpointing.policy` may name (the config's choices are these).
POLICIES = ("nothing", "dots_no_batch", "dots", "everything")
# The name every checkpointed layer gives its input, so an offloading policy can move it to the host.
LAYER_INPUT = "zerojax_layer_input"
HOST = "pinned_host"


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
        keep = (prim.name == "name" and params.get("name") == LAYER_INPUT) or (
            self.save in ("dots", "dots_no_batch") and _is_dot(prim, params, self.save == "dots_no_batch"))
        return Offloadable(src="device", dst=HOST) if keep else Recompute


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
