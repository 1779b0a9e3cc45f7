"""The train step with optimizer state on NVMe (`offload_optimizer.device: nvme`, ZeRO-Infinity).

The state the step carries between calls is *slim*: the parameters, the counters, the loss scaler
and the optimizer's scalars (its step count); the fp32 master copy and every parameter-shaped
optimizer array live in files (`core.swap.SwapFiles`), one region per unique shard of the update
placement this process holds. A step is three parts:

1. jitted on the devices: forward, backward and reduction (the plain step's `micro_grad_fn`), the
   unscale, global norm, finiteness and skip decision (`step.unscaled`) and the clip coefficient;
2. on the host, DeepSpeed's CPU optimizer over NVMe: each tile of each shard is read from the
   files, updated by the plan's optax transformation (jitted once per leaf on the CPU backend, the
   same `tx.update` the in-memory step runs, with the leaf's own name so parameter groups hold),
   and written back; the new master shard goes up to its devices;
3. jitted on the devices: `step.finish_update`, the plain step's end (scaler, cast and gather into
   the parameter placement, counters, metrics).

With the parameters on NVMe too (`core.param_swap`), the device part may read the stacked layer leaves
at use from the parameters' files (`at_use`): both parts are handed None for them, and an fp32 run's
update, whose master copy is the parameters, reads those leaves' shards from the parameters' files on
the host (their update placement is their parameter placement).

A step skipped for non-finite gradients reads and writes nothing. `full(state)` reads the files
back into a whole `TrainState` (checkpoints save that, so a checkpoint does not depend on the
files); `store(state)` writes a whole state out and returns the slim one, and the step accepts a
whole state too (it stores it first), so `init_state` + `make_train_step` work unchanged.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import numpy as np
import optax

from zerojax.core.layout import Plan
from zerojax.core.state import TrainState, state_shardings
from zerojax.core.swap import SwapFiles, Tile
from zerojax.errors import ConfigError


def _param_index(tx: optax.GradientTransformation, opt_state: Any, trained: Any) -> list[int]:
    """Per leaf of `opt_state` (flattened): the index of the trainable parameter it mirrors, or -1 for
    a counter or scalar. `trained` is the parameter tree the state was made for."""
    index = iter(range(10**9))
    numbered = jax.tree.map(lambda x: None if x is None else next(index), trained, is_leaf=lambda x: x is None)
    found: list[Any] = []
    jax.eval_shape(lambda: found.append(optax.tree_utils.tree_map_params(
        tx, lambda x, i: None if x is None else i, opt_state, numbered,
        transform_non_params=lambda v: jax.tree.map(lambda _: -1, v), is_leaf=lambda x: x is None)))
    return [int(i) for i in jax.tree.leaves(found[0])]


class Region:
    """One unique shard of one trainable leaf's update placement held by this process."""

    def __init__(self, leaf: int, index: tuple[slice, ...], devices: list[jax.Device], shape: tuple[int, ...]):
        self.leaf, self.index, self.devices, self.shape = leaf, index, devices, shape
        self.size = int(np.prod(shape, dtype=np.int64))


def shard_regions(shapes: list[tuple[int, ...]], shardings: list[jax.sharding.Sharding]) -> list[Region]:
    """The unique shards this process holds of each leaf (`shapes[i]` placed by `shardings[i]`), leaf by
    leaf, each with every local device that holds it: what a swap file stores once."""
    out = []
    for i, (shape, sharding) in enumerate(zip(shapes, shardings)):
        seen: dict[tuple, Region] = {}
        for device, index in sorted(sharding.addressable_devices_indices_map(shape).items(),
                                    key=lambda kv: kv[0].id):
            key = tuple((s.start, s.stop) for s in index)
            if key in seen:
                seen[key].devices.append(device)
                continue
            sub = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
            seen[key] = Region(i, index, [device], sub)
            out.append(seen[key])
    return out


