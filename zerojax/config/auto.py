"""Hugging Face's "auto" values, filled as the transformers Trainer fills them.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from zerojax.errors import ConfigError
from zerojax.config.fields import schema_fields
from zerojax.config.schema.run import ModelConfig
from zerojax.config.schema.zero import ZeroConfig
from zerojax.config.validate import is_auto


# zero_optimization keys the Trainer derives from the model's hidden size.
HIDDEN_FILLS: dict[str, tuple[str, Callable[[int], int]]] = {
    "reduce_bucket_size": ("hidden^2", lambda h: h * h),
    "stage3_prefetch_bucket_size": ("0.9 * hidden^2", lambda h: int(0.9 * h * h)),
    "stage3_param_persistence_threshold": ("10 * hidden", lambda h: 10 * h),
}


# Keys only the Trainer's arguments can fill: (the argument it reads, an example value).
TRAINER_ONLY: dict[str, tuple[str, str]] = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", "8"),
    "fp16.enabled": ("--fp16", "true"),
    "bf16.enabled": ("--bf16", "true"),
    "optimizer.params.lr": ("learning_rate", "5e-5"),
    "optimizer.params.betas": ("adam_beta1, adam_beta2", "[0.9,0.999]"),
    "optimizer.params.eps": ("adam_epsilon", "1e-8"),
    "optimizer.params.weight_decay": ("weight_decay", "0.0"),
    "scheduler.params.warmup_max_lr": ("learning_rate", "5e-5"),
    "scheduler.params.warmup_num_steps": ("warmup_steps", "100"),
    "scheduler.params.total_num_steps": ("max_steps", "1000"),
}


# The Trainer's TrainingArguments default for max_grad_norm.
_TRAINER_MAX_GRAD_NORM = 1.0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def fill_auto(raw: dict[str, Any], hidden_size: int | None) -> dict[str, str]:
    """Replace the Trainer's "auto" placeholders that zerojax can derive, in place; returns the
    source label of each filled key. Every "auto" only the Trainer could fill is one error."""
    fills: dict[str, str] = {}
    pending: list[str] = []
    tb, mb = raw.get("train_batch_size"), raw.get("train_micro_batch_size_per_gpu")
    if (is_auto(tb) or is_auto(mb)) and not (_number(tb) or _number(mb)):
        pending.append("train_micro_batch_size_per_gpu")
    if is_auto(raw.get("gradient_clipping")):
        raw["gradient_clipping"] = _TRAINER_MAX_GRAD_NORM
        fills["gradient_clipping"] = "derived ('auto': the Trainer's max_grad_norm default, 1.0)"
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        fields = {f.name: f for f in schema_fields(ZeroConfig)}
        for key in list(zero):
            name = next((n for n, f in fields.items() if key == n or key in f.metadata.get("aliases", ())), key)
            if name in HIDDEN_FILLS and is_auto(zero[key]):
                formula, fn = HIDDEN_FILLS[name]
                h, whence = _hidden_size(raw, hidden_size)
                zero[key] = fn(h)
                fills[f"zero_optimization.{name}"] = f"derived ('auto': {formula}, hidden size {h} {whence})"
    for section in ("fp16", "bf16", "bfloat16"):
        if isinstance(raw.get(section), dict) and is_auto(raw[section].get("enabled")):
            pending.append("bf16.enabled" if section == "bfloat16" else f"{section}.enabled")
    opt = raw.get("optimizer")
    opt_params = opt.get("params") if isinstance(opt, dict) else None
    if isinstance(opt_params, dict):
        pending += [f"optimizer.params.{k}" for k, v in opt_params.items() if is_auto(v)]
    sched = raw.get("scheduler")
    params = sched.get("params") if isinstance(sched, dict) else None
    if isinstance(params, dict):
        lr = opt_params.get("lr") if isinstance(opt_params, dict) else None
        run = raw.get("run") if isinstance(raw.get("run"), dict) else {}
        for key, value in list(params.items()):
            if not is_auto(value):
                continue
            if key == "warmup_min_lr":
                params[key] = 0.0
                fills[f"scheduler.params.{key}"] = "derived ('auto': 0, as the Trainer writes it)"
            elif key == "warmup_max_lr" and _number(lr):
                params[key] = lr
                fills[f"scheduler.params.{key}"] = "derived ('auto': optimizer.params.lr, the Trainer's " \
                                                   "learning_rate)"
            elif key == "total_num_steps" and _number(run.get("steps")):
                params[key] = run["steps"]
                fills[f"scheduler.params.{key}"] = "derived ('auto': run.steps, the Trainer's max_steps)"
            else:
                pending.append(f"scheduler.params.{key}")
    if pending:
        raise ConfigError(_auto_error(pending, _precision_choice(raw, pending)))
    return fills


def _precision_choice(raw: Mapping[str, Any], pending: list[str]) -> dict[str, tuple[str, str]]:
    """(value, why) the fix-it line gives each pending fp16/bf16 `enabled` key: on, unless the other
    precision is on too (in the file, or pending as well: then bf16), since both on is refused."""
    def on(section: str) -> bool:
        names = (section, "bfloat16") if section == "bf16" else (section,)
        return any(isinstance(raw.get(s), Mapping) and raw[s].get("enabled") is True for s in names)
    choice = {}
    both = {"fp16.enabled", "bf16.enabled"} <= set(pending)
    for key, other in (("fp16.enabled", "bf16"), ("bf16.enabled", "fp16")):
        if key not in pending:
            continue
        if on(other):
            choice[key] = ("false", f"not given: the file turns {other} on")
        elif both and key == "fp16.enabled":
            choice[key] = ("false", "not given: fp16 and bf16 both on is refused; for fp16 instead set "
                                    "fp16.enabled=true bf16.enabled=false")
        else:
            choice[key] = ("true", "")
    return choice


def _hidden_size(raw: Mapping[str, Any], hidden_size: int | None) -> tuple[int, str]:
    """The hidden size the Trainer would read from the model's config, and where it came from."""
    if hidden_size is not None:
        if not _number(hidden_size) or hidden_size <= 0 or int(hidden_size) != hidden_size:
            raise ConfigError(f"hidden_size: {hidden_size!r} must be a positive integer (the model's width)")
        return int(hidden_size), "given as hidden_size"
    model = raw.get("model")
    if isinstance(model, Mapping) and _number(model.get("d_model")):
        return int(model["d_model"]), "from model.d_model"
    return ModelConfig().d_model, "from model.d_model, the embedded GPT's default"


def _auto_error(pending: list[str], precision: Mapping[str, tuple[str, str]]) -> str:
    """One line per key with a value that loads, and the whole fix as one --set line that loads as printed."""
    sets = [f"{key}={precision[key][0] if key in precision else TRAINER_ONLY.get(key, ('', '<value>'))[1]}"
            for key in pending]
    lines = [f'"auto" is a Hugging Face Trainer placeholder, and {len(pending)} of them can only be filled '
             f"from the Trainer's arguments; set each one:"]
    for key, kv in zip(pending, sets):
        arg = TRAINER_ONLY.get(key, ("", ""))[0]
        why = precision.get(key, ("", ""))[1]
        arg = f"{arg} {why}" if arg and why else arg
        lines.append(f"  {kv}" + (f"   (the Trainer's {arg})" if arg else ""))
    lines.append(f"command line: --set {' '.join(sets)}; Python: load_config(path, {json.dumps(sets)})")
    return "\n".join(lines)
