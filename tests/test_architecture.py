"""The package's layers, read from its source: imports flow one way, the config has one door, and
the user's loss is rewritten in one folder (`zerojax.rewrite`), the only one that reads JAX's internals.

Every import counts, at the top of a module or inside a function (a lazy import still ties two
modules together); imports under `if TYPE_CHECKING:` are annotations only and do not.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zerojax"

# Module prefix -> layer; the longest prefix wins. A module may import its own layer and the ones
# below it, never one above. `zerojax` itself (the public facade) may import anything.
LAYERS = {
    "zerojax.errors": 0,
    "zerojax.config": 1,
    "zerojax.core": 2, "zerojax.rewrite": 2, "zerojax.measure": 2, "zerojax.pallas": 2, "zerojax.pipeline": 2, "zerojax.optim.transforms": 2,
    "zerojax.planner": 3, "zerojax.optim": 3,
    "zerojax.checkpoint": 4, "zerojax.runtime": 4, "zerojax.models": 4,
    "zerojax.engine": 5,
    "zerojax.tools": 6,
    "zerojax.app": 7, "zerojax.cli": 7,
}
# Layer 2 holds the rewriters beside the core they build on; the core never calls them (the planner
# API, the engine and the pipeline hand the step a loss `zerojax.rewrite.prepare_loss` made).
REWRITE = "zerojax.rewrite"
# JAX's internals: a jaxpr's equations and primitives, and everything under jax._src. Only the
# rewriters read them; elsewhere only these named uses, each with no public counterpart.
JAX_INTERNALS = ("jax._src", "jax.core", "jax.extend", "jax.interpreters")
INTERNALS_ELSEWHERE = {
    # the coordination service's client that jax.distributed.initialize made (no public accessor)
    "zerojax.runtime.agreement": ("jax._src.distributed",),
    # the kernels' Triton IR out of their lowering, compiled to PTX without a GPU
    "zerojax.pallas.ptx": ("jax._src.interpreters.mlir", "jax._src.lib"),
}
# Below the door: these read plans, never the DeepSpeed config.
BELOW_THE_DOOR = ("zerojax.core", "zerojax.pallas", "zerojax.pipeline", "zerojax.checkpoint", "zerojax.optim.transforms")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(name: str) -> set[str]:
    """The package's modules `name` imports (a `from pkg import sub` names the submodule)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES else base)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def layer(name: str) -> int | None:
    keys = [k for k in LAYERS if name == k or name.startswith(k + ".")]
    return LAYERS[max(keys, key=len)] if keys else None


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if m != "zerojax" and layer(m) is None] == []


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
              for m, targets in GRAPH.items() if m != "zerojax"
              for t in sorted(targets) if t != "zerojax" and layer(t) > layer(m)]
    assert upward == []


def test_the_import_graph_has_no_cycle() -> None:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert cycles == []


def test_the_config_package_imports_nothing_above_it() -> None:
    assert {m: sorted(t for t in GRAPH[m] if layer(t) > 1) for m in GRAPH
            if layer(m) == 1 and any(layer(t) > 1 for t in GRAPH[m])} == {}


@pytest.mark.parametrize("prefix", BELOW_THE_DOOR)
def test_below_the_door_nothing_reads_the_config(prefix: str) -> None:
    """The step, state, kernels, pipeline executor and checkpoints take a Plan: no module there imports
    `zerojax.config` (outside annotations) or reads a `.config` attribute."""
    offenders = []
    for name, path in MODULES.items():
        if not (name == prefix or name.startswith(prefix + ".")):
            continue
        offenders += [f"{name} imports {t}" for t in GRAPH[name] if t.startswith("zerojax.config")]
        offenders += [f"{name}:{node.lineno} reads {ast.unparse(node)}" for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.Attribute) and node.attr == "config"
                      and ast.unparse(node.value) != "jax"]
    assert offenders == []


def test_the_layer_test_sees_imports() -> None:
    """The graph is read, not empty: the step imports the layouts, the engine the planner."""
    assert "zerojax.core.layout" in GRAPH["zerojax.core.step"]
    assert "zerojax.planner.plan" in GRAPH["zerojax.engine.engine"]
    assert layer("zerojax.optim.transforms") < layer("zerojax.optim.deepspeed")


