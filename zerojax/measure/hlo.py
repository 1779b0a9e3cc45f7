"""Collective traffic per device, read from HLO text (the comms logger and the benchmarks use it).

`collectives(hlo_text)` finds every all-reduce / reduce-scatter / all-gather / all-to-all /
collective-permute (and their async `-start` forms; `-done` moves nothing new), works out how many
times each one runs per execution (ops inside a `while` body run trip-count times, nested loops
multiply), and counts the bytes each device sends the way the ZeRO paper counts volume, for a
group of N devices:

    all-reduce of S bytes            2 S (N-1)/N   (reduce-scatter + all-gather)
    reduce-scatter, S_in = N S_out   S_in (N-1)/N
    all-gather,     S_out            S_out (N-1)/N
    all-to-all of S bytes            S (N-1)/N
    collective-permute of S bytes    S

Trip counts come from the `known_trip_count` XLA attaches to optimized while loops, or, in HLO
from before optimization, from the loop condition `counter < constant` (the form `lax.scan` and
`fori_loop` lower to). A loop whose count cannot be found is an error, not a silent guess.

Relies on: nothing but HLO text (no mesh, no plan, no JAX import): a replica group is read as written,
and a mesh passed in names the axes it spans (`mesh_axes`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections import defaultdict
from typing import Any, Iterable

import numpy as np

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1,
    "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "s1": 0.125, "u1": 0.125,
}
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_SHAPE = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(")
_COLLECTIVE = re.compile(r"=\s*(?P<type>.+?)\s(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE = re.compile(r"\swhile\(")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:\s*\{([^}]*)\})?")
_DEVICE_IDS = re.compile(r"device_ids=\(\[([0-9,]*)\](?:T\(([0-9,]*)\))?\)")
_GROUPS_EMPTY = re.compile(r"replica_groups=\{\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_NUM_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_CONST = re.compile(r"%([\w.\-]+)\s*=\s*s(?:32|64)\[\]\s*constant\((-?\d+)\)")
_COMPARE = re.compile(r"compare\(%([\w.\-]+),\s*%([\w.\-]+)\),\s*direction=(LT|LE|GT|GE)")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str            # one of KINDS
    computation: str     # HLO computation it sits in
    dtypes: tuple        # element types of its result
    result_bytes: float  # bytes of the (per-device) result, all tuple elements
    result_elems: int
    group: int           # devices per replica group (N)
    count: int           # executions per run of the module (trip counts multiplied)
    line: str
    groups: tuple = ()   # replica groups: tuples of device (partition) ids that run it together
    pairs: tuple = ()    # collective-permute: its (source, target) device pairs

    def crosses(self, groups: Iterable[Iterable[int]]) -> bool:
        """Some replica group holds devices from more than one of `groups` (e.g. hosts)."""
        where = {d: i for i, g in enumerate(groups) for d in g}
        return any(len({where.get(d, -1 - d) for d in g}) > 1 for g in self.groups)

    @property
    def bytes_per_device(self) -> float:
        """Bytes one device sends per run, ZeRO-paper accounting (see module doc)."""
        return self.count * _volume(self.kind, self.result_bytes, self.group)

    @property
    def elems_per_device(self) -> float:
        return self.count * _volume(self.kind, self.result_elems, self.group)


def _volume(kind: str, size: float, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * size * (n - 1) / n
    if kind == "reduce-scatter":
        return size * n * (n - 1) / n  # input is N times the result
    if kind in ("all-gather", "all-to-all"):
        return size * (n - 1) / n
    return size  # collective-permute


def _shapes(type_str: str) -> list[tuple[str, int]]:
    out = []
    for dtype, dims in _SHAPE.findall(type_str):
        out.append((dtype, math.prod(int(d) for d in dims.split(",") if d) if dims else 1))
    return out


def _group_size(line: str, num_partitions: int) -> int:
    m = _GROUPS_LIST.search(line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(2))
    m = _GROUPS_MESH.search(line)
    if m:
        sizes = {k.strip().strip("'"): int(v) for k, v in
                 (item.split("=") for item in m.group(1).split(",") if "=" in item)}
        axes = [a.strip().strip("'") for a in (m.group(2) or "").split(",") if a.strip()] or list(sizes)
        return math.prod(sizes[a] for a in axes)
    if _GROUPS_EMPTY.search(line) or "replica_groups" not in line:
        return num_partitions
    raise ValueError(f"cannot read replica groups of: {line[:200]}")


_GROUPS_IOTA_FULL = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?")


def replica_groups(line: str, num_partitions: int) -> tuple:
    """The replica groups of one collective's HLO line, as tuples of device ids (every form XLA
    prints: explicit lists, iota `[G,S]<=[dims]T(perm)`, `mesh[...]{axes}`, or none: all devices)."""
    import numpy as np
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", line)
    if m and m.group(1):
        return tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    m = _GROUPS_IOTA_FULL.search(line)
    if m:
        dims = [int(d) for d in m.group(3).split(",") if d]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",") if p])
        return tuple(tuple(int(x) for x in row) for row in ids.reshape(int(m.group(1)), int(m.group(2))))
    m = _GROUPS_MESH.search(line)
    if m:
        items = [item.split("=") for item in m.group(1).split(",") if "=" in item]
        names = [k.strip().strip("'") for k, _ in items]
        sizes = [int(v) for _, v in items]
        axes = ([names.index(a.strip().strip("'")) for a in (m.group(2) or "").split(",") if a.strip()]
                or list(range(len(sizes))))
        ids = np.arange(math.prod(sizes))
        d = _DEVICE_IDS.search(line)
        if d:  # mesh position -> device id, an iota like the replica groups'
            dims = [int(x) for x in d.group(1).split(",") if x]
            order = np.arange(math.prod(dims)).reshape(dims)
            ids = (order.transpose([int(x) for x in d.group(2).split(",") if x]) if d.group(2) else order).reshape(-1)
        ids = ids.reshape(sizes)
        rest = [i for i in range(len(sizes)) if i not in axes]
        ids = ids.transpose(rest + axes).reshape(-1, math.prod(sizes[a] for a in axes) if axes else 1)
        return tuple(tuple(int(x) for x in row) for row in ids)
    return (tuple(range(num_partitions)),)


def _split_computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = _COMP_HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
                continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _trip_count(line: str, comps: dict[str, list[str]], unknown: int | None = None) -> int:
    m = _TRIP.search(line)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%([\w.\-]+)", line).group(1)
    body = "\n".join(comps[cond])
    consts = {name: int(v) for name, v in _CONST.findall(body)}
    root = [l for l in comps[cond] if l.lstrip().startswith("ROOT")]
    cmp = _COMPARE.search(root[0]) if root else None
    if cmp and cmp.group(3) == "LT" and cmp.group(2) in consts:
        return consts[cmp.group(2)]  # counter from 0 (lax.scan / fori_loop(0, n))
    if unknown is not None:  # a loop bounded by a runtime value: the caller says how often it runs
        return unknown
    raise ValueError(f"cannot find the trip count of while loop: {line[:200]}")


def _executions(comps: dict[str, list[str]], entry: str,
                unknown_trips: int | None = None) -> tuple[dict[str, int], set[str]]:
    """Executions of every computation per run of the module (while bodies trip-count times,
    nested loops multiplied), and the computations that run inside one kernel (fusion bodies,
    reducers: called through `calls=` of a fusion or `to_apply=`)."""
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    inner: set[str] = set()
    for name, lines in comps.items():
        for line in lines:
            factor = _trip_count(line, comps, unknown_trips) if _WHILE.search(line) else 1
            for role, callee in _CALLEE.findall(line):
                edges[name].append((callee, factor if role in ("body", "condition") else 1))
                if role == "to_apply" or (role == "calls" and " fusion(" in line):
                    inner.add(callee)
            for group in _BRANCHES.findall(line):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    edges[name].append((callee, 1))  # every branch counted: an upper bound
    # Executions per computation: propagate from ENTRY in topological order.
    order, seen = [], set()

    def visit(c: str) -> None:
        if c in seen:
            return
        seen.add(c)
        for callee, _ in edges.get(c, ()):
            visit(callee)
        order.append(c)

    visit(entry)
    runs: dict[str, int] = defaultdict(int)
    runs[entry] = 1
    for c in reversed(order):
        for callee, factor in edges.get(c, ()):
            runs[callee] += runs[c] * factor
    return runs, inner


def collectives(text: str, unknown_trips: int | None = None) -> list[Collective]:
    """Every collective in an HLO module's text, with its executions per run of the module. A loop
    whose trip count is a runtime value (a decode loop that stops at a traced count) is counted
    `unknown_trips` times; None: such a loop is an error."""
    comps, entry = _split_computations(text)
    m = _NUM_PARTITIONS.search(text)
    num_partitions = int(m.group(1)) if m else 1
    runs, _ = _executions(comps, entry, unknown_trips)
    found = []
    for name, lines in comps.items():
        if not runs.get(name):
            continue
        for line in lines:
            m = _COLLECTIVE.search(line)
            if not m:
                continue
            shapes = _shapes(m.group("type"))
            if m.group("start") and m.group("op") in ("all-gather", "collective-permute"):
                # async start returns (operands..., results..., [contexts]): keep the results
                arrays = [s for s in shapes]
                shapes = arrays[len(arrays) // 2:] if m.group("op") == "all-gather" else arrays[1:2]
            found.append(Collective(
                kind=m.group("op"), computation=name, dtypes=tuple(sorted({d for d, _ in shapes})),
                result_bytes=sum(DTYPE_BYTES[d] * n for d, n in shapes),
                result_elems=sum(n for _, n in shapes),
                group=_group_size(line, num_partitions), count=runs[name], line=line.strip(),
                groups=replica_groups(line, num_partitions), pairs=source_target_pairs(line)))
    return found


def source_target_pairs(line: str) -> tuple:
    """A collective-permute's (source, target) device pairs; () for any other line."""
    m = _PAIRS.search(line)
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))) if m else ()