class NvmeStep:
    """`step(state, batch) -> (slim state, metrics)` with the optimizer state in files (module doc)."""

    def __init__(self, plan: Plan, front: Callable[..., Any], back: Callable[..., Any], *,
                 at_use: frozenset[int] = frozenset(), filed: Any = None):
        """`front(state, batch)` and `back(state, shards, opt_state, norm, finite, overflow, losses,
        model_state)`: the device parts (`core.step.make_train_step` builds them). `at_use`: parameter
        leaves (flat indices) the front reads from the parameters' files itself (`core.param_swap`),
        handed to both parts as None; `filed` (a `ParamFiles`): where an fp32 run's update reads their
        master copy, the parameters, from."""
        swap = plan.memory.swap
        assert swap is not None
        self.plan, self.swap = plan, swap
        self.mixed = plan.policy.mixed
        full = state_shardings(plan)
        self._opt_def = jax.tree.structure(plan.abstract_opt_state)
        owner = _param_index(plan.tx, plan.abstract_opt_state, plan.abstract_trained)
        self._owner = owner
        self._trained_def = jax.tree.structure(plan.abstract_trained)
        self._trained_shapes = [tuple(x.shape) for x in jax.tree.leaves(plan.abstract_trained)]
        moments = [sum(1 for o in owner if o == i) for i in range(len(self._trained_shapes))]
        if len(set(moments)) > 1:
            raise ConfigError("zero_optimization.offload_optimizer.device: nvme needs the same optimizer state "
                              f"for every parameter (got {sorted(set(moments))} arrays per leaf); use device: cpu")
        dtypes = {str(x.dtype) for x, o in zip(self._opt_def.flatten_up_to(plan.abstract_opt_state), owner) if o >= 0}
        if dtypes - {"float32"}:
            raise ConfigError(f"zero_optimization.offload_optimizer.device: nvme stores float32 state; this "
                              f"optimizer keeps {sorted(dtypes)}: use device: cpu")
        self.k = moments[0] if moments else 0
        self.names = (["master"] if self.mixed else []) + [f"moment{j}" for j in range(self.k)]
        per_tile = len(self.names) + 1 + (0 if self.mixed else 1)  # + the gradient (+ the fp32 parameter)
        zero = "zero_optimization.offload_optimizer.buffer_count"
        if swap.buffer_count < per_tile:
            raise ConfigError(f"{zero}: {swap.buffer_count} buffers cannot hold one tile: the optimizer streams "
                              f"{per_tile} arrays per tile (parameter, gradient and {self.k} optimizer moments, as "
                              f"DeepSpeed counts them); set buffer_count to at least {per_tile}")
        self.regions = self._regions()
        self.files = SwapFiles(swap, self.names, [r.size for r in self.regions], extra=per_tile - len(self.names))
        self.slim_shardings = full._replace(master=None, opt_state=self.slim(full.opt_state))
        self.stall_s = 0.0  # the last step's host update, from the device part's end (the devices wait for it)
        self.at_use, self._filed = frozenset(at_use), filed
        # a trained leaf's index among the parameter leaves (an fp32 master read from the parameters' files)
        self._param_leaf = [i for i, t in enumerate(jax.tree.leaves(plan.trainable)) if t]
        given = self.slim_shardings._replace(params=jax.tree.unflatten(
            jax.tree.structure(full.params),
            [None if i in self.at_use else sh for i, sh in enumerate(jax.tree.leaves(full.params))]))

        update_dev = jax.tree.map(lambda s: s.with_memory_kind("device"), plan.update_shardings)
        self._front = jax.jit(front, in_shardings=(given, None))
        self._back = jax.jit(back, in_shardings=(given, update_dev, self.slim_shardings.opt_state,
                                                 None, None, None, None, None),
                             out_shardings=(self.slim_shardings, None), donate_argnums=(0,))
        self._update_dev = update_dev
        self._cpu = jax.devices("cpu")[0]

    # -- the slim state ---------------------------------------------------------------------------
    def slim(self, opt_state: Any) -> Any:
        """`opt_state` with its parameter-shaped leaves dropped (None): counters and scalars only."""
        leaves = self._opt_def.flatten_up_to(opt_state)
        return self._opt_def.unflatten([x if o < 0 else None for x, o in zip(leaves, self._owner)])

    def _regions(self) -> list[Region]:
        return shard_regions(self._trained_shapes, jax.tree.leaves(self.plan.update_shardings))

    def _device_shard(self, array: jax.Array, region: Region) -> jax.Array:
        return next(s.data for s in array.addressable_shards if s.device == region.devices[0])

    def _shard(self, array: jax.Array, region: Region) -> np.ndarray:
        return np.asarray(self._device_shard(array, region), np.float32).reshape(-1)

    def _place(self, r: int, values: np.ndarray) -> list[jax.Array]:
        """One region's host values on each device that holds that shard."""
        region = self.regions[r]
        return [jax.device_put(values.reshape(region.shape), device) for device in region.devices]

    def _assemble(self, leaf: int, placed: list[jax.Array]) -> jax.Array:
        """A trainable leaf's update-placement array from its regions' device arrays."""
        return jax.make_array_from_single_device_arrays(self._trained_shapes[leaf],
                                                        jax.tree.leaves(self._update_dev)[leaf], placed)

    def _read_leaf(self, array: int, leaf: int) -> jax.Array:
        """A leaf of one file's state array, read and placed region by region."""
        return self._assemble(leaf, [x for r, g in enumerate(self.regions) if g.leaf == leaf
                                     for x in self._place(r, self.files.read_region(array, r))])

    def _moment_slots(self) -> list[list[int]]:
        """Per trainable leaf, the flat opt_state positions of its moments (in order)."""
        slots: list[list[int]] = [[] for _ in self._trained_shapes]
        for pos, o in enumerate(self._owner):
            if o >= 0:
                slots[o].append(pos)
        return slots

    # -- whole state <-> files --------------------------------------------------------------------
    def is_slim(self, state: TrainState) -> bool:
        leaves = self._opt_def.flatten_up_to(state.opt_state)
        return state.master is None and all(x is None for x, o in zip(leaves, self._owner) if o >= 0)

    def store(self, state: TrainState) -> TrainState:
        """Write the master copy and optimizer moments of a whole state to the files; the slim state."""
        if self.is_slim(state):
            return state
        leaves = self._opt_def.flatten_up_to(state.opt_state)
        masters = jax.tree.leaves(state.master) if self.mixed else []
        slots = self._moment_slots()
        for r, region in enumerate(self.regions):
            arrays = ([masters[region.leaf]] if self.mixed else []) + [leaves[p] for p in slots[region.leaf]]
            for a, array in enumerate(arrays):
                self.files.write_region(a, r, self._shard(array, region))
        slim = state._replace(master=None, opt_state=self.slim(state.opt_state))
        return jax.device_put(slim, self.slim_shardings)

    def full(self, state: TrainState, *, moments: bool = True) -> TrainState:
        """The whole state: the slim one with the master copy and moments read back from the files, in
        the plan's shardings (host memory where the plan stores offloaded state). `moments=False`: the
        master copy only, the optimizer state left slim (reading the parameters needs no moments)."""
        if not moments:
            if not self.mixed:
                return state
            return state._replace(master=jax.device_put(self._master(), state_shardings(self.plan).master))
        storage = state_shardings(self.plan)
        columns: list[list[jax.Array]] = []
        for a in range(len(self.names)):
            per_leaf = []
            for leaf in range(len(self._trained_shapes)):
                per_leaf.append(self._read_leaf(a, leaf))
            columns.append(per_leaf)
        master = None
        if self.mixed:
            master = jax.device_put(self._trained_def.unflatten(columns[0]), storage.master)
        moments = columns[1:] if self.mixed else columns
        leaves = self._opt_def.flatten_up_to(state.opt_state)
        slots = self._moment_slots()
        for leaf, positions in enumerate(slots):
            for j, pos in enumerate(positions):
                leaves[pos] = moments[j][leaf]
        opt_state = jax.device_put(self._opt_def.unflatten(leaves), storage.opt_state)
        return state._replace(master=master, opt_state=opt_state)

    # -- the step ---------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=None)
    def _tile_update(self, leaf: int) -> Callable[..., Any]:
        """The optimizer on one tile of leaf `leaf`: the plan's `tx.update` on the trainable tree with
        only this leaf present (a flat tile), so name-based groups and masks see the leaf's own name."""
        tx, n = self.plan.tx, self.files.tile
        L = len(self._trained_shapes)

        def tree(x: Any) -> Any:
            return self._trained_def.unflatten([x if j == leaf else None for j in range(L)])

        template = jax.eval_shape(tx.init, tree(jax.ShapeDtypeStruct((n,), np.float32)))
        t_def = jax.tree.structure(template)
        t_owner = _param_index(tx, template, tree(jax.ShapeDtypeStruct((n,), np.float32)))

        def update(master: jax.Array, grad: jax.Array, moments: list[jax.Array], scalars: list[jax.Array],
                   coef: jax.Array) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
            it_m, it_s = iter(moments), iter(scalars)
            state = t_def.unflatten([next(it_m) if o >= 0 else next(it_s) for o in t_owner])
            g = grad * coef.astype(grad.dtype)  # step.clip_by_global_norm's scaling, coef 1 when off
            updates, new_state = tx.update(tree(g), state, tree(master))
            new_master = jax.tree.leaves(optax.apply_updates(tree(master), updates))[0]
            new_leaves = t_def.flatten_up_to(new_state)
            return (new_master, [x for x, o in zip(new_leaves, t_owner) if o >= 0],
                    [x for x, o in zip(new_leaves, t_owner) if o < 0])

        return jax.jit(update)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        state = self.store(state)
        losses, grads, master, norm, finite, overflow, coef, model_state = self._front(state, batch)
        opt_state = state.opt_state
        skip = bool(overflow)  # waits for the device part
        started = time.perf_counter()
        if skip:  # skipped: the files keep the previous state, the parameters stay as they were
            shards = self._old_shards(state, master)
        else:
            shards, opt_state = self._stream(state, grads, master, coef)
        self.stall_s = time.perf_counter() - started
        return self._back(state, shards, opt_state, norm, finite, overflow, losses, model_state)

    def _old_shards(self, state: TrainState, master: Any) -> Any:
        if not self.mixed:
            leaves = self._trained_def.flatten_up_to(master)
            return self._trained_def.unflatten([
                self._assemble(leaf, [x for r, g in enumerate(self.regions) if g.leaf == leaf
                                      for x in self._place(r, self._filed_master(g))])
                if x is None else x for leaf, x in enumerate(leaves)])
        return self._master()

    def _filed_master(self, region: Region) -> np.ndarray:
        """An fp32 run's master shard of a leaf read at use: its parameters' shard, from their files (the
        leaf's update placement is its parameter placement, `core.step.read_at_use`)."""
        return np.asarray(self._filed.shard(self._param_leaf[region.leaf], region.devices[0].id), np.float32).reshape(-1)

    def _master(self) -> Any:
        """The master copy (a mixed-precision run's first file), read and placed in the update placement."""
        return self._trained_def.unflatten([self._read_leaf(0, leaf) for leaf in range(len(self._trained_shapes))])

    def _stream(self, state: TrainState, grads: Any, master: Any, coef: jax.Array) -> tuple[Any, Any]:
        grads_l = jax.tree.leaves(grads)
        master_l = self._trained_def.flatten_up_to(master) if not self.mixed else None
        opt_leaves = self._opt_def.flatten_up_to(state.opt_state)
        scalars = [np.asarray(x) for x, o in zip(opt_leaves, self._owner) if o < 0]
        coef = np.asarray(coef)
        new_scalars: list[Any] = list(scalars)
        current: dict[str, Any] = {}
        shards: list[jax.Array | None] = [None] * len(self._trained_shapes)
        placed: list[list[jax.Array]] = [[] for _ in self._trained_shapes]
        tiles = [t for r in range(len(self.regions)) for t in self.files.tiles(r)]
        last_of_leaf = {self.regions[t.region].leaf: i for i, t in enumerate(tiles)}
        last_of_region = {t.region: i for i, t in enumerate(tiles)}

        def compute(i: int, t: Tile, bufs: list[np.ndarray]) -> None:
            region = self.regions[t.region]
            if current.get("region") != t.region:
                current["region"] = t.region
                if t.region + 1 < len(self.regions):  # the next shard's gradient comes down while this updates
                    nxt = self.regions[t.region + 1]
                    self._device_shard(grads_l[nxt.leaf], nxt).copy_to_host_async()
                current["grad"] = self._shard(grads_l[region.leaf], region)
                current["param"] = (None if self.mixed else self._filed_master(region)
                                    if master_l[region.leaf] is None else self._shard(master_l[region.leaf], region))
                current["out"] = np.empty(region.size, np.float32)
            a, b = t.start, t.stop
            m = b - a
            filed, extra = bufs[:len(self.names)], bufs[len(self.names):]
            extra[0][:m] = current["grad"][a:b]
            if self.mixed:
                master_buf, moment_bufs = filed[0], filed[1:]
            else:
                extra[1][:m] = current["param"][a:b]
                master_buf, moment_bufs = extra[1], filed
            with jax.default_device(self._cpu):
                new_master, new_moments, sc = self._tile_update(region.leaf)(
                    master_buf, extra[0], list(moment_bufs), scalars, coef)
            new_master = np.asarray(new_master)
            for buf, value in zip(moment_bufs, new_moments):
                np.copyto(buf[:m], np.asarray(value)[:m])
            if self.mixed:
                np.copyto(master_buf[:m], new_master[:m])
            current["out"][a:b] = new_master[:m]
            new_scalars[:] = [np.asarray(x) for x in sc]
            # Host memory beyond the buffers: this region's gradient and new master, sent up when it ends.
            if i == last_of_region[t.region]:
                placed[region.leaf] += self._place(t.region, current.pop("out"))
                current.clear()
            if i == last_of_leaf[region.leaf]:
                shards[region.leaf] = self._assemble(region.leaf, placed[region.leaf])
                placed[region.leaf] = []

        self.files.stream(tiles, compute)
        leaves = list(opt_leaves)
        it = iter(new_scalars)
        for pos, o in enumerate(self._owner):
            if o < 0:
                leaves[pos] = jax.device_put(next(it), self.plan.replicated)
        return self._trained_def.unflatten(shards), self._opt_def.unflatten(leaves)

    def lower(self, state: TrainState, batch: Any) -> "Lowered":
        """The step lowered for `state` (whole or slim, arrays or `jax.ShapeDtypeStruct`s: only shapes
        and shardings are read, nothing is written to the files) and `batch`, as JAX's ahead-of-time
        interface has it: the device part's program, whose `compile()` is the step to call."""
        slim = state._replace(master=None, opt_state=self.slim(state.opt_state))
        return Lowered(self, self._front.lower(slim, batch))


class Lowered:
    """A step of several programs lowered (`NvmeStep`, `core.param_swap.ParamSwapStep`): JAX's `Lowered`
    of its device part (`as_text`, ... read through), and `compile()` gives the `Compiled` that runs the
    whole step. Such a step thus takes the path of a jitted one (`Engine._agreed`: lower, compare across
    processes, compile, call)."""

    def __init__(self, step: Callable[..., Any], front: Any):
        self._step, self._front = step, front

    def __getattr__(self, name: str) -> Any:
        return getattr(self._front, name)

    def compile(self, *args: Any, **kwargs: Any) -> "Compiled":
        return Compiled(self._step, self._front.compile(*args, **kwargs))


class Compiled:
    """The device part's executable (`as_text`, `memory_analysis`, ... read through); calling it runs
    the whole step (the step's own `__call__`), its first program already compiled."""

    def __init__(self, step: Callable[..., Any], front: Any):
        self._step, self._front = step, front

    def __getattr__(self, name: str) -> Any:
        return getattr(self._front, name)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        return self._step(state, batch)
