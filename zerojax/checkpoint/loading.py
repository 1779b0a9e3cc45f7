"""Loading a tag onto any plan: checked against the model first, then read shard by shard into the
plan's layout (orbax with abstract targets), so a checkpoint resumes on any mesh, stage or offload.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax
import numpy as np

from zerojax.checkpoint.format import PIPELINE_ROWS, CheckpointError, FORMAT, META_FILE, PathLike, STATE_DIR, absolute, closing, describe_leaf, leaf_names, named_leaves, state_fields, truth_name
from zerojax.checkpoint.integrity import corrupt_error, first_bad_file, read_meta
from zerojax.checkpoint.pending import continue_run, resolve_tag
from zerojax.core.layout import Plan
from zerojax.core.offload import to_device
from zerojax.core.state import TrainState, abstract_state, init_state


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
    return {name: tuple(x.shape) for name, x in named_leaves(tree, prefix).items()}


def check_compatible(meta: Mapping[str, Any], plan: Plan, where: PathLike = "checkpoint") -> None:
    """The checkpoint's parameters must be the plan's (names and shapes); raise listing every difference."""
    lines = _mismatch_lines(meta["params"], _shapes(plan.abstract_params, ""))
    if lines:
        shown = lines[:40] + ([f"  ... and {len(lines) - 40} more"] if len(lines) > 40 else [])
        rows = meta.get("extra", {}).get(PIPELINE_ROWS)
        hint = ("\nthis is a pipelined run's checkpoint: it resumes in a pipeline (any mesh.stage, mesh.tensor, "
                "data size and ZeRO stage); for an unpipelined run, `zerojax export` it and pass "
                "zerojax.checkpoint.load_exported(file) (re-stacked as the model's tree) as initialize(..., params=)"
                if rows else "")
        raise CheckpointError(f"checkpoint {where} holds a different model: {len(lines)} parameter(s) differ\n"
                              + "\n".join(shown) + hint)


def _group(meta: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Saved leaves of one state field (the field name itself for a scalar field)."""
    return {name: entry for name, entry in meta["leaves"].items()
            if name == prefix or name.startswith(prefix + ".")}


@contextlib.contextmanager
def reading(tag_dir: Path) -> Iterator[None]:
    """Whatever orbax raises while reading a tag becomes one CheckpointError naming the tag (files
    verified by checksum never get here damaged; an unverifiable version-1 tag might)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for one bad file
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise corrupt_error(tag_dir, f"orbax could not read {tag_dir / STATE_DIR} ({type(e).__name__}: {first})") from None


def read_leaves(state_dir: Path, names: Iterable[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Each named array whole on the host, one at a time: memory stays near the largest leaf."""
    import orbax.checkpoint as ocp  # here, not at import: a run pays for orbax at its first load
    with reading(state_dir.parent), closing(ocp.PyTreeCheckpointer()) as ckptr:
        for name in names:
            out = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
                item={name: 0}, restore_args={name: ocp.RestoreArgs(restore_type=np.ndarray)},
                partial_restore=True))
            yield name, out[name]


def verified(tag_dir: Path, meta: Mapping[str, Any]) -> None:
    problem = first_bad_file(tag_dir, meta)
    if problem is not None:
        raise corrupt_error(tag_dir, problem)


