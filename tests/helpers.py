"""Shared pieces of the step / layout / collectives tests: a tiny model, configs, a single-device
reference trainer, tree comparison and HLO parsing.

The model is a small MLP whose hidden layers are stacked (leading layer axis) and applied with
`lax.scan`, so the same forward serves as a plain loss (whole parameters) and as a ZeRO-3 loss that
gathers each layer inside the scanned body.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import zerojax
from zerojax.core.collectives import gather, gathers_params
from zerojax.core.mesh import DATA

D_IN, D_HID, D_OUT, N_LAYERS = 16, 32, 4, 2


# ------------------------------------------------------------------------------------------------
# Model.

def mlp_params(seed: int = 0, *, divisible: bool = False) -> dict[str, Any]:
    """fp32 numpy parameters. Not `divisible`: `b_out` (4,) and `w_out` (32, 4) shard only on some
    meshes, a mix of sharded and replicated leaves. `divisible`: every leaf divides by 8."""
    rng = np.random.default_rng(seed)

    def f(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.normal(size=shape) * scale).astype(np.float32)

    out = 8 if divisible else D_OUT
    return {"w_in": f(D_IN, D_HID), "b_in": f(D_HID, scale=0.1),
            "layers": {"w": f(N_LAYERS, D_HID, D_HID), "b": f(N_LAYERS, D_HID, scale=0.1)},
            "w_out": f(D_HID, out), "b_out": f(out, scale=0.1)}


def forward(params: dict[str, Any], x: jax.Array, g: Callable[[Any], Any] = lambda t: t) -> jax.Array:
    """Compute in the parameters' dtype; `g` gathers (ZeRO-3) or is the identity."""
    top = g({k: v for k, v in params.items() if k != "layers"})
    dt = top["w_in"].dtype
    h = jnp.tanh(x.astype(dt) @ top["w_in"] + top["b_in"])

    def body(h: jax.Array, layer: dict[str, Any]) -> tuple[jax.Array, None]:
        layer = g(layer)
        return jnp.tanh(h @ layer["w"] + layer["b"]), None

    h, _ = jax.lax.scan(body, h, params["layers"])
    out = h @ top["w_out"] + top["b_out"]
    return out[:, :D_OUT].astype(jnp.float32)


def mse_loss(params: dict[str, Any], batch: dict[str, Any]) -> jax.Array:
    """A plain loss: expects whole parameters."""
    return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2)


@gathers_params
def layerwise_loss(params: dict[str, Any], batch: dict[str, Any]) -> jax.Array:
    """The same loss, gathering ZeRO-3 parameters layer by layer inside the scan."""
    return jnp.mean((forward(params, batch["x"], gather) - batch["y"]) ** 2)


def make_batch(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + seed)
    x = rng.normal(size=(rows, D_IN)).astype(np.float32)
    y = np.tanh(x[:, :D_OUT] * 1.5 + 0.3 * rng.normal(size=(rows, D_OUT))).astype(np.float32)
    return {"x": x, "y": y}


# ------------------------------------------------------------------------------------------------
# Configs and meshes.

ADAM = {"type": "Adam", "params": {"lr": 1e-2}}
SGD = {"type": "SGD", "params": {"lr": 0.2}}


def make_config(stage: int, *, gas: int = 1, dtype: str = "fp32", optimizer: dict | None = None,
                clip: float = 1.0, threshold: int = 0, train_batch_size: int = 32,
                **extra: Any) -> zerojax.Config:
    raw: dict[str, Any] = {
        "train_batch_size": train_batch_size, "gradient_accumulation_steps": gas,
        "optimizer": optimizer or ADAM, "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": threshold},
        "zero_allow_untested_optimizer": True,
    }
    if dtype == "bf16":
        raw["bf16"] = {"enabled": True}
    raw.update(extra)
    return zerojax.load_config(raw)


def data_mesh(n: int | None = None) -> Mesh:
    devices = jax.devices() if n is None else jax.devices()[:n]
    return Mesh(np.array(devices), (DATA,))


def train_steps(cfg: zerojax.Config, batches: Sequence[Any], params: Any = None,
                loss_fn: Callable[..., jax.Array] = mse_loss, mesh: Mesh | None = None
                ) -> tuple[zerojax.Plan, zerojax.TrainState, list[dict]]:
    """`make_train_step` over `batches` (default: the 8-device data mesh, `mlp_params(0)`, MSE):
    the plan, the final state and the metrics on the host."""
    params = mlp_params(0) if params is None else params
    p = zerojax.plan(cfg, data_mesh() if mesh is None else mesh, params)
    state = zerojax.init_state(cfg, p, params)
    step = zerojax.make_train_step(cfg, p, loss_fn)
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append(jax.device_get(m))
    return p, state, metrics


