"""ZeRO stages as layouts: per-leaf placements of parameters, gradients and optimizer state.

A stage is nothing but the set of model-state roles it partitions over the `data` axis
(`STAGE_PARTITIONS`). `plan` turns that set, the mesh and the model's abstract parameters into
per-leaf placements and `NamedSharding`s; the train step reads them and never asks for the stage.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from zerojax.collectives import PARTIAL, REPLICATED, Placement, Shard, Wire
from zerojax.config import BatchSize, Config, as_config, check_supported
from zerojax.errors import ConfigError
from zerojax.mesh import DATA, DATA_INNER, DATA_OUTER, STAGE, DataAxis, data_axes, data_size
from zerojax.measure import planned_bytes
from zerojax.offload import Memory, memory_plan
from zerojax.optim import ClientOptimizer, ScheduleFn, param_groups, update_rule
from zerojax.pallas.backend import XLA, platform_of, resolve as resolve_kernels
from zerojax.pallas.selfcheck import settle as settle_kernels
from zerojax.precision import Policy, ScalerConfig, policy as make_policy, scaler_config
from zerojax.schedules import LrSchedule
from zerojax.sharded_init import abstract_params

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
    """
    param: Placement
    grad: Placement
    update: Placement
    lead: str | None = None    # a mesh axis dim 0 is split over (pipelines: one row per `stage`)


def choose_dim(shape: tuple[int, ...], n: int, layer_axes: int | None = None) -> int | None:
    """The dimension to shard over `n` devices: the most major one they divide, outside the layer axes.

    Most major, so that each device's block is contiguous: every gather and reduce-scatter then
    moves whole rows (XLA:CPU runs a collective along an inner dimension 5-14x slower, and NCCL
    needs contiguous buffers, which XLA otherwise makes with a transpose). `layer_axes` leading
    dimensions stack layers that a loss scans over: they stay whole, so the scan slices them
    without communication. When they are not known (None), every dimension but the last two is
    taken to stack layers (a matrix is a matrix, `[layers, in, out]` a stack, `[groups, layers,
    in, out]` a nested one). Failing those, the most major divisible dimension but the first;
    dimension 0 only when nothing else divides.
    """
    if n == 1:
        return None
    candidates = [d for d, s in enumerate(shape) if s % n == 0 and s >= n]
    if not candidates:
        return None
    skip = max(len(shape) - 2, 0) if layer_axes is None else layer_axes
    return ([d for d in candidates if d >= skip] or [d for d in candidates if d > 0] or candidates)[0]


def leaf_layout(shape: tuple[int, ...], n: int, partitions: frozenset[str],
                persistence_threshold: int, layer_axes: int | None = None, *, lead_axes: int = 0) -> LeafLayout:
    """`layer_axes` leading dimensions stack layers (a scanned stack; None: not known): the
    persistence threshold is compared with one layer's slice, which is what the loss holds whole
    at a time. `lead_axes` leading dimensions are split by another mesh axis (the pipeline's
    stage rows), so ZeRO shards a later one."""
    dim = choose_dim(shape, n, layer_axes if not lead_axes else max(lead_axes, layer_axes or 0))
    sharded: Placement = REPLICATED if dim is None else Shard(dim)
    keep_param_whole = math.prod(shape[layer_axes or 0:]) < persistence_threshold
    param = sharded if PARAMETERS in partitions and not keep_param_whole else REPLICATED
    grad = sharded if GRADIENTS in partitions else PARTIAL
    update = sharded if OPTIMIZER in partitions else REPLICATED
    return LeafLayout(param=param, grad=grad, update=update)


def hpz_layout(lay: LeafLayout) -> LeafLayout:
    """ZeRO++ hpZ (`zero_hpz_partition_size`): the stored parameters are a secondary copy split over
    `data_inner` only (replicated across `data_outer`), so every forward/backward gather stays within
    an inner group; gradients and optimizer state stay split over every device, inner-major, so that
    gathering an updated shard over `data_outer` yields exactly the secondary copy's block."""
    def primary(p: Placement) -> Placement:
        return Shard(p.dim, (DATA_INNER, DATA_OUTER)) if isinstance(p, Shard) else p
    param = Shard(lay.param.dim, DATA_INNER) if isinstance(lay.param, Shard) else lay.param
    return dataclasses.replace(lay, param=param, grad=primary(lay.grad), update=primary(lay.update))


