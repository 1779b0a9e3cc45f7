"""The plan builder: the one place that turns a config into the decisions the maths runs on.

`make_plan` reads the DeepSpeed config (and the mesh and the model's shapes) once and returns a
`Plan` - per-leaf layouts, the update rule, the step rule, dtypes, memory kinds - as plain data.
Everything below it (the step, state, kernels, pipeline executor, checkpoints) reads the plan
and never the config; every config check that needs the mesh runs here, before any compile.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from zerojax.config import Config, ConfigWarning, as_config, check_supported, fingerprint
from zerojax.core.collectives import Shard, Wire
from zerojax.core.layout import (Prefetch, STAGE_PARTITIONS, LeafLayout, Plan, StepRule, UpdateRule, hpz_layout, is_layout,
                                 leaf_layout)
from zerojax.core.names import dotted
from zerojax.core.mesh import (DATA_INNER, EXPERT, STAGE, TENSOR, axes_size, data_axes, data_size, expert_data_axes,
                               expert_size, host_axes, row_size, tensor_size)
from zerojax.core.sharded_init import abstract_params
from zerojax.errors import ConfigError
from zerojax.optim.deepspeed import ClientOptimizer, ScheduleFn, adam_settings, param_groups, update_rule
from zerojax.optim.groups import name_matches
from zerojax.pallas.backend import XLA, platform_of, resolve as resolve_kernels
from zerojax.planner.settings import memory_plan, policy, remat_policy, scaler_config
from zerojax.planner.tensor import ADAPTER_LEAVES, LayerSpec, TensorPlan, tensor_plan

__all__ = ["make_plan", "plan", "step_rule"]


def make_plan(config: Config | Any, mesh: Mesh | AbstractMesh, params: Any, *, lead: str | None = None,
              layer_axes: Any = None, optimizer: ClientOptimizer | None = None,
              lr_scheduler: ScheduleFn | None = None, logical_axes: Any = None, tensor_dims: Any = None,
              model_state: Any = None, trainable: Any = None, variable_types: Any = None) -> Plan:
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
    `zerojax.optim.transforms.update_rule`); the config's optimizer section is used without them.
    `logical_axes`: the model's own annotations, a tuple of logical axis names per leaf (None for a
    leaf without); default: those `zerojax.from_nnx` found (`params.logical_axes`). Fewer names than
    dimensions name the leading ones (JAX's shorter `PartitionSpec`: the rest are unnamed). A leaf
    whose names include the mesh's data axis is sharded along that dimension; the others are kept in
    the plan.
    `tensor_dims`: per leaf, a dimension to split over the tensor axis (or None) for the leaves that
    neither annotations, layer_specs nor Megatron's names decide: what `zerojax.find_tensor_splits`
    derives from the loss. For a pipeline's rows (`lead`) it is the whole decision (their tensor slices).
    `model_state`: the model's state that the step updates without differentiating it (NNX BatchNorm's
    running statistics), its initial values; kept replicated, checkpointed with the rest; default: what
    `zerojax.from_nnx` found (`params.model_state` / `loss_fn.model_state`).
    `trainable`: per leaf, whether it is trained (a pytree of bools shaped like the parameters), or an
    NNX Variable class or tuple of them (`nnx.LoRAParam`: the leaves of that kind are trained), read
    against `variable_types` (default: what `zerojax.from_nnx` recorded, `params.variable_types`);
    default: the config's `model.trainable` / `model.frozen` name patterns (every leaf, without them).
    A frozen leaf gets no gradient, master copy or optimizer state (`LeafLayout.trainable`).
    `config` is a Config, a dict or a config file path.
    `mesh` may be a `jax.sharding.AbstractMesh` (sizes and axis names, no devices): the plan then
    serves byte counting only (`Plan.report()`, `zerojax.tools.estimate`) for a cluster that need not
    exist here - the XLA update is assumed and offload memory kinds are not checked against a backend.
    """
    config = as_config(config)
    check_supported(config)
    origin = fingerprint(config)
    if logical_axes is None:
        logical_axes = getattr(params, "logical_axes", None)
    if model_state is None:
        model_state = getattr(params, "model_state", None)
    if variable_types is None:
        variable_types = getattr(params, "variable_types", None)
    if lead is not None and model_state is not None:
        raise ValueError("plan: a pipeline's layers keep no model state (BatchNorm's running statistics); "
                         "train the model without pipeline stages (mesh.stage: 1)")
    params = abstract_params(params)
    tx, schedule, opt = update_rule(config, optimizer, lr_scheduler, layer_axes=_stacked_axes(layer_axes, params),
                                    mesh=mesh)
    config = dataclasses.replace(config, optimizer=opt)  # "client" for an optimizer from code
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
    n = data_size(mesh)  # ZeRO's shards: every data-parallel device (rows x sequence)
    batch = config.batch(row_size(mesh))  # the batch's rows are split over the row axes only
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
    if lead is not None:
        for x in jax.tree.leaves(abstract):
            if not x.shape or x.shape[0] != mesh.shape[lead]:
                raise ValueError(f"plan: with lead={lead!r} every leaf's dimension 0 must be the "
                                 f"{lead} axis size {mesh.shape[lead]}, got shape {x.shape}")
    split = () if lead is None else ((0, lead),)
    names = _names_per_leaf(logical_axes, abstract)
    data = set(data_axes(mesh)) if isinstance(data_axes(mesh), tuple) else {data_axes(mesh)}
    sliced = None if lead is not None else tensor_split(config, mesh, abstract, names, derived=tensor_dims)
    if sliced is not None:
        tensor_dims = jax.tree.unflatten(jax.tree.structure(abstract), list(sliced.dims))
    elif tensor_dims is None:
        tensor_dims = jax.tree.map(lambda _: None, abstract)

    data.discard(EXPERT)  # a dimension named "expert" is the expert axis's, not ZeRO's preference
    ep = expert_size(mesh)
    expert_zero = expert_data_axes(mesh)  # DeepSpeed's expert-data-parallel group

    def layout(x: Any, k: int, leaf_names: Any, tdim: int | None) -> LeafLayout:
        prefer = next((d for d, n in enumerate(leaf_names or ()) if n in data or
                       (isinstance(n, tuple) and set(n) & data)), None)
        pairs = split if tdim is None else (*split, (tdim, TENSOR))
        edim = _expert_dim(x, leaf_names, ep)
        if edim is None:
            lay = leaf_layout(x.shape, n, partitions, threshold, None if k < 0 else k, split=pairs, prefer=prefer)
        else:  # an expert weight: split over `expert`, ZeRO-sharded over the other data axes only
            lay = leaf_layout(x.shape, axes_size(mesh, expert_zero), partitions, threshold, None if k < 0 else k,
                              split=(*pairs, (edim, EXPERT)), prefer=prefer, axis=expert_zero)
        return dataclasses.replace(lay, names=leaf_names)

    layouts = jax.tree.map(layout, abstract, axes, names, tensor_dims, is_leaf=lambda x: x is None)
    mask = trainable_mask(config, abstract, trainable, variable_types)
    if not all(mask) and lead is not None:
        raise ConfigError("model.trainable / model.frozen: a pipeline's parameters are flat stage rows without "
                          "names, so none can be frozen; remove them, or train with mesh.stage: 1")
    layouts = jax.tree.unflatten(jax.tree.structure(abstract), [
        dataclasses.replace(lay, trainable=t) for lay, t in zip(jax.tree.leaves(layouts, is_leaf=is_layout), mask)])
    zero = config.zero_optimization
    if zero.zero_hpz_partition_size > 1:
        _check_hpz(config, mesh, lead)
        layouts = jax.tree.map(lambda lay: hpz_layout(lay, data_axes(mesh)), layouts, is_leaf=is_layout)
    _check_quantized(config)
    layouts = jax.tree.map(lambda lay: _with_wire(lay, zero.zero_quantized_weights, zero.zero_quantized_gradients),
                           layouts, is_leaf=is_layout)
    rule = UpdateRule(tx, schedule, scaler_config(config), kernels, clip=config.gradient_clipping,
                      adam=adam_settings(config.optimizer), strict=config.kernels == "pallas")
    return Plan(mesh=mesh, stage=stage, batch=batch, policy=policy(config), rule=rule, abstract_params=abstract,
                layouts=layouts, memory=memory_plan(config, mesh, kernels), step=step_rule(config),
                seed=config.run.seed, hpz=zero.zero_hpz_partition_size, origin=origin, model_state=model_state,
                tensor_plan=sliced.describe(tensor_size(mesh)) if sliced is not None and tensor_size(mesh) > 1 else None)


