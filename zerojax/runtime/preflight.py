"""Checks that need the machine (folders, checkpoints, memory) but no compile: a run that cannot
finish fails here, in seconds, with the fix - not after training, or at the kernel's OOM killer."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import jax

from zerojax.config import Config
from zerojax.core.mesh import row_size
from zerojax.errors import ConfigError

GIB = 2 ** 30


def check_writable(path: Path, key: str) -> None:
    """`path` exists (created if need be) and takes a new file: a read-only or misnamed folder is found
    now, not at the first checkpoint or when a finished run writes its summary."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".zerojax-write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: cannot write to {path} ({e.strerror or e}); choose a writable folder, e.g. "
                          f"--set {key}=/path/you/own") from None


# ---------------------------------------------------------------------------------------------
# Which checkpoint `--resume` continues.

def _tags(ckpt_dir: Path) -> list[str]:
    from zerojax.checkpoint import list_tags
    return list_tags(ckpt_dir)


def check_resume_tag(ckpt_dir: Path, tag: str | None, steps: int | None = None, save_every: int = 0) -> None:
    """`--resume TAG` must exist, and the run from it must not reach a tag that is already saved:
    training on would get there and then refuse to overwrite it, after all that work. The run
    saves `global_step<k>` every `save_every` steps and at `steps` (None: any newer tag collides)."""
    tags = _tags(ckpt_dir)
    if tag is None:
        if not tags:
            raise ConfigError(f"--resume: no complete checkpoint in {ckpt_dir}; start without --resume")
        return
    if tag not in tags:
        raise ConfigError(f"--resume {tag}: no complete checkpoint {tag} in {ckpt_dir}; complete tags: "
                          f"{', '.join(tags) or 'none'}")
    newer = tags[tags.index(tag) + 1:]
    if steps is not None:  # exactly the tags this run will write that a save already holds
        from zerojax.checkpoint import META_FILE, metadata
        start = int(metadata(ckpt_dir, tag)["step"])
        written = [f"global_step{k}" for k in range(start + 1, steps + 1)
                   if k == steps or (save_every and k % save_every == 0)]
        newer = [t for t in written if (ckpt_dir / t / META_FILE).exists()]
    if newer:
        shown = ", ".join(newer[:5]) + (f" and {len(newer) - 5} more" if len(newer) > 5 else "")
        raise ConfigError(f"--resume {tag}: {ckpt_dir} already holds newer checkpoints ({shown}) that this run "
                          f"would have to overwrite; continue the newest with --resume (no tag), or move the "
                          f"newer tags out of {ckpt_dir} first to branch from {tag}")


def resume_target(runs: list[Path], base: Path, resume: str, shared_ckpt: Path | None
                  ) -> tuple[Path, Path, str | None]:
    """(run folder, checkpoint folder, tag or None for the latest) that `--resume [TAG|PATH]` means.

    `runs`: the earlier runs under `run.output_dir` (it, then its `-2`, `-3`, ... suffixed copies).
    `resume` may be a path (a run folder, its checkpoint folder, or a tag folder), which picks exactly.
    Otherwise the runs that hold a checkpoint (with TAG, if given) are the candidates: one is taken,
    several are listed with the exact command for each.
    """
    tag = None if resume == "latest" else resume
    if tag is not None and (os.sep in tag or Path(tag).is_dir()):
        return _resume_path(Path(tag), runs)
    if shared_ckpt is not None:  # one run.checkpoint_dir for every run: continue the newest run
        if not runs:
            raise ConfigError(f"--resume: no earlier run under run.output_dir={base}; start without --resume")
        return runs[-1], shared_ckpt, tag
    found = [(r, _tags(r / "checkpoints")) for r in runs]
    candidates = [(r, tags) for r, tags in found if tags and (tag is None or tag in tags)]
    what = f"checkpoint {tag}" if tag else "checkpoint"
    if not candidates:
        where = ", ".join(str(r) for r in runs) if runs else f"run.output_dir={base}"
        existing = "; ".join(f"{r}: {', '.join(tags)}" for r, tags in found if tags)
        raise ConfigError(f"--resume: no {what} under {where}"
                          + (f" (complete tags: {existing})" if existing else "")
                          + "; start without --resume, or name a tag or run folder that exists")
    if len(candidates) > 1:
        lines = "; ".join(f"--resume {r} (latest {tags[-1]})" for r, tags in candidates)
        raise ConfigError(f"--resume: {len(candidates)} runs under run.output_dir={base} hold a {what}: pick one "
                          f"with {lines}")
    run, _ = candidates[0]
    return run, run / "checkpoints", tag


