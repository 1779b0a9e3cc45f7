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
this tier for stacked layer leaves (`at_use`, `core.step.read_at_use`: a loss run through
`rewrite.gather_at_use`, in a program that only computes their gradients - mixed precision, or the
optimizer on NVMe): they are not read before the step but inside it, each device's block of layer i
read from the files by a host callback (`reader`) in the scan's iteration i, forward and again in the
rematerialised backward, then all-gathered as usual; the step's arguments carry only the other leaves.

Like DeepSpeed's prefetch ahead of use (`PartitionedParameterCoordinator`, the swapper's async
`swap_in`), the callback for layer i also starts, on the swap's I/O threads, the read of the layer its
device will ask for next (i+1 in the forward, i-1 in the backward, learnt from the order of its reads)
into one of the `buffer_count` pool buffers, so that read is usually done when it is asked for. At the
step's end what was read ahead is dropped before the update's shards are written (`settle`), so no read
made before a write-back is served after it. Read-ahead follows the plan's stage-3 prefetch
(`overlap_comm`, `stage3_prefetch_bucket_size`); `last` counts a step's reads at use, how many were read
ahead, the time the callbacks waited on the disk (the stall) and the time the reads took.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.core.layout import Plan
from zerojax.core.nvme_step import Lowered, Region, shard_regions
from zerojax.core.state import TrainState, abstract_state, state_shardings
from zerojax.core.swap import SwapFiles, Tile


