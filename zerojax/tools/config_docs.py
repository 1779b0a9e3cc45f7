"""The configuration reference, `docs/config.md`, rendered from the schema in `zerojax.config`.

The schema's field metadata (default, doc, choices, bounds, aliases) is the single source; a test
compares the committed file with `render_reference()`, so the reference cannot drift. Regenerate with

    python -m zerojax.tools.config_docs > docs/config.md
"""
from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from typing import Any, Iterator, Mapping

from zerojax import config as schema
from zerojax.config.schema.optimizer import REFUSED_OPTIMIZERS
from zerojax.config.status import KEY_STATUS

REGENERATE = "python -m zerojax.tools.config_docs > docs/config.md"

# DeepSpeed's spelling of the optimizer types (the loader matches them case-insensitively).
_OPTIMIZER_NAMES = {"adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "adagrad": "Adagrad", "lion": "Lion",
                    "sgd": "SGD", "onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam",
                    "onebitlamb": "OneBitLamb", "muon": "Muon"}


def render_reference() -> str:
    """The whole Markdown reference."""
    parts = [_header(), _compatibility(), _bringing(), _top_level(), _optimizers(), _schedulers(), *_sections()]
    return "\n".join(parts).rstrip("\n") + "\n"


def _header() -> str:
    return f"""# Configuration reference

<!-- Generated from zerojax/config/schema/; do not edit by hand. Regenerate with: {REGENERATE} -->

A zerojax config is a DeepSpeed config plus zerojax's own sections (`mesh`, `model`, `data`, `run`,
`checkpoint`, `distributed`, `kernels`). It is a dict, or a file: JSON (comments and trailing commas
allowed, as DeepSpeed's hjson reader allows), `.hjson` or YAML (`.yaml`/`.yml`; `1e-3` reads as a
number). Load it with `zerojax.load_config(path_or_dict, overrides)`; the command line takes
`--set key.path=value` overrides (values read as YAML: `true`, `3e-4`, `[0.9, 0.95]`, `null`), and
`python -m zerojax.cli config explain FILE` prints every resolved value with its source (`file`,
`override`, `default`, `derived (...)`).

A bad config gets one error naming the dotted key path and the fix, before anything is compiled:
`load_config` checks everything that needs no devices; `zerojax.plan` then checks the batch triad
against the mesh and rejects features that are not built yet.
"""


def _compatibility() -> str:
    untested = _names(sorted(set(schema.OPTIMIZER_PARAMS) - schema.ZERO_TESTED_OPTIMIZERS))
    one_bit = _names(sorted(schema.ONE_BIT_OPTIMIZERS))
    refused = f", and these are not built: {_names(sorted(REFUSED_OPTIMIZERS))}" if REFUSED_OPTIMIZERS else ""
    return f"""## DeepSpeed compatibility

* **Defaults** are DeepSpeed's code defaults. One deliberate choice: `gradient_clipping` defaults to
  1.0 (current DeepSpeed; it was 0.0 before mid-2026); 0 disables clipping.
* **Status.** Every key's `status` column says whether it is honoured (it means what it means in
  DeepSpeed), has no effect by design (and why), or is refused (and for which values); the table is
  `zerojax/config/status.py`, and a test fails on any key without one. Every key of DeepSpeed's
  config-json documentation has a status too (a schema key's, a DeepSpeed-only key's or section's in
  the tables below, or, for a parameter of an optimizer type zerojax refuses, that refusal):
  `tests/test_deepspeed_keys.py` checks the list extracted from that page.
* **Keys accepted for compatibility.** Keys described as "accepted" are read and validated so that
  existing DeepSpeed configs load, but have no effect: XLA schedules and overlaps collectives itself,
  so bucket sizes and similar knobs mean nothing here.
* **Not supported yet.** Some keys parse and validate, but their feature is not built yet (their
  description says "not supported"). `zerojax.plan` rejects a config that turns one on, with an error
  naming the key and what to write instead.
* **Unknown keys are rejected** at every level, with the nearest valid key suggested ("did you
  mean ...", only for a slip of a letter or two), or the section where the key belongs. DeepSpeed
  silently ignores unknown top-level keys; a typo there would otherwise go unnoticed. Keys written
  twice in one file are an error. DeepSpeed's own keys that zerojax does not build are not unknown:
  see the next section. Keys starting with `_` (`"_comment"`) are comments, at any level. Every
  unknown or refused key of a file is named in the same error (DeepSpeedExamples' cifar config gives
  `bf16` five of fp16's loss-scaling keys: one error lists all five), not one per run.
* **`"auto"`** is a Hugging Face Trainer placeholder, not DeepSpeed's: see the next section. On a
  key the Trainer does not fill it means that key's default (source `default ('auto')`), unless
  `"auto"` is an ordinary value of the key (`kernels`, `pipeline.stages`).
* **Batch triad.**
  `train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp`, where `dp`
  is the number of data-parallel shards the batch is split over (`mesh.data`: by default the devices
  over `mesh.stage` x `mesh.tensor`, as DeepSpeed divides its world size by the pipeline and
  tensor-parallel sizes). All three given: they
  must agree. Two given: the third is derived (a division that is not exact is an error printing the
  arithmetic). Only `train_batch_size` or only `train_micro_batch_size_per_gpu`:
  `gradient_accumulation_steps` is 1. Only `gradient_accumulation_steps`, or none: an error.
* **Adam means AdamW.** `type: Adam` uses decoupled weight decay unless `adam_w_mode: false` (0/1
  accepted). Implementation selectors in `params` (`torch_adam`, `fused`, `adam_w_mode`) are accepted;
  `torch_adam` only changes the default weight decay, as the implementation it selects does in
  DeepSpeed: 0.0 for FusedAdam (the default), 0.01 for torch's AdamW, 0.0 for torch's Adam.
* **Optimizers outside DeepSpeed's ZeRO-tested list** ({untested}) need
  `zero_allow_untested_optimizer: true` with ZeRO stage 1 or more, as in DeepSpeed. 1-bit optimizers
  ({one_bit}) are out of scope{refused}; each is refused with the reason. `Muon` is DeepSpeed's
  MuonWithAuxAdam: see docs/zero.md for how ZeRO stage 3 gives it whole matrices, and where it differs.
* **Schedulers** step once per applied optimizer step (not on a step skipped for fp16 overflow),
  starting from position -1, as in DeepSpeed.
"""


