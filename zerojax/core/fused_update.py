"""The fused kernels inside the ZeRO update: each device runs them on its own shards.

A Pallas kernel is a custom call the SPMD partitioner cannot split (left to it, XLA would gather
the operands and run the kernel on whole arrays). So both kernels run inside `jax.shard_map` over
the whole mesh with the plan's `update` specs, the placement gradients arrive in and master weights
and optimizer state live in: no data moves in or out of the kernels. Adam is elementwise, so a
device's blocks are all it needs, whatever axes split them.

A device holds a block of each leaf: its update spec splits the leaf over some mesh axes (the data
axes where ZeRO shards it, and the leaf's `split` axes: a pipeline's `stage`, `tensor`, `expert`) and
copies it over the others. So a leaf's partial statistics are summed over exactly the axes its spec
names, and a leaf no axis splits counts once. Leaves that name the same axes share one `psum`. The
shard_maps run with `check_vma=False` so that one launch can take every kind of leaf; that is exact
because a leaf's results are the same on every device that holds the same block of it.

A plan whose layout stores some values more than once inside one leaf (a pipeline's rows with a
tensor axis copy whole leaves into every tensor slice) carries its own norm (`rule.norm`, which
counts each value once); per-leaf sums cannot see that, so such a plan's norm is the rule's, read
under the automatic partitioner, and the kernel gives the finiteness only.

The optimizer state keeps optax's structure exactly (`tx.init`'s pytree): the fused path reads
Adam's moments out of it and writes them back in place, and advances its scalar bookkeeping (update
counts, the schedule's hyperparameters) by running the optax transform itself on empty arrays.
So checkpoints, layouts and everything else cannot tell which path produced a state.

Relies on: every axis of the plan's mesh (the `update` specs name which split a leaf); the kernels
themselves (`zerojax.pallas`) know no plan and no mesh.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zerojax.core.layout import Plan
from zerojax.optim.transforms import ScaleByMomentsState, bias_corrections
from zerojax.pallas.adam import AdamScalars, adam_update_pallas
from zerojax.pallas.backend import XLA
from zerojax.pallas.loss_scale import grad_stats_pallas


class GradStats(NamedTuple):
    """Statistics of the unscaled gradients over all devices.

    norm:        global L2 norm (what clipping reads).
    leaf_finite: one bool per trainable parameter leaf (tree order): no inf/NaN anywhere in it.
    """
    norm: jax.Array
    leaf_finite: jax.Array


def split_axes(spec: P, mesh_axes: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec splits its array over, in mesh order (a block differs along
    each of them; along every other axis the devices hold copies)."""
    named: set[str] = set()
    for entry in spec:
        named.update(() if entry is None else (entry,) if isinstance(entry, str) else entry)
    return tuple(a for a in mesh_axes if a in named)


