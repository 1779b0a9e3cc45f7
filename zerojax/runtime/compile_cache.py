"""JAX's persistent compilation cache for train.py and the CLI: a second run (or a resume) with the
same shapes reads its compiled programs from disk instead of compiling them again.

JAX keys each entry by the program, its shardings, the devices and the jax/XLA versions, so a stale
entry is never used: a changed model or mesh compiles afresh and adds its own entry.
(https://docs.jax.dev/en/latest/persistent_compilation_cache.html)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import jax

ENV = "JAX_COMPILATION_CACHE_DIR"
AUTO = "auto"


def default_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user cache folder: `$XDG_CACHE_HOME/zerojax/jax`, by default `~/.cache/zerojax/jax`."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zerojax" / "jax"


def cache_dir(setting: str | None, environ: Mapping[str, str] | None = None) -> Path | str | None:
    """Where the run's compiled programs are cached; None: nowhere.

    `setting` is `run.compile_cache`: "auto" (the default) keeps a JAX_COMPILATION_CACHE_DIR the
    environment already names (JAX reads it itself; returned as that string) and otherwise uses
    `default_dir`; a path moves the cache there; None turns it off."""
    env = os.environ if environ is None else environ
    if setting is None:
        return None
    if setting == AUTO:
        return env[ENV] if env.get(ENV) else default_dir(env)
    return Path(setting).expanduser()


def enable(setting: str | None, environ: Mapping[str, str] | None = None) -> Path | str | None:
    """Point JAX's persistent cache at `cache_dir(setting)`, before the process compiles anything.

    Every program is cached however fast it compiled (JAX's default skips those under a second, which
    on a small model is all of them but the step), unless the environment sets the threshold itself."""
    env = os.environ if environ is None else environ
    where = cache_dir(setting, env)
    if where is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(where))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in env:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return where


class Compilations:
    """Counts the programs XLA compiles while open (`with Compilations() as c: ...; c.count`), from
    jax.monitoring's backend-compile event: what a loop that should reuse its programs (generate and
    train steps across calls) can print or assert. A program read from the persistent cache is not
    compiled and not counted."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0

    def _listen(self, event: str, duration: float, **kwargs: object) -> None:
        if event == self.EVENT:
            self.count += 1

    def __enter__(self) -> "Compilations":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)