plan = make_plan  # the public name, `zerojax.plan`


def trainable_mask(config: Config, abstract: Any, trainable: Any = None, variable_types: Any = None) -> list[bool]:
    """Per leaf (tree order), whether it is trained: `trainable` (a bool tree shaped like the parameters,
    or Variable classes picked from `variable_types`) or else the config's name patterns - a leaf is trained when `model.trainable` is empty or one of its
    patterns picks it, and no `model.frozen` pattern does. A pattern that picks no parameter is a typo
    and an error; so is freezing everything (nothing would be trained)."""
    names = [dotted(path) for path, _ in jax.tree_util.tree_leaves_with_path(abstract)]
    model = config.model
    if trainable is not None:
        if model.trainable or model.frozen or config.lora.enabled:
            raise ConfigError("plan: trainable= was given and the config sets model.trainable / model.frozen / "
                              "lora.enabled; choose one (remove the config keys, or leave trainable= out)")
        if isinstance(trainable, type) or (isinstance(trainable, tuple) and trainable
                                           and all(isinstance(t, type) for t in trainable)):
            if variable_types is None:
                raise ValueError(f"plan: trainable={trainable!r} picks parameters by their NNX Variable class, "
                                 f"which only parameters from zerojax.from_nnx record (loss_fn.variable_types); "
                                 f"pass those, or a tree of bools")
            trainable = jax.tree.map(lambda k: issubclass(k, trainable), variable_types)
        try:
            mask = jax.tree.structure(abstract).flatten_up_to(trainable)
        except (ValueError, TypeError) as e:
            raise ValueError(f"plan: trainable= must be shaped like the parameters (a bool per leaf): "
                             f"{str(e).splitlines()[0]}") from None
        bad = [n for n, t in zip(names, mask) if not isinstance(t, (bool, np.bool_))]
        if bad:
            held = type(mask[names.index(bad[0])]).__name__
            raise ValueError(f"plan: trainable= must hold a bool per leaf; {bad[0]} holds a {held}")
        mask = [bool(t) for t in mask]
        where = "trainable="
    else:
        shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
        for key in ("trainable", "frozen"):
            for pattern in getattr(model, key):
                if not any(name_matches(pattern, n) for n in names):
                    raise ConfigError(f"model.{key}: '{pattern}' matches no parameter of the model; its "
                                      f"parameters are {shown}")
        adapters = [n.rsplit(".", 1)[-1] in ADAPTER_LEAVES for n in names]
        if config.lora.enabled and not any(adapters):
            raise ConfigError(f"lora.enabled: the model has no adapter parameters (leaves named "
                              f"{' / '.join(ADAPTER_LEAVES)}); the shipped GPT and Llama and Hugging Face imports "
                              f"add them from the lora section; a model of your own adds its own (nnx.LoRA) and "
                              f"picks them with trainable=nnx.LoRAParam instead. Its parameters are {shown}")
        # with LoRA the base is frozen: the adapters are trained, and what model.trainable adds to them
        picked = [any(name_matches(p, n) for p in model.trainable) for n in names]
        mask = [((a or p) if config.lora.enabled else (not model.trainable or p))
                and not any(name_matches(f, n) for f in model.frozen) for n, a, p in zip(names, adapters, picked)]
        where = "lora / model.trainable / model.frozen" if config.lora.enabled else "model.trainable / model.frozen"
    if not any(mask):
        raise ConfigError(f"{where}: every parameter is frozen, so nothing would be trained; leave at least "
                          f"one trainable")
    return mask


