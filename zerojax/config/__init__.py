"""DeepSpeed-compatible configuration as frozen dataclasses.

The package shows its three parts apart: `schema/` (the keys, by area, each with its default and
doc string: `docs/config.md` is generated from it), `load` / `validate` / `files` (reading a file
or dict, coercing and checking every value, with the dotted key path and a "did you mean" in
every error), and `rules` / `auto` / `foreign` (DeepSpeed's cross-key rules, Hugging Face's "auto"
values, and DeepSpeed sections zerojax does not build).
"""
from zerojax.errors import ConfigError
from zerojax.config.fields import ConfigWarning, option, schema_fields, section
from zerojax.config.schema.root import BATCH_KEYS, Config
from zerojax.config.schema.optimizer import (AdagradParams, AdamParams, CLIENT_OPTIMIZER, LambParams, LionParams, ONE_BIT_OPTIMIZERS, OPTIMIZER_PARAMS, OptimizerConfig, ParamGroup, SGDParams, ZERO_TESTED_OPTIMIZERS)
from zerojax.config.schema.scheduler import (LRRangeTestParams, OneCycleParams, REQUIRED_SCHEDULER_PARAMS, SCHEDULER_PARAMS, SchedulerConfig, WarmupCosineLRParams, WarmupDecayLRParams, WarmupLRParams)
from zerojax.config.schema.precision import BF16Config, DataTypesConfig, FP16Config
from zerojax.config.schema.zero import (ActivationCheckpointingConfig, OffloadOptimizerConfig, OffloadParamConfig, POLICY_CHOICES, ZeroConfig)
from zerojax.config.schema.monitoring import (COLLECTIVE_KINDS, OP_NAMES, CommsLoggerConfig, FlopsProfilerConfig,
    CometConfig, MonitorConfig, WandbConfig)
from zerojax.config.schema.parallel import (AxisRules, DistributedConfig, HybridEngineConfig, LayerSpec, MeshConfig,
    PARTITION_TYPES, PartitionConfig, PipelineConfig, RULE_AXES, TPConfig, TensorParallelConfig)
from zerojax.config.schema.run import CheckpointConfig, DataConfig, LoraConfig, ModelConfig, RunConfig
from zerojax.config.batch import BatchSize, resolve_batch
from zerojax.config.files import read_config_file
from zerojax.config.foreign import FOREIGN_KEYS, Foreign
from zerojax.config.rules import check_supported, unsupported_features
from zerojax.config.auto import HIDDEN_FILLS, TRAINER_ONLY
from zerojax.config.validate import schema_paths
from zerojax.config.load import Fingerprint, as_config, differences, fingerprint, load_config
from zerojax.config.hf import HFError

__all__ = ["Config", "ConfigError", "ConfigWarning", "BatchSize", "load_config", "resolve_batch", "unsupported_features"]
