"""ZeRO-Infinity's parameter tier (`offload_param.device: nvme`): stage 3's parameter partitions in files.

DeepSpeed (`runtime/swap_tensor/partitioned_param_swapper.py`) keeps each rank's partition of every
parameter, in the model dtype, in a file under `nvme_path`; a partition is swapped in through a pool
of `buffer_count` pinned buffers of `buffer_size` elements when its module is about to run (prefetched
ahead of use), and swapped out when it is released. The first `max_in_cpu` elements of the rank's
partitions stay in CPU memory instead of files (`stage3.py`, `_create_param_groups_fp16_flat_cpu_memory`).

Here the step is a compiled program over the parameters as arguments (or, with the optimizer on NVMe,
`core.nvme_step`'s programs), so the swap happens around it, not inside it: at the step's start each
shard of the parameter placement this process holds is read from the files tile by tile (`buffer_size`
elements; the next tile read while this one goes to its devices) through the same bounded buffers the
optimizer's tier streams through (`core.swap.SwapFiles`), and after the update the new shards go back
out tile by tile (written behind). During the step the devices hold their stage-3 shards, as without
offload; between steps neither the devices nor host memory hold them (beyond `max_in_cpu` elements per
device).

DeepSpeed goes further: during the forward and backward only the layers in use are resident. So does
this tier for stacked layer leaves (`at_use`: a loss run through `rewrite.gather_at_use`, mixed
precision, the optimizer not on NVMe): they are not read before the step but inside it, each device's
block of layer i read from the files by a host callback (`reader`) in the scan's iteration i, forward
and again in the rematerialised backward, then all-gathered as usual; the step's arguments carry only
the other leaves.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.core.layout import Plan
from zerojax.core.nvme_step import Lowered, Region, shard_regions
from zerojax.core.state import TrainState, abstract_state, state_shardings
from zerojax.core.swap import SwapFiles, Tile


class ParamFiles:
    """The compute-dtype parameter shards of this process: in files, or (the first `max_in_cpu` elements
    per device, leaf order) in host memory; `store(params)` puts a whole parameter tree there,
    `load()` brings it back onto the devices in the plan's parameter placement."""

    def __init__(self, plan: Plan):
        swap = plan.memory.param_swap
        assert swap is not None
        self._def = jax.tree.structure(plan.abstract_params)
        self.shapes = [tuple(x.shape) for x in jax.tree.leaves(plan.abstract_params)]
        self.shardings = jax.tree.leaves(state_shardings(plan).params)
        self.regions: list[Region] = shard_regions(self.shapes, self.shardings)
        used: collections.Counter = collections.Counter()
        spent: set[jax.Device] = set()
        self.in_memory: set[int] = set()
        for r, region in enumerate(self.regions):  # DeepSpeed fills its CPU buffer in order, then stops
            if all(d not in spent and used[d] + region.size <= swap.in_memory for d in region.devices):
                used.update({d: region.size for d in region.devices})
                self.in_memory.add(r)
            else:
                spent.update(region.devices)
        self.filed = [r for r in range(len(self.regions)) if r not in self.in_memory]
        self.files = SwapFiles(swap, ["params"], [self.regions[r].size for r in self.filed],
                               dtype=np.dtype(plan.policy.param))
        self.held: dict[int, np.ndarray] = {}  # the in-memory regions, between steps
        self._slot = {self.filed[f]: f for f in range(len(self.filed))}
        self._by_device = {(region.leaf, d.id): r for r, region in enumerate(self.regions) for d in region.devices}
        self.reads = 0  # blocks read at use (inside the step), since the engine started
        self.load_s = self.store_s = 0.0  # the latest load's and store's time (the devices wait for both)

    @property
    def held_bytes(self) -> int:
        """Host bytes of the shards kept in memory (`max_in_cpu`)."""
        return sum(x.nbytes for x in self.held.values())

    @property
    def host_bytes(self) -> int:
        """Everything the parameters take in host memory between steps: the buffers and the held shards."""
        return self.files.buffer_bytes + self.held_bytes

    def _tiles(self, skip: frozenset[int] = frozenset()) -> list[Tile]:
        return [t for f in range(len(self.filed)) if self.regions[self.filed[f]].leaf not in skip
                for t in self.files.tiles(f)]

    def read_block(self, leaf: int, device_id: int, layer: int) -> np.ndarray:
        """Device `device_id`'s block of leaf `leaf`: layer `layer` of it (its leading axis), or all of
        it for a negative `layer`."""
        r = self._by_device[(leaf, device_id)]
        region = self.regions[r]
        per = region.size // region.shape[0]
        start, stop = (0, region.size) if layer < 0 else (layer * per, (layer + 1) * per)
        shape = region.shape if layer < 0 else region.shape[1:]
        self.reads += 1
        if r in self.held:
            return self.held[r][start:stop].reshape(shape)
        return self.files.read_range(0, self._slot[r], start, stop).reshape(shape)

    def reader(self, leaf: int, mesh: jax.sharding.Mesh) -> Callable[[jax.Array, Any], jax.Array]:
        """`read(placeholder, layer)` for `ParamShard.read`, traced inside the step's `shard_map`: this
        device's block of `leaf` (layer `layer`, or whole for None) from the files. A custom VJP: the
        cotangent of the block read goes to the placeholder, which the step differentiates, so the
        gradient of the leaf comes out of the step as for a block passed in. A `pure_callback` (not
        `io_callback`: effects are refused inside `jax.checkpoint`), so the rematerialised backward
        reads the layer again rather than keeping it."""
        ids = np.asarray([d.id for d in mesh.devices.flat], np.int32)

        def host(position: np.ndarray, layer: np.ndarray, like: jax.ShapeDtypeStruct) -> np.ndarray:
            return np.asarray(self.read_block(leaf, int(ids[int(position)]), int(layer)), like.dtype)

        def position() -> jax.Array:
            pos = jnp.int32(0)
            for name in mesh.axis_names:
                pos = pos * mesh.shape[name] + jax.lax.axis_index(name)
            return pos

        @jax.custom_vjp
        def read(x: jax.Array, layer: jax.Array) -> jax.Array:
            like = jax.ShapeDtypeStruct(x.shape, x.dtype)
            got = jax.pure_callback(lambda p, i: host(p, i, like), like, position(), layer)
            return got + jnp.zeros_like(x)  # typed as `x` is (per device) for the gather

        def fwd(x: jax.Array, layer: jax.Array) -> tuple[jax.Array, None]:
            return read(x, layer), None

        def bwd(_: None, ct: jax.Array) -> tuple[jax.Array, None]:
            return ct, None

        read.defvjp(fwd, bwd)

        def at(x: jax.Array, layer: Any) -> jax.Array:
            return read(x, jnp.int32(-1) if layer is None else layer)

        return at

    def store(self, params: Any) -> None:
        """Write each shard of `params` (the plan's parameter placement) out, tile by tile."""
        started = time.perf_counter()
        leaves = self._def.flatten_up_to(params)

        def flat(r: int) -> jax.Array:
            region = self.regions[r]
            shard = next(s.data for s in leaves[region.leaf].addressable_shards if s.device == region.devices[0])
            return shard.reshape(-1)

        for r in self.in_memory:
            self.held[r] = np.array(flat(r))
        current: dict[int, jax.Array] = {}

        def compute(i: int, t: Tile, bufs: list[np.ndarray]) -> None:
            if t.region not in current:
                current.clear()
                current[t.region] = flat(self.filed[t.region])
            bufs[0][:t.stop - t.start] = np.asarray(current[t.region][t.start:t.stop])

        self.files.stream(self._tiles(), compute, read=False)
        self.store_s = time.perf_counter() - started

    def load(self, skip: frozenset[int] = frozenset()) -> Any:
        """The parameter tree on the devices, read from the files tile by tile (and from the held shards);
        the leaves numbered in `skip` (read at use, inside the step) are None."""
        started = time.perf_counter()
        pieces: dict[tuple[int, jax.Device], list[jax.Array]] = collections.defaultdict(list)

        def compute(i: int, t: Tile, bufs: list[np.ndarray]) -> None:
            host = np.array(bufs[0][:t.stop - t.start])  # a copy: the buffer is reused for a later tile
            for device in self.regions[self.filed[t.region]].devices:
                pieces[(self.filed[t.region], device)].append(jax.device_put(host, device))

        self.files.stream(self._tiles(skip), compute, write=False)
        placed: list[list[jax.Array]] = [[] for _ in self.shapes]
        for r, region in enumerate(self.regions):
            for device in region.devices:
                if region.leaf in skip:
                    continue
                if r in self.in_memory:
                    x = jax.device_put(self.held[r], device)
                else:
                    parts = pieces.pop((r, device))
                    x = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
                placed[region.leaf].append(x.reshape(region.shape))
        out = self._def.unflatten([None if i in skip else jax.make_array_from_single_device_arrays(shape, sharding, arrays)
                                   for i, (shape, sharding, arrays) in enumerate(zip(self.shapes, self.shardings, placed))])
        self.load_s = time.perf_counter() - started
        return out

    def close(self) -> None:
        self.files.close()


