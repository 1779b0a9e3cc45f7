"""Checkpoints as pure functions over a TrainState and a Plan, stored with orbax.

On disk (DeepSpeed's shape: one folder per tag and a `latest` pointer)::

    directory/
      latest            the newest complete tag (plain text)
      <tag>/state/      orbax PyTree checkpoint: every array of the state, each process writes its shards
      <tag>/meta.json   step counters, precision, leaf names/shapes/dtypes, the caller's `extra`,
                        the size and CRC-32 of every file under state/, and a CRC-32 of itself

`meta.json` is written last, after orbax has committed, so it is the mark of a complete tag: a
folder without it is never listed, loaded or pointed at by `latest`. A save marks its folder with
`.zerojax-saving` until meta.json is written; `.best` (beside `latest`) names the tag of a run's lowest
validation loss, and retention keeps it; only such a leftover of an interrupted zerojax save is
ever replaced, and retention deletes only tags of the run that saves (`run_id` in meta.json). Its checksums make a complete tag verifiable: a file that was truncated, zeroed,
bit-flipped or removed after the save is an error at load and export, never silent garbage.
A tag whose parameters are not finite is written (for inspection) but never becomes `latest`.
Paths may be relative: they are made absolute once, where they enter this module. Arrays are stored under flat dotted names ("master.blocks.fc.kernel"), so
a checkpoint is independent of the mesh and ZeRO stage that wrote it: `load` reads it into the
layout of whatever plan it is given, shard by shard, using `abstract_state(plan)` as targets.

The package in parts: `format` (the layout above: tags, meta.json, latest, leaf names), `integrity`
(checksums, verification, finite parameters), `pending` (saves still being written in the background),
`saving`, `loading` (onto any plan) and `export` (parameters out, one leaf at a time).
"""
from zerojax.checkpoint.export import export_safetensors, load_exported, read_leaves, read_params, unpipelined_tag
from zerojax.checkpoint.format import (BEST_FILE, FORMAT, LATEST_FILE, META_FILE, PIPELINE_ROWS, STATE_DIR, VERSION, CheckpointError,
                                       PathLike, absolute, check_tag, default_tag, flatten_state, latest_tag,
                                       leaf_names, list_tags, best_tag)
from zerojax.checkpoint.integrity import file_checksums, nonfinite_params, read_meta, verify
from zerojax.checkpoint.loading import Relayout, check_compatible, load, metadata, verified
from zerojax.checkpoint.pending import PendingSave, resolve_tag, wait_all
from zerojax.checkpoint.saving import prune, save

__all__ = ["BEST_FILE", "best_tag", "CheckpointError", "PendingSave", "absolute", "check_compatible", "check_tag", "default_tag",
           "export_safetensors", "file_checksums", "flatten_state", "latest_tag", "leaf_names", "list_tags", "load",
           "load_exported", "metadata", "nonfinite_params", "prune", "read_leaves", "read_meta", "read_params",
           "Relayout", "resolve_tag", "save", "unpipelined_tag", "verified", "verify", "wait_all", "FORMAT", "LATEST_FILE", "META_FILE", "PIPELINE_ROWS",
           "STATE_DIR", "VERSION", "PathLike"]