def spec(placement: Placement, ndim: int, lead: str | None = None, data: DataAxis = DATA) -> P:
    """PartitionSpec of a reduced placement (PARTIAL buffers are full-size per device); `lead`
    names a mesh axis that dimension 0 is split over besides; `data` is the mesh's data axis
    (a pair of axes on a hierarchical mesh: a shard is split over both)."""
    if lead is None and not isinstance(placement, Shard):
        return P()
    axes: list[Any] = [None] * ndim
    if isinstance(placement, Shard):
        axes[placement.dim] = data if placement.axis is None else placement.axis
    if lead is not None:
        axes[0] = lead
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

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def host(self) -> int:
        return self.params_host + self.optimizer_host

    @property
    def device(self) -> int:
        return self.total - self.host

    @property
    def formula_total(self) -> float:
        return self.formula_params + self.formula_grads + self.formula_optimizer

    def table(self) -> str:
        def mib(b: float) -> str:
            return f"{b / 2**20:10.2f}"
        rows = [("parameters", self.params, self.params_host, self.formula_params),
                ("gradients", self.grads, 0, self.formula_grads),
                ("optimizer state", self.optimizer, self.optimizer_host, self.formula_optimizer),
                ("total", self.total, self.host, self.formula_total)]
        out = [f"ZeRO stage {self.stage}: {self.n_params:,} parameters over {self.data_size} data shards; "
               f"{self.memory}",
               f"{'per device':<16} {'device MiB':>10} {'host MiB':>10} {'formula':>10} {'ratio':>7}"]
        for name, got, host, want in rows:
            ratio = got / want if want else float("nan")  # wherever the bytes live
            out.append(f"{name:<16} {mib(got - host)} {mib(host)} {mib(want)} {ratio:7.3f}")
        out.append(f"bytes left replicated where the stage shards: {100 * self.replicated_fraction:.2f}%")
        return "\n".join(out)


class UpdateRule(NamedTuple):
    """How the update is computed, apart from where state lives: the optax transformation, its
    learning-rate schedule, the fp16 loss scaler and the backend that runs the update."""
    tx: optax.GradientTransformation
    schedule: LrSchedule
    scaler: ScalerConfig
    kernels: str = "xla"           # optimizer-update backend: xla, triton, mosaic_gpu or interpret


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Where every piece of state lives, derived from the config; the update rule rides along.

    Derived trees (shardings, specs, abstract optimizer state) are computed once, on first use.
    """
    config: Config
    mesh: Mesh
    stage: int
    batch: BatchSize
    policy: Policy
    rule: UpdateRule
    abstract_params: Any           # ShapeDtypeStructs of the logical (fp32) parameters
    layouts: Any                   # LeafLayout per parameter leaf
    memory: Memory = Memory()      # memory kinds of stored state and where the update runs (offload)

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
        """The same plan with the update run by another backend (e.g. "xla" or "triton")."""
        return dataclasses.replace(self, rule=self.rule._replace(kernels=kernels))

    # -- where state lives ---------------------------------------------------------------------
    @property
    def data_size(self) -> int:
        return data_size(self.mesh)

    @property
    def hpz(self) -> int:
        """Devices in hpZ's secondary parameter partition (1: off)."""
        return self.config.zero_optimization.zero_hpz_partition_size

    def wire(self, lay: LeafLayout) -> Wire:
        """How a sharded parameter is gathered: over the axis its placement names, quantized as
        ZeRO++'s qwZ / qgZ keys say."""
        zero = self.config.zero_optimization
        return Wire(axis=lay.param.axis if isinstance(lay.param, Shard) else None,
                    quantize_weights=zero.zero_quantized_weights,
                    quantize_gradients=zero.zero_quantized_gradients)

    @functools.cached_property
    def n_leaves(self) -> int:
        return len(jax.tree.leaves(self.abstract_params))

    @functools.cached_property
    def leaf_paths(self) -> list[str]:
        """Each parameter leaf's path, in tree order (for messages)."""
        return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(self.abstract_params)]

    def _shardings(self, role: str) -> Any:
        data = data_axes(self.mesh)
        return map_layouts(lambda lay, p: NamedSharding(self.mesh, spec(getattr(lay, role), len(p.shape), lay.lead,
                                                                        data)),
                           self.layouts, self.abstract_params)

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
        """Parameter-shaped optimizer leaves placed as `update`; counters and scalars replicated."""
        return optax.tree_utils.tree_map_params(
            self.tx, lambda _, sharding: sharding, self.abstract_opt_state, update,
            transform_non_params=lambda _: self.replicated)

    @functools.cached_property
    def abstract_opt_state(self) -> Any:
        master = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, self.policy.master),
                              self.abstract_params)
        return jax.eval_shape(self.tx.init, master)

    @functools.cached_property
    def opt_state_shardings(self) -> Any:
        """Parameter-shaped optimizer leaves follow `update`; counters and scalars are replicated."""
        return self._opt_state_following(self.update_shardings)

    @property
    def batch_sharding(self) -> NamedSharding:
        """How a global batch is placed: rows split over the data axis."""
        return NamedSharding(self.mesh, P(data_axes(self.mesh)))

    def report(self) -> MemoryReport:
        return memory_report(self)


