"""What a run reports: progress bar, steps_per_print lines, metrics.jsonl, TensorBoard, CSV, wandb and Comet events.

Metrics arrive as device scalars; they are fetched to the host only on logged steps, so the
training loop never waits on the device in between.
"""
from __future__ import annotations

import csv
import json
import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Mapping

import jax

from zerojax.config import Config, ConfigError

# DeepSpeed's monitor event names.
EVENTS = {"loss": "Train/Samples/train_loss", "lr": "Train/Samples/lr", "loss_scale": "Train/Samples/loss_scale"}
#: metrics.jsonl keys that are not events (the step's own beyond EVENTS); any other key is a loop's extra.
_NOT_EVENTS = ("step", "grad_norm", "skipped", "tokens_per_s")


def _installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it (tensorboardX's import pulls in
    comet_ml and matplotlib where they are installed: a second of start-up)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def check_monitors(config: Config) -> None:
    """The monitors' optional packages, checked at start-up so that a missing one fails before
    anything is compiled rather than after. Every process checks, so that all of them stop together."""
    if config.tensorboard.enabled and not _installed("tensorboardX"):  # its writer is made at the first event
        raise ConfigError("tensorboard.enabled: needs the `tensorboardX` package; pip install tensorboardX "
                          "(a dependency of zerojax), or set tensorboard.enabled: false")
    if config.wandb.enabled:
        try:
            import wandb  # noqa: F401  (optional dependency, imported only when used)
        except ImportError:
            raise ConfigError("wandb.enabled: needs the `wandb` package; pip install 'zerojax[wandb]' "
                              "(or set wandb.enabled: false)") from None
    if config.comet.enabled:
        try:
            import comet_ml  # noqa: F401  (optional dependency, imported only when used)
        except ImportError:
            raise ConfigError("comet.enabled: needs the `comet_ml` package; pip install 'zerojax[comet]' "
                              "(or set comet.enabled: false)") from None


def _wandb_run(config: Config, output_dir: Path) -> Any:
    """DeepSpeed's wandb.init(project, group, entity), plus the zerojax key `wandb.mode`. The run
    folder goes under WANDB_DIR when set, else under the run's output_dir (beside metrics.jsonl)."""
    import wandb  # optional dependency, imported only when used
    cfg = config.wandb
    return wandb.init(project=cfg.project, group=cfg.group, entity=cfg.team, mode=cfg.mode,
                      dir=None if os.environ.get("WANDB_DIR") else str(output_dir), config=config.to_dict())


def _comet_experiment(config: Config, output_dir: Path) -> Any:
    """DeepSpeed's comet_ml.start(api_key, project, workspace, experiment_key, mode, online) and
    set_name(experiment_name). Offline, the archive goes under COMET_OFFLINE_DIRECTORY when set, else
    under the run's output_dir (beside metrics.jsonl) rather than comet_ml's default in the cwd."""
    import comet_ml  # optional dependency, imported only when used
    from comet_ml.comet_start.experiment_config import ExperimentConfig
    cfg = config.comet
    folder = os.environ.get("COMET_OFFLINE_DIRECTORY") or str(output_dir / "comet")
    experiment = comet_ml.start(api_key=cfg.api_key, project=cfg.project, workspace=cfg.workspace,
                                experiment_key=cfg.experiment_key, mode=cfg.mode, online=cfg.online,
                                experiment_config=ExperimentConfig(offline_directory=folder))
    if cfg.experiment_name is not None:
        experiment.set_name(cfg.experiment_name)
    return experiment


