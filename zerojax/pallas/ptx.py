"""The Triton kernels compiled one step past lowering, to PTX and cubin, without a GPU.

Lowering for CUDA stops at Triton IR: the `__gpu$xla.gpu.triton` custom call carries the kernel as
MLIR bytecode, which XLA compiles on a GPU machine. Here that same IR is read back out of the
lowered module (with jaxlib's Triton dialect) and handed to the `triton` package's compiler for a
given GPU target (sm_80, sm_90), with the launch's own `num_warps` and `num_stages`; `ptxas -v`
then reports each kernel's registers, spill bytes and shared memory.

This is Triton's pipeline from the pip package, not the one built into XLA, so the figures are an
estimate of what a GPU build gives, not a record of it. Optional: needs `pip install triton`
(which ships ptxas). Run `python -m zerojax.pallas.ptx` for the table.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any, NamedTuple

TARGETS = (80, 90)


class Kernel(NamedTuple):
    """One kernel as the lowered module launches it."""
    name: str
    ir: bytes
    num_warps: int
    num_stages: int


class Build(NamedTuple):
    """ptxas's report for one kernel on one target."""
    name: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int       # Triton's dynamic shared memory (metadata.shared) + ptxas's static smem
    cubin_bytes: int


def triton_kernels(lowered: Any) -> list[Kernel]:
    """The Triton launches of a `jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`."""
    found: list[Kernel] = []

    def attr_int(cfg: Any, key: str) -> int:
        return int(str(cfg[key]).split(":")[0].strip())

    def walk(op: Any) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if (inner.operation.name == "stablehlo.custom_call"
                            and "triton" in str(inner.attributes["call_target_name"])):
                        cfg = inner.attributes["mhlo.backend_config"]
                        found.append(Kernel(str(cfg["name"]).strip('"'), cfg["ir"].value_bytes,
                                            attr_int(cfg, "num_warps"), attr_int(cfg, "num_stages")))
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def _ttir_text(ir_bytes: bytes) -> str:
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect
    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)
    with ctx:
        return ir.Module.parse(ir_bytes).operation.get_asm(enable_debug_info=False)


def build(kernel: Kernel, capability: int, max_registers: int | None = None) -> Build:
    """Compile `kernel` for sm_`capability` with the triton package and read ptxas -v.

    `max_registers` caps registers per thread in the ptxas run (to show that spills are seen)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton 3.9's default, made explicit
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, f"{kernel.name}.ttir")
        with open(src, "w") as f:
            f.write(_ttir_text(kernel.ir))
        compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                                  options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages))
        ptx = compiled.asm["ptx"]
        arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
        if max_registers:  # a .maxnreg directive (ptxas ignores -maxrregcount for these entries)
            ptx = re.sub(r"^\{$", f".maxnreg {max_registers}\n{{", ptx, count=1, flags=re.M)
        ptx_path = os.path.join(tmp, "k.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(capability).path, f"-arch={arch}", "-v", ptx_path,
                              "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr

    def num(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0
    return Build(kernel.name, arch, registers=num(r"Used (\d+) registers"),
                 spill_stores=num(r"(\d+) bytes spill stores"), spill_loads=num(r"(\d+) bytes spill loads"),
                 shared_bytes=int(compiled.metadata.shared) + num(r"(\d+) bytes smem"),
                 cubin_bytes=len(compiled.asm["cubin"]))


def zero_kernels() -> list[Kernel]:
    """Both kernels as the ZeRO update launches them: fused AdamW emitting bf16, and the statistics."""
    import jax
    import jax.numpy as jnp

    from zerojax.pallas.adam import AdamScalars, adam_update_pallas
    from zerojax.pallas.loss_scale import grad_stats_pallas
    from zerojax.pallas.selfcheck import SIZES

    f32 = [jax.ShapeDtypeStruct((n,), jnp.float32) for n in SIZES]
    bf16 = [jax.ShapeDtypeStruct((n,), jnp.bfloat16) for n in SIZES]
    s = AdamScalars(*[jax.ShapeDtypeStruct((), jnp.float32)] * 9)

    def both(p: Any, g: Any, m: Any, v: Any, s: AdamScalars, g16: Any) -> Any:
        return (adam_update_pallas(p, g, m, v, s, decoupled=True, emit=jnp.bfloat16, backend="triton"),
                grad_stats_pallas(g16, s.grad_scale, backend="triton"))
    lowered = jax.jit(both).trace(f32, bf16, f32, f32, s, bf16).lower(lowering_platforms=("cuda",))
    return triton_kernels(lowered)


def main() -> None:
    print("| kernel | target | registers/thread | spill stores/loads (B) | shared memory (B) | cubin (B) |")
    print("|---|---|---|---|---|---|")
    for kernel in zero_kernels():
        for cc in TARGETS:
            b = build(kernel, cc)
            print(f"| {b.name} (num_warps={kernel.num_warps}) | {b.arch} | {b.registers} | "
                  f"{b.spill_stores}/{b.spill_loads} | {b.shared_bytes} | {b.cubin_bytes} |")


if __name__ == "__main__":
    main()