def plan(config: Config | Any, mesh: Mesh | AbstractMesh, params: Any, *, lead: str | None = None,
         layer_axes: Any = None,
         optimizer: ClientOptimizer | None = None, lr_scheduler: ScheduleFn | None = None) -> Plan:
    """Derive the layout of every piece of model state for the config's ZeRO stage.

    `params` may be real arrays, `jax.ShapeDtypeStruct`s or an unbuilt `init_params(...)`; only
    shapes are read. Every config
    check that needs the mesh (batch triad, features not built yet) runs here, before any compile.
    `lead` names a mesh axis that every leaf's dimension 0 is split over on top of the ZeRO layout
    (the pipeline's `[stage, width]` parameter rows; ZeRO then shards a later dimension).
    `layer_axes`: how many leading axes of each leaf stack layers (an int, or a pytree prefix of
    ints such as `{"layers": 1}`; `zerojax.find_layer_axes(loss_fn, params, batch)` reads it off
    the loss), so `stage3_param_persistence_threshold` compares with one layer's slice.
    `optimizer` / `lr_scheduler` are DeepSpeed's client optimizer and scheduler (see
    `zerojax.optim.update_rule`); the config's optimizer section is used without them.
    `config` is a Config, a dict or a config file path.
    `mesh` may be a `jax.sharding.AbstractMesh` (sizes and axis names, no devices): the plan then
    serves byte counting only (`Plan.report()`, `zerojax.estimate`) for a cluster that need not
    exist here - the XLA update is assumed and offload memory kinds are not checked against a backend.
    """
    config = as_config(config)
    check_supported(config)
    params = abstract_params(params)
    tx, schedule, opt = update_rule(config, optimizer, lr_scheduler)
    config = dataclasses.replace(config, optimizer=opt)  # records "client" for an optimizer from code
    if STAGE in mesh.shape and mesh.shape[STAGE] > 1 and lead != STAGE:
        raise ConfigError(f"mesh.stage: {mesh.shape[STAGE]} pipeline stages need a pipelined model: "
                          f"zerojax.initialize(config, model=zerojax.PipelineModule(...)); for a model "
                          f"given as params= and loss_fn= set mesh.stage=1")
    abstract_mesh = isinstance(mesh, AbstractMesh)
    kernels = "xla" if abstract_mesh else resolve_kernels(config.kernels, platform_of(mesh), config.optimizer.type)
    groups = param_groups(config.optimizer)
    if groups is not None:
        if lead is not None:
            raise ConfigError("optimizer.no_decay / optimizer.param_groups: a pipeline's parameters are "
                              "flat stage rows without names; remove them, or train with mesh.stage: 1")
        groups.check(params)
        if kernels != XLA:  # the fused Adam kernel takes one weight decay and one lr for all parameters
            if config.kernels == "pallas":
                raise ConfigError("kernels: 'pallas' fuses one weight decay and lr for every parameter; "
                                  "with optimizer.no_decay or param_groups use kernels: auto or xla")
            kernels = XLA
    n = data_size(mesh)
    batch = config.batch(n)
    stage = config.zero_optimization.stage
    partitions = STAGE_PARTITIONS[stage]
    threshold = config.zero_optimization.stage3_param_persistence_threshold
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("plan: the parameter tree has no arrays")
    for x in leaves:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"plan: parameter leaves must be arrays, got {type(x).__name__}")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), params)
    axes = _layer_axes_per_leaf(layer_axes, abstract)
    layouts = jax.tree.map(lambda x, k: leaf_layout(x.shape, n, partitions, threshold, None if k < 0 else k,
                                                    lead_axes=int(lead is not None)), abstract, axes)
    if lead is not None:
        for x in jax.tree.leaves(abstract):
            if not x.shape or x.shape[0] != mesh.shape[lead]:
                raise ValueError(f"plan: with lead={lead!r} every leaf's dimension 0 must be the "
                                 f"{lead} axis size {mesh.shape[lead]}, got shape {x.shape}")
        layouts = jax.tree.map(lambda lay: dataclasses.replace(lay, lead=lead), layouts, is_leaf=is_layout)
    if config.zero_optimization.zero_hpz_partition_size > 1:
        _check_hpz(config, mesh, lead)
        layouts = jax.tree.map(hpz_layout, layouts, is_leaf=is_layout)
    _check_quantized(config)
    pol = make_policy(config)
    # after every config check: the kernels' self-check compiles (once per process and backend)
    if not abstract_mesh:
        kernels = settle_kernels(config.kernels, kernels, mesh.local_devices[0])
    return Plan(config=config, mesh=mesh, stage=stage, batch=batch, policy=pol,
                rule=UpdateRule(tx, schedule, scaler_config(config), kernels), abstract_params=abstract,
                layouts=layouts, memory=memory_plan(config, mesh, kernels))


