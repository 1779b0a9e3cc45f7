"""The `optimizer` section: DeepSpeed's optimizer types and their params.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from zerojax.config.fields import option


@dataclass(frozen=True)
class AdamParams:
    """Adam / AdamW (DeepSpeed FusedAdam; `torch_adam` selects torch's implementation)."""
    lr: float = option(1e-3, "Learning rate; the peak value of any schedule.", ge=0)
    betas: tuple[float, float] = option((0.9, 0.999), "Exponential decay rates (beta1, beta2).")
    eps: float = option(1e-8, "Added to the denominator.", gt=0)
    weight_decay: Optional[float] = option(
        None, "Default 0.0 (DeepSpeed FusedAdam); 0.01 with torch_adam (torch.optim.AdamW).", ge=0)
    adam_w_mode: bool = option(True, "True: decoupled weight decay (AdamW). False: L2 added to the "
                                     "gradient (classic Adam). Accepts 0/1.", int_bool=True)
    torch_adam: bool = option(False, "Implementation selector; changes only the weight_decay default.",
                              int_bool=True)
    fused: Optional[bool] = option(None, "Implementation selector; XLA fuses the update either way.",
                                   int_bool=True)
    bias_correction: bool = option(True, "Apply Adam's bias correction.", int_bool=True)
    amsgrad: bool = option(False, "Not supported (DeepSpeed's fused kernels reject it too).")


@dataclass(frozen=True)
class LambParams:
    """LAMB (DeepSpeed FusedLamb): Adam direction scaled by a clamped trust ratio."""
    lr: float = option(1e-3, "Learning rate.", ge=0)
    betas: tuple[float, float] = option((0.9, 0.999), "Exponential decay rates (beta1, beta2).")
    eps: float = option(1e-8, "Added to the denominator.", gt=0)
    weight_decay: float = option(0.0, "Decoupled weight decay inside the trust-ratio update.", ge=0)
    bias_correction: bool = option(True, "Apply Adam's bias correction.", int_bool=True)
    max_coeff: float = option(10.0, "Upper clamp of the trust ratio.", gt=0)
    min_coeff: float = option(0.01, "Lower clamp of the trust ratio.", ge=0)
    max_grad_norm: float = option(0.0, "Must be 0 (DeepSpeed rejects it too); use gradient_clipping.", ge=0)


@dataclass(frozen=True)
class AdagradParams:
    """Adagrad (DeepSpeed CPU Adagrad / torch.optim.Adagrad semantics)."""
    lr: float = option(1e-2, "Learning rate.", ge=0)
    eps: float = option(1e-10, "Added to the denominator.", gt=0)
    weight_decay: float = option(0.0, "L2 penalty added to the gradient.", ge=0)
    initial_accumulator_value: float = option(0.0, "Starting value of the squared-gradient sum.", ge=0)


@dataclass(frozen=True)
class LionParams:
    """Lion (DeepSpeed FusedLion)."""
    lr: float = option(1e-4, "Learning rate.", ge=0)
    betas: tuple[float, float] = option((0.9, 0.99), "Interpolation (beta1) and momentum (beta2) rates.")
    weight_decay: float = option(0.0, "Decoupled weight decay.", ge=0)


@dataclass(frozen=True)
class SGDParams:
    """SGD with momentum (torch.optim.SGD semantics)."""
    lr: float = option(1e-3, "Learning rate.", ge=0)
    momentum: float = option(0.0, "Momentum factor.", ge=0)
    dampening: float = option(0.0, "Dampening for momentum.", ge=0)
    weight_decay: float = option(0.0, "L2 penalty added to the gradient.", ge=0)
    nesterov: bool = option(False, "Nesterov momentum.", int_bool=True)


@dataclass(frozen=True)
class MuonParams:
    """Muon (DeepSpeed's MuonWithAuxAdam): Newton-Schulz orthogonalised momentum for the hidden
    matrices, Adam for embeddings, the head, norms and biases. Defaults are DeepSpeed's code defaults."""
    lr: Optional[float] = option(None, "Learning rate of both groups where muon_lr / adam_lr is not given; without "
                                       "it and them, MuonWithAuxAdam's 0.02 (Muon) and 3e-4 (Adam). A "
                                       "scheduler starts from lr (or, without it, the Muon lr).", ge=0)
    momentum: float = option(0.95, "Muon's momentum (Nesterov form, as DeepSpeed's muon_update).", ge=0, le=1)
    weight_decay: float = option(0.0, "Decoupled weight decay of both groups: p *= 1 - lr * wd.", ge=0)
    muon_lr: Optional[float] = option(None, "Learning rate of the Muon matrices; overrides lr.", ge=0)
    adam_lr: Optional[float] = option(None, "Learning rate of the Adam parameters; overrides lr.", ge=0)
    ns_method: str = option("gram", "Newton-Schulz form: gram (iterates on the small Gram matrix X X^T) or "
                                    "standard (the quintic iteration on X); the same map in exact arithmetic.",
                            choices=("gram", "standard"))
    betas: tuple[float, float] = option((0.9, 0.95), "Adam's decay rates for the non-Muon parameters.")
    eps: float = option(1e-10, "Adam's eps for the non-Muon parameters.", gt=0)

    @property
    def muon_rate(self) -> float:
        """DeepSpeed: muon_lr, else lr, else MuonWithAuxAdam's 0.02."""
        return next(v for v in (self.muon_lr, self.lr, 0.02) if v is not None)

    @property
    def adam_rate(self) -> float:
        """DeepSpeed: adam_lr, else lr, else MuonWithAuxAdam's 3e-4."""
        return next(v for v in (self.adam_lr, self.lr, 3e-4) if v is not None)


def base_lr(params: Any) -> float:
    """The lr a scheduler starts from: params.lr, or for Muon without one the Muon group's lr."""
    lr = getattr(params, "lr", None)
    return params.muon_rate if lr is None and isinstance(params, MuonParams) else lr


OPTIMIZER_PARAMS: dict[str, type] = {
    "adam": AdamParams, "adamw": AdamParams, "lamb": LambParams, "adagrad": AdagradParams,
    "lion": LionParams, "sgd": SGDParams, "muon": MuonParams,
}


# DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS (MuonWithAuxAdam joins it in deepspeed/runtime/zero/utils.py);
# anything else needs zero_allow_untested_optimizer.
ZERO_TESTED_OPTIMIZERS = frozenset({"adam", "adamw", "lamb", "adagrad", "lion", "muon"})


ONE_BIT_OPTIMIZERS = frozenset({"onebitadam", "zerooneadam", "onebitlamb"})

# DeepSpeed optimizer types zerojax does not build, with the reason its error gives.
REFUSED_OPTIMIZERS: dict[str, str] = {}


@dataclass(frozen=True)
class ParamGroup:
    """One parameter group (DeepSpeed/torch param groups by name): its lr multiplier and weight decay."""
    match: tuple[str, ...] = ()
    lr_scale: float = 1.0
    weight_decay: Optional[float] = None


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer: {"type": ..., "params": {...}} as in DeepSpeed, with zerojax's parameter groups."""
    type: str = option("adam", "One of " + ", ".join(sorted(OPTIMIZER_PARAMS)) + " (case-insensitive).")
    params: Any = option(factory=AdamParams, doc="Keys depend on type; see the tables below.")
    no_decay: tuple[str, ...] = option((), "Parameters without weight decay, by name pattern (zerojax key): a "
                                           "word matches a part of the dotted name (`bias`; `norm` also "
                                           "matches `ln`, `ln1`, `ln_f`; `embed` also matches `pos`, `wte`, "
                                           "`wpe`), a pattern with `*` matches the whole name "
                                           "(`blocks.*.bias`). [bias, norm, embed] is Hugging Face's and "
                                           "Megatron's choice; empty: everything decays, as in DeepSpeed.")
    param_groups: tuple[ParamGroup, ...] = option((), "Parameter groups, first match wins (zerojax key): a "
                                                      "list of {match: pattern or list, lr_scale: 1.0, "
                                                      "weight_decay: null}; lr_scale multiplies the "
                                                      "scheduled lr, a weight_decay replaces params."
                                                      "weight_decay (and no_decay) for the group.")


# The optimizer type a plan records when the optimizer came from code (`plan(..., optimizer=)`).
CLIENT_OPTIMIZER = "client"
