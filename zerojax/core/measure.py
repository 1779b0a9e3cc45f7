"""Measuring memory per device: what arrays hold, what a plan places, what a compiled step takes.

One place for the library (the plan's memory report, the start-up table, `memory_breakdown`,
offload's host split), the benchmarks and the tests. Collective traffic and work are read from
compiled HLO text by `zerojax.measure.hlo`.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax

from zerojax.measure.hlo import entry_layout_bytes

HOST_KINDS = ("pinned_host", "unpinned_host")  # memory kinds of host memory (offload)


def release_freed_heap() -> None:
    """Hand freed heap memory back to the system (glibc's malloc_trim). Memory freed in one thread's
    malloc arena (the compiler's working memory, a large tensor's blocks) otherwise stays resident
    until that thread allocates again, and the next allocations elsewhere (the step's buffers, on
    XLA's worker threads) stack on top of it in the process's peak. A no-op off glibc."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def array_bytes(tree: Any, host: bool | None = None) -> int:
    """Bytes this process's first device really holds of `tree`'s arrays (`host`: only those stored
    in host memory, or only those in device memory; None: both). Non-array leaves count nothing."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
               if isinstance(x, jax.Array) and (host is None or (x.sharding.memory_kind in HOST_KINDS) == host))


def live_device_bytes() -> dict[Any, int]:
    """Bytes each local device holds in live arrays (device memory only: offloaded arrays in host
    memory are the host process's)."""
    held: dict[Any, int] = {}
    for x in jax.live_arrays():
        if x.sharding.memory_kind in HOST_KINDS:
            continue
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def planned_bytes(abstract: Any, shardings: Any, dtype: Any = None, *, host_only: bool = False) -> int:
    """Bytes per device of `abstract` placed by `shardings` (with `host_only`: those in host memory)."""
    total = 0
    for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        if host_only and s.memory_kind not in HOST_KINDS:
            continue
        itemsize = jax.numpy.dtype(dtype or x.dtype).itemsize
        total += math.prod(s.shard_shape(x.shape)) * itemsize
    return total


class StepMemory(NamedTuple):
    """Per-device bytes of a compiled step's arguments and outputs by memory space, and its temp."""
    device_arguments: int
    host_arguments: int
    device_outputs: int
    host_outputs: int
    temp: int
    source: str   # "memory_analysis" or "HLO" (where memory_analysis does not split host bytes)

    def line(self) -> str:
        mib = 2 ** 20
        return (f"compiled step per device: arguments {self.device_arguments / mib:.2f} MiB on device + "
                f"{self.host_arguments / mib:.2f} MiB on host, temp {self.temp / mib:.2f} MiB "
                f"(host placement from {self.source})")


def step_memory(compiled: Any) -> StepMemory:
    """Where a compiled step's arguments live, per device.

    `memory_analysis()` splits host bytes on backends that report them; on CPU its host fields are
    zero and host-resident arguments are counted as ordinary ones, so the split is read from the
    memory spaces (`S(5)`, `S(6)`) of the compiled module's entry layout instead.
    """
    stats = compiled.memory_analysis()
    stats = stats[0] if isinstance(stats, (list, tuple)) else stats
    temp = int(getattr(stats, "temp_size_in_bytes", 0))
    host_args = int(getattr(stats, "host_argument_size_in_bytes", 0) or 0)
    host_outs = int(getattr(stats, "host_output_size_in_bytes", 0) or 0)
    if host_args or host_outs:
        return StepMemory(int(stats.argument_size_in_bytes), host_args, int(stats.output_size_in_bytes), host_outs,
                          temp, "memory_analysis")
    dev_args, host_args, dev_outs, host_outs = entry_layout_bytes(compiled.as_text())
    return StepMemory(dev_args, host_args, dev_outs, host_outs, temp, "HLO")
