"""Which parameter gets which treatment, by its dotted name: the config's `optimizer.no_decay` and
`optimizer.param_groups` (weight decay and lr scale per group), DeepSpeed's Muon/Adam split, and the
name patterns `model.trainable` / `model.frozen` share.

The answers are trees (`Groups.decay`, `Groups.lr_scales`, `muon_labels`) that the building blocks of
`zerojax.optim.transforms` take, so those never see a name or the config.
"""
from __future__ import annotations

import fnmatch
import re
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from zerojax.core.names import dotted
from zerojax.errors import ConfigError

if TYPE_CHECKING:
    from zerojax.config import ParamGroup

__all__ = ["NAME_ALIASES", "name_matches", "Groups", "ADAM_WORDS", "muon_labels"]


#: Name words that keep a matrix on Adam: DeepSpeed's "embed" and "lm_head" (set_optimizer_flags), as
#: zerojax's name words (`embed` also matches pos, wte, wpe; `head` also the bare `head` of its models).
ADAM_WORDS = ("embed", "head")


def muon_labels(params: Any, layer_axes: Any = None) -> Any:
    """"muon" or "adam" per leaf: Muon for a matrix (two or more dimensions besides the leading
    `layer_axes` that stack layers) whose name has none of ADAM_WORDS; Adam for the rest (embeddings,
    the head, norms, biases), as DeepSpeed's set_optimizer_flags decides."""
    if not jax.tree.leaves(params):  # optax.tree_utils.tree_map_params' placeholder
        return params
    stacked = jax.tree.map(lambda _: 0, params) if layer_axes is None else jax.tree.map(
        lambda k, sub: jax.tree.map(lambda _: max(int(k), 0), sub), layer_axes, params)

    def one(path: Any, x: Any, k: int) -> str:
        name = dotted(path)
        matrix = len(x.shape) - k >= 2
        return "muon" if matrix and not any(name_matches(w, name) for w in ADAM_WORDS) else "adam"
    return jax.tree_util.tree_map_with_path(one, params, stacked)


# ---------------------------------------------------------------------------------------------
# Weight-decay masks and parameter groups, by parameter name (HF Trainer's no-decay list, Megatron's
# no-weight-decay-for-biases-and-norms, DeepSpeed/torch param groups with their own lr and decay).

#: What the words of `optimizer.no_decay` also match besides their own text (a part of the name).
NAME_ALIASES = {"norm": re.compile(r"ln(\d+|_\w+)?"), "embed": re.compile(r"pos|wte|wpe|pos_emb\w*")}


def name_matches(pattern: str, name: str) -> bool:
    """Whether a group pattern picks the parameter with dotted `name` (case-insensitive).

    A pattern with `*`, `?` or `[` matches the whole name (fnmatch: `blocks.*.bias`); a word matches
    when it is part of one of the name's parts (`bias` matches `blocks.qkv.bias`), dotted words are
    whole consecutive parts (`qkv.bias` matches `blocks.qkv.bias`, not `blocks.qkv.bias2`), and `norm` / `embed`
    also match the usual short names of norms and embeddings (`ln1`, `ln_f`; `pos`, `wte`, `wpe`).
    """
    pattern, name = pattern.lower(), name.lower()
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    if "." in pattern:  # dotted words: a run of whole parts (`layers.b` matches `model.layers.b`)
        return f".{pattern}." in f".{name}."
    alias = NAME_ALIASES.get(pattern)
    return any(pattern in part or (alias is not None and alias.fullmatch(part)) for part in name.split("."))


class Groups(NamedTuple):
    """The config's no-decay patterns and parameter groups, answering per parameter name."""
    no_decay: tuple[str, ...]
    param_groups: tuple[ParamGroup, ...]

    def group(self, name: str) -> ParamGroup | None:
        return next((g for g in self.param_groups if any(name_matches(p, name) for p in g.match)), None)

    def weight_decay(self, name: str, default: float) -> float:
        """The group's weight_decay, else 0 for a no-decay name, else the optimizer's."""
        group = self.group(name)
        if group is not None and group.weight_decay is not None:
            return group.weight_decay
        if any(name_matches(p, name) for p in self.no_decay):
            return 0.0
        return default

    def lr_scale(self, name: str) -> float:
        group = self.group(name)
        return 1.0 if group is None else group.lr_scale

    @property
    def scales_lr(self) -> bool:
        return any(g.lr_scale != 1.0 for g in self.param_groups)

    def table(self, params: Any, default: float) -> list[tuple[str, float, float]]:
        """(name, weight decay, lr scale) of every parameter: what the update will use."""
        return [(name, self.weight_decay(name, default), self.lr_scale(name)) for name in _names(params)]

    def check(self, params: Any) -> None:
        """Every pattern must pick at least one parameter: a pattern that matches none is a typo."""
        names = _names(params)
        keyed = [("optimizer.no_decay", p) for p in self.no_decay]
        keyed += [(f"optimizer.param_groups[{i}].match", p) for i, g in enumerate(self.param_groups) for p in g.match]
        for key, pattern in keyed:
            if not any(name_matches(pattern, n) for n in names):
                shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
                raise ConfigError(f"{key}: '{pattern}' matches no parameter of the model; its parameters "
                                  f"are {shown}")

    def decay(self, default: float) -> Any:
        """A callable params -> each leaf's weight decay (`transforms.add_decay`'s argument)."""
        return lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: self.weight_decay(dotted(path), default), params)

    def lr_scales(self) -> Any:
        """A callable updates -> each leaf's lr scale (`transforms.scale_per_leaf`'s argument)."""
        return lambda tree: jax.tree_util.tree_map_with_path(lambda path, _: self.lr_scale(dotted(path)), tree)


def _names(params: Any) -> list[str]:
    return [dotted(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
