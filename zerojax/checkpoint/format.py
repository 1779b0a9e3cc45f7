"""The on-disk layout of a checkpoint: tag folders, `meta.json`, the `latest` pointer, flat leaf names.

Every other module of the package reads and writes tags through these names and helpers; see the
package docstring for the layout.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import zlib
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import numpy as np

from zerojax.errors import ConfigError
from zerojax.core.names import dotted
from zerojax.core.state import TrainState


STATE_DIR = "state"


META_FILE = "meta.json"


LATEST_FILE = "latest"


BEST_FILE = ".best"               # the tag of the lowest validation loss (train.py's run.save_best); hidden,
                                  # so no tag name is taken from users (DeepSpeed's examples save tag="best")
BEST = "best"                     # what --tag names it by, when no tag of that name exists


PIPELINE_ROWS = "pipeline_rows"   # extra key: where a pipelined run's logical parameters sit in its rows


SAVING_FILE = ".zerojax-saving"  # written first into a tag folder, removed once meta.json is: marks a save in progress


FORMAT = "zerojax-checkpoint"


VERSION = 2                       # 2: meta.json lists a checksum of every file (1 is still read)


CHUNK = 1 << 22                   # bytes read at a time when checksumming: memory stays flat


PathLike = str | os.PathLike[str]


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as asked: another model, another optimizer, incomplete or corrupt."""


def absolute(path: PathLike) -> Path:
    """`path` with `~` expanded, made absolute against the current directory (not resolving
    symlinks): orbax refuses relative paths, and a later chdir must not move a checkpoint."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def leaf_names(tree: Any, prefix: str = "") -> list[str]:
    """Dotted path of every leaf, in `jax.tree.leaves` order; duplicates are an error."""
    names = [dotted(path, prefix) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"checkpoint: leaf names collide after joining with '.': {dup[:5]}; "
                              f"rename the keys that contain '.'")
    return names


def named_leaves(tree: Any, prefix: str) -> dict[str, Any]:
    return dict(zip(leaf_names(tree, prefix), jax.tree.leaves(tree)))


def truth_name(meta: Mapping[str, Any], name: str) -> str:
    """The saved array a parameter is read from: the tag's truth (its fp32 master) when the tag holds
    one for it, else its stored parameter (a leaf the saving run kept frozen has no master)."""
    truth = f"{meta['truth']}.{name}"
    return truth if truth in meta["leaves"] else f"params.{name}"


def state_fields(state: TrainState) -> Iterator[tuple[str, Any]]:
    """The fields that hold arrays (a None master means the params are their own master)."""
    for field, value in state._asdict().items():
        if value is not None:
            yield field, value


def flatten_state(state: TrainState) -> dict[str, Any]:
    """Every array of the state under its dotted name."""
    out: dict[str, Any] = {}
    for field, value in state_fields(state):
        out.update(named_leaves(value, field))
    return out


def describe_leaf(x: Any) -> dict[str, Any]:
    return {"shape": [int(d) for d in x.shape], "dtype": np.dtype(x.dtype).name}


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the whole new one, never a torn write (tmp + fsync + rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def default_tag(step: int) -> str:
    """DeepSpeed's default tag."""
    return f"global_step{step}"


def check_tag(tag: str) -> str:
    """A tag is one plain folder name (no separators, not hidden, not the pointer file)."""
    if (not isinstance(tag, str) or not tag or tag in (".", "..", LATEST_FILE) or tag.startswith(".")
            or "/" in tag or os.sep in tag or "\0" in tag):
        raise ConfigError(f"checkpoint tag {tag!r} is not a usable folder name; use letters, digits, "
                          f"'_', '-', '.' (not leading) such as 'global_step100'")
    return tag


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / META_FILE).is_file() and (tag_dir / STATE_DIR).is_dir()


def meta_crc(meta: Mapping[str, Any]) -> str:
    """CRC-32 of the metadata's canonical JSON (without its own checksum)."""
    body = {k: v for k, v in meta.items() if k != "meta_crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


class Unreadable(Exception):
    """meta.json exists but cannot be trusted; the message says why (turned into a CheckpointError)."""


def parse_meta(tag_dir: Path) -> dict[str, Any]:
    path = tag_dir / META_FILE
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        size = path.stat().st_size if path.is_file() else 0
        raise Unreadable(f"{path} is not readable JSON ({size} bytes; {type(e).__name__}: {e}): "
                          f"truncated or overwritten after the save") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise Unreadable(f"{path} does not hold checkpoint metadata")
    if "meta_crc32" in meta and meta["meta_crc32"] != meta_crc(meta):
        raise Unreadable(f"{path} does not match its own checksum (changed after the save)")
    return meta


def try_meta(tag_dir: Path) -> dict[str, Any] | None:
    """The metadata of a complete tag, or None when there is none or it cannot be trusted."""
    if not is_complete(tag_dir):
        return None
    try:
        return parse_meta(tag_dir)
    except Unreadable:
        return None


def is_primary_process() -> bool:
    return jax.process_index() == 0


def scan_tags(root: Path) -> list[tuple[str, dict[str, Any]]]:
    """(tag, metadata) of every complete tag with trustworthy metadata, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for tag_dir in root.iterdir():
        if tag_dir.is_dir() and not tag_dir.name.startswith("."):
            meta = try_meta(tag_dir)
            if meta is not None:
                found.append((int(meta["step"]), float(meta.get("saved_at", 0.0)), tag_dir.name, meta))
    return [(tag, meta) for *_, tag, meta in sorted(found, key=lambda x: x[:3])]


def list_tags(directory: PathLike) -> list[str]:
    """Complete tags, oldest first (by step, then by save time); leftovers of crashed saves and tags
    whose meta.json is unreadable are skipped."""
    return [tag for tag, _ in scan_tags(absolute(directory))]


def latest_tag(directory: PathLike) -> str | None:
    """The tag `latest` names if it is a plain name beside it (never `..` or a path: a crafted or
    stray pointer cannot lead a resume out of the folder) and complete, else the newest complete tag
    with finite parameters, else None."""
    root = absolute(directory)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        tag = pointer.read_text(errors="replace").strip()
        if tag and tag == Path(tag).name and tag not in (".", "..") and is_complete(root / tag):
            return tag
    finite = [tag for tag, meta in scan_tags(root) if meta.get("finite", True)]
    return finite[-1] if finite else None


def best_tag(directory: PathLike) -> str | None:
    """The tag the `.best` pointer names (the run's lowest validation loss) if it is a plain name beside
    it and complete, else None."""
    pointer = absolute(directory) / BEST_FILE
    if not pointer.is_file():
        return None
    tag = pointer.read_text(errors="replace").strip()
    if tag and tag == Path(tag).name and tag not in (".", "..") and is_complete(absolute(directory) / tag):
        return tag
    return None


@contextlib.contextmanager
def closing(ckptr: Any) -> Iterator[Any]:
    """Orbax checkpointers hold threads and files until closed (they are not context managers)."""
    try:
        yield ckptr
    finally:
        ckptr.close()
