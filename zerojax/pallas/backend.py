"""Which implementation runs the fused update: XLA (optax) or a Pallas backend.

Kept free of Pallas imports so the config and layout layers can resolve the choice cheaply; the
kernels import Pallas only when they are traced.
"""
from __future__ import annotations

from typing import Any

from zerojax.errors import ConfigError

XLA, INTERPRET, TRITON, MOSAIC_GPU = "xla", "interpret", "triton", "mosaic_gpu"
PALLAS_BACKENDS = (INTERPRET, TRITON, MOSAIC_GPU)

# Optimizers with a fused kernel (DeepSpeed's FusedAdam covers both).
KERNEL_OPTIMIZERS = frozenset({"adam", "adamw"})


def resolve(kernels: str, platform: str, optimizer_type: str) -> str:
    """The backend for `kernels` (config value) on devices of `platform` ("cpu", "gpu", "tpu").

    auto:   Triton on GPU when the optimizer has a kernel, XLA otherwise (`plan` then runs
            selfcheck.settle, which falls back to XLA if the kernels fail their check).
    pallas: Triton on GPU, interpret mode on CPU (slow; it runs the kernel bodies for tests).
    xla:    the optax update, compiled by XLA.
    """
    has_kernel = optimizer_type.lower() in KERNEL_OPTIMIZERS
    if kernels == XLA:
        return XLA
    if kernels == "auto":
        return TRITON if platform == "gpu" and has_kernel else XLA
    if kernels != "pallas":
        raise ConfigError(f"kernels: unknown value '{kernels}'; use auto, pallas or xla")
    if not has_kernel:
        raise ConfigError(f"kernels: 'pallas' has fused kernels for Adam and AdamW only, and "
                          f"optimizer.type is '{optimizer_type}'; use kernels: auto or xla")
    if platform == "gpu":
        return TRITON
    if platform == "cpu":
        return INTERPRET
    raise ConfigError(f"kernels: 'pallas' runs on GPU (Triton) or in interpret mode on CPU, not on "
                      f"'{platform}' devices; use kernels: auto or xla")


def platform_of(mesh: Any) -> str:
    """"gpu", "cpu" or "tpu" for the devices of a mesh (CUDA and ROCm devices report "gpu")."""
    return mesh.devices.flat[0].platform
