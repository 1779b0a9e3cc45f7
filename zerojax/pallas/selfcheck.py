"""The kernels prove themselves on a backend before `kernels: auto` trusts them.

Pallas kernels lower without a GPU, but lowering says nothing about whether the GPU compiler
accepts them or whether they compute the right numbers there. So the first plan that would run
them on a backend compiles both kernels (fused Adam and the gradient statistics) on a small case,
runs them on one device of that backend and compares them with the jnp references at the tolerance
the tests use (per array, max |diff| <= 1e-6 x max |reference|; non-finite counts exact; the
compute-dtype copy equal to the kernel's own master weights cast). The verdict is cached per
process and backend, so the check costs one small compile per process.

`auto` falls back to the XLA (optax) update with one printed line naming the reason; `pallas`
raises instead. The check itself takes the backend to check and the device to run on as arguments,
so a test can hold the interpreted kernels to the same check on CPU.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, NamedTuple

import numpy as np

from zerojax.errors import ConfigError
from zerojax.pallas.backend import MOSAIC_GPU, TRITON, XLA

# Per array: max |kernel - reference| <= REL x max |reference| (docs/kernels.md).
REL = 1e-6
# Leaf sizes of the small case: several blocks, partial tails, a single element (default blocks
# are 1024 elements on Triton).
SIZES = (37, 2 * 1024 + 5, 300, 1)
# Backends checked before use: the compiled ones. Interpret mode (`pallas` on CPU) is what the test
# suite holds to the references; checking it again would cost ~15 s of compilation per process.
CHECKED = (TRITON, MOSAIC_GPU)


class Verdict(NamedTuple):
    """ok, and when not, why (one line)."""
    ok: bool
    reason: str = ""


_VERDICTS: dict[tuple[str, str], Verdict] = {}
_TOLD: set[tuple[str, str]] = set()


def _max_error(got: Any, want: Any) -> float:
    """max over arrays of max |got - want| / max |want| (0 for an all-zero reference)."""
    worst = 0.0
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return float("inf")
        bad = ~np.isfinite(w)  # a non-finite reference (a sum over inf/NaN) wants a non-finite result
        if np.any(np.isfinite(g[bad])):
            return float("inf")
        g, w = g[~bad], w[~bad]
        if not g.size:
            continue
        diff = float(np.max(np.abs(g - w)))
        scale = float(np.max(np.abs(w)))
        worst = max(worst, diff / scale if scale else (0.0 if diff == 0 else float("inf")))
    return worst


def _case() -> tuple[list[np.ndarray], ...]:
    rng = np.random.default_rng(0)
    p = [rng.normal(size=n).astype(np.float32) for n in SIZES]
    g = [rng.normal(size=n).astype(np.float32) for n in SIZES]
    m = [(0.1 * rng.normal(size=n)).astype(np.float32) for n in SIZES]
    v = [np.abs(0.01 * rng.normal(size=n)).astype(np.float32) for n in SIZES]
    return p, g, m, v


def run_check(backend: str, device: Any) -> Verdict:
    """Compile and run both kernels for `backend` on `device` and compare with the references."""
    import jax
    import jax.numpy as jnp

    from zerojax.pallas.adam import AdamScalars, adam_update_pallas, adam_update_reference
    from zerojax.pallas.loss_scale import grad_stats_pallas, grad_stats_reference

    p, g, m, v = (jax.device_put([jnp.asarray(x) for x in xs], device) for xs in _case())
    s = AdamScalars(lr=jnp.float32(1e-2), b1=jnp.float32(0.9), b2=jnp.float32(0.999), eps=jnp.float32(1e-8),
                    weight_decay=jnp.float32(0.1), c1=jnp.float32(1 - 0.9 ** 3), c2=jnp.float32(1 - 0.999 ** 3),
                    grad_scale=jnp.float32(0.5), apply=jnp.float32(1.0))
    s = jax.device_put(s, device)
    g16 = [x.astype(jnp.bfloat16) for x in g]
    # non-finite values in the statistics' input: one in a full block, one in a tail
    g16[1] = g16[1].at[7].set(jnp.inf).at[2048 + 2].set(jnp.nan)

    def fused(p, g, m, v, s, g16):
        adam = adam_update_pallas(p, g, m, v, s, decoupled=True, emit=jnp.bfloat16, backend=backend)
        return adam, grad_stats_pallas(g16, jnp.float32(0.5), backend=backend)

    def reference(p, g, m, v, s, g16):
        adam = adam_update_reference(p, g, m, v, s, decoupled=True, emit=jnp.bfloat16)
        return adam, grad_stats_reference(g16, jnp.float32(0.5))

    try:
        (kp, km, kv, kcast), (ksq, kbad) = jax.device_get(jax.jit(fused)(p, g, m, v, s, g16))
    except Exception as err:  # noqa: BLE001 - any failure to build or run means "do not use"
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return Verdict(False, f"compile/run error: {type(err).__name__}: {first[:300]}")
    (rp, rm, rv, _), (rsq, rbad) = jax.device_get(jax.jit(reference)(p, g, m, v, s, g16))
    err = max(_max_error(kp, rp), _max_error(km, rm), _max_error(kv, rv), _max_error(ksq, rsq))
    if not err <= REL:
        return Verdict(False, f"mismatch with the jnp reference: max error {err:.2e} x max |reference| "
                              f"(tolerance {REL:g})")
    if [float(x) for x in kbad] != [float(x) for x in rbad]:
        return Verdict(False, f"mismatch with the jnp reference: non-finite counts "
                              f"{[int(x) for x in kbad]}, expected {[int(x) for x in rbad]}")
    if any(not np.array_equal(np.asarray(c), np.asarray(jnp.asarray(q).astype(jnp.bfloat16)))
           for c, q in zip(kcast, kp)):
        return Verdict(False, "mismatch: the bfloat16 copy differs from the kernel's master weights cast")
    return Verdict(True)


def verdict(backend: str, device: Any, check: Callable[[str, Any], Verdict] = run_check) -> Verdict:
    """The cached verdict for `backend` on `device`'s platform (checked once per process)."""
    key = (backend, device.platform)
    if key not in _VERDICTS:
        _VERDICTS[key] = check(backend, device)
    return _VERDICTS[key]


