"""The generic part of loading: walk the schema, coerce each value to its field's type, check it,
and name the nearest valid key for a typo.
"""
from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, Mapping, Sequence

from zerojax.errors import ConfigError
from zerojax.config.fields import MISSING, schema_fields
from zerojax.config.foreign import accept_foreign, foreign_keys_in
from zerojax.config.paths import join_path, show, to_plain
from zerojax.config.schema.optimizer import (ONE_BIT_OPTIMIZERS, OPTIMIZER_PARAMS, REFUSED_OPTIMIZERS, OptimizerConfig,
                                             ParamGroup)
from zerojax.config.schema.root import BATCH_KEYS, Config
from zerojax.config.schema.scheduler import REQUIRED_SCHEDULER_PARAMS, SCHEDULER_PARAMS, SchedulerConfig


def schema_step(cls: type | None, part: str) -> tuple[str, tuple[str, ...], type | None]:
    """One step down the schema: canonical name of `part`, its aliases, and the section below it."""
    if cls is None:
        return part, (), None
    fields = {f.name: f for f in schema_fields(cls)}
    alias_of = {a: f.name for f in fields.values() for a in f.metadata.get("aliases", ())}
    name = alias_of.get(part, part)
    if name not in fields:
        return part, (), None
    return name, fields[name].metadata.get("aliases", ()), _dataclass_of(typing.get_type_hints(cls)[name])


def given_values(obj: Any, prefix: str, sources: Mapping[str, str],
                  origin: dict[str, str]) -> dict[str, Any]:
    """The raw tree a loaded Config was built from, with each value's source recorded in `origin`.

    Derived values are left out so that overrides re-derive them (weight_decay after torch_adam
    changes, d_ff after d_model changes); values changed in Python count as "given".
    """
    out: dict[str, Any] = {}
    for f in schema_fields(type(obj)):
        path, value = join_path(prefix, f.name), getattr(obj, f.name)
        if isinstance(value, (OptimizerConfig, SchedulerConfig)):
            origin[path + ".type"] = sources.get(path + ".type", "default")
            out[f.name] = {"type": value.type,
                           "params": given_values(value.params, path + ".params", sources, origin)}
        elif dataclasses.is_dataclass(value):
            out[f.name] = given_values(value, path, sources, origin)
        else:
            label = sources.get(path, "default")
            if "'auto'" in label:
                out[f.name] = "auto"
            elif label.startswith("default"):
                if value != _field_default(f):
                    out[f.name] = to_plain(value)
                    origin[path] = "given"
            elif not label.startswith("derived"):
                out[f.name] = to_plain(value)
                origin[path] = label
    return out


def _field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


def plain_copy(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: plain_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain_copy(v) for v in obj]
    return obj


_SUGGEST_CUTOFF = 0.75


def _did_you_mean(key: str, valid: Sequence[str], noun: str = "keys", where: str | None = None) -> str:
    """The nearest valid key; else, for a key that lives in another section, where it goes."""
    # 0.75: a slip of a letter or two, a missing word; not a different key sharing a prefix
    # (tensor_parallel is not tensorboard).
    close = difflib.get_close_matches(key, valid, n=1, cutoff=_SUGGEST_CUTOFF)
    if not close:
        lowered = {v.lower(): v for v in valid}
        close = [lowered[key.lower()]] if key.lower() in lowered else []
    if close:
        return f"; did you mean '{close[0]}'?"
    if where == "bf16" and f"fp16.{key}" in schema_paths():  # a loss-scaling key: not a typo to move
        return (f"; bf16 trains without loss scaling (its range needs none, and DeepSpeed's bf16 section has no "
                f"{key}): remove it (fp16.{key} applies to fp16 runs only)")
    if where is not None:
        homes = [p for p in schema_paths() if p.rsplit(".", 1)[-1] == key and p != join_path(where, key)]
        if homes:
            return f"; it belongs elsewhere: did you mean '{homes[0]}'?"
    return f"; valid {noun}: {', '.join(sorted(valid))}"