def summarize(found: Iterable[Collective]) -> dict:
    """Totals per kind and per dtype (bytes per device per run)."""
    found = list(found)
    by_kind: dict[str, float] = defaultdict(float)
    by_dtype: dict[str, float] = defaultdict(float)
    for c in found:
        by_kind[c.kind] += c.bytes_per_device
        for d in c.dtypes:
            by_dtype[d] += c.bytes_per_device / len(c.dtypes)
    return {"bytes": sum(c.bytes_per_device for c in found),
            "elems": sum(c.elems_per_device for c in found),
            "by_kind": dict(by_kind), "by_dtype": dict(by_dtype),
            "ops": sum(c.count for c in found)}


def _size(b: float) -> str:
    """Exact bytes, and the same in a readable unit."""
    unit = next((u for u, f in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)) if b >= f), None)
    readable = f" ({b / dict(GiB=2 ** 30, MiB=2 ** 20, KiB=2 ** 10)[unit]:.1f} {unit})" if unit else ""
    return f"{round(b):,} B{readable}"


def mesh_axes(groups: tuple, mesh: Any) -> str:
    """The mesh axes a collective's replica groups span (e.g. "tensor", "data", "stage+data"), or "?".

    A compiled program numbers its devices in the mesh's flat order, so a group over axes A holds the
    flat indices that differ only along A.
    """
    names, shape = tuple(mesh.axis_names), tuple(int(mesh.shape[a]) for a in mesh.axis_names)
    index = np.arange(math.prod(shape)).reshape(shape)
    want = {tuple(sorted(g)) for g in groups}
    for r in range(1, len(names) + 1):
        for axes in itertools.combinations(range(len(names)), r):
            rest = [d for d in range(len(names)) if d not in axes]
            moved = np.moveaxis(index, rest, list(range(len(rest)))).reshape(-1, math.prod(shape[d] for d in axes))
            if {tuple(sorted(row)) for row in moved.tolist()} == want:
                return "+".join(names[d] for d in axes)
    return "?"


