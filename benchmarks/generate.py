"""Generation: decode tokens/s with the KV cache against gathering the weights per token and against
recomputing the window per token; generate's memory against the train step's.

    python -m benchmarks.generate          (or: python benchmarks/generate.py)

The embedded GPT at configs/zero3.yaml's size (d_model 128, 4 layers, 4 heads, bf16 parameters over
fp32 masters, ZeRO-3 over 8 virtual CPU devices; seq_len 256 so that 16 + 128 tokens fit its learned
positions), built as train.py builds it
(`trainer.build_model`, `trainer.build_engine`; untrained weights, which decode as fast as trained
ones). Prompts of 16 tokens, `--new` new tokens each, greedy, at batch 1 and 16:

* `KV cache, engine.generate`: `engine.generate` on the live state (the bf16 compute copy, ZeRO-3
  shards gathered once per call inside the one program, rows split over the data axis when the
  batch divides by 8).
* `KV cache, fp32 master`: `zerojax.models.generate` on the fp32 master copy, also sharded: the
  weights `zerojax sample` and the end-of-run sample now read.
* `KV cache, one device`: the same program with the master weights gathered to the host and put on
  one device (as the recompute path has them), for what 8 virtual devices sharing the CPU cost.
* `gather per token`: DeepSpeed ZeRO-3's way of generating: the same KV-cache prefill and decode
  steps, greedy, but the ZeRO-3 shards are all-gathered inside every decode step (the gather sits in
  the loop body behind an optimization barrier, so XLA cannot hoist it out as loop-invariant).
* `recompute window`: `zerojax.app.sample.generate_recompute`, the path before: the master weights
  gathered to the host, one prompt at a time, a [1, seq_len] forward per new token, sampled on the
  host (its forward is jitted once per model config; the first call holds the compile).

Each path is called once untimed (its compile), then `--rounds` times; tokens/s is batch x new
tokens over the median call. Memory: per device, the compiled generate program's arguments plus
temporaries (`memory_analysis`; the KV cache and the gathered weights are temporaries of it) against
the compiled train step's arguments plus temporaries (its outputs alias the donated state), and the
KV cache's own bytes. It writes the section between the `generate` markers of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
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

BEGIN, END = "<!-- generate -->", "<!-- /generate -->"
LAYOUTS_BEGIN, LAYOUTS_END = "<!-- generate_layouts -->", "<!-- /generate_layouts -->"
#: `--layouts`' model, before any `--set`: a real model's depth (32 layers, as Llama-7B's) with
#: grouped-query attention, at a width the CPU runs. The peak against the plan's bytes is a matter of
#: proportions: one layer's slice is 1/32 of the weights, and short prompts (`--prompt 8 --new 8`) keep
#: the KV cache small next to the weights, as it is at 7B scale (the GPT at configs/zero3.yaml's size
#: has 4 layers, so one layer's slice alone is 25% of its weights). float32: XLA:CPU computes every
#: bf16 op in f32 and converts each whole bf16 stack to f32 ahead of the layer loop, a copy a GPU's
#: native bf16 does not make (on a GPU add `--set bf16.enabled=true`).
LAYOUTS_MODEL = ["model.name=llama", "model.n_layers=32", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2",
                 "model.d_ff=512", "bf16.enabled=false"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides on top of configs/zero3.yaml (e.g. a larger model on a GPU)")
    p.add_argument("--layouts", action="store_true",
                   help="only the decode layouts at ZeRO-3 x tensor 2 x data 4, on LAYOUTS_MODEL (their own section of "
                        "the page; run with --prompt 8 --new 8)")
    output_args(p, "benchmarks.md", rounds=3)
    return p.parse_args(argv)


def _timed(fn: Callable[[], Any], rounds: int) -> tuple[float, float, Any]:
    """(first call's seconds, median seconds of `rounds` more calls, the last call's result)."""
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - t
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return first, statistics.median(times), out


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def gather_per_token(decoder: Any, params: Any, prompts: jax.Array, lengths: jax.Array, n: int, rows: Any,
                     replicated: Any) -> jax.Array:
    """Greedy KV-cache decoding with the sharded `params` all-gathered in the prefill and again in
    every decode step (DeepSpeed ZeRO-3's generation), [B, n] tokens."""
    from zerojax.models import generate as gen

    def whole(p: Any) -> Any:
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), p)

    b, width = prompts.shape
    cache = decoder.init_cache(params, b, width + n)
    cache = jax.tree.map(lambda c: gen._constrain(c, gen._cache_sharding(rows, c.ndim)), cache)
    logits, cache = decoder.prefill(whole(params), cache, prompts, lengths)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out = jax.lax.dynamic_update_index_in_dim(jnp.zeros((b, n), jnp.int32), token, 0, axis=1)

    def body(i: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        token, cache, out = carry
        shards, token = jax.lax.optimization_barrier((params, token))  # the gather depends on this step
        logits, cache = decoder.decode_step(whole(shards), cache, token, lengths + i - 1)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return token, cache, jax.lax.dynamic_update_index_in_dim(out, token, i, axis=1)

    return jax.lax.fori_loop(1, n, body, (token, cache, out))[2]


def _memory(compiled: Any) -> dict[str, int]:
    """Per-device arguments and temporaries of a compiled program (its peak: outputs are small or aliased)."""
    stats = compiled.memory_analysis()
    stats = stats[0] if isinstance(stats, (list, tuple)) else stats
    return {"args": int(stats.argument_size_in_bytes), "temp": int(stats.temp_size_in_bytes)}


def _gathered(compiled: Any) -> float:
    """All-gathered bytes per device in one run of the compiled program (loop trip counts multiplied)."""
    from zerojax.measure.hlo import collectives
    return sum(c.bytes_per_device for c in collectives(compiled.as_text()) if c.kind == "all-gather")


def _gathered_once(params: Any, n: int) -> float:
    """What one all-gather of every leaf sends per device, by the same accounting as `_gathered`: the
    KV-cache program's gathers sit outside its loop (tests/test_generate.py), and its early-stopping
    loop has no trip count for the HLO reader to multiply by."""
    return sum(x.nbytes for x in jax.tree.leaves(params)) * (n - 1) / n


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import zerojax
    from zerojax.app import sample, trainer
    from zerojax.models import generate as gen
    from zerojax.models.generate import generate

    config = zerojax.load_config(os.path.join(ROOT, "configs", "zero3.yaml"),
                                 ["run.progress=false", f"model.seq_len={max(128, args.prompt + args.new)}",
                                  *args.overrides])
    mesh = trainer.make_mesh(config)
    engine = trainer.build_engine(config, mesh, trainer.build_model(config, mesh))
    cfg = config.model
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    for b in args.batches:
        prompts = [list(rng.integers(0, cfg.vocab_size, args.prompt)) for _ in range(b)]

        def recompute() -> list[list[int]]:
            host = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(engine.params))
            return [sample.generate_recompute(cfg, host, p, args.new, temperature=0.0) for p in prompts]

        def one_device() -> Any:
            host = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(engine.params))
            return generate(engine.decoder, jax.device_put(host, jax.devices()[0]), prompts, None, args.new).tokens

        padded, lens = gen.pad_prompts(prompts)
        width = gen.bucket(int(lens.max()), args.new, cfg.seq_len)
        padded = np.pad(padded, ((0, 0), (0, width - padded.shape[1])))
        route = gen.decode_layout.choose(engine.plan, engine.decoder, engine.state.params, b, width + gen.new_token_bucket(args.new),
                                         "gathered")
        placed = gen._rows(padded, lens, route)
        rows_s, replicated = route.rows, jax.sharding.NamedSharding(engine.plan.mesh, jax.sharding.PartitionSpec())
        per_token = gather_per_token.lower(engine.decoder, engine.state.params, *placed, args.new, rows_s,
                                           replicated).compile()
        once = gen._program.lower(engine.decoder, engine.state.params, *placed, np.uint32(0), np.int32(args.new),
                                  gen.new_token_bucket(args.new), 0.0, None, None, (), 0, route).compile()
        chosen = gen.decode_layout.choose(engine.plan, engine.decoder, engine.state.params, b,
                                          width + gen.new_token_bucket(args.new), None, gen.cache_bytes).name
        memory.append(dict(batch=b, once=_memory(once), per_token=_memory(per_token), chosen=chosen,
                           cache=gen.cache_bytes(engine.decoder, engine.state.params, b, width + gen.new_token_bucket(args.new)),
                           rows_split=b % engine.plan.data_size == 0,
                           gathered_once=_gathered_once(engine.state.params, engine.plan.data_size),
                           gathered_per_token=_gathered(per_token)))
        paths = [("KV cache, engine.generate", lambda: engine.generate(prompts, args.new).tokens),
                 ("gather per token", lambda: per_token(engine.state.params, *placed)[:b]),
                 ("KV cache, fp32 master", lambda: generate(engine.decoder, engine.params, prompts, None, args.new,
                                                           plan=engine.plan).tokens),
                 ("KV cache, one device", one_device),
                 ("recompute window", recompute)]
        got = {}
        for name, fn in paths:
            first, median, out = _timed(fn, args.rounds)
            got[name] = np.asarray(out, np.int32)
            rows.append(dict(batch=b, path=name, first=first, median=median, tps=b * args.new / median))
        # the fp32 paths decode the same greedy tokens (the bf16 copy may part from them on a near-tie)
        rows[-1]["same"] = bool(np.array_equal(got["recompute window"], got["KV cache, fp32 master"]))
        rows[-1]["same_gather"] = bool(np.array_equal(got["gather per token"], got["KV cache, engine.generate"]))
    batch = engine.place_batch({"tokens": np.zeros((engine.train_batch_size(), cfg.seq_len + 1), np.int32)})
    train = _memory(engine.train_step_fn.lower(engine.state, batch).compile())
    return dict(rows=rows, cfg=cfg, memory=memory, train=train, train_batch=(engine.train_batch_size(), cfg.seq_len),
                data_size=engine.plan.data_size, **_setting(engine))


