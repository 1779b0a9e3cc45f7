"""Where a train.py run writes: its output folder (never another run's) and its checkpoint folder.

Process 0 decides for every process (`choose`); a fresh run takes `run.output_dir`, or `-2`, `-3`, ...
when a run already wrote there, and never writes into another run's checkpoints; a resumed run finds
its folders from `--resume`.
"""
from __future__ import annotations

from pathlib import Path

from zerojax.config import Config
from zerojax.core.layout import Plan
from zerojax.errors import ConfigError
from zerojax.runtime.preflight import check_memory, check_resume_tag, check_writable, resume_target

__all__ = ["choose", "fresh_output_dir"]


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


def choose(config: Config, plan: Plan, resume: str | None, processes: int) -> tuple[Path, Path, str | None]:
    """(output folder, checkpoint folder, tag to resume or None), every check done before any batch or
    compile: memory for this process's rows, the folders writable, a resume target that exists."""
    rows = plan.batch.train_batch_size
    check_memory(config, plan, rows // processes)
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
    return out, ckpt_dir, tag
