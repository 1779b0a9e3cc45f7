"""ZeRO stages as layouts: per-leaf placements of parameters, gradients and optimizer state.

A stage is nothing but the set of model-state roles it partitions over the `data` axis
(`STAGE_PARTITIONS`). The plan builder (`zerojax.planner.plan.make_plan`) turns that set, the mesh
and the model's abstract parameters into a `Plan`: per-leaf placements, their `NamedSharding`s and
every other decision the step needs, as plain data. The train step reads the plan and never asks
for the stage, nor for the config it came from.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.core.collectives import PARTIAL, REPLICATED, Placement, Shard, Wire
from zerojax.core.measure import planned_bytes
from zerojax.core.mesh import (DATA, EXPERT, TENSOR, DataAxis, data_axes, data_size, expert_size, host_axes,
                               inner_major, row_axes, sequence_size, tensor_size)
from zerojax.core.offload import Memory
from zerojax.core.precision import Policy, ScalerConfig
from zerojax.core.remat import Remat
from zerojax.optim.transforms import AdamSettings, LrSchedule

if TYPE_CHECKING:
    from zerojax.config import BatchSize

PARAMETERS, GRADIENTS, OPTIMIZER = "parameters", "gradients", "optimizer"
STAGE_PARTITIONS: dict[int, frozenset[str]] = {
    0: frozenset(),
    1: frozenset({OPTIMIZER}),
    2: frozenset({OPTIMIZER, GRADIENTS}),
    3: frozenset({OPTIMIZER, GRADIENTS, PARAMETERS}),
}


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one parameter's state lives.

    param:  the stored parameter the forward pass reads (REPLICATED or Shard).
    grad:   the gradient accumulator across micro-steps: PARTIAL (reduced once at the boundary),
            or reduced on every micro-step into Shard / REPLICATED.
    update: the reduced gradient at the update, the fp32 master copy and the optimizer state.
    split:  (dim, mesh axis) pairs: dimensions split over mesh axes other than the data axis,
            whatever the stage - a leaf's second role (a pipeline's `stage` rows today; a tensor,
            expert or sequence axis is one more pair). ZeRO then shards another dimension, and
            every sharding composes the two.
    wire:   how a sharded parameter is gathered (its axis; ZeRO++'s quantized gathers and reductions).
    names:  the logical axis names the model annotated the leaf with (`nnx.with_partitioning`), one
            per dimension, or None: where they name a mesh axis the layout follows them.
    trainable: False for a frozen leaf: it has a `param` placement only - no gradient, no master copy,
            no optimizer state - so `grad` and `update` are unused; it is stored in the compute dtype
            and gathered like any weight.
    """
    param: Placement
    grad: Placement
    update: Placement
    split: tuple[tuple[int, str], ...] = ()
    wire: Wire = Wire()
    names: tuple[Any, ...] | None = None
    trainable: bool = True

    @property
    def lead(self) -> str | None:
        """The mesh axis dimension 0 is split over besides ZeRO's (pipelines: one row per `stage`)."""
        return dict(self.split).get(0)

    @property
    def split_dims(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.split)

    @property
    def split_axes(self) -> tuple[str, ...]:
        return tuple(a for _, a in self.split)

    def over(self, axis: str) -> int | None:
        """The dimension split over mesh axis `axis` (None: not split over it)."""
        return next((d for d, a in self.split if a == axis), None)


def choose_dim(shape: tuple[int, ...], n: int, layer_axes: int | None = None,
               taken: tuple[int, ...] = (), prefer: int | None = None) -> int | None:
    """The dimension to shard over `n` devices: the most major one they divide, outside the layer axes.

    Most major, so that each device's block is contiguous: every gather and reduce-scatter then
    moves whole rows (XLA:CPU runs a collective along an inner dimension 5-14x slower, and NCCL
    needs contiguous buffers, which XLA otherwise makes with a transpose). `layer_axes` leading
    dimensions stack layers that a loss scans over: they stay whole, so the scan slices them
    without communication. When they are not known (None), every dimension but the last two is
    taken to stack layers (a matrix is a matrix, `[layers, in, out]` a stack, `[groups, layers,
    in, out]` a nested one). Failing those, the most major divisible dimension but the first;
    dimension 0 only when nothing else divides. Dimensions in `taken` are split over another
    mesh axis already (a leaf's second role) and are never chosen; `prefer` (a dimension the model
    annotated with the data axis) wins whenever the devices divide it.
    """
    if n == 1:
        return None
    candidates = [d for d, s in enumerate(shape) if s % n == 0 and s >= n and d not in taken]
    if not candidates:
        return None
    if prefer in candidates:
        return prefer
    skip = max(len(shape) - 2, 0) if layer_axes is None else layer_axes
    return ([d for d in candidates if d >= skip] or [d for d in candidates if d > 0] or candidates)[0]


