"""The whole training job of `python train.py --config ...`: data, model, engine, monitor, eval.

`train` builds what the config names (`build_model`, `build_engine`), picks the run's folders
(`run_dirs`), and hands the loop to a `Run`; reports are `reports`' business.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np

from zerojax.app import run_dirs
from zerojax.app.monitor import Monitor, check_monitors, start_comet
from zerojax.app.reports import (comms_report, compile_step, flops_profile, memory_table, schedule_warning,
                                 startup_table)
from zerojax.checkpoint import latest_tag
from zerojax.config import Config, load_config
from zerojax.core.mesh import row_size
from zerojax.core.sharded_init import ParamsInit
from zerojax.core.nonfinite import NonFiniteGuard, stop_message
from zerojax.engine.engine import Engine
from zerojax.errors import ConfigError, NonFiniteError
from zerojax.models import gpt
from zerojax.planner.mesh import make_mesh
from zerojax.planner.plan import make_plan
from zerojax.runtime.data import BatchSource, Loader, make_batches
from zerojax.runtime.distributed import (agreed, check_consistency, interrupts_as_preemption, is_primary, local_rows,
                                        stop_requested)
from zerojax.runtime.preemption import Preempted, bounded, stop_signals
from zerojax.runtime.watchdog import FIRST_STEP_ALLOWANCE, beat, watching


#: Batches built ahead of the step that takes them (0: built in the loop, no thread).
PREFETCH_DEPTH = 2


def evaluate(engine: Engine, batches: BatchSource, n: int) -> float | None:
    if n == 0:
        return None
    return float(np.mean([float(engine.eval_batch(batches.batch(i, batches.local))) for i in range(n)]))


def _say(text: str) -> None:
    """Only process 0 prints (every process of a multi-process run would say the same)."""
    if is_primary():
        print(text, flush=True)


class Model(NamedTuple):
    """What train.py trains, before any data or engine: the plan (validated), the pipeline plan
    (mesh.stage > 1), and the unbuilt parameters and loss of a model given as code (the Llama)."""
    plan: Any
    pipeline: Any = None
    params: Any = None
    loss_fn: Any = None


def build_model(config: Config, mesh: Any) -> Model:
    """The model `model.*` names and its plan on `mesh`, as train.py builds them (benchmarks reuse
    it): a Llama through `from_nnx`, the embedded GPT, or the GPT cut into pipeline stages."""
    model_cfg = config.model
    pipeline = None
    params: Any = None
    loss_fn: Any = None
    unpipelined = model_cfg.name == "llama" and model_cfg.tie_embeddings
    if config.mesh.stage > 1 and (model_cfg.hf_checkpoint or unpipelined):
        what = "model.hf_checkpoint" if model_cfg.hf_checkpoint else "a Llama with model.tie_embeddings"
        raise ConfigError(f"mesh.stage: {config.mesh.stage} pipeline stages, but train.py pipelines the embedded GPT "
                          f"and an untied Llama (dense or MoE) trained from scratch ({what} given); set mesh.stage: 1 "
                          f"(ZeRO-3 shards the model over the data axis instead)")
    if config.mesh.stage > 1:  # the model as pipeline layers, cut into mesh.stage stages
        from zerojax.planner.pipeline import make_pipeline_plan
        from zerojax.models import llama
        family = llama if model_cfg.name == "llama" else gpt
        pipeline = make_pipeline_plan(config, mesh, family.pipeline_module(model_cfg, config.pipeline.partition))
        plan = pipeline.plan
    elif model_cfg.name == "llama":
        # The public path a user's NNX model takes: from_nnx(constructor, loss), built into its shards.
        from zerojax.models import llama
        params, loss_fn = llama.build(model_cfg, config.run.seed)
        plan = make_plan(config, mesh, params)  # unbuilt, with its annotations: the experts' `expert` dimension
    else:
        plan = make_plan(config, mesh, gpt.abstract_params(model_cfg))  # validates before data or compile
    return Model(plan, pipeline, params, loss_fn)


def build_engine(config: Config, mesh: Any, model: Model, compile_for: Any = None) -> Engine:
    """The engine of `model` with its parameters placed: read from `model.hf_checkpoint` (each device
    its own slices), or initialized straight into the sharded plan. `compile_for`: `Engine`'s (a first
    batch, whose train step compiles while the parameters initialize)."""
    model_cfg, plan = config.model, model.plan
    pipeline, params, loss_fn = model.pipeline, model.params, model.loss_fn
    if pipeline is not None:
        from zerojax.engine.pipeline import PipelineEngine  # each stage initializes its own layers
        return PipelineEngine(config, pipeline.module, mesh, pipeline=pipeline)
    if model_cfg.hf_checkpoint:  # each device reads only its own slices of the checkpoint's tensors
        from zerojax.models.hf import load_params
        beat(f"reading {model_cfg.hf_checkpoint}", allowance=FIRST_STEP_ALLOWANCE)
        params = load_params(model_cfg.hf_checkpoint, model_cfg, plan.init_shardings, seed=config.run.seed)
    elif params is None:
        # Initialized straight into the sharded master plan (no device ever holds the whole model), inside
        # the one program that makes the train state.
        params = ParamsInit(functools.partial(gpt.init_params, model_cfg, config.run.seed), plan.abstract_params)
    loss_fn = loss_fn or gpt.make_loss_fn(model_cfg, config.activation_checkpointing)
    from zerojax.models.decode import decoder
    return Engine(config, params, loss_fn, mesh, plan=plan, decode=decoder(model_cfg), compile_for=compile_for)


def from_hf(path: str | os.PathLike[str], config: Config | Mapping[str, Any] | str, *, mesh: Any = None,
            loss_fn: Any = None) -> Engine:
    """An engine that trains and generates, started from the transformers checkpoint folder `path`:
    what `zerojax.initialize` returns, built as train.py builds a run with `model.hf_checkpoint: path`
    (the model keys read from config.json, each device reading only its own slices of the weights, the
    model's decoder attached so `engine.generate` works).

    `config`: the run's DeepSpeed config (a Config, a dict or a file), without the model's size keys
    (they come from the checkpoint; one that disagrees is an error naming both values). `mesh`: default
    the config's. `loss_fn`: what `train_batch` minimises over the model's params; default the model's
    next-token loss (batches {"tokens": [B, T+1]}); e.g. `zerojax.models.rl.make_grpo_loss(engine.config.model)`
    for GRPO, whose model config is `zerojax.load_config(...)`'s with the same `model.hf_checkpoint`.
    """
    given = config.model.hf_checkpoint if isinstance(config, Config) else None
    if isinstance(config, Mapping):
        given = (config.get("model") or {}).get("hf_checkpoint")
    if given is not None and Path(given).expanduser().resolve() != Path(path).expanduser().resolve():
        raise ConfigError(f"model.hf_checkpoint: the config names {given}, but from_hf was given {path}; drop the "
                          f"key from the config (from_hf sets it) or pass the same folder")
    config = load_config(config, [f"model.hf_checkpoint={json.dumps(str(path))}"])
    if config.mesh.stage > 1:
        raise ConfigError(f"mesh.stage: {config.mesh.stage} pipeline stages, but from_hf builds one engine over the "
                          f"whole model; set mesh.stage: 1 (ZeRO-3 shards the model over the data axis instead)")
    mesh = mesh if mesh is not None else make_mesh(config)
    model = build_model(config, mesh)
    if loss_fn is not None:
        model = model._replace(loss_fn=loss_fn)
    return build_engine(config, mesh, model)


def train(config: Config, resume: str | None = None) -> dict[str, Any]:
    """Train the model the config names (`model.name`: the embedded GPT or a Llama) as it says; returns a summary (also written to summary.json).

    `resume` is None for a fresh run; "latest", a checkpoint tag, or the path of a run, checkpoint or
    tag folder to continue a run under `run.output_dir` exactly where its checkpoint left off (state,
    schedule and data position): `preflight.resume_target` says which run that is. A DeepSpeed
    checkpoint folder (`global_stepN/` or the folder holding `latest`) is imported into a new run's
    checkpoint folder first (app/deepspeed.py), then resumed the same way.
    A run that makes no progress for `distributed.hang_timeout` seconds fails (zerojax.runtime.watchdog).
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
    model = build_model(config, mesh)
    plan = model.plan
    if config.distributed.check_consistency:  # before choosing the folders, the first collective
        check_consistency(config, plan=plan, what="train.py")
    # `--resume PATH` of a DeepSpeed checkpoint: a fresh run whose first checkpoint is that one, imported.
    from zerojax.app.deepspeed import is_deepspeed_checkpoint
    deepspeed = resume if resume and is_deepspeed_checkpoint(resume) else None
    if deepspeed and model.pipeline is not None:
        raise ConfigError(f"--resume {deepspeed}: a DeepSpeed checkpoint continues with mesh.stage: 1 (any data "
                          f"mesh and ZeRO stage), not in a pipeline")

    # Process 0 picks the folders (it alone writes run files) and holds the run's lock; every process
    # writes checkpoint shards.
    folders: list[run_dirs.RunFolders] = []

    def choose() -> str:
        wanted = run_dirs.resolve_resume(config, resume)  # `--resume auto`: latest if there is one, else fresh
        folders.append(run_dirs.choose(config, plan, None if deepspeed else wanted, jax.process_count()))
        return json.dumps([str(folders[0].out), str(folders[0].ckpt_dir), folders[0].tag, wanted])

    out_name, ckpt_name, resume_tag, resume = json.loads(agreed(choose))
    out, ckpt_dir = Path(out_name), Path(ckpt_name)
    try:
        if deepspeed:  # every process places its shards; the tag is then resumed like any other
            from zerojax.app.deepspeed import import_into
            beat(f"importing DeepSpeed checkpoint {deepspeed}", allowance=FIRST_STEP_ALLOWANCE)
            resume_tag = import_into(deepspeed, ckpt_dir, plan, config).name
            _say(f"imported DeepSpeed checkpoint {deepspeed} as {ckpt_dir / resume_tag}")
        run = _start(config, mesh, model, out, ckpt_dir, resume, resume_tag)
    except BaseException:
        for f in folders:  # nothing was written: leave no empty folder and no lock behind
            f.abandon()
        raise
    del model
    try:
        try:
            first, last, val_loss = run.train()
        except KeyboardInterrupt as e:  # saved (or not) by now: say how to go on, for the command line
            if is_primary():
                e.resume = run_dirs.resume_argument(config, out) if latest_tag(ckpt_dir) else None  # type: ignore
            raise
        engine = run.engine
        summary = {"steps": engine.global_steps, "first_loss": first, "last_loss": last, "val_loss": val_loss,
                   "seconds": round(time.perf_counter() - start, 2), "output_dir": str(out),
                   "checkpoint_dir": str(ckpt_dir)}
        if is_primary():
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        losses = f"loss {first:.4f} -> {last:.4f}" if first is not None else "no steps run"
        _say(f"done: {summary['steps']} steps, {losses}, validation loss "
             f"{val_loss if val_loss is None else round(val_loss, 4)}, {summary['seconds']} s, output in {out}")
        _print_sample(config, engine, out)
    finally:
        for f in folders:
            f.release()
    return summary


def _start(config: Config, mesh: Any, model: Model, out: Path, ckpt_dir: Path, resume: str | None,
           resume_tag: str | None) -> "Run":
    """Data, engine and (resuming) the checkpoint, then the compiled step: every start-up check runs
    here, before the run writes anything."""
    plan, rows = model.plan, model.plan.batch.train_batch_size
    mine = local_rows(plan.batch_sharding, rows)  # this process builds only its own rows
    check_monitors(config)  # a monitor's missing package fails here, not after compiling
    # and a Comet key the server refuses (comet_ml only logs it): started before anything compiles
    comet = start_comet(config, out) if config.comet.enabled and is_primary() else None
    # every data error (missing file, vocabulary, too short) is raised here, before compiling
    train_batches, val_batches = make_batches(config.data, rows, config.model.seq_len, config.model.vocab_size, mine)
    steps = run_steps(config, train_batches)
    # the step compiles for the first batch while the state's program compiles: two compiles at once
    engine = build_engine(config, mesh, model, compile_for=train_batches.batch(train_batches.position,
                                                                                train_batches.local))
    data_state = None
    if resume:
        beat(f"loading checkpoint {resume_tag or 'latest'} from {ckpt_dir}", allowance=FIRST_STEP_ALLOWANCE)
        path, _ = engine.load_checkpoint(str(ckpt_dir), resume_tag)
        train_batches.position = int(engine.loaded_extra.get("data_position", engine.global_steps))
        data_state = engine.loaded_extra.get("data_state")  # the grain iterator's state, where saved
        _say(f"resumed from {path} at step {engine.global_steps}")
    return Run(config, engine, out, ckpt_dir, train_batches, val_batches, data_state, steps, comet=comet)


def run_steps(config: Config, batches: BatchSource) -> int:
    """The run's length: `run.steps`, or `run.epochs` passes over the training rows (the windows of a
    packed corpus, the documents of a padded one), rounded up to whole steps."""
    if config.run.epochs is None:
        return config.run.steps
    rows = batches.rows
    return max(int(np.ceil(config.run.epochs * batches.windows / rows - 1e-9)), 1)


def best_val_loss(ckpt_dir: Path) -> float | None:
    """The validation loss of the tag `best` names (a resumed run keeps beating the same record)."""
    from zerojax.checkpoint import best_tag, metadata
    tag = best_tag(ckpt_dir)
    if tag is None:
        return None
    value = metadata(ckpt_dir, tag).get("extra", {}).get("val_loss")
    return None if value is None else float(value)


class Run:
    """One train.py run once its folders, data and engine exist: the step loop, its saves and checks,
    and every way out (the end, a stop signal, Ctrl-C, a stop agreed across processes, a non-finite
    loss), each of which leaves the last good checkpoint complete."""

    def __init__(self, config: Config, engine: Engine, out: Path, ckpt_dir: Path, batches: BatchSource,
                 val_batches: BatchSource, data_state: Any, steps: int | None = None, comet: Any = None):
        self.config, self.engine, self.out, self.ckpt_dir = config, engine, out, ckpt_dir
        self.val_batches = val_batches
        self.steps = config.run.steps if steps is None else steps  # run.epochs: counted from the data
        self.first_step = engine.global_steps + 1
        beat("compiling the train step", allowance=FIRST_STEP_ALLOWANCE)
        compiled = compile_step(engine, batches.batch(batches.position, batches.local))
        if is_primary() and not (out / "config.json").exists():  # the first file of the run, once it can start
            (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        _say(startup_table(engine, compiled=compiled))
        self.comms_text = compiled.as_text() if config.comms_logger.enabled else None
        if config.dump_state:
            _say(config.explain(row_size(engine.mesh)))
        _say(f"writing to {out}; checkpoints in {ckpt_dir}")
        if config.run.epochs is not None:
            _say(f"run.epochs {config.run.epochs:g}: {self.steps} steps of {batches.rows} rows over {batches.windows} "
                 f"rows an epoch ({batches.windows / batches.rows:.1f} steps an epoch)")
        warning = schedule_warning(dataclasses.replace(config, run=dataclasses.replace(config.run, steps=self.steps)))
        if warning is not None:  # a run shorter than its lr schedule ends mid-schedule
            _say(warning)
        rows = engine.plan.batch.train_batch_size
        self.monitor = Monitor(config, out, self.steps, tokens_per_step=rows * config.model.seq_len,
                               samples_per_step=rows, start_step=self.first_step - 1, enabled=is_primary(),
                               comet=comet)
        if self.monitor.replaced:
            self.monitor.print(f"metrics.jsonl: dropped {self.monitor.replaced} row(s) past step "
                               f"{self.first_step - 1} (written after that checkpoint by the run that stopped; "
                               f"this run writes them again)")
        self.guard = NonFiniteGuard(engine)
        self.saved_at: int | None = None  # the last save's step: a stop right after a save does not save twice
        self.validated: tuple[int, float] | None = None  # the last validation's step and loss
        self.best = best_val_loss(ckpt_dir) if engine.global_steps else None  # the lowest validation loss saved
        self.first: float | None = None
        self.last: float | None = None
        # grain builds the next batches in a thread while the step runs; its state counts the batches
        # taken, the data position a checkpoint saves.
        self.ahead = Loader(batches, depth=PREFETCH_DEPTH, state=data_state)

    def check_finite(self, record: dict[str, Any] | None = None, saving: bool = False) -> None:
        """At fetch points and before saves only: never a per-step host sync."""
        problem = self.guard.problem(record, saving=saving)
        if problem is not None:
            self.engine.wait_for_checkpoint()
            raise NonFiniteError(stop_message(problem, self.engine.global_steps, latest_tag(self.ckpt_dir),
                                              self.ckpt_dir))

    def save(self, async_save: bool | None = None, best: bool = False) -> None:
        engine = self.engine
        if self.saved_at == engine.global_steps:
            return
        self.check_finite(saving=True)  # a non-finite state is never saved: `latest` stays the last good one
        beat(f"saving checkpoint global_step{engine.global_steps} (every process writes its shards, then "
             f"they meet in a barrier)")
        extra: dict[str, Any] = {"data_position": self.ahead.position, "data_state": self.ahead.state()}
        if self.validated is not None and self.validated[0] == engine.global_steps:
            extra["val_loss"] = self.validated[1]
        tag = engine.save_checkpoint(str(self.ckpt_dir), async_save=async_save, extra=extra, best=best)
        self.monitor.print(f"checkpoint {tag} -> {self.ckpt_dir}" + (" (best validation loss so far)" if best else ""))
        self.saved_at = engine.global_steps

    def save_and_wait(self) -> None:
        """The checkpoint of a run that stops early (nothing new to save right after a start)."""
        if self.engine.global_steps >= self.first_step:
            self.save(async_save=False)
        self.engine.wait_for_checkpoint()

    def train(self) -> tuple[float | None, float | None, float | None]:
        """Run the steps and end the run; (first logged loss, last logged loss, validation loss)."""
        config, monitor = self.config, self.monitor
        stopped = False  # all processes agreed to stop early (multi-process SIGTERM or Ctrl-C)
        try:
            with self.ahead, interrupts_as_preemption(), stop_signals() as signals:
                for step in range(self.first_step, self.steps + 1):
                    self.step(step)
                    if signals.received is not None:
                        break
                    if stop_requested(step):
                        stopped = True
                        break
        except NonFiniteError:
            monitor.close()
            raise
        except KeyboardInterrupt as e:
            monitor.print(f"interrupted at step {self.engine.global_steps}: saving a checkpoint before exiting")
            with bounded(config.run.signal_save_seconds, getattr(e, "exit_code", 130), "the checkpoint on interrupt"):
                try:
                    self.save_and_wait()
                except RuntimeError as err:  # a second signal inside a step: its state buffers were donated
                    monitor.print(f"no checkpoint: interrupted inside a step ({err}); the last saved one stands")
            monitor.close()
            raise
        try:  # every way out closes the writers (progress bar, metrics, TensorBoard, CSV)
            val_loss = self.end(signals, stopped)
            final = self.engine.last_metrics
            if final is not None and self.engine.global_steps >= self.first_step:
                self.last = float(jax.device_get(final["loss"]))  # the last step's, logged or not
            return self.first, self.last, val_loss
        finally:
            monitor.close()

    def step(self, step: int) -> None:
        """One train step with what accompanies it: data, timers, profiling, logging, checks, saves."""
        config, engine, monitor, timers = self.config, self.engine, self.monitor, self.monitor.timers
        beat(f"in train step {step} (its all-gathers and reduce-scatters, or waiting for step "
             f"{step - 1} to finish)", f"step {step - 1} dispatched",
             allowance=FIRST_STEP_ALLOWANCE if step == self.first_step else 1.0)  # compiled already, mostly
        timers.start("data")
        batch = next(self.ahead)
        timers.stop("data")
        profiling = config.flops_profiler.enabled and step == config.flops_profiler.profile_step
        if profiling:  # time this step alone: the previous one finishes first
            jax.block_until_ready(engine.state)
            started = time.perf_counter()
        timers.start("dispatch")
        metrics = engine.train_batch(batch)
        timers.stop("dispatch")
        if config.wall_clock_breakdown:  # DeepSpeed's timers synchronize too: the device time of this step
            timers.start("device")
            jax.block_until_ready(metrics)
            timers.stop("device")
        if profiling:
            jax.block_until_ready(metrics)
            self.profile(batch, time.perf_counter() - started, step)
        timers.start("log")
        record = monitor.step(step, metrics)
        timers.stop("log")
        if step % config.steps_per_print == 0:
            if config.memory_breakdown:
                monitor.print(memory_table(engine))
            every = config.steps_per_print
            if self.comms_text is not None and step == every * ((self.first_step + every - 1) // every):
                monitor.print(comms_report(self.comms_text, config.comms_logger, mesh=self.engine.mesh))  # the first print step
        if record is not None:
            self.first = record["loss"] if self.first is None else self.first
            self.last = record["loss"]
        if monitor.fetches(step):  # every process reads the loss here, not only the one that logs
            self.check_finite({"loss": float(jax.device_get(metrics["loss"])), "step": step})
        every = config.run.eval_every
        if every and (step % every == 0 or step == self.steps):
            self.validate(step)
        if config.run.save_every and step % config.run.save_every == 0 and step < self.steps:
            self.save()

    def validate(self, step: int) -> float:
        """`run.eval_batches` validation batches at `step` (the same ones each time), logged; with
        `run.save_best`, a loss below every earlier one saves this step as the folder's `best`."""
        config = self.config
        beat(f"validating after step {step} (the first time compiles the eval step)", allowance=FIRST_STEP_ALLOWANCE)
        loss = evaluate(self.engine, self.val_batches, config.run.eval_batches)
        assert loss is not None  # run.eval_every needs run.eval_batches >= 1 (a config rule)
        self.validated = (step, loss)
        improved = bool(np.isfinite(loss)) and (self.best is None or loss < self.best)
        self.monitor.validation(step, loss, self.best)
        if improved and config.run.save_best:
            self.best = loss
            if self.saved_at == step:  # saved already at this step: a later save cannot mark it
                self.monitor.print(f"step {step}: best validation loss, but its checkpoint was saved before "
                                   f"validating; `best` stays at the earlier one")
            else:
                self.save(best=True)
        elif improved:
            self.best = loss
        return loss

    def profile(self, batch: Any, latency: float, step: int) -> None:
        beat(f"profiling step {step} (compiles it once more)", allowance=FIRST_STEP_ALLOWANCE)
        profile = flops_profile(self.engine, batch, latency)
        output = self.config.flops_profiler.output_file
        if not output:
            self.monitor.print(profile)
        elif is_primary():  # DeepSpeed writes it there instead of stdout
            Path(output).write_text(profile + "\n")

    def end(self, signals: Any, stopped: bool) -> float | None:
        """After the loop: a stop signal or an agreed stop saves and raises; otherwise the final save,
        the comms summary and the evaluation. Returns the validation loss."""
        config, engine, monitor = self.config, self.engine, self.monitor
        if signals.received is not None:
            monitor.print(f"{signals.name} after step {engine.global_steps}: saving a checkpoint before exiting "
                          f"(at most {config.run.signal_save_seconds} s)")
            with bounded(config.run.signal_save_seconds, 128 + signals.received, f"the checkpoint on {signals.name}"):
                self.save_and_wait()
            raise Preempted(signals.received)
        if stopped:
            monitor.print(f"stop requested: every process stopped after step {engine.global_steps}; saving a "
                          f"checkpoint")
            self.save(async_save=False)
            engine.wait_for_checkpoint()
            raise KeyboardInterrupt
        val_loss = None
        # A stop signal from here on lets the final save finish, then ends the run with its exit code.
        with stop_signals() as late:
            if engine.global_steps >= self.first_step:
                if self.saved_at != engine.global_steps:
                    monitor.phase(f"saving final checkpoint global_step{engine.global_steps} to {self.ckpt_dir}...")
                self.save()
            if late.received is None:
                ran = engine.global_steps - self.first_step + 1
                if self.comms_text is not None and ran > 0:
                    monitor.print(comms_report(self.comms_text, config.comms_logger, steps=ran, mesh=self.engine.mesh))
                beat("evaluating (compiles the eval step) and waiting for the last checkpoint",
                     f"step {engine.global_steps}", allowance=FIRST_STEP_ALLOWANCE)
                if self.validated is not None and self.validated[0] == engine.global_steps:
                    val_loss = self.validated[1]  # run.eval_every validated this very step
                else:
                    if config.run.eval_batches:
                        monitor.phase(f"validating on {config.run.eval_batches} batch(es) after step "
                                      f"{engine.global_steps}...")
                    val_loss = evaluate(engine, self.val_batches, config.run.eval_batches)
            engine.wait_for_checkpoint()
        if late.received is not None:
            monitor.print(f"{late.name} during the final save: the checkpoint is complete; exiting")
            raise Preempted(late.received)
        return val_loss


def _print_sample(config: Config, engine: Engine, out: Path) -> None:
    """A few generated tokens, so a finished run shows what it learned (`run.sample_tokens`, 0: off).
    The run is complete and saved by now: a failure here is reported, not raised. Where the sample is
    not made because the run has several processes, the line says how to make one from the checkpoint."""
    from zerojax.app.sample import end_of_run_sample, samples_at_end
    if config.run.sample_tokens and jax.process_count() > 1 and is_primary():
        print(f"sample: not generated in a run of {jax.process_count()} processes; make one from the saved "
              f"checkpoint with `zerojax sample {out}`", flush=True)
        return
    if not samples_at_end(config) or not is_primary():
        return  # before `engine.params`: a multi-process pipeline's rows cannot be fetched by one process
    try:
        text = end_of_run_sample(config, engine.params, engine.plan)
    except Exception as e:  # noqa: BLE001 - the run itself succeeded
        print(f"sample: not generated ({type(e).__name__}: {e})", flush=True)
        return
    if text is not None:
        print(f"sample ({config.run.sample_tokens} tokens; more with zerojax sample RUN_DIR):\n{text}", flush=True)