def sum_groups(plan: Plan) -> tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]:
    """Leaf indices (tree order) grouped by the mesh axes their update blocks split them over:
    one `psum` per distinct set of axes; leaves no axis splits are whole on every device."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, sharding in enumerate(jax.tree.leaves(plan.update_shardings)):
        groups.setdefault(split_axes(sharding.spec, plan.mesh.axis_names), []).append(i)
    return tuple((axes, tuple(leaves)) for axes, leaves in groups.items() if axes)


def _find_moments(opt_state: Any) -> ScaleByMomentsState:
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScaleByMomentsState))
             if isinstance(x, ScaleByMomentsState)]
    if len(found) != 1:
        raise ValueError(f"fused Adam: expected one ScaleByMomentsState in the optimizer state, found {len(found)}")
    return found[0]


def _replace_moments(opt_state: Any, moments: ScaleByMomentsState) -> Any:
    return jax.tree.map(lambda x: moments if isinstance(x, ScaleByMomentsState) else x, opt_state,
                        is_leaf=lambda x: isinstance(x, ScaleByMomentsState))


def _empty(x: Any) -> jax.Array:
    return jnp.zeros((0,), x.dtype)


class FusedUpdate:
    """The kernel path of the update for one plan; `plan.kernels` picks the Pallas backend."""

    def __init__(self, plan: Plan):
        if plan.kernels == XLA:
            raise ValueError("FusedUpdate: the plan resolved kernels to xla")
        settings = plan.rule.adam
        if settings is None:
            raise ValueError("FusedUpdate: the plan's optimizer is not Adam; the fused kernel runs Adam only")
        self.plan, self.settings, self.backend = plan, settings, plan.kernels
        self._groups = sum_groups(plan)
        self._specs = plan.update_specs
        self._treedef = jax.tree.structure(plan.abstract_trained)  # frozen leaves have no update

    # -- loss-scale kernel ------------------------------------------------------------------------
    def grad_stats(self, grads: Any, inv_scale: jax.Array | float = 1.0) -> GradStats:
        """Norm and finiteness of `grads * inv_scale` (grads in the update placement, any float dtype)."""
        inv_scale = jnp.asarray(inv_scale, jnp.float32)
        per_leaf = jax.shard_map(self._local_stats, mesh=self.plan.mesh, in_specs=(self._specs, P()),
                                 out_specs=P(), check_vma=False)(grads, inv_scale)
        return GradStats(norm=self._norm(per_leaf[0], grads, inv_scale), leaf_finite=per_leaf[1] == 0)

    def _norm(self, sumsq: jax.Array, grads: Any, inv_scale: jax.Array) -> jax.Array:
        """The global norm from the leaves' sums of squares; a plan with its own norm (a layout that
        holds copies inside a leaf, which per-leaf sums would count again) has that read instead,
        one more pass over the gradients under the automatic partitioner."""
        if self.plan.rule.norm is None:
            return jnp.sqrt(jnp.sum(sumsq))
        return self.plan.rule.norm(jax.tree.map(lambda g: g.astype(jnp.float32) * inv_scale, grads))

    def _local_stats(self, grads: Any, inv_scale: jax.Array) -> jax.Array:
        """Per leaf (sum of squares, non-finite count) of the whole leaf, from this device's blocks."""
        sumsq, bad = grad_stats_pallas(jax.tree.leaves(grads), inv_scale, backend=self.backend)
        local = jnp.stack([jnp.stack(sumsq), jnp.stack(bad)])          # (2, leaves)
        whole = local
        for axes, leaves in self._groups:
            cols = jnp.asarray(leaves)
            # invariant: the blocks of these leaves along `axes` partition them (each element is on
            # exactly one device of every group along `axes`), so their partial sums add up to the
            # leaf's; along the other axes the devices hold copies and are not added.
            whole = whole.at[:, cols].set(jax.lax.psum(local[:, cols], axes))
        return whole

    # -- fused Adam -------------------------------------------------------------------------------
    def adam(self, grads: Any, master: Any, opt_state: Any, *, grad_scale: jax.Array | float = 1.0,
             apply: jax.Array | bool = True, emit: Any = None) -> tuple[Any, Any, Any]:
        """One Adam/AdamW update of the fp32 `master` shards, equal to `tx.update` + apply_updates.

        `grad_scale` multiplies the gradients as they are read (1/loss scale times the clipping
        coefficient). Where `apply` is false the step is skipped: master and the whole optimizer
        state come back unchanged. Returns (master, opt_state, master cast to `emit` or None).
        """
        tx, st = self.plan.tx, self.settings
        apply = jnp.asarray(apply, jnp.bool_)
        # Scalar bookkeeping: optax's own update on empty parameter leaves (no parameter work).
        hollow = optax.tree_utils.tree_map_params(tx, _empty, opt_state)
        empties = jax.tree.map(_empty, master)
        _, advanced = tx.update(empties, hollow, empties)
        hyper = advanced.hyperparams
        count = _find_moments(advanced).count
        advanced = jax.tree.map(lambda new, old: jnp.where(apply, new, old), advanced, hollow)
        c1, c2 = bias_corrections(hyper["b1"], hyper["b2"], count, st.bias_correction)
        scalars = AdamScalars(lr=hyper["learning_rate"], b1=hyper["b1"], b2=hyper["b2"],
                              eps=jnp.float32(st.eps), weight_decay=jnp.float32(st.weight_decay),
                              c1=c1, c2=c2, grad_scale=jnp.asarray(grad_scale, jnp.float32),
                              apply=apply.astype(jnp.float32))
        moments = _find_moments(opt_state)
        tree = self._treedef

        def local(master: Any, grads: Any, mu: Any, nu: Any, s: AdamScalars) -> tuple[Any, ...]:
            p, m, v, cast = adam_update_pallas(jax.tree.leaves(master), jax.tree.leaves(grads),
                                               jax.tree.leaves(mu), jax.tree.leaves(nu), s,
                                               decoupled=st.decoupled, emit=emit, backend=self.backend)
            out = (jax.tree.unflatten(tree, p), jax.tree.unflatten(tree, m), jax.tree.unflatten(tree, v))
            return out + ((jax.tree.unflatten(tree, cast),) if emit is not None else ())

        specs = self._specs
        n_out = 4 if emit is not None else 3
        outs = jax.shard_map(local, mesh=self.plan.mesh, in_specs=(specs, specs, specs, specs, P()),
                             out_specs=(specs,) * n_out, check_vma=False)(
            master, grads, moments.mu, moments.nu, scalars)
        new_master, mu, nu = outs[:3]
        new_moments = _find_moments(advanced)._replace(mu=mu, nu=nu)
        return new_master, _replace_moments(advanced, new_moments), (outs[3] if emit is not None else None)
