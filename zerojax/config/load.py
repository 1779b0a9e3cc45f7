"""`load_config`: a file, dict or Config (plus `--set` overrides) to a checked, frozen Config.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from zerojax.errors import ConfigError
from zerojax.config.auto import fill_auto
from zerojax.config.fields import reading
from zerojax.config.files import load_yaml, reject_duplicates, read_config_file
from zerojax.config.paths import flatten, show
from zerojax.config.rules import check_rules, derive
from zerojax.config.schema.root import Config
from zerojax.config.validate import build_config, plain_copy, given_values, schema_step


def load_config(src: "str | os.PathLike[str] | Mapping[str, Any] | Config",
                overrides: Sequence[str] = (), *, hidden_size: int | None = None) -> Config:
    """Load a config from a dict, a JSON/hjson/YAML file, or pass a Config through.

    `overrides` are `dotted.key=value` strings (value parsed as YAML) applied on top, as the CLI's
    `--set` does. `hidden_size` is the model's width, for the Hugging Face "auto" values the Trainer
    derives from it (default: model.d_model). Everything is checked here; nothing touches JAX devices.
    """
    origin: dict[str, str] = {}
    if isinstance(src, Config):
        if not overrides:
            return src
        raw = given_values(src, "", src.sources, origin)
    elif isinstance(src, Mapping):
        raw = plain_copy(src)
    elif isinstance(src, (str, os.PathLike)):
        raw = read_config_file(Path(src))
    else:
        raise ConfigError(f"config: expected a dict, a file path or a Config, got {type(src).__name__}")
    for item in overrides:
        key, value = _parse_override(item)
        path = _set_dotted(raw, key, value)
        for stale in [k for k in origin if k.startswith(path + ".")]:
            del origin[stale]  # the override replaced the whole section
        origin[path] = "override"
    sources: dict[str, str] = {}
    with reading(Path(src).expanduser().absolute() if isinstance(src, (str, os.PathLike)) else None):
        fills = fill_auto(raw, hidden_size)
        config = build_config(raw, sources, origin)
        sources.update(fills)
        config = derive(config, sources)
        check_rules(config, sources)
    return dataclasses.replace(config, sources=sources)


def as_config(config: "Config | Mapping[str, Any] | str | os.PathLike[str]") -> Config:
    """What the public functions take as `config` (a Config, a dict or a file path, as `initialize`
    does), loaded."""
    return load_config(config)


Fingerprint = tuple[tuple[str, str], ...]


def fingerprint(config: Config) -> Fingerprint:
    """Every resolved key and its value as written, sorted: equal fingerprints, equal configs. A plan
    records its config's, so a config handed to a function with the plan can be checked against it."""
    return tuple(sorted((key, show(value)) for key, value in flatten(config.to_dict())))


def differences(mine: Fingerprint, theirs: Fingerprint) -> list[tuple[str, str | None, str | None]]:
    """(key, value in `mine`, value in `theirs`) for every key whose values differ (None: absent)."""
    a, b = dict(mine), dict(theirs)
    return [(k, a.get(k), b.get(k)) for k in sorted({*a, *b}) if a.get(k) != b.get(k)]


def _parse_override(item: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value parsed as YAML, so 2, true, null, 1e-3 and [0.9, 0.95] work)."""
    import yaml
    if "=" not in item:
        raise ConfigError(f"override '{item}': write it as key.path=value, e.g. zero_optimization.stage=2")
    key, _, value = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}': the key path before '=' has an empty part; write it as "
                          f"key.path=value, e.g. zero_optimization.stage=2")
    try:
        parsed = load_yaml(value) if value.strip() else None
    except yaml.YAMLError:
        return key, value
    return key, reject_duplicates(parsed, key)


def _set_dotted(raw: dict, key: str, value: Any) -> str:
    """Set a dotted key in the raw tree and return its canonical path (aliases resolved).

    An alias already in the tree (e.g. `bfloat16`) is renamed to its canonical key first, so an
    override of `bf16.enabled` lands in the same section instead of duplicating it.
    """
    parts = key.split(".")
    node, cls, canon = raw, Config, []
    for i, part in enumerate(parts):
        name, aliases, cls = schema_step(cls, part)
        for alias in aliases:
            if alias in node and name not in node:
                node[name] = node.pop(alias)
        canon.append(name)
        if i == len(parts) - 1:
            node[name] = value
            break
        child = node.get(name)
        if child is None:
            child = node[name] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: '{'.'.join(canon)}' is a value, not a section")
        node = child
    return ".".join(canon)