def settle(requested: str, resolved: str, device: Any, *,
           check: Callable[[str, Any], Verdict] = run_check, checked: Collection[str] = CHECKED) -> str:
    """The backend to use after the self-check: `resolved`, or XLA when `auto`'s kernels failed.

    `requested` is the config value (auto, pallas, xla), `resolved` what `backend.resolve` chose
    for the platform, `device` one device to run the check on. Only backends in `checked` are
    checked (tests pass the interpret backend to exercise the check on CPU). `pallas` raises
    ConfigError on a failed check; `auto` prints one line (once per process and backend) and
    returns XLA.
    """
    if resolved == XLA or resolved not in checked:
        return resolved
    found = verdict(resolved, device, check)
    if found.ok:
        return resolved
    where = f"{resolved} on {device.platform}"
    if requested == "pallas":
        raise ConfigError(f"kernels: 'pallas' forces the fused kernels, but their self-check failed "
                          f"({where}): {found.reason}; use kernels: auto (falls back to the optax "
                          f"update) or xla")
    if (resolved, device.platform) in _TOLD:
        return XLA
    _TOLD.add((resolved, device.platform))
    print(f"zerojax: kernels: auto: using the XLA (optax) update; the Pallas kernels' self-check "
          f"failed ({where}): {found.reason}", flush=True)
    return XLA


def forget() -> None:
    """Drop cached verdicts (tests)."""
    _VERDICTS.clear()
    _TOLD.clear()
