"""The device mesh a config asks for: (`stage`, `data`, `expert`, `sequence`, `tensor`) axes, or a
hierarchical data axis.

The axis names and what the layouts ask of a mesh live in `zerojax.core.mesh`; this module reads the
config's `mesh` section (and ZeRO++'s hpZ partition size) into a `jax.sharding.Mesh`.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from zerojax.config import Config, as_config
from zerojax.core.mesh import DATA, EXPERT, HIERARCHICAL, SEQUENCE, STAGE, TENSOR
from zerojax.errors import ConfigError

__all__ = ["make_mesh", "hierarchical_sizes", "hierarchical_mesh"]


def make_mesh(config: Config | Mapping[str, Any] | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh from the config's `mesh` section: (`stage`, `data`, `expert`, `sequence`, `tensor`) axes,
    `stage` only with more than one stage, `expert` only with mesh.expert above 1 (the data-parallel
    devices are then data x expert), `sequence` only with mesh.sequence above 1 and `tensor` only
    with mesh.tensor above 1 (a config without them gets a plain
    `data` mesh); `data` is by default every device stage x tensor leave over. `tensor` is innermost:
    one tensor group is consecutive devices, the fastest links. With `mesh.data_outer` /
    `mesh.data_inner` the data axis is (`data_outer`, `data_inner`) (`hierarchical_mesh`); with neither,
    `zero_optimization.zero_hpz_partition_size` > 1 builds that mesh with `data_inner` = the hpZ
    partition size.

    `config` is a Config, a dict or a config file path (as `initialize` takes it)."""
    config = as_config(config)
    devices = list(devices if devices is not None else jax.devices())
    m, n = config.mesh, len(devices)
    hierarchical = (m.data_outer is not None or m.data_inner is not None
                    or config.zero_optimization.zero_hpz_partition_size > 1)
    if m.expert > 1 and hierarchical:
        raise ConfigError(f"mesh.expert: {m.expert} does not combine with a hierarchical data axis "
                          f"(mesh.data_outer / mesh.data_inner, or ZeRO++ hpZ) yet; set mesh.expert: 1 or remove them")
    if m.sequence > 1 and hierarchical:
        raise ConfigError(f"mesh.sequence: {m.sequence} (sequence_parallel_size) does not combine with "
                          f"mesh.data_outer / mesh.data_inner (or zero_hpz_partition_size) yet; use sequence "
                          f"parallelism with a flat data axis (with pipeline stages and the expert or tensor "
                          f"axes as needed)")
    if hierarchical:
        return hierarchical_mesh(config, devices)
    _check_model_axes(m.stage, m.tensor * m.sequence, n)
    dp = m.data_parallel(n)
    if dp % m.expert:
        raise ConfigError(f"mesh.expert: {m.expert} does not divide the data-parallel size {dp}, so data x expert "
                          f"cannot fill it; choose mesh.expert dividing {dp} (expert groups are carved out of the "
                          f"data-parallel devices, as DeepSpeed's ep_size)")
    sizes = {STAGE: m.stage, DATA: dp // m.expert, EXPERT: m.expert, SEQUENCE: m.sequence, TENSOR: m.tensor}
    used = math.prod(sizes.values())
    if used > n:
        named = " x ".join(f"{a} {k}" for a, k in sizes.items() if a not in (TENSOR, EXPERT, SEQUENCE) or k > 1)
        raise ConfigError(f"mesh.data: {named} = {used} devices, but only {n} exist; lower mesh.data"
                          f"{' or mesh.tensor' if m.tensor > 1 else ''} (on CPU, raise mesh.cpu_devices before "
                          f"JAX starts)")
    axes = tuple(a for a, k in sizes.items() if a == DATA or k > 1)
    grid = np.array(devices[:used], dtype=object).reshape([sizes[a] for a in axes])
    return Mesh(grid, axes)


def _check_model_axes(stage: int, tensor: int, n: int) -> None:
    """stage x tensor must divide the devices, so that whole data-parallel replicas fill them."""
    if n % (stage * tensor) == 0:
        return
    if tensor == 1:
        raise ConfigError(f"mesh.stage: {stage} does not divide the {n} devices; choose a divisor of {n}")
    raise ConfigError(f"mesh.tensor: stage {stage} x tensor {tensor} = {stage * tensor} does not divide the {n} "
                      f"devices, so stage x data x tensor cannot fill them; choose mesh.tensor and mesh.stage "
                      f"whose product divides {n}")


def _granules(devices: Sequence[jax.Device]) -> tuple[str, int]:
    """What separates slow links: TPU slices where devices have a `slice_index`, else processes."""
    if all(getattr(d, "slice_index", None) is not None for d in devices):
        return "slices", len({d.slice_index for d in devices})
    return "processes", len({d.process_index for d in devices})


def hierarchical_sizes(config: Config, n_devices: int) -> tuple[int, int]:
    """(data_outer, data_inner) from the config for `n_devices`, every device used exactly once (the data
    axis holds n_devices / mesh.tensor of them)."""
    m = config.mesh
    if m.stage != 1:
        raise ConfigError(f"mesh.data_outer: a hierarchical data axis does not combine with pipeline stages yet "
                          f"(mesh.stage is {m.stage}); set mesh.stage: 1 or remove mesh.data_outer")
    _check_model_axes(m.stage, m.tensor, n_devices)
    left = n_devices // m.tensor  # the data axis's devices
    data = m.data or left
    if data != left:
        by = f" left by mesh.tensor {m.tensor}" if m.tensor > 1 else ""
        raise ConfigError(f"mesh.data: {data} of the {left} devices{by} with a hierarchical data axis; it must use "
                          f"every device (remove mesh.data, or run on {data * m.tensor} devices)")
    outer, inner = m.data_outer, m.data_inner
    hpz = config.zero_optimization.zero_hpz_partition_size
    if outer is None and inner is None and hpz > 1:
        inner = hpz  # ZeRO++ hpZ: one secondary partition per inner group
    if outer is None:
        outer = data // inner if inner and data % inner == 0 else None
        if outer is None:
            raise ConfigError(f"mesh.data_inner: {inner} does not divide the {data} data-parallel devices; "
                              f"choose a divisor of {data}")
    if inner is None:
        if data % outer:
            raise ConfigError(f"mesh.data_outer: {outer} does not divide the {data} data-parallel devices; "
                              f"choose a divisor of {data}")
        inner = data // outer
    if outer * inner != data:
        raise ConfigError(f"mesh.data_outer x mesh.data_inner: {outer} x {inner} = {outer * inner}, but the data axis "
                          f"has {data} devices; the product must be {data} (no device left out)")
    return outer, inner


def hierarchical_mesh(config: Config, devices: Sequence[jax.Device]) -> Mesh:
    """A (`data_outer`, `data_inner`) mesh over every device, from JAX's topology-aware helpers, with a
    `tensor` axis innermost when mesh.tensor is above 1.

    Across several slices (TPU `slice_index`) or processes, `create_hybrid_device_mesh` puts each
    slice/process in one `data_outer` row, so `data_inner` and `tensor` collectives stay on fast links;
    it needs `data_outer` equal to the number of slices/processes. Within one, `create_device_mesh`
    orders the devices for the physical topology (ICI / NVLink) and `data_outer` subdivides it.
    """
    from jax.experimental import mesh_utils
    devices = list(devices)
    outer, inner = hierarchical_sizes(config, len(devices))
    tail = (config.mesh.tensor,) if config.mesh.tensor > 1 else ()
    kind, granules = _granules(devices)
    try:
        if granules > 1:
            if outer != granules:
                raise ConfigError(f"mesh.data_outer: {outer}, but the {len(devices)} devices sit in {granules} {kind}; "
                                  f"set mesh.data_outer: {granules} (one outer row per {kind[:-1]}: slow links only "
                                  f"between rows)")
            grid = mesh_utils.create_hybrid_device_mesh(
                (1, inner, *tail), (outer, 1, *(1 for _ in tail)), devices, process_is_granule=kind == "processes")
        else:
            grid = mesh_utils.create_device_mesh((outer, inner, *tail), devices, contiguous_submeshes=False)
    except ConfigError:
        raise
    except (ValueError, AssertionError, NotImplementedError) as e:
        raise ConfigError(f"mesh.data_outer x mesh.data_inner: {outer} x {inner} cannot be mapped onto the "
                          f"devices' topology ({e}); choose sizes that match the hosts/slices and their "
                          f"devices") from None
    grid = np.asarray(grid, dtype=object).reshape(outer, inner, *tail)
    if sorted(d.id for d in grid.flat) != sorted(d.id for d in devices):
        raise ConfigError("mesh.data_outer x mesh.data_inner: the mesh does not hold every device once")
    return Mesh(grid, HIERARCHICAL + ((TENSOR,) if tail else ()))
