"""The maths of a ZeRO training step, over a Plan: mesh axes, per-leaf layouts, collectives, the
train state and the one jitted step. Nothing here reads the DeepSpeed config (the planner does), and
nothing here rewrites the user's loss or reads JAX's jaxpr internals (`zerojax.rewrite` does: the step
runs the `PreparedLoss` it is given)."""
