"""The Pallas kernels against their jnp references, and their CUDA lowering on this CPU machine.

Interpret mode runs the kernel bodies (masked tails, in-place aliasing, one launch over many arrays)
on CPU. Sizes are odd and blocks small (128 elements) so every array spans several blocks and most
end in a partial one. The Mosaic GPU kernel (unmasked, TMA-clipped blocks, rsqrt instead of sqrt)
is interpreted too. The GPU build is checked by lowering for CUDA without a GPU: the lowering must
succeed and contain the kernel's custom call, with parameters and moments aliased in place.
"""
from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from zerojax.optim.transforms import ScaleByMomentsState, bias_corrections
from zerojax.optim.deepspeed import make_optimizer
from zerojax.pallas import multi_tensor
from zerojax.pallas.adam import AdamScalars, adam_update_pallas, adam_update_reference
from zerojax.pallas.loss_scale import grad_stats_pallas, grad_stats_reference

SHAPES = [(37,), (5, 41), (128,), (3, 7, 11), (300,), (0,), (1,)]
BLOCK = 128
REL = 1e-6
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "mosaic_gpu_v2"
# (backend, interpret): the Triton kernel interpreted, and the Mosaic GPU kernel interpreted.
FLAVOURS = {"triton": ("interpret", False), "mosaic": ("mosaic_gpu", True)}


def arrays(seed: int, dtype: Any = jnp.float32, scale: float = 1.0, positive: bool = False) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    out = []
    for shape in SHAPES:
        x = rng.normal(size=shape) * scale
        out.append(jnp.asarray(np.abs(x) if positive else x, dtype))
    return out


def state(grad_dtype: Any = jnp.float32) -> tuple[list[jax.Array], ...]:
    return (arrays(0), arrays(1, grad_dtype), arrays(2, scale=0.1), arrays(3, scale=0.01, positive=True))


def scalars(apply: float = 1.0, bias_correction: bool = True, grad_scale: float = 0.5) -> AdamScalars:
    b1, b2 = jnp.float32(0.9), jnp.float32(0.999)
    c1, c2 = bias_corrections(b1, b2, jnp.int32(3), bias_correction)
    return AdamScalars(lr=jnp.float32(1e-2), b1=b1, b2=b2, eps=jnp.float32(1e-8), weight_decay=jnp.float32(0.1),
                       c1=c1, c2=c2, grad_scale=jnp.float32(grad_scale), apply=jnp.float32(apply))


