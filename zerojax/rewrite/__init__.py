"""Every transformation of the user's loss, and the one place that reads JAX's jaxpr internals.

prepare.py        `prepare_loss(plan, loss_fn)`: the loss the step runs (the door to this folder)
jaxpr_eval.py     re-running a jaxpr equation by equation, with a rule per equation
remat.py          each `lax.scan` body of a loss checkpointed with the plan's policy
tensor_slices.py  the loss on each device's weight slices over `tensor` (Megatron's collectives)
tensor_pairs.py   which weights pair up (column -> row), read off a loss on shapes only
gather_at_use.py  each ZeRO-3-sharded parameter gathered where it is used, one layer per scan step

`zerojax.core` imports nothing from here (the step runs a `PreparedLoss`); a JAX upgrade that moves
`jax.extend.core` or a primitive's parameters breaks this folder and no other
(tests/test_architecture.py keeps both rules).
"""
from zerojax.rewrite.prepare import on_tensor_slices, prepare_loss

__all__ = ["prepare_loss", "on_tensor_slices"]
