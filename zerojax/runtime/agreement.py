"""Refuse to start a multi-process step whose processes would run different programs.

Processes that compiled different steps (another config value on one host, another library version,
a nondeterministic compile) enter different collectives and wait for each other forever: the hang
ZeRO-3 users of DeepSpeed meet most. Before a step first runs, every process publishes what it is
about to run through `jax.distributed`'s key-value store - a digest of the lowered program, a digest
of the compiled one, the ordered list of its collectives (kind, result types, replica groups) and the
config it came from - and reads everyone else's, with a timeout. When the collectives differ every
process fails at once, with one message naming the processes that differ, the config keys that
differ, and the first collective where the programs part; lowered programs that agree with compiled
ones that do not are the compiler's nondeterminism, and the message says so.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any, Mapping

import jax

from zerojax.core.hlo import collectives
from zerojax.errors import ConfigError

__all__ = ["ProgramMismatch", "program_digest", "agree_on_program", "first_difference"]

_ROUNDS = itertools.count()   # one key per check, in the order every process makes its checks


class ProgramMismatch(ConfigError):
    """Processes of one run compiled different programs: refused before any of them runs."""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def program_digest(lowered_text: str, compiled_text: str, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What must be equal on every process, as JSON-ready data."""
    found = [f"{c.kind} of {c.result_elems:,} {'/'.join(c.dtypes)} elements, {c.count}x per step, over "
             f"{list(map(list, c.groups)) or 'all devices'}" for c in collectives(compiled_text)]
    return {"lowered": _sha(lowered_text), "compiled": _sha(compiled_text), "collectives": found,
            "config": dict(config or {})}


def first_difference(mine: list[str], theirs: list[str]) -> str:
    """Where two ordered collective lists part, in words."""
    for i, (a, b) in enumerate(itertools.zip_longest(mine, theirs)):
        if a != b:
            return (f"collective #{i + 1}: here {a or 'none (the program ends)'}, there "
                    f"{b or 'none (the program ends)'}")
    return "the same collectives in the same order (the programs differ elsewhere)"


def _client() -> Any:
    from jax._src import distributed  # the coordination service's client `jax.distributed.initialize` made
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("the run has several processes but jax.distributed is not initialized")
    return client


def agree_on_program(name: str, lowered_text: str, compiled_text: str, *, config: Mapping[str, Any] | None = None,
                     timeout_s: float = 300.0) -> None:
    """Every process calls this with its own program before running it; raises `ProgramMismatch` on
    every process if any differs, or `ConfigError` if a process does not arrive within `timeout_s`.
    One process: nothing to compare."""
    n = jax.process_count()
    if n == 1:
        return
    me = jax.process_index()
    key = f"zerojax/program/{next(_ROUNDS)}/{name}"
    mine = program_digest(lowered_text, compiled_text, config)
    client = _client()
    client.key_value_set(f"{key}/{me}", json.dumps(mine))
    digests = {}
    for p in range(n):
        try:
            digests[p] = mine if p == me else json.loads(client.blocking_key_value_get(f"{key}/{p}",
                                                                                      int(timeout_s * 1000)))
        except Exception as e:  # the coordination service's timeout (or its loss)
            raise ConfigError(f"{name}: process {p} did not compile its {name} within {timeout_s:g} s of this one "
                              f"(distributed.hang_timeout); it is stuck or gone before its first step "
                              f"({type(e).__name__})") from None
    reference = digests[0]
    # What hangs is a collective one process enters and another does not: compare those. (The compiled
    # text itself may differ in names when one process loads its executable from a compilation cache.)
    bad = [p for p, d in digests.items() if d["collectives"] != reference["collectives"]]
    if not bad:
        return
    other = digests[bad[0]] if me == 0 else mine
    keys = sorted(k for k in {*reference["config"], *other["config"]}
                  if reference["config"].get(k) != other["config"].get(k))
    shown = "; ".join(f"{k}: process 0 {reference['config'].get(k)}, process {bad[0]} {other['config'].get(k)}"
                      for k in keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
    where = first_difference(reference["collectives"], other["collectives"]).replace("here", "process 0", 1) \
        .replace("there", f"process {bad[0]}", 1)
    if all(d["lowered"] == reference["lowered"] for d in digests.values()):
        raise ProgramMismatch(
            f"{name}: process(es) {bad} compiled a different program than process 0 from the same lowered one: the "
            f"compiler was nondeterministic ({where}). Start every process with the same XLA_FLAGS and library "
            f"versions, or share one persistent compilation cache (jax_compilation_cache_dir) so every process "
            f"runs the same binary; refused before any collective could hang")
    raise ProgramMismatch(
        f"{name}: process(es) {bad} would run a different program than process 0, so their collectives would "
        f"not match and the run would hang; refused before the first step. "
        + (f"The configs differ: {shown}. " if keys else "The configs agree: the code, a library version or the "
                                                         "model differs between the processes. ")
        + f"The programs part at {where}")
