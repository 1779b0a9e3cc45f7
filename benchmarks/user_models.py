"""ZeRO stages 0-3 on models written the way users write them (no marking), against plain
`jax.jit` auto-sharded FSDP of the same model.

    python -m benchmarks.user_models          (or: python benchmarks/user_models.py)

Three model shapes:

* `nnx_scan`: a Flax NNX model as the Flax guides write deep models: layers created with
  `nnx.vmap` (stacked parameters) and applied with `nnx.scan` over an `nnx.remat` body.
* `lax_scan`: a plain `loss_fn(params, batch)` over stacked layers with `lax.scan` and
  `jax.checkpoint` on the body.
* `loop`: a plain `loss_fn` over a Python list of layers (no scan, no remat).

Each builder returns (params, loss_fn, make_batch(rows, seed)); the tests train the same builders.
For each shape, at stages 0-3 (fp32 AdamW, 8 virtual CPU devices) and for the FSDP baseline, the
benchmark reports the compiled step's temp bytes over the full fp32 gradients (4Ψ), its per-device
peak bytes (stage 0 over each), collective elements per device over 3Ψ (counted from the compiled
HLO with zerojax/hlo.py, ZeRO-paper accounting) and the median step time over the FSDP step's,
all in one run; it writes the section between the `user-models` markers of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchmarks.report import output_args, run_section  # noqa: E402

Builder = Callable[..., tuple[Any, Callable[..., jax.Array], Callable[[int, int], dict]]]


def _regression_batch(d_in: int, d_out: int) -> Callable[[int, int], dict]:
    def make(rows: int, seed: int) -> dict:
        rng = np.random.default_rng(1000 + seed)
        x = rng.normal(size=(rows, d_in)).astype(np.float32)
        return {"x": x, "y": np.tanh(x[:, :d_out] * 1.5).astype(np.float32)}
    return make


def nnx_scan(width: int = 256, layers: int = 4, d_in: int = 32, d_out: int = 8, *, seed: int = 0,
             constructor: bool = False) -> tuple[Any, Callable[..., jax.Array], Callable[[int, int], dict]]:
    """An NNX MLP stack: `nnx.vmap` creates the layers, `nnx.scan(nnx.remat(...))` applies them."""
    from flax import nnx
    import zerojax

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(width, 2 * width, rngs=rngs)
            self.down = nnx.Linear(2 * width, width, rngs=rngs)
            self.norm = nnx.LayerNorm(width, rngs=rngs)

        def __call__(self, h: jax.Array) -> jax.Array:
            return h + self.down(nnx.gelu(self.up(self.norm(h))))

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.inp = nnx.Linear(d_in, width, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs: nnx.Rngs) -> Block:
                return Block(rngs)

            self.blocks = create(rngs)
            self.out = nnx.Linear(width, d_out, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            h = self.inp(x)

            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            @nnx.remat
            def apply(block: Block, h: jax.Array) -> jax.Array:
                return block(h)

            return self.out(apply(self.blocks, h))

    def loss(model: Any, batch: dict) -> jax.Array:
        return jnp.mean((model(batch["x"]).astype(jnp.float32) - batch["y"]) ** 2)

    make = (lambda: Model(nnx.Rngs(seed))) if constructor else Model(nnx.Rngs(seed))
    params, loss_fn = zerojax.from_nnx(make, loss)
    return params, loss_fn, _regression_batch(d_in, d_out)


def _mlp_layer(rng: np.random.Generator, width: int) -> dict[str, np.ndarray]:
    s = 1 / np.sqrt(width)
    return {"up": (rng.normal(size=(width, 2 * width)) * s).astype(np.float32),
            "b_up": np.zeros(2 * width, np.float32),
            "down": (rng.normal(size=(2 * width, width)) * s / np.sqrt(2)).astype(np.float32),
            "b_down": np.zeros(width, np.float32)}


def _block(h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    dt = p["up"].dtype
    h = h.astype(dt)
    return h + jax.nn.gelu(h @ p["up"] + p["b_up"]) @ p["down"] + p["b_down"]


def _io(rng: np.random.Generator, width: int, d_in: int, d_out: int) -> dict[str, np.ndarray]:
    return {"w_in": (rng.normal(size=(d_in, width)) / np.sqrt(d_in)).astype(np.float32),
            "w_out": (rng.normal(size=(width, d_out)) / np.sqrt(width)).astype(np.float32)}


def lax_scan(width: int = 256, layers: int = 4, d_in: int = 32, d_out: int = 8, *, seed: int = 0
             ) -> tuple[Any, Callable[..., jax.Array], Callable[[int, int], dict]]:
    """Stacked layers, `lax.scan` over a `jax.checkpoint`ed body: a plain loss, no marking."""
    rng = np.random.default_rng(seed)
    stack = [_mlp_layer(rng, width) for _ in range(layers)]
    params = {**_io(rng, width, d_in, d_out),
              "layers": {k: np.stack([l[k] for l in stack]) for k in stack[0]}}

    def loss_fn(params: dict, batch: dict) -> jax.Array:
        h = batch["x"].astype(params["w_in"].dtype) @ params["w_in"]
        body = jax.checkpoint(lambda h, p: (_block(h, p), None))
        h, _ = jax.lax.scan(body, h, params["layers"])
        out = (h @ params["w_out"]).astype(jnp.float32)
        return jnp.mean((out - batch["y"]) ** 2)

    return params, loss_fn, _regression_batch(d_in, d_out)


def loop(width: int = 256, layers: int = 4, d_in: int = 32, d_out: int = 8, *, seed: int = 0
         ) -> tuple[Any, Callable[..., jax.Array], Callable[[int, int], dict]]:
    """A Python list of layers applied in a loop: no scan, no remat."""
    rng = np.random.default_rng(seed)
    params = {**_io(rng, width, d_in, d_out), "layers": [_mlp_layer(rng, width) for _ in range(layers)]}

    def loss_fn(params: dict, batch: dict) -> jax.Array:
        h = batch["x"].astype(params["w_in"].dtype) @ params["w_in"]
        for p in params["layers"]:
            h = _block(h, p)
        out = (h @ params["w_out"]).astype(jnp.float32)
        return jnp.mean((out - batch["y"]) ** 2)

    return params, loss_fn, _regression_batch(d_in, d_out)


SHAPES: dict[str, Builder] = {"nnx_scan": nnx_scan, "lax_scan": lax_scan, "loop": loop}


# ------------------------------------------------------------------------------------------------
# The benchmark.

FSDP = "FSDP"
# ZeRO-3 twice: one layer gathered at a time, and with overlap_comm (the next layer gathered ahead).
CONFIGS = ("0", "1", "2", "3", "3+prefetch")
BEGIN, END = "<!-- user-models -->", "<!-- /user-models -->"


def make_fsdp_step(params: Any, loss_fn: Callable[..., jax.Array], mesh: Any, *, lr: float
                   ) -> tuple[Any, Callable[[Any, Any], Any]]:
    """Plain `jax.jit` FSDP: every leaf (fp32) and its Adam moments sharded on the largest
    dimension the devices divide, `value_and_grad` + optax, the partitioner does the rest."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from benchmarks.fsdp_baseline import largest_divisible_spec

    n = mesh.shape["data"]
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, largest_divisible_spec(tuple(x.shape), n)), params)
    tx = optax.adamw(lr, weight_decay=0.01)

    def init(p: Any) -> Any:
        p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)
        return {"params": p, "opt": tx.init(p)}

    abstract = jax.eval_shape(init, params)
    opt_sh = optax.tree_utils.tree_map_params(tx, lambda _, s: s, abstract["opt"], shardings,
                                              transform_non_params=lambda _: NamedSharding(mesh, P()))
    state_sh = {"params": shardings, "opt": opt_sh}
    state = jax.jit(init, out_shardings=state_sh)(params)

    def step(state: Any, batch: Any) -> tuple[Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    batch_sh = NamedSharding(mesh, P("data"))
    return state, jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                          donate_argnums=0)


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\(.*?\)|\S+) ([a-z][\w\-]*)\(([^)]*)\)")
_GATHERS = ("all-gather", "all-gather-start", "all-gather-done")
_MOVES = ("copy", "bitcast", "dynamic-slice", "get-tuple-element")
# The op that makes a layer's weight gradient (x^T @ cotangent, then transposed to the weight's
# layout), or sums two of them; activations of the weight's shape come from other ops.
_GRAD_OPS = ("transpose", "add_any")


