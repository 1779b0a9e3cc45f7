"""Saving a TrainState under a tag: orbax writes the arrays (in the background when asked), then the
checksums, `meta.json`, `latest` and retention are committed in that order.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import socket
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import jax
import numpy as np

from zerojax.checkpoint.format import BEST_FILE, CheckpointError, FORMAT, LATEST_FILE, best_tag, META_FILE, PathLike, SAVING_FILE, STATE_DIR, VERSION, absolute, check_tag, closing, default_tag, describe_leaf, flatten_state, is_complete, latest_tag, leaf_names, meta_crc, named_leaves, is_primary_process, scan_tags, write_atomic
from zerojax.checkpoint.integrity import file_checksums, nonfinite_params
from zerojax.checkpoint.pending import PendingSave, run_of, track, wait_pending
from zerojax.errors import ConfigError
from zerojax.core.layout import Plan
from zerojax.core.state import TrainState, logical_params
from zerojax.runtime.run_lock import LOCK_FILE, holder_elsewhere, pid_alive

if TYPE_CHECKING:
    import orbax.checkpoint as ocp


_SYNCS = iter(range(1 << 62))


_COMMITS: collections.Counter = collections.Counter()


def _sync(name: str) -> None:
    """A barrier across processes (every process calls the same functions in the same order)."""
    if jax.process_count() > 1:
        import orbax.checkpoint as ocp
        ocp.multihost.sync_global_processes(f"zerojax_checkpoint_{name}_{next(_SYNCS)}")


def _handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler writing each shard whole from its first replica (orbax's own default on
    GPU): replica-parallel saving slices replicated arrays with one small compiled program per shape,
    dozens of compiles at a run's first save for no gain within one host."""
    import orbax.checkpoint as ocp  # here, not at import: a run pays for orbax at its first save
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()), (jax.Array, th.ArrayHandler(use_replica_parallel=False)),
        (str, th.StringHandler()))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _agree(problem: str | None) -> None:
    """Process 0's verdict raised on every process, so none is left waiting in the next barrier."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        refused = bool(multihost_utils.broadcast_one_to_all(np.int32(problem is not None)))
        if refused and problem is None:
            problem = "process 0 refused this save (its error says why); nothing was written"
    if problem is not None:
        raise CheckpointError(problem)


def _marker_writer(tag_dir: Path) -> str | None:
    """The process on this host still writing the tag its marker names (None: that save is over)."""
    try:
        info = json.loads((tag_dir / SAVING_FILE).read_text())
        pid, host = int(info["pid"]), str(info["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host == socket.gethostname() and pid != os.getpid() and pid_alive(pid):
        return f"process {pid} on {host}"
    return None


def _refusal(root: Path, tag_dir: Path) -> str | None:
    """Why process 0 must not write `tag_dir` (None: go ahead). Only a folder zerojax marked as its
    own save in progress is ever replaced; anything else in the way is the user's and stays."""
    holder = holder_elsewhere(root)
    if holder is not None:
        return (f"checkpoint directory {root} is in use by another run ({holder}; lock {root / LOCK_FILE}); "
                f"two runs never save into one folder: wait for it to finish, or save elsewhere")
    if not tag_dir.exists() and not tag_dir.is_symlink():
        return None
    if not tag_dir.is_dir() or not (tag_dir / SAVING_FILE).is_file():
        return (f"checkpoint {tag_dir} exists and is not a zerojax checkpoint (no {META_FILE}) nor the "
                f"leftover of an interrupted zerojax save (no {SAVING_FILE}); it is never deleted: move it "
                f"away, or save under another tag")
    writer = _marker_writer(tag_dir)
    if writer is not None:
        return (f"checkpoint {tag_dir} is being written by {writer}; two runs never save into one folder: "
                f"wait for it to finish, or save under another tag")
    return None


def _prepare_tag_dir(root: Path, tag_dir: Path) -> None:
    """The tag's folder, new and marked as a save in progress (`SAVING_FILE`, removed once meta.json
    is written), after checking that nothing of the user's or of another run is in the way."""
    if is_complete(tag_dir):
        raise FileExistsError(f"checkpoint {tag_dir} already exists and is complete; it is never "
                              f"overwritten: save under another tag, or delete that folder first")
    problem = None
    if is_primary_process():
        problem = _refusal(root, tag_dir)
        try:
            if problem is None:
                if tag_dir.exists():  # zerojax's own leftover: an interrupted save of this tag
                    shutil.rmtree(tag_dir)
                tag_dir.mkdir(parents=True)
                write_atomic(tag_dir / SAVING_FILE, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                                "run_id": run_of(root), "started": time.time()}) + "\n")
        except OSError as e:  # said on every process, none left in the barrier
            problem = f"checkpoint {tag_dir}: cannot create the tag folder ({e.strerror or e}); save to a writable folder"
    _agree(problem)
    _sync("prepare")


