"""How the schema is declared: `option` and `section` carry each key's default, doc string and
checks in the dataclass field metadata, which the loader and the generated docs read.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
import sys
import warnings
from dataclasses import field
from pathlib import Path
from typing import Any, Iterator, Sequence

MISSING = dataclasses.MISSING
_PACKAGE = str(Path(__file__).resolve().parents[1])  # zerojax/: frames inside it are not the user's

# The config file being loaded, so that a warning points at the user's file and line.
_SOURCE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("zerojax_config_source", default=None)


class ConfigWarning(UserWarning):
    """A key that loads but means nothing here (DeepSpeed ignores it too, or it is not built)."""


@contextlib.contextmanager
def reading(path: Path | None) -> Iterator[None]:
    """Warnings raised while loading come from `path` (None: a dict given in code)."""
    token = _SOURCE.set(path)
    try:
        yield
    finally:
        _SOURCE.reset(token)


def _line_of(text: str, key: str) -> int:
    """The first line naming the key's last part as a key (JSON, hjson or YAML); 1 if none does."""
    name = re.escape(key.rsplit(".", 1)[-1])
    for i, line in enumerate(text.splitlines(), 1):
        if re.search(rf"(^|[\s{{,])[\"']?{name}[\"']?\s*:", line):
            return i
    return 1


def warn(path: str, message: str) -> None:
    """A ConfigWarning that points at the user's config file and the key's line (or at the config
    given in code), not at the loader's own source."""
    source = _SOURCE.get()
    if source is None:  # a config given in code: the caller's line outside zerojax
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
            frame = frame.f_back
        warnings.warn_explicit(f"{path}: {message}", ConfigWarning, frame.f_code.co_filename, frame.f_lineno,
                               module=frame.f_globals.get("__name__", "zerojax.config"))
        return
    try:
        line = _line_of(source.read_text(errors="replace"), path)
    except OSError:
        line = 1
    warnings.warn_explicit(f"{path}: {message}", ConfigWarning, str(source), line, module="zerojax.config")


def warn_ignored(sources: dict[str, str], path: str, message: str, label: str) -> None:
    """One warning line per ignored key, and its source label for `config explain`."""
    sources[path] = label
    warn(path, message)


def option(default: Any = MISSING, doc: str = "", *, choices: Sequence[Any] | None = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None,
           aliases: Sequence[str] = (), int_bool: bool = False, factory: Any = None,
           parse: Any = None) -> Any:
    """A schema field: default, doc string and the checks the loader applies. `parse(value, path)`
    reads a value no plain type describes (a mapping), raising ConfigError for a bad one."""
    meta = dict(doc=doc, choices=tuple(choices) if choices else None, ge=ge, gt=gt, le=le,
                aliases=tuple(aliases), int_bool=int_bool, parse=parse)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type) -> Any:
    """A nested section; its doc is the first line of the class docstring."""
    return field(default_factory=cls, metadata=dict(doc=(cls.__doc__ or "").strip().splitlines()[0]))


def schema_fields(cls: type) -> list[dataclasses.Field]:
    """The user-facing fields of a schema dataclass (not the internal `sources`)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