def _tuple_shapes(shape: str) -> list[str]:
    """The element shapes of an HLO tuple shape `(f32[2,3]{1,0}, s32[])` (layouts dropped)."""
    bare = re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", shape[1:-1])
    return [e.strip() for e in re.split(r",\s*(?![^\[]*\])", bare)]


def compile_with_peak(lowered: Any, weight_shapes: set[str], module: str = "jit_step") -> tuple[Any, dict[str, int]]:
    """Compile `lowered` (the jitted function `module` names: jit_<its name>) with XLA's buffer dumps
    on and read what is live at the step's peak.

    XLA's live-range report (`*-live-range.txt`, "Live ranges at N (peak)") lists every buffer live
    at the moment arguments + temporaries + outputs are largest; the train state's arguments are
    left out here. Each buffer is attributed by its shape and the op that made it:
    `gathered`: a whole weight (a layer's, or a leaf used whole) made by a gather or its copies,
    or carried by a loop; `grads`: a whole weight's gradient (the backward pass's transpose that
    makes it, or a sum of two), waiting for its reduce-scatter; `other`: activations (also those
    of a weight's shape, as at 512 rows per device and width 512), gradient shards and the
    update's temporaries.
    """
    from jax._src import compilation_cache  # a persistent-cache hit compiles nothing, so dumps nothing
    with tempfile.TemporaryDirectory() as d:
        used = getattr(compilation_cache, "_cache_used", None)
        try:
            if used:
                compilation_cache._cache_used = False
            compiled = lowered.compile({"xla_dump_to": d, "xla_dump_hlo_as_text": True,
                                        "xla_dump_hlo_module_re": module})
        finally:
            if used:
                compilation_cache._cache_used = used
        ranges = glob.glob(os.path.join(d, "*live-range.txt"))
        if not ranges:
            return compiled, {}
        text = open(ranges[0]).read()
        hlo = open(ranges[0].replace("-live-range.txt", ".txt")).read()
    info: dict[str, tuple[str, str, str, list[str]]] = {}
    entry = False
    for line in hlo.splitlines():
        entry = entry or line.startswith("ENTRY")
        m = _INSTR.match(line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            shape = m.group(2) if m.group(2).startswith("(") else m.group(2).split("{")[0]
            info[m.group(1)] = (shape, m.group(3) if not (entry and m.group(3) == "parameter") else "argument",
                                op.group(1) if op else "", re.findall(r"%([\w.\-]+)", m.group(4)))

    def gathered(name: str, depth: int = 0) -> bool:
        """Made by a gather, or moved (copied, sliced, carried) from one."""
        opcode, operands = info[name][1], info[name][3]
        if opcode in _GATHERS:
            return True
        return opcode in _MOVES and depth < 16 and any(o in info and gathered(o, depth + 1) for o in operands[:1])

    out = {"gathered": 0, "grads": 0, "other": 0}
    block = text.split("(peak):")[-1].split("Stack trace")[0]
    for m in re.finditer(r"([\w.\-]+)\{([\d,]*)\}: (\d+) bytes", block):
        shape, opcode, op_name, _ = info.get(m.group(1), ("?", "?", "", []))
        if opcode == "argument":
            continue
        if shape.startswith("(") and m.group(2):
            # One element of a tuple (a loop's carried state): a weight's shape there is the
            # gathered layer a prefetching loop carries (gradients are carried as shards).
            elems = _tuple_shapes(shape)
            index = int(m.group(2).split(",")[0])
            key = "gathered" if index < len(elems) and elems[index] in weight_shapes else "other"
        elif shape not in weight_shapes:
            key = "other"
        elif gathered(m.group(1)):
            key = "gathered"
        elif op_name.rsplit("/", 1)[-1] in _GRAD_OPS:
            key = "grads"
        else:  # an activation that happens to have a weight's shape (rows per device = its width)
            key = "other"
        out[key] += int(m.group(3))
    return compiled, out


def weight_shapes(params: Any, layer_axes: Any) -> set[str]:
    """HLO shape strings (`f32[256,128]`) of each weight as a use gathers it (one layer of a stacked
    leaf), 2-D and up (biases and norm scales are too small to matter and collide with activations)."""
    from zerojax.core.sharded_init import abstract_params
    shapes = set()
    for x, a in zip(jax.tree.leaves(abstract_params(params)), jax.tree.leaves(layer_axes)):
        if len(x.shape[a:]) >= 2:
            shapes.add(f"f32[{','.join(map(str, x.shape[a:]))}]")
    return shapes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 4096],
                    help="global batch rows, one table set per value (default: 8 and 512 rows per device)")
    ap.add_argument("--scan-width", type=int, default=512)
    ap.add_argument("--scan-layers", type=int, default=8)
    ap.add_argument("--loop-width", type=int, default=1024)
    ap.add_argument("--loop-layers", type=int, default=6)
    output_args(ap, "benchmarks.md", warmup=1, rounds=3)
    return ap.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    return {rows: _measure_rows(args, rows) for rows in args.rows}