def start_comet(config: Config, output_dir: Path) -> Any:
    """The run's Comet experiment, started before anything compiles. comet_ml does not raise when the
    server refuses the API key or cannot be reached: it logs an error and returns an experiment that
    is not alive, which would take the run's events and drop them. That is one error here, with the fix."""
    import comet_ml  # optional dependency, imported only when used
    fix = ("set a valid key in COMET_API_KEY (or comet.api_key), set comet.online: false to write an archive "
           "for `comet upload` later, or set comet.enabled: false")
    try:
        experiment = _comet_experiment(config, output_dir)
    except Exception as e:  # comet_ml's own errors: an old SDK, mode: get of an unknown experiment_key, ...
        raise ConfigError(f"comet: the Comet experiment did not start ({type(e).__name__}: {e}); {fix}") from None
    dead = not (getattr(experiment, "disabled", False) or isinstance(experiment, comet_ml.OfflineExperiment)
                or getattr(experiment, "alive", True))
    if dead:
        raise ConfigError("comet: the Comet experiment did not start (comet_ml's error above: the API key was "
                          "refused or the Comet server could not be reached), so nothing would be logged to "
                          f"Comet; {fix}")
    return experiment


class CometLog:
    """DeepSpeed's EventsLogScheduler: an event is logged when first seen, then again only once
    comet.samples_log_interval samples have passed since it was last logged."""

    def __init__(self, experiment: Any, samples_log_interval: int) -> None:
        self.experiment, self.interval = experiment, samples_log_interval
        self._last: dict[str, int] = {}

    def log(self, events: Mapping[str, float], samples: int) -> None:
        for name, value in events.items():
            if name in self._last and samples - self._last[name] < self.interval:
                continue
            self._last[name] = samples
            self.experiment.log_metric(name, value, step=samples)


