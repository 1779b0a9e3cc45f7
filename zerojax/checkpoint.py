"""Checkpoints as pure functions over a TrainState and a Plan, stored with orbax.

On disk (DeepSpeed's shape: one folder per tag and a `latest` pointer)::

    directory/
      latest            the newest complete tag (plain text)
      <tag>/state/      orbax PyTree checkpoint: every array of the state, each process writes its shards
      <tag>/meta.json   step counters, precision, leaf names/shapes/dtypes, the caller's `extra`,
                        the size and CRC-32 of every file under state/, and a CRC-32 of itself

`meta.json` is written last, after orbax has committed, so it is the mark of a complete tag: a
folder without it is the leftover of an interrupted save and is never listed, loaded or pointed
at by `latest`. Its checksums make a complete tag verifiable: a file that was truncated, zeroed,
bit-flipped or removed after the save is an error at load and export, never silent garbage.
A tag whose parameters are not finite is written (for inspection) but never becomes `latest`.
Paths may be relative: they are made absolute once, where they enter this module. Arrays are stored under flat dotted names ("master.blocks.fc.kernel"), so
a checkpoint is independent of the mesh and ZeRO stage that wrote it: `load` reads it into the
layout of whatever plan it is given, shard by shard, using `abstract_state(plan)` as targets.
"""
from __future__ import annotations

import collections
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import contextlib
import functools
import json
import math
import os
import shutil
import struct
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from zerojax.errors import ConfigError
from zerojax.layout import Plan
from zerojax.names import dotted, join
from zerojax.offload import to_device
from zerojax.state import TrainState, abstract_state, init_state
from zerojax.precision import leaf_finite

STATE_DIR = "state"
META_FILE = "meta.json"
LATEST_FILE = "latest"
PIPELINE_ROWS = "pipeline_rows"   # extra key: where a pipelined run's logical parameters sit in its rows
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


# ---------------------------------------------------------------------------------------------
# Leaf names: one dotted string per array, the same on every mesh and stage.

def leaf_names(tree: Any, prefix: str = "") -> list[str]:
    """Dotted path of every leaf, in `jax.tree.leaves` order; duplicates are an error."""
    names = [dotted(path, prefix) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"checkpoint: leaf names collide after joining with '.': {dup[:5]}; "
                              f"rename the keys that contain '.'")
    return names


def _named(tree: Any, prefix: str) -> dict[str, Any]:
    return dict(zip(leaf_names(tree, prefix), jax.tree.leaves(tree)))


def _state_fields(state: TrainState) -> Iterator[tuple[str, Any]]:
    """The fields that hold arrays (a None master means the params are their own master)."""
    for field, value in state._asdict().items():
        if value is not None:
            yield field, value


def flatten_state(state: TrainState) -> dict[str, Any]:
    """Every array of the state under its dotted name."""
    out: dict[str, Any] = {}
    for field, value in _state_fields(state):
        out.update(_named(value, field))
    return out


def _describe(x: Any) -> dict[str, Any]:
    return {"shape": [int(d) for d in x.shape], "dtype": np.dtype(x.dtype).name}


# ---------------------------------------------------------------------------------------------
# Files: small atomic writes, tags, completeness.

def _write_atomic(path: Path, text: str) -> None:
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


def _is_complete(tag_dir: Path) -> bool:
    return (tag_dir / META_FILE).is_file() and (tag_dir / STATE_DIR).is_dir()