# ------------------------------------------------------------------------------------------------
# The single-device reference: plain value_and_grad of the global mean loss + the plan's optax tx.

def deepspeed_clip(grads: Any, norm: jax.Array, max_norm: Any) -> Any:
    """DeepSpeed: coef = max_norm / (norm + 1e-6), applied when it is below 1; max_norm 0 disables."""
    coef = max_norm / (norm + 1e-6)
    engage = (max_norm > 0) & (coef < 1.0)
    return jax.tree.map(lambda g: jnp.where(engage, g * coef, g), grads)


def reference_run(tx: optax.GradientTransformation, compute_dtype: Any, loss_fn: Any,
                  params0: Any, batches: Sequence[Any], clip: float) -> list[dict[str, Any]]:
    """Train on one device: fp32 master, forward in `compute_dtype` (the same casting as the step).

    Returns, after each step, the master params, the optimizer state, the loss and the gradient norm
    (before clipping), as numpy trees.
    """
    dev = jax.devices()[0]

    @jax.jit
    def step(master: Any, opt_state: Any, batch: Any, clip: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array]:
        compute = jax.tree.map(lambda x: x.astype(compute_dtype), master)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch).astype(jnp.float32))(compute)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        norm = optax.tree.norm(grads)
        grads = deepspeed_clip(grads, norm, clip)
        updates, opt_state = tx.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state, loss, norm

    master = jax.device_put(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params0), dev)
    opt_state = tx.init(master)
    out = []
    for batch in batches:
        master, opt_state, loss, norm = step(master, opt_state, jax.device_put(batch, dev),
                                             jnp.float32(clip))
        out.append({"master": to_numpy(master), "opt_state": to_numpy(opt_state),
                    "loss": float(loss), "grad_norm": float(norm)})
    return out


# ------------------------------------------------------------------------------------------------
# Trees.

def to_numpy(tree: Any) -> Any:
    """Host copies; floating leaves (bf16 included) as float64."""
    def one(x: Any) -> np.ndarray:
        x = jax.device_get(x)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return np.asarray(x.astype(np.float32), np.float64)
        return np.asarray(x)
    return jax.tree.map(one, tree)


def host_state(e: zerojax.Engine) -> dict[str, Any]:
    """Everything a resume must give back, on the host (floats as float64)."""
    s = e.state
    return to_numpy({"params": s.params, "master": s.master, "opt_state": s.opt_state, "step": s.step,
                     "skipped": s.skipped, "scaler": s.scaler, "rng": s.rng})


class SavedRun(NamedTuple):
    """A run that saved a checkpoint and went on: what a resume at another mesh size is held to."""
    engine: zerojax.Engine
    directory: Any  # its checkpoint folder
    state: dict[str, Any]  # at the save
    losses: list[float]  # the next steps' losses at its own size
    after: dict[str, Any]  # the state after them


def save_and_go_on(e: zerojax.Engine, directory: Any, batch: Callable[[int], Any], saved_at: int,
                   more: int) -> SavedRun:
    """Train `saved_at` steps on `batch(i)`, save to `directory`, then train `more` steps."""
    for i in range(saved_at):
        e.train_batch(batch(i))
    e.save_checkpoint(str(directory))
    state = host_state(e)
    losses = [float(e.train_batch(batch(i))["loss"]) for i in range(saved_at, saved_at + more)]
    return SavedRun(e, directory, state, losses, host_state(e))


def moved(after: Any, before: Any) -> Any:
    """How far each leaf moved: `after - before`, leaf by leaf."""
    return jax.tree.map(lambda a, b: a - b, after, before)


