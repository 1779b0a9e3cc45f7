"""Splitting a list of layers into contiguous pipeline stages.

Every method reduces to one problem: given a non-negative weight per layer, cut the list into
`num_stages` non-empty contiguous parts. The weights say what to balance:

* `parameters` - each layer's parameter count (a tied layer counts on every stage that uses it,
  because every such stage runs it);
* `uniform`    - 1 per layer (balance the number of layers);
* `type:REGEX` - 1 for layers whose type name matches REGEX (case-insensitive search), 0 otherwise
  (balance e.g. the transformer blocks and let embeddings and heads ride along).

The chosen split is exact, not a heuristic: first the smallest possible heaviest stage (the
pipeline's bottleneck), then, among splits with that bottleneck, the smallest sum of squared stage
weights (evenness beyond the heaviest stage), then the smallest sum of squared layer counts (so
weightless layers spread out), and on a full tie earlier stages take more layers. For unit weights
this gives DeepSpeed's `uniform` split: the first `n % S` stages get one layer more.
"""
from __future__ import annotations

import re
from typing import Sequence

from zerojax.errors import ConfigError

METHODS = ("parameters", "uniform", "type:REGEX")


def _parts_needed(weights: Sequence[int], cap: int) -> int:
    """Fewest contiguous parts with every part's weight <= cap (greedy fill is optimal)."""
    parts, current = 1, 0
    for w in weights:
        if current + w > cap:
            parts, current = parts + 1, w
        else:
            current += w
    return parts


def bottleneck(weights: Sequence[int], num_parts: int) -> int:
    """Smallest achievable weight of the heaviest of `num_parts` non-empty contiguous parts."""
    lo, hi = max(weights), sum(weights)
    while lo < hi:  # integer bisection: feasibility is monotone in the cap
        mid = (lo + hi) // 2
        if _parts_needed(weights, mid) <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    return lo


def balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Stage boundaries `[0, b1, ..., n]` of the split described in the module docstring."""
    n = len(weights)
    if not 1 <= num_parts <= n:
        raise ValueError(f"cannot split {n} layers into {num_parts} non-empty stages")
    weights = [int(w) for w in weights]
    if any(w < 0 for w in weights):
        raise ValueError("layer weights must be non-negative")
    cap = bottleneck(weights, num_parts)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (float("inf"), float("inf"))
    # cost[k][i]: best (sum w^2, sum count^2) of splitting the first i layers into k parts.
    cost = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    cost[0][0] = (0, 0)
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            best, arg = inf, 0
            for j in range(i - 1, k - 2, -1):  # largest j first: ties keep earlier stages bigger
                w = prefix[i] - prefix[j]
                if w > cap:
                    break  # weights are non-negative, so smaller j only gets heavier
                prev = cost[k - 1][j]
                if prev == inf:
                    continue
                c = (prev[0] + w * w, prev[1] + (i - j) ** 2)
                if c < best:
                    best, arg = c, j
            cost[k][i], cut[k][i] = best, arg
    bounds, i = [n], n
    for k in range(num_parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def uniform(num_layers: int, num_parts: int) -> list[int]:
    return balanced([1] * num_layers, num_parts)


def type_weights(names: Sequence[str], pattern: str) -> list[int]:
    """1 for layers whose type name matches `pattern` (re.search, case-insensitive)."""
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as e:
        raise ConfigError(f"partition_method: 'type:{pattern}' is not a valid regular expression ({e})")
    weights = [1 if regex.search(name) else 0 for name in names]
    if not any(weights):
        kinds = ", ".join(dict.fromkeys(names))
        raise ConfigError(f"partition_method: 'type:{pattern}' matches no layer; layer types are {kinds}")
    return weights


def partition(method: str, names: Sequence[str], param_counts: Sequence[int], num_stages: int) -> list[int]:
    """Boundaries `[0, ..., len(names)]` for a DeepSpeed partition method name."""
    n = len(names)
    if num_stages > n:
        raise ConfigError(f"mesh.stage: {num_stages} pipeline stages but the model has only {n} layers; "
                          f"use at most {n} stages (each stage needs at least one layer)")
    low = method.lower()
    if low == "parameters":
        if not any(param_counts):
            raise ConfigError("partition_method: 'parameters' needs layers with parameters; use 'uniform'")
        return balanced(param_counts, num_stages)
    if low == "uniform":
        return uniform(n, num_stages)
    if low.startswith("type:"):
        return balanced(type_weights(names, method[len("type:"):]), num_stages)
    raise ConfigError(f"partition_method: unknown method {method!r}; use one of {', '.join(METHODS)}")
