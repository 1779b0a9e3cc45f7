"""Which dimension of which weight the tensor axis splits: the tensor-parallel plan.

Sources, the first that applies to a leaf wins (each leaf's row in `TensorPlan.table` names it; a LoRA
adapter's A is split like its projection's input side and B like its output side, `_role_dim`):

1. the model's own annotations (`nnx.with_partitioning` logical axis names) through
   `mesh.logical_axis_rules`, or a name that is the tensor axis itself;
2. DeepSpeed's `tensor_parallel.partition_config.layer_specs`: regular expressions over the leaf's
   dotted path with a `partition_type` (DeepSpeed's AutoTP training). Torch stores a linear weight
   [out, in] and Flax [in, out]: "column" splits the output features (Flax's last dimension, and a
   bias), "row" the input features (the one before it); a Flax `embedding` table [vocab, features]
   is split by vocabulary for "column" and by features for "row"; "skip" keeps the leaf whole;
3. Megatron's pairs for the shipped GPT and Llama (and checkpoints imported from Hugging Face, which
   use the Llama's names; `tensor_parallel.preset_model` names the family for a user's tree that uses
   them): query/key/value, gate and up split by output features, the attention output and down
   projections by input features, the embedding and head by vocabulary. Heads are split whole:
   key/value projections stay whole when the tensor size does not divide their heads, and the
   GPT's fused qkv projection stays whole (its [q | k | v] columns are not head-major); a MoE
   layer's stacked experts (`experts.gate` / `up` / `down`) are sliced as its MLP is, every expert
   alike (DeepSpeed-MoE's `enable_expert_tensor_parallelism=True`);
4. the pairs read off the loss (`zerojax.find_tensor_splits`, passed as `tensor_dims`).

With `whole_experts` (DeepSpeed-MoE's `enable_expert_tensor_parallelism=False`) the expert weights -
leaves annotated `expert`, or Megatron's `experts.gate` / `up` / `down` - stay whole whatever the
source: each tensor device runs whole experts on its share of the tokens instead.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import jax

from zerojax.core.names import dotted, key_name
from zerojax.errors import ConfigError

COLUMN, ROW, SKIP = "column", "row", "skip"
# A LoRA adapter's two matrices beside its projection's kernel (zerojax.models.lora): A [..., in, r] is
# split like the kernel's input side, B [..., r, out] like its output side, so x A B needs no gather.
ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One of DeepSpeed's `layer_specs`: leaves whose path matches a pattern get `partition_type`."""
    patterns: tuple[str, ...]
    partition_type: str


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """Per leaf (tree order): the split dimension or None, and why."""
    dims: tuple[int | None, ...]
    table: tuple[tuple[str, tuple[int, ...], int | None, str], ...]  # (path, shape, dim, source)

    def describe(self, size: int) -> str:
        """The plan as a table a user can read and copy into `layer_specs`."""
        split = sum(d is not None for d in self.dims)
        out = [f"tensor parallel over {size} devices: {split} of {len(self.dims)} weights split"]
        width = max((len(p) for p, *_ in self.table), default=4)
        for path, shape, dim, source in self.table:
            where = "whole" if dim is None else f"dim {dim}"
            out.append(f"  {path:<{width}} {str(shape):<18} {where:<7} {source}")
        return "\n".join(out)


# Megatron's roles by the shipped models' layer names (the Llama's are Hugging Face's, shortened).
_COLUMN_NAMES = {"q", "k", "v", "gate", "up", "fc", "head", "q_proj", "k_proj", "v_proj", "gate_proj",
                 "up_proj", "c_fc", "lm_head", "wq", "wk", "wv", "w1", "w3"}
_ROW_NAMES = {"o", "down", "out", "o_proj", "down_proj", "c_proj", "wo", "w2"}
_KEY_VALUE = {"k", "v", "k_proj", "v_proj", "wk", "wv"}
_ATTENTION = {"q", "o", "q_proj", "o_proj", "wq", "wo"} | _KEY_VALUE  # split by whole heads
_VOCAB = {"embed", "embed_tokens", "wte", "tok_embeddings"}
WHOLE_EXPERTS = "whole: experts whole on every tensor device (model.expert_tensor_parallelism: false)"