def _measure_rows(args: argparse.Namespace, batch_rows: int) -> dict:
    import zerojax
    from zerojax.measure import hlo

    lr = 1e-3
    sizes = {"nnx_scan": (args.scan_width, args.scan_layers), "lax_scan": (args.scan_width, args.scan_layers),
             "loop": (args.loop_width, args.loop_layers)}
    results: dict = {}
    for shape, (width, layers) in sizes.items():
        kw = {"constructor": True} if shape == "nnx_scan" else {}
        params, loss_fn, make_batch = SHAPES[shape](width=width, layers=layers, **kw)
        psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(zerojax.core.sharded_init.abstract_params(params)))
        data = [make_batch(batch_rows, i) for i in range(args.warmup + args.rounds)]
        shapes = weight_shapes(params, zerojax.find_layer_axes(loss_fn, params, data[0]))
        runners: dict = {}
        rows: dict = {}
        for stage in CONFIGS:
            cfg = zerojax.load_config({
                "train_batch_size": batch_rows,
                "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
                "zero_optimization": {"stage": int(stage[0]), "stage3_param_persistence_threshold": 0,
                                      "overlap_comm": stage == "3+prefetch"}})
            mesh = zerojax.make_mesh(cfg)
            plan = zerojax.plan(cfg, mesh, params)
            state = zerojax.init_state(cfg, plan, params)
            step = zerojax.make_train_step(cfg, plan, loss_fn)
            t = time.perf_counter()
            compiled, at_peak = compile_with_peak(step.lower(state, data[0]), shapes)
            rows[stage] = {"compile_s": time.perf_counter() - t, "at_peak": at_peak}
            runners[stage] = [compiled, state]
            print(f"{batch_rows} rows, {shape} stage {stage}: compiled", file=sys.stderr, flush=True)
        whole = params if not isinstance(params, zerojax.ParamsInit) else jax.jit(params.fn)()
        state, step = make_fsdp_step(whole, loss_fn, mesh, lr=lr)
        del whole
        t = time.perf_counter()
        compiled, at_peak = compile_with_peak(step.lower(state, data[0]), shapes)
        rows[FSDP] = {"compile_s": time.perf_counter() - t, "at_peak": at_peak}
        runners[FSDP] = [compiled, state]
        for key, (compiled, _) in runners.items():
            mem = compiled.memory_analysis()
            found = hlo.collectives(compiled.as_text())
            kinds: dict = {}
            for c in found:
                kinds[c.kind] = kinds.get(c.kind, 0.0) + c.elems_per_device
            # Everything the step holds at once on a device: its arguments (the train state and the
            # batch), its temporaries, and outputs that do not reuse a donated argument.
            peak = (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                    - mem.alias_size_in_bytes)
            rows[key].update(temp=mem.temp_size_in_bytes, peak=peak,
                             elems=sum(kinds.values()), kinds=kinds, times=[])

        def run(key: Any, batch: Any) -> float:
            compiled, state = runners[key]
            t = time.perf_counter()
            state, out = compiled(state, batch)
            jax.block_until_ready(out)
            runners[key][1] = state
            return time.perf_counter() - t

        for i in range(args.warmup):
            for key in runners:
                run(key, data[i])
        for i in range(args.rounds):
            for key in runners:
                rows[key]["times"].append(run(key, data[args.warmup + i]))
        for key in rows:
            rows[key]["step_s"] = statistics.median(rows[key]["times"])
        results[shape] = {"psi": psi, "width": width, "layers": layers, "rows": rows}
        runners.clear()
        print(f"{batch_rows} rows, {shape}: measured", file=sys.stderr, flush=True)
    return results