def _check_hpz(config: Config, mesh: Mesh | AbstractMesh, lead: str | None) -> None:
    """hpZ needs stage 3 and a hierarchical data axis whose inner size is the partition size."""
    zero = config.zero_optimization
    hpz = zero.zero_hpz_partition_size
    key = f"zero_optimization.zero_hpz_partition_size: {hpz}"
    if zero.stage != 3:
        raise ConfigError(f"{key} needs stage 3 (hpZ keeps a secondary copy of partitioned parameters; stage "
                          f"{zero.stage} does not partition them); set zero_optimization.stage: 3 or the size to 1")
    if lead is not None:
        raise ConfigError(f"{key}: hpZ does not combine with pipeline stages; set it to 1")
    if zero.offload_param.device != "none":
        raise ConfigError(f"{key}: hpZ does not combine with offload_param (the secondary copy would live on "
                          f"the host); remove offload_param or set the size to 1")
    if DATA_INNER not in mesh.shape:
        raise ConfigError(f"{key} needs a hierarchical data axis: leave mesh.data_outer/mesh.data_inner unset "
                          f"(zerojax.make_mesh then builds data_inner = {hpz}) or set mesh.data_inner: {hpz}")
    if mesh.shape[DATA_INNER] != hpz:
        raise ConfigError(f"{key}, but the mesh's data_inner axis has {mesh.shape[DATA_INNER]} devices; they must "
                          f"be equal (the secondary partition is one inner group): set mesh.data_inner: {hpz}")