def permute_axes(pairs: tuple, mesh: Any) -> str:
    """The mesh axes a collective-permute's pairs cross: those along which some source and its target
    differ (e.g. "stage" for a pipeline's ring); "" for pairs that stay on their device."""
    names, shape = tuple(mesh.axis_names), tuple(int(mesh.shape[a]) for a in mesh.axis_names)
    crossed: set[int] = set()
    for source, target in pairs:
        a, b = np.unravel_index(source, shape), np.unravel_index(target, shape)
        crossed |= {d for d in range(len(names)) if a[d] != b[d]}
    return "+".join(names[d] for d in sorted(crossed))


def collective_axes(c: Collective, mesh: Any) -> str:
    """The mesh axes a collective runs over: a permute's the axes its pairs cross, any other's the
    axes its replica groups span (`mesh_axes`)."""
    if c.kind == "collective-permute" and c.pairs:
        return permute_axes(c.pairs, mesh) or "none"
    return mesh_axes(c.groups, mesh)


def comms_report(text: str, *, steps: int = 1, kinds: Iterable[str] | None = None, verbose: bool = False,
                 debug: bool = False, mesh: Any = None) -> str:
    """DeepSpeed's comms-logger summary for a compiled step's HLO: per collective kind (and dtype,
    and - given the `mesh` - the mesh axes it runs over), how many run and the bytes each device
    sends, per step and over `steps` steps.

    The collectives run inside one compiled program, so there is no per-op latency or bandwidth
    to report (DeepSpeed's columns); a profiler trace (jax.profiler) has those. `kinds`: only these
    HLO kinds (prof_ops); `verbose`: one line per collective; `debug`: with its HLO computation.
    """
    found = [c for c in collectives(text) if kinds is None or c.kind in set(kinds)]
    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    axes = {id(c): collective_axes(c, mesh) for c in found} if mesh is not None else {}
    for c in found:
        kind = f"{c.kind} ({axes[id(c)]})" if axes else c.kind
        row = rows[(kind, "/".join(c.dtypes))]
        row[0] += c.count
        row[1] += c.bytes_per_device
        row[2] += c.count * c.result_bytes
    head = (f"comms logger: collectives of the compiled train step, per device "
            f"({'per step' if steps == 1 else f'{steps} steps'}; bytes sent counted as in the ZeRO paper)")
    width = max([20] + [len(k) + 2 for k, _ in rows])
    lines = [head, f"  {'op':<{width}}{'dtype':<10}{'count':>8}  {'bytes sent':<28}message bytes"]
    for (kind, dtype), (count, sent, message) in sorted(rows.items()):
        lines.append(f"  {kind:<{width}}{dtype:<10}{int(count * steps):>8}  {_size(sent * steps):<28}"
                     f"{_size(message * steps)}")
    total = summarize(found)
    lines.append(f"  {'total':<{width + 10}}{int(total['ops'] * steps):>8}  {_size(total['bytes'] * steps)}")
    if verbose:
        for c in found:
            where = f" in {c.computation}" if debug else ""
            over = f" over {axes[id(c)]}" if axes else ""
            lines.append(f"  - {c.kind}{over} {'/'.join(c.dtypes)} {_size(c.result_bytes)} result, group {c.group}, "
                         f"{c.count}x per step{where}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Work per run: matmul FLOPs and memory traffic, loops counted trip-count times.

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s([a-z][\w\-]*)\(([^)]*)\)(.*)$")
_LHS_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
               "after-all", "partition-id", "replica-id", "iota", "opt-barrier"}