def _bringing() -> str:
    """What happens to a config written for DeepSpeed or the Hugging Face Trainer."""
    hidden = "\n".join(f"| `zero_optimization.{k}` | {formula.replace('^2', '²')} |"
                        for k, (formula, _) in schema.HIDDEN_FILLS.items())
    trainer = ", ".join(f"`{k}`" for k in schema.TRAINER_ONLY
                        if not k.startswith("scheduler") and k not in schema.BATCH_KEYS)
    accepted = [(k, f) for k, f in schema.FOREIGN_KEYS.items() if f.refuse is None]
    refused = [(k, f) for k, f in schema.FOREIGN_KEYS.items() if f.refuse is not None]
    accepted_rows = "\n".join(f"| `{k}` | {_cell(f.what)} | {_cell(f.effect)} | {_cell(f.alternative)} |"
                              for k, f in accepted)
    refused_rows = "\n".join(f"| `{k}` | {_cell(f.what)} | {_cell(f.refused_when)} | {_cell(f.effect)} | "
                             f"{_cell(f.alternative)} |" for k, f in refused)
    return f"""## Bringing a DeepSpeed or Hugging Face config

A `ds_config.json` written for DeepSpeed, for the Hugging Face Trainer or for accelerate loads as it
is. Each key is honoured, filled, ignored with one warning line (a `zerojax.config.ConfigWarning`,
also shown by `config explain` with the source `ignored (...)`), or refused with the reason.

**Honoured.** Every key in the tables below means what it means in DeepSpeed, under DeepSpeed's field
names and their aliases alike: `prefetch_bucket_size` or `stage3_prefetch_bucket_size`,
`param_persistence_threshold`, `max_live_parameters`, `max_reuse_distance`,
`gather_16bit_weights_on_model_save` (or `stage3_gather_16bit_weights_on_model_save`, or the older
`stage3_gather_fp16_weights_on_model_save`); the deprecated `cpu_offload` and `cpu_offload_param`
mean `offload_optimizer` / `offload_param` with device `cpu`; `sub_group_size: 0` is valid.
`offload_param` below stage 3 is ignored with a warning, as DeepSpeed ignores it (device `nvme` there is
refused: a run that asked for files would silently keep its parameters on the device). Both NVMe tiers
are built (`offload_optimizer.device: nvme`, `offload_param.device: nvme`: docs/offload.md).

**No optimizer section.** DeepSpeed then trains with the optimizer passed to
`deepspeed.initialize(optimizer=...)`, and so does zerojax: pass `optimizer=` (and optionally
`lr_scheduler=`) to `zerojax.initialize` or `zerojax.plan`. `optimizer` is an optax
`GradientTransformation` (it keeps its learning rate to itself; the `lr` metric is then NaN), or a
factory taking `learning_rate` such as `optax.adamw` or `functools.partial(optax.adamw,
weight_decay=0.1)`, driven by `lr_scheduler` (an optax schedule of the update count) or by the
config's `scheduler` section (WarmupLR with `warmup_max_lr`, WarmupDecayLR, OneCycle with
`cycle_momentum: false`, LRRangeTest; WarmupCosineLR scales an lr the optimizer keeps to itself, so
it is an error). With neither a section nor `optimizer=`, `plan` stops with one error: zerojax never
picks an optimizer for you. With both, the one passed in code is used and the section is ignored with a
warning, as DeepSpeed does. An optimizer passed in code is not known to be elementwise, so
`offload_optimizer.compute: auto` keeps its update on the device, and pipelines (`model=`) need the
section.

**Filled: Hugging Face `"auto"`.** The Trainer fills these placeholders from its `TrainingArguments`
and the model's config before DeepSpeed reads the file. zerojax fills those it can derive the same way,
and `config explain` shows each with the source `derived ('auto': ...)`:

| key | value (hidden: the model's hidden size) |
|---|---|
| `train_batch_size`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps` | derived from the other two (or one) as the batch triad rule below says |
| `gradient_clipping` | 1.0, the Trainer's `max_grad_norm` default |
{hidden}
| `scheduler.params.warmup_min_lr` | 0, as the Trainer writes it |
| `scheduler.params.warmup_max_lr` | `optimizer.params.lr` (the Trainer writes its `learning_rate` into both) |
| `scheduler.params.total_num_steps` | `run.steps`, when given (the Trainer's `max_steps`) |

The hidden size is `load_config(..., hidden_size=H)` / `zerojax.initialize(..., hidden_size=H)` (the
Trainer reads `model.config.hidden_size`), else `model.d_model` (the embedded GPT). Every other
`"auto"` the Trainer fills ({trainer}, the other scheduler params, and the batch sizes when neither
`train_batch_size` nor `train_micro_batch_size_per_gpu` is a number) can only come from the Trainer's
arguments; `load_config` lists all of them in one error, each with the `--set key=value`
that sets it (in Python: `load_config(path, ["fp16.enabled=true", ...])`). In particular
`fp16.enabled: "auto"` and `bf16.enabled: "auto"` never fall back to fp32 in silence. The printed
`--set` line loads as printed: when both are `"auto"` it picks bf16 (`fp16.enabled=false
bf16.enabled=true`; the Trainer's `--fp16` is the reverse), since both on is refused.

**Ignored with one warning.** DeepSpeed keys that zerojax does not build and that cannot change the
result here:

| key | in DeepSpeed | effect here | alternative |
|---|---|---|---|
{accepted_rows}

**Refused.** The same keys are refused, with the reason, when their value would change the result,
as are 1-bit optimizers,
`fp16.fp16_master_weights_and_grads`, partial offload (`offload_optimizer.ratio` < 1) and MiCS
(`mics_shard_size` > 0):

| key | in DeepSpeed | refused when | effect otherwise | alternative |
|---|---|---|---|---|
{refused_rows}
"""