def _setting(engine: Any) -> dict[str, Any]:
    """What both sections' headers name: the model's parameter count and the devices."""
    devices = jax.devices()
    return dict(params=sum(x.size for x in jax.tree.leaves(engine.params)),
                devices=f"{len(devices)} {devices[0].device_kind}", cpu=devices[0].platform == "cpu")


def _over(res: dict[str, Any]) -> str:
    """The devices as the headers say them: `8 cpu (virtual)`."""
    return f"{res['devices']}{' (virtual)' if res['cpu'] else ''}"


def render(args: argparse.Namespace, res: dict[str, Any], seconds: float) -> str:
    cfg = res["cfg"]
    lines = [BEGIN, "## Generation: KV cache against gathering per token and recomputing the window", "",
             f"`python -m benchmarks.generate` ({seconds:.0f} s here): the embedded GPT at configs/zero3.yaml's size "
             f"({res['params'] / 1e6:.2f}M parameters: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
             f"seq_len {cfg.seq_len}, raised from 128 so that prompt and new tokens fit), bf16 parameters over fp32 masters, ZeRO-3 over {_over(res)}, built as "
             f"train.py builds it. Prompts of {args.prompt} tokens, {args.new} new tokens each, greedy; median of "
             f"{args.rounds} calls after one untimed call.", "",
             "- **KV cache, engine.generate**: the live bf16 compute copy in one compiled program (prefill, then a "
             "`while_loop` of decode steps), in the layout it chooses (docs/models.md, where generation runs; "
             "`--layouts` compares them).",
             "- **KV cache, fp32 master**: the same program on the fp32 master copy (what `zerojax sample` and the "
             "end-of-run sample read now).",
             "- **KV cache, one device**: the same program with the master weights gathered to the host and put on "
             "one device, as the recompute path has them (the gather is in the timed call).",
             "- **gather per token**: DeepSpeed ZeRO-3's way: the same KV-cache prefill and decode steps, greedy, with "
             "the ZeRO-3 shards all-gathered again inside every decode step (`gather_per_token` in the benchmark).",
             "- **recompute window**: the path before (`app.sample.generate_recompute`): master weights gathered to "
             "the host, one prompt at a time, a [1, seq_len] forward per token, sampled on the host (its forward compiled "
             "once, in the first call; before this change it was recompiled in every call).", "",
             "| batch | path | tokens/s | vs recompute | call (s) | first call (s) |", "|---|---|---|---|---|---|"]
    rows = res["rows"]
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["path"] == "recompute window")
        lines.append(f"| {r['batch']} | {r['path']} | {r['tps']:.0f} | {r['tps'] / base['tps']:.1f}x | "
                     f"{r['median']:.3f} | {r['first']:.2f} |")
    lines += ["", "engine.generate ran the " + ", ".join(f"`{m['chosen']}` layout at batch {m['batch']}" for m in res["memory"])
              + " (at ZeRO-3 `tensor` decodes every row on every device, `gathered` splits the rows over them; the "
              "memory table below compiles engine.generate's program in the `gathered` layout)."]
    same_gather = all(r.get("same_gather", True) for r in rows)
    lines += ["", f"Gathering per token gave {'the same' if same_gather else 'different'} greedy tokens as engine.generate. "
              "Weights all-gathered per device in one call (from the compiled HLO, loop trip counts multiplied; "
              "engine.generate's gathers sit outside its loop, one per leaf):", "",
              "| batch | engine.generate | gather per token |", "|---|---|---|"]
    for m in res["memory"]:
        lines.append(f"| {m['batch']} | {m['gathered_once'] / 2**20:.2f} MiB | {m['gathered_per_token'] / 2**20:.2f} MiB |")
    once = res["memory"][0]["gathered_once"]
    if res["cpu"] and once:
        lines += ["", "On this CPU an all-gather between virtual devices is a memory copy, so gathering per token costs "
                  "little wall time here; across a network (DeepSpeed's multi-GPU ZeRO-3 generation) those bytes are "
                  f"the cost, {res['memory'][0]['gathered_per_token'] / once:.0f} times what engine.generate gathers "
                  f"at {args.new} new tokens."]
    tb, ts = res["train_batch"]
    train = res["train"]
    lines += ["", f"Memory per device, from the compiled programs' `memory_analysis()` (arguments + temporaries; "
              f"the KV cache and the gathered weights are temporaries of the generate program, freed when it returns). "
              f"The train step: batch {tb} x {ts} tokens, arguments {train['args'] / 2**20:.2f} MiB (the ZeRO-3 state) "
              f"+ temporaries {train['temp'] / 2**20:.2f} MiB = **{(train['args'] + train['temp']) / 2**20:.2f} MiB**.", "",
              "| batch | program | arguments (MiB) | temporaries (MiB) | total (MiB) | vs train step | KV cache on a device (MiB) |",
              "|---|---|---|---|---|---|---|"]
    for m in res["memory"]:
        cache = m["cache"] / (res["data_size"] if m["rows_split"] else 1)
        for name, key in (("engine.generate", "once"), ("gather per token", "per_token")):
            total = m[key]["args"] + m[key]["temp"]
            lines.append(f"| {m['batch']} | {name} | {m[key]['args'] / 2**20:.2f} | {m[key]['temp'] / 2**20:.2f} | "
                         f"{total / 2**20:.2f} | {total / (train['args'] + train['temp']):.2f}x | {cache / 2**20:.2f} |")
    same = all(r.get("same", True) for r in rows)
    lines += ["", f"The fp32 KV-cache path and the recompute path gave {'the same' if same else 'different'} greedy "
              "tokens at every batch."]
    if res["cpu"]:
        lines[-1] += (" The 8 virtual devices share this machine's CPU cores: a batch that does not divide by 8 is "
                      "decoded whole by each of them, so on the mesh a row costs about 8 times its one-device work, "
                      "and a batch of 16 gives each device 2 rows; the one-device row shows the program without that. "
                      "On real accelerators the devices run side by side and the replicated work costs no wall time.")
    lines += ["", END]
    return "\n".join(lines)


