"""docs/config.md is generated from the schema; this keeps the committed copy from drifting."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from zerojax import config as cfg
from zerojax.config_docs import REGENERATE, render_reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_committed_reference_is_current() -> None:
    assert DOC.read_text() == render_reference(), (
        f"docs/config.md is out of date with zerojax/config.py; regenerate it with `{REGENERATE}`")


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