def _names(keys: list[str]) -> str:
    return ", ".join(f"`{_OPTIMIZER_NAMES.get(k, k)}`" for k in keys)


def _top_level() -> str:
    """Top-level scalar keys in one table; each section gets its own table below."""
    rows = []
    for f, tp in _fields(schema.Config):
        if f.name in ("optimizer", "scheduler") or _section_of(tp) is not None:
            rows.append(_row(f.name, f, tp, section=True, path=f.name))
        else:
            rows.append(_row(f.name, f, tp, path=f.name))
    return "## Top-level keys\n\n" + _table(rows)


def _sections() -> Iterator[str]:
    for f, tp in _fields(schema.Config):
        cls = _section_of(tp)
        if cls is not None and f.name not in ("optimizer", "scheduler"):
            yield from _section(f.name, cls, level=2)


def _section(path: str, cls: type, level: int) -> Iterator[str]:
    """A section's table, then its sub-sections one heading level down."""
    rows, nested = [], []
    for f, tp in _fields(cls):
        sub = _section_of(tp)
        rows.append(_row(f.name, f, tp, section=sub is not None, path=f"{path}.{f.name}"))
        if sub is not None:
            nested.append((f"{path}.{f.name}", sub))
        elif _items_of(tp) is not None:  # a list of sections: one table for the keys of each item
            nested.append((f"{path}.{f.name}[]", _items_of(tp)))
    yield f"{'#' * level} `{path}`\n\n{_class_doc(cls)}\n\n{_table(rows)}"
    for sub_path, sub in nested:
        yield from _section(sub_path, sub, level + 1)