def assert_leaves_close(got: Any, want: Any, rel: float = REL, what: str = "") -> None:
    """Per array: max |got - want| <= rel * max |want| (elementwise ratios are meaningless where
    p - lr*u cancels to nearly 0)."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}[{i}]: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if w.size:
            err, scale = np.max(np.abs(g - w)), np.max(np.abs(w))
            assert err <= rel * scale, f"{what}[{i}] shape {w.shape}: max |diff| {err:.3g} > {rel} * {scale:.3g}"


# ------------------------------------------------------------------------------------------------
# Fused Adam.

@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("decoupled, grad_dtype", [(True, jnp.float32), (False, jnp.bfloat16), (True, jnp.float16)])
def test_adam_kernel_matches_reference(flavour: str, decoupled: bool, grad_dtype: Any) -> None:
    backend, interpret = FLAVOURS[flavour]
    p, g, m, v = state(grad_dtype)
    s = scalars()
    emit = jnp.bfloat16
    kernel = jax.jit(functools.partial(adam_update_pallas, decoupled=decoupled, emit=emit, backend=backend,
                                       block=BLOCK, interpret=interpret))
    got = kernel(p, g, m, v, s)
    want = adam_update_reference(p, g, m, v, s, decoupled=decoupled, emit=emit)
    for name, a, b in zip(("params", "mu", "nu"), got[:3], want[:3]):
        assert_leaves_close(a, b, what=name)
    # The compute-dtype copy is the new master rounded once.
    for cast, master in zip(got[3], got[0]):
        np.testing.assert_array_equal(np.asarray(cast, np.float32), np.asarray(master.astype(emit), np.float32))
    # The update really moved everything (a kernel that wrote nothing would fail above only by luck).
    assert all(np.max(np.abs(np.asarray(a) - np.asarray(b))) > 1e-5 for a, b in zip(got[0], p) if a.size)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_adam_kernel_skip_leaves_state_unchanged(flavour: str) -> None:
    """apply = 0 (a step skipped for non-finite gradients): p, m, v come back bit for bit."""
    backend, interpret = FLAVOURS[flavour]
    p, g, m, v = state()
    g = [x.at[(0,) * x.ndim].set(jnp.nan) if x.size else x for x in g]
    got = jax.jit(functools.partial(adam_update_pallas, decoupled=True, backend=backend, block=BLOCK,
                                    interpret=interpret))(p, g, m, v, scalars(apply=0.0))
    for new, old in zip(got[:3], (p, m, v)):
        for a, b in zip(new, old):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert got[3] is None


def test_adam_kernel_without_bias_correction() -> None:
    p, g, m, v = state()
    s = scalars(bias_correction=False)
    assert float(s.c1) == 1.0 and float(s.c2) == 1.0
    got = jax.jit(functools.partial(adam_update_pallas, decoupled=True, backend="interpret", block=BLOCK))(p, g, m, v, s)
    want = adam_update_reference(p, g, m, v, s, decoupled=True)
    for a, b in zip(got[:3], want[:3]):
        assert_leaves_close(a, b)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_reference_is_zerojax_adam(adam_w_mode: bool) -> None:
    """The reference computes the optax update zerojax.optim.transforms builds for DeepSpeed's Adam."""
    opt = zerojax.load_config({"train_batch_size": 8, "optimizer": {
        "type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": adam_w_mode}}}).optimizer
    tx = make_optimizer(opt, lambda count: jnp.float32(1e-2))
    p, g, _, _ = state()
    opt_state = tx.init(p)

    def moments(opt_state: Any) -> ScaleByMomentsState:
        return next(x for x in opt_state.inner_state if isinstance(x, ScaleByMomentsState))

    for _ in range(2):  # two updates, so the moments are non-zero going in
        before = moments(opt_state)
        updates, opt_state = tx.update(g, opt_state, p)
        p_new = [a + u for a, u in zip(p, updates)]
        c1, c2 = bias_corrections(jnp.float32(0.9), jnp.float32(0.999), moments(opt_state).count, True)
        s = AdamScalars(lr=jnp.float32(1e-2), b1=jnp.float32(0.9), b2=jnp.float32(0.999), eps=jnp.float32(1e-8),
                        weight_decay=jnp.float32(0.1), c1=c1, c2=c2, grad_scale=jnp.float32(1.0),
                        apply=jnp.float32(1.0))
        want = adam_update_reference(p, g, before.mu, before.nu, s, decoupled=adam_w_mode)
        assert_leaves_close(want[0], p_new, what="params")
        assert_leaves_close(want[1], moments(opt_state).mu, what="mu")
        assert_leaves_close(want[2], moments(opt_state).nu, what="nu")
        p = p_new


def test_adam_kernel_rejects_low_precision_state() -> None:
    p, g, m, v = state()
    with pytest.raises(ValueError, match="mu must be float32"):
        adam_update_pallas(p, g, [x.astype(jnp.bfloat16) for x in m], v, scalars(), decoupled=True,
                           backend="interpret")


# ------------------------------------------------------------------------------------------------
# Loss-scale statistics.

