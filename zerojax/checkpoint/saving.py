"""Saving a TrainState under a tag: orbax writes the arrays (in the background when asked), then the
checksums, `meta.json`, `latest` and retention are committed in that order.
"""
from __future__ import annotations

import collections
import json
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint.format import CheckpointError, FORMAT, LATEST_FILE, META_FILE, PathLike, STATE_DIR, VERSION, absolute, check_tag, closing, default_tag, describe_leaf, flatten_state, is_complete, latest_tag, leaf_names, meta_crc, named_leaves, is_primary_process, scan_tags, write_atomic
from zerojax.checkpoint.integrity import file_checksums, nonfinite_params
from zerojax.checkpoint.pending import PendingSave, track, wait_pending
from zerojax.errors import ConfigError
from zerojax.core.layout import Plan
from zerojax.core.state import TrainState


_SYNCS = iter(range(1 << 62))


_COMMITS: collections.Counter = collections.Counter()


def _sync(name: str) -> None:
    """A barrier across processes (every process calls the same functions in the same order)."""
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(f"zerojax_checkpoint_{name}_{next(_SYNCS)}")


def _handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler writing each shard whole from its first replica (orbax's own default on
    GPU): replica-parallel saving slices replicated arrays with one small compiled program per shape,
    dozens of compiles at a run's first save for no gain within one host."""
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()), (jax.Array, th.ArrayHandler(use_replica_parallel=False)),
        (str, th.StringHandler()))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _prepare_tag_dir(tag_dir: Path) -> None:
    if is_complete(tag_dir):
        raise FileExistsError(f"checkpoint {tag_dir} already exists and is complete; it is never "
                              f"overwritten: save under another tag, or delete that folder first")
    if is_primary_process():
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
        "params": {name: describe_leaf(x) for name, x in named_leaves(logical, "").items()},
        "leaves": {name: describe_leaf(x) for name, x in arrays.items()},
        "extra": dict(extra),
        "saved_at": time.time(),
    }


def _commit(root: Path, tag: str, meta: dict[str, Any], max_to_keep: int | None,
            keep_every_n_steps: int | None) -> None:
    """After orbax has committed the arrays: checksums, meta.json, `latest` (finite tags only), retention."""
    if is_primary_process():
        tag_dir = root / tag
        meta = {**meta, "files": file_checksums(tag_dir)}
        meta["meta_crc32"] = meta_crc(meta)
        write_atomic(tag_dir / META_FILE, json.dumps(meta, indent=1) + "\n")
        if meta["finite"]:
            write_atomic(root / LATEST_FILE, tag + "\n")
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
    wait_pending(root)
    arrays = flatten_state(state)
    want = leaf_names(plan.abstract_params, "")
    got = list(named_leaves(getattr(state, "master" if state.master is not None else "params"), ""))
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

    handler = _handler()
    if not async_save:
        with closing(ocp.Checkpointer(handler)) as ckptr:
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
    track(root, pending)
    return pending


def prune(directory: PathLike, max_to_keep: int | None = None,
          keep_every_n_steps: int | None = None) -> list[str]:
    """Delete old complete tags: keep the newest `max_to_keep`, every multiple of
    `keep_every_n_steps`, and always the tag `latest` resolves to. Returns the deleted tags."""
    if max_to_keep is None:
        return []
    if max_to_keep < 1:
        raise ConfigError(f"prune: max_to_keep must be >= 1, got {max_to_keep}")
    root = absolute(directory)
    tags = scan_tags(root)
    keep = {tag for tag, _ in tags[-max_to_keep:]} | {latest_tag(root)}
    deleted = []
    for tag, meta in tags:
        if tag in keep or (keep_every_n_steps and int(meta["step"]) % keep_every_n_steps == 0):
            continue
        (root / tag / META_FILE).unlink()  # first make it incomplete, so a half-deleted tag is never loaded
        shutil.rmtree(root / tag)
        deleted.append(tag)
    return deleted