def leaf_layout(shape: tuple[int, ...], n: int, partitions: frozenset[str],
                persistence_threshold: int, layer_axes: int | None = None, *,
                split: tuple[tuple[int, str], ...] = (), prefer: int | None = None,
                axis: DataAxis | None = None) -> LeafLayout:
    """`layer_axes` leading dimensions stack layers (a scanned stack; None: not known): the
    persistence threshold is compared with one layer's slice, which is what the loss holds whole
    at a time. `split` dimensions are split by other mesh axes (the pipeline's stage rows), so
    ZeRO shards another one; `prefer` is a dimension the model asked to split over the data axis.
    `axis`: the part of the data axis ZeRO shards this leaf over (`n` its devices; None: all of it):
    an expert weight, split over `expert`, is ZeRO-sharded over `data` only."""
    dim = choose_dim(shape, n, layer_axes, taken=tuple(d for d, _ in split), prefer=prefer)
    sharded: Placement = REPLICATED if dim is None else Shard(dim, axis)
    keep_param_whole = math.prod(shape[layer_axes or 0:]) < persistence_threshold
    param = sharded if PARAMETERS in partitions and not keep_param_whole else REPLICATED
    grad = sharded if GRADIENTS in partitions else PARTIAL
    update = sharded if OPTIMIZER in partitions else REPLICATED
    return LeafLayout(param=param, grad=grad, update=update, split=split)


def hpz_layout(lay: LeafLayout, data: DataAxis) -> LeafLayout:
    """ZeRO++ hpZ (`zero_hpz_partition_size`): the stored parameters are a secondary copy split over the
    part of the leaf's ZeRO group inside one host (`host_axes`; replicated across `data_outer`), so every
    forward/backward gather stays within a host; gradients and optimizer state stay split over the whole
    group, inner-major (`inner_major`), so that gathering an updated shard over `data_outer` yields
    exactly the secondary copy's block. `data` is the mesh's data axes, the group of a Shard whose axis
    is None (an expert weight's Shard names its expert-data-parallel group itself)."""
    def group(p: Shard) -> DataAxis:
        return data if p.axis is None else p.axis

    def secondary(p: Placement) -> Placement:
        return Shard(p.dim, host_axes(group(p))) if isinstance(p, Shard) else p

    def primary(p: Placement) -> Placement:
        return Shard(p.dim, inner_major(group(p))) if isinstance(p, Shard) else p

    return dataclasses.replace(lay, param=secondary(lay.param), grad=primary(lay.grad), update=primary(lay.update))


def spec(placement: Placement, ndim: int, split: tuple[tuple[int, str], ...] = (), data: DataAxis = DATA) -> P:
    """PartitionSpec of a reduced placement (PARTIAL buffers are full-size per device) composed with
    the leaf's `split` dimensions (other mesh axes); `data` is the mesh's data axis (a pair of axes
    on a hierarchical mesh: a shard is split over both)."""
    if not split and not isinstance(placement, Shard):
        return P()
    axes: list[Any] = [None] * ndim
    for dim, axis in split:
        axes[dim] = axis
    if isinstance(placement, Shard):
        axes[placement.dim] = data if placement.axis is None else placement.axis
    return P(*axes)


def is_layout(x: Any) -> bool:
    """`is_leaf` for trees of LeafLayouts (a LeafLayout is a dataclass, not a pytree node to enter)."""
    return isinstance(x, LeafLayout)


def map_layouts(fn: Callable[..., Any], layouts: Any, *trees: Any) -> Any:
    """`jax.tree.map` over a plan's layouts and parameter-shaped trees, one LeafLayout per leaf."""
    return jax.tree.map(fn, layouts, *trees, is_leaf=is_layout)


