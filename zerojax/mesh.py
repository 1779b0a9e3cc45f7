"""The device mesh: a `data` axis that ZeRO shards over (and, for pipelines, a `stage` axis)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from zerojax.config import Config, as_config
from zerojax.errors import ConfigError

DATA = "data"
STAGE = "stage"


def request_cpu_devices(n: int | None) -> None:
    """Ask for `n` virtual CPU devices; effective only before JAX's backends start.

    On a machine with an accelerator the CPU count does not matter, so this is harmless there.
    Once the backends have started the count cannot change: the mesh check then reports the
    devices that exist.
    """
    if n is None:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backends already initialized; make_mesh reports a shortfall


def make_mesh(config: Config | Mapping[str, Any] | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh from the config's `mesh` section: (`stage`, `data`) axes, `data` by default all devices.

    `config` is a Config, a dict or a config file path (as `initialize` takes it)."""
    config = as_config(config)
    devices = list(devices if devices is not None else jax.devices())
    stage = config.mesh.stage
    if len(devices) % stage:
        raise ConfigError(f"mesh.stage: {stage} does not divide the {len(devices)} devices; "
                          f"choose a divisor of {len(devices)}")
    data = config.mesh.data or len(devices) // stage
    if stage * data > len(devices):
        raise ConfigError(
            f"mesh.data: stage {stage} x data {data} = {stage * data} devices, but only {len(devices)} "
            f"exist; lower mesh.data (on CPU, raise mesh.cpu_devices before JAX starts)")
    grid = np.array(devices[: stage * data], dtype=object)
    if stage == 1:
        return Mesh(grid.reshape(data), (DATA,))
    return Mesh(grid.reshape(stage, data), (STAGE, DATA))


def data_size(mesh: Mesh) -> int:
    """Number of data-parallel shards (what the batch triad counts)."""
    if DATA not in mesh.shape:
        raise ConfigError(f"mesh: needs an axis named '{DATA}' (got axes {tuple(mesh.shape)})")
    return int(mesh.shape[DATA])
