"""Checkpoints as pure functions over a TrainState and a Plan, stored with orbax.

On disk (DeepSpeed's shape: one folder per tag and a `latest` pointer)::

    directory/
      latest            the newest complete tag (plain text)
      <tag>/state/      orbax PyTree checkpoint: every array of the state, each process writes its shards
      <tag>/meta.json   step counters, precision, leaf names/shapes/dtypes, the caller's `extra`

`meta.json` is written last, after orbax has committed, so it is the mark of a complete tag: a
folder without it is the leftover of an interrupted save and is never listed, loaded or pointed
at by `latest`. Arrays are stored under flat dotted names ("master.blocks.fc.kernel"), so
a checkpoint is independent of the mesh and ZeRO stage that wrote it: `load` reads it into the
layout of whatever plan it is given, shard by shard, using `abstract_state(plan)` as targets.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from zerojax.errors import ConfigError
from zerojax.layout import Plan
from zerojax.names import dotted, join
from zerojax.offload import to_device
from zerojax.state import TrainState, abstract_state, init_state

STATE_DIR = "state"
META_FILE = "meta.json"
LATEST_FILE = "latest"
PIPELINE_ROWS = "pipeline_rows"   # extra key: where a pipelined run's logical parameters sit in its rows
FORMAT = "zerojax-checkpoint"
VERSION = 1
PathLike = str | os.PathLike[str]


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as asked: another model, another optimizer, or incomplete."""


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


def _read_meta(tag_dir: Path) -> dict[str, Any]:
    return json.loads((tag_dir / META_FILE).read_text())


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


def _sync(name: str) -> None:
    """A barrier across processes (every process calls the same functions in the same order)."""
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(f"zerojax_checkpoint_{name}_{next(_SYNCS)}")


def list_tags(directory: PathLike) -> list[str]:
    """Complete tags, oldest first (by step, then by save time); leftovers of crashed saves are skipped."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for tag_dir in root.iterdir():
        if tag_dir.is_dir() and not tag_dir.name.startswith(".") and _is_complete(tag_dir):
            meta = _read_meta(tag_dir)
            found.append((int(meta["step"]), float(meta.get("saved_at", 0.0)), tag_dir.name))
    return [tag for *_, tag in sorted(found)]


def latest_tag(directory: PathLike) -> str | None:
    """The tag `latest` names if it is complete, else the newest complete tag, else None."""
    root = Path(directory)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if tag and _is_complete(root / tag):
            return tag
    tags = list_tags(root)
    return tags[-1] if tags else None


def metadata(directory: PathLike, tag: str | None = None) -> dict[str, Any]:
    """The JSON metadata of a complete tag (None: latest): counters, precision, leaves, `extra`."""
    return _read_meta(_resolve(Path(directory), tag))


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
    root = Path(directory)
    tags = list_tags(root)
    keep = set(tags[-max_to_keep:]) | {latest_tag(root)}
    deleted = []
    for tag in tags:
        step = int(_read_meta(root / tag)["step"])
        if tag in keep or (keep_every_n_steps and step % keep_every_n_steps == 0):
            continue
        (root / tag / META_FILE).unlink()  # first make it incomplete, so a half-deleted tag is never loaded
        shutil.rmtree(root / tag)
        deleted.append(tag)
    return deleted


# ---------------------------------------------------------------------------------------------
# Save.

class PendingSave:
    """A save whose arrays may still be being written.

    The tag becomes complete (meta.json, then `latest`, then retention) in a background thread
    once orbax has committed; training goes on meanwhile. `wait()` blocks until then and
    re-raises a failure. The thread is not a daemon, so a normal interpreter exit finishes it.
    """

    def __init__(self, directory: Path, tag: str, work: Any = None):
        self.directory, self.tag = directory, tag
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
               extra: Mapping[str, Any]) -> dict[str, Any]:
    truth = "master" if state.master is not None else "params"
    logical = getattr(state, truth)
    return {
        "format": FORMAT, "version": VERSION, "tag": tag,
        "step": int(state.step), "skipped": int(state.skipped),
        "stage": plan.stage, "mesh": {k: int(v) for k, v in plan.mesh.shape.items()},
        "precision": {"param": np.dtype(plan.policy.param).name,
                      "master": np.dtype(plan.policy.master).name if state.master is not None else None},
        "truth": truth,
        "params": {name: _describe(x) for name, x in _named(logical, "").items()},
        "leaves": {name: _describe(x) for name, x in arrays.items()},
        "extra": dict(extra),
        "saved_at": time.time(),
    }


def save(directory: PathLike, tag: str | None, state: TrainState, plan: Plan, *,
         extra: Mapping[str, Any] | None = None, async_save: bool = True,
         max_to_keep: int | None = None, keep_every_n_steps: int | None = None) -> PendingSave:
    """Write `state` to `directory/<tag>/` (tag None: `global_step<step>`); every process writes
    only its own shards, nothing is gathered.

    `extra` must be JSON-serializable (client state, data position, resolved config...); it comes
    back from `load`. With `async_save` this returns once the arrays are copied off the devices,
    so the caller may donate or update `state` right away. Retention (`prune`) runs after the tag
    completes. An existing complete tag raises FileExistsError; an incomplete leftover is replaced.
    """
    root = Path(directory)
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
    meta = _save_meta(state, plan, tag, arrays, extra)
    tag_dir = root / tag
    _prepare_tag_dir(tag_dir)

    def finalize() -> None:
        if _primary():
            _write_atomic(tag_dir / META_FILE, json.dumps(meta, indent=1) + "\n")
            _write_atomic(root / LATEST_FILE, tag + "\n")
            prune(root, max_to_keep, keep_every_n_steps)

    handler = ocp.PyTreeCheckpointHandler()
    if not async_save:
        with _closing(ocp.Checkpointer(handler)) as ckptr:
            ckptr.save(tag_dir / STATE_DIR, args=ocp.args.PyTreeSave(arrays))
        finalize()
        return PendingSave(root, tag)

    ckptr = ocp.AsyncCheckpointer(handler)
    ckptr.save(tag_dir / STATE_DIR, args=ocp.args.PyTreeSave(arrays))

    def commit_then_finalize() -> None:
        try:
            ckptr.wait_until_finished()
        finally:
            ckptr.close()
        finalize()

    pending = PendingSave(root, tag, commit_then_finalize)
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


def _restore(state_dir: Path, targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Read the named arrays straight into their target shardings (and dtypes); others are skipped."""
    if not targets:
        return {}
    restore_args = {name: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=tuple(t.shape), dtype=t.dtype)
                    for name, t in targets.items()}
    with _closing(ocp.PyTreeCheckpointer()) as ckptr:
        return ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
            item=dict(targets), restore_args=restore_args, partial_restore=True))