def _check_quantized(config: Config) -> None:
    zero = config.zero_optimization
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if getattr(zero, key) and zero.stage != 3:
            raise ConfigError(f"zero_optimization.{key}: ZeRO++ quantizes stage 3's parameter gathers and their "
                              f"gradient reduce-scatters; stage {zero.stage} has none; set stage: 3 or remove it")


def _layer_axes_per_leaf(layer_axes: Any, abstract: Any) -> Any:
    """An int per leaf (-1: not known) from None, an int, or a pytree prefix of ints."""
    if layer_axes is None:
        layer_axes = -1
    try:
        return jax.tree.map(lambda k, sub: jax.tree.map(lambda x: int(k), sub), layer_axes, abstract)
    except (ValueError, TypeError) as e:
        reason = str(e).splitlines()[0].rstrip(":")  # JAX's first line; the rest repeats the trees
        top = list(abstract) if isinstance(abstract, dict) else type(abstract).__name__
        raise ValueError(f"plan: layer_axes={layer_axes!r} must be an int or a prefix of the parameter tree "
                         f"(its top level: {top}; e.g. {{'layers': 1}}): {reason}") from None


def memory_report(p: Plan) -> MemoryReport:
    """Bytes per device the plan's layouts give, against the ZeRO formula for the same dtypes.

    Formula (Rajbhandari et al.): params P·Ψ, gradients G·Ψ, optimizer K·Ψ, each divided by N
    when the stage partitions it; P, G are the parameter and accumulator itemsizes and K counts
    the fp32 master copy (mixed precision only) plus the optimizer's per-parameter state.
    """
    n, pol = p.data_size, p.policy
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(p.abstract_params))
    params = planned_bytes(p.abstract_params, p.param_shardings, pol.param)
    grads = planned_bytes(p.abstract_params, p.grad_shardings, pol.accum)
    master = planned_bytes(p.abstract_params, p.update_shardings, pol.master) if pol.mixed else 0
    opt_abstract = p.abstract_opt_state
    opt = planned_bytes(opt_abstract, p.opt_state_shardings)
    # K: bytes per parameter of master + parameter-shaped optimizer leaves (whole-model count).
    opt_full = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(opt_abstract)
                   if math.prod(x.shape) > 1)
    k = (pol.master.itemsize if pol.mixed else 0) + opt_full / psi
    parts = STAGE_PARTITIONS[p.stage]

    def share(role: str) -> float:
        return 1 / n if role in parts else 1.0

    # Fraction of model-state bytes that the stage would shard but stayed whole.
    kept = total = 0.0
    for lay, x in zip(jax.tree.leaves(p.layouts, is_leaf=is_layout), jax.tree.leaves(p.abstract_params)):
        size = math.prod(x.shape)
        for role, place, width in ((PARAMETERS, lay.param, pol.param.itemsize),
                                   (GRADIENTS, lay.grad, pol.accum.itemsize),
                                   (OPTIMIZER, lay.update, k)):
            if role in parts:
                total += size * width
                kept += size * width * (not isinstance(place, Shard))
    host_master = (planned_bytes(p.abstract_params, p.update_storage, pol.master, host_only=True)
                   if pol.mixed else 0)
    # hpZ's secondary copy is split over one inner group: Ψ/hpz parameters per device.
    param_share = 1 / p.hpz if p.hpz > 1 else share(PARAMETERS)
    return MemoryReport(
        n_params=psi, data_size=n, stage=p.stage, params=params, grads=grads, optimizer=master + opt,
        formula_params=pol.param.itemsize * psi * param_share,
        formula_grads=pol.accum.itemsize * psi * share(GRADIENTS),
        formula_optimizer=k * psi * share(OPTIMIZER),
        replicated_fraction=kept / total if total else 0.0,
        params_host=planned_bytes(p.abstract_params, p.param_storage, pol.param, host_only=True),
        optimizer_host=host_master + planned_bytes(opt_abstract, p.opt_state_storage, host_only=True),
        memory=p.memory.describe())
