"""Start-up: time to the first step of `train.py`, cold and warm, against a hand-written jit + optax run.

    python -m benchmarks.startup          (or: python benchmarks/startup.py)

Three processes per round, side by side so that load from elsewhere on the machine hits them alike,
each timed from its launch (Python and imports included) to the end of its first train step
(`block_until_ready` on the new state), and by the CPU time it used until then:

* `baseline`: a hand-written data-parallel step of the same GPT (`zerojax.models.gpt`: same config,
  batch and sequence length as `--config`): parameters replicated, rows split over the 8 devices,
  `jax.value_and_grad` + `optax` (clip by global norm, AdamW) in one `jax.jit`, parameters
  initialized by one jitted program; no persistent compilation cache, as such a script runs.
* `zerojax cold`: `train.py --config configs/zero3.yaml --set run.steps=1` with `run.compile_cache` a
  fresh, empty folder (every program compiled).
* `zerojax warm`: the same command again on that folder (what a resume or a second run with the same
  shapes finds).

The children run in `--python` (default: this interpreter). What is installed there moves the time:
where comet_ml is installed (the `test` extra installs it), tensorboardX imports it, and matplotlib
with it, at the run's first TensorBoard event, about a second; the README's install line
(`pip install -e .`) does not install it. The table names the interpreter and whether it has comet_ml.

Each process counts the programs JAX obtains (the '/jax/core/compile/backend_compile_duration' event
wraps compiling and reading the persistent cache alike), before its first step and in all (train.py
also saves, validates and samples after it), and the persistent cache hits. Times are medians over
`--rounds` rounds. It writes the section between the `startup` markers of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import output_args, run_section  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- startup -->", "<!-- /startup -->"
TARGETS = {"cold": 1.2, "warm": 0.5, "programs": 8}

# Prepended to both children: counts programs and reports the first step's end, as one JSON line.
_COUNT = """
import json, sys, time
from jax import monitoring
_programs, _hits, _first = [], [], {}
monitoring.register_event_duration_secs_listener(
    lambda e, s, **k: _programs.append(s) if e == '/jax/core/compile/backend_compile_duration' else None)
monitoring.register_event_listener(
    lambda e, **k: _hits.append(e) if e == '/jax/compilation_cache/cache_hits' else None)
def _first_step_done():
    if not _first:
        _first.update(time=time.time(), cpu=time.process_time(), programs=len(_programs))
def _report():
    print('STARTUP ' + json.dumps({'first_step': _first['time'], 'cpu': _first['cpu'], 'programs_before': _first['programs'],
                                   'programs': len(_programs), 'hits': len(_hits)}), flush=True)
"""

_ZEROJAX = _COUNT + """
import jax
from zerojax.app import trainer
_step = trainer.Run.step
def _timed(self, step):
    _step(self, step)
    jax.block_until_ready(self.engine.state)
    _first_step_done()
trainer.Run.step = _timed
from zerojax.app.cli import main
rc = main(['train', *sys.argv[1:]])
_report()
sys.exit(rc)
"""

_BASELINE = _COUNT + """
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from zerojax.config import load_config
from zerojax.models import gpt
jax.config.update('jax_num_cpu_devices', 8)
config = load_config(sys.argv[1])
m, rows = config.model, config.train_batch_size
o = config.optimizer.params
mesh = Mesh(np.array(jax.devices()), ('data',))
rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))
tx = optax.chain(optax.clip_by_global_norm(config.gradient_clipping),
                 optax.adamw(o.lr, b1=o.betas[0], b2=o.betas[1], weight_decay=o.weight_decay))

@jax.jit
def init():
    params = gpt.init_params(m, config.run.seed)
    return params, tx.init(params)