class ParamSwapStep:
    """`step(state, batch) -> (state, metrics)` whose returned state holds no parameters (`params`
    None): they are in `files` between steps. Wraps the step the plan would run without parameter
    swapping (the jitted step or `core.nvme_step.NvmeStep`), which sees them as usual - except the
    leaves numbered in `at_use`, which it reads from `files` itself (`ParamFiles.reader`) and is
    handed as None."""

    def __init__(self, plan: Plan, inner: Callable[..., Any], files: ParamFiles | None = None,
                 at_use: frozenset[int] = frozenset()):
        self.plan, self.inner, self.at_use = plan, inner, frozenset(at_use)
        self.params = ParamFiles(plan) if files is None else files
        self.files = self.params.files
        abstract = abstract_state(plan).params
        self._abstract = jax.tree.unflatten(jax.tree.structure(abstract), [
            None if i in self.at_use else x for i, x in enumerate(jax.tree.leaves(abstract))])

    def store(self, state: TrainState) -> TrainState:
        """A whole state written out (the optimizer's part by the inner step, when it swaps too); the
        state the step carries, without parameters."""
        if state.params is None:
            return state
        inner = getattr(self.inner, "store", None)
        if inner is not None:
            state = inner(state)
        self.params.store(state.params)
        return state._replace(params=None)

    def live(self, state: TrainState) -> TrainState:
        """`state` with its parameters on the devices (read from the files)."""
        return state if state.params is not None else state._replace(params=self.params.load())

    def full(self, state: TrainState) -> TrainState:
        """The whole state (checkpoints save this): parameters, and the inner step's files read back."""
        state = self.live(state)
        inner = getattr(self.inner, "full", None)
        return state if inner is None else inner(state)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        live = state if state.params is not None else state._replace(params=self.params.load(self.at_use))
        new, metrics = self.inner(live, batch)
        return self.store(new), metrics

    def lower(self, state: TrainState, batch: Any) -> Lowered:
        """The inner step's lowering, parameters as their shapes (nothing is read); its `compile()` is
        this step to call."""
        params = self._abstract if state.params is None or self.at_use else state.params
        return Lowered(self, self.inner.lower(state._replace(params=params), batch))
