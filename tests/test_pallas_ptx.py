"""The Triton kernels compile past lowering, to PTX and cubin for sm_80 and sm_90, without spills.

Needs the optional `triton` package (it brings ptxas); skipped without it. The IR compiled is the one
the lowered ZeRO update carries in its Triton custom calls, with their own num_warps/num_stages.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from zerojax.pallas import ptx  # noqa: E402

SHARED_LIMIT = 48 * 1024   # bytes of shared memory a kernel may use without opting in


@pytest.fixture(scope="module")
def kernels() -> list[ptx.Kernel]:
    return ptx.zero_kernels()


def test_the_update_launches_both_kernels(kernels: list[ptx.Kernel]) -> None:
    assert sorted(k.name for k in kernels) == ["fused_adam", "grad_stats"]
    assert all(k.num_warps == 4 and k.num_stages == 1 for k in kernels)


@pytest.mark.parametrize("capability", ptx.TARGETS)
def test_each_kernel_builds_a_cubin_without_spills(kernels: list[ptx.Kernel], capability: int) -> None:
    for kernel in kernels:
        b = ptx.build(kernel, capability)
        assert b.arch.startswith(f"sm_{capability}"), b
        assert b.cubin_bytes > 0, b
        assert b.spill_stores == 0 and b.spill_loads == 0, f"{b.name} spills on {b.arch}: {b}"
        assert 0 < b.registers <= 255, b
        assert b.shared_bytes <= SHARED_LIMIT, b


def test_a_spill_is_seen(kernels: list[ptx.Kernel]) -> None:
    """With registers capped far below what it needs, ptxas spills and the report says so."""
    adam = next(k for k in kernels if k.name == "fused_adam")
    b = ptx.build(adam, 80, max_registers=24)
    assert b.registers <= 24 and b.spill_stores > 0 and b.spill_loads > 0, b