class AtUseStats(NamedTuple):
    """A step's reads at use: blocks read, how many the read-ahead had already started, the time the
    step's callbacks waited on the disk (`wait_s`: the stall) and the time the reads took (`read_s`)."""
    reads: int = 0
    ahead: int = 0
    wait_s: float = 0.0
    read_s: float = 0.0

    def add(self, **more: Any) -> "AtUseStats":
        return self._replace(**{k: getattr(self, k) + v for k, v in more.items()})


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
        # Read-ahead of the blocks read at use (`pipeline_read`): the block a callback will most likely
        # ask for next is read on the I/O threads into one of the pool's buffers (the same
        # `buffer_count` x `buffer_size` the load and store stream through, idle during the step).
        # Off with the plan's stage-3 prefetch (`overlap_comm: false` or `stage3_prefetch_bucket_size: 0`),
        # as DeepSpeed's parameter prefetch is.
        self.read_ahead = swap.read_ahead and plan.step.prefetch is not None
        self._lock = threading.Lock()
        self._pool_buffers = [b for s in self.files.buffers for b in s]
        self._free = list(range(len(self._pool_buffers)))
        self._ahead: dict[tuple[int, int], tuple[int, Future, int]] = {}  # (leaf, device) -> (layer, read, buffer)
        self._stale: list[tuple[Future, int]] = []  # reads ahead guessed wrong, buffer back once done
        self._course: dict[tuple[int, int], tuple[int, int]] = {}  # (leaf, device) -> (last layer, direction)
        self.last = AtUseStats()  # the latest step's reads at use
        self._stats = AtUseStats()

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
        it for a negative `layer`. With `pipeline_read`, a layer read at use also starts the read of
        the layer this device will ask for next (`_next`), which a later call then finds read."""
        r = self._by_device[(leaf, device_id)]
        region = self.regions[r]
        per = region.size // region.shape[0]
        start, stop = (0, region.size) if layer < 0 else (layer * per, (layer + 1) * per)
        shape = region.shape if layer < 0 else region.shape[1:]
        with self._lock:  # the devices' callbacks run on their own threads
            self.reads += 1
        if r in self.held:
            return self.held[r][start:stop].reshape(shape)
        if layer < 0:
            return self.files.read_range(0, self._slot[r], start, stop).reshape(shape)
        key = (leaf, device_id)
        with self._lock:
            ahead = self._ahead.pop(key, None)
            nxt = self._next(key, layer, region.shape[0])
        self._fetch(key, nxt, ahead if ahead is not None and ahead[0] != layer else None)
        waited = time.perf_counter()
        if ahead is not None and ahead[0] == layer:  # read ahead: wait for it (usually done), copy it out
            _, future, b = ahead
            future.result()
            waited = time.perf_counter() - waited
            out = self._pool_buffers[b][:per].copy()
            self._release(b)
            hit, took = 1, 0.0
        else:
            out = self.files.read_range(0, self._slot[r], start, stop)
            waited = took = time.perf_counter() - waited
            hit = 0
        with self._lock:
            self._stats = self._stats.add(reads=1, ahead=hit, wait_s=waited, read_s=took)
        return out.reshape(shape)

    def _next(self, key: tuple[int, int], layer: int, layers: int) -> int:
        """The layer this (leaf, device) will most likely read after `layer`, from the order of its
        reads: a scan runs 0, 1, ... forward, its backward ... 1, 0 (a reversed scan the other way), each
        end read again as the pass turns (the last forward layer is the backward's first; the first
        backward layer the next micro-batch's first). Holds `_lock`."""
        last, direction = self._course.get(key, (None, 1))
        if last is not None:
            if layer == last + 1:
                direction = 1
            elif layer == last - 1:
                direction = -1
            elif layer == last:  # the pass turned at an end
                direction = -1 if layer == layers - 1 else 1 if layer == 0 else direction
        self._course[key] = (layer, direction)
        nxt = layer + direction
        return nxt if 0 <= nxt < layers else layer

    def _fetch(self, key: tuple[int, int], layer: int, stale: tuple[int, Future, int] | None) -> None:
        """Start reading (leaf, device) `key`'s layer `layer` into a free pool buffer, unless read-ahead
        is off, the block is larger than a buffer, or every buffer is taken (then the read happens at
        use). `stale`: this key's earlier read-ahead of another layer, guessed wrong: its buffer goes
        back once its read is done."""
        with self._lock:
            if stale is not None:
                self._stale.append(stale[1:])
            done = [b for f, b in self._stale if f.done()]
            self._stale = [(f, b) for f, b in self._stale if not f.done()]
            self._free += done
        if not self.read_ahead:
            return
        r = self._by_device[key]
        region = self.regions[r]
        per = region.size // region.shape[0]
        if per > self.files.tile:
            return
        with self._lock:
            if not self._free:
                return
            b = self._free.pop()
            self._ahead[key] = (layer, self.files.submit(self._read_ahead, r, layer * per,
                                                          self._pool_buffers[b][:per]), b)

    def _read_ahead(self, r: int, start: int, out: np.ndarray) -> None:
        """On an I/O thread: one block into its pool buffer, its time counted as reading."""
        t0 = time.perf_counter()
        self.files.read_into(0, self._slot[r], start, out)
        took = time.perf_counter() - t0
        with self._lock:
            self._stats = self._stats.add(read_s=took)

    def _release(self, b: int) -> None:
        with self._lock:
            self._free.append(b)

    def _drain(self) -> None:
        """Wait for every read still ahead and drop what it read: the pool's buffers are all free again
        (the load and store stream through them) and nothing read before a write-back is served after it."""
        with self._lock:
            pending = [(f, b) for _, f, b in self._ahead.values()] + self._stale
            self._ahead, self._stale = {}, []
            self._course.clear()
        for future, b in pending:
            future.result()
            self._release(b)
        assert len(self._free) == len(self._pool_buffers), "a read ahead still holds a buffer"

    def settle(self) -> AtUseStats:
        """The step's end, before the update's shards are written: drop the reads ahead (`_drain`) and
        start a fresh count. The step's reads at use (`last`)."""
        self._drain()
        with self._lock:
            self.last, self._stats = self._stats, AtUseStats()
        return self.last

    def shard(self, leaf: int, device_id: int) -> np.ndarray:
        """Device `device_id`'s whole block of leaf `leaf`, read outside the step (an fp32 update's master
        copy of a leaf read at use: `core.nvme_step`); not counted as a read at use."""
        r = self._by_device[(leaf, device_id)]
        region = self.regions[r]
        if r in self.held:
            return self.held[r].reshape(region.shape)
        return self.files.read_region(0, self._slot[r]).reshape(region.shape)

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
        leaves = self._def.flatten_up_to(jax.block_until_ready(params))  # the step, its reads at use, done
        self.settle()
        started = time.perf_counter()

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
        self._drain()
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