def assert_resumes_like(e: zerojax.Engine, src: SavedRun, batch: Callable[[int], Any], saved_at: int,
                        more: int) -> None:
    """`e` (another mesh size) loads `src`'s checkpoint into its own layout, holds the saved state bit for
    bit, and goes on as `src` did: the losses to float32's rounding (sums run in another order at
    another size), the parameter updates within 0.1% (a restore with fresh Adam moments is far off).
    Runs in float32: in bf16 another split's rounding alone moves Adam's first, sign-like updates of
    rarely seen rows by up to the learning rate."""
    import pathlib
    path, _ = e.load_checkpoint(str(src.directory))
    assert pathlib.Path(path) == pathlib.Path(src.directory) / f"global_step{saved_at}" and e.global_steps == saved_at
    for got, want in ((e.state.params, e.plan.param_shardings), (e.state.opt_state, e.plan.opt_state_shardings)):
        assert [x.sharding for x in jax.tree.leaves(got)] == jax.tree.leaves(want)  # read into this layout
    assert_tree_close(host_state(e), src.state, rtol=0, atol=0, what="restored")
    losses = [float(e.train_batch(batch(i))["loss"]) for i in range(saved_at, saved_at + more)]
    np.testing.assert_allclose(losses, src.losses, rtol=2e-5)
    assert e.global_steps == saved_at + more
    assert_tree_close(moved(host_state(e)["params"], src.state["params"]),
                      moved(src.after["params"], src.state["params"]), rtol=1e-3, atol=0, what="update")


def assert_tree_close(got: Any, want: Any, *, rtol: float, atol: float, what: str = "") -> None:
    """Leaf by leaf: |got - want| <= atol + rtol * max|want| (a per-leaf scale, so moments as small
    as Adam's v are compared relative to their own size)."""
    got_l, got_t = jax.tree_util.tree_flatten_with_path(got)
    want_l, want_t = jax.tree_util.tree_flatten_with_path(want)
    assert got_t == want_t, f"{what}: tree structures differ\n{got_t}\n{want_t}"
    for (path, g), (_, w) in zip(got_l, want_l):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, f"{what}{jax.tree_util.keystr(path)}: shape {g.shape} != {w.shape}"
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        err = float(np.max(np.abs(g - w))) if w.size else 0.0
        assert err <= atol + rtol * scale, (
            f"{what}{jax.tree_util.keystr(path)}: max |diff| {err:.3g} > {atol:g} + {rtol:g} * {scale:.3g}")


def assert_relative_close(got: Any, want: Any, *, rel: float, origin: Any = None, what: str = "") -> None:
    """Leaf by leaf: ||got - want|| <= rel * ||want - origin|| (L2 norms; origin 0 by default).

    For bf16, where Adam turns the noise of tiny gradients into whole-lr steps of either sign on a
    few elements, this bounds the error of the update as a whole: a gradient over-counted by N, a
    dropped micro-batch or a wrong sign gives errors of order 1 or more.
    """
    got_l, got_t = jax.tree_util.tree_flatten_with_path(got)
    want_l, want_t = jax.tree_util.tree_flatten_with_path(want)
    assert got_t == want_t, f"{what}: tree structures differ\n{got_t}\n{want_t}"
    origin_l = jax.tree.leaves(origin) if origin is not None else [0.0] * len(want_l)
    for (path, g), (_, w), o in zip(got_l, want_l, origin_l):
        g, w, o = (np.asarray(a, np.float64) for a in (g, w, o))
        err, size = float(np.linalg.norm(g - w)), float(np.linalg.norm(w - o))
        assert err <= rel * size, (
            f"{what}{jax.tree_util.keystr(path)}: ||diff|| {err:.3g} > {rel:g} * {size:.3g}")




# ------------------------------------------------------------------------------------------------
# HLO.

