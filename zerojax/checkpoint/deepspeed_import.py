"""A DeepSpeed ZeRO checkpoint (`global_stepN/`, read by `deepspeed_format`) as a zerojax TrainState
on any plan: any mesh, any ZeRO stage, any precision.

What is carried over, and where it goes:

| DeepSpeed                                              | zerojax TrainState                                |
|--------------------------------------------------------|---------------------------------------------------|
| fp32 master partitions (`single_partition_of_fp32_groups` / `fp32_flat_groups`) | `master` (and `params`, cast to the plan's dtype) |
| Adam `exp_avg` / `exp_avg_sq`                           | the Adam state's `mu` / `nu` (`ScaleByMomentsState`, or optax's `ScaleByAdamState`) |
| Adam `step`                                             | the Adam state's `count` (its bias correction)    |
| `lr_scheduler.last_batch_iteration`                     | the schedule's update count (`inject_hyperparams`' `count`) |
| `global_steps`, `skipped_steps`                         | `step`, `skipped`                                 |
| `loss_scaler` (DynamicLossScaler)                       | `scaler`: scale, hysteresis, last overflow        |

Each leaf is created with `jax.make_array_from_callback` under the plan's sharding: each device gets
only its block, cut from the DeepSpeed tensor(s) named by the leaf's source (one per layer for a
stacked leaf, `{i}` in the name; transposed from torch's [out, in] where the source says so).
Every name and shape is checked before any array is made.

Below the planner's door: nothing here reads the config. The caller (the app layer) gives the
name table and the schedule position the config implies.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zerojax.checkpoint.deepspeed_format import (DeepSpeedCheckpoint, DeepSpeedCheckpointError, read_checkpoint,
                                                 shape_of)
from zerojax.checkpoint.format import CheckpointError, PathLike, leaf_names
from zerojax.core.layout import Plan
from zerojax.core.offload import to_device
from zerojax.core.precision import init_loss_scale
from zerojax.core.state import TrainState, key_data, state_shardings
from zerojax.optim.transforms import ScaleByMomentsState

__all__ = ["DeepSpeedImportError", "DeepSpeedSource", "check_destination", "import_state", "is_deepspeed_checkpoint",
           "mapping_sources", "read", "save_imported", "schedule_count"]


class DeepSpeedImportError(CheckpointError):
    """A DeepSpeed checkpoint that cannot continue this model: the message names the file, the
    parameter and the fix."""


class DeepSpeedSource(NamedTuple):
    """Where one zerojax leaf comes from: DeepSpeed parameter `name` (`{i}`: the layer index of a
    stacked leaf, whose first dimension is the layers), stored transposed or not; `prefix_rows`:
    the tensor may have more rows than the leaf, which takes the first ones."""
    name: str
    transpose: bool = False
    prefix_rows: bool = False


def is_deepspeed_checkpoint(path: PathLike) -> bool:
    """A folder DeepSpeed's `save_checkpoint` wrote (with `latest`) or one of its tag folders: told
    apart from a zerojax checkpoint by DeepSpeed's `*_model_states.pt` files. A run folder whose
    pointer is missing or stale is still DeepSpeed's (its tag folders say so), so the reader's error
    about the pointer is what the user sees, not that the folder is no checkpoint at all."""
    root = Path(os.path.expanduser(os.fspath(path)))
    if not root.is_dir():
        return False

    def has_states(folder: Path) -> bool:
        try:
            return any(n.endswith("_model_states.pt") for n in os.listdir(folder))
        except OSError:
            return False

    if has_states(root):
        return True
    for pointer in ("latest", "latest_universal"):  # the latter: ds_to_universal.py's output folder
        latest = root / pointer
        if latest.is_file():
            tag = latest.read_text(errors="replace").strip()
            if tag and "/" not in tag and has_states(root / tag):
                return True
    try:
        return any(has_states(d) for d in root.iterdir() if d.is_dir())
    except OSError:
        return False


def check_destination(source: PathLike, directory: PathLike) -> None:
    """The zerojax folder an import writes must lie outside the DeepSpeed checkpoint: written into it,
    the new tag (DeepSpeed's tag name by default) would land on DeepSpeed's own tag folder and `latest`
    would replace DeepSpeed's pointer. Checked before anything is read or written."""
    src = Path(os.path.realpath(os.path.expanduser(os.fspath(source))))
    dst = Path(os.path.realpath(os.path.expanduser(os.fspath(directory))))
    inside = dst == src or src in dst.parents
    if inside or is_deepspeed_checkpoint(dst):
        where = ("is the DeepSpeed checkpoint itself" if dst == src else "lies inside the DeepSpeed checkpoint "
                 f"{src}" if inside else "holds a DeepSpeed checkpoint (its `latest` and tag folders)")
        raise DeepSpeedImportError(f"import-deepspeed: the destination {dst} {where}; the import never writes "
                                   f"into the checkpoint it reads: give a new folder for the zerojax checkpoint, "
                                   f"e.g. {src.parent / (src.name + '-zerojax')}")


def read(path: PathLike) -> DeepSpeedCheckpoint:
    """`deepspeed_format.read_checkpoint`, its errors as `DeepSpeedImportError` (a ConfigError)."""
    try:
        return read_checkpoint(os.path.expanduser(os.fspath(path)))
    except DeepSpeedCheckpointError as e:
        raise DeepSpeedImportError(str(e)) from None


def mapping_sources(names: Mapping[str, Any]) -> dict[str, DeepSpeedSource]:
    """A user's mapping from DeepSpeed parameter names to leaves of the parameter tree, as sources.

    `names`: {DeepSpeed name: leaf} where a leaf is its dotted path ("blocks.fc.kernel"), or a dict
    {"leaf": path, "transpose": bool, "prefix_rows": bool}. `{i}` in the DeepSpeed name stands for the
    layer index of a stacked leaf: {"layers.{i}.fc.weight": {"leaf": "blocks.fc.kernel", "transpose": true}}.
    """
    out: dict[str, DeepSpeedSource] = {}
    for ds_name, target in names.items():
        if isinstance(target, str):
            leaf, transpose, prefix_rows = target, False, False
        elif isinstance(target, Mapping) and isinstance(target.get("leaf"), str):
            unknown = set(target) - {"leaf", "transpose", "prefix_rows"}
            if unknown:
                raise DeepSpeedImportError(f"names[{ds_name!r}]: unknown keys {sorted(unknown)}; use leaf, "
                                           f"transpose, prefix_rows")
            leaf, transpose = target["leaf"], bool(target.get("transpose", False))
            prefix_rows = bool(target.get("prefix_rows", False))
        else:
            raise DeepSpeedImportError(f"names[{ds_name!r}]: {target!r} is not a leaf path; give the dotted path "
                                       f"of a parameter leaf, e.g. \"blocks.fc.kernel\", or "
                                       f"{{\"leaf\": \"blocks.fc.kernel\", \"transpose\": true}}")
        if leaf in out:
            raise DeepSpeedImportError(f"names: leaf {leaf!r} is given twice ({out[leaf].name!r} and {ds_name!r})")
        out[leaf] = DeepSpeedSource(ds_name, transpose, prefix_rows)
    return out


def _model_file(ckpt: DeepSpeedCheckpoint) -> str:
    name = "mp_rank_00_model_states.pt" if ckpt.zero_stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    return os.path.join(ckpt.path, name)


def _layers(source: Any, shape: tuple[int, ...]) -> list[tuple[int | None, str]]:
    if "{i}" in source.name:
        return [(i, source.name.format(i=i)) for i in range(shape[0])]
    return [(None, source.name)]


def check_sources(ckpt: DeepSpeedCheckpoint, plan: Plan, sources: Mapping[str, Any], fix: str) -> None:
    """Every leaf has a source whose tensor is in the checkpoint with the shape the model implies, and
    every trainable tensor of the checkpoint is used: else one error naming the file, leaf, both shapes
    and `fix`."""
    where = _model_file(ckpt)
    abstract = dict(zip(leaf_names(plan.abstract_params), jax.tree.leaves(plan.abstract_params)))
    missing_leaves = [n for n in abstract if n not in sources]
    if missing_leaves:
        raise DeepSpeedImportError(f"{where}: no DeepSpeed parameter is mapped to model leaves {missing_leaves[:8]}; "
                                   f"{fix}")
    used: set[str] = set()
    for leaf, x in abstract.items():
        source = sources[leaf]
        shape = tuple(x.shape)
        one = shape[1:] if "{i}" in source.name else shape
        want = tuple(reversed(one)) if source.transpose else one
        for _, name in _layers(source, shape):
            if name not in ckpt.params:
                close = sorted(n for n in ckpt.params if n.split(".")[-1] == name.split(".")[-1])[:4]
                raise DeepSpeedImportError(
                    f"{where}: model leaf {leaf} needs DeepSpeed parameter {name}, which is not in the checkpoint's "
                    f"param_shapes ({len(ckpt.params)} parameters{', e.g. ' + ', '.join(close) if close else ''}); "
                    f"{fix}")
            got = shape_of(ckpt.params, name)
            ok = got == want or (source.prefix_rows and len(got) == len(want) >= 1 and got[1:] == want[1:]
                                 and got[0] >= want[0])
            if not ok:
                raise DeepSpeedImportError(
                    f"{where}: parameter {name} has shape {list(got)}, but model leaf {leaf} {list(shape)} needs "
                    f"{list(want)}{' per layer' if '{i}' in source.name else ''}"
                    f"{' (stored transposed, torch [out, in])' if source.transpose else ''}; the model the config "
                    f"describes is not the one DeepSpeed trained - set the model keys (model.d_model, n_layers, "
                    f"n_heads, d_ff, vocab_size, seq_len) to that run's, or {fix}")
            used.add(name)
    unused = [n for n in ckpt.params if n not in used]
    if unused:
        raise DeepSpeedImportError(f"{where}: DeepSpeed parameters {unused[:8]}{' ...' if len(unused) > 8 else ''} "
                                   f"map to no model leaf, so their weights and optimizer state would be dropped; "
                                   f"{fix}")


def _block(arrays: Mapping[str, np.ndarray], source: Any, shape: tuple[int, ...], index: tuple[slice, ...],
           dtype: Any) -> np.ndarray:
    """The block `index` of a leaf of `shape`, cut from the checkpoint tensors (one per layer); always
    a copy, so a device buffer never keeps a checkpoint tensor (or its file mapping) alive."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))

    def one(name: str, idx: tuple[slice, ...]) -> np.ndarray:
        tensor = arrays[name]
        return tensor[tuple(reversed(idx))].T if source.transpose else tensor[idx]

    if "{i}" in source.name:
        out = np.stack([one(source.name.format(i=i), index[1:]) for i in range(shape[0])[index[0]]])
    else:
        out = one(source.name, index)
    return np.array(out, dtype=dtype, order="C", copy=True)


def _place(arrays: Mapping[str, np.ndarray], plan: Plan, sources: Mapping[str, Any]) -> Any:
    """The parameter tree (fp32), each leaf made on its devices from only their blocks. A leaf's
    checkpoint tensors are assembled once, placed, and let go before the next leaf's: host memory
    holds one leaf's tensors at a time, not the model (`deepspeed_format.Tensors` assembles on access)."""
    names = leaf_names(plan.abstract_params)
    shardings = jax.tree.leaves(plan.update_shardings)
    leaves = []
    for name, x, sharding in zip(names, jax.tree.leaves(plan.abstract_params), shardings):
        shape, source = tuple(x.shape), sources[name]
        held = {n: arrays[n] for _, n in _layers(source, shape)}
        leaves.append(jax.make_array_from_callback(
            shape, sharding, lambda idx, s=source, shape=shape, held=held: _block(held, s, shape, idx, np.float32)))
        del held
    return jax.tree.unflatten(jax.tree.structure(plan.abstract_params), leaves)


def schedule_count(ckpt: DeepSpeedCheckpoint, config_last_batch_iteration: int | None) -> int:
    """The schedule's update count that continues DeepSpeed's scheduler where it stopped.

    DeepSpeed steps its scheduler after each applied step, so after k of them a run started at
    `last_batch_iteration` L0 (the config's, -1 for a new run) is at L0 + k; zerojax's k-th update uses
    position L0 + k (optim/schedules.py). Without a scheduler the count is the applied steps."""
    lbi = (ckpt.lr_scheduler or {}).get("last_batch_iteration") if isinstance(ckpt.lr_scheduler, dict) else None
    if lbi is None or config_last_batch_iteration is None:
        return max(0, ckpt.global_steps - ckpt.skipped_steps)
    count = int(lbi) - int(config_last_batch_iteration)
    if count < 0:
        raise DeepSpeedImportError(
            f"{_model_file(ckpt)}: the scheduler is at last_batch_iteration {lbi}, before the config's "
            f"scheduler.params.last_batch_iteration {config_last_batch_iteration}; set the config's to -1 (the "
            f"run's start), as in the DeepSpeed config the run began with")
    return count


_SCHEDULED = {"learning_rate": "lr", "b1": "beta1", "b2": "beta2"}


def _fill_opt_state(plan: Plan, node: Any, mu: Any, nu: Any, adam_count: jax.Array, count: jax.Array,
                    found: list[str]) -> Any:
    """The optimizer state with DeepSpeed's moments, Adam step and schedule position filled in."""
    def fill(n: Any) -> Any:
        if isinstance(n, (ScaleByMomentsState, optax.ScaleByAdamState)):
            found.append(type(n).__name__)
            return n._replace(count=adam_count.astype(n.count.dtype), mu=mu, nu=nu)
        if isinstance(n, optax.InjectStatefulHyperparamsState):
            hyper = dict(n.hyperparams)
            for key in n.hyperparams_states:
                fn = getattr(plan.schedule, _SCHEDULED.get(key, ""), None)
                if fn is not None:  # what the latest update used, as the uninterrupted run keeps it
                    hyper[key] = jnp.where(count > 0, fn(jnp.maximum(count - 1, 0)), hyper[key]).astype(
                        hyper[key].dtype)
            states = {k: s._replace(count=count.astype(s.count.dtype)) if hasattr(s, "count") else s
                      for k, s in n.hyperparams_states.items()}
            return n._replace(count=count.astype(n.count.dtype), hyperparams=hyper, hyperparams_states=states,
                              inner_state=fill(n.inner_state))
        if isinstance(n, optax.InjectHyperparamsState):
            return n._replace(count=count.astype(n.count.dtype), inner_state=fill(n.inner_state))
        if isinstance(n, tuple) and hasattr(n, "_fields"):
            return type(n)(*(fill(x) for x in n))
        if isinstance(n, tuple):
            return tuple(fill(x) for x in n)
        if isinstance(n, list):
            return [fill(x) for x in n]
        if isinstance(n, dict):
            return {k: fill(v) for k, v in n.items()}
        return n
    return fill(node)


def _scaler_fields(ckpt: DeepSpeedCheckpoint) -> dict[str, float | int] | None:
    """DeepSpeed's DynamicLossScaler as zerojax's scaler fields (None for a static scaler).

    DeepSpeed counts overflows in its scaler's own `cur_iter`; zerojax in the step counter. Both
    advance once per step, so the last overflow keeps its distance from the current step."""
    ls = ckpt.loss_scale or {}
    if ls.get("type") != "DynamicLossScaler" or not ls.get("dynamic", True):
        return None
    last = int(ls.get("last_overflow_iter", -1))
    cur = int(ls.get("cur_iter", ckpt.global_steps))
    return {"scale": float(ls.get("cur_scale", 65536.0)), "hysteresis": int(ls.get("cur_hysteresis", 2)),
            "last_overflow": -1 if last < 0 else last - cur + ckpt.global_steps}


def import_state(ckpt: DeepSpeedCheckpoint, plan: Plan, sources: Mapping[str, Any], *, count: int,
                 weights_only: bool = False, fix: str = "pass a name mapping",
                 rng: jax.Array | int | None = None) -> TrainState:
    """The TrainState that continues `ckpt` under `plan`, made straight into the plan's shards.

    `sources`: zerojax leaf (dotted) -> its DeepSpeed source (`DeepSpeedSource`, `models.hf.Source`, or
    anything with `name`, `transpose` and optionally `prefix_rows`). `count`: the schedule's update
    count (`schedule_count`). `weights_only`: weights and counters, a fresh optimizer state (for a
    checkpoint of another optimizer). `fix` ends every name or shape error.
    """
    if plan.model_state is not None:
        raise ValueError("import_state: this model keeps BatchNorm statistics (plan.model_state), which a DeepSpeed "
                         "checkpoint stores as module buffers that are not read here; train it from a zerojax "
                         "checkpoint instead")
    if plan.has_frozen:
        raise ValueError("import_state: the plan freezes parameters (model.trainable / model.frozen), but a DeepSpeed "
                         "checkpoint's fp32 partitions and moments are read for every parameter; import with every "
                         "parameter trained, save a zerojax checkpoint, and load that into the frozen plan "
                         "(load_optimizer_states=False: the optimizer state then covers other leaves)")
    check_sources(ckpt, plan, sources, fix)
    where = _model_file(ckpt)
    moments = ckpt.exp_avg is not None and ckpt.exp_avg_sq is not None
    master = _place(ckpt.params, plan, sources)
    if weights_only or not moments:
        mu = nu = None
    else:
        mu, nu = _place(ckpt.exp_avg, plan, sources), _place(ckpt.exp_avg_sq, plan, sources)
    pol = plan.policy
    scaler = _scaler_fields(ckpt) if plan.scaler.dynamic else None
    adam_count = ckpt.step if ckpt.step is not None else max(0, ckpt.global_steps - ckpt.skipped_steps)
    found: list[str] = []

    def build(master: Any, mu: Any, nu: Any, key: jax.Array) -> TrainState:
        master = to_device(master)
        opt = plan.tx.init(master)
        if not (weights_only or not moments):
            opt = _fill_opt_state(plan, opt, mu, nu, jnp.asarray(adam_count, jnp.int32), jnp.asarray(count, jnp.int32),
                                  found)
        elif not weights_only:
            opt = _fill_opt_state(plan, opt, jax.tree.map(jnp.zeros_like, master),
                                  jax.tree.map(jnp.zeros_like, master), jnp.asarray(0, jnp.int32),
                                  jnp.asarray(count, jnp.int32), found)
        sc = init_loss_scale(plan.scaler, plan.n_leaves)
        if scaler is not None:
            sc = sc._replace(scale=jnp.asarray(scaler["scale"], sc.scale.dtype),
                             hysteresis=jnp.asarray(scaler["hysteresis"], sc.hysteresis.dtype),
                             last_overflow=jnp.asarray(scaler["last_overflow"], sc.last_overflow.dtype))
        return TrainState(params=jax.tree.map(lambda x: x.astype(pol.param), master),
                          master=master if pol.mixed else None,
                          opt_state=opt, step=jnp.asarray(ckpt.global_steps, jnp.int32),
                          skipped=jnp.asarray(ckpt.skipped_steps, jnp.int32), scaler=sc, rng=key)

    key = key_data(plan.seed if rng is None else rng)
    state = jax.jit(build, out_shardings=state_shardings(plan))(master, mu, nu, key)
    has_moment_leaves = any(x.shape == y.shape and x.ndim > 0 for x, y in zip(
        jax.tree.leaves(plan.abstract_opt_state), jax.tree.leaves(plan.abstract_params)))
    if not weights_only and moments and not found and has_moment_leaves:
        raise DeepSpeedImportError(
            f"{where}: the checkpoint holds Adam's exp_avg/exp_avg_sq, but the config's optimizer keeps another "
            f"state; set optimizer.type to Adam or AdamW (as the DeepSpeed run), or import the weights and "
            f"counters only (--weights-only, weights_only=True) for a fresh optimizer state")
    if not weights_only and not moments and has_moment_leaves:
        raise DeepSpeedImportError(
            f"{where}: the optimizer files hold no Adam exp_avg/exp_avg_sq (another optimizer, or saved without "
            f"optimizer state), so the run cannot continue exactly; import the weights and counters only "
            f"(--weights-only, weights_only=True) for a fresh optimizer state")
    return state


def save_imported(directory: PathLike, tag: str | None, state: TrainState, plan: Plan, ckpt: DeepSpeedCheckpoint,
                  extra: Mapping[str, Any] | None = None) -> Path:
    """Write the imported state as a zerojax checkpoint tag (default: the DeepSpeed tag); `extra` records
    where it came from, the data position (DeepSpeed's global_steps) and the client state that is JSON."""
    from zerojax.checkpoint.saving import save

    client = {}
    for k, v in ckpt.client_state.items():
        try:
            json.dumps(v)
            client[k] = v
        except (TypeError, ValueError):
            pass
    record = {"imported_from": ckpt.path, "deepspeed_version": ckpt.ds_version, "deepspeed_zero_stage": ckpt.zero_stage,
              "deepspeed_dp_world_size": ckpt.dp_world_size, "global_samples": ckpt.global_samples,
              "data_position": ckpt.global_steps, "client_state": client, **dict(extra or {})}
    pending = save(directory, tag or ckpt.tag, state, plan, extra=record, async_save=False)
    return Path(pending.directory) / pending.tag
