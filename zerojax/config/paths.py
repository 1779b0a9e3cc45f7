"""Dotted key paths, and a config as the plain data `config.json` holds.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from zerojax.config.fields import schema_fields
from zerojax.config.schema.optimizer import OptimizerConfig
from zerojax.config.schema.scheduler import SchedulerConfig


def join_path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def show(value: Any) -> str:
    """A value as the user wrote it (JSON where possible; YAML can also give dates and such)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        out = {}
        if isinstance(obj, (OptimizerConfig, SchedulerConfig)):
            out = {"type": obj.type, "params": to_plain(obj.params)}
            for key in ("no_decay", "param_groups"):  # written only when set: DeepSpeed has neither
                if getattr(obj, key, ()):
                    out[key] = to_plain(getattr(obj, key))
            return out
        for f in schema_fields(type(obj)):
            out[f.name] = to_plain(getattr(obj, f.name))
        return out
    if isinstance(obj, tuple):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def flatten(d: Mapping[str, Any], prefix: str = "") -> Any:
    for k, v in d.items():
        path = join_path(prefix, k)
        if isinstance(v, Mapping) and v:
            yield from flatten(v, path)
        else:
            yield path, v
