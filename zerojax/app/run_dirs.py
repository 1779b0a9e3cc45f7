"""Where a train.py run writes: its output folder (never another run's) and its checkpoint folder.

Process 0 decides for every process (`choose`); a fresh run takes `run.output_dir`, or `-2`, `-3`, ...
when a run already wrote there, and never writes into another run's checkpoints; a resumed run finds
its folders from `--resume`. Process 0 holds a lock on both folders for the whole run, so a second run
on the same checkpoint folder is refused before it compiles anything (the other processes of a run
follow process 0's choice, `runtime.distributed.agreed`, and take no lock of their own).
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from zerojax.config import Config
from zerojax.core.layout import Plan
from zerojax.errors import ConfigError
from zerojax.runtime.preflight import check_memory, check_resume_tag, check_writable, resume_target
from zerojax.runtime.run_lock import RunLock

__all__ = ["RunFolders", "checkpoint_folder", "choose", "fresh_output_dir", "resolve_resume", "resume_argument"]

#: `--resume auto`: continue the run if it has a checkpoint, else start it
AUTO = "auto"


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


def _refuse_existing_checkpoints(ckpt_dir: Path) -> None:
    """A fresh run never writes into checkpoints of another run."""
    from zerojax.checkpoint import latest_tag
    if ckpt_dir.exists() and latest_tag(ckpt_dir) is not None:
        raise ConfigError(f"run.checkpoint_dir: {ckpt_dir} already holds checkpoints (latest "
                          f"{latest_tag(ckpt_dir)}); pass --resume to continue that run, or choose "
                          f"another run.checkpoint_dir")


class RunFolders(NamedTuple):
    """A run's folders, the tag it resumes (or None), and the locks process 0 holds on the output
    and checkpoint folders (one lock when they are the same folder)."""
    out: Path
    ckpt_dir: Path
    tag: str | None
    lock: RunLock | None
    created: tuple[Path, ...]   # folders this start made, deepest last
    ckpt_lock: RunLock | None = None

    def release(self, remove: bool = False) -> None:
        """The run is over: both locks go (`remove`: their files too)."""
        for lock in (self.ckpt_lock, self.lock):
            if lock is not None:
                lock.release(remove=remove)

    def abandon(self) -> None:
        """A start that failed: the locks go, and so do the folders it made that are still empty."""
        self.release(remove=True)
        for folder in reversed(self.created):
            try:
                folder.rmdir()
            except OSError:
                pass  # not empty (or gone): something else is in it


def _missing(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, outermost first."""
    out = []
    for p in (path, *path.parents):
        if p.exists():
            break
        out.append(p)
    return out[::-1]


def resolve_resume(config: Config, resume: str | None) -> str | None:
    """`--resume auto` is `--resume latest` when the run under run.output_dir (or run.checkpoint_dir)
    holds a checkpoint, else a fresh start (None): one command for a job that is started and restarted
    by a scheduler. Any other value is returned as it is."""
    if resume != AUTO:
        return resume
    from zerojax.checkpoint import latest_tag
    base = Path(config.run.output_dir)
    if config.run.checkpoint_dir:
        return "latest" if latest_tag(config.run.checkpoint_dir) is not None else None
    runs = [d for d in _run_dirs(base) if _has_run(d)]
    return "latest" if any(latest_tag(d / "checkpoints") is not None for d in runs) else None


def choose(config: Config, plan: Plan, resume: str | None, processes: int) -> RunFolders:
    """The run's folders, with every check done before any batch or compile: memory for this
    process's rows, the folders writable, a resume target that exists, and no other run writing to
    the output folder or the checkpoint folder (locks held until the run ends; a lock a killed run
    left is taken over, with a message). A check that fails leaves no new folder."""
    rows = plan.batch.train_batch_size
    check_memory(config, plan, rows // processes)
    base = Path(config.run.output_dir)
    shared = Path(config.run.checkpoint_dir) if config.run.checkpoint_dir else None
    created: list[Path] = []
    lock = ckpt_lock = None
    tag = None
    try:
        try:
            if resume:
                runs = [d for d in _run_dirs(base) if _has_run(d)]
                out, ckpt_dir, tag = resume_target(runs, base, resume, shared)
            else:
                created += _missing(base)
                out = fresh_output_dir(base)
                created += [out] if out != base and out not in created else []
                ckpt_dir = shared or out / "checkpoints"
        except OSError as e:
            raise ConfigError(f"run.output_dir: cannot create {base} ({e.strerror or e}); choose a writable "
                              f"folder, e.g. --set run.output_dir=/path/you/own") from None
        check_writable(out, "run.output_dir")
        lock = RunLock.hold(out)
        created += [p for p in _missing(ckpt_dir) if p not in created]
        check_writable(ckpt_dir, "run.checkpoint_dir")
        ckpt_lock = RunLock.hold(ckpt_dir, "run.checkpoint_dir")  # before reading it: no other run writes there
        if resume:
            # run.epochs: the length is known once the data is read, so any newer tag is in the way
            check_resume_tag(ckpt_dir, tag, None if config.run.epochs else config.run.steps, config.run.save_every)
        else:
            _refuse_existing_checkpoints(ckpt_dir)
    except BaseException:
        RunFolders(base, base, None, lock, tuple(created), ckpt_lock).abandon()
        raise
    return RunFolders(out, ckpt_dir, tag, lock, tuple(created), ckpt_lock)


def resume_argument(config: Config, out: Path) -> str:
    """What `--resume` takes to continue the run in `out` with the same config: "latest" when that
    finds this run (as `choose` would), else the run's folder, which picks it exactly."""
    base = Path(config.run.output_dir)
    shared = Path(config.run.checkpoint_dir) if config.run.checkpoint_dir else None
    try:
        found, _, _ = resume_target([d for d in _run_dirs(base) if _has_run(d)], base, "latest", shared)
    except ConfigError:
        return str(out)
    return "latest" if found == out else str(out)


def checkpoint_folder(path: str | Path, what: str = "export") -> Path:
    """The checkpoint folder `path` means: a run folder (its run.output_dir, holding config.json) gives
    its checkpoints (run.checkpoint_dir, else `checkpoints/`), so `export`, `sample` and `plot` all take
    the same run folder; any other folder is taken as a checkpoint folder itself."""
    import json
    from zerojax.config import load_config
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file() or (folder / "latest").is_file():
        return folder
    try:
        config = load_config(json.loads(cfg_file.read_text()))
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"{what}: {cfg_file} is not the config.json a train.py run writes ({e}); give the run's "
                          f"checkpoint folder instead") from None
    return Path(config.run.checkpoint_dir) if config.run.checkpoint_dir else folder / "checkpoints"
