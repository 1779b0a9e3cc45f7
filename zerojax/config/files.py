"""Reading config files: JSON, hjson (DeepSpeed's own reader) and YAML, duplicate keys refused.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Sequence

from zerojax.errors import ConfigError
from zerojax.config.paths import join_path


def read_config_file(path: Path) -> dict[str, Any]:
    """A config file's mapping; every failure names the file and says what to do."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise ConfigError(f"config file {path}: {what}; give the path of a .json, .hjson or .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: cannot read it ({e})") from None
    if not text.strip():
        raise ConfigError(f"config file {path}: the file is empty; write a mapping such as "
                          f'{{"train_batch_size": 32}}')
    try:
        data = reject_duplicates(_parse_text(text, path.suffix.lower()))
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except Exception as e:  # parser errors carry line/column
        raise ConfigError(f"config file {path}: cannot parse: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of keys, "
                          f"got {type(data).__name__}")
    return data


def _parse_text(text: str, suffix: str) -> Any:
    """By extension: YAML, hjson, or JSON (then hjson: DeepSpeed configs often carry comments and
    trailing commas). Any other extension (.txt, .cfg, none) is JSON, else YAML, else hjson: a YAML
    file read as hjson would fail with a misleading message about keys or braces."""
    if suffix in (".yaml", ".yml"):
        return load_yaml(text)
    if suffix == ".hjson":
        return _load_hjson(text)
    try:
        return json.loads(text, object_pairs_hook=_Pairs.of)
    except json.JSONDecodeError:
        if suffix == ".json":
            return _load_hjson(text)
    try:
        data = load_yaml(text)
    except Exception as yaml_error:
        try:
            data = _load_hjson(text)
        except Exception:
            data = None
        if isinstance(data, dict):
            return data
        raise ConfigError(f"cannot parse it as JSON, YAML or hjson (YAML says: {yaml_error}); "
                          f"name the file .yaml, .json or .hjson to choose its format") from None
    if isinstance(data, dict):
        return data
    return _load_hjson(text)  # e.g. an hjson mapping without braces reads as one YAML string


class _Pairs(dict):
    """A parsed mapping that remembers keys written twice, so the error can name their full path."""
    duplicates: tuple[Any, ...] = ()

    @classmethod
    def of(cls, pairs: Sequence[tuple[Any, Any]], written: Sequence[Any] | None = None) -> "_Pairs":
        out = cls(pairs)
        keys = [k for k, _ in pairs] if written is None else list(written)
        out.duplicates = tuple(dict.fromkeys(k for i, k in enumerate(keys) if k in keys[:i]))
        return out


def reject_duplicates(data: Any, prefix: str = "") -> Any:
    """Plain dicts and lists again; the first key written twice is an error naming its dotted path."""
    if isinstance(data, dict):
        for key in getattr(data, "duplicates", ()):
            raise ConfigError(f"{join_path(prefix, str(key))}: key written twice; keep one of them")
        return {k: reject_duplicates(v, join_path(prefix, str(k))) for k, v in data.items()}
    if isinstance(data, list):
        return [reject_duplicates(v, f"{prefix}[{i}]") for i, v in enumerate(data)]
    return data


def _load_hjson(text: str) -> Any:
    import hjson
    return hjson.loads(text, object_pairs_hook=_Pairs.of)


# YAML 1.1 (PyYAML) reads `1e-3` as a string; YAML 1.2 and JSON read it as a number, as users expect.
_YAML_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


@functools.lru_cache(maxsize=None)
def _yaml_loader() -> type:
    """A safe YAML loader that reads 1e-3 as a float and records keys written twice."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    merge_tag = "tag:yaml.org,2002:merge"

    def construct_mapping(loader: Any, node: Any, deep: bool = False) -> dict:
        written = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode) and k.tag != merge_tag]
        loader.flatten_mapping(node)  # `<<` merges first, so explicit keys win over merged ones
        pairs = [(loader.construct_object(k, deep=deep), loader.construct_object(v, deep=deep))
                 for k, v in node.value]
        return _Pairs.of(pairs, written)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_FLOAT, list("-+0123456789."))
    return Loader


def load_yaml(text: str) -> Any:
    import yaml
    return yaml.load(text, Loader=_yaml_loader())