class Timers:
    """Wall-clock totals per phase (DeepSpeed's wall_clock_breakdown), reset at each print.

    The trainer times data wait, dispatch (the host's part of a step), device (waiting for the
    step's results: the rest of its device time) and logging. Forward, backward and optimizer run
    inside one compiled program, so they are not timed apart (a jax.profiler trace shows them)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._start: dict[str, float] = {}

    def start(self, name: str) -> None:
        self._start[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - self._start.pop(name)

    ORDER = ("data", "dispatch", "device", "log")  # the loop's order; others follow

    def summary(self, steps: int) -> str:
        names = sorted(self.totals, key=lambda k: (self.ORDER.index(k) if k in self.ORDER else len(self.ORDER), k))
        parts = [f"{k} {1e3 * self.totals[k] / max(steps, 1):.1f} ms" for k in names]
        self.totals.clear()
        return "time per step: " + ", ".join(parts)


class Monitor:
    """Writes every logged step to metrics.jsonl and the enabled monitors; drives the progress bar."""

    def __init__(self, config: Config, output_dir: Path, total_steps: int, tokens_per_step: int,
                 samples_per_step: int, *, enabled: bool = True, start_step: int = 0, comet: Any = None):
        """`comet`: the run's experiment when already started (`start_comet`), else started here."""
        self.config, self.output_dir = config, output_dir
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.enabled = enabled
        self.timers = Timers()
        self._last_time, self._last_step = time.perf_counter(), start_step
        self._first_step = start_step + 1
        self._bar = None
        self._latest: tuple[int, Mapping[str, jax.Array]] | None = None  # the newest step not yet on the bar
        self._postfix: dict[str, Any] = {}
        self._tb = None
        self._csv: dict[str, Any] = {}
        self._wandb = None
        self._comet: CometLog | None = None
        self.replaced = 0  # metrics.jsonl rows past start_step dropped on resume
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.replaced = drop_rows_after(output_dir / "metrics.jsonl", start_step)
        self._jsonl = open(output_dir / "metrics.jsonl", "a")
        if config.run.progress:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True)
        if config.csv_monitor.enabled:
            self._csv_dir = self._monitor_dir(config.csv_monitor.output_path, config.csv_monitor.job_name)
            self._csv_dir.mkdir(parents=True, exist_ok=True)
        if config.wandb.enabled:
            self._wandb = _wandb_run(config, output_dir)
            folder = Path(self._wandb.dir).parent  # the run's files/ sit in its folder
            if getattr(self._wandb, "disabled", False):  # WANDB_MODE=disabled: wandb writes nothing
                self.print("wandb: disabled by WANDB_MODE; nothing is logged to wandb")
            else:
                self.print(f"wandb: run {self._wandb.id} in {folder}" + (
                    f" (offline: upload it with `wandb sync {folder}`)" if self._wandb.offline else ""))
        if config.comet.enabled:
            import comet_ml  # optional dependency, imported only when used
            experiment = comet if comet is not None else start_comet(config, output_dir)
            self._comet = CometLog(experiment, config.comet.samples_log_interval)
            if getattr(experiment, "disabled", False):
                self.print("comet: disabled by comet_ml's settings; nothing is logged to Comet")
            elif isinstance(experiment, comet_ml.OfflineExperiment):
                self.print(f"comet: offline experiment {experiment.get_key()}, archived in "
                           f"{experiment.offline_directory} when the run ends (upload it with `comet upload`)")
            else:
                self.print(f"comet: experiment {experiment.get_key()}")

    def _monitor_dir(self, output_path: str, job_name: str) -> Path:
        return Path(output_path or self.output_dir) / job_name

    def print(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def fetches(self, step: int) -> bool:
        """Whether `step`'s metrics come to the host (the same answer on every process): the only
        steps at which the run looks at values, so it never waits on the device in between."""
        return (step % self.config.run.log_every == 0 or step == self._first_step
                or step % self.config.steps_per_print == 0)

    def step(self, step: int, metrics: Mapping[str, jax.Array],
             extra: Mapping[str, float] | None = None) -> dict[str, Any] | None:
        """Advance to `step` (1-based); on logging steps fetch and write the metrics. `extra`: more
        scalars of this step a loop computed itself (an RLHF loop's reward and KL), written beside the
        step's own in metrics.jsonl, the printed line and the TensorBoard/CSV/wandb events (`zerojax plot`
        draws them)."""
        if self._bar is not None:
            self._bar_numbers(wait=False)  # the previous step's numbers, if the device has them by now
            self._bar.update(step - self._bar.n)
        cfg = self.config
        log = step % cfg.run.log_every == 0 or step == self._first_step
        show = step % cfg.steps_per_print == 0
        if not (self.enabled and self.fetches(step)):
            if self._bar is not None:
                self._latest = (step, metrics)
            return None
        self._latest = None
        values = {k: v.item() for k, v in jax.device_get(dict(metrics)).items() if v.ndim == 0}
        now = time.perf_counter()
        elapsed = now - self._last_time
        tokens_per_s = self.tokens_per_step * (step - self._last_step) / elapsed if elapsed > 0 else 0.0
        self._last_time, self._last_step = now, step
        record = {"step": step, "loss": values["loss"], "lr": values["lr"], "grad_norm": values["grad_norm"],
                  "loss_scale": values["loss_scale"], "skipped": bool(values["skipped"]),
                  "tokens_per_s": tokens_per_s, **{k: float(v) for k, v in (extra or {}).items()}}
        if log:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
            self._events(step, record)
        if self._bar is not None:
            self._postfix = {"step": step, "loss": f"{record['loss']:.3f}", "lr": f"{record['lr']:.2e}",
                             "tok_s": f"{tokens_per_s:,.0f}"}
            self._bar.set_postfix(self._postfix, refresh=False)
        if show:
            line = (f"step {step}: loss {record['loss']:.4f}, lr {record['lr']:.3e}, "
                    f"grad_norm {record['grad_norm']:.3f}, loss_scale {record['loss_scale']:g}, "
                    f"skipped {record['skipped']}, tokens/s {tokens_per_s:,.0f}")
            line += "".join(f", {k} {record[k]:.4g}" for k in extra or {})
            if cfg.wall_clock_breakdown:
                line += " | " + self.timers.summary(cfg.steps_per_print)
            self.print(line)
        return record

    def validation(self, step: int, val_loss: float, best: float | None = None) -> None:
        """A validation during the run (`run.eval_every`): a `{"step", "val_loss"}` row in metrics.jsonl
        (`zerojax plot` draws it), a Train/Samples/val_loss event in TensorBoard, CSV and wandb, and a
        printed line saying whether it beat `best`, the lowest one before it."""
        if not self.enabled:
            return
        record = {"step": step, "val_loss": val_loss}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._events(step, record)
        note = " (best so far)" if best is None or val_loss < best else f" (best {best:.4f})"
        self.print(f"step {step}: validation loss {val_loss:.4f}{note}")

    def _bar_numbers(self, wait: bool) -> None:
        """The bar shows the newest step whose numbers are on the host, named by its step, not the last
        logged step's: between fetches a step's loss and lr are taken once the device has them (no
        wait, so no per-step sync), or, `wait`, after the loop."""
        if self._latest is None or self._bar is None:
            return
        step, metrics = self._latest
        if not wait and not all(getattr(metrics[k], "is_ready", lambda: True)() for k in ("loss", "lr")):
            return
        loss, lr = (float(v) for v in jax.device_get((metrics["loss"], metrics["lr"])))
        self._postfix.update(step=step, loss=f"{loss:.3f}", lr=f"{lr:.2e}")  # tokens/s: the last fetch's
        self._bar.set_postfix(self._postfix, refresh=wait)
        self._latest = None

    def phase(self, text: str) -> None:
        """What runs after the last step (the final save, validation) says so: the bar shows the last
        step's numbers and the phase, and the line is printed."""
        if not self.enabled:
            return
        self._bar_numbers(wait=True)
        if self._bar is not None:
            self._bar.set_description(text.split(" ")[0], refresh=True)
        self.print(text)

    def _events(self, step: int, record: Mapping[str, Any]) -> None:
        samples = step * self.samples_per_step  # DeepSpeed's x axis: samples seen
        extra = {k: f"Train/Samples/{k}" for k in record if k not in EVENTS and k not in _NOT_EVENTS}
        events = {name: record[key] for key, name in {**EVENTS, **extra}.items() if key in record}
        if self.config.tensorboard.enabled and self._tb is None:
            # made at the first event, not at start: its import (with what it pulls in) is not paid
            # before the first step
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(self._monitor_dir(self.config.tensorboard.output_path,
                                                           self.config.tensorboard.job_name)))
        for name, value in events.items():
            if self._tb is not None:
                self._tb.add_scalar(name, value, samples)
            if self.config.csv_monitor.enabled:
                self._csv_row(name, samples, value)
        if self._wandb is not None:  # one history row per logged step, at DeepSpeed's step (samples seen)
            self._wandb.log(events, step=samples)
        if self._comet is not None:
            self._comet.log(events, samples)

    def _csv_row(self, name: str, samples: int, value: float) -> None:
        if name not in self._csv:
            path = self._csv_dir / (name.replace("/", "_") + ".csv")
            _drop_csv_rows_after(path, (self._first_step - 1) * self.samples_per_step)
            new = not path.exists()
            handle = open(path, "a", newline="")
            writer = csv.writer(handle)
            if new:
                writer.writerow(["step", name])
            self._csv[name] = (handle, writer)
        handle, writer = self._csv[name]
        writer.writerow([samples, value])
        handle.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for handle, _ in self._csv.values():
            handle.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._comet is not None:
            self._comet.experiment.end()


def _rewrite(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)


def drop_rows_after(path: Path, step: int) -> int:
    """A resumed run continues from its checkpoint's `step`: rows an earlier process wrote past it
    (it was killed before its next checkpoint) would be written again, so they go. Returns how many."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) > step:
                continue
        except (ValueError, KeyError, TypeError):  # a line cut short by the kill
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        _rewrite(path, kept)
    return len(lines) - len(kept)


def _drop_csv_rows_after(path: Path, samples: int) -> None:
    """The same for a CSV monitor file, whose rows are keyed by samples seen."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = lines[:1] + [l for l in lines[1:] if l.split(",")[0].strip().isdigit()
                        and int(l.split(",")[0]) <= samples and l.endswith("\n")]
    if kept != lines:
        _rewrite(path, kept)