class MemoryReport(NamedTuple):
    """Per-device bytes of model state, next to the ZeRO formula with this run's dtypes."""
    n_params: int
    data_size: int
    stage: int
    params: int
    grads: int
    optimizer: int
    formula_params: float
    formula_grads: float
    formula_optimizer: float
    replicated_fraction: float
    params_host: int = 0        # of `params`, the bytes stored in host memory (offload)
    optimizer_host: int = 0     # of `optimizer`, the bytes stored in host memory (offload)
    memory: str = "no offload"  # Memory.describe() of the plan
    tensor_size: int = 1        # devices a tensor-sliced weight is split over (the formula's Ψ is one slice)
    expert_size: int = 1        # devices an expert weight's experts are split over (then ZeRO over data / expert)
    sequence_size: int = 1      # devices one row's tokens are split over (part of `data_size`)
    n_frozen: int = 0           # of `n_params`, the frozen ones: stored parameters only (no gradient, no master)
    optimizer_nvme: int = 0     # of `optimizer`, the bytes in NVMe swap files (offload_optimizer.device: nvme)
    nvme_buffers: int = 0       # host bytes the swapped state streams through (buffer_count x tile x 4)
    params_nvme: int = 0        # of `params`, the bytes in NVMe swap files (offload_param.device: nvme)
    param_buffers: int = 0      # host bytes the parameters stream through (buffer_count x buffer_size x width)
    params_at_use: int = 0      # of `params_nvme`, the stacked layers a step reads layer by layer (`layers_read_at_use`)
    params_at_use_held: int = 0  # of those, the most on the device at once: two layers (in use, and the next)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def host(self) -> int:
        return self.params_host + self.optimizer_host

    @property
    def device(self) -> int:
        return self.total - self.host - self.optimizer_nvme - self.params_nvme

    @property
    def device_in_step(self) -> int:
        """The state's bytes on the device during a step: the NVMe parameters are read onto it for the
        step, whole, except the stacked layers read at use, of which two layers at a time (the one in
        use and the next, which the step's prefetch may read early)."""
        return self.device + self.params_nvme - self.params_at_use + self.params_at_use_held

    @property
    def formula_total(self) -> float:
        return self.formula_params + self.formula_grads + self.formula_optimizer

    def table(self) -> str:
        def mib(b: float) -> str:
            return f"{b / 2**20:10.2f}"
        nvme = self.optimizer_nvme + self.params_nvme
        rows = [("parameters", self.params, self.params_host, self.params_nvme, self.formula_params),
                ("gradients", self.grads, 0, 0, self.formula_grads),
                ("optimizer state", self.optimizer, self.optimizer_host, self.optimizer_nvme, self.formula_optimizer),
                ("total", self.total, self.host, nvme, self.formula_total)]
        frozen = f" ({self.n_frozen:,} frozen)" if self.n_frozen else ""
        out = [f"ZeRO stage {self.stage}: {self.n_params:,} parameters{frozen} over {self.over()}; {self.memory}",
               f"{'per device':<16} {'device MiB':>10} {'host MiB':>10}{' ' + format('NVMe MiB', '>10') if nvme else ''}"
               f" {'formula':>10} {'ratio':>7}"]
        for name, got, host, disk, want in rows:
            ratio = got / want if want else float("nan")  # wherever the bytes live
            out.append(f"{name:<16} {mib(got - host - disk)} {mib(host)}{f' {mib(disk)}' if nvme else ''} "
                       f"{mib(want)} {ratio:7.3f}")
        if self.optimizer_nvme:
            out.append(f"NVMe: the master copy and moments in swap files, streamed through {self.nvme_buffers / 2**20:.2f} "
                       f"MiB of host buffers per process (DeepSpeed's ZeRO-Infinity)")
        if self.params_nvme:
            out.append(f"NVMe: the parameter partitions in swap files between steps (on the device during the step), "
                       f"streamed through {self.param_buffers / 2**20:.2f} MiB of host buffers per process (up to "
                       f"max_in_cpu elements per device stay in host memory instead)")
        if self.params_at_use:
            out.append(f"of them {self.params_at_use / 2**20:.2f} MiB of stacked layers are read layer by layer inside "
                       f"the step: at most {self.params_at_use_held / 2**20:.2f} MiB on the device at once (the layer "
                       f"in use and the next, which the step's prefetch may read early), so the step holds "
                       f"{self.device_in_step / 2**20:.2f} MiB of state")
        out.append(f"bytes left replicated where the stage shards: {100 * self.replicated_fraction:.2f}%")
        return "\n".join(out)

    def over(self) -> str:
        """The devices the state is divided over, axis by axis: ZeRO's data shards (with the sequence
        axis among them), the tensor slices, and the expert weights' own split."""
        rows = self.data_size // self.sequence_size
        over = f"{self.data_size} data shards"
        if self.sequence_size > 1:
            over += f" (data {rows} x sequence {self.sequence_size})"
        if self.tensor_size > 1:
            over += f" x {self.tensor_size} tensor slices"
        if self.expert_size > 1:
            over += (f" (expert weights: experts over {self.expert_size} expert devices, ZeRO over the "
                     f"{self.data_size // self.expert_size} data shards)")
        return over


