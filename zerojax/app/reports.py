"""What a train.py run prints about its step: the memory table at start-up, DeepSpeed's
memory_breakdown, comms logger and flops profiler lines."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zerojax.config import OP_NAMES
from zerojax.measure.hlo import comms_report as hlo_comms_report, matmuls
from zerojax.measure.profile import call_tree, top_by_depth
from zerojax.core.measure import array_bytes, live_device_bytes, step_memory
from zerojax.core.mesh import row_size
from zerojax.core.names import dotted
from zerojax.engine.engine import Engine
from zerojax.optim.schedules import make_schedule, schedule_extent
from zerojax.planner.axes import axis_plans

__all__ = ["compile_step", "named_model", "startup_table", "schedule_warning", "comms_report", "memory_table",
           "flops_profile"]


def compile_step(engine: Engine, batch: Any) -> Any:
    """The train step compiled for `batch` (the compile the first step then uses)."""
    placed = engine.place_batch(batch, engine.plan.batch.train_batch_size)
    return engine.train_step_fn.lower(engine.state, placed).compile()


def _measured_line(engine: Engine) -> str:
    state, mib = engine.state, 2 ** 20
    measured = [(name, array_bytes(tree, False), array_bytes(tree, True))
                for name, tree in (("parameters", state.params), ("optimizer state", (state.master, state.opt_state)))]
    return "measured on device 0: " + ", ".join(
        f"{name} {dev / mib:.2f} MiB" + (f" + {host / mib:.2f} MiB on host" if host else "")
        for name, dev, host in measured)


def named_model(config: Any) -> bool:
    """Whether the config's `model` section names the model (train.py's), rather than its defaults
    standing for a model given in code."""
    return any(key == "model" or key.startswith("model.") for key in config.sources)


def startup_table(engine: Engine, batch: Any = None, compiled: Any = None) -> str:
    """The plan's bytes per device against the ZeRO formula, what the arrays really hold, and - given
    a batch or the compiled step - what the compiled step takes on device and on host."""
    report = engine.memory_report()
    lines = [engine.partition_report()] if hasattr(engine, "partition_report") else []
    lines += [report.table(), _measured_line(engine)]
    model = engine.config.model if named_model(engine.config) else None
    for note in (engine.plan.annotations(), engine.plan.tensor_plan, *axis_plans(engine.plan, model)):
        if note is not None:
            lines.append(note)
    if compiled is None and batch is not None:
        compiled = compile_step(engine, batch)
    if compiled is not None:
        lines.append(step_memory(compiled).line())
    b = engine.plan.batch
    lines.append(f"batch: {b.train_batch_size} = micro {b.micro_batch_size} x accumulation "
                 f"{b.gradient_accumulation_steps} x data {row_size(engine.mesh)}; mesh {dict(engine.mesh.shape)}; "
                 f"precision {engine.config.compute_dtype}")
    return "\n".join(lines)


def schedule_warning(config: Any) -> str | None:
    """The start-up line for a run shorter than its lr schedule (`--set run.steps=30` under a schedule
    sized for 200): it would end mid-warmup or at the peak lr with no word. None when it runs it all."""
    steps, sched = config.run.steps, config.scheduler
    longer = {k: n for k, n in schedule_extent(sched).items() if n > steps}
    if not longer or config.optimizer is None:
        return None
    lr = make_schedule(sched, config.optimizer.params.lr).lr
    key, length = list(longer.items())[-1]  # the whole schedule, or the longest part the run cuts short
    keys = ", ".join(f"{k}={n}" for k, n in longer.items())
    fix = f"set {key}={steps}" if " + " not in key else f"make {key} at most {steps}"
    fix += "".join(f" with {k} below it" for k in list(longer)[:-1])
    # the update of step n runs with the lr at update count n - 1 (metrics.jsonl's lr); both in one program
    ends, goes_on = np.asarray(jax.jit(jax.vmap(lr))(np.array([steps - 1, length - 1], np.int32))).tolist()
    return (f"warning: run.steps={steps} is shorter than the {sched.type} schedule ({keys}): the run ends at "
            f"lr {ends:.3e}, where the schedule goes on to lr {goes_on:.3e} at step "
            f"{length}; to run the whole schedule {fix}, or set run.steps={length}")


def comms_report(text: str, comms: Any, steps: int = 1, mesh: Any = None) -> str:
    """The comms logger's summary of the compiled step (`comms_logger` settings: prof_all/prof_ops,
    verbose, debug) for `steps` steps; given the `mesh`, each collective's row names the axes it spans."""
    kinds = None if comms.prof_all else {OP_NAMES[n] for n in comms.prof_ops}
    try:
        return hlo_comms_report(text, steps=steps, kinds=kinds, verbose=comms.verbose, debug=comms.debug, mesh=mesh)
    except ValueError as e:  # an HLO form the parser does not know: say so, never stop the run for it
        return f"comms logger: cannot read the compiled step's collectives ({e})"