def measure_layouts(args: argparse.Namespace) -> dict[str, Any]:
    """Per decode layout (zerojax.models.decode_layout) on a ZeRO-3 x tensor 2 x data 4 engine: the
    compiled generate program's peak per device against the plan's parameter bytes, and tokens/s."""
    import zerojax
    from zerojax.app import trainer
    from zerojax.models import decode_layout
    from zerojax.models import generate as gen

    config = zerojax.load_config(os.path.join(ROOT, "configs", "zero3.yaml"),
                                 ["run.progress=false", "mesh.tensor=2", f"model.seq_len={max(128, args.prompt + args.new)}",
                                  *LAYOUTS_MODEL, *args.overrides])
    mesh = trainer.make_mesh(config)
    engine = trainer.build_engine(config, mesh, trainer.build_model(config, mesh))
    # `tensor` as it ran before its decode steps' layers were rolled: the same decoder, unrolled
    unrolled = type("Unrolled", (type(engine.decoder),), {"rolled": lambda self: self})(config.model)
    runs = (("tensor", "tensor", engine.decoder), ("tensor, layers unrolled (before)", "tensor", unrolled),
            ("layers", "layers", engine.decoder), ("gathered", "gathered", engine.decoder))
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batches:
        prompts = [list(rng.integers(0, config.model.vocab_size, args.prompt)) for _ in range(b)]
        got = {}
        for name, layout, decoder in runs:
            mem = gen.memory_report(decoder, engine.state.params, prompts, None, args.new, plan=engine.plan,
                                    layout=layout)
            call = lambda: gen.generate(decoder, engine.state.params, prompts, None, args.new,  # noqa: E731
                                        plan=engine.plan, layout=layout).tokens
            first, median, out = _timed(call, args.rounds)
            got[name] = np.asarray(out)
            rows.append(dict(batch=b, layout=name, peak=mem.peak, weights=mem.weights, planned=mem.planned,
                             cache=mem.cache, tps=b * args.new / median, first=first, prefetch=mem.prefetch))
        chosen = gen.memory_report(engine.decoder, engine.state.params, prompts, None, args.new, plan=engine.plan)
        for r in rows[-len(runs):]:  # share of greedy tokens equal to the gathered layout's (bf16 sums in another
            r["agree"] = float(np.mean(got[r["layout"]] == got["gathered"]))  # order can flip a near-tie, and all after it)
        rows[-1]["chosen"] = chosen.layout
    layer = decode_layout.one_layer_bytes(engine.decoder, engine.state.params) / mesh.size  # every weight split 8 ways
    devices = jax.devices()
    gpu_rows = None
    if devices[0].platform == "gpu":  # batch 1 and 64 against the bytes-per-token bound (benchmarks.gpu's)
        from benchmarks import gpu
        _, hbm = gpu.card(devices[0])
        m = config.model
        size = (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size, m.seq_len, 1, args.prompt,
                args.new, 0)
        gpu_rows = gpu.measure_generate(engine, size, argparse.Namespace(batch=64, rounds=max(args.rounds, 4)),
                                        hbm or 1e12, hbm)
    return dict(rows=rows, cfg=config.model, gpu=gpu_rows, layer=layer,
                dtype=str(jax.tree.leaves(engine.state.params)[0].dtype), **_setting(engine))