def _unflatten(abstract: Any, prefix: str, values: Mapping[str, Any]) -> Any:
    names = leaf_names(abstract, prefix)
    return jax.tree.unflatten(jax.tree.structure(abstract), [values[n] for n in names])


def load(directory: PathLike, tag: str | None, plan: Plan, *, load_optimizer_states: bool = True,
         load_module_only: bool = False) -> tuple[TrainState, dict[str, Any]]:
    """Restore a checkpoint (tag None: latest) into `plan`'s layout, on any mesh and ZeRO stage.

    Each device reads only its own shards. The fp32 master copy (the saved parameters when the run
    had none) is the truth: the stored parameters are re-derived from it in the plan's dtype, so
    bf16 <-> fp32 restores work and a same-precision resume is bit-exact. `load_module_only`:
    parameters only, fresh optimizer and counters. `load_optimizer_states=False`: parameters and
    counters, fresh optimizer state. Returns the state and the `extra` dict given to `save`.
    """
    tag_dir = _resolve(Path(directory), tag)
    meta = _read_meta(tag_dir)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{tag_dir / META_FILE} is not a zerojax checkpoint")
    check_compatible(meta, plan, tag_dir)
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
    with _closing(ocp.PyTreeCheckpointer()) as ckptr:
        for name in names:
            out = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
                item={name: 0}, restore_args={name: ocp.RestoreArgs(restore_type=np.ndarray)},
                partial_restore=True))
            yield name, out[name]


def export_safetensors(directory: PathLike, tag: str | None, out_path: PathLike, dtype: str = "fp32") -> Path:
    """Write the parameters of a checkpoint (the fp32 master when there is one) to one safetensors file.

    Tensor names are the parameter paths joined with '.'. The header is computed from the
    metadata, then leaves are read and written one by one, so host memory stays near the
    largest leaf whatever the model size. A pipelined run's parameters are written under their
    logical names, cut out of its `[stages, width]` rows (held in host memory while writing). The
    file appears atomically at `out_path`.
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: use one of {sorted(_SAFETENSORS_DTYPES)}")
    np_dtype, st_dtype = _SAFETENSORS_DTYPES[dtype]
    tag_dir = _resolve(Path(directory), tag)
    meta = _read_meta(tag_dir)
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
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in _exported_arrays(tag_dir, meta, rows):
            np.ascontiguousarray(array.astype(np_dtype, copy=False)).tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
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
