"""What a train.py run prints about its step: the memory table at start-up, DeepSpeed's
memory_breakdown, comms logger and flops profiler lines."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zerojax.config import OP_NAMES
from zerojax.measure.hlo import comms_report as hlo_comms_report, work
from zerojax.core.measure import array_bytes, live_device_bytes, step_memory
from zerojax.core.mesh import row_size
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
    """FLOPs of one step from the compiled HLO, with that step's measured `latency` (seconds) and
    the achieved TFLOPS. Nothing is trained here: the step timed is one of the run's own."""
    placed = engine.place_batch(batch, engine.plan.batch.train_batch_size)
    compiled = engine.train_step_fn.lower(engine.state, placed).compile()
    # zerojax.measure.hlo.work counts a scanned layer stack's matmuls once per layer (XLA's cost_analysis
    # counts a while body once, whatever its trip count)
    flops = work(compiled.as_text()).flops * engine.mesh.size  # the module is each device's program
    return (f"flops profile: {flops:.3e} FLOPs per step (all devices), latency {1e3 * latency:.1f} ms, "
            f"{flops / latency / 1e12:.3f} TFLOPS")
