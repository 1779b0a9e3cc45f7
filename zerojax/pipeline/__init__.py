"""Pipeline parallelism: a model as a list of layers cut into stages along a `stage` mesh axis.

module.py    PipelineModule / LayerSpec / TiedLayerSpec and the partition report
partition.py the partition methods (parameters | uniform | type:REGEX)
schedule.py  schedules as data (GPipe, 1F1B, interleaved, forward-only)
buffers.py   each stage's parameters as one row of a `[stage, width]` array
executor.py  one shard_map over (stage, data) running a schedule with lax.ppermute
step.py      the pipelined train / eval steps on the shared ZeRO `apply_update`
engine.py    `zerojax.initialize(config, model=PipelineModule(...))`
"""
from zerojax.pipeline.module import LayerSpec, Partition, PipelineModule, TiedLayerSpec
from zerojax.pipeline.schedule import Schedule, build as build_schedule

__all__ = ["LayerSpec", "Partition", "PipelineModule", "Schedule", "TiedLayerSpec", "build_schedule"]