def _meta_crc(meta: Mapping[str, Any]) -> str:
    """CRC-32 of the metadata's canonical JSON (without its own checksum)."""
    body = {k: v for k, v in meta.items() if k != "meta_crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


class _Unreadable(Exception):
    """meta.json exists but cannot be trusted; the message says why (turned into a CheckpointError)."""


def _parse_meta(tag_dir: Path) -> dict[str, Any]:
    path = tag_dir / META_FILE
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        size = path.stat().st_size if path.is_file() else 0
        raise _Unreadable(f"{path} is not readable JSON ({size} bytes; {type(e).__name__}: {e}): "
                          f"truncated or overwritten after the save") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise _Unreadable(f"{path} does not hold checkpoint metadata")
    if "meta_crc32" in meta and meta["meta_crc32"] != _meta_crc(meta):
        raise _Unreadable(f"{path} does not match its own checksum (changed after the save)")
    return meta


def _try_meta(tag_dir: Path) -> dict[str, Any] | None:
    """The metadata of a complete tag, or None when there is none or it cannot be trusted."""
    if not _is_complete(tag_dir):
        return None
    try:
        return _parse_meta(tag_dir)
    except _Unreadable:
        return None


def _read_meta(tag_dir: Path) -> dict[str, Any]:
    """The metadata of a tag, or one CheckpointError naming the file and the tag to use instead."""
    try:
        return _parse_meta(tag_dir)
    except _Unreadable as e:
        raise _corrupt(tag_dir, str(e)) from None


@contextlib.contextmanager
def _closing(ckptr: Any) -> Iterator[Any]:
    """Orbax checkpointers hold threads and files until closed (they are not context managers)."""
    try:
        yield ckptr
    finally:
        ckptr.close()


def _primary() -> bool:
    return jax.process_index() == 0


_SYNCS = iter(range(1 << 62))
_COMMITS: collections.Counter = collections.Counter()


def _sync(name: str) -> None:
    """A barrier across processes (every process calls the same functions in the same order)."""
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(f"zerojax_checkpoint_{name}_{next(_SYNCS)}")


def _scan(root: Path) -> list[tuple[str, dict[str, Any]]]:
    """(tag, metadata) of every complete tag with trustworthy metadata, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for tag_dir in root.iterdir():
        if tag_dir.is_dir() and not tag_dir.name.startswith("."):
            meta = _try_meta(tag_dir)
            if meta is not None:
                found.append((int(meta["step"]), float(meta.get("saved_at", 0.0)), tag_dir.name, meta))
    return [(tag, meta) for *_, tag, meta in sorted(found, key=lambda x: x[:3])]


def list_tags(directory: PathLike) -> list[str]:
    """Complete tags, oldest first (by step, then by save time); leftovers of crashed saves and tags
    whose meta.json is unreadable are skipped."""
    return [tag for tag, _ in _scan(absolute(directory))]


def latest_tag(directory: PathLike) -> str | None:
    """The tag `latest` names if it is complete, else the newest complete tag with finite
    parameters, else None."""
    root = absolute(directory)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        tag = pointer.read_text(errors="replace").strip()
        if tag and "/" not in tag and _is_complete(root / tag):
            return tag
    finite = [tag for tag, meta in _scan(root) if meta.get("finite", True)]
    return finite[-1] if finite else None


def metadata(directory: PathLike, tag: str | None = None) -> dict[str, Any]:
    """The JSON metadata of a complete tag (None: latest): counters, precision, leaves, `extra`."""
    return _read_meta(_resolve(absolute(directory), tag))


def _resolve(root: Path, tag: str | None) -> Path:
    """The folder of a complete tag, or an error that names the path and what exists instead."""
    _wait_pending(root)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    if tag is None:
        tag = latest_tag(root)
        if tag is None:
            raise FileNotFoundError(f"no complete checkpoint in {root} (no tag folder with {META_FILE})")
    tag_dir = root / check_tag(tag)
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"checkpoint {tag_dir} does not exist; complete tags in {root}: "
                                f"{list_tags(root) or 'none'}")
    if not _is_complete(tag_dir):
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete (its save was interrupted: no "
                              f"{META_FILE}); use a complete tag: {list_tags(root) or 'none'}")
    return tag_dir


def prune(directory: PathLike, max_to_keep: int | None = None,
          keep_every_n_steps: int | None = None) -> list[str]:
    """Delete old complete tags: keep the newest `max_to_keep`, every multiple of
    `keep_every_n_steps`, and always the tag `latest` resolves to. Returns the deleted tags."""
    if max_to_keep is None:
        return []
    if max_to_keep < 1:
        raise ConfigError(f"prune: max_to_keep must be >= 1, got {max_to_keep}")
    root = absolute(directory)
    tags = _scan(root)
    keep = {tag for tag, _ in tags[-max_to_keep:]} | {latest_tag(root)}
    deleted = []
    for tag, meta in tags:
        if tag in keep or (keep_every_n_steps and int(meta["step"]) % keep_every_n_steps == 0):
            continue
        (root / tag / META_FILE).unlink()  # first make it incomplete, so a half-deleted tag is never loaded
        shutil.rmtree(root / tag)
        deleted.append(tag)
    return deleted


# ---------------------------------------------------------------------------------------------
# Integrity: a checksum of every file of a tag, checked before anything is read from it.

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


def _first_bad_file(tag_dir: Path, meta: Mapping[str, Any]) -> str | None:
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
        meta = _parse_meta(tag_dir)
    except _Unreadable as e:
        return str(e)
    return _first_bad_file(tag_dir, meta)


def _corrupt(tag_dir: Path, problem: str) -> CheckpointError:
    """One message: which tag and file, and the newest older tag that does verify (with the command)."""
    root, tag = tag_dir.parent, tag_dir.name
    meta = _try_meta(tag_dir)
    if meta is not None:
        before = (meta["step"], meta.get("saved_at", 0.0))
    else:  # unreadable metadata: a default tag still says its step
        step = tag[len("global_step"):] if tag.startswith("global_step") else ""
        before = (int(step), 0.0) if step.isdigit() else (math.inf, 0.0)
    older = [(t, m) for t, m in _scan(root)
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
    tag_dir = _resolve(absolute(directory), tag)
    problem = _problem(tag_dir)
    if problem is not None:
        raise _corrupt(tag_dir, problem)
    return tag_dir.name


# ---------------------------------------------------------------------------------------------
# Finite parameters: a tag whose parameters hold NaN or inf never becomes `latest`.

@functools.lru_cache(maxsize=8)
def _finite_flags(replicated: Any) -> Any:
    return jax.jit(lambda leaves: leaf_finite(to_device(leaves)), out_shardings=replicated)


def nonfinite_params(state: TrainState, plan: Plan) -> list[str]:
    """Dotted names of the parameters (and fp32 master leaves) holding NaN or inf; [] when all finite.

    One reduction per leaf on the devices and one small transfer: cheap enough for every save, and
    for a trainer that wants to check before it saves.
    """
    named = {name: x for field in ("master", "params") if getattr(state, field) is not None
             for name, x in _named(getattr(state, field), field).items()
             if jnp.issubdtype(x.dtype, jnp.inexact)}
    if not named:
        return []
    ok = np.asarray(jax.device_get(_finite_flags(plan.replicated)(list(named.values()))))
    return [name for name, fine in zip(named, ok) if not fine]


# ---------------------------------------------------------------------------------------------
# Save.

class PendingSave:
    """A save whose arrays may still be being written.

    The tag becomes complete (checksums, meta.json, then `latest`, then retention) in a background
    thread once orbax has committed; training goes on meanwhile. `wait()` blocks until then and
    re-raises a failure. Every pending save is also finished at interpreter exit (before Python
    stops the thread pools orbax writes with), so a script that saves and ends keeps its checkpoint.
    `nonfinite` names the parameters that held NaN or inf (then the tag is not made `latest`).
    """

    def __init__(self, directory: Path, tag: str, work: Any = None, nonfinite: Iterable[str] = ()):
        self.directory, self.tag = directory, tag
        self.nonfinite = list(nonfinite)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if work is not None:
            self._thread = threading.Thread(target=self._run, args=(work,), name=f"zerojax-save-{tag}")
            self._thread.start()

    def _run(self, work: Any) -> None:
        try:
            work()
        except BaseException as e:  # surfaced by wait()
            self._error = e

    @property
    def path(self) -> Path:
        return self.directory / self.tag

    @property
    def finite(self) -> bool:
        return not self.nonfinite

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint save of {self.path} failed; the tag stays incomplete") from error

    def __repr__(self) -> str:
        return f"PendingSave({str(self.path)!r}, done={self.done()})"


_PENDING: dict[Path, PendingSave] = {}
_PENDING_LOCK = threading.Lock()


def _wait_pending(root: Path) -> None:
    """Finish this process's in-flight save into `root` (one at a time keeps `latest` ordered)."""
    with _PENDING_LOCK:
        pending = _PENDING.pop(root.resolve(), None)
    if pending is not None:
        pending.wait()


def wait_all() -> None:
    """Finish every save this process has in flight (raises the first failure)."""
    with _PENDING_LOCK:
        pending = list(_PENDING.values())
        _PENDING.clear()
    errors = []
    for p in pending:
        try:
            p.wait()
        except RuntimeError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def _finish_at_exit() -> None:
    """Interpreter exit: complete pending saves while orbax's thread pools still accept work.

    Registered with threading's exit hooks, which run before concurrent.futures shuts its pools
    (hooks run in reverse order of registration) and long before `atexit`: by `atexit` time an
    unfinished orbax save can no longer be committed.
    """
    try:
        wait_all()
    except RuntimeError as e:
        import sys
        print(f"zerojax: {e}: {e.__cause__!r}", file=sys.stderr)


_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_finish_at_exit)
else:  # pragma: no cover - every CPython zerojax supports has the hook
    import atexit
    atexit.register(_finish_at_exit)


