"""DeepSpeed's batch triad: train_batch_size = micro batch x accumulation steps x data-parallel size.
"""
from __future__ import annotations

import operator
import typing
from typing import TYPE_CHECKING, Any

from zerojax.errors import ConfigError

if TYPE_CHECKING:
    from zerojax.config.schema.root import Config


class BatchSize(typing.NamedTuple):
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def resolve_batch(config: Config, dp_size: int) -> BatchSize:
    """DeepSpeed's triad: train_batch_size = micro * accumulation * dp_size; derive the missing one."""
    tb, mb, gas = (config.train_batch_size, config.train_micro_batch_size_per_gpu,
                   config.gradient_accumulation_steps)
    n = _positive_size(dp_size)

    def exact(total: int, div: int, what: str, formula: str) -> int:
        if total % div:
            raise ConfigError(
                f"{what}: {formula} = {total} / {div} is not a whole number; choose train_batch_size "
                f"as a multiple of {div}")
        return total // div

    if tb and mb and gas:
        if tb != mb * gas * n:
            raise ConfigError(
                f"train_batch_size: {tb} != train_micro_batch_size_per_gpu * gradient_accumulation_steps "
                f"* data-parallel size = {mb} * {gas} * {n} = {mb * gas * n}; fix one of the three or "
                f"leave one out to have it derived")
    elif tb and mb:
        gas = exact(tb, mb * n, "gradient_accumulation_steps",
                    f"train_batch_size / (micro {mb} * dp {n})")
    elif tb and gas:
        mb = exact(tb, gas * n, "train_micro_batch_size_per_gpu",
                   f"train_batch_size / (accumulation {gas} * dp {n})")
    elif mb and gas:
        tb = mb * gas * n
    elif tb:
        gas = 1
        mb = exact(tb, n, "train_micro_batch_size_per_gpu", f"train_batch_size / dp {n}")
    elif mb:
        gas, tb = 1, mb * n
    else:
        raise ConfigError("train_batch_size: give train_batch_size or train_micro_batch_size_per_gpu "
                          "(gradient_accumulation_steps alone cannot fix the batch)")
    return BatchSize(tb, mb, gas)


def _positive_size(dp_size: Any) -> int:
    """The data-parallel size as an int; 0 or a float would otherwise divide by zero or round silently."""
    try:
        n = operator.index(dp_size)
    except TypeError:
        n = 0
    if isinstance(dp_size, bool) or n < 1:
        raise ConfigError(f"data-parallel size: got {dp_size!r}; it must be a positive integer (the size "
                          f"of the mesh axes the batch is split over, e.g. mesh.data)")
    return n