def tensor_split(config: Config, mesh: Mesh | AbstractMesh, abstract: Any, names: Any, shipped: bool | None = None,
                 derived: Any = None) -> TensorPlan:
    """The tensor-parallel plan (`zerojax.planner.tensor`) from the config's sources; nothing is split
    without a tensor axis. Megatron's names apply to the shipped models (`shipped`; None: recognised by
    their top-level keys) and to a tree `tensor_parallel.preset_model` names; the expert weights stay
    whole with `model.expert_tensor_parallelism: false`. Splitting nothing on a tensor axis is a
    warning: every tensor device would compute the same thing."""
    size = tensor_size(mesh)
    if size == 1:
        return TensorPlan(tuple(None for _ in jax.tree.leaves(abstract)), ())
    tp, model = config.tensor_parallel, config.model
    builtin = tp.preset_model is not None or (_shipped(abstract) if shipped is None else shipped)
    heads = (model.n_heads, model.n_kv_heads or model.n_heads) if builtin and tp.preset_model is None else None
    specs = [LayerSpec(tuple(s.patterns), s.partition_type) for s in tp.layer_specs]
    out = tensor_plan(abstract, size, names=names, rules=dict(config.mesh.logical_axis_rules), layer_specs=specs,
                      use_default_specs=tp.use_default_specs, builtin=builtin, heads=heads, axis=TENSOR,
                      derived=None if derived is None else _dims_per_leaf(derived, abstract),
                      whole_experts=not model.expert_tensor_parallelism)
    if all(d is None for d in out.dims):
        warnings.warn(f"mesh.tensor: {size}, but no weight of this model is split over the tensor axis (no "
                      f"annotation, layer_specs pattern or known layer name applies), so every tensor device "
                      f"computes the same thing; add mesh.logical_axis_rules or tensor_parallel.partition_config."
                      f"layer_specs, pass tensor_dims=zerojax.find_tensor_splits(...), or set mesh.tensor: 1",
                      ConfigWarning, stacklevel=3)
    return out


