"""Every command line of README.md runs as written after the README's own install: each subcommand it
names exists, and what those commands import is installed by the lines the README gives (the base
dependencies plus the extras its install lines name), not only by the test extra."""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[list[str]]:
    """The README's shell commands (```bash blocks), each `&&` part split into words, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    commands = []
    for line in "\n".join(blocks).splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words:
                commands.append(words)
    return commands


def zerojax_command(words: list[str]) -> list[str] | None:
    """The argument list `zerojax.cli.main` gets for a README command (train.py: `train ...`), else None."""
    for i, w in enumerate(words):
        if w == "zerojax" or w.endswith("/zerojax"):
            return words[i + 1:]
        if w == "-m" and words[i + 1:i + 2] == ["zerojax.cli"]:
            return words[i + 2:]
        if w == "train.py":
            return ["train", *words[i + 1:]]
    return None


def readme_install() -> set[str]:
    """The distributions a user has after the README's install lines: the base dependencies and the
    extras those lines name (the `test` extra's line installs the suite's tools, not a user's)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {e for words in readme_commands() if "install" in words
              for w in words for group in re.findall(r"\[([\w,-]+)\]", w) for e in group.split(",")} - {"test"}
    unknown = extras - set(project["optional-dependencies"])
    assert not unknown, f"README installs extras pyproject.toml does not define: {unknown}"
    wanted = list(project["dependencies"]) + [d for e in extras for d in project["optional-dependencies"][e]]
    return {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower() for d in wanted}


def blocked_modules() -> list[str]:
    """Top-level modules of the optional dependencies the README's install does not bring."""
    import importlib.metadata
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower()
                for deps in project["optional-dependencies"].values() for d in deps}
    missing = optional - readme_install()
    return sorted(mod for mod, dists in importlib.metadata.packages_distributions().items()
                  if any(d.lower() in missing for d in dists))


# Run zerojax's command line with the optional dependencies the README's install lacks made unimportable.
_AS_INSTALLED = """
import sys, importlib.abc
BLOCKED = set({blocked!r})
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not installed by the README)")
sys.meta_path.insert(0, Block())
{body}
"""


def run_as_installed(body: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    code = _AS_INSTALLED.format(blocked=blocked_modules(), body=body)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_every_subcommand_the_readme_names_exists() -> None:
    from zerojax.app.cli import _parser
    parser = _parser()
    names = set(next(a for a in parser._subparsers._group_actions).choices)
    named = [args[0] for words in readme_commands() if (args := zerojax_command(words))]
    assert {"train", "plot", "sample", "config", "launch"} <= set(named)
    assert set(named) <= names, f"README names subcommands the CLI lacks: {set(named) - names}"


def _handler_imports(command: str) -> list[str]:
    """The modules `zerojax <command>`'s handler in app/cli.py imports when it runs."""
    tree = ast.parse((ROOT / "zerojax" / "app" / "cli.py").read_text())
    name = "_" + command.replace("-", "_")
    name = "_explain" if command == "config" else name
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return sorted({n.module for n in ast.walk(fn) if isinstance(n, ast.ImportFrom) and n.module}
                  | {a.name for n in ast.walk(fn) if isinstance(n, ast.Import) for a in n.names})


def test_readme_commands_run_after_the_readme_install(tmp_path: Path) -> None:
    """`zerojax plot runs/zero3 runs/zero3-2 -o runs.png` as written (on two small runs' metrics) and
    `config explain` as written exit 0, and every named subcommand's imports load, with the optional
    packages the README's install lines do not bring made unimportable."""
    commands = [args for words in readme_commands() if (args := zerojax_command(words))]
    runs = tmp_path / "cwd"
    for args in commands:
        if args[0] == "plot":  # the runs it names, each with a few metrics rows
            for folder in [a for a in args[1:] if not a.startswith("-") and not a.endswith(".png")]:
                (runs / folder).mkdir(parents=True, exist_ok=True)
                rows = [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0,
                         "skipped": False, "tokens_per_s": 1000.0} for s in (1, 2, 3)]
                (runs / folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            proc = run_as_installed(f"from zerojax.app.cli import main; sys.exit(main({args!r}))", runs)
            assert proc.returncode == 0, f"README line `zerojax {shlex.join(args)}`: {proc.stderr[-2000:]}"
            out = args[args.index("-o") + 1] if "-o" in args else "zerojax-runs.png"
            assert (runs / out).stat().st_size > 0
        elif args[:2] == ["config", "explain"]:
            proc = run_as_installed(f"from zerojax.app.cli import main; sys.exit(main({args!r}))", ROOT)
            assert proc.returncode == 0, f"README line `zerojax {shlex.join(args)}`: {proc.stderr[-2000:]}"
    # the rest (a training run, a checkpoint to sample) are too long to run here: what they import loads
    modules = sorted({m for command in {args[0] for args in commands} - {"launch"} for m in _handler_imports(command)}
                     | {"zerojax.runtime.launch"})
    proc = run_as_installed("import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules),
                            ROOT)
    assert proc.returncode == 0, f"the README's subcommands import {modules}: {proc.stderr[-2000:]}"


@pytest.mark.parametrize("key, module", [("data.tokenizer=", "tokenizers"), ("tensorboard.enabled=true", "tensorboardX")])
def test_a_readme_line_setting_an_optional_feature_has_its_package_installed(key: str, module: str) -> None:
    """A README command that turns on a feature whose package is an extra: the README installs it."""
    uses = [w for words in readme_commands() for w in words if w.startswith(key)]
    if uses:
        assert module not in blocked_modules(), (f"README sets {uses[0]} but its install lines do not bring "
                                                 f"{module}")
