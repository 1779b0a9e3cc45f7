"""The `scheduler` section: DeepSpeed's learning-rate schedulers and their params.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from zerojax.config.fields import option


_WARMUP_TYPES = ("log", "linear")


_WARMUP_STEPS_DOC = ("Warmup length in optimizer steps; 1 means 2 (DeepSpeed clamps it to >= 2); 0 is "
                     "rejected, as DeepSpeed rejects it.")


@dataclass(frozen=True)
class WarmupLRParams:
    """WarmupLR: warm up from warmup_min_lr to warmup_max_lr, then hold."""
    warmup_min_lr: float = option(0.0, "Learning rate at the start of warmup.", ge=0)
    warmup_max_lr: Optional[float] = option(
        None, "Learning rate after warmup (default: optimizer lr; 0.001 for WarmupDecayLR, as in DeepSpeed).",
        ge=0)
    warmup_num_steps: int = option(1000, _WARMUP_STEPS_DOC, gt=0)
    warmup_type: str = option("log", "Warmup curve.", choices=_WARMUP_TYPES)
    last_batch_iteration: int = option(-1, "Position to start from (-1: a new run).", ge=-1)


@dataclass(frozen=True)
class WarmupDecayLRParams(WarmupLRParams):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""
    total_num_steps: Optional[int] = option(None, "Required: step at which the lr reaches 0.", gt=0)


@dataclass(frozen=True)
class WarmupCosineLRParams:
    """WarmupCosineLR: ratios of the optimizer lr; warmup then cosine decay."""
    total_num_steps: Optional[int] = option(None, "Required: length of the whole schedule.", gt=0)
    warmup_min_ratio: float = option(0.0, "lr ratio at the start of warmup.", ge=0)
    warmup_num_steps: int = option(1000, _WARMUP_STEPS_DOC, gt=0)
    cos_min_ratio: float = option(1e-4, "lr ratio at the end of the cosine.", ge=0)
    warmup_type: str = option("log", "Warmup curve.", choices=_WARMUP_TYPES)
    last_batch_iteration: int = option(-1, "Position to start from (-1: a new run).", ge=-1)


@dataclass(frozen=True)
class OneCycleParams:
    """OneCycle: triangular lr (and momentum) cycle, then decay."""
    cycle_min_lr: Optional[float] = option(None, "Required: lr at the cycle's ends.", ge=0)
    cycle_max_lr: Optional[float] = option(None, "Required: lr at the cycle's peak.", ge=0)
    decay_lr_rate: float = option(0.0, "lr decay rate after the cycle.", ge=0)
    cycle_first_step_size: int = option(2000, "Steps in the rising half.", gt=0)
    cycle_second_step_size: Optional[int] = option(None, "Steps in the falling half (default: first).", gt=0)
    cycle_first_stair_count: int = option(0, "Stairs in the rising half (0: smooth).", ge=0)
    cycle_second_stair_count: Optional[int] = option(None, "Stairs in the falling half.", ge=0)
    decay_step_size: int = option(0, "Steps per decay interval after the cycle.", ge=0)
    cycle_momentum: bool = option(True, "Cycle beta1 between cycle_max_mom and cycle_min_mom.")
    cycle_min_mom: float = option(0.8, "beta1 at the cycle's peak lr.", ge=0, le=1)
    cycle_max_mom: float = option(0.9, "beta1 at the cycle's ends.", ge=0, le=1)
    decay_mom_rate: float = option(0.0, "Momentum decay rate after the cycle.", ge=0)
    last_batch_iteration: int = option(-1, "Position to start from (-1: a new run).", ge=-1)


@dataclass(frozen=True)
class LRRangeTestParams:
    """LRRangeTest: lr grows from lr_range_test_min_lr, to find a good lr."""
    lr_range_test_min_lr: float = option(1e-3, "Starting lr.", ge=0)
    lr_range_test_step_size: int = option(2000, "Steps per interval.", gt=0)
    lr_range_test_step_rate: float = option(1.0, "Growth per interval.", ge=0)
    lr_range_test_staircase: bool = option(False, "Grow in stairs instead of continuously.")
    last_batch_iteration: int = option(-1, "Position to start from (-1: a new run).", ge=-1)


SCHEDULER_PARAMS: dict[str, type] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams, "OneCycle": OneCycleParams, "LRRangeTest": LRRangeTestParams,
}


REQUIRED_SCHEDULER_PARAMS = {
    "WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
}


@dataclass(frozen=True)
class SchedulerConfig:
    """LR scheduler: {"type": ..., "params": {...}}; stepped once per applied optimizer step."""
    type: str = option("WarmupLR", "One of " + ", ".join(SCHEDULER_PARAMS) + ".")
    params: Any = option(factory=WarmupLRParams, doc="Keys depend on type; see the tables below.")