class UpdateRule(NamedTuple):
    """How the update is computed, apart from where state lives: the optax transformation, its
    learning-rate schedule, the fp16 loss scaler, gradient clipping and the backend that runs it."""
    tx: optax.GradientTransformation
    schedule: LrSchedule
    scaler: ScalerConfig
    kernels: str = "xla"           # optimizer-update backend: xla, triton, mosaic_gpu or interpret
    clip: float = 0.0              # global L2 norm the gradients are clipped to (0: no clipping)
    adam: AdamSettings | None = None  # Adam's constants, for the fused kernel (None: not Adam)
    strict: bool = False           # kernels forced (`pallas`): a failed self-check is an error, not XLA
    checked: bool = False          # the backend needs no self-check (XLA, or chosen in code: `with_kernels`)
    norm: Callable[[Any], jax.Array] | None = None  # the gradient tree's global L2 norm (None: optax's);
    #                                   a layout that stores some values more than once counts each once


class Prefetch(NamedTuple):
    """Prefetching over scanned stacks (DeepSpeed's `overlap_comm` with
    `stage3_prefetch_bucket_size` and `stage3_max_live_parameters`, in elements): layer i+1 is
    gathered ahead when its gathered size fits the bucket and two layers fit the live limit."""
    bucket: int
    max_live: int
    # activation_checkpointing.cpu_checkpointing: the per-layer input carries the backward pass
    # replays from are kept in host memory (pinned_host) between the forward and backward scans.
    offload_carries: bool = False


