"""docs/config.md is generated from the schema; this keeps the committed copy from drifting."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from zerojax import config as cfg
from zerojax.tools.config_docs import REGENERATE, render_reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_committed_reference_is_current() -> None:
    assert DOC.read_text() == render_reference(), (
        f"docs/config.md is out of date with zerojax/config/schema/; regenerate it with `{REGENERATE}`")


def _sections(text: str) -> dict[str, str]:
    """Heading title -> the text under it, up to the next heading."""
    parts = re.split(r"^#+ (.*)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _schema_tables() -> dict[str, type]:
    """Heading of each table the reference must have -> the schema class it documents."""
    out: dict[str, type] = {}

    def walk(path: str, cls: type) -> None:
        out[f"`{path}`"] = cls
        for f in cfg.schema_fields(cls):
            if dataclasses.is_dataclass(f.default_factory):
                walk(f"{path}.{f.name}", f.default_factory)

    for f in cfg.schema_fields(cfg.Config):
        if dataclasses.is_dataclass(f.default_factory) and f.name != "optimizer":
            walk(f.name, f.default_factory)
    out["`optimizer`"], out["`scheduler`"] = cfg.OptimizerConfig, cfg.SchedulerConfig
    for name, cls in cfg.SCHEDULER_PARAMS.items():
        out[f"`scheduler.params` for type `{name}`"] = cls
    return out


def test_every_key_of_every_section_is_documented() -> None:
    sections = _sections(render_reference())
    top = sections["Top-level keys"]
    for f in cfg.schema_fields(cfg.Config):
        assert f"| `{f.name}` |" in top, f.name
    for heading, cls in _schema_tables().items():
        assert heading in sections, heading
        for f in cfg.schema_fields(cls):
            assert f"| `{f.name}` |" in sections[heading], (heading, f.name)


def test_optimizer_tables_cover_every_type_and_mark_required_scheduler_params() -> None:
    text = render_reference()
    for cls in set(cfg.OPTIMIZER_PARAMS.values()):
        assert (cls.__doc__ or "").split("\n")[0] in text
    cosine = _sections(text)["`scheduler.params` for type `WarmupCosineLR`"]
    assert re.search(r"\| `total_num_steps` \| int > 0 \| \*\*required\*\* \|", cosine)
    assert "| `adam_w_mode` | bool (or 0/1) | `true` |" in text
    assert '| `device` | one of "none", "cpu", "nvme" | `"none"` |' in text
    assert "none \\| cpu" in text  # a `|` inside a cell is escaped


# ---------------------------------------------------------------------------------------------
# Every key has a status: honoured, no effect by design (and why), or refused.

def test_every_schema_key_has_a_status_and_the_reference_prints_it() -> None:
    from zerojax.config.status import KEY_STATUS, KINDS, NO_EFFECT
    paths = set(cfg.schema_paths())
    assert sorted(paths - set(KEY_STATUS)) == [], "keys without a status in zerojax/config/status.py"
    assert sorted(set(KEY_STATUS) - paths) == [], "statuses of keys the schema no longer has"
    for path, status in KEY_STATUS.items():
        assert status.startswith(KINDS), (path, status)
        if status.startswith(NO_EFFECT):
            assert re.match(rf"^{NO_EFFECT}: \S", status), f"{path}: say why it has no effect"
    rows = 0
    for heading, body in _sections(render_reference()).items():
        if "| key | type | default | status | description |" not in body:
            continue
        for line in body.splitlines():
            if line.startswith("| `"):
                cells = re.split(r"(?<!\\)\|", line)[1:-1]
                assert len(cells) == 5 and cells[3].strip().startswith(KINDS), (heading, line)
                rows += 1
    assert rows >= len(paths) - 10  # every key printed (params shared by several types count once here)


def test_a_key_without_a_status_fails_the_reference(monkeypatch) -> None:
    """The walk fails on any key without a status: a new schema key must be classified."""
    import pytest
    from zerojax.config import status as key_status
    table = dict(key_status.KEY_STATUS)
    del table["zero_optimization.stage3_max_live_parameters"]
    monkeypatch.setattr("zerojax.tools.config_docs.KEY_STATUS", table)
    with pytest.raises(KeyError, match="stage3_max_live_parameters"):
        render_reference()


def test_refused_statuses_are_refused() -> None:
    """A sample value for each key marked refused is rejected by load_config or by plan's check."""
    import pytest
    from zerojax.config.status import KEY_STATUS, REFUSED
    samples = {
        "optimizer.params.amsgrad": {"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
        "optimizer.params.max_grad_norm": {"optimizer": {"type": "Lamb", "params": {"max_grad_norm": 1.0}}},
        "fp16.fp16_master_weights_and_grads": {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
        "zero_optimization.mics_shard_size": {"zero_optimization": {"stage": 3, "mics_shard_size": 2}},
        "aio.use_gds": {"aio": {"use_gds": True}},
        "zero_optimization.ignore_unused_parameters": {"zero_optimization": {"ignore_unused_parameters": False}},
        "tensor_parallel.replace_with_kernel_inject": {"tensor_parallel": {"kernel_inject": True}},
        "tensor_parallel.partition_config.strict_mode": {"tensor_parallel": {"partition_config": {"strict_mode": True}}},
    }
    assert sorted(samples) == sorted(k for k, v in KEY_STATUS.items() if v.startswith(REFUSED))
    for key, raw in samples.items():
        with pytest.raises(cfg.ConfigError):
            cfg.check_supported(cfg.load_config({"train_batch_size": 8, **raw}))