def _resume_path(path: Path, runs: list[Path]) -> tuple[Path, Path, str | None]:
    if (path / "checkpoints").is_dir():
        return path, path / "checkpoints", None
    if _tags(path):
        return (path.parent if path.name == "checkpoints" else runs[-1] if runs else path.parent), path, None
    if path.name in _tags(path.parent):
        ckpt = path.parent
        return (ckpt.parent if ckpt.name == "checkpoints" else runs[-1] if runs else ckpt.parent), ckpt, path.name
    raise ConfigError(f"--resume {path}: not a run folder, a checkpoint folder or a complete checkpoint tag")


# ---------------------------------------------------------------------------------------------
# Memory.

def _host_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def activation_bytes(config: Config, micro_rows: int) -> int:
    """A rough lower estimate of the embedded GPT's activations for one micro-batch on one device:
    each block's input is kept (all of a block's tensors without `model.remat`), one block is
    live in full during its backward, and the fp32 logits and their gradient. With a sequence axis a
    device holds 1/sequence of each row's tokens (and of the heads over the whole row in attention,
    so the score term per token is unchanged)."""
    m = config.model
    width = {"bf16": 2, "fp16": 2}.get(config.compute_dtype, 4)
    tokens = micro_rows * m.seq_len // config.mesh.sequence
    block = tokens * (10 * m.d_model + 2 * (m.d_ff or 4 * m.d_model) + 2 * m.n_heads * m.seq_len) * width
    kept = m.n_layers * (tokens * m.d_model * width if m.remat else block)
    return kept + block + tokens * m.vocab_size * 4 * 2


def check_memory(config: Config, layout: Any, local_rows: int) -> None:
    """The plan's bytes per device + an activation estimate against the device's memory limit, and the
    host's share (the batch built on the host; on CPU the devices' memory too) against free memory."""
    b = layout.batch
    report = layout.report()
    act = activation_bytes(config, b.micro_batch_size)
    device = report.device + act
    batch_host = local_rows * (config.model.seq_len + 1) * 13  # int64 window indices, bytes, int32 tokens
    local = jax.local_devices()
    stats = local[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    fix = ("lower train_micro_batch_size_per_gpu (or train_batch_size; gradient_accumulation_steps keeps the "
           "global batch), keep model.remat on, or shard more (a higher zero_optimization.stage, offload)")
    detail = (f"model state {report.device / GIB:.2f} GiB from the plan + activations ~{act / GIB:.2f} GiB "
              f"for {b.micro_batch_size} rows x {config.model.seq_len} tokens per micro-step")
    if limit:
        if device > limit:
            raise ConfigError(f"train_batch_size: {b.train_batch_size} needs about {device / GIB:.2f} GiB per "
                              f"device ({detail}) but {local[0].device_kind} has {limit / GIB:.2f} GiB; {fix}")
        host = batch_host + report.host * len(local)
    else:  # CPU devices live in host memory
        host = batch_host + device * len(local)
    available = _host_available()
    if available is not None and host > available:
        if batch_host * 2 > host:  # the batch itself is the problem, not the model
            fix = (f"lower train_batch_size (micro {b.micro_batch_size} x accumulation "
                   f"{b.gradient_accumulation_steps} x data {row_size(layout.mesh)}): every optimizer step builds "
                   f"its whole batch on the host")
        raise ConfigError(f"train_batch_size: {b.train_batch_size} needs about {host / GIB:,.2f} GiB of host "
                          f"memory (this process's {local_rows} rows of each batch: {batch_host / GIB:,.2f} GiB"
                          + ("" if limit else f"; per device: {detail}; {len(local)} devices") +
                          f") but {available / GIB:.2f} GiB is available; {fix}")