class StepRule(NamedTuple):
    """How the forward and backward pass run, decided once from the config.

    remat:     the activation-checkpointing policy a user's loss is rewritten with (None: as written).
    prefetch:  stage-3 gathers issued ahead of their layer (DeepSpeed's overlap_comm; None: off).
    predivide: each device's gradient is divided by the data-parallel size before the sum
               (DeepSpeed's reduce-scatter path and `prescale_gradients`); otherwise by
               `predivide_factor` before and `factor / dp` after (its all-reduce path).
    partition_activations: with tensor slices, what a rematerialized layer keeps is split over the
               tensor axis (DeepSpeed's activation_checkpointing.partition_activations).
    average:   the data-parallel gradients are averaged (DeepSpeed's gradient_allreduce_op: mean); False:
               summed with no 1/dp anywhere (sum).
    """
    remat: Remat | None = None
    prefetch: Prefetch | None = None
    predivide: bool = True
    predivide_factor: float = 1.0
    partition_activations: bool = False  # tensor slices: rematerialized regions keep inputs split
    average: bool = True           # gradient_allreduce_op mean (True) or sum (False)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Every decision a run's maths needs, as plain data: where each piece of state lives (per-leaf
    layouts over the mesh), how the update and the step are computed, the batch split and dtypes.

    Built once per run by the plan builder from a config (`zerojax.plan`); nothing below it reads
    the config. `origin` is that config's fingerprint (every key and value, as text), so a public
    function given a config can check that it is the plan's. Derived trees (shardings, specs, abstract optimizer state) are computed
    once, on first use.
    """
    mesh: Mesh
    stage: int                     # the ZeRO stage, for reports: the maths reads the layouts
    batch: "BatchSize"
    policy: Policy
    rule: UpdateRule
    abstract_params: Any           # ShapeDtypeStructs of the logical (fp32) parameters
    layouts: Any                   # LeafLayout per parameter leaf
    memory: Memory = Memory()      # memory kinds of stored state and where the update runs (offload)
    step: StepRule = StepRule()
    seed: int = 0                  # the run's seed: initial parameters and per-step keys
    hpz: int = 1                   # devices in ZeRO++ hpZ's secondary parameter partition (1: off)
    origin: tuple[tuple[str, str], ...] = ()  # fingerprint of the config the plan was made from
    tensor_plan: str | None = None  # which weights the tensor axis splits, and why (a table to print)
    model_state: Any = None        # the model's state the step updates but does not differentiate (NNX
    #                                BatchStats: BatchNorm's running mean and var), its initial values; replicated

    # -- the update rule, by name (what the step reads) ----------------------------------------
    @property
    def tx(self) -> optax.GradientTransformation:
        return self.rule.tx

    @property
    def schedule(self) -> LrSchedule:
        return self.rule.schedule

    @property
    def scaler(self) -> ScalerConfig:
        return self.rule.scaler

    @property
    def kernels(self) -> str:
        return self.rule.kernels

    def with_kernels(self, kernels: str) -> "Plan":
        """The same plan with the update run by another backend (e.g. "xla" or "triton"), as the caller
        chose it: no self-check runs for it (e.g. lowering for CUDA on a machine without a GPU)."""
        return dataclasses.replace(self, rule=self.rule._replace(kernels=kernels, checked=True))

    # -- where state lives ---------------------------------------------------------------------
    @property
    def data_size(self) -> int:
        return data_size(self.mesh)

    @property
    def tensor_size(self) -> int:
        return tensor_size(self.mesh)

    @functools.cached_property
    def tensor_dims(self) -> Any:
        """Per leaf, the dimension split over the tensor axis (None: whole on every tensor device)."""
        return map_layouts(lambda lay: lay.over(TENSOR), self.layouts)

    @property
    def sliced(self) -> bool:
        """Some weight is split over the tensor axis: the loss runs on slices (`tensor_parallel`)."""
        return any(d is not None for d in jax.tree.leaves(self.tensor_dims))

    def annotations(self) -> str | None:
        """One line on the model's own sharding annotations (None when it has none): which leaves
        carry logical axis names, and whether the layout follows them here."""
        lays = jax.tree.leaves(self.layouts, is_leaf=is_layout)
        named = [lay for lay in lays if lay.names is not None]
        if not named:
            return None
        words = sorted({w for lay in named for n in lay.names for w in ((n,) if isinstance(n, str) else n or ())})
        mesh_axes = set(self.mesh.axis_names)
        used = sorted(set(words) & mesh_axes)
        head = f"model annotations: {len(named)} of {len(lays)} leaves name logical axes ({', '.join(words)})"
        if used:
            return f"{head}; the data-axis shard follows the ones naming mesh axes ({', '.join(used)})"
        return (f"{head}; none names an axis of this mesh ({', '.join(self.mesh.axis_names)}), so they are kept "
                f"in the plan and ZeRO shards each leaf along its most major divisible dimension")

    @functools.cached_property
    def n_leaves(self) -> int:
        return len(jax.tree.leaves(self.abstract_params))

    # -- what is trained: the update's trees hold the trainable leaves only (None at a frozen one) ------
    @functools.cached_property
    def trainable(self) -> Any:
        """Per leaf, whether it is trained (a bool tree shaped like the parameters)."""
        return map_layouts(lambda lay: lay.trainable, self.layouts)

    @functools.cached_property
    def has_frozen(self) -> bool:
        return not all(jax.tree.leaves(self.trainable))

    def trained(self, tree: Any) -> Any:
        """`tree` (parameter-shaped; a leaf may be a subtree such as a ParamShard) with each frozen
        leaf replaced by None: the shape of gradients, the master copy and the optimizer's parameters."""
        return map_layouts(lambda lay, x: x if lay.trainable else None, self.layouts, tree)

    def frozen(self, tree: Any) -> Any:
        """`tree` with each trainable leaf replaced by None: the part the step closes over."""
        return map_layouts(lambda lay, x: None if lay.trainable else x, self.layouts, tree)

    def merge(self, trained: Any, frozen: Any) -> Any:
        """The whole parameter tree again from its two parts (`trained`, `frozen`)."""
        return map_layouts(lambda lay, t, f: t if lay.trainable else f, self.layouts, trained, frozen)

    @functools.cached_property
    def trained_layouts(self) -> Any:
        """The layouts of the trainable leaves (None at a frozen one): what the update maps over."""
        return self.trained(self.layouts)

    @functools.cached_property
    def abstract_trained(self) -> Any:
        """`abstract_params` of the trainable leaves (None at a frozen one)."""
        return self.trained(self.abstract_params)

    @functools.cached_property
    def n_trained(self) -> int:
        """Leaves the update sees: one finiteness flag each (`leaf_finite`, the scaler's `first_bad`)."""
        return len(jax.tree.leaves(self.abstract_trained))

    @functools.cached_property
    def trained_paths(self) -> list[str]:
        """Each trainable leaf's path, in tree order (what a finiteness flag's index names)."""
        return [p for p, t in zip(self.leaf_paths, jax.tree.leaves(self.trainable)) if t]

    @functools.cached_property
    def leaf_paths(self) -> list[str]:
        """Each parameter leaf's path, in tree order (for messages)."""
        return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(self.abstract_params)]

    def _shardings(self, role: str) -> Any:
        """Per leaf, the sharding of one role; gradients and the update exist for trainable leaves only."""
        data = data_axes(self.mesh)
        layouts, abstract = ((self.layouts, self.abstract_params) if role == "param" else
                             (self.trained_layouts, self.abstract_trained))
        return map_layouts(lambda lay, p: NamedSharding(self.mesh, spec(getattr(lay, role), len(p.shape), lay.split,
                                                                        data)),
                           layouts, abstract)

    @functools.cached_property
    def init_shardings(self) -> Any:
        """Where each whole parameter is first built: a trainable one in its update placement (its master
        copy's), a frozen one in its parameter placement (it has no other)."""
        return self.merge(self.update_shardings, self.frozen(self.param_shardings))

    @functools.cached_property
    def param_shardings(self) -> Any:
        return self._shardings("param")

    @functools.cached_property
    def grad_shardings(self) -> Any:
        """Shardings of the gradient accumulator (PARTIAL accumulators are whole on each device)."""
        return self._shardings("grad")

    @functools.cached_property
    def update_shardings(self) -> Any:
        """Shardings of reduced gradients at the update, of the master copy and of optimizer state."""
        return self._shardings("update")

    @functools.cached_property
    def param_specs(self) -> Any:
        """PartitionSpecs of `param_shardings` (shard_map's in/out specs)."""
        return jax.tree.map(lambda s: s.spec, self.param_shardings)

    @functools.cached_property
    def update_specs(self) -> Any:
        """PartitionSpecs of `update_shardings` (shard_map's in/out specs)."""
        return jax.tree.map(lambda s: s.spec, self.update_shardings)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def _stored(self, shardings: Any, kind: str | None) -> Any:
        return shardings if kind is None else jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)

    @functools.cached_property
    def param_storage(self) -> Any:
        """Where parameters live between steps: `param_shardings` in the plan's parameter memory."""
        return self._stored(self.param_shardings, self.memory.params)

    @functools.cached_property
    def update_storage(self) -> Any:
        """Where the fp32 master copy lives between steps (host memory under optimizer offload)."""
        return self._stored(self.update_shardings, self.memory.optimizer)

    @functools.cached_property
    def opt_state_storage(self) -> Any:
        """Where optimizer state lives between steps: parameter-shaped leaves follow the master copy,
        counters and scalars stay on the device."""
        return self._opt_state_following(self.update_storage)

    def _opt_state_following(self, update: Any) -> Any:
        """Parameter-shaped optimizer leaves placed as `update`; counters and scalars replicated. A None
        in a parameter-shaped tree (a leaf the optimizer keeps no state for, e.g. Muon's momentum of an
        Adam leaf) stays None.

        optax finds the parameter-shaped leaves by running `tx.init` on a placeholder; run under
        `eval_shape` its scalars (schedule values, counters) are traced, not each compiled and run."""
        found: list[Any] = []
        jax.eval_shape(lambda: found.append(optax.tree_utils.tree_map_params(
            self.tx, lambda x, sharding: None if x is None else sharding, self.abstract_opt_state, update,
            transform_non_params=lambda _: self.replicated, is_leaf=lambda x: x is None)))
        return found[0]

    @functools.cached_property
    def abstract_opt_state(self) -> Any:
        master = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, self.policy.master),
                              self.abstract_trained)
        return jax.eval_shape(self.tx.init, master)

    @functools.cached_property
    def opt_state_shardings(self) -> Any:
        """Parameter-shaped optimizer leaves follow `update`; counters and scalars are replicated."""
        return self._opt_state_following(self.update_shardings)

    @property
    def batch_sharding(self) -> NamedSharding:
        """How a global batch is placed: rows split over the data axis (not `sequence`: the step splits
        each row's tokens over it)."""
        return NamedSharding(self.mesh, P(row_axes(self.mesh)))

    def report(self) -> MemoryReport:
        return memory_report(self)


