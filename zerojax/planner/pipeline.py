"""The pipeline's plan builder: a PipelineModule, the config and the mesh into a `PipelinePlan`.

The stage rows (`{"stages": [S, width]}`, and `{"expert_stages": [S, ep, width]}` for a model with
expert weights) get the ordinary ZeRO plan with dimension 0 split over `stage`
(`make_plan(..., lead="stage")`; the expert rows' dimension 1 is named `expert`, so the plan splits it
over the expert axis and ZeRO-shards them over the expert-data-parallel devices only, as it does any
expert weight); the schedule, partition and activation checkpointing of the config's `pipeline`
section ride along in the executor's `Pipeline`.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from zerojax.config import Config
from zerojax.core.layout import Plan
from zerojax.core.mesh import (EXPERT, STAGE, DataAxis, axes_size, data_axes, data_size, expert_data_axes,
                               expert_size, row_size, tensor_size)
from zerojax.errors import ConfigError
from zerojax.optim.deepspeed import is_elementwise
from zerojax.pipeline.buffers import EXPERT_ROWS, ROWS, stage_rows
from zerojax.pipeline.executor import Pipeline, RowGroup
from zerojax.pipeline.module import PipelineModule
from zerojax.pipeline.schedule import build
from zerojax.pipeline.step import PipelinePlan, row_placement
from zerojax.planner.plan import make_plan, tensor_split
from zerojax.planner.tensor import TensorPlan

__all__ = ["make_pipeline_plan"]


def _layer_plan(config: Config, mesh: Mesh, module: PipelineModule) -> TensorPlan:
    """The tensor plan of the module's logical layers (keys `layer_NN.<the layer's own names>`): Megatron's
    names apply when every layer is one of the shipped models' (`zerojax.models`)."""
    abstract = module.abstract_params()
    shipped = all(layer.spec.typename.__module__.startswith("zerojax.models.")
                  for layer in module.layers if layer.spec is not None)
    return tensor_split(config, mesh, abstract, jax.tree.map(lambda _: None, abstract), shipped=shipped)


def _layer_dims(module: PipelineModule, layer_plan: TensorPlan) -> dict[str, tuple[int | None, ...]]:
    """Per entry of the module, its leaves' tensor-split dimensions in leaf order."""
    abstract = module.abstract_params()
    dims = iter(layer_plan.dims)
    return {key: tuple(next(dims) for _ in jax.tree.leaves(abstract[key])) for key in sorted(abstract)}  # tree order


def make_pipeline_plan(config: Config, mesh: Mesh, module: PipelineModule) -> PipelinePlan:
    """Check the pipeline config against the module and mesh, partition, lay out; nothing compiles."""
    if not isinstance(module, PipelineModule):
        raise ConfigError(f"initialize: model= must be a zerojax.PipelineModule, got {type(module).__name__}")
    stages = int(mesh.shape.get(STAGE, 1))
    if stages < 2:
        raise ConfigError("mesh.stage: a PipelineModule needs mesh.stage >= 2 (got 1); set mesh.stage, or "
                          "train it unpipelined with initialize(config, params=module.init(), "
                          "loss_fn=module.loss)")
    if module.num_stages is not None and module.num_stages != stages:
        raise ConfigError(f"mesh.stage: the mesh has {stages} stages but PipelineModule(num_stages="
                          f"{module.num_stages}); make them equal (or leave num_stages=None)")
    if config.optimizer is None:
        raise ConfigError('optimizer: a pipeline trains with the config\'s optimizer section, and this config '
                          'has none; add one, e.g. "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}')
    if not is_elementwise(config.optimizer.type):  # on a flat stage row it would see one tensor
        raise ConfigError(f"optimizer.type: {config.optimizer.type} reads whole parameter tensors (Lamb's "
                          f"trust ratio, Muon's orthogonalisation), but a pipeline stores each stage's parameters as one flat row; use "
                          f"Adam, AdamW, Lion, Adagrad or SGD with pipelines")
    pipe_cfg = config.pipeline
    dp = data_size(mesh)
    gas = config.batch(row_size(mesh)).gradient_accumulation_steps  # the triad counts row shards
    chunks = pipe_cfg.chunks
    n = len(module.layers)
    if stages * chunks > n:
        pieces = f"{stages} pipeline stages" + (f" x {chunks} chunks = {stages * chunks} pieces" if chunks > 1 else "")
        raise ConfigError(f"mesh.stage: {pieces} but the model has only {n} layers; use at most "
                          f"{n // chunks} stages (each piece needs at least one layer)")
    schedule = build(pipe_cfg.schedule, stages, gas, chunks)
    # Rows padded to a multiple of lcm(dp, 128): ZeRO can shard them, and for power-of-two data
    # sizes up to 128 the width (so a checkpoint's shapes) does not depend on dp.
    tensor = tensor_size(mesh)
    layer_plan = _layer_plan(config, mesh, module) if tensor > 1 else None
    rows = stage_rows(module, stages, chunks, align=math.lcm(dp, 128), tensor=tensor,
                      dims=_layer_dims(module, layer_plan) if layer_plan is not None else None,
                      expert=expert_size(mesh), expert_align=math.lcm(axes_size(mesh, expert_data_axes(mesh)), 128))
    shape = (stages, tensor, rows.width) if tensor > 1 else (stages, rows.width)
    arrays, names = {ROWS: jax.ShapeDtypeStruct(shape, jnp.float32)}, {ROWS: None}
    if rows.experts is not None:  # dimension 1 named `expert`: split over the expert axis, ZeRO over the rest
        arrays[EXPERT_ROWS] = jax.ShapeDtypeStruct((stages, rows.experts.size, rows.experts.width), jnp.float32)
        names[EXPERT_ROWS] = (None, EXPERT, None)
    plan = make_plan(config, mesh, arrays, lead=STAGE, logical_axes=names,
                     tensor_dims={k: 1 if k == ROWS and tensor > 1 else None for k in arrays})
    if tensor > 1:  # whole leaves are copied into every tensor slice's row: the norm counts them once
        plan = dataclasses.replace(plan, tensor_plan=layer_plan.describe(tensor),
                                   rule=plan.rule._replace(norm=rows.norm))
    pol = plan.policy
    interval = (module.activation_checkpoint_interval if module.activation_checkpoint_interval is not None
                else pipe_cfg.activation_checkpoint_interval)
    groups = (_group(plan, ROWS, data_axes(mesh), 2 if tensor > 1 else 1),)
    if rows.experts is not None:
        groups += (_group(plan, EXPERT_ROWS, expert_data_axes(mesh), 2),)
    train = Pipeline(mesh, rows, schedule, pol.param, pol.accum, pol.comm, groups, interval,
                     config.activation_checkpointing.partition_activations)
    return PipelinePlan(plan, module, rows, train)


def _group(plan: Plan, name: str, zero: DataAxis, lead: int) -> RowGroup:
    """The executor's view of one array of rows: its placements on a device's row, and its specs."""
    lay = plan.layouts[name]
    return RowGroup(name, zero, row_placement(lay.param), row_placement(lay.grad), row_placement(lay.update),
                    plan.param_specs[name], plan.update_specs[name], lead)