def memory_table(engine: Engine) -> str:
    """DeepSpeed's memory_breakdown line at a print step: per device, the bytes its live arrays
    hold and - where the backend reports them (GPU) - the allocator's in-use and peak bytes; then
    the host process's resident memory."""
    import resource
    mib = 2 ** 20
    held = live_device_bytes()  # offloaded state is in host memory, counted by the RSS
    lines = ["memory breakdown: " + _measured_line(engine)]
    for device in jax.local_devices():
        stats = device.memory_stats() or {}
        extra = "".join(f", {label} {stats[key] / mib:.2f} MiB" for key, label in (
            ("bytes_in_use", "allocator in use"), ("peak_bytes_in_use", "peak"), ("bytes_limit", "limit"))
            if key in stats)
        lines.append(f"  {device}: live arrays {held.get(device, 0) / mib:.2f} MiB{extra}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    lines.append(f"  host process: peak resident {rss:.1f} MiB")
    return "\n".join(lines)


def flops_profile(engine: Engine, batch: Any, latency: float) -> str:
    """DeepSpeed's flops profile of one step: its matmul FLOPs from the compiled HLO (a scanned layer
    stack counted once per layer, where XLA's cost_analysis counts a while body once), that step's
    measured `latency` and the achieved TFLOPS; the FLOPs by module of the user's model, from the
    call stacks XLA keeps (`zerojax.measure.profile`), with the top modules at each depth and, with
    `detailed`, the call tree to `module_depth`; the parameters by path. A module's latency is its
    share of the step's FLOPs times the step's: the step runs as one program, with no per-module
    boundary to time. Nothing is trained here: the step timed is one of the run's own."""
    cfg = engine.config.flops_profiler
    placed = engine.place_batch(batch, engine.plan.batch.train_batch_size)
    # A cached executable keeps the call stacks of the code that first compiled it; keyed with them
    # here, a profile never names lines of an older version of the model.
    keyed = jax.config.jax_compilation_cache_include_metadata_in_key
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
    try:
        text = engine.train_step_fn.lower(engine.state, placed).compile().as_text()
    finally:
        jax.config.update("jax_compilation_cache_include_metadata_in_key", keyed)
    devices = engine.mesh.size  # the module is each device's program
    found = matmuls(text)
    flops = sum(m.flops for m in found) * devices
    backward = sum(m.flops for m in found if m.backward) * devices
    lines = [f"flops profile: {flops:.3e} FLOPs per step (all devices; forward {flops - backward:.3e}, backward "
             f"and recomputation {backward:.3e}), latency {1e3 * latency:.1f} ms, {flops / latency / 1e12:.3f} TFLOPS"]
    nodes, outside = call_tree(found)

    def row(node: Any, indent: str = "") -> str:
        share = node.flops / (flops / devices) if flops else 0.0
        return (f"{indent}{node.path[-1]}: {node.flops * devices:.3e} FLOPs ({share:.1%}; forward "
                f"{node.forward * devices:.3e}), ~{1e3 * latency * share:.2f} ms")
    if nodes:
        lines.append(f"top {cfg.top_modules} module(s) by FLOPs at each depth:")
        for depth, top in top_by_depth(nodes, cfg.top_modules, cfg.module_depth).items():
            lines += [f"  depth {depth}: " + row(n) for n in top]
        if cfg.detailed:
            lines.append("by module (the chain of calls in the model; forward and backward together):")
            lines += [row(n, "  " * len(p)) for p, n in sorted(nodes.items())
                      if cfg.module_depth < 0 or len(p) <= cfg.module_depth]
    if outside:
        lines.append(f"outside the model (the update and anything without a Python stack): "
                     f"{outside * devices:.3e} FLOPs")
    lines.append("parameters by path: " + parameter_counts(engine.params, cfg.module_depth))
    return "\n".join(lines)


def parameter_counts(params: Any, depth: int = -1) -> str:
    """Parameter counts grouped by the first `depth` keys of their paths (-1: the whole path)."""
    counts: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keys = path if depth < 0 else path[:max(depth, 1)]
        name = dotted(keys)
        counts[name] = counts.get(name, 0) + int(np.prod(leaf.shape))
    total = sum(counts.values())
    return f"{total:,} in all; " + ", ".join(f"{k} {v:,}" for k, v in counts.items())