def _path_names(path: Sequence[Any]) -> list[str]:
    return [key_name(k) for k in path]


def _is_expert(names: list[str], logical: Any, builtin: bool) -> bool:
    """A MoE layer's stacked expert weight: annotated with the logical name `expert` (what the expert axis
    splits), or named as the shipped models' experts (`experts.gate` / `up` / `down`)."""
    flat = [n for name in (logical or ()) for n in (name if isinstance(name, tuple) else (name,))]
    named = builtin and len(names) >= 2 and names[-2] == "experts" and names[-1] in _COLUMN_NAMES | _ROW_NAMES
    return "expert" in flat or named


def _role_dim(role: str, names: list[str], ndim: int) -> int | None:
    """The dimension a column/row role splits, for a Flax leaf (kernel [..., in, out], bias [..., out],
    embedding table [vocab, features])."""
    leaf = names[-1] if names else ""
    if role == SKIP:
        return None
    if leaf == "embedding":
        return ndim - 2 if role == COLUMN else ndim - 1
    if leaf in ADAPTER_LEAVES:  # A takes the input side's split (row), B the output side's (column)
        return (ndim - 2 if role == ROW else None) if leaf == "lora_a" else (ndim - 1 if role == COLUMN else None)
    if ndim >= 2 and leaf != "bias":
        return ndim - 1 if role == COLUMN else ndim - 2
    return ndim - 1 if role == COLUMN else None  # a row layer's bias is added after the sum


def _megatron(names: list[str], shape: tuple[int, ...], size: int, heads: tuple[int, int] | None
              ) -> tuple[int | None, str]:
    """The shipped models' Megatron role of a leaf, or (None, reason)."""
    layer = names[-2] if len(names) >= 2 else ""
    leaf = names[-1] if names else ""
    if layer == "experts" and leaf in _COLUMN_NAMES | _ROW_NAMES:
        layer = leaf  # a MoE layer's stacked experts [..., experts, in, out]: each expert's MLP sliced as one
    if layer in _VOCAB and leaf == "embedding":
        dim = len(shape) - 2
        return (dim, "vocabulary-parallel embedding") if shape[dim] % size == 0 else \
            (None, f"whole: vocabulary {shape[dim]} not divisible by {size}")
    if layer in ("qkv", "c_attn", "proj"):
        return None, "whole: fused qkv projection (columns not head-major)" if layer != "proj" else \
            "whole: its qkv projection is whole"
    if layer in _COLUMN_NAMES or layer in _ROW_NAMES:
        role = COLUMN if layer in _COLUMN_NAMES else ROW
        if heads is not None and layer in _ATTENTION:
            n_heads, n_kv = heads
            count = n_kv if layer in _KEY_VALUE else n_heads
            if count % size:
                return None, f"whole: {count} heads not divisible by {size}"
        dim = _role_dim(role, names, len(shape))
        if dim is None:
            return None, ("whole: LoRA adapter on the unsplit side of its projection" if leaf in ADAPTER_LEAVES
                          else "whole: bias of a row-parallel layer")
        if shape[dim] % size:
            return None, f"whole: dimension {dim} ({shape[dim]}) not divisible by {size}"
        return dim, f"{role}-parallel ({'output' if role == COLUMN else 'input'} features)"
    return None, "whole"


