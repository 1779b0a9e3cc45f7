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

Before that, and before anything compiles at all (initialising the state, reading it, choosing the run
folder are collectives too), the processes compare what they were asked to run - the resolved config
and the plan made from it - the same way (`agree_on_items`): a stale config file on one host is named
key by key instead of ending in the transport's "collective mismatch".
"""
from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any, Mapping

import jax

from zerojax.measure.hlo import collectives
from zerojax.errors import ConfigError

__all__ = ["ProgramMismatch", "ProcessMismatch", "program_digest", "agree_on_program", "first_difference",
           "agree_on_items", "plan_items", "item_differences"]

_ROUNDS = itertools.count()   # one key per check, in the order every process makes its checks


class ProgramMismatch(ConfigError):
    """Processes of one run compiled different programs: refused before any of them runs."""


class ProcessMismatch(ConfigError):
    """Processes of one run hold different configs or plans: refused before anything compiles."""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def program_digest(lowered_text: str, compiled_text: str, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What must be equal on every process, as JSON-ready data."""
    # Kind, size, dtypes, executions and the devices that meet in it (groups; a permute's pairs): a digest
    # of kinds and counts alone would call a ZeRO-3 gather of another width or over another axis equal.
    found = [f"{c.kind} of {c.result_elems:,} {'/'.join(c.dtypes)} elements, {c.count}x per step, over "
             + (f"pairs {list(map(list, c.pairs))}" if c.pairs else f"{list(map(list, c.groups)) or 'all devices'}")
             for c in collectives(compiled_text)]
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


def _joined() -> tuple[int, int]:
    """(processes, this process's index) of the run `jax.distributed.initialize` joined, (1, 0) without
    one. Read from the coordination service's state, so it does not start JAX's backends."""
    from jax._src import distributed
    state = distributed.global_state
    if state.client is None or not state.num_processes:
        return 1, 0
    return int(state.num_processes), int(state.process_id or 0)


def _exchange(key: str, mine: Any, n: int, me: int, timeout_s: float, what: str, waiting_for: str) -> dict[int, Any]:
    """Publish `mine` under `key` and read every process's, each within `timeout_s`: the coordination
    service's key-value store, no collective, so nothing can hang or fail in the transport."""
    client = _client()
    client.key_value_set(f"{key}/{me}", json.dumps(mine))
    found: dict[int, Any] = {}
    for p in range(n):
        try:
            found[p] = mine if p == me else json.loads(client.blocking_key_value_get(f"{key}/{p}",
                                                                                     int(timeout_s * 1000)))
        except Exception as e:  # the coordination service's timeout (or its loss)
            raise ConfigError(f"{what}: process {p} did not {waiting_for} within {timeout_s:g} s of this one "
                              f"(distributed.hang_timeout); it is stuck or gone ({type(e).__name__})") from None
    return found


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def item_differences(tables: Mapping[int, Mapping[str, Any]]) -> tuple[list[int], list[str]]:
    """The processes whose table differs from process 0's, and one line per differing key naming every
    process's value (tables: per process, key -> {"d": digest, "v": value shown})."""
    reference = tables[0]
    bad = [p for p, t in sorted(tables.items()) if t != reference]
    lines = []
    for k in sorted({k for p in bad for k in tables[p]} | set(reference)):
        if all(tables[p].get(k, {}).get("d") == reference.get(k, {}).get("d") for p in bad):
            continue
        seen: dict[str, list[int]] = {}
        for p, t in sorted(tables.items()):
            seen.setdefault(t[k]["v"] if k in t else "<missing>", []).append(p)
        lines.append(f"{k}: " + ", ".join(f"process{'es' if len(ps) > 1 else ''} {','.join(map(str, ps))} {v}"
                                          for v, ps in seen.items()))
    return bad, lines


def agree_on_items(what: str, items: Mapping[str, Any], *, timeout_s: float = 300.0, fix: str = "") -> None:
    """Every process calls this with its own `items` (dotted key -> JSON-ready value) before anything
    compiles; raises `ProcessMismatch` on every process, naming the differing keys and processes, if
    any process's differ from process 0's. Only a digest per key and a short form of its value travel.
    One process: nothing to compare."""
    n, me = _joined()
    if n == 1:
        return
    mine = {k: {"d": _sha(json.dumps(v, sort_keys=True, default=str)), "v": _short(v)} for k, v in items.items()}
    tables = _exchange(f"zerojax/agree/{next(_ROUNDS)}/{what}", mine, n, me, timeout_s, what,
                       "reach the start-up check")
    bad, lines = item_differences(tables)
    if not bad:
        return
    shown = "\n  ".join(lines[:12] + ([f"... and {len(lines) - 12} more"] if len(lines) > 12 else []))
    raise ProcessMismatch(f"{what}: process(es) {bad} hold a different config or plan than process 0; refused "
                          f"before anything ran (their collectives would not match). Differing keys:\n  {shown}"
                          + (f"\n{fix}" if fix else ""))


def plan_items(plan: Any) -> dict[str, Any]:
    """A plan as dotted keys: the mesh, the batch and per parameter its shape, dtype and layout - what
    decides which collectives the programs run, besides the config the plan came from."""
    import jax.tree_util as tu
    items: dict[str, Any] = {"plan.mesh": {str(k): int(v) for k, v in plan.mesh.shape.items()},
                             "plan.stage": plan.stage, "plan.batch": repr(plan.batch), "plan.hpz": plan.hpz,
                             "plan.memory": repr(plan.memory), "plan.step": repr(plan.step)}
    for (path, x), layout in zip(tu.tree_leaves_with_path(plan.abstract_params), tu.tree_leaves(
            plan.layouts, is_leaf=lambda v: type(v).__name__ == "LeafLayout")):
        items[f"plan.params{tu.keystr(path)}"] = [list(x.shape), str(x.dtype), repr(layout)]
    return items


def agree_on_program(name: str, lowered_text: str, compiled_text: str, *, config: Mapping[str, Any] | None = None,
                     timeout_s: float = 300.0) -> None:
    """Every process calls this with its own program before running it; raises `ProgramMismatch` on
    every process if any differs, or `ConfigError` if a process does not arrive within `timeout_s`.
    One process: nothing to compare."""
    n, me = _joined()
    if n == 1:
        return
    key = f"zerojax/program/{next(_ROUNDS)}/{name}"
    mine = program_digest(lowered_text, compiled_text, config)
    digests = _exchange(key, mine, n, me, timeout_s, name, f"compile its {name}")
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