def _optimizers() -> str:
    rows = [_row(f.name, f, tp, section=f.name == "params", path=f"optimizer.{f.name}")
            for f, tp in _fields(schema.OptimizerConfig)]
    out = [f"## `optimizer`\n\n{_class_doc(schema.OptimizerConfig)}\n\n{_table(rows)}"]
    by_class: dict[type, list[str]] = {}
    for key, cls in schema.OPTIMIZER_PARAMS.items():
        by_class.setdefault(cls, []).append(key)
    for cls, keys in by_class.items():
        untested = [k for k in keys if k not in schema.ZERO_TESTED_OPTIMIZERS]
        note = (" Under ZeRO it needs `zero_allow_untested_optimizer: true`." if untested else "")
        out.append(f"### `optimizer.params` for type {' / '.join(_names([k]) for k in keys)}\n\n"
                   f"{_class_doc(cls)}{note}\n\n"
                   f"{_table([_row(f.name, f, tp, path=f'optimizer.params.{f.name}') for f, tp in _fields(cls)])}")
    return "\n".join(out)


def _schedulers() -> str:
    rows = [_row(f.name, f, tp, section=f.name == "params", path=f"scheduler.{f.name}")
            for f, tp in _fields(schema.SchedulerConfig)]
    out = [f"## `scheduler`\n\n{_class_doc(schema.SchedulerConfig)} Leave `scheduler` out for a constant "
           f"learning rate (the optimizer's `lr`).\n\n{_table(rows)}"]
    for name, cls in schema.SCHEDULER_PARAMS.items():
        required = schema.REQUIRED_SCHEDULER_PARAMS.get(name, ())
        rows = [_row(f.name, f, tp, required=f.name in required, path=f"scheduler.params.{f.name}")
                for f, tp in _fields(cls)]
        out.append(f"### `scheduler.params` for type `{name}`\n\n{_class_doc(cls)}\n\n{_table(rows)}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Rows and cells.

def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in schema.schema_fields(cls)]


def _section_of(tp: Any) -> type | None:
    """The dataclass a field holds (Optional[...] unwrapped), if it is a section."""
    for arg in _union_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _items_of(tp: Any) -> type | None:
    """The section each item of a list-of-sections field holds (`layer_specs`), else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and args[1:] == (Ellipsis,) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _union_args(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _class_doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split())


def _row(name: str, f: dataclasses.Field, tp: Any, *, path: str, section: bool = False,
         required: bool = False) -> list[str]:
    """One table row; the status comes from zerojax.config.status (KeyError: a key without one)."""
    status = _cell(KEY_STATUS[path])
    meta = f.metadata
    doc = meta.get("doc", "")
    aliases = meta.get("aliases", ())
    if aliases:
        doc += " Also accepted as " + ", ".join(f"`{a}`" for a in aliases) + "."
    if section:
        kind = "section" + (" or null" if type(None) in _union_args(tp) else "")
        default = "`null`" if f.default is None else "see below"
        return [f"`{name}`", kind, default, status, _cell(doc)]
    if required:
        return [f"`{name}`", _cell(_type_text(tp, meta, nullable=False)), "**required**", status, _cell(doc)]
    return [f"`{name}`", _cell(_type_text(tp, meta)), f"`{_json(_default(f))}`", status, _cell(doc)]


def _default(f: dataclasses.Field) -> Any:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return _plain(value)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in schema.schema_fields(type(value))}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _json(value: Any) -> str:
    return json.dumps(value)


def _type_text(tp: Any, meta: Mapping[str, Any], nullable: bool = True) -> str:
    """e.g. `int > 0`, `float or null`, `one of "log", "linear"`, `bool (or 0/1)`."""
    args = _union_args(tp)
    nullable = nullable and type(None) in args
    base = next(a for a in args if a is not type(None))
    choices = meta.get("choices")
    if choices:
        text = "one of " + ", ".join(_json(c) for c in choices)
    else:
        text = _base_type(base)
        if meta.get("int_bool"):
            text += " (or 0/1)"
        bounds = [f"{word} {_number(meta[key])}" for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="))
                  if meta.get(key) is not None]
        if bounds:
            text += " " + ", ".join(bounds)
    return text + (" or null" if nullable else "")


def _base_type(tp: Any) -> str:
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:  # a list of any length
            item = args[0]
            if dataclasses.is_dataclass(item):
                return "list of {" + ", ".join(f.name for f in dataclasses.fields(item)) + "}"
            return "list of " + _base_type(item)
        return "[" + ", ".join(_base_type(a) for a in args) + "]"
    if isinstance(tp, type) and issubclass(tp, Mapping):
        return "mapping"
    if tp is tuple:
        return "list"
    return {bool: "bool", int: "int", float: "float", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _cell(text: str) -> str:
    """Table-safe text: a `|` would end the cell."""
    return text.replace("|", "\\|")


def _table(rows: list[list[str]]) -> str:
    lines = ["| key | type | default | status | description |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(render_reference())


if __name__ == "__main__":
    main()