def frozen_names(plan: Plan) -> list[str]:
    """Dotted names of the plan's frozen leaves."""
    return [name for name, t in zip(leaf_names(plan.abstract_params, ""), jax.tree.leaves(plan.trainable)) if not t]


def _save_meta(state: TrainState, plan: Plan, tag: str, arrays: Mapping[str, Any],
               extra: Mapping[str, Any], nonfinite: list[str], excluded: list[str]) -> dict[str, Any]:
    truth = "master" if state.master is not None else "params"
    logical = logical_params(state)  # a frozen leaf's truth is its stored parameter (it has no master)
    return {
        "format": FORMAT, "version": VERSION, "tag": tag,
        "step": int(state.step), "skipped": int(state.skipped),
        "stage": plan.stage, "mesh": {k: int(v) for k, v in plan.mesh.shape.items()},
        "precision": {"param": np.dtype(plan.policy.param).name,
                      "master": np.dtype(plan.policy.master).name if state.master is not None else None},
        "truth": truth,
        "frozen": frozen_names(plan),
        "excluded": excluded,  # frozen leaves not written (exclude_frozen): a load takes them from the model
        "finite": not nonfinite, "nonfinite": nonfinite[:20],
        "params": {name: describe_leaf(x) for name, x in named_leaves(logical, "").items()},
        "leaves": {name: describe_leaf(x) for name, x in arrays.items()},
        "extra": dict(extra),
        "saved_at": time.time(),
    }


def _commit(root: Path, tag: str, meta: dict[str, Any], max_to_keep: int | None,
            keep_every_n_steps: int | None, best: bool = False) -> None:
    """After orbax has committed the arrays: checksums, meta.json, `latest` (and `best`, when asked;
    finite tags only), retention."""
    if is_primary_process():
        tag_dir = root / tag
        meta = {**meta, "files": file_checksums(tag_dir)}
        meta["meta_crc32"] = meta_crc(meta)
        write_atomic(tag_dir / META_FILE, json.dumps(meta, indent=1) + "\n")
        (tag_dir / SAVING_FILE).unlink(missing_ok=True)  # complete: no longer an in-progress save
        if meta["finite"]:
            write_atomic(root / LATEST_FILE, tag + "\n")
            if best:
                write_atomic(root / BEST_FILE, tag + "\n")
        prune(root, max_to_keep, keep_every_n_steps, run_id=meta["run_id"])
    # No process returns before process 0 has written meta.json and `latest`: a load right after
    # (tag None) resolves the same tag on every process. This may run in a save's background
    # thread, so: the coordination service's barrier, never an XLA collective (one issued here
    # would interleave with the training thread's and deadlock), and its own key per folder and tag.
    if jax.process_count() > 1:
        _COMMITS[(root.name, tag)] += 1
        import orbax.checkpoint as ocp
        ocp.multihost.get_barrier_sync_fn()(
            key=f"zerojax_checkpoint_commit_{root.name}_{tag}_{_COMMITS[(root.name, tag)]}",
            timeout_ms=ocp.multihost.coordination_timeout() * 1000)


