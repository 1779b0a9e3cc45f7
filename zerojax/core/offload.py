"""ZeRO-Offload as memory kinds: where model state lives between steps, and where the update runs.

DeepSpeed moves optimizer state (and, in ZeRO-3, parameters) to CPU memory by hand and runs a CPU
Adam. Here offload is part of the layout: the plan gives the stored state `NamedSharding`s with
`memory_kind="pinned_host"` (`unpinned_host` without `pin_memory`), and the step moves between
memory spaces only where the layout says:

* `offload_optimizer.device: cpu` - the fp32 master copy and the optimizer state live in host
  memory. The update either runs on the host (`compute: host`, DeepSpeed's ZeRO-Offload: only
  gradients go down and the new parameters come up) or on the device (`compute: device`, state
  offload: this device's state shards come up for the update and go back). `compute: auto` takes
  the host where the backend can compile a host computation (`compute_on`), the device otherwise.
* `offload_param.device: cpu` (stage 3) - the parameter shards live in host memory and each layer
  is brought to the device where the model gathers it (`zerojax.gather` inside the scanned body).
  Their gradients leave the backward pass in host memory and are brought back before reduction.

On a CPU backend "host" and "device" are the same RAM: placements, equivalence and the compiled
memory spaces can be checked there; the memory saving only exists on GPU and TPU.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from zerojax.core.measure import HOST_KINDS
from zerojax.core.swap import Swap



@dataclasses.dataclass(frozen=True)
class Memory:
    """Memory kinds of stored state (None: the device's own memory) and where the update computes."""
    params: str | None = None      # stored parameters
    optimizer: str | None = None   # fp32 master copy and optimizer state
    update: str = "device"         # "device" or "host"
    swap: Swap | None = None       # NVMe (ZeRO-Infinity): master and optimizer state in files, `optimizer`
                                   # the host memory a whole state passes through (init, checkpoints)
    param_swap: Swap | None = None  # NVMe parameters (stage 3): compute-dtype shards in files between steps,
                                    # on the device (`params` None) during the step (`core.param_swap`)

    @property
    def offloaded(self) -> bool:
        return self.params is not None or self.optimizer is not None or self.param_swap is not None

    def describe(self) -> str:
        if not self.offloaded:
            return "no offload"
        parts = []
        if self.swap is not None:
            parts.append(f"master weights and optimizer state in {self.swap.describe()}")
        elif self.optimizer is not None:
            parts.append(f"master weights and optimizer state in {self.optimizer}")
        if self.params is not None:
            parts.append(f"parameters in {self.params}")
        if self.param_swap is not None:
            parts.append(f"parameters in {self.param_swap.describe()} between steps")
        return "offload: " + ", ".join(parts) + f"; optimizer update on the {self.update}"


@functools.lru_cache(maxsize=None)
def host_update_supported(platform: str, kind: str) -> bool:
    """Whether this backend compiles an elementwise update inside `compute_on("device_host")`."""
    from jax.experimental.compute_on import compute_on

    device = next(d for d in jax.devices() if d.platform == platform)
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)

    @compute_on("device_host")
    @jax.jit
    def update(m: jax.Array, g: jax.Array) -> jax.Array:
        return m - 0.1 * g / (jax.numpy.sqrt(g * g) + 1e-8)

    def probe(m: jax.Array, g: jax.Array) -> jax.Array:
        return update(*to_memory((m, g), kind))

    try:
        x = jax.ShapeDtypeStruct((8,), np.float32, sharding=sharding)
        g = jax.ShapeDtypeStruct((8,), np.float32, sharding=sharding.with_memory_kind("device"))
        jax.jit(probe, out_shardings=sharding).lower(x, g).compile()
        return True
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# Moves inside the jitted step.

def to_memory(tree: Any, kind: str | None) -> Any:
    """Every array of `tree` in device memory (kind None or "device") or host memory (a host kind)."""
    space = jax.memory.Space.Host if kind in HOST_KINDS else jax.memory.Space.Device
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def to_device(tree: Any) -> Any:
    """Values typed as host memory moved to the device; the others untouched.

    Inside jit the type says where a value is, so the lowered module carries no transfer, not even
    an empty one, for what is already on the device.
    """
    def one(x: Any) -> Any:
        on_host = getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
        return jax.device_put(x, jax.memory.Space.Device) if on_host else x
    return jax.tree.map(one, tree)


def bring_in(tree: Any, kind: str | None) -> Any:
    """Arrays stored in memory `kind` moved to the device for computing; a no-op for device memory."""
    return tree if kind is None else to_device(tree)


def run_update(memory: Memory, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` where the plan runs the optimizer update.

    On the device: state stored on the host is brought in first (and the step's out_shardings put
    the results back). On the host: every input goes to host memory (gradients and a few scalars
    travel, the state is already there) and `fn` runs as a host computation.
    """
    if memory.update == "host":
        from jax.experimental.compute_on import compute_on

        with compute_on("device_host"):
            return jax.jit(fn)(*to_memory(args, memory.optimizer))
    return fn(*bring_in(args, memory.optimizer))


# ---------------------------------------------------------------------------------------------
# What a compiled step holds where.
