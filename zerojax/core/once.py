"""Compiler options for the programs a process runs once: the train state's initialisation.

Such a program's compile stands between the launch and the first step, and its run does not: on XLA:CPU,
LLVM's optimisation level 1 (XLA's `xla_backend_optimization_level`; its default is 2) compiles the
state's init program of `configs/zero3.yaml` in about 40% less CPU time, to the same arrays bit for bit,
and runs it within a few percent (docs/benchmarks.md, start-up). The train step, which runs every step,
keeps XLA's default. A level the user set (`--xla_backend_optimization_level` in XLA_FLAGS, or JAX's
`jax_disable_most_optimizations`) is left alone, and so are other backends: there the option steers a
different code generator, and a GPU's init program has not been measured.
"""
from __future__ import annotations

import os
from typing import Any

import jax
from jax.sharding import Mesh

#: XLA's options for a program run once per process, on the CPU.
CPU_ONCE = {"xla_backend_optimization_level": 1}


def once_options(mesh: Mesh) -> dict[str, Any] | None:
    """`jax.jit(..., compiler_options=)` for a program that runs once on `mesh`'s devices."""
    chosen = ("xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
              or jax.config.read("jax_disable_most_optimizations"))
    return None if chosen or mesh.devices.flat[0].platform != "cpu" else dict(CPU_ONCE)