def _restore(state_dir: Path, targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Read the named arrays straight into their target shardings (and dtypes); others are skipped."""
    if not targets:
        return {}
    import orbax.checkpoint as ocp
    restore_args = {name: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=tuple(t.shape), dtype=t.dtype)
                    for name, t in targets.items()}
    with reading(state_dir.parent), closing(ocp.PyTreeCheckpointer()) as ckptr:
        return ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
            item=dict(targets), restore_args=restore_args, partial_restore=True))


def _unflatten(abstract: Any, prefix: str, values: Mapping[str, Any]) -> Any:
    names = leaf_names(abstract, prefix)
    return jax.tree.unflatten(jax.tree.structure(abstract), [values[n] for n in names])


@dataclasses.dataclass(frozen=True)
class Relayout:
    """How saved leaves of another layout become the plan's (a pipeline's stage rows saved at another
    stage count, tensor or expert size): `convert(leaf name, saved array, the tag's meta)` gives the
    target's array, for every leaf `wanted(name, meta)` picks and every leaf saved under its name with
    another shape."""
    convert: Callable[[str, np.ndarray, Mapping[str, Any]], np.ndarray]
    wanted: Callable[[str, Mapping[str, Any]], bool] = lambda name, meta: False


def load(directory: PathLike, tag: str | None, plan: Plan, *, load_optimizer_states: bool = True,
         load_module_only: bool = False, verify: bool = True, relayout: Relayout | None = None,
         frozen: Any = None) -> tuple[TrainState, dict[str, Any]]:
    """Restore a checkpoint (tag None: latest) into `plan`'s layout, on any mesh and ZeRO stage.

    Each device reads only its own shards. The fp32 master copy (the saved parameters when the run
    had none) is the truth: the stored parameters are re-derived from it in the plan's dtype, so
    bf16 <-> fp32 restores work and a same-precision resume is bit-exact. `load_module_only`:
    parameters (and the model state: BatchNorm statistics) only, fresh optimizer and counters.
    `load_optimizer_states=False`: parameters and counters, fresh optimizer state. Returns the state and the `extra` dict given to `save`.
    Every file of the tag is first checked against its save's checksums (`verify=False` skips
    that read): a damaged tag is one CheckpointError naming the file and a tag that verifies.
    `relayout`: how leaves of another layout become the plan's (`Relayout`); such leaves are read whole
    on the host and placed once converted, and the relayout checks that they hold this model.
    `frozen`: a parameter tree (e.g. the model's own, `state.params`) the frozen leaves a tag saved with
    `exclude_frozen` left out are taken from; such a tag cannot be loaded without it.
    """
    tag_dir = resolve_tag(absolute(directory), tag)
    meta = read_meta(tag_dir)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{tag_dir / META_FILE} is not a zerojax checkpoint")
    target = abstract_state(plan)
    moved = _moved(meta, target, relayout) if relayout is not None else set()
    if not moved:
        check_compatible(meta, plan, tag_dir)
    if verify:
        verified(tag_dir, meta)
    pol = plan.policy
    # Per leaf, what it is restored from: a trainable leaf of a mixed-precision plan into its master copy,
    # any other into its stored parameter; read from the checkpoint's truth (its master, when it had
    # one for the leaf), else from the saved parameter (a leaf the saving run kept frozen).
    truth_target = plan.merge(target.master, plan.frozen(target.params)) if pol.mixed else target.params
    names = leaf_names(plan.abstract_params, "")
    sources = [truth_name(meta, n) for n in names]
    targets = dict(zip(sources, jax.tree.leaves(truth_target)))
    excluded = {f"params.{n}" for n in meta.get("excluded", ())} & set(sources)  # not in the tag: given
    if excluded and frozen is None:
        raise CheckpointError(f"checkpoint {tag_dir} was saved with exclude_frozen_parameters: it holds no "
                              f"{', '.join(sorted(n[7:] for n in excluded)[:6])}{' ...' if len(excluded) > 6 else ''}; "
                              f"load it into an engine built with those weights (engine.load_checkpoint), or "
                              f"pass them: load(..., frozen=params)")
    given = {}
    if excluded:
        check_compatible({"params": {n: describe_leaf(x) for n, x in named_leaves(frozen, "").items()}}, plan,
                         "frozen=")
        given = {s: x for s, x in zip(sources, jax.tree.leaves(frozen)) if s in excluded}
    restored_fields: list[str] = []
    # the model state (BatchNorm's statistics) belongs to the module, as torch's buffers do: it comes
    # back with the parameters, load_module_only included
    for field, abstract in state_fields(target):
        if field in ("params", "master") or (field == "opt_state" and not load_optimizer_states):
            continue
        if load_module_only and field != "model_state":
            continue
        wanted = _shapes(abstract, field)
        lines = _mismatch_lines({k: v for k, v in _group(meta, field).items() if k not in moved},
                                {k: v for k, v in wanted.items() if k not in moved})
        if lines and field == "opt_state":
            raise CheckpointError(f"checkpoint {tag_dir}: the optimizer state differs from this plan's "
                                  f"(another optimizer or schedule?); load with load_optimizer_states=False "
                                  f"to start a fresh one\n" + "\n".join(lines[:20]))
        if lines:
            continue  # a field this checkpoint predates: it starts fresh
        targets.update(named_leaves(abstract, field))
        restored_fields.append(field)
    values = _restore(tag_dir / STATE_DIR, {k: v for k, v in targets.items() if k not in moved and k not in given})
    values.update({k: jax.device_put(x.astype(targets[k].dtype), targets[k].sharding) for k, x in given.items()})
    for name, array in read_leaves(tag_dir / STATE_DIR, [k for k in targets if k in moved]):
        want = targets[name]
        values[name] = jax.device_put(np.asarray(relayout.convert(name, array, meta), want.dtype), want.sharding)

    truth = jax.tree.unflatten(jax.tree.structure(truth_target), [values[n] for n in sources])
    missing = [f for f, _ in state_fields(target) if f not in ("params", "master") and f not in restored_fields]
    if missing:
        fields = init_state(plan, truth)._asdict()
    else:
        params = (jax.jit(lambda t: jax.tree.map(lambda x: to_device(x).astype(pol.param), t),
                          out_shardings=jax.tree.map(lambda t: t.sharding, target.params))(truth)
                  if pol.mixed else truth)
        fields = {"params": params, "master": plan.trained(truth) if pol.mixed else None}
    for field in restored_fields:
        fields[field] = _unflatten(getattr(target, field), field, values)
    continue_run(tag_dir.parent, meta)  # later saves here are the same run's: retention may prune its tags
    return TrainState(**fields), dict(meta.get("extra", {}))


def _moved(meta: Mapping[str, Any], target: TrainState, relayout: Relayout) -> set[str]:
    """Leaves a relayout converts: those it wants, and those saved under the same name with another shape."""
    saved = meta["leaves"]
    out = set()
    for field, abstract in state_fields(target):
        for name, shape in _shapes(abstract, field).items():
            if name in saved and (tuple(saved[name]["shape"]) != tuple(shape) or relayout.wanted(name, meta)):
                out.add(name)
    return out


def metadata(directory: PathLike, tag: str | None = None) -> dict[str, Any]:
    """The JSON metadata of a complete tag (None: latest): counters, precision, leaves, `extra`."""
    return read_meta(resolve_tag(absolute(directory), tag))