@dataclasses.dataclass(frozen=True)
class Work:
    """Per-device work of one run of a module.

    flops: 2 x multiply-adds of every dot (and cuBLAS gemm custom call), loops trip-count times;
           elementwise work is not counted (matmuls dominate a transformer step).
    bytes: operands read + results written by every kernel-level instruction (a fusion counts its
           own operands and result, not its body's), loops trip-count times: HBM traffic when no
           operand stays in cache.
    """
    flops: float
    bytes: float
    dots: int


def _dims(type_str: str) -> list[int]:
    m = _SHAPE.search(type_str)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _type_bytes(type_str: str) -> float:
    return sum(DTYPE_BYTES[d] * n for d, n in _shapes(type_str))


def _instructions(text: str) -> Iterable[tuple[int, bool, re.Match, list[str]]]:
    """(runs per execution, in a fusion body, the instruction, its operands' types) for every
    instruction of every computation that runs, loops counted trip-count times."""
    comps, entry = _split_computations(text)
    runs, inner = _executions(comps, entry)
    for name, lines in comps.items():
        n = runs.get(name, 0)
        if not n:
            continue
        types: dict[str, str] = {}
        parsed = []
        for line in lines:
            m = _INSTR.match(line)
            if m:
                types[m.group(1)] = m.group(2)
                parsed.append(m)
        for m in parsed:
            yield n, name in inner, m, [types.get(a, "") for a in re.findall(r"%([\w.\-]+)", m.group(4))]


