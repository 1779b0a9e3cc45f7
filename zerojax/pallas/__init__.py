"""Fused optimizer kernels in Pallas, each beside a plain jnp reference with the same signature.

adam.py        fused Adam/AdamW over master weights, gradients and moments, in place
loss_scale.py  gradient statistics for the loss scaler and clipping (sum of squares, inf/NaN count)
multi_tensor.py  one launch over many arrays, block by block (the kernels' shared driver)
backend.py     which implementation the `kernels` config key selects (no Pallas import)
selfcheck.py   the kernels checked against the references on a backend before `auto` uses them
ptx.py         the Triton IR compiled to PTX/cubin without a GPU (optional `triton` package)

Pallas itself is imported only when a kernel is traced. The kernels know no plan and no mesh: the ZeRO
update that runs them on each device's shards is `zerojax.core.fused_update`.
"""