def render_layouts(args: argparse.Namespace, res: dict[str, Any], seconds: float) -> str:
    cfg = res["cfg"]
    mib = 2 ** 20
    tensor = [r for r in res["rows"] if r["layout"] == "tensor"]
    planned = tensor[0]["planned"]
    lines = [LAYOUTS_BEGIN, "## Generation from the shards: decode layouts at ZeRO-3 x tensor 2 x data 4", "",
             f"`python -m benchmarks.generate --layouts --prompt {args.prompt} --new {args.new} --rounds {args.rounds}` "
             f"({seconds:.0f} s here): a Llama of a real model's depth at a width the CPU runs ({res['params'] / 1e6:.1f}M "
             f"parameters: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads over {cfg.n_kv_heads} "
             f"key-value heads, d_ff {cfg.d_ff}; `LAYOUTS_MODEL` in the benchmark), {res['dtype']} parameters, "
             f"configs/zero3.yaml's ZeRO-3 with `mesh.tensor: 2` over {_over(res)}; prompts of "
             f"{args.prompt} tokens, {args.new} new tokens, greedy, median of {args.rounds} calls (tokens/s: batch x new "
             "tokens over a call, its prefill included). "
             "Peak: the compiled generate program's arguments + temporaries + outputs per device "
             "(`zerojax.models.generate.memory_report`, from `memory_analysis`), against the parameter bytes the "
             f"plan stores per device ({planned / mib:.2f} MiB: what the train step holds of the parameters). "
             f"Under `tensor` the peak is those parameters, one layer's slice of the stacked weights "
             f"({res['layer'] / mib:.2f} MiB: the decode step's layers run as a loop, and XLA:CPU copies the slice a "
             "matmul reads), the KV cache (the column: every row's cache; XLA splits it over the key-value heads "
             "and holds it twice, as the layer loop's input and output, which comes to the column's bytes) and a few "
             "KiB of activations and logits. The target, at most "
             f"1.1x at ZeRO-3 with tensor-parallel decoding, is {'met' if tensor[0]['peak'] <= 1.1 * planned else 'not met'} "
             f"at batch {tensor[0]['batch']} ({tensor[0]['peak'] / planned:.2f}x); a batch's cache grows with its rows "
             "(every device holds every row's under `tensor` at ZeRO-3).", "",
             "- **tensor**: the weights stay as stored (weight-stationary; the data axis re-read as a tensor axis), "
             "activations move; every device runs every row.",
             "- **tensor, layers unrolled (before)**: the same, with the decode step's layers unrolled as before this "
             "change: every layer's slice is copied at the top of the step, a second copy of the weights.",
             "- **layers**: each device decodes its rows, every ZeRO-3 shard all-gathered in every decode step" + (
                 ", layer i+1's gather in flight while layer i computes (two layers gathered at most: the plan's "
                 "`overlap_comm` prefetch)." if any(r.get("prefetch") for r in res["rows"]) else
                 ", where a layer uses it."),
             "- **gathered**: every weight all-gathered whole once per call (the path before).", "",
             "| batch | layout | peak per device (MiB) | vs plan's parameter bytes | KV cache per device (MiB) | tokens/s | first call (s) | tokens as gathered |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['batch']} | {r['layout']} | {r['peak'] / mib:.2f} | {r['peak'] / r['planned']:.2f}x | "
                     f"{r['cache'] / mib:.2f} | {r['tps']:.0f} | {r['first']:.1f} | {r['agree']:.0%} |")
    ends = [r for r in res["rows"] if "chosen" in r]
    lines += ["", "Chosen by default: " + ", ".join(f"batch {r['batch']}: {r['chosen']}" for r in ends) + ". "
              "Tokens as gathered: the share of greedy tokens equal to the gathered layout's; in float32 the layouts "
              "give the one-device tokens exactly (tests/test_generate_layouts.py)." + (
                  " In bf16 the tensor layout's partial sums are added across devices in bf16 and the other layouts' "
                  "rows run in batches of another shape, so a near-tie of this randomly initialised model (its logits "
                  "are nearly uniform) can flip, and every token after it differs." if res["dtype"] == "bfloat16" else ""),
              ""]
    if res.get("gpu"):
        lines += ["engine.generate on the GPU (its chosen layout), new tokens/s against reading every bf16 weight and "
                  "the KV cache once per token at the card's nominal bandwidth:", "",
                  "| batch | tokens/s | bound | share of bound |", "|---|---|---|---|"]
        lines += [f"| {g['batch']} | {g['tokens_per_s']:.0f} | {g['bound_tokens_per_s']:.0f} | "
                  f"{g['tokens_per_s'] / g['bound_tokens_per_s']:.0%} |" for g in res["gpu"]] + [""]
    else:
        lines += ["No GPU here: the batch 1 and 64 rows against the bytes-per-token bound run only where one is "
                  "present (this command, or `python -m benchmarks.gpu`).", ""]
    lines += [LAYOUTS_END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if "--layouts" in (sys.argv[1:] if argv is None else argv):
        return run_section(argv, parse_args, measure_layouts, render_layouts, LAYOUTS_BEGIN, LAYOUTS_END,
                           "generate layouts")
    return run_section(argv, parse_args, measure, render, BEGIN, END, "generate")


if __name__ == "__main__":
    sys.exit(main())