def _prepare_tag_dir(tag_dir: Path) -> None:
    if _is_complete(tag_dir):
        raise FileExistsError(f"checkpoint {tag_dir} already exists and is complete; it is never "
                              f"overwritten: save under another tag, or delete that folder first")
    if _primary():
        if tag_dir.exists():  # leftover of an interrupted save of this tag
            shutil.rmtree(tag_dir)
        tag_dir.mkdir(parents=True)
    _sync("prepare")


def _save_meta(state: TrainState, plan: Plan, tag: str, arrays: Mapping[str, Any],
               extra: Mapping[str, Any], nonfinite: list[str]) -> dict[str, Any]:
    truth = "master" if state.master is not None else "params"
    logical = getattr(state, truth)
    return {
        "format": FORMAT, "version": VERSION, "tag": tag,
        "step": int(state.step), "skipped": int(state.skipped),
        "stage": plan.stage, "mesh": {k: int(v) for k, v in plan.mesh.shape.items()},
        "precision": {"param": np.dtype(plan.policy.param).name,
                      "master": np.dtype(plan.policy.master).name if state.master is not None else None},
        "truth": truth,
        "finite": not nonfinite, "nonfinite": nonfinite[:20],
        "params": {name: _describe(x) for name, x in _named(logical, "").items()},
        "leaves": {name: _describe(x) for name, x in arrays.items()},
        "extra": dict(extra),
        "saved_at": time.time(),
    }