@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_grad_stats_match_reference(flavour: str, dtype: Any) -> None:
    backend, interpret = FLAVOURS[flavour]
    grads = arrays(5, dtype, scale=64.0)
    grads[1] = grads[1].at[4, 40].set(jnp.inf)          # in the tail block
    grads[4] = grads[4].at[7].set(jnp.nan).at[299].set(-jnp.inf)
    inv_scale = jnp.float32(1 / 256)
    got = jax.jit(functools.partial(grad_stats_pallas, backend=backend, block=BLOCK, interpret=interpret))(
        grads, inv_scale)
    want = grad_stats_reference(grads, inv_scale)
    assert [float(x) for x in got[1]] == [float(x) for x in want[1]] == [0, 1, 0, 0, 2, 0, 0]
    for i, (a, b) in enumerate(zip(got[0], want[0])):
        if np.isfinite(float(b)):
            np.testing.assert_allclose(float(a), float(b), rtol=REL, err_msg=f"sum of squares [{i}]")
        else:
            assert not np.isfinite(float(a)), i
    assert float(got[0][0]) > 0


def test_grad_stats_unscale() -> None:
    """The sums are of the unscaled gradient: scaling inv_scale by 2 scales them by 4."""
    grads = arrays(6)
    one = grad_stats_pallas(grads, jnp.float32(1.0), backend="interpret", block=BLOCK)[0]
    two = grad_stats_pallas(grads, jnp.float32(2.0), backend="interpret", block=BLOCK)[0]
    for a, b in zip(one, two):
        np.testing.assert_allclose(float(b), 4 * float(a), rtol=REL)


# ------------------------------------------------------------------------------------------------
# One launch over many arrays.

def test_segments_cover_every_block_once() -> None:
    segs = multi_tensor.segments([37, 205, 128, 0, 300], 128)
    assert [(s.start, s.blocks) for s in segs] == [(0, 1), (1, 2), (3, 1), (4, 0), (4, 3)]


# ------------------------------------------------------------------------------------------------
# CUDA lowering on a CPU-only machine.

def custom_calls(text: str) -> list[str]:
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


def lower_for_cuda(fn: Any, *args: Any) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_adam_lowers_for_cuda_with_triton_as_one_launch_in_place() -> None:
    p, g, m, v = state(jnp.bfloat16)
    text = lower_for_cuda(functools.partial(adam_update_pallas, decoupled=True, emit=jnp.bfloat16, backend="triton"),
                          p, g, m, v, scalars())
    calls = custom_calls(text)
    assert len(calls) == 1 and TRITON_CALL in calls[0]
    n = sum(1 for x in p if x.size)
    # p, m and v of every array are written over their inputs.
    assert len(re.findall(r"stablehlo.output_operand_alias<", calls[0])) == 3 * n
    assert "num_warps = 4" in calls[0]


def test_grad_stats_lower_for_cuda_with_triton() -> None:
    grads = arrays(7, jnp.float16)
    calls = custom_calls(lower_for_cuda(functools.partial(grad_stats_pallas, backend="triton"), grads,
                                        jnp.float32(0.5)))
    assert len(calls) == 1 and TRITON_CALL in calls[0]


def test_many_arrays_split_into_few_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multi_tensor, "MAX_ARRAYS_PER_LAUNCH", 4)
    grads = [jnp.ones((3 + i,), jnp.float32) for i in range(9)]
    calls = custom_calls(lower_for_cuda(functools.partial(grad_stats_pallas, backend="triton"), grads,
                                        jnp.float32(1.0)))
    assert len(calls) == 3


def test_kernels_lower_for_cuda_with_mosaic_gpu() -> None:
    """Mosaic GPU lowers too: one launch per array (its block pipeline would copy every operand)."""
    p, g, m, v = state(jnp.bfloat16)
    n = sum(1 for x in p if x.size)
    adam = custom_calls(lower_for_cuda(functools.partial(adam_update_pallas, decoupled=True, emit=jnp.bfloat16,
                                                         backend="mosaic_gpu"), p, g, m, v, scalars()))
    stats = custom_calls(lower_for_cuda(functools.partial(grad_stats_pallas, backend="mosaic_gpu"), g,
                                        jnp.float32(1.0)))
    assert len(adam) == len(stats) == n
    assert all(MOSAIC_CALL in c for c in adam + stats)
    assert all(len(re.findall(r"stablehlo.output_operand_alias<", c)) == 3 for c in adam)
