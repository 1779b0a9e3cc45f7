"""The whole training job of `python train.py --config ...`: data, model, engine, monitor, eval."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from zerojax.config import Config
from zerojax.errors import ConfigError, NonFiniteError
from zerojax.data import BatchSource, Loader, make_batches
from zerojax.distributed import agreed, interrupts_as_preemption, is_primary, local_rows, stop_requested
from zerojax.engine import Engine
from zerojax.hlo import work
from zerojax.layout import plan as make_plan
from zerojax.mesh import make_mesh
from zerojax.models import gpt
from zerojax.monitor import Monitor
from zerojax.nonfinite import NonFiniteGuard, stop_message
from zerojax.measure import array_bytes, live_device_bytes, step_memory
from zerojax.preemption import Preempted, bounded, stop_signals
from zerojax.preflight import check_memory, check_resume_tag, check_writable, resume_target
from zerojax.watchdog import FIRST_STEP_ALLOWANCE, beat, watching


#: Batches built ahead of the step that takes them (0: built in the loop, no thread).
PREFETCH_DEPTH = 2


def _run_dirs(path: Path) -> list[Path]:
    """`path`, `path-2`, `path-3`, ... that exist, in order."""
    dirs, n = [], 1
    while True:
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        if not candidate.exists():
            return dirs
        dirs.append(candidate)
        n += 1


def _has_run(path: Path) -> bool:
    return (path / "metrics.jsonl").exists() or (path / "config.json").exists()


def fresh_output_dir(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... if a previous run already wrote there: nothing is overwritten."""
    candidate, n = path, 1
    while _has_run(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate


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


def startup_table(engine: Engine, batch: Any = None, compiled: Any = None) -> str:
    """The plan's bytes per device against the ZeRO formula, what the arrays really hold, and - given
    a batch or the compiled step - what the compiled step takes on device and on host."""
    report = engine.memory_report()
    lines = [engine.partition_report()] if hasattr(engine, "partition_report") else []
    lines += [report.table(), _measured_line(engine)]
    if compiled is None and batch is not None:
        compiled = compile_step(engine, batch)
    if compiled is not None:
        lines.append(step_memory(compiled).line())
    b = engine.plan.batch
    lines.append(f"batch: {b.train_batch_size} = micro {b.micro_batch_size} x accumulation "
                 f"{b.gradient_accumulation_steps} x data {engine.plan.data_size}; mesh {dict(engine.mesh.shape)}; "
                 f"precision {engine.config.compute_dtype}")
    return "\n".join(lines)


def evaluate(engine: Engine, batches: BatchSource, n: int) -> float | None:
    if n == 0:
        return None
    return float(np.mean([float(engine.eval_batch(batches.batch(i, batches.local))) for i in range(n)]))


def _say(text: str) -> None:
    """Only process 0 prints (every process of a multi-process run would say the same)."""
    if is_primary():
        print(text, flush=True)


class Model(NamedTuple):
    """What train.py trains, before any data or engine: the layout (validated), the pipeline plan
    (mesh.stage > 1), and the unbuilt parameters and loss of a model given as code (the Llama)."""
    layout: Any
    pipeline: Any = None
    params: Any = None
    loss_fn: Any = None


def build_model(config: Config, mesh: Any) -> Model:
    """The model `model.*` names and its layout on `mesh`, as train.py builds them (benchmarks reuse
    it): a Llama through `from_nnx`, the embedded GPT, or the GPT cut into pipeline stages."""
    model_cfg = config.model
    pipeline = None
    params: Any = None
    loss_fn: Any = None
    if config.mesh.stage > 1 and (model_cfg.name != "gpt" or model_cfg.hf_checkpoint):
        what = "model.hf_checkpoint" if model_cfg.hf_checkpoint else f"model.name: {model_cfg.name}"
        raise ConfigError(f"mesh.stage: {config.mesh.stage} pipeline stages, but train.py pipelines only the "
                          f"embedded GPT trained from scratch ({what} given); set mesh.stage: 1 (ZeRO-3 shards "
                          f"the model over the data axis instead)")
    if config.mesh.stage > 1:  # the GPT as pipeline layers, cut into mesh.stage stages
        from zerojax.pipeline.step import make_pipeline_plan
        pipeline = make_pipeline_plan(config, mesh, gpt.pipeline_module(model_cfg, config.pipeline.partition))
        layout = pipeline.plan
    elif model_cfg.name == "llama":
        # The public path a user's NNX model takes: from_nnx(constructor, loss), built into its shards.
        from zerojax.models import llama
        from zerojax.sharded_init import abstract_params
        params, loss_fn = llama.build(model_cfg, config.run.seed)
        layout = make_plan(config, mesh, abstract_params(params))
    else:
        layout = make_plan(config, mesh, gpt.abstract_params(model_cfg))  # validates before data or compile
    return Model(layout, pipeline, params, loss_fn)


def build_engine(config: Config, mesh: Any, model: Model) -> Engine:
    """The engine of `model` with its parameters placed: read from `model.hf_checkpoint` (each device
    its own slices), or initialized straight into the sharded layout."""
    model_cfg, layout = config.model, model.layout
    pipeline, params, loss_fn = model.pipeline, model.params, model.loss_fn
    if pipeline is not None:
        from zerojax.pipeline.engine import PipelineEngine  # each stage initializes its own layers
        return PipelineEngine(config, pipeline.module, mesh, pipeline=pipeline)
    if model_cfg.hf_checkpoint:  # each device reads only its own slices of the checkpoint's tensors
        from zerojax.hf import load_params
        beat(f"reading {model_cfg.hf_checkpoint}", allowance=FIRST_STEP_ALLOWANCE)
        params = load_params(model_cfg.hf_checkpoint, model_cfg, layout.update_shardings)
    elif params is None:
        # Initialize straight into the sharded master layout: no device ever holds the whole model.
        params = jax.jit(lambda: gpt.init_params(model_cfg, config.run.seed),
                         out_shardings=layout.update_shardings)()
    loss_fn = loss_fn or gpt.make_loss_fn(model_cfg, config.activation_checkpointing)
    return Engine(config, params, loss_fn, mesh)


def train(config: Config, resume: str | None = None) -> dict[str, Any]:
    """Train the model the config names (`model.name`: the embedded GPT or a Llama) as it says; returns a summary (also written to summary.json).

    `resume` is None for a fresh run; "latest", a checkpoint tag, or the path of a run, checkpoint or
    tag folder to continue a run under `run.output_dir` exactly where its checkpoint left off (state,
    schedule and data position): `preflight.resume_target` says which run that is.
    A run that makes no progress for `distributed.hang_timeout` seconds fails (zerojax.watchdog).
    """
    with watching(config.distributed.hang_timeout):
        return _train(config, resume)


def _train(config: Config, resume: str | None) -> dict[str, Any]:
    start = time.perf_counter()
    if config.optimizer is None:  # a library user passes one in code; the command line has only the file
        raise ConfigError('optimizer: train.py trains with the config\'s optimizer section and this config has '
                          'none; add one, e.g. "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, or '
                          '--set optimizer.type=AdamW optimizer.params.lr=3e-4')
    mesh = make_mesh(config)
    model_cfg = config.model
    model = build_model(config, mesh)
    layout = model.layout
    rows = layout.batch.train_batch_size

    def choose_dirs() -> str:
        # process 0's host speaks for all (one answer, so no process is left waiting for another)
        check_memory(config, layout, rows // jax.process_count())  # before any batch is built
        base = Path(config.run.output_dir)
        shared = Path(config.run.checkpoint_dir) if config.run.checkpoint_dir else None
        tag = None
        try:
            if resume:
                runs = [d for d in _run_dirs(base) if _has_run(d)]
                out, ckpt_dir, tag = resume_target(runs, base, resume, shared)
                check_resume_tag(ckpt_dir, tag, config.run.steps, config.run.save_every)
            else:
                out = fresh_output_dir(base)
                ckpt_dir = shared or out / "checkpoints"
                _refuse_existing_checkpoints(ckpt_dir)
        except OSError as e:
            raise ConfigError(f"run.output_dir: cannot create {base} ({e.strerror or e}); choose a writable "
                              f"folder, e.g. --set run.output_dir=/path/you/own") from None
        check_writable(out, "run.output_dir")
        check_writable(ckpt_dir, "run.checkpoint_dir")
        return json.dumps([str(out), str(ckpt_dir), tag])

    # Process 0 picks the folders (it alone writes run files); every process writes checkpoint shards.
    out_name, ckpt_name, resume_tag = json.loads(agreed(choose_dirs))
    out, ckpt_dir = Path(out_name), Path(ckpt_name)
    mine = local_rows(layout.batch_sharding, rows)  # this process builds only its own rows
    # every data error (missing file, vocabulary, too short) is raised here, before compiling
    train_batches, val_batches = make_batches(config.data, rows, model_cfg.seq_len, model_cfg.vocab_size, mine)
    data_state = None

    engine = build_engine(config, mesh, model)
    del model
    if resume:
        beat(f"loading checkpoint {resume_tag or 'latest'} from {ckpt_dir}", allowance=FIRST_STEP_ALLOWANCE)
        path, _ = engine.load_checkpoint(str(ckpt_dir), resume_tag)
        train_batches.position = int(engine.loaded_extra.get("data_position", engine.global_steps))
        data_state = engine.loaded_extra.get("data_state")  # the grain iterator's state, where saved
        _say(f"resumed from {path} at step {engine.global_steps}")
    first_step = engine.global_steps + 1

    if is_primary() and not (out / "config.json").exists():
        (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    beat("compiling the train step", allowance=FIRST_STEP_ALLOWANCE)
    compiled = compile_step(engine, train_batches.batch(train_batches.position, train_batches.local))
    _say(startup_table(engine, compiled=compiled))
    comms = config.comms_logger
    comms_text = compiled.as_text() if comms.enabled else None
    if config.dump_state:
        _say(config.explain(engine.plan.data_size))
    _say(f"writing to {out}; checkpoints in {ckpt_dir}")
    monitor = Monitor(config, out, config.run.steps, tokens_per_step=rows * model_cfg.seq_len,
                      samples_per_step=rows, start_step=first_step - 1, enabled=is_primary())

    if monitor.replaced:
        monitor.print(f"metrics.jsonl: dropped {monitor.replaced} row(s) past step {first_step - 1} "
                      f"(written after that checkpoint by the run that stopped; this run writes them again)")
    guard = NonFiniteGuard(engine)

    def check_finite(record: dict[str, Any] | None = None, saving: bool = False) -> None:
        """At fetch points and before saves only: never a per-step host sync."""
        problem = guard.problem(record, saving=saving)
        if problem is not None:
            from zerojax.checkpoint import latest_tag
            engine.wait_for_checkpoint()
            raise NonFiniteError(stop_message(problem, engine.global_steps, latest_tag(ckpt_dir), ckpt_dir))

    saved_at = None  # the step of the last save: a stop right after a save_every save does not save twice

    def save(async_save: bool | None = None) -> None:
        nonlocal saved_at
        if saved_at == engine.global_steps:
            return
        check_finite(saving=True)  # a non-finite state is never saved, so `latest` stays the last good one
        beat(f"saving checkpoint global_step{engine.global_steps} (every process writes its shards, then "
             f"they meet in a barrier)")
        tag = engine.save_checkpoint(str(ckpt_dir), extra={"data_position": ahead.position,
                                                                   "data_state": ahead.state()},
                                     async_save=async_save)
        monitor.print(f"checkpoint {tag} -> {ckpt_dir}")
        saved_at = engine.global_steps

    first = last = None
    timers, breakdown = monitor.timers, config.wall_clock_breakdown
    step = first_step - 1
    stopped = False  # all processes agreed to stop early (multi-process SIGTERM or Ctrl-C)
    # grain builds the next batches in a thread while the step runs; its state counts the batches
    # taken, the data position a checkpoint saves.
    ahead = Loader(train_batches, depth=PREFETCH_DEPTH, state=data_state)
    try:
        with ahead, interrupts_as_preemption(), stop_signals() as signals:
            for step in range(first_step, config.run.steps + 1):
                beat(f"in train step {step} (its all-gathers and reduce-scatters, or waiting for step "
                     f"{step - 1} to finish)", f"step {step - 1} dispatched",
                     allowance=FIRST_STEP_ALLOWANCE if step == first_step else 1.0)  # compiled already, mostly
                timers.start("data")
                batch = next(ahead)
                timers.stop("data")
                profiling = config.flops_profiler.enabled and step == config.flops_profiler.profile_step
                if profiling:  # time this step alone: the previous one finishes first
                    jax.block_until_ready(engine.state)
                    started = time.perf_counter()
                timers.start("dispatch")
                metrics = engine.train_batch(batch)
                timers.stop("dispatch")
                if breakdown:  # DeepSpeed's timers synchronize too: the device time of this step
                    timers.start("device")
                    jax.block_until_ready(metrics)
                    timers.stop("device")
                if profiling:
                    jax.block_until_ready(metrics)
                    latency = time.perf_counter() - started
                    beat(f"profiling step {step} (compiles it once more)", allowance=FIRST_STEP_ALLOWANCE)
                    profile = flops_profile(engine, batch, latency)
                    if config.flops_profiler.output_file:  # DeepSpeed writes it there instead of stdout
                        if is_primary():
                            Path(config.flops_profiler.output_file).write_text(profile + "\n")
                    else:
                        monitor.print(profile)
                timers.start("log")
                record = monitor.step(step, metrics)
                timers.stop("log")
                if step % config.steps_per_print == 0:
                    if config.memory_breakdown:
                        monitor.print(memory_table(engine))
                    if comms_text is not None and step == config.steps_per_print * (
                            (first_step + config.steps_per_print - 1) // config.steps_per_print):
                        monitor.print(comms_report(comms_text, comms))  # the first print step
                if record is not None:
                    first = record["loss"] if first is None else first
                    last = record["loss"]
                if monitor.fetches(step):  # every process reads the loss here, not only the one that logs
                    check_finite({"loss": float(jax.device_get(metrics["loss"])), "step": step})
                if config.run.save_every and step % config.run.save_every == 0 and step < config.run.steps:
                    save()
                if signals.received is not None:
                    break
                if stop_requested(step):
                    stopped = True
                    break
    except NonFiniteError:
        monitor.close()
        raise
    except KeyboardInterrupt as e:
        code = getattr(e, "exit_code", 130)
        monitor.print(f"interrupted at step {engine.global_steps}: saving a checkpoint before exiting")
        with bounded(config.run.signal_save_seconds, code, "the checkpoint on interrupt"):
            try:
                if engine.global_steps >= first_step:
                    save(async_save=False)
                engine.wait_for_checkpoint()
            except RuntimeError as err:  # a second signal inside a step: its state buffers were donated
                monitor.print(f"no checkpoint: interrupted inside a step ({err}); the last saved one stands")
        monitor.close()
        raise
    try:  # every way out closes the writers (progress bar, metrics, TensorBoard, CSV)
        if signals.received is not None:
            monitor.print(f"{signals.name} after step {engine.global_steps}: saving a checkpoint before exiting "
                          f"(at most {config.run.signal_save_seconds} s)")
            with bounded(config.run.signal_save_seconds, 128 + signals.received, f"the checkpoint on {signals.name}"):
                if engine.global_steps >= first_step:
                    save(async_save=False)
                engine.wait_for_checkpoint()
            raise Preempted(signals.received)
        if stopped:
            monitor.print(f"stop requested: every process stopped after step {engine.global_steps}; saving a checkpoint")
            save(async_save=False)
            engine.wait_for_checkpoint()
            raise KeyboardInterrupt
        # A stop signal from here on lets the final save finish, then ends the run with its exit code.
        with stop_signals() as late:
            if engine.global_steps >= first_step:
                save()
            if late.received is None:
                if comms_text is not None and engine.global_steps >= first_step:
                    monitor.print(comms_report(comms_text, comms, steps=engine.global_steps - first_step + 1))
                beat("evaluating (compiles the eval step) and waiting for the last checkpoint",
                     f"step {engine.global_steps}", allowance=FIRST_STEP_ALLOWANCE)
                val_loss = evaluate(engine, val_batches, config.run.eval_batches)
            engine.wait_for_checkpoint()
        if late.received is not None:
            monitor.print(f"{late.name} during the final save: the checkpoint is complete; exiting")
            raise Preempted(late.received)
    finally:
        monitor.close()
    summary = {"steps": engine.global_steps, "first_loss": first, "last_loss": last, "val_loss": val_loss,
               "seconds": round(time.perf_counter() - start, 2), "output_dir": str(out),
               "checkpoint_dir": str(ckpt_dir)}
    if is_primary():
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    losses = f"loss {first:.4f} -> {last:.4f}" if first is not None else "no steps run"
    _say(f"done: {summary['steps']} steps, {losses}, validation loss "
         f"{val_loss if val_loss is None else round(val_loss, 4)}, {summary['seconds']} s, output in {out}")
    _print_sample(config, engine)
    return summary


def _print_sample(config: Config, engine: Engine) -> None:
    """A few generated tokens, so a finished run shows what it learned (`run.sample_tokens`, 0: off).
    The run is complete and saved by now: a failure here is reported, not raised."""
    if not config.run.sample_tokens or not is_primary():
        return
    from zerojax.sample import end_of_run_sample
    try:
        text = end_of_run_sample(config, engine.params)
    except Exception as e:  # noqa: BLE001 - the run itself succeeded
        print(f"sample: not generated ({type(e).__name__}: {e})", flush=True)
        return
    if text is not None:
        print(f"sample ({config.run.sample_tokens} tokens; more with zerojax sample --run DIR):\n{text}", flush=True)


def _refuse_existing_checkpoints(ckpt_dir: Path) -> None:
    """A fresh run never writes into checkpoints of another run."""
    from zerojax.checkpoint import latest_tag
    if ckpt_dir.exists() and latest_tag(ckpt_dir) is not None:
        raise ConfigError(f"run.checkpoint_dir: {ckpt_dir} already holds checkpoints (latest "
                          f"{latest_tag(ckpt_dir)}); pass --resume to continue that run, or choose "
                          f"another run.checkpoint_dir")


def comms_report(text: str, comms: Any, steps: int = 1) -> str:
    """The comms logger's summary of the compiled step (`comms_logger` settings: prof_all/prof_ops,
    verbose, debug) for `steps` steps."""
    from zerojax.hlo import OP_NAMES, comms_report as report
    kinds = None if comms.prof_all else {OP_NAMES[n] for n in comms.prof_ops}
    try:
        return report(text, steps=steps, kinds=kinds, verbose=comms.verbose, debug=comms.debug)
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
    # zerojax.hlo.work counts a scanned layer stack's matmuls once per layer (XLA's cost_analysis
    # counts a while body once, whatever its trip count)
    flops = work(compiled.as_text()).flops * engine.plan.data_size  # the module is one device's program
    return (f"flops profile: {flops:.3e} FLOPs per step (all devices), latency {1e3 * latency:.1f} ms, "
            f"{flops / latency / 1e12:.3f} TFLOPS")
