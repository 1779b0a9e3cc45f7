"""Every key of DeepSpeed's config-json documentation has a status here: honoured, no effect by design
(and why), or refused (and why); none fails as an unknown key.

tests/fixtures/deepspeed_keys/keys.json is the list of documented keys, extracted from the page by
tests/fixtures/deepspeed_keys/extract_keys.py (the page's version is in the file). A key DeepSpeed's
config.py reads that the page leaves out is listed in SOURCE_ONLY.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import warnings
from pathlib import Path

import pytest

import zerojax
from zerojax.config import ConfigWarning
from zerojax.config.foreign import FOREIGN_KEYS
from zerojax.config import status as key_status
from zerojax.config.status import HONOURED, KEY_STATUS, KINDS, NO_EFFECT, REFUSED

OTHER_KEY_STATUS: dict[str, str] = getattr(key_status, "OTHER_KEY_STATUS", {})

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed_keys"

# Read by DeepSpeed 0.19.6's runtime/config.py (constants LOG_LEVEL, LEGACY_FUSION), not on the page.
SOURCE_ONLY = ("log_level", "optimizer.legacy_fusion")


def documented_keys() -> list[str]:
    data = json.loads((FIXTURES / "keys.json").read_text())
    assert data["deepspeed_version"] and data["source"]
    return data["keys"]


def status_of(path: str) -> str | None:
    """zerojax's status of a DeepSpeed key: the schema's (KEY_STATUS), a DeepSpeed-only key's or section's
    (FOREIGN_KEYS: a section's status covers every key inside it), or OTHER_KEY_STATUS's."""
    if path in KEY_STATUS:
        return KEY_STATUS[path]
    if path in OTHER_KEY_STATUS:
        return OTHER_KEY_STATUS[path]
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        foreign = FOREIGN_KEYS.get(".".join(parts[:n]))
        if foreign is not None:
            if foreign.refuse is None:
                return f"{NO_EFFECT}: ignored with a warning ({foreign.effect})"
            return f"{REFUSED} when {foreign.refused_when}; otherwise ignored with a warning ({foreign.effect})"
    return None


def test_every_documented_key_has_a_status() -> None:
    keys = documented_keys()
    assert len(keys) > 300 and len(set(keys)) == len(keys)
    missing = [k for k in [*keys, *SOURCE_ONLY] if status_of(k) is None]
    assert missing == [], f"DeepSpeed keys without a status (zerojax/config/status.py or foreign.py): {missing}"
    for key in [*keys, *SOURCE_ONLY]:
        status = status_of(key)
        assert status.startswith(KINDS), (key, status)
        if status.startswith(NO_EFFECT):
            assert status[len(NO_EFFECT):].startswith(": ") and len(status) > len(NO_EFFECT) + 4, key


def test_every_deepspeed_only_key_is_reachable_by_the_loader() -> None:
    """A DeepSpeed-only key is looked up where its parent section is read: the top level, a schema
    section, or the optimizer section (its `type`/`params` sibling keys)."""
    sections = set(zerojax.config.schema_paths())
    for path in FOREIGN_KEYS:
        parent = path.rpartition(".")[0]
        assert parent == "" or parent in sections, path


def test_the_fixture_names_the_keys_that_failed_as_unknown() -> None:
    keys = set(documented_keys())
    assert {"managed_gradient_accumulation", "gradient_allreduce_op", "hybrid_engine.enable_cuda_graph",
            "zero_optimization.grad_hooks", "fp16.enabled", "zero_optimization.offload_param.max_in_cpu",
            "tensor_parallel.partition_config.layer_specs[].patterns",
            "compression_training.weight_quantization.different_groups.*.params.start_bits"} <= keys


def test_extractor_reads_every_form_of_key() -> None:
    spec = importlib.util.spec_from_file_location("extract_keys", FIXTURES / "extract_keys.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = """
### FP16 training options

<i>**fp16**</i>: [dictionary]

<i>**fp16:loss_scale**</i>: [float]

### ZeRO Optimizations for FP16 Training
```json
  "zero_optimization": {
    "stage": [0|1|2|3],
    "offload_param": {
      ...
    },
    "elastic_checkpoint" : [true|false] (deprecated),
    }
```
***overlap_comm***: [boolean]

### Tensor Parallel (AutoTP)
```json
  "tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": ["a\\\\.b"], "partition_type": "row"}]}}
```
***partition_type***: [string]

### Monitoring Module

<i>**wandb**</i>: [dictionary]

| Fields | Value | Default |
| ------ | ----- | ----- |
| team | Name. | `None` |

### Compression
<i>**different_groups**</i>: [dictionary]

| Fields | Value | Default |
| ----- | ----- | ----- |
| <i>**params**</i>: [dictionary] | | |
| <i>&emsp;&emsp;**bits**</i>: [integer] | Bits. | `8` |

### Checkpoint options
```json
"checkpoint": {
    "tag_validation"="Warn"
}
```
"""
    assert mod.extract(page) == [
        "fp16", "fp16.loss_scale", "zero_optimization", "zero_optimization.stage", "zero_optimization.offload_param",
        "zero_optimization.elastic_checkpoint", "zero_optimization.overlap_comm", "tensor_parallel",
        "tensor_parallel.partition_config", "tensor_parallel.partition_config.layer_specs",
        "tensor_parallel.partition_config.layer_specs[].patterns",
        "tensor_parallel.partition_config.layer_specs[].partition_type", "wandb", "wandb.team",
        "compression_training.different_groups", "compression_training.different_groups.*.params",
        "compression_training.different_groups.*.params.bits", "checkpoint", "checkpoint.tag_validation"]


# ------------------------------------------------------------------------------------------------
# The keys that failed as "unknown key": each loads, or is refused with the reason.

BASE = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _quiet_load(raw: dict) -> zerojax.Config:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return zerojax.load_config(raw)


def test_managed_gradient_accumulation_true_loads_false_is_refused() -> None:
    assert _quiet_load({**BASE, "managed_gradient_accumulation": True}).managed_gradient_accumulation
    assert KEY_STATUS["managed_gradient_accumulation"].startswith(HONOURED)
    with pytest.raises(zerojax.ConfigError, match=r"^managed_gradient_accumulation: false is not supported"):
        zerojax.load_config({**BASE, "managed_gradient_accumulation": False})


def test_gradient_allreduce_op_values_and_refusals() -> None:
    assert _quiet_load(BASE).gradient_allreduce_op == "mean"
    assert _quiet_load({**BASE, "gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"  # as DeepSpeed lowers it
    with pytest.raises(zerojax.ConfigError, match=r"gradient_allreduce_op: 'avg' is not one of mean, sum"):
        zerojax.load_config({**BASE, "gradient_allreduce_op": "avg"})
    with pytest.raises(zerojax.ConfigError, match=r"^gradient_allreduce_op: 'sum' is not supported with ZeRO stage 3"):
        zerojax.load_config({**BASE, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})
    with pytest.raises(zerojax.ConfigError, match=r"^gradient_allreduce_op: 'sum' is not built for pipeline runs"):
        zerojax.load_config({**BASE, "gradient_allreduce_op": "sum", "mesh": {"stage": 2}})
    with pytest.raises(zerojax.ConfigError, match=r"^gradient_allreduce_op: 'sum' is not built with a sequence axis"):
        zerojax.load_config({**BASE, "gradient_allreduce_op": "sum", "sequence_parallel_size": 2})


def test_log_level_sets_the_zerojax_logger_when_an_engine_starts() -> None:
    from helpers import data_mesh, mlp_params, mse_loss
    with pytest.raises(zerojax.ConfigError, match=r"log_level: 'verbose' is not one of debug, info"):
        zerojax.load_config({**BASE, "log_level": "verbose"})
    logger = logging.getLogger("zerojax")
    handler = logging.NullHandler()
    before = logger.level
    logger.addHandler(handler)
    try:
        cfg = _quiet_load({**BASE, "log_level": "ERROR"})
        zerojax.initialize(cfg, params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh(8))
        assert logger.level == logging.ERROR and handler.level == logging.ERROR
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


def test_enable_cuda_graph_loads_as_no_effect() -> None:
    cfg = _quiet_load({**BASE, "hybrid_engine": {"enabled": True, "enable_cuda_graph": True}})
    assert cfg.hybrid_engine.enable_cuda_graph
    assert KEY_STATUS["hybrid_engine.enable_cuda_graph"].startswith(NO_EFFECT + ": ")


def test_legacy_fusion_is_ignored_with_one_warning() -> None:
    raw = {**BASE, "optimizer": {**BASE["optimizer"], "legacy_fusion": False}}
    with pytest.warns(ConfigWarning, match=r"optimizer\.legacy_fusion") as caught:
        cfg = zerojax.load_config(raw)
    assert len([w for w in caught if issubclass(w.category, ConfigWarning)]) == 1
    assert cfg.optimizer.type == "adamw" and cfg.sources["optimizer.legacy_fusion"].startswith("ignored")


def test_parameters_of_refused_optimizer_types_are_refused_with_their_type() -> None:
    with pytest.raises(zerojax.ConfigError, match=r"^optimizer\.type: OneBitAdam \(1-bit"):
        zerojax.load_config({**BASE, "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 10}}})
    assert all(v.startswith(REFUSED) for v in OTHER_KEY_STATUS.values())


def test_offload_param_nvme_keys_load_and_are_honoured() -> None:
    """ZeRO-Infinity's parameter tier: DeepSpeed's offload_param block loads at stage 3 as written."""
    block = {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5, "buffer_size": 100_000_000,
             "max_in_cpu": 1_000_000_000, "pin_memory": True}
    cfg = _quiet_load({**BASE, "zero_optimization": {"stage": 3, "offload_param": block}})
    assert cfg.zero_optimization.offload_param.device == "nvme"
    for key in ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu"):
        assert KEY_STATUS[f"zero_optimization.offload_param.{key}"].startswith(HONOURED), key