def layers_read_at_use(p: Plan) -> frozenset[int]:
    """The parameter leaves (flat indices) that a step with `offload_param.device: nvme` can read from the
    files at use, layer by layer inside the compiled step (`core.param_swap`), rather than before it: the
    trainable stacked layers (three or more dimensions, the planner's reading of a stack when not told
    its layer axes), sharded along a dimension after the layer axis, in a program that only computes
    gradients of them: a mixed-precision run's (the update reads the fp32 master, not these), or any
    run's with the optimizer on NVMe (the update runs on the host, which reads an fp32 run's master, the
    parameters, from their files; there the leaf's update placement must be its parameter placement,
    shard for shard). Elsewhere none: an fp32 run's update on the device or in host memory is in the
    same program and reads the parameters as its master copy."""
    if p.memory.param_swap is None or not (p.policy.mixed or p.memory.swap is not None):
        return frozenset()
    leaves = jax.tree.leaves(p.abstract_params)
    layouts = jax.tree.leaves(p.layouts, is_leaf=is_layout)
    return frozenset(i for i, (x, lay) in enumerate(zip(leaves, layouts))
                     if lay.trainable and isinstance(lay.param, Shard) and lay.param.dim > 0 and x.ndim >= 3
                     and not lay.split and (p.policy.mixed or lay.update == lay.param))