def _in(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_core_imports_nothing_from_the_rewriters() -> None:
    assert {m: sorted(t for t in GRAPH[m] if _in(t, REWRITE)) for m in GRAPH
            if _in(m, "zerojax.core") and any(_in(t, REWRITE) for t in GRAPH[m])} == {}


def jax_internals(source: str) -> list[str]:
    """The JAX internals a module's source imports or reads (`jax.core.Tracer`), type annotations too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "jax":
            found.append(f"jax.{node.attr}")
    return sorted({n for n in found if any(_in(n, p) for p in JAX_INTERNALS)})


def test_only_the_rewriters_touch_jax_internals() -> None:
    offenders = {}
    for name, path in MODULES.items():
        if _in(name, REWRITE):
            continue
        allowed = INTERNALS_ELSEWHERE.get(name, ())
        used = [n for n in jax_internals(path.read_text()) if not any(_in(n, a) for a in allowed)]
        if used:
            offenders[name] = used
    assert offenders == {}


def test_the_internals_rule_sees_every_form() -> None:
    """An import, a from-import, a `from jax import core` and an attribute read all count; public
    `jax.extend`-free code does not."""
    assert jax_internals("from jax.extend import core as jcore") == ["jax.extend.core"]
    assert jax_internals("import jax._src.core") == ["jax._src.core"]
    assert jax_internals("from jax import core, numpy") == ["jax.core"]
    assert jax_internals("import jax\nx = isinstance(1, jax.core.Tracer)") == ["jax.core"]
    assert jax_internals("import jax\nfrom jax.ad_checkpoint import Recompute\njax.numpy.add") == []
    assert "jax.extend.core" in jax_internals(MODULES["zerojax.rewrite.jaxpr_eval"].read_text())


def test_the_kernels_know_no_plan() -> None:
    """pallas/ holds kernels only: it imports nothing of the package but itself and the errors (the
    ZeRO update that drives them over a plan is core/fused_update.py)."""
    assert {m: sorted(t for t in GRAPH[m] if not (_in(t, "zerojax.pallas") or t == "zerojax.errors"))
            for m in GRAPH if _in(m, "zerojax.pallas")
            and any(not (_in(t, "zerojax.pallas") or t == "zerojax.errors") for t in GRAPH[m])} == {}


def test_the_optimizer_blocks_read_no_names() -> None:
    """optim/transforms.py takes per-leaf trees or callables (optax's mask convention): it imports
    nothing of the package but the errors, so the kernels and the core may build on it."""
    assert sorted(t for t in GRAPH["zerojax.optim.transforms"] if t != "zerojax.errors") == []


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def private_imports(name: str, source: str) -> list[str]:
    """`from zerojax.x import _y`, or `x._y` on a module `x` imported from the package, in module `name`:
    a private name of another module, which that module may rename or drop without a caller knowing; a
    name another module calls is public."""
    tree = ast.parse(source)
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerojax") and node.module != name:
            found += [f"{name}:{node.lineno} imports {a.name} from {node.module}" for a in node.names if _private(a.name)]
            modules.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                            if f"{node.module}.{a.name}" in MODULES})
        elif isinstance(node, ast.Import):
            modules.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr)
                and modules.get(node.value.id, name) != name):
            found.append(f"{name}:{node.lineno} reads {node.attr} of {modules[node.value.id]}")
    return found


def test_no_module_imports_another_modules_private_name() -> None:
    assert [hit for name, path in MODULES.items() for hit in private_imports(name, path.read_text())] == []


def test_the_private_import_rule_sees_one() -> None:
    assert private_imports("zerojax.models.generate", "from zerojax.core.step import _wrap_params\n") == [
        "zerojax.models.generate:1 imports _wrap_params from zerojax.core.step"]
    assert private_imports("zerojax.models.decode", "from zerojax.models import llama\nllama._eps(cfg)\n") == [
        "zerojax.models.decode:2 reads _eps of zerojax.models.llama"]
    assert private_imports("zerojax.core.step", "from zerojax.core.step import _x\nfrom zerojax.core import mesh\n"
                                                "mesh.row_axes(m)\nself._plan\n") == []
