"""The `fp16`, `bf16` and `data_types` sections.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zerojax.config.fields import option


@dataclass(frozen=True)
class FP16Config:
    """fp16 mixed precision with DeepSpeed's dynamic loss scaler."""
    enabled: bool = option(False, "Train with fp16 compute, fp32 master weights and optimizer state, "
                                  "and loss scaling.")
    auto_cast: bool = option(False, "Cast inputs to fp16 (accepted; the model decides its dtypes).")
    loss_scale: float = option(0.0, "0: dynamic loss scaling; > 0: this static scale.", ge=0)
    initial_scale_power: int = option(16, "Dynamic scaling starts at 2**initial_scale_power.", ge=0)
    loss_scale_window: int = option(1000, "Clean steps before the scale doubles.", gt=0)
    hysteresis: int = option(2, "Overflows tolerated before the scale halves.", gt=0)
    consecutive_hysteresis: bool = option(False, "Refill hysteresis on every clean step.")
    min_loss_scale: float = option(1.0, "Smallest scale; an overflow there is an error.", gt=0)
    fp16_master_weights_and_grads: bool = option(False, "Not supported: master weights stay fp32.")


@dataclass(frozen=True)
class BF16Config:
    """bf16 mixed precision: bf16 params and compute, fp32 master weights and optimizer state."""
    enabled: bool = option(False, "Train with bf16 compute and fp32 master weights.")
    check_grad_overflow: bool = option(False, "Skip steps whose gradients are not finite, as fp16 does "
                                              "(no loss scale).")
    immediate_grad_update: bool = option(True, "Accepted; gradients are always applied at the boundary.")


@dataclass(frozen=True)
class DataTypesConfig:
    """Data types of intermediate buffers."""
    grad_accum_dtype: Optional[str] = option(
        None, "Gradient accumulator dtype (default: the parameters' compute dtype).",
        choices=("fp32", "fp16", "bf16"))