def step_rule(config: Config) -> StepRule:
    """DeepSpeed's settings for the forward and backward pass.

    Prefetch: `overlap_comm` turns it on (the default at stage 3); `stage3_prefetch_bucket_size` and
    `stage3_max_live_parameters` bound what is gathered ahead. Averaging: stage 0 (engine.allreduce_bucket)
    and stages 1-2 with `reduce_scatter: false` (stage_1_and_2.gradient_reduction_w_predivide) divide by
    `gradient_predivide_factor` before the sum and multiply by factor/dp after, unless
    `prescale_gradients`; stages 1-3 with `reduce_scatter: true` (stage_1_and_2.average_tensor, stage3's
    reduce path) divide by dp before the sum. `gradient_allreduce_op: sum`: no division at all
    (engine.allreduce_bucket and stage_1_and_2 skip it, and the predivide factor, when not averaging).
    """
    zero = config.zero_optimization
    prefetch = None
    if zero.overlap_comm and zero.stage3_prefetch_bucket_size > 0:
        prefetch = Prefetch(bucket=zero.stage3_prefetch_bucket_size, max_live=zero.stage3_max_live_parameters,
                            offload_carries=config.activation_checkpointing.cpu_checkpointing)
    predivide = (zero.stage >= 1 and zero.reduce_scatter) or config.prescale_gradients
    return StepRule(remat=remat_policy(config.activation_checkpointing), prefetch=prefetch, predivide=predivide,
                    predivide_factor=config.gradient_predivide_factor,
                    partition_activations=config.activation_checkpointing.partition_activations,
                    average=config.gradient_allreduce_op == "mean")


def _dims_per_leaf(dims: Any, abstract: Any) -> list[int | None]:
    """A split dimension (or None) per leaf, from a tree shaped like the parameters."""
    try:
        return jax.tree.structure(abstract).flatten_up_to(dims)
    except (ValueError, TypeError) as e:
        raise ValueError(f"plan: tensor_dims must be shaped like the parameters (an int or None per leaf): "
                         f"{str(e).splitlines()[0]}") from None


def _stacked_axes(layer_axes: Any, abstract: Any) -> Any:
    """The layer axes the update may rely on: the caller's, else the shipped models' (one leading axis
    under `blocks` / `layers`), else None (every dimension is the leaf's own)."""
    if layer_axes is not None or not _shipped(abstract):
        return layer_axes
    return {k: int(k in ("blocks", "layers")) for k in abstract}