def tensor_plan(abstract: Any, size: int, *, names: Any = None, rules: Mapping[str, str | None] | None = None,
                layer_specs: Sequence[LayerSpec] = (), use_default_specs: bool = True,
                builtin: bool = False, heads: tuple[int, int] | None = None, axis: str = "tensor",
                derived: Sequence[int | None] | None = None, whole_experts: bool = False) -> TensorPlan:
    """Resolve every leaf's split over a tensor axis of `size` devices (see the module docstring).

    `names`: per leaf, the model's logical axis names (or None); `rules`: logical name -> mesh axis;
    `builtin`: the tree is a shipped model's (or a `preset_model` names one), so Megatron's names
    apply; `heads`: (query heads, key/value heads) when known; `derived`: per leaf, the split read off
    the loss (`find_tensor_splits`), for leaves nothing else decides; `whole_experts`: the expert
    weights stay whole (see the module docstring). A pattern matching no leaf, and a split the size
    does not divide, are errors naming the leaf, its shape and the fix.
    """
    rules = dict(rules or {})
    leaves = jax.tree_util.tree_leaves_with_path(abstract)
    name_leaves = ([None] * len(leaves) if names is None else
                   jax.tree.leaves(names, is_leaf=lambda x: x is None or isinstance(x, tuple)))
    compiled = [(spec, [re.compile(p) for p in spec.patterns]) for spec in layer_specs]
    used = [False] * len(compiled)
    dims: list[int | None] = []
    table = []
    for k, ((path, x), logical) in enumerate(zip(leaves, name_leaves)):
        shape, where = tuple(x.shape), dotted(path)
        if whole_experts and _is_expert(_path_names(path), logical, builtin):
            _match_spec(where, compiled, used)  # a spec naming experts did match, though it does not split them
            dims.append(None)
            table.append((where, shape, None, WHOLE_EXPERTS))
            continue
        dim, source = _from_names(logical, rules, axis)
        if dim is not None:
            source = f"annotation '{logical[dim]}'"
            _check_divides(where, shape, dim, size, f"mesh.logical_axis_rules ('{logical[dim]}' -> {axis})")
        else:
            dim, source = _from_specs(where, shape, compiled, used, size)
            if source is None:
                dim, source = (_megatron(_path_names(path), shape, size, heads)
                               if builtin and use_default_specs else (None, "whole"))
            if dim is None and source == "whole" and derived is not None and derived[k] is not None:
                dim, source = derived[k], "derived from the loss (column -> row pair)"
                _check_divides(where, shape, dim, size, "tensor_dims")
        dims.append(dim)
        table.append((where, shape, dim, source))
    for (spec, _), hit in zip(compiled, used):
        if not hit:
            raise ConfigError(f"tensor_parallel.partition_config.layer_specs: patterns {list(spec.patterns)} match no "
                              f"parameter; the parameters are named like {leaves and dotted(leaves[0][0])!r} "
                              f"(run `zerojax config explain` to list them); fix or remove the spec")
    return TensorPlan(tuple(dims), tuple(table))


def _from_names(logical: Any, rules: dict[str, str | None], axis: str) -> tuple[int | None, str | None]:
    for d, name in enumerate(logical or ()):
        for n in (name if isinstance(name, tuple) else (name,)):
            if n == axis or (n is not None and rules.get(n) == axis):
                return d, None
    return None, None


def _match_spec(where: str, compiled: list[Any], used: list[bool]) -> None:
    """Mark the first spec whose patterns match `where` as used."""
    hit = next((i for i, (_, patterns) in enumerate(compiled) if any(p.search(where) for p in patterns)), None)
    if hit is not None:
        used[hit] = True


def _from_specs(where: str, shape: tuple[int, ...], compiled: list[Any], used: list[bool], size: int
                ) -> tuple[int | None, str | None]:
    for i, (spec, patterns) in enumerate(compiled):
        if any(p.search(where) for p in patterns):
            used[i] = True
            names = where.split(".")
            dim = _role_dim(spec.partition_type, names, len(shape))
            if dim is not None:
                _check_divides(where, shape, dim, size, f"layer_specs pattern {list(spec.patterns)} "
                                                        f"({spec.partition_type})")
            return dim, f"layer_specs {spec.partition_type} ({spec.patterns[0]})"
    return None, None


def _check_divides(where: str, shape: tuple[int, ...], dim: int, size: int, why: str) -> None:
    if shape[dim] % size:
        raise ConfigError(f"tensor parallel: {where} {shape} is split along dimension {dim} by {why}, but the "
                          f"tensor size {size} does not divide {shape[dim]}; choose a mesh.tensor that divides it, "
                          f"or keep the leaf whole (partition_type: skip)")