@functools.lru_cache(maxsize=None)
def schema_paths() -> tuple[str, ...]:
    """Every dotted key the schema knows (optimizer/scheduler params of every type), shallow first."""
    paths: list[str] = []
    queue: list[tuple[type, str]] = [(Config, "")]
    queue += [(c, "optimizer.params") for c in OPTIMIZER_PARAMS.values()]
    queue += [(c, "scheduler.params") for c in SCHEDULER_PARAMS.values()]
    while queue:
        cls, prefix = queue.pop(0)
        hints = typing.get_type_hints(cls)
        for f in schema_fields(cls):
            path = join_path(prefix, f.name)
            if path not in paths:
                paths.append(path)
            nested = _dataclass_of(hints[f.name])
            if nested is not None:
                queue.append((nested, path))
            elif item_section(hints[f.name]) is not None:
                queue.append((item_section(hints[f.name]), path + "[]"))
    paths += ["optimizer.type", "optimizer.params", "optimizer.no_decay", "optimizer.param_groups",
              "scheduler.type", "scheduler.params"]
    return tuple(paths)


def _origin_of(path: str, origin: Mapping[str, str]) -> str:
    """Where a given value came from: the nearest overridden ancestor (a whole section can be
    overridden), else the file (or dict)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        label = origin.get(".".join(parts[:i]))
        if label is not None:
            return label
    return "file"


#: While `build_config` runs: the unknown and refused keys met so far (None: raise at the first).
_KEY_PROBLEMS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("key_problems", default=None)


def _key_problem(message: str) -> None:
    """An unknown or refused key: noted, so that the load names every one; raised when building alone."""
    found = _KEY_PROBLEMS.get()
    if found is None:
        raise ConfigError(message)
    found.append(message)


def build_config(raw: Any, sources: dict[str, str], origin: Mapping[str, str]) -> Config:
    """The root section, with every unknown or refused key named in one error: a config written for
    DeepSpeed often has several (DeepSpeedExamples' cifar config has five), and one error per run
    would take as many runs to find them all."""
    found: list[str] = []
    token = _KEY_PROBLEMS.set(found)
    try:
        config = build_section(Config, raw, "", sources, origin)
    except ConfigError as e:
        if not found:
            raise
        found.append(str(e))  # the first error of another kind, after the keys met before it
    finally:
        _KEY_PROBLEMS.reset(token)
    if len(found) == 1:
        raise ConfigError(found[0])
    if found:
        raise ConfigError(f"{len(found)} problems in the config; fix each:\n" + "\n".join(f"  - {m}" for m in found))
    return config


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _auto_is_a_value(tp: Any, meta: Mapping[str, Any]) -> bool:
    """Whether "auto" is an ordinary value of the field (a free string, or one of its choices)."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    choices = meta.get("choices")
    return str in args and (not choices or "auto" in choices)


def build_section(cls: type, raw: Any, prefix: str, sources: dict[str, str], origin: Mapping[str, str]) -> Any:
    where = prefix or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a section (mapping of keys), got {show(raw)}")
    fields = {f.name: f for f in schema_fields(cls)}
    alias_of = {a: f.name for f in fields.values() for a in f.metadata.get("aliases", ())}
    given: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key {key!r} must be a string")
        if key.startswith("_"):
            continue  # "_comment", "_read_the_docs": comments, as real configs write them
        name = alias_of.get(key, key)
        if name not in fields:
            try:
                if accept_foreign(join_path(prefix, key), value, sources):
                    continue
            except ConfigError as e:  # refused: named with the others
                _key_problem(str(e))
                continue
            if prefix == "optimizer.params" and key == "max_grad_norm":
                _key_problem("optimizer.params.max_grad_norm: not a parameter of DeepSpeed's "
                             f"{cls.__doc__.split()[0]} optimizer; clip gradients with the top-level "
                             "gradient_clipping (e.g. \"gradient_clipping\": 1.0)")
                continue
            hint = _did_you_mean(key, list(fields) + list(alias_of) + foreign_keys_in(prefix), where=prefix)
            if prefix in ("optimizer.params", "scheduler.params"):
                hint += f" ({cls.__doc__.splitlines()[0]})"
            _key_problem(f"unknown key '{join_path(prefix, key)}'{hint}")
            continue
        if name in given:
            raise ConfigError(f"{join_path(prefix, key)}: given twice (also as an alias); keep one")
        given[name] = value
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        path = join_path(prefix, name)
        if cls is Config and name in ("optimizer", "scheduler"):
            if name in given and given[name] is not None:
                kwargs[name] = _build_typed(name, given[name], sources, origin)
            continue
        tp = hints[name]
        nested = _dataclass_of(tp)
        if nested is not None:
            kwargs[name] = build_section(nested, given.get(name), path, sources, origin)
            continue
        if name not in given:
            continue
        value = given[name]
        if is_auto(value) and not _auto_is_a_value(tp, f.metadata):
            # Hugging Face's placeholder: the batch triad derives it, everything else takes its default.
            sources[path] = "derived ('auto')" if path in BATCH_KEYS else "default ('auto')"
            continue
        item = item_section(tp)
        if item is not None:
            kwargs[name] = _build_items(item, value, path, origin)
        else:
            kwargs[name] = _coerce(value, tp, path, f.metadata)
        sources[path] = _origin_of(path, origin)
    return cls(**kwargs)


def _build_typed(name: str, raw: Any, sources: dict[str, str], origin: Mapping[str, str]) -> Any:
    """optimizer / scheduler: the params schema depends on `type`."""
    example = "AdamW" if name == "optimizer" else "WarmupLR"
    if not isinstance(raw, Mapping):
        raise ConfigError(f'{name}: expected {{"type": "{example}", "params": {{...}}}}, got {show(raw)}')
    raw = {k: v for k, v in raw.items() if not (isinstance(k, str) and k.startswith("_"))}
    allowed = ["type", "params"] + (["no_decay", "param_groups"] if name == "optimizer" else [])
    extra = {k for k in set(raw) - set(allowed) if not accept_foreign(f"{name}.{k}", raw[k], sources)}
    for key in sorted(map(str, extra)):
        _key_problem(f"unknown key '{name}.{key}'{_did_you_mean(key, allowed)}")
    if "type" not in raw or not isinstance(raw["type"], str):
        raise ConfigError(f'{name}.type: required, a string such as "{example}"')
    given_type = raw["type"]
    params = raw.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{name}.params: expected a mapping of keys, got {show(params)}")
    for key, value in params.items():
        if is_auto(value):
            raise ConfigError(f"{name}.params.{key}: 'auto' is a Hugging Face Trainer placeholder and "
                              f"there is no Trainer to fill it in; write the number")
    if name == "optimizer":
        canon = given_type.lower()
        if canon in ONE_BIT_OPTIMIZERS:
            raise ConfigError(f"optimizer.type: {given_type} (1-bit communication compression) is out of "
                              f"scope for zerojax; use Adam or Lamb")
        if canon in REFUSED_OPTIMIZERS:
            raise ConfigError(f"optimizer.type: {given_type}: {REFUSED_OPTIMIZERS[canon]}")
        if canon not in OPTIMIZER_PARAMS:
            raise ConfigError(f"optimizer.type: unknown optimizer '{given_type}'"
                              f"{_did_you_mean(canon, list(OPTIMIZER_PARAMS), 'types')}")
        params_cls = OPTIMIZER_PARAMS[canon]
        built = build_section(params_cls, params, "optimizer.params", sources, origin)
        sources["optimizer.type"] = _origin_of("optimizer.type", origin)
        groups = {}
        for key in ("no_decay", "param_groups"):
            if raw.get(key) is not None:
                groups[key] = _parse_group_key(key, raw[key])
                sources[f"optimizer.{key}"] = _origin_of(f"optimizer.{key}", origin)
        return OptimizerConfig(type=canon, params=built, **groups)
    canon_map = {k.lower(): k for k in SCHEDULER_PARAMS}
    canon = canon_map.get(given_type.lower())
    if canon is None:
        raise ConfigError(f"scheduler.type: unknown scheduler '{given_type}'"
                          f"{_did_you_mean(given_type, list(SCHEDULER_PARAMS), 'types')}")
    built = build_section(SCHEDULER_PARAMS[canon], params, "scheduler.params", sources, origin)
    for req in REQUIRED_SCHEDULER_PARAMS.get(canon, ()):
        if getattr(built, req) is None:
            raise ConfigError(f"scheduler.params.{req}: required by {canon}; add it")
    sources["scheduler.type"] = _origin_of("scheduler.type", origin)
    return SchedulerConfig(type=canon, params=built)


def _patterns(value: Any, path: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(p, str) and p for p in items):
        raise ConfigError(f"{path}: expected a name pattern or a list of them (e.g. [bias, norm, embed]), "
                          f"got {show(value)}")
    return tuple(items)


def _parse_group_key(key: str, value: Any) -> Any:
    """optimizer.no_decay (patterns) and optimizer.param_groups (a list of groups), checked."""
    if key == "no_decay":
        return () if value == [] else _patterns(value, "optimizer.no_decay")
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"optimizer.param_groups: expected a list of groups such as "
                          f'[{{"match": "embed", "lr_scale": 0.1}}], got {show(value)}')
    groups = []
    for i, g in enumerate(value):
        path = f"optimizer.param_groups[{i}]"
        if not isinstance(g, Mapping):
            raise ConfigError(f"{path}: expected a mapping with match, lr_scale and/or weight_decay, got {show(g)}")
        unknown = sorted(set(map(str, g)) - {"match", "lr_scale", "weight_decay"})
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}: unknown key; a group has match, lr_scale and weight_decay")
        if "match" not in g:
            raise ConfigError(f"{path}.match: required: the name pattern(s) of the group's parameters")
        lr_scale = _coerce(g.get("lr_scale", 1.0), float, f"{path}.lr_scale", {})
        wd = g.get("weight_decay")
        wd = None if wd is None else _coerce(wd, float, f"{path}.weight_decay", {})
        if lr_scale < 0 or (wd is not None and wd < 0):
            raise ConfigError(f"{path}: lr_scale and weight_decay must be >= 0")
        if lr_scale == 1.0 and wd is None:
            raise ConfigError(f"{path}: sets neither lr_scale nor weight_decay, so it changes nothing; "
                              f"give one or remove the group")
        groups.append(ParamGroup(_patterns(g["match"], f"{path}.match"), lr_scale, wd))
    return tuple(groups)


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    return None