def _shipped(abstract: Any) -> bool:
    """The tree is the shipped GPT's or Llama's (or a Hugging Face import into them): Megatron's names apply."""
    keys = set(abstract) if isinstance(abstract, dict) else set()
    return keys - {"head"} in ({"embed", "pos", "blocks", "ln_f"}, {"embed", "layers", "norm"})


def _with_wire(lay: LeafLayout, quantize_weights: bool, quantize_gradients: bool) -> LeafLayout:
    """How a sharded parameter is gathered: over the axis its placement names, quantized as
    ZeRO++'s qwZ / qgZ keys say."""
    axis = lay.param.axis if isinstance(lay.param, Shard) else None
    return dataclasses.replace(lay, wire=Wire(axis, quantize_weights, quantize_gradients))





def _check_hpz(config: Config, mesh: Mesh | AbstractMesh, lead: str | None) -> None:
    """hpZ needs stage 3 and a hierarchical data axis whose within-host data-parallel devices (data_inner x
    expert x sequence: an ordinary weight's secondary partition) number the partition size."""
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
                          f"(zerojax.make_mesh then builds data_inner = {hpz} / (expert x sequence)) or set "
                          f"mesh.data_inner")
    within = host_axes(data_axes(mesh))  # the secondary partition of an ordinary weight
    if axes_size(mesh, within) != hpz:
        sizes = " x ".join(f"{a} {mesh.shape[a]}" for a in ((within,) if isinstance(within, str) else within))
        raise ConfigError(f"{key}, but the mesh's data-parallel devices within a host are {sizes} = "
                          f"{axes_size(mesh, within)}; they must be equal (the secondary partition is the host's "
                          f"part of the ZeRO group): set mesh.data_inner so that data_inner x expert x sequence "
                          f"is {hpz}, or leave mesh.data_outer/mesh.data_inner unset")


def _expert_dim(x: Any, leaf_names: Any, ep: int) -> int | None:
    """The dimension the expert axis splits: the one the model named "expert" (the MoE layer's stacked
    experts), when the mesh has an expert axis; the device count must divide it."""
    if ep == 1 or not leaf_names or EXPERT not in leaf_names:
        return None
    dim = list(leaf_names).index(EXPERT)
    if x.shape[dim] % ep:
        raise ConfigError(f"mesh.expert: {ep} expert-parallel devices do not divide the {x.shape[dim]} experts of "
                          f"a weight of shape {tuple(x.shape)} (model.n_experts); choose mesh.expert dividing it")
    return dim


def _check_quantized(config: Config) -> None:
    zero = config.zero_optimization
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if getattr(zero, key) and zero.stage != 3:
            raise ConfigError(f"zero_optimization.{key}: ZeRO++ quantizes stage 3's parameter gathers and their "
                              f"gradient reduce-scatters; stage {zero.stage} has none; set stage: 3 or remove it")



def _names_per_leaf(logical_axes: Any, abstract: Any) -> Any:
    """A tuple of names (or None) per leaf; a tree that does not match the parameters is one error."""
    if logical_axes is None:
        return jax.tree.map(lambda _: None, abstract)
    is_names = lambda x: x is None or isinstance(x, tuple)  # noqa: E731
    try:
        names = jax.tree.map(lambda a, x: a, logical_axes, abstract, is_leaf=is_names)
    except (ValueError, TypeError) as e:
        reason = str(e).splitlines()[0].rstrip(":")
        raise ValueError(f"plan: logical_axes must be shaped like the parameters (a tuple of names or None per "
                         f"leaf): {reason}") from None
    padded = []
    for (path, x), leaf in zip(jax.tree_util.tree_leaves_with_path(abstract), jax.tree.leaves(names, is_leaf=is_names)):
        if leaf is not None and len(leaf) > len(x.shape):
            raise ValueError(f"plan: logical_axes{jax.tree_util.keystr(path)} = {leaf} names {len(leaf)} dimensions "
                             f"but the parameter has shape {tuple(x.shape)}; name at most {len(x.shape)}")
        # Fewer names than dimensions: the trailing ones are unnamed, as in a shorter PartitionSpec
        # (JAX replicates them; here they stay free for ZeRO and the tensor axis to shard).
        padded.append(None if leaf is None else (*leaf, *(None,) * (len(x.shape) - len(leaf))))
    return jax.tree.unflatten(jax.tree.structure(abstract), padded)


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