def _commit(root: Path, tag: str, meta: dict[str, Any], max_to_keep: int | None,
            keep_every_n_steps: int | None) -> None:
    """After orbax has committed the arrays: checksums, meta.json, `latest` (finite tags only), retention."""
    if _primary():
        tag_dir = root / tag
        meta = {**meta, "files": file_checksums(tag_dir)}
        meta["meta_crc32"] = _meta_crc(meta)
        _write_atomic(tag_dir / META_FILE, json.dumps(meta, indent=1) + "\n")
        if meta["finite"]:
            _write_atomic(root / LATEST_FILE, tag + "\n")
        prune(root, max_to_keep, keep_every_n_steps)
    # No process returns before process 0 has written meta.json and `latest`: a load right after
    # (tag None) resolves the same tag on every process. This may run in a save's background
    # thread, so: the coordination service's barrier, never an XLA collective (one issued here
    # would interleave with the training thread's and deadlock), and its own key per folder and tag.
    if jax.process_count() > 1:
        _COMMITS[(root.name, tag)] += 1
        ocp.multihost.get_barrier_sync_fn()(
            key=f"zerojax_checkpoint_commit_{root.name}_{tag}_{_COMMITS[(root.name, tag)]}",
            timeout_ms=ocp.multihost.coordination_timeout() * 1000)