def _matmul_flops(m: re.Match, operands: list[str]) -> float | None:
    """2 x multiply-adds of a dot (or a cuBLAS gemm custom call); None for any other instruction."""
    result, op, rest = m.group(2), m.group(3), m.group(5)
    if op == "dot":
        c = _LHS_CONTRACT.search(rest)
        contract = [int(x) for x in c.group(1).split(",") if x] if c else []
    elif op == "custom-call" and re.search(r'custom_call_target="__cublas\$(lt\$matmul|gemm)', rest):
        c = _GEMM_CONTRACT.search(rest)
        contract = [int(x.strip().strip('"')) for x in c.group(1).split(",") if x.strip()] if c else []
        result = result.split(",")[0]  # (out, workspace)
    else:
        return None
    if not operands or not operands[0]:
        return None
    lhs = _dims(operands[0])
    return 2.0 * math.prod(_dims(result)) * math.prod(lhs[d] for d in contract if d < len(lhs))


def work(text: str) -> Work:
    """FLOPs and memory bytes per run of an HLO module (compiled text, one device's program).

    XLA's `cost_analysis()` counts a while body once whatever its trip count, so a scanned layer
    stack reads as one layer; this walks the same call graph as `collectives` instead.
    """
    flops = nbytes = 0.0
    dots = 0
    for n, fused, m, operands in _instructions(text):
        f = _matmul_flops(m, operands)
        if f is not None:
            flops += n * f
            dots += 1
        op = m.group(3)
        if not fused and op not in _NO_TRAFFIC and not op.endswith("-done"):
            nbytes += n * (_type_bytes(m.group(2)) + sum(_type_bytes(t) for t in operands))
    return Work(flops, nbytes, dots)


# ---------------------------------------------------------------------------------------------
# Where the matmuls come from: the Python call stack XLA keeps with every instruction.