def loss_fn(params, tokens):
    logits = gpt.apply(m, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()

@jax.jit
def step(params, opt, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss

params, opt = init()
tokens = jax.device_put(np.random.default_rng(0).integers(0, m.vocab_size, (rows, m.seq_len + 1), dtype=np.int32), split)
params, opt, loss = step(params, opt, tokens)
jax.block_until_ready((params, opt, loss))
_first_step_done()
_report()
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/zero3.yaml")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter the timed processes run, e.g. a venv made by the README's install line")
    p.add_argument("--against", default=None,
                   help="another checkout of zerojax (e.g. main's): its cold and warm runs interleaved with this one's")
    output_args(p, "benchmarks.md", rounds=3)
    return p.parse_args(argv)


def _env(root: str = ROOT) -> dict[str, str]:
    """What a user's shell has: CPU with 8 devices, no compile-cache or optimization settings of the tests;
    zerojax imported from `root`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(PYTHONPATH=root, JAX_PLATFORMS="cpu")  # zerojax asks for mesh.cpu_devices, the baseline for 8
    return env


def _has_comet(python: str) -> bool:
    """Whether `python` can import comet_ml (then tensorboardX's import imports it too)."""
    code = "import importlib.util; print(importlib.util.find_spec('comet_ml') is not None)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


def _launch(python: str, code: str, args: list[str], root: str = ROOT) -> dict[str, float]:
    """Run one child (zerojax from `root`); its first step's end and program counts, timed from its launch."""
    start = time.time()
    p = subprocess.run([python, "-c", code, *args], env=_env(root), cwd=root, capture_output=True,
                       text=True, timeout=1800)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("STARTUP ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"startup benchmark child failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    out = json.loads(line[len("STARTUP "):])
    out["first_step"] -= start
    out["total"] = time.time() - start
    return out


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "zerojax cold": [], "zerojax warm": []}
    against = os.path.abspath(args.against) if args.against else None
    label = f"`{os.path.basename(against)}`" if against else ""  # the other checkout's rows
    if against:
        runs.update({f"{label} cold": [], f"{label} warm": []})
    for _ in range(args.rounds):
        work = tempfile.mkdtemp(prefix="zerojax-startup-")
        try:
            def train(tree: str, kind: str) -> list[str]:  # each checkout its own compile cache: cold, then warm
                return ["--config", args.config, "--set", "run.steps=1", "run.progress=false",
                        f"run.compile_cache={work}/jax-cache-{tree}", f"run.output_dir={work}/{tree}-{kind}"]
            runs["baseline"].append(_launch(args.python, _BASELINE, [args.config]))
            for kind in ("cold", "warm"):
                runs[f"zerojax {kind}"].append(_launch(args.python, _ZEROJAX, train("this", kind)))
            for kind in ("cold", "warm") if against else ():
                runs[f"{label} {kind}"].append(_launch(args.python, _ZEROJAX, train("against", kind), against))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return runs


def render(args: argparse.Namespace, runs: dict[str, list[dict[str, float]]], seconds: float) -> str:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    base = med("baseline", "first_step")
    lines = [BEGIN, f"## Start-up: time to the first step (`python -m benchmarks.startup`)", "",
             f"`train.py --config {args.config} --set run.steps=1` against a hand-written `jax.jit` + optax "
             f"data-parallel step of the same GPT, 8 CPU devices, median of {args.rounds} rounds (each process "
             f"timed from its launch, imports included, to the end of its first step). Programs: what JAX "
             f"compiled or read from the persistent cache, before the first step / in the whole run (train.py "
             f"then saves, validates and samples). Benchmark run time {seconds:.0f} s. The timed "
             "processes' interpreter: " + ("with comet_ml installed (tensorboardX imports it and matplotlib at the "
             "first TensorBoard event)" if _has_comet(args.python) else "without comet_ml (as the README's "
             "install line leaves it)") + "." + (f" Rows named `{os.path.basename(os.path.abspath(args.against))}` "
             f"ran that checkout's code, its cold and warm runs right after this tree's in every round."
             if args.against else ""), "",
             "| run | first step (s) | vs baseline cold | CPU s to first step | vs baseline | programs before / in all "
             "| cache hits | process (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    cpu = med("baseline", "cpu")
    for name in runs:
        lines.append(f"| {name} | {med(name, 'first_step'):.2f} | {med(name, 'first_step') / base:.2f}x | "
                     f"{med(name, 'cpu'):.1f} | {med(name, 'cpu') / cpu:.2f}x | "
                     f"{med(name, 'programs_before'):.0f} / {med(name, 'programs'):.0f} | {med(name, 'hits'):.0f} | "
                     f"{med(name, 'total'):.2f} |")
    cold, warm = med("zerojax cold", "first_step") / base, med("zerojax warm", "first_step") / base
    programs = med("zerojax cold", "programs")
    ok = lambda good: "met" if good else "missed"  # noqa: E731
    lines += ["", f"Targets: cold <= {TARGETS['cold']}x the baseline: {cold:.2f}x ({ok(cold <= TARGETS['cold'])}); "
                  f"warm <= {TARGETS['warm']}x the baseline's cold: {warm:.2f}x ({ok(warm <= TARGETS['warm'])}); "
                  f"at most {TARGETS['programs']} programs for the run: {programs:.0f} "
                  f"({ok(programs <= TARGETS['programs'])}). The baseline's step is smaller than zerojax's "
                  f"(replicated fp32 parameters, no fp32 master copy, ZeRO-3 gathers, non-finite skip or loss "
                  f"scaler), and its process reads no corpus and writes nothing; times on a shared 2-core machine "
                  f"move by tens of percent between runs. CPU s: the process's CPU time (all threads) up to the "
                  f"end of its first step, which load elsewhere moves less: zerojax compiles its step while the "
                  f"state's program compiles (`Engine(compile_for=)`), so its wall time can fall below its CPU "
                  f"time where a core is free, and on a saturated machine tends to its CPU time.", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "startup")


if __name__ == "__main__":
    sys.exit(main())