def render(args: argparse.Namespace, results: dict, elapsed: float) -> str:
    n = jax.device_count()
    frac = (n - 1) / n
    out = [BEGIN, "## Your model: ZeRO on models written without zerojax in mind", "",
           f"`python -m benchmarks.user_models` ({elapsed:.0f} s here): {n} virtual CPU devices, fp32 AdamW, "
           f"global batches of {' and '.join(str(r) for r in results)} rows, "
           "`stage3_param_persistence_threshold` 0. The loss functions are the users' own "
           "(benchmarks/user_models.py): no `gathers_params`, no `zerojax.gather`.", "",
           "- **temp / grads**: the compiled step's temp bytes per device over the full fp32 gradients (4Ψ).",
           "- **peak**: the compiled step's bytes per device at once: arguments (train state, batch) + "
           "temp + outputs not aliased to donated arguments; **stage 0 / this** is how many times "
           "less than stage 0 it needs (8 devices share one host here, so this is also the ratio of "
           "host memory the step needs).",
           "- **collectives / 3Ψ**: elements each device sends per step (all kinds, ZeRO-paper accounting, "
           "compiled HLO) over 3Ψ(N-1)/N, the ideal of stage 3; stages 0-2 ideally send 2Ψ(N-1)/N "
           "(0.67 on this scale).",
           "- **step / FSDP**: median step time over the auto-sharded FSDP step's (plain `jax.jit`, "
           "parameters and Adam moments sharded on their largest divisible dimension), measured side "
           "by side. Eight devices share two cores here: read times as relative, not as speed-ups.", ""]
    names = {"nnx_scan": "Flax NNX: `nnx.vmap` layers, `nnx.scan` + `nnx.remat` (via `from_nnx(constructor, loss)`)",
             "lax_scan": "plain loss: `lax.scan` + `jax.checkpoint` over stacked layers",
             "loop": "plain loss: Python loop over a list of layers (no scan, no remat)"}
    short = {"3": "ZeRO-3", "3+prefetch": "ZeRO-3 + prefetch", FSDP: "FSDP"}
    for batch_rows, shapes in results.items():
        out += [f"### Global batch {batch_rows} ({batch_rows // n} rows per device)", ""]
        for shape, r in shapes.items():
            psi, rows = r["psi"], r["rows"]
            out += [f"#### {names[shape]}", "",
                    f"{r['layers']} layers of width {r['width']}, Ψ = {psi / 1e6:.1f}M parameters.", "",
                    "| config | temp / grads | peak MiB | stage 0 / this | collectives / 3Ψ | by kind (/ Ψ) "
                    "| step s | step / FSDP |",
                    "|---|---|---|---|---|---|---|---|"]
            base_peak, fsdp_t = rows["0"]["peak"], rows[FSDP]["step_s"]
            for key, row in rows.items():
                name = {FSDP: "FSDP (`jax.jit`)", "3": "ZeRO-3, overlap_comm false",
                        "3+prefetch": "ZeRO-3, overlap_comm true (prefetch)"}.get(key, f"ZeRO-{key}")
                kinds = ", ".join(f"{k} {v / psi:.2f}" for k, v in sorted(row["kinds"].items()) if v / psi >= 0.005)
                out.append(f"| {name} | {row['temp'] / (4 * psi):.2f} | {row['peak'] / 2**20:.1f} | "
                           f"{base_peak / row['peak']:.2f} | {row['elems'] / (3 * psi * frac):.2f} | {kinds or '-'} | "
                           f"{row['step_s']:.3f} | {row['step_s'] / fsdp_t:.2f} |")
            out += ["", "At the step's peak (XLA's live-range report, train-state arguments left out), in "
                    f"layers ({r['layers']} layers: one layer = 4Ψ/{r['layers']} bytes):", "",
                    "| config | gathered weights | full gradients awaiting reduce-scatter | other (activations, "
                    "gradient shards, update) |", "|---|---|---|---|"]
            unit = 4 * psi / r["layers"]
            for key in ("3", "3+prefetch", FSDP):
                b = rows[key].get("at_peak") or {}
                if b:
                    out.append(f"| {short[key]} | {b['gathered'] / unit:.2f} | {b['grads'] / unit:.2f} | "
                               f"{b['other'] / unit:.2f} |")
            out.append("")
    out.append(END)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return run_section(argv, parse_args, measure, render, BEGIN, END, "user-models")

if __name__ == "__main__":
    sys.exit(main())