@dataclasses.dataclass(frozen=True)
class Frame:
    """One Python frame of an instruction's call stack (the module's StackFrames table)."""
    file: str
    function: str
    line: int
    column: int = 0
    end_line: int = 0
    end_column: int = 0


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One dot of a module: FLOPs per execution (runs counted), whether it is the backward pass
    (a transpose of the forward), and the Python call stack that made it, outermost first."""
    flops: float
    backward: bool
    stack: tuple[Frame, ...]


_TABLE = re.compile(r"^(\d+)\s+(.*)$")
_FIELDS = re.compile(r"(\w+)=(-?\d+)")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _tables(text: str) -> dict[str, dict[int, str]]:
    """The module's FileNames / FunctionNames / FileLocations / StackFrames tables (id -> text)."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None:
            m = _TABLE.match(line)
            if m is None:
                current = None
            else:
                current[int(m.group(1))] = m.group(2).strip().strip('"')
    return tables


def stack_frames(text: str) -> dict[int, tuple[Frame, ...]]:
    """Every stack frame id of a module as its call stack, outermost first. A frame's parent is the
    entry before `parent_frame_id` (0: none), as XLA prints the table."""
    t = _tables(text)
    files, functions = t.get("FileNames", {}), t.get("FunctionNames", {})
    locations = {}
    for i, body in t.get("FileLocations", {}).items():
        f = {k: int(v) for k, v in _FIELDS.findall(body)}
        locations[i] = Frame(files.get(f.get("file_name_id", 0), "?"), functions.get(f.get("function_name_id", 0), "?"),
                             f.get("line", 0), f.get("column", 0), f.get("end_line", 0), f.get("end_column", 0))
    links = {i: {k: int(v) for k, v in _FIELDS.findall(body)} for i, body in t.get("StackFrames", {}).items()}
    chains: dict[int, tuple[Frame, ...]] = {}

    def chain(i: int) -> tuple[Frame, ...]:
        if i not in chains:
            link = links.get(i)
            if link is None:
                return ()
            parent = link.get("parent_frame_id", 0) - 1
            here = (locations[link["file_location_id"]],) if link.get("file_location_id") in locations else ()
            chains[i] = (chain(parent) if 0 < parent < i else ()) + here
        return chains[i]
    for i in sorted(links):
        chain(i)
    return chains


def matmuls(text: str) -> list[Matmul]:
    """Every dot of a compiled module with its FLOPs per execution and the call stack that made it
    (empty where XLA kept none): what a per-module FLOPs profile groups."""
    frames = stack_frames(text)
    out = []
    for n, _, m, operands in _instructions(text):
        f = _matmul_flops(m, operands)
        if f is None:
            continue
        rest = m.group(5)
        frame = _FRAME_ID.search(rest)
        name = _OP_NAME.search(rest)
        out.append(Matmul(n * f, bool(name and "transpose(" in name.group(1)),
                          frames.get(int(frame.group(1)), ()) if frame else ()))
    return out


# ---------------------------------------------------------------------------------------------
# Where a compiled module's arguments and outputs live: the entry computation layout.

_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](?:\{([^}]*)\})?")
# Memory spaces of host memory in compiled layouts: S(5) is XLA's kHostMemorySpace (pinned_host);
# the CPU client prints unpinned_host as S(6).
HOST_MEMORY_SPACES = ("S(5)", "S(6)")


def _layout_bytes(text: str) -> tuple[int, int]:
    """(device bytes, host bytes) of the arrays in one side of an entry computation layout."""
    device = host = 0
    for dtype, dims, layout in _ARRAY.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        size = math.ceil(math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype])
        if layout and any(space in layout for space in HOST_MEMORY_SPACES):
            host += size
        else:
            device += size
    return device, host


def entry_layout_bytes(hlo: str) -> tuple[int, int, int, int]:
    """(device args, host args, device outputs, host outputs) from `entry_computation_layout`."""
    start = hlo.find("entry_computation_layout={")
    if start < 0:
        raise ValueError("no entry_computation_layout in the HLO text")
    i = start + len("entry_computation_layout={")
    depth = 1
    j = i
    while depth:
        depth += {"{": 1, "}": -1}.get(hlo[j], 0)
        j += 1
    args, _, outs = hlo[i:j - 1].partition(")->")
    return (*_layout_bytes(args), *_layout_bytes(outs))
