"""The DeepSpeed-shaped engine for a PipelineModule: `zerojax.initialize(config, model=module)`.

It is the ordinary Engine (same train_batch / eval_batch / checkpoint / accessor methods, same
TrainState) whose plan lays out the stage rows and whose steps run the pipeline schedule.
`engine.params` gives the logical parameters (`module.init()`-shaped), unpacked from the rows.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from jax.sharding import Mesh

from zerojax.config import Config
from zerojax.engine.engine import Engine, agree_before_compiling
from zerojax.core.layout import MemoryReport
from zerojax.core.step import checked_kernels
from zerojax.pipeline.module import PipelineModule
from zerojax.pipeline.step import (ROWS, PipelinePlan, init_rows, make_pipeline_eval_step, make_pipeline_train_step,
                                   pack_params)
from zerojax.planner.pipeline import make_pipeline_plan


class PipelineEngine(Engine):
    """Training state plus compiled pipelined train/eval steps.

    params: logical initial parameters (as `module.init()` returns); None initializes each stage's
    own parameters on its own devices from `config.run.seed`.
    """

    def __init__(self, config: Config, module: PipelineModule, mesh: Mesh, params: Any = None,
                 pipeline: PipelinePlan | None = None):
        self.module = module
        pipeline = pipeline if pipeline is not None else make_pipeline_plan(config, mesh, module)
        agree_before_compiling(config, pipeline.plan)
        # the kernels' self-check, where the step is made (as Engine does): the plan then names the
        # update that really runs
        self.pipeline = dataclasses.replace(pipeline, plan=checked_kernels(pipeline.plan))
        rows = init_rows(self.pipeline, config.run.seed) if params is None else pack_params(self.pipeline, params)
        self._start(config, mesh, module.loss, self.pipeline.plan, rows, make_pipeline_train_step(self.pipeline),
                    make_pipeline_eval_step(self.pipeline))

    @property
    def params(self) -> dict[str, Any]:
        """Logical parameters (host numpy arrays): the fp32 master copy under mixed precision."""
        tree = self.state.master if self.plan.policy.mixed else self.state.params
        return self.pipeline.rows.unpack(tree)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: Any = None, *,
                        extra: Mapping[str, Any] | None = None, async_save: bool | None = None,
                        best: bool = False) -> str:
        """As Engine.save_checkpoint, plus the row manifest `zerojax export` needs for logical names."""
        from zerojax.checkpoint import PIPELINE_ROWS  # orbax is imported only when checkpoints are used
        extra = {PIPELINE_ROWS: {"array": ROWS, "leaves": self.pipeline.rows.manifest()}, **(extra or {})}
        return super().save_checkpoint(save_dir, tag, client_state, extra=extra, async_save=async_save, best=best)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        ) -> tuple[str, Any]:
        """As Engine.load_checkpoint; rows laid out otherwise (another stage count, tensor or expert size
        or partition: the saved row manifest differs) are read whole, cut into the logical parameters by
        that manifest and packed into this run's rows (the optimizer's moments with them: the
        pipeline optimizers are elementwise)."""
        from zerojax import checkpoint
        del load_lr_scheduler_states
        self.wait_for_checkpoint()
        mine = self.pipeline.rows.manifest()

        def wanted(name: str, meta: Mapping[str, Any]) -> bool:
            saved = meta.get("extra", {}).get(checkpoint.PIPELINE_ROWS, {}).get("leaves")
            return name.split(".")[-1] in self.pipeline.rows.arrays and saved is not None and saved != mine

        self.state, extra = checkpoint.load(load_dir, tag, self.plan, load_optimizer_states=load_optimizer_states,
                                            load_module_only=load_module_only,
                                            relayout=checkpoint.Relayout(self._relayout, wanted))
        self.loaded_extra = extra
        resolved = tag or checkpoint.latest_tag(load_dir)
        return str(Path(load_dir) / str(resolved)), extra.get("client_state")

    def _relayout(self, name: str, saved: Any, meta: Mapping[str, Any]) -> Any:
        """Saved rows -> this run's (`name`: the state leaf, ending in the array's name): each logical leaf
        the array holds cut out by the saved manifest, checked against this module's parameters, and
        packed into this run's array of that name."""
        from zerojax.checkpoint import PIPELINE_ROWS, CheckpointError
        from zerojax.checkpoint.export import pipeline_leaf
        from zerojax.core.names import dotted
        entries = meta.get("extra", {}).get(PIPELINE_ROWS, {}).get("leaves")
        if entries is None:
            raise CheckpointError("checkpoint: stage rows of another layout, without the row manifest to convert them")
        array, rows = name.split(".")[-1], self.pipeline.rows
        table, logical = np.asarray(saved), {}
        for key, entry in self.module.abstract_params().items():
            paths, treedef = jax.tree_util.tree_flatten_with_path(entry)
            leaves = []
            for path, want in paths:
                leaf = dotted(path, key)
                found = entries.get(leaf)
                if found is None or tuple(found["shape"]) != tuple(want.shape):
                    got = "missing" if found is None else f"shape {tuple(found['shape'])}"
                    raise CheckpointError(f"checkpoint holds a different model: {leaf} is {got}, this pipeline's "
                                          f"model has shape {tuple(want.shape)}")
                # leaves of the other array are not read: zeros of their shape fill the entry for packing
                leaves.append(pipeline_leaf(table, found) if found.get("array", ROWS) == array
                              else np.zeros(want.shape, table.dtype))
            logical[key] = jax.tree.unflatten(treedef, leaves)
        return np.asarray(rows.pack(logical, saved.dtype)[array])

    def generate(self, prompts: Any, max_new_tokens: int, **kwargs: Any) -> Any:
        """Refused: a pipeline's layers live on different stages, and generation here runs the whole model."""
        raise NotImplementedError("generate: a pipeline engine (mesh.stage > 1) cannot generate, its layers live on "
                                  "different stages; train with mesh.stage: 1 (ZeRO-3 shards the model over the data "
                                  "axis and engine.generate gathers it once per call), or export the checkpoint "
                                  "and use `zerojax sample`")

    def memory_report(self) -> MemoryReport:
        return self.pipeline.memory_report()

    def partition_report(self) -> str:
        """Layers and parameters per stage, what each device stores, and the schedule."""
        return self.pipeline.table()

    def is_pipelined(self) -> bool:
        return True

    @property
    def num_stages(self) -> int:
        return self.pipeline.stages

    def micro_batches(self) -> int:
        return self.pipeline.schedule.micro_batches
