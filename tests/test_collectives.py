"""Placements and the moves between them, inside shard_map over the 8-device `data` axis."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import data_mesh
from zerojax.core.collectives import (PARTIAL, REPLICATED, ParamShard, Shard, gather, gathers_params, is_gathering, move, to_varying, unwrap, zeros_like_local)
from zerojax.core.mesh import DATA

N = 8
MESH = data_mesh()


def smap(f: Any, in_specs: Any, out_specs: Any) -> Any:
    return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs))


def per_device(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """One different array per device, stacked on a leading axis of size N."""
    return np.random.default_rng(seed).normal(size=(N, *shape)).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# move

def test_partial_to_replicated_is_the_sum() -> None:
    xs = per_device((16, 24))
    f = smap(lambda x: move(x[0], PARTIAL, REPLICATED), P(DATA), P())
    np.testing.assert_allclose(f(xs), xs.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 1])
def test_partial_to_shard_is_a_reduce_scatter(dim: int) -> None:
    xs = per_device((16, 24), seed=dim)
    out = P(*[DATA if d == dim else None for d in range(2)])
    f = smap(lambda x: move(x[0], PARTIAL, Shard(dim)), P(DATA), out)
    y = f(xs)
    np.testing.assert_allclose(y, xs.sum(0), rtol=1e-5, atol=1e-5)
    # Device i holds block i of the sum along `dim`.
    for shard in y.addressable_shards:
        i = shard.index[dim].start // (xs.shape[1 + dim] // N)
        block = np.take(xs.sum(0), range(i * xs.shape[1 + dim] // N, (i + 1) * xs.shape[1 + dim] // N), axis=dim)
        np.testing.assert_allclose(shard.data, block, rtol=1e-5, atol=1e-5)
    assert "reduce-scatter" in f.lower(xs).compile().as_text()


@pytest.mark.parametrize("dim", [0, 1])
def test_replicated_to_shard_slices_and_back(dim: int) -> None:
    x = per_device((16, 24))[0]
    spec = P(*[DATA if d == dim else None for d in range(2)])
    sliced = smap(lambda v: move(v, REPLICATED, Shard(dim)), P(), spec)(x)
    np.testing.assert_array_equal(sliced, x)
    assert sliced.sharding.shard_shape(x.shape)[dim] == x.shape[dim] // N
    # Every device ends up with the whole array (one copy per device, stacked).
    copies = smap(lambda v: move(v, Shard(dim), REPLICATED)[None], spec, P(DATA))(sliced)
    np.testing.assert_array_equal(copies, np.broadcast_to(x, (N, *x.shape)))
    assert "all-gather" in smap(lambda v: move(v, Shard(dim), REPLICATED)[None], spec, P(DATA)).lower(
        sliced).compile().as_text()


def test_shard_to_replicated_is_typed_replicated() -> None:
    """BUG (zerojax/collectives.py, move): Shard -> REPLICATED uses a plain `all_gather`, whose
    result shard_map types as *varying*, unlike PARTIAL -> REPLICATED (psum, invariant). So a
    REPLICATED value from `move` cannot leave shard_map through `out_specs=P()` (check_vma rejects
    it), and a later psum of it would count it N times. Fix: gather with
    `jax.lax.all_gather(x, axis, axis=src.dim, tiled=True, to="invarying")`.
    (`gather` for ParamShard must keep the varying all_gather: its transpose is the reduce-scatter.)
    """
    x = per_device((16, 24))[0]
    whole = smap(lambda v: move(v, Shard(1), REPLICATED), P(None, DATA), P())(x)
    np.testing.assert_array_equal(whole, x)


def test_same_placement_is_identity_and_bad_moves_raise() -> None:
    x = jnp.ones((8, 8))
    for placement in (PARTIAL, REPLICATED, Shard(0), Shard(1)):
        assert move(x, placement, placement) is x
    assert Shard(1) == Shard(1) and Shard(0) != Shard(1)
    assert repr(PARTIAL) == "PARTIAL" and repr(REPLICATED) == "REPLICATED"
    for src, dst in ((REPLICATED, PARTIAL), (Shard(0), PARTIAL), (Shard(0), Shard(1))):
        with pytest.raises(ValueError, match="no move"):
            move(x, src, dst)


def test_comm_dtype_casts_the_payload_only() -> None:
    xs = np.full((N, 8), 1 / 3, np.float32)       # 8/3 is not a bf16 number
    exact = smap(lambda x: move(x[0], PARTIAL, REPLICATED), P(DATA), P())(xs)
    low = smap(lambda x: move(x[0], PARTIAL, REPLICATED, comm_dtype=jnp.bfloat16), P(DATA), P())(xs)
    assert exact.dtype == low.dtype == jnp.float32
    np.testing.assert_allclose(exact, 8 / 3, rtol=1e-6)
    np.testing.assert_allclose(low, 8 / 3, rtol=1e-2)   # bf16 has 8 bits of mantissa
    assert float(jnp.max(jnp.abs(low - exact))) > 1e-4  # the payload really went through bf16


# ------------------------------------------------------------------------------------------------
# ParamShard / gather

def test_param_shard_is_a_pytree_and_gather_passes_other_leaves() -> None:
    s = ParamShard(jnp.zeros((4, 3)), -1)
    leaves, treedef = jax.tree.flatten({"a": s, "b": jnp.ones(2)})
    assert len(leaves) == 2
    back = jax.tree.unflatten(treedef, leaves)
    assert isinstance(back["a"], ParamShard) and back["a"].dim == -1
    assert "dim=-1" in repr(s)
    tree = {"a": s, "b": jnp.ones(2), "c": 3}
    assert unwrap(tree)["a"] is s.value
    # Outside ZeRO-3 there is nothing to gather: gather is the identity.
    plain = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
    assert gather(plain)["w"] is plain["w"]


@pytest.mark.parametrize("dim", [-1, -2])
def test_gather_rebuilds_the_whole_parameter(dim: int) -> None:
    w = per_device((16, 24))[0]
    spec = P(DATA, None) if dim == -2 else P(None, DATA)
    # gather's result stays typed per-device (its transpose must be a reduce-scatter): one copy each.
    f = smap(lambda v: gather({"w": ParamShard(v, dim), "other": v})["w"][None], spec, P(DATA))
    np.testing.assert_array_equal(f(w), np.broadcast_to(w, (N, *w.shape)))


def test_param_shard_dim_survives_scan_over_stacked_layers() -> None:
    """`dim` counts from the end, so lax.scan slicing the leading layer axis keeps it right."""
    w = per_device((16, 24))[:3]   # 3 stacked layers

    def local(v: jax.Array) -> jax.Array:
        def body(c: None, layer: ParamShard) -> tuple[None, jax.Array]:
            assert isinstance(layer, ParamShard) and layer.value.shape == (16, 24 // N)
            return c, gather(layer)
        _, ys = jax.lax.scan(body, None, ParamShard(v, -1))
        return ys

    ys = smap(lambda v: local(v)[None], P(None, None, DATA), P(DATA))(w)
    np.testing.assert_array_equal(ys, np.broadcast_to(w, (N, *w.shape)))


def test_gather_gradient_is_the_reduce_scattered_sum() -> None:
    """d/dW of sum_d loss_d(gather(W_shard)) arrives on device d as block d of sum_d grad loss_d."""
    w = per_device((16, 24), seed=1)[0] * 0.3
    xs = per_device((5, 16), seed=2)

    def loss(wfull: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(x @ wfull) ** 2)

    def local(w_shard: jax.Array, x: jax.Array) -> jax.Array:
        return jax.grad(lambda v: loss(gather(ParamShard(v, -1)), x[0]))(w_shard)

    g = smap(local, (P(None, DATA), P(DATA)), P(None, DATA))(w, xs)
    want = jax.grad(lambda v: sum(loss(v, xs[d]) for d in range(N)))(jnp.asarray(w))
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
    # Moving it again as if it were PARTIAL would count it twice: the step must not.
    assert g.sharding.shard_shape(g.shape) == (16, 24 // N)


# ------------------------------------------------------------------------------------------------
# The replicated-input trap

def test_to_varying_keeps_the_gradient_partial() -> None:
    """shard_map sums the gradient of a replicated (P()) input over the axis by itself; after
    `to_varying` it stays per-device (PARTIAL), so exactly one explicit reduction is right."""
    w = per_device((16, 24), seed=3)[0] * 0.3
    xs = per_device((5, 16), seed=4)

    def loss(v: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(x @ v) ** 2)

    per_dev = np.stack([jax.grad(loss)(jnp.asarray(w), xs[d]) for d in range(N)])

    implicit = smap(lambda v, x: jax.grad(loss)(v, x[0]), (P(), P(DATA)), P())(w, xs)
    np.testing.assert_allclose(implicit, per_dev.sum(0), rtol=1e-5, atol=1e-5)

    partial = smap(lambda v, x: jax.grad(loss)(to_varying(v), x[0])[None], (P(), P(DATA)), P(DATA))(w, xs)
    np.testing.assert_allclose(partial, per_dev, rtol=1e-5, atol=1e-5)

    reduced = smap(lambda v, x: move(jax.grad(loss)(to_varying(v), x[0]), PARTIAL, Shard(1)),
                   (P(), P(DATA)), P(None, DATA))(w, xs)
    np.testing.assert_allclose(reduced, per_dev.sum(0), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Small helpers

def test_zeros_like_local() -> None:
    assert zeros_like_local((16, 24), jnp.float32, Shard(1), N).shape == (16, 3)
    assert zeros_like_local((16, 24), jnp.bfloat16, Shard(0), N).shape == (2, 24)
    assert zeros_like_local((16, 24), jnp.float32, PARTIAL, N).shape == (16, 24)
    z = zeros_like_local((4,), jnp.bfloat16, REPLICATED, N)
    assert z.shape == (4,) and z.dtype == jnp.bfloat16 and not z.any()


def test_gathers_params_marks_the_function() -> None:
    def f(params: Any, batch: Any) -> Any:
        return 0.0
    assert not is_gathering(f)
    assert gathers_params(f) is f and is_gathering(f)
