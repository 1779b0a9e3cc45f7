"""How the schema is declared: `option` and `section` carry each key's default, doc string and
checks in the dataclass field metadata, which the loader and the generated docs read.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import field
from typing import Any, Sequence



MISSING = dataclasses.MISSING


class ConfigWarning(UserWarning):
    """A key that loads but means nothing here (DeepSpeed ignores it too, or it is not built)."""


def warn_ignored(sources: dict[str, str], path: str, message: str, label: str) -> None:
    """One warning line per ignored key, and its source label for `config explain`."""
    sources[path] = label
    warnings.warn(f"{path}: {message}", ConfigWarning, stacklevel=4)


def option(default: Any = MISSING, doc: str = "", *, choices: Sequence[Any] | None = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None,
           aliases: Sequence[str] = (), int_bool: bool = False, factory: Any = None) -> Any:
    """A schema field: default, doc string and the checks the loader applies."""
    meta = dict(doc=doc, choices=tuple(choices) if choices else None, ge=ge, gt=gt, le=le,
                aliases=tuple(aliases), int_bool=int_bool)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type) -> Any:
    """A nested section; its doc is the first line of the class docstring."""
    return field(default_factory=cls, metadata=dict(doc=(cls.__doc__ or "").strip().splitlines()[0]))


def schema_fields(cls: type) -> list[dataclasses.Field]:
    """The user-facing fields of a schema dataclass (not the internal `sources`)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
