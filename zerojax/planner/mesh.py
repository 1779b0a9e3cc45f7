"""The device mesh a config asks for: (`stage`, `data`, `expert`, `sequence`, `tensor`) axes, or a
hierarchical data axis (`data_outer`, `data_inner`) with the expert, sequence and tensor axes inside it.

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

__all__ = ["make_mesh", "is_hierarchical", "hierarchical_sizes", "hierarchical_mesh"]


def make_mesh(config: Config | Mapping[str, Any] | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh from the config's `mesh` section: (`stage`, `data`, `expert`, `sequence`, `tensor`) axes,
    `stage` only with more than one stage, `expert` only with mesh.expert above 1 (the data-parallel
    devices are then data x expert), `sequence` only with mesh.sequence above 1 and `tensor` only
    with mesh.tensor above 1 (a config without them gets a plain
    `data` mesh); `data` is by default every device stage x tensor leave over. `tensor` is innermost:
    one tensor group is consecutive devices, the fastest links. With `mesh.data_outer` /
    `mesh.data_inner` the data axis is (`data_outer`, `data_inner`) (`hierarchical_mesh`); with neither,
    `zero_optimization.zero_hpz_partition_size` > 1 builds that mesh with data_inner x expert x sequence
    = the hpZ partition size.

    `config` is a Config, a dict or a config file path (as `initialize` takes it)."""
    config = as_config(config)
    devices = list(devices if devices is not None else jax.devices())
    m, n = config.mesh, len(devices)
    if is_hierarchical(config):
        return hierarchical_mesh(config, devices)
    _check_model_axes(m.stage, m.tensor * m.sequence, n)
    dp = m.data_parallel(n)
    _check_expert_divides(m.expert, dp)
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


def is_hierarchical(config: Config) -> bool:
    """The config asks for a hierarchical data axis: mesh.data_outer or mesh.data_inner, or ZeRO++'s hpZ."""
    m = config.mesh
    return m.data_outer is not None or m.data_inner is not None or config.zero_optimization.zero_hpz_partition_size > 1


def _check_expert_divides(expert: int, dp: int) -> None:
    """Expert groups are carved out of the data-parallel devices, so mesh.expert must divide them."""
    if dp % expert:
        raise ConfigError(f"mesh.expert: {expert} does not divide the data-parallel size {dp}, so data x expert "
                          f"cannot fill it; choose mesh.expert dividing {dp} (expert groups are carved out of the "
                          f"data-parallel devices, as DeepSpeed's ep_size)")


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


def _host_axes(config: Config) -> dict[str, int]:
    """The axes inside data_inner, each within one host, outermost first: `expert`, `sequence`, `tensor`
    (those above 1). Ulysses' and the experts' all-to-alls and the tensor collectives then stay on the
    fast links, as DeepSpeed keeps its expert and sequence groups inside a node."""
    m = config.mesh
    return {a: k for a, k in ((EXPERT, m.expert), (SEQUENCE, m.sequence), (TENSOR, m.tensor)) if k > 1}


def _hpz_inner(config: Config) -> int | None:
    """data_inner from ZeRO++'s partition size: hpZ's secondary group is the host's part of the ZeRO group,
    data_inner x expert x sequence devices (DeepSpeed's zero_hpz_partition_size counts a node's ranks that
    share the secondary copy), so data_inner is the partition size over expert x sequence."""
    m, hpz = config.mesh, config.zero_optimization.zero_hpz_partition_size
    within = m.expert * m.sequence
    if hpz % within:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size: {hpz} is not a multiple of mesh.expert x "
                          f"mesh.sequence = {within}; hpZ's secondary partition is data_inner x expert x sequence "
                          f"devices of one host, so choose a multiple of {within} (or set mesh.data_inner)")
    return hpz // within


def hierarchical_sizes(config: Config, n_devices: int) -> tuple[int, int]:
    """(data_outer, data_inner) from the config for `n_devices`, every device used exactly once: the data
    axis holds n_devices / (expert x sequence x tensor) of them (the data-parallel size, mesh.data, is
    data_outer x data_inner x expert)."""
    m = config.mesh
    if m.stage != 1:
        raise ConfigError(f"mesh.data_outer: a hierarchical data axis does not combine with pipeline stages yet "
                          f"(mesh.stage is {m.stage}); set mesh.stage: 1 or remove mesh.data_outer")
    _check_model_axes(m.stage, m.tensor * m.sequence, n_devices)
    left = n_devices // (m.tensor * m.sequence)  # the data-parallel devices: data x expert
    data = m.data or left
    if data != left:
        by = " x ".join(f"mesh.{a} {k}" for a, k in _host_axes(config).items() if a != EXPERT)
        by = f" left by {by}" if by else ""
        raise ConfigError(f"mesh.data: {data} of the {left} devices{by} with a hierarchical data axis; it must use "
                          f"every device (remove mesh.data, or run on {n_devices // left * data} devices)")
    _check_expert_divides(m.expert, data)
    data //= m.expert  # the data axis proper, data_outer x data_inner
    outer, inner = m.data_outer, m.data_inner
    if outer is None and inner is None and config.zero_optimization.zero_hpz_partition_size > 1:
        inner = _hpz_inner(config)  # ZeRO++ hpZ: one secondary partition per host's data-parallel devices
    of = f"{data} data-parallel devices" + (f" per expert slot (mesh.expert {m.expert})" if m.expert > 1 else "")
    if outer is None:
        outer = data // inner if inner and data % inner == 0 else None
        if outer is None:
            raise ConfigError(f"mesh.data_inner: {inner} does not divide the {of}; choose a divisor of {data}")
    if inner is None:
        if data % outer:
            raise ConfigError(f"mesh.data_outer: {outer} does not divide the {of}; choose a divisor of {data}")
        inner = data // outer
    if outer * inner != data:
        raise ConfigError(f"mesh.data_outer x mesh.data_inner: {outer} x {inner} = {outer * inner}, but the data axis "
                          f"has {data} devices; the product must be {data} (no device left out)")
    return outer, inner


def hierarchical_mesh(config: Config, devices: Sequence[jax.Device]) -> Mesh:
    """A (`data_outer`, `data_inner`) mesh over every device, from JAX's topology-aware helpers, with
    `expert`, `sequence` and `tensor` axes inside it where their sizes are above 1.

    Across several slices (TPU `slice_index`) or processes, `create_hybrid_device_mesh` puts each
    slice/process in one `data_outer` row, so every other axis's collectives (data_inner, the experts'
    and Ulysses' all-to-alls, tensor) stay on fast links; it needs `data_outer` equal to the number of
    slices/processes. Within one, `create_device_mesh` orders the devices for the physical topology
    (ICI / NVLink) and `data_outer` subdivides it.
    """
    from jax.experimental import mesh_utils
    devices = list(devices)
    outer, inner = hierarchical_sizes(config, len(devices))
    host = _host_axes(config)
    tail = tuple(host.values())
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
    return Mesh(grid, HIERARCHICAL + tuple(host))
