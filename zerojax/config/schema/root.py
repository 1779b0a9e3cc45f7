"""`Config`: every section of the schema, and the views derived from a resolved config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from zerojax.config.batch import resolve_batch
from zerojax.config.fields import option, section
from zerojax.config.paths import flatten, to_plain
from zerojax.config.schema.monitoring import (CometConfig, CommsLoggerConfig, FlopsProfilerConfig, MonitorConfig,
                                              WandbConfig)
from zerojax.config.schema.optimizer import OptimizerConfig
from zerojax.config.schema.parallel import (DistributedConfig, HybridEngineConfig, MeshConfig, PipelineConfig,
                                            TensorParallelConfig)
from zerojax.config.schema.precision import BF16Config, DataTypesConfig, FP16Config
from zerojax.config.schema.run import CheckpointConfig, DataConfig, LoraConfig, ModelConfig, RunConfig
from zerojax.config.schema.scheduler import SchedulerConfig
from zerojax.config.schema.zero import ActivationCheckpointingConfig, AioConfig, ZeroConfig

if TYPE_CHECKING:
    from zerojax.config.batch import BatchSize


# DeepSpeed's batch triad: two of them fix the third for a given data-parallel size.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class Config:
    """A resolved zerojax / DeepSpeed configuration."""
    train_batch_size: Optional[int] = option(None, "Global batch = micro * accumulation * data-parallel size.",
                                             gt=0)
    train_micro_batch_size_per_gpu: Optional[int] = option(None, "Rows per data shard per micro-step.", gt=0)
    gradient_accumulation_steps: Optional[int] = option(None, "Micro-steps per optimizer step.", gt=0)
    managed_gradient_accumulation: bool = option(
        True, "The engine tracks micro-batches and steps the optimizer at the accumulation boundary (every "
              "gradient_accumulation_steps micro-batches), as DeepSpeed's default; false (the client calls "
              "step() at its own boundaries) is refused.")
    optimizer: Optional[OptimizerConfig] = option(
        None, "No optimizer section: the optimizer passed in code (initialize(optimizer=...) or "
              "plan(optimizer=...)), as DeepSpeed uses the one passed to deepspeed.initialize; with neither, "
              "an error.")
    scheduler: Optional[SchedulerConfig] = option(None, "No scheduler: constant optimizer lr.")
    gradient_clipping: float = option(1.0, "Clip the global L2 gradient norm to this (0 disables).", ge=0)
    fp16: FP16Config = section(FP16Config)
    bf16: BF16Config = option(factory=BF16Config, doc="bf16 mixed precision.", aliases=("bfloat16",))
    zero_optimization: ZeroConfig = section(ZeroConfig)
    aio: AioConfig = section(AioConfig)
    zero_allow_untested_optimizer: bool = option(False, "Allow optimizers outside DeepSpeed's ZeRO list.")
    zero_force_ds_cpu_optimizer: bool = option(True, "Accepted; the offload path has one optimizer.")
    activation_checkpointing: ActivationCheckpointingConfig = section(ActivationCheckpointingConfig)
    data_types: DataTypesConfig = section(DataTypesConfig)
    communication_data_type: Optional[str] = option(
        None, "dtype of gradient collectives (default: the gradient dtype).", choices=("fp32", "fp16", "bf16"))
    prescale_gradients: bool = option(
        False, "Divide gradients by the data-parallel size before their all-reduce instead of after (stage 0, "
               "or reduce_scatter: false); matters when the sum runs in fp16.")
    gradient_predivide_factor: float = option(
        1.0, "Without prescale: divide gradients by this before the all-reduce and multiply by factor/dp "
             "after (stage 0, or reduce_scatter: false).", gt=0)
    gradient_allreduce_op: str = option(
        "mean", "How data-parallel gradients combine: mean (averaged over the data-parallel ranks) or sum (their "
                "unscaled sum: the mean gradient times the data-parallel size, before clipping and the update; "
                "ZeRO stages 0-2, as in DeepSpeed, and not with pipeline stages or a sequence axis).",
        choices=("mean", "sum"))
    steps_per_print: int = option(10, "Print a metrics line every this many steps.", gt=0)
    wall_clock_breakdown: bool = option(
        False, "Per step at each print: data wait, dispatch, device time (waits for every step) and logging; "
               "forward, backward and optimizer run inside one compiled program and are not separated.")
    memory_breakdown: bool = option(False, "Print each device's memory (arrays by role, allocator in-use and "
                                           "peak where the backend reports them, host RSS) at every print step.")
    dump_state: bool = option(False, "Print the resolved config at start.")
    log_level: Optional[str] = option(
        None, "Level of zerojax's Python logger (the `zerojax` logger and its handlers), set when an engine "
              "starts, as DeepSpeed sets its logger's; unset: left as it is.",
        choices=("debug", "info", "warning", "error", "critical"))
    tensorboard: MonitorConfig = section(MonitorConfig)
    csv_monitor: MonitorConfig = section(MonitorConfig)
    wandb: WandbConfig = section(WandbConfig)
    comet: CometConfig = section(CometConfig)
    flops_profiler: FlopsProfilerConfig = section(FlopsProfilerConfig)
    comms_logger: CommsLoggerConfig = section(CommsLoggerConfig)
    pipeline: PipelineConfig = section(PipelineConfig)
    hybrid_engine: HybridEngineConfig = section(HybridEngineConfig)
    tensor_parallel: TensorParallelConfig = section(TensorParallelConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    sequence_parallel_size: int = option(1, "DeepSpeed-Ulysses sequence-parallel size; sets mesh.sequence "
                                            "(1: none).", gt=0)
    kernels: str = option("auto", "Optimizer update: auto (Pallas kernels on GPU for Adam/AdamW, XLA "
                                  "elsewhere) | pallas (Triton on GPU, interpret mode on CPU) | xla (optax).",
                          choices=("auto", "pallas", "xla"))
    mesh: MeshConfig = section(MeshConfig)
    model: ModelConfig = section(ModelConfig)
    lora: LoraConfig = section(LoraConfig)
    data: DataConfig = section(DataConfig)
    run: RunConfig = section(RunConfig)
    distributed: DistributedConfig = section(DistributedConfig)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False,
                                       metadata=dict(internal=True))

    # -- derived views ------------------------------------------------------------------------
    @property
    def compute_dtype(self) -> str:
        return "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"

    def batch(self, dp_size: int) -> "BatchSize":
        return resolve_batch(self, dp_size)

    def to_dict(self) -> dict[str, Any]:
        """Every resolved value as plain JSON-able data (what `config.json` holds)."""
        return to_plain(self)

    def explain(self, dp_size: int | None = None) -> str:
        """Every resolved value and where it came from (file, override, default, derived)."""
        rows = list(flatten(self.to_dict()))
        if dp_size is not None:
            b = self.batch(dp_size)
            extra = dict(zip(BATCH_KEYS, b))
            rows = [(k, extra.get(k, v)) for k, v in rows]
        width = max(len(k) for k, _ in rows)
        lines = [f"{'key'.ljust(width)}  {'value':<24} source"]
        for key, value in rows:
            src = self._source_of(key)
            if dp_size is not None and key in BATCH_KEYS and getattr(self, key) is None:
                auto = "'auto', " if src == "derived ('auto')" else ""
                src = f"derived ({auto}data-parallel size {dp_size})"
            lines.append(f"{key.ljust(width)}  {json.dumps(value):<24} {src}")
        for key, src in self.sources.items():  # keys that loaded with a warning and do nothing
            if src.startswith("ignored"):
                lines.append(f"{key.ljust(width)}  {'-':<24} {src}")
        return "\n".join(lines)

    def _source_of(self, key: str) -> str:
        """Where a row's value came from; a mapping's entries (mesh.logical_axis_rules.embed) share the
        source of the mapping."""
        obj, parts = self, key.split(".")
        for i, part in enumerate(parts[:-1]):
            obj = getattr(obj, part, None)
            if isinstance(obj, Mapping):
                return self.sources.get(".".join(parts[:i + 1]), "default")
        return self.sources.get(key, "default")