_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z][\w\-]*)\(")


def collectives(hlo: str, op: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """For every `op` instruction (e.g. "all-reduce", or its async "-start" form) in compiled HLO
    text, the (dtype, shape) of each element of its result (a combined, tuple-shaped collective
    gives several)."""
    out = []
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if m and m.group(2) in (op, op + "-start"):
            out.append([(dt, tuple(int(d) for d in dims.split(",") if d))
                        for dt, dims in _SHAPE.findall(m.group(1))])
    return out


def collective_shapes(hlo: str, op: str) -> list[tuple[int, ...]]:
    """Every result shape of every `op` instruction, tuples flattened."""
    return [shape for instr in collectives(hlo, op) for _, shape in instr]


def count_op(hlo: str, op: str) -> int:
    return len(collectives(hlo, op))


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%([\w.\-]+)")


def computations_with(hlo: str, op: str) -> set[str]:
    """Names of the HLO computations that contain an `op` instruction ("ENTRY" for the entry)."""
    found, current = set(), None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = "ENTRY" if m.group(1) else m.group(2)
            continue
        m = _INSTR.match(line)
        if m and m.group(2) in (op, op + "-start"):
            found.add(current)
    return found


def while_bodies(hlo: str) -> set[str]:
    """Names of the computations that are the body of a while loop."""
    return {m.group(1) for m in _WHILE_BODY.finditer(hlo)}


_OPERANDS = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")


def _computations(hlo: str) -> dict[str, dict[str, tuple[str, list[str], bool]]]:
    """computation -> instruction -> (opcode, operand names, is root)."""
    comps: dict[str, dict[str, tuple[str, list[str], bool]]] = {}
    current = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head:
            current = comps.setdefault(head.group(1), {})
            continue
        m = _OPERANDS.match(line)
        if m and current is not None:
            current[m.group(2)] = (m.group(3), re.findall(r"%([\w.\-]+)", m.group(4)), bool(m.group(1)))
    return comps


def _computes(comps: dict, opcode: str, operands: list[str]) -> bool:
    """A dot or convolution, or a fusion / call / loop that holds one."""
    if opcode in ("dot", "convolution"):
        return True
    return any(o in comps and any(op in ("dot", "convolution") for op, _, _ in comps[o].values())
               for o in operands)


def _users(instrs: dict[str, tuple[str, list[str], Any]]) -> dict[str, list[str]]:
    """Per instruction of one computation, the instructions that read it."""
    users: dict[str, list[str]] = {}
    for name, (_, ops, _) in instrs.items():
        for o in ops:
            users.setdefault(o, []).append(name)
    return users


def gathers_in_loops(hlo: str) -> dict[str, list[tuple[bool, bool]]]:
    """Per while-loop body of compiled HLO text, each all-gather's (after_compute, feeds_compute):
    whether a matmul of the same iteration comes before it (in its operands' chain), and whether a
    matmul of the same iteration waits for it (in its users' chain, up to the body's result tuple).
    A gather with neither reads only what the iteration was handed and feeds only the loop carry:
    the next iteration's weights, gathered while this iteration computes (a prefetch)."""
    comps = _computations(hlo)
    out: dict[str, list[tuple[bool, bool]]] = {}
    for body in while_bodies(hlo):
        instrs = comps[body]
        users = _users(instrs)
        found = out.setdefault(body, [])
        for name, (opcode, ops, _) in instrs.items():
            if opcode not in ("all-gather", "all-gather-start"):
                continue
            seen, todo, after_compute = set(), list(ops), False
            while todo:
                n = todo.pop()
                if n in instrs and n not in seen:
                    seen.add(n)
                    after_compute |= _computes(comps, instrs[n][0], instrs[n][1])
                    todo += instrs[n][1]
            seen, todo, feeds_compute = set(), list(users.get(name, [])), False
            while todo:
                n = todo.pop()
                if n not in seen:
                    seen.add(n)
                    feeds_compute |= _computes(comps, instrs[n][0], instrs[n][1])
                    if instrs[n][0] != "tuple":
                        todo += users.get(n, [])
            found.append((after_compute, feeds_compute))
    return out


def gathers_ahead(hlo: str) -> list[tuple[int, bool]]:
    """Each all-gather inside a while-loop body of compiled HLO text: (its result bytes, whether it
    is gathered ahead). Ahead: the first matmuls that read it (dots, or fusions and loops holding
    one, found through the ops between) wait for some matmul the gather does not wait for, so it
    can be in flight while that one computes (a layer's weights gathered while the layer before
    computes); or it feeds only the loop's state (the next iteration's weights, as
    `gathers_in_loops` finds). A gather tied to the input of the matmul that reads it (gathered
    where it is used) is not ahead."""
    comps = _computations(hlo)
    out = []
    for body in while_bodies(hlo):
        instrs = comps[body]
        users = _users(instrs)
        before: dict[str, set[str]] = {}

        def ancestors(name: str) -> set[str]:
            if name not in before:
                seen, todo = set(), list(instrs[name][1])
                while todo:
                    n = todo.pop()
                    if n in instrs and n not in seen:
                        seen.add(n)
                        todo += instrs[n][1]
                before[name] = seen
            return before[name]

        def computes(name: str) -> bool:
            return _computes(comps, instrs[name][0], instrs[name][1])

        for name, (opcode, _, _) in instrs.items():
            if opcode not in ("all-gather", "all-gather-start"):
                continue
            first, seen, todo = set(), set(), list(users.get(name, []))
            while todo:
                n = todo.pop()
                if n in seen:
                    continue
                seen.add(n)
                if computes(n):
                    first.add(n)
                elif not (instrs[n][0] == "tuple" and instrs[n][2]):  # the body's result: the next iteration's
                    todo += users.get(n, [])
            mine = ancestors(name)
            ahead = not first or any(computes(d) for f in first for d in ancestors(f) - mine - {name})
            line = next(x for x in hlo.splitlines() if re.match(rf"^\s*(ROOT\s+)?%{re.escape(name)}\s*=", x))
            size = sum(numel(tuple(int(d) for d in dims.split(",") if d)) * (2 if dt in ("bf16", "f16") else 4)
                       for dt, dims in _SHAPE.findall(line.split("=", 1)[1].split("all-gather")[0]))
            out.append((size, ahead))
    return out


def greedy_by_recompute(forward: Callable[[Any, np.ndarray], Any], params: Any, prompts: Sequence[Sequence[int]],
                        n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens [rows, n] and their log-probabilities by full recomputation: `forward(params,
    tokens [rows, width]) -> logits` on each row's growing sequence (left-aligned in the window,
    logits read at its last token). What a KV-cache decoder must reproduce."""
    params = jax.device_get(params)
    seqs = [list(p) for p in prompts]
    toks, logps = np.zeros((len(seqs), n), np.int32), np.zeros((len(seqs), n), np.float32)
    for i in range(n):
        buf = np.zeros((len(seqs), width), np.int32)
        for r, s in enumerate(seqs):
            buf[r, :len(s)] = s
        logits = np.asarray(forward(params, buf))
        for r, s in enumerate(seqs):
            row = logits[r, len(s) - 1]
            toks[r, i] = int(np.argmax(row))
            logps[r, i] = np.asarray(jax.nn.log_softmax(jnp.asarray(row)))[toks[r, i]]
            s.append(int(toks[r, i]))
    return toks, logps


# ------------------------------------------------------------------------------------------------
# Metrics backends (tests/test_wandb.py, tests/test_comet.py): train.py's three-step run with one
# backend on, its events against metrics.jsonl, and the refusal when the package is absent.

def train_with_monitor(tmp_path: Path, monitor: str, *args: str, env: Mapping[str, str], drop: Iterable[str],
                       pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """configs/zero1.yaml for 3 steps, logging every step, with `{monitor}.enabled=true`. `env` adds the
    backend's folders (so nothing lands in ~); `drop` removes the variables the backend would read
    instead of the config's keys."""
    from test_cli import ROOT, SMALL
    tiny = [*SMALL, "run.steps=3", "run.log_every=1", "steps_per_print=1", "run.sample_tokens=0",
            "scheduler.params.total_num_steps=3", "scheduler.params.warmup_num_steps=1", f"{monitor}.enabled=true"]
    env = {**os.environ, "PYTHONPATH": pythonpath or str(ROOT), "JAX_PLATFORMS": "cpu", **env}
    for key in [*drop, "XLA_FLAGS"]:
        env.pop(key, None)
    return subprocess.run([sys.executable, "train.py", "--config", "configs/zero1.yaml", "--set", *tiny, *args,
                           f"run.output_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def samples_events(run_dir: Path) -> dict[int, dict[str, float]]:
    """The Train/Samples/* events a backend should hold for `train_with_monitor`'s run, from its
    metrics.jsonl (steps 1 to 3), keyed as DeepSpeed's are by samples seen."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    samples = 32  # train_batch_size: DeepSpeed's x axis is samples seen
    return {r["step"] * samples: {"Train/Samples/train_loss": r["loss"], "Train/Samples/lr": r["lr"],
                                  "Train/Samples/loss_scale": r["loss_scale"]} for r in rows}


def assert_absent_package_refused(tmp_path: Path, monitor: str, package: str,
                                  train: Callable[..., subprocess.CompletedProcess]) -> None:
    """With `package` importable but failing as an uninstalled one does, `train(tmp_path, pythonpath=)`
    stops with one error naming the key and the extra to install, before compiling or writing the run."""
    from test_cli import ROOT
    fake = tmp_path / "site" / package
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError('No module named {package}')\n")
    proc = train(tmp_path, pythonpath=f"{fake.parent}{os.pathsep}{ROOT}")
    assert proc.returncode != 0
    assert f"{monitor}.enabled: needs the `{package}` package; pip install 'zerojax[{monitor}]'" in proc.stderr
    assert "compiled step" not in proc.stdout and not (tmp_path / "run" / "config.json").exists()