def save(directory: PathLike, tag: str | None, state: TrainState, plan: Plan, *,
         extra: Mapping[str, Any] | None = None, async_save: bool = True,
         max_to_keep: int | None = None, keep_every_n_steps: int | None = None,
         exclude_frozen: bool = False, best: bool = False) -> PendingSave:
    """Write `state` to `directory/<tag>/` (tag None: `global_step<step>`); every process writes
    only its own shards, nothing is gathered.

    `extra` must be JSON-serializable (client state, data position, resolved config...); it comes
    back from `load`. With `async_save` this returns once the arrays are copied off the devices,
    so the caller may donate or update `state` right away. Retention (`prune`) runs after the tag
    completes, and deletes only this run's tags. An existing complete tag raises FileExistsError; the
    leftover of an interrupted zerojax save (marked by SAVING_FILE) is replaced; any other folder in
    the way, or a folder another run holds (its lock), is one CheckpointError: nothing is deleted.
    Parameters holding NaN or inf are still written, flagged in meta.json (`finite: false`) with a
    warning, but the tag never becomes `latest`.
    `exclude_frozen` (DeepSpeed's `exclude_frozen_parameters`): the frozen leaves are not written, only
    what is trained (and the optimizer's state): a LoRA-style run's tag is then its adapters' size. Such
    a tag is loaded with the frozen weights given (`load(..., frozen=params)`; the engine passes its own).
    `best`: once complete (and finite), the tag is also the one the folder's `.best` pointer names (the
    lowest validation loss so far), which retention never deletes.
    """
    root = absolute(directory)
    tag = check_tag(default_tag(int(state.step)) if tag is None else tag)
    extra = dict(extra or {})
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint extra must be JSON-serializable (dicts, lists, str, numbers): {e}") from e
    wait_pending(root)
    arrays = flatten_state(state)
    excluded = frozen_names(plan) if exclude_frozen else []
    for name in excluded:
        del arrays[f"params.{name}"]
    want = leaf_names(plan.abstract_params, "")
    got = list(named_leaves(logical_params(state), ""))
    if want != got:
        raise CheckpointError(f"save: the state's parameters do not match the plan's ({len(got)} vs "
                              f"{len(want)} leaves); pass the plan the state was made with")
    nonfinite = nonfinite_params(state, plan)
    if nonfinite:
        warnings.warn(f"checkpoint {root / tag}: parameters are not finite ({', '.join(nonfinite[:5])}"
                      f"{' ...' if len(nonfinite) > 5 else ''}); the tag is written and flagged in {META_FILE}, "
                      f"but `latest` keeps naming {latest_tag(root)}", RuntimeWarning, stacklevel=2)
    meta = {**_save_meta(state, plan, tag, arrays, extra, nonfinite, excluded), "run_id": run_of(root)}
    tag_dir = root / tag
    _prepare_tag_dir(root, tag_dir)

    handler = _handler()
    import orbax.checkpoint as ocp
    if not async_save:
        with closing(ocp.Checkpointer(handler)) as ckptr:
            ckptr.save(tag_dir / STATE_DIR, args=ocp.args.PyTreeSave(arrays))
        _commit(root, tag, meta, max_to_keep, keep_every_n_steps, best)
        return PendingSave(root, tag, nonfinite=nonfinite)

    ckptr = ocp.AsyncCheckpointer(handler)
    ckptr.save(tag_dir / STATE_DIR, args=ocp.args.PyTreeSave(arrays))

    def commit_then_finalize() -> None:
        try:
            ckptr.wait_until_finished()
        finally:
            ckptr.close()
        _commit(root, tag, meta, max_to_keep, keep_every_n_steps, best)

    pending = PendingSave(root, tag, commit_then_finalize, nonfinite=nonfinite)
    track(root, pending)
    return pending


def prune(directory: PathLike, max_to_keep: int | None = None,
          keep_every_n_steps: int | None = None, *, run_id: str | None = None) -> list[str]:
    """Delete old complete tags: keep the newest `max_to_keep`, every multiple of
    `keep_every_n_steps`, and always the tags `latest` and `.best` name. Returns the deleted tags.

    Only zerojax checkpoints are candidates (a folder with a meta.json of this format), and with
    `run_id` (as after each save) only the tags that run wrote: another run's tags, and tags from
    before run ids, are never deleted by a run's retention."""
    if max_to_keep is None:
        return []
    if max_to_keep < 1:
        raise ConfigError(f"prune: max_to_keep must be >= 1, got {max_to_keep}")
    root = absolute(directory)
    tags = [(tag, meta) for tag, meta in scan_tags(root)
            if meta.get("format") == FORMAT and (run_id is None or meta.get("run_id") == run_id)]
    keep = {tag for tag, _ in tags[-max_to_keep:]} | {latest_tag(root), best_tag(root)}
    deleted = []
    for tag, meta in tags:
        if tag in keep or (keep_every_n_steps and int(meta["step"]) % keep_every_n_steps == 0):
            continue
        # first mark it as zerojax's work in progress, then make it incomplete (a half-deleted tag is
        # never loaded, and a later save of this tag may replace what is left)
        write_atomic(root / tag / SAVING_FILE, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                          "deleting": True}) + "\n")
        (root / tag / META_FILE).unlink()
        shutil.rmtree(root / tag)
        deleted.append(tag)
    return deleted