def item_section(tp: Any) -> type | None:
    """The section each item of a list-of-sections field holds (`layer_specs`), else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and args[1:] == (Ellipsis,) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _build_items(cls: type, value: Any, path: str, origin: Mapping[str, str]) -> tuple:
    """A list of sections, each checked like a section (unknown keys, types, choices) under `path[i]`."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list of sections ({{...}}, ...), got {show(value)}")
    return tuple(build_section(cls, v, f"{path}[{i}]", {}, origin) for i, v in enumerate(value))


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        return "a list of " + _type_name(typing.get_args(tp)[0]) + "s"
    if origin is tuple:
        return "a list of " + str(len(typing.get_args(tp))) + " numbers"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, path: str, meta: Mapping[str, Any]) -> Any:
    if meta.get("parse") is not None:
        return meta["parse"](value, path)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return _coerce(value, inner, path, meta)

    def bad() -> ConfigError:
        zero_one = " (or 0/1)" if meta.get("int_bool") else ""
        return ConfigError(f"{path}: expected {_type_name(tp)}{zero_one}, got {show(value)}")

    if tp is bool:
        if isinstance(value, bool):
            out: Any = value
        elif meta.get("int_bool") and isinstance(value, int) and value in (0, 1):
            out = bool(value)
        else:
            raise bad()
    elif tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise bad()
        out = value
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        out = float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise bad()
        out = value
    elif origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        if not isinstance(value, (list, tuple)):
            raise bad()
        out = tuple(_coerce(v, typing.get_args(tp)[0], f"{path}[{i}]", {}) for i, v in enumerate(value))
    elif origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad()
        out = tuple(_coerce(v, a, f"{path}[{i}]", {}) for i, (v, a) in enumerate(zip(value, args)))
    else:  # pragma: no cover - schema types are the ones above
        out = value
    choices = meta.get("choices")
    if choices:
        if isinstance(out, str):
            match = {str(c).lower(): c for c in choices}.get(out.lower())
            if match is None:
                raise ConfigError(f"{path}: '{out}' is not one of {', '.join(map(str, choices))}")
            out = match
        elif out not in choices:
            raise ConfigError(f"{path}: {show(out)} is not one of {', '.join(map(str, choices))}")
    if isinstance(out, float) and out != out:
        raise ConfigError(f"{path}: NaN is not a usable value; write a number")
    for bound, ok, word in (("ge", lambda x, b: x >= b, ">="), ("gt", lambda x, b: x > b, ">"),
                            ("le", lambda x, b: x <= b, "<=")):
        b = meta.get(bound)
        if b is not None and isinstance(out, (int, float)) and not ok(out, b):
            raise ConfigError(f"{path}: {show(out)} must be {word} {b}")
    return out