def save(directory: PathLike, tag: str | None, state: TrainState, plan: Plan, *,
         extra: Mapping[str, Any] | None = None, async_save: bool = True,
         max_to_keep: int | None = None, keep_every_n_steps: int | None = None) -> PendingSave:
    """Write `state` to `directory/<tag>/` (tag None: `global_step<step>`); every process writes
    only its own shards, nothing is gathered.

    `extra` must be JSON-serializable (client state, data position, resolved config...); it comes
    back from `load`. With `async_save` this returns once the arrays are copied off the devices,
    so the caller may donate or update `state` right away. Retention (`prune`) runs after the tag
    completes. An existing complete tag raises FileExistsError; an incomplete leftover is replaced.
    Parameters holding NaN or inf are still written, flagged in meta.json (`finite: false`) with a
    warning, but the tag never becomes `latest`.
    """
    root = absolute(directory)
    tag = check_tag(default_tag(int(state.step)) if tag is None else tag)
    extra = dict(extra or {})
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint extra must be JSON-serializable (dicts, lists, str, numbers): {e}") from e
    _wait_pending(root)
    arrays = flatten_state(state)
    want = leaf_names(plan.abstract_params, "")
    got = list(_named(getattr(state, "master" if state.master is not None else "params"), ""))
    if want != got:
        raise CheckpointError(f"save: the state's parameters do not match the plan's ({len(got)} vs "
                              f"{len(want)} leaves); pass the plan the state was made with")
    nonfinite = nonfinite_params(state, plan)
    if nonfinite:
        warnings.warn(f"checkpoint {root / tag}: parameters are not finite ({', '.join(nonfinite[:5])}"
                      f"{' ...' if len(nonfinite) > 5 else ''}); the tag is written and flagged in {META_FILE}, "
                      f"but `latest` keeps naming {latest_tag(root)}", RuntimeWarning, stacklevel=2)
    meta = _save_meta(state, plan, tag, arrays, extra, nonfinite)
    tag_dir = root / tag
    _prepare_tag_dir(tag_dir)

    handler = ocp.PyTreeCheckpointHandler()
    if not async_save:
        with _closing(ocp.Checkpointer(handler)) as ckptr:
            ckptr.save(tag_dir / STATE_DIR, args=ocp.args.PyTreeSave(arrays))
        _commit(root, tag, meta, max_to_keep, keep_every_n_steps)
        return PendingSave(root, tag, nonfinite=nonfinite)

    ckptr = ocp.AsyncCheckpointer(handler)
    ckptr.save(tag_dir / STATE_DIR, args=ocp.args.PyTreeSave(arrays))

    def commit_then_finalize() -> None:
        try:
            ckptr.wait_until_finished()
        finally:
            ckptr.close()
        _commit(root, tag, meta, max_to_keep, keep_every_n_steps)

    pending = PendingSave(root, tag, commit_then_finalize, nonfinite=nonfinite)
    with _PENDING_LOCK:
        _PENDING[root.resolve()] = pending
    return pending


# ---------------------------------------------------------------------------------------------
# Load.

def _mismatch_lines(saved: Mapping[str, Any], wanted: Mapping[str, tuple[int, ...]]) -> list[str]:
    lines = []
    for name, shape in wanted.items():
        if name not in saved:
            lines.append(f"  {name}: model {shape}, not in the checkpoint")
        elif tuple(saved[name]["shape"]) != tuple(shape):
            lines.append(f"  {name}: checkpoint {tuple(saved[name]['shape'])}, model {tuple(shape)}")
    lines += [f"  {name}: checkpoint {tuple(entry['shape'])}, not in the model"
              for name, entry in saved.items() if name not in wanted]
    return lines


def _shapes(tree: Any, prefix: str) -> dict[str, tuple[int, ...]]:
    return {name: tuple(x.shape) for name, x in _named(tree, prefix).items()}


def check_compatible(meta: Mapping[str, Any], plan: Plan, where: PathLike = "checkpoint") -> None:
    """The checkpoint's parameters must be the plan's (names and shapes); raise listing every difference."""
    lines = _mismatch_lines(meta["params"], _shapes(plan.abstract_params, ""))
    if lines:
        shown = lines[:40] + ([f"  ... and {len(lines) - 40} more"] if len(lines) > 40 else [])
        raise CheckpointError(f"checkpoint {where} holds a different model: {len(lines)} parameter(s) differ\n"
                              + "\n".join(shown))


