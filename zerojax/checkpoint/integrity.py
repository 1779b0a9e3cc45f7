"""Whether a saved tag can be trusted: the checksum of every file, verification, finite parameters.

A tag whose files changed after its save is an error naming the file and the newest older tag that
verifies; a tag whose parameters are not finite is written for inspection but never made `latest`.
"""
from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from zerojax.checkpoint.format import CHUNK, CheckpointError, PathLike, STATE_DIR, Unreadable, absolute, leaf_names, parse_meta, scan_tags, try_meta
from zerojax.checkpoint.pending import resolve_tag
from zerojax.core.layout import Plan
from zerojax.core.state import TrainState
from zerojax.core.nonfinite import finite_flags, float_leaves


def _file_crc(path: Path) -> tuple[int, str]:
    """Size and CRC-32 of one file, read in CHUNK pieces (about 2 GB/s on one core)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


def file_checksums(tag_dir: PathLike) -> dict[str, dict[str, Any]]:
    """`{path under the tag: {"bytes", "crc32"}}` of every file orbax committed under `state/`."""
    tag_dir = absolute(tag_dir)
    out = {}
    for path in sorted((tag_dir / STATE_DIR).rglob("*")):
        if path.is_file():
            size, crc = _file_crc(path)
            out[path.relative_to(tag_dir).as_posix()] = {"bytes": size, "crc32": crc}
    return out


def first_bad_file(tag_dir: Path, meta: Mapping[str, Any]) -> str | None:
    """What is wrong with the tag's files (None: every listed file is there, whole and unchanged)."""
    for name, want in meta.get("files", {}).items():
        path = tag_dir / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{path} has {size} bytes, the save wrote {want['bytes']} (truncated or overwritten)"
        if _file_crc(path)[1] != want["crc32"]:
            return f"{path} does not match its checksum (crc32 {want['crc32']} at save): its bytes changed"
    return None


def _problem(tag_dir: Path) -> str | None:
    """Why a complete tag cannot be trusted, or None when its metadata and every file verify."""
    try:
        meta = parse_meta(tag_dir)
    except Unreadable as e:
        return str(e)
    return first_bad_file(tag_dir, meta)


def corrupt_error(tag_dir: Path, problem: str) -> CheckpointError:
    """One message: which tag and file, and the newest older tag that does verify (with the command)."""
    root, tag = tag_dir.parent, tag_dir.name
    meta = try_meta(tag_dir)
    if meta is not None:
        before = (meta["step"], meta.get("saved_at", 0.0))
    else:  # unreadable metadata: a default tag still says its step
        step = tag[len("global_step"):] if tag.startswith("global_step") else ""
        before = (int(step), 0.0) if step.isdigit() else (math.inf, 0.0)
    older = [(t, m) for t, m in scan_tags(root)
             if t != tag and m.get("finite", True) and (m["step"], m.get("saved_at", 0.0)) < before]
    fallback = next((t for t, _ in reversed(older) if _problem(root / t) is None), None)
    if fallback is None:
        fix = f"no older checkpoint in {root} verifies: start again without --resume"
    else:
        fix = (f"the newest older checkpoint that verifies is {fallback}: continue from it with "
               f"`--resume {fallback}` (or engine.load_checkpoint({str(root)!r}, tag={fallback!r}))")
    return CheckpointError(f"checkpoint {tag_dir} is corrupt: {problem}. {fix}")


def verify(directory: PathLike, tag: str | None = None) -> str:
    """Check a tag's metadata and every file against the checksums of its save; returns the tag.

    Costs one streaming read of the tag (CRC-32 runs at about 2 GB/s per core). Raises one
    CheckpointError naming the file and the newest older tag that verifies. Tags written before
    checksums existed (format version 1) only have their metadata checked.
    """
    tag_dir = resolve_tag(absolute(directory), tag)
    problem = _problem(tag_dir)
    if problem is not None:
        raise corrupt_error(tag_dir, problem)
    return tag_dir.name


def nonfinite_params(state: TrainState, plan: Plan) -> list[str]:
    """Dotted names of the parameters (and fp32 master leaves) holding NaN or inf; [] when all finite.

    One reduction per leaf on the devices and one small transfer: cheap enough for every save, and
    for a trainer that wants to check before it saves.
    """
    found = float_leaves(state)  # the guard's program too (core.nonfinite): compiled once per run
    if not found:
        return []
    names = {field: leaf_names(getattr(state, field), field) for field, _, _ in found}
    ok = np.asarray(jax.device_get(finite_flags(plan.replicated)([x for *_, x in found])))
    return [names[field][i] for (field, i, _), fine in zip(found, ok) if not fine]


def read_meta(tag_dir: Path) -> dict[str, Any]:
    """The metadata of a tag, or one CheckpointError naming the file and the tag to use instead."""
    try:
        return parse_meta(tag_dir)
    except Unreadable as e:
        raise corrupt_error(tag_dir, str(e)) from None