def memory_report(p: Plan) -> MemoryReport:
    """Bytes per device the plan's layouts give, against the ZeRO formula for the same dtypes.

    Formula (Rajbhandari et al.): params P·Ψ, gradients G·Ψ_t, optimizer K·Ψ_t, each divided by N
    when the stage partitions it; P, G are the parameter and accumulator itemsizes and K counts
    the fp32 master copy (mixed precision only) plus the optimizer's per-parameter state. Ψ counts
    every parameter, Ψ_t the trainable ones: a frozen parameter is stored (P bytes, in the compute
    dtype) and nothing else.
    """
    n, pol = p.data_size, p.policy
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(p.abstract_params))
    psi_t = sum(math.prod(x.shape) for x in jax.tree.leaves(p.abstract_trained))
    trains = jax.tree.leaves(p.trainable)
    ep = expert_size(p.mesh)
    # One device's slice of the model (a tensor-sliced leaf's 1/tensor, an expert leaf's 1/expert) and
    # the shards ZeRO divides it into: the data-parallel size, or data / expert for an expert leaf
    # (its expert-data-parallel group, DeepSpeed's ep_size carving).
    slices = [(math.prod(x.shape) / (1 if lay.over(TENSOR) is None else p.tensor_size)
               / (1 if lay.over(EXPERT) is None else ep), n // (1 if lay.over(EXPERT) is None else ep))
              for lay, x in zip(jax.tree.leaves(p.layouts, is_leaf=is_layout), jax.tree.leaves(p.abstract_params))]
    params = planned_bytes(p.abstract_params, p.param_shardings, pol.param)
    grads = planned_bytes(p.abstract_trained, p.grad_shardings, pol.accum)
    master = planned_bytes(p.abstract_trained, p.update_shardings, pol.master) if pol.mixed else 0
    opt_abstract = p.abstract_opt_state
    opt = planned_bytes(opt_abstract, p.opt_state_shardings)
    # K: bytes per parameter of master + parameter-shaped optimizer leaves (whole-model count).
    opt_full = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(opt_abstract)
                   if math.prod(x.shape) > 1)
    k = (pol.master.itemsize if pol.mixed else 0) + opt_full / psi_t
    parts = STAGE_PARTITIONS[p.stage]

    def share(role: str, hosts: int = 1) -> float:
        """Elements per device of one role under the stage: each slice (a trainable one, for gradients and
        optimizer state), divided by its ZeRO shards (by those within one of `hosts` hosts, for hpZ's
        secondary copy)."""
        return sum(size / (shards // hosts) if role in parts else size
                   for (size, shards), trained in zip(slices, trains) if trained or role == PARAMETERS)

    # Fraction of model-state bytes that the stage would shard but stayed whole.
    kept = total = 0.0
    for lay, x in zip(jax.tree.leaves(p.layouts, is_leaf=is_layout), jax.tree.leaves(p.abstract_params)):
        size = math.prod(x.shape)
        roles = ((PARAMETERS, lay.param, pol.param.itemsize), (GRADIENTS, lay.grad, pol.accum.itemsize),
                 (OPTIMIZER, lay.update, k))
        for role, place, width in roles if lay.trainable else roles[:1]:
            if role in parts:
                total += size * width
                kept += size * width * (not isinstance(place, Shard))
    host_master = (planned_bytes(p.abstract_trained, p.update_storage, pol.master, host_only=True)
                   if pol.mixed else 0)
    # hpZ's secondary copy is split over the host's part of each leaf's ZeRO group (its shards over the
    # n / hpz hosts): hpz devices for an ordinary weight (data_inner x expert x sequence), hpz / expert
    # for an expert weight's 1/expert slice, so Ψ/hpz parameters per device either way.
    param_elements = share(PARAMETERS, hosts=n // p.hpz if p.hpz > 1 else 1)
    optimizer_host = host_master + planned_bytes(opt_abstract, p.opt_state_storage, host_only=True)
    nvme = nvme_buffers = 0
    if p.memory.swap is not None:  # the offloaded part lives in files, streamed through the buffers
        nvme, optimizer_host = optimizer_host, 0
        largest = max((math.prod(s.shard_shape(x.shape)) for s, x in
                       zip(jax.tree.leaves(p.update_shardings), jax.tree.leaves(p.abstract_trained))), default=1)
        nvme_buffers = p.memory.swap.buffer_count * min(p.memory.swap.tile, largest) * 4
    params_nvme = param_buffers = 0
    if p.memory.param_swap is not None:  # stored parameters in files (max_in_cpu's part counted there too)
        params_nvme = params
        largest = max((math.prod(s.shard_shape(x.shape)) for s, x in
                       zip(jax.tree.leaves(p.param_shardings), jax.tree.leaves(p.abstract_params))), default=1)
        param_buffers = p.memory.param_swap.buffer_count * min(p.memory.param_swap.tile, largest) * pol.param.itemsize
    at_use = layers_read_at_use(p)
    shards = [(x, planned_bytes(x, s, pol.param))
              for i, (s, x) in enumerate(zip(jax.tree.leaves(p.param_shardings), jax.tree.leaves(p.abstract_params)))
              if i in at_use]
    return MemoryReport(
        n_params=psi, data_size=n, stage=p.stage, params=params, grads=grads, optimizer=master + opt,
        formula_params=pol.param.itemsize * param_elements,
        formula_grads=pol.accum.itemsize * share(GRADIENTS),
        formula_optimizer=k * share(OPTIMIZER), tensor_size=p.tensor_size, expert_size=ep,
        sequence_size=sequence_size(p.mesh), n_frozen=psi - psi_t,
        replicated_fraction=kept / total if total else 0.0,
        params_host=planned_bytes(p.abstract_params, p.param_storage, pol.param, host_only=True),
        optimizer_host=optimizer_host, optimizer_nvme=nvme, nvme_buffers=nvme_buffers,
        params_nvme=params_nvme, param_buffers=param_buffers,
        params_at_use=sum(b for _, b in shards),
        params_at_use_held=sum(b * min(2, x.shape[0]) // x.shape[0] for x, b in shards),
        memory=p.memory.describe())