def _group(meta: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Saved leaves of one state field (the field name itself for a scalar field)."""
    return {name: entry for name, entry in meta["leaves"].items()
            if name == prefix or name.startswith(prefix + ".")}


@contextlib.contextmanager
def _reading(tag_dir: Path) -> Iterator[None]:
    """Whatever orbax raises while reading a tag becomes one CheckpointError naming the tag (files
    verified by checksum never get here damaged; an unverifiable version-1 tag might)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for one bad file
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise _corrupt(tag_dir, f"orbax could not read {tag_dir / STATE_DIR} ({type(e).__name__}: {first})") from None


def _verified(tag_dir: Path, meta: Mapping[str, Any]) -> None:
    problem = _first_bad_file(tag_dir, meta)
    if problem is not None:
        raise _corrupt(tag_dir, problem)


def _restore(state_dir: Path, targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Read the named arrays straight into their target shardings (and dtypes); others are skipped."""
    if not targets:
        return {}
    restore_args = {name: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=tuple(t.shape), dtype=t.dtype)
                    for name, t in targets.items()}
    with _reading(state_dir.parent), _closing(ocp.PyTreeCheckpointer()) as ckptr:
        return ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
            item=dict(targets), restore_args=restore_args, partial_restore=True))


def _unflatten(abstract: Any, prefix: str, values: Mapping[str, Any]) -> Any:
    names = leaf_names(abstract, prefix)
    return jax.tree.unflatten(jax.tree.structure(abstract), [values[n] for n in names])


def load(directory: PathLike, tag: str | None, plan: Plan, *, load_optimizer_states: bool = True,
         load_module_only: bool = False, verify: bool = True) -> tuple[TrainState, dict[str, Any]]:
    """Restore a checkpoint (tag None: latest) into `plan`'s layout, on any mesh and ZeRO stage.

    Each device reads only its own shards. The fp32 master copy (the saved parameters when the run
    had none) is the truth: the stored parameters are re-derived from it in the plan's dtype, so
    bf16 <-> fp32 restores work and a same-precision resume is bit-exact. `load_module_only`:
    parameters only, fresh optimizer and counters. `load_optimizer_states=False`: parameters and
    counters, fresh optimizer state. Returns the state and the `extra` dict given to `save`.
    Every file of the tag is first checked against its save's checksums (`verify=False` skips
    that read): a damaged tag is one CheckpointError naming the file and a tag that verifies.
    """
    tag_dir = _resolve(absolute(directory), tag)
    meta = _read_meta(tag_dir)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{tag_dir / META_FILE} is not a zerojax checkpoint")
    check_compatible(meta, plan, tag_dir)
    if verify:
        _verified(tag_dir, meta)
    target = abstract_state(plan)
    pol = plan.policy
    truth_target = target.master if pol.mixed else target.params

    targets = _named(truth_target, meta["truth"])
    restored_fields: list[str] = []
    if not load_module_only:
        for field, abstract in _state_fields(target):
            if field in ("params", "master") or (field == "opt_state" and not load_optimizer_states):
                continue
            wanted = _shapes(abstract, field)
            lines = _mismatch_lines(_group(meta, field), wanted)
            if lines and field == "opt_state":
                raise CheckpointError(f"checkpoint {tag_dir}: the optimizer state differs from this plan's "
                                      f"(another optimizer or schedule?); load with load_optimizer_states=False "
                                      f"to start a fresh one\n" + "\n".join(lines[:20]))
            if lines:
                continue  # a field this checkpoint predates: it starts fresh
            targets.update(_named(abstract, field))
            restored_fields.append(field)
    values = _restore(tag_dir / STATE_DIR, targets)

    truth = _unflatten(truth_target, meta["truth"], values)
    missing = [f for f, _ in _state_fields(target) if f not in ("params", "master") and f not in restored_fields]
    if missing:
        fields = init_state(plan.config, plan, truth)._asdict()
    else:
        params = (jax.jit(lambda t: jax.tree.map(lambda x: to_device(x).astype(pol.param), t),
                          out_shardings=jax.tree.map(lambda t: t.sharding, target.params))(truth)
                  if pol.mixed else truth)
        fields = {"params": params, "master": truth if pol.mixed else None}
    for field in restored_fields:
        fields[field] = _unflatten(getattr(target, field), field, values)
    return TrainState(**fields), dict(meta.get("extra", {}))


# ---------------------------------------------------------------------------------------------
# Export: the consolidated parameters in one safetensors file (DeepSpeed's zero_to_fp32).

_SAFETENSORS_DTYPES = {"fp32": (np.dtype(np.float32), "F32"), "bf16": (np.dtype(ml_dtypes.bfloat16), "BF16"),
                       "fp16": (np.dtype(np.float16), "F16")}


def _read_leaves(state_dir: Path, names: Iterable[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Each named array whole on the host, one at a time: memory stays near the largest leaf."""
    with _reading(state_dir.parent), _closing(ocp.PyTreeCheckpointer()) as ckptr:
        for name in names:
            out = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
                item={name: 0}, restore_args={name: ocp.RestoreArgs(restore_type=np.ndarray)},
                partial_restore=True))
            yield name, out[name]


def export_safetensors(directory: PathLike, tag: str | None, out_path: PathLike, dtype: str = "fp32", *,
                       overwrite: bool = False) -> Path:
    """Write the parameters of a checkpoint (the fp32 master when there is one) to one safetensors file.

    Tensor names are the parameter paths joined with '.'. The header is computed from the
    metadata, then leaves are read and written one by one, so host memory stays near the
    largest leaf whatever the model size. A pipelined run's parameters are written under their
    logical names, cut out of its `[stages, width]` rows (held in host memory while writing).

    The tag is verified against its checksums first. An existing `out_path` is an error unless
    `overwrite`; the file is written under a temporary name in the same folder and renamed only
    once complete, so a failed export leaves neither a partial file nor a changed old one.
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: use one of {sorted(_SAFETENSORS_DTYPES)}")
    np_dtype, st_dtype = _SAFETENSORS_DTYPES[dtype]
    out = absolute(out_path)
    if out.is_dir():
        raise FileExistsError(f"export: --out {out} is a folder; name the .safetensors file to write")
    if out.exists() and not overwrite:
        raise FileExistsError(f"export: {out} already exists and is never overwritten silently; pass "
                              f"--force (overwrite=True) to replace it, or choose another --out")
    tag_dir = _resolve(absolute(directory), tag)
    meta = _read_meta(tag_dir)
    _verified(tag_dir, meta)
    rows = meta.get("extra", {}).get(PIPELINE_ROWS)
    params = rows["leaves"] if rows else meta["params"]
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": str(tag_dir), "step": str(meta["step"]),
                                               "dtype": dtype}}
    offset = 0
    for name, entry in params.items():
        size = math.prod(entry["shape"]) * np_dtype.itemsize
        header[name] = {"dtype": st_dtype, "shape": entry["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # 8-byte aligned data, as the format recommends
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for array in _exported_arrays(tag_dir, meta, rows):
                np.ascontiguousarray(array.astype(np_dtype, copy=False)).tofile(f)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, out)
        else:
            try:  # a link fails, rather than replaces, if the name appeared while we wrote
                os.link(tmp, out)
            except FileExistsError:
                raise FileExistsError(f"export: {out} appeared while exporting; it was left as it is") from None
            except OSError:  # a filesystem without hard links
                os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _exported_arrays(tag_dir: Path, meta: Mapping[str, Any], rows: Mapping[str, Any] | None
                     ) -> Iterator[np.ndarray]:
    """The parameters to export, in header order: saved leaves, or slices of pipeline rows."""
    if not rows:
        sources = [join(meta["truth"], name) for name in meta["params"]]
        for _, array in _read_leaves(tag_dir / STATE_DIR, sources):
            yield array
        return
    (_, table), = _read_leaves(tag_dir / STATE_DIR, [join(meta["truth"], rows["array"])])
    for entry in rows["leaves"].values():
        start = entry["offset"]
        yield table[entry["row"], start:start + math.prod(entry["shape"])].reshape(entry["shape"])


def read_params(directory: PathLike, tag: str | None = None) -> tuple[dict[str, Any], str]:
    """A checkpoint's parameters (fp32 master where there is one) as nested dicts of numpy arrays,
    read without a plan or a mesh after verifying the tag; also the tag folder. For inspection and
    generation on one host (`zerojax sample`)."""
    tag_dir = _resolve(absolute(directory), tag)
    meta = _read_meta(tag_dir)
    _verified(tag_dir, meta)
    rows = meta.get("extra", {}).get(PIPELINE_ROWS)
    names = rows["leaves"] if rows else meta["params"]
    params: dict[str, Any] = {}
    for name, array in zip(names, _exported_arrays(tag_dir, meta, rows)):
        *parents, leaf = name.split(".")
        node = params
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = np.asarray(array)
    return params, str(tag_dir)


def load_exported(path: PathLike) -> dict[str, Any]:
    """The params pytree (nested dicts of numpy arrays) from an exported safetensors file."""
    from safetensors import safe_open

    params: dict[str, Any] = {}
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
            *parents, leaf = name.split(".")
            node = params
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = f.get_tensor(name)
    return params
