"""`data_types.grad_accum_dtype` follows DeepSpeed's engine (`get_data_types`, `_do_optimizer_sanity_check`).

DeepSpeed (since 0.17.6) accumulates in the model dtype unless the key says otherwise, bf16 without
ZeRO included; without ZeRO it rejects any other accumulator dtype ("unsupported mix"); with ZeRO a
different dtype is a separate accumulator.
"""
from __future__ import annotations

import jax.numpy as jnp
import pytest

import zerojax
from helpers import data_mesh, make_config, mlp_params

PARAMS0 = mlp_params(0)


def fp16() -> dict:
    return {"fp16": {"enabled": True}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype, extra, want", [
    ("fp32", {}, jnp.float32), ("bf16", {}, jnp.bfloat16), ("fp32", fp16(), jnp.float16)])
def test_the_default_accumulator_is_the_model_dtype(stage: int, dtype: str, extra: dict, want) -> None:
    plan = zerojax.plan(make_config(stage, dtype=dtype, **extra), data_mesh(), PARAMS0)
    assert plan.policy.accum == jnp.dtype(want)


@pytest.mark.parametrize("dtype, extra, key", [("bf16", {}, "bf16"), ("fp32", {}, "fp32"), ("fp32", fp16(), "fp16")])
def test_the_model_dtype_named_explicitly_is_accepted_at_stage_0(dtype: str, extra: dict, key: str) -> None:
    cfg = make_config(0, dtype=dtype, data_types={"grad_accum_dtype": key}, **extra)
    assert zerojax.plan(cfg, data_mesh(), PARAMS0).policy.accum == jnp.dtype({"bf16": jnp.bfloat16, "fp32": jnp.float32,
                                                                              "fp16": jnp.float16}[key])


@pytest.mark.parametrize("dtype, extra, key, model", [
    ("bf16", {}, "fp32", "bf16"), ("fp32", fp16(), "fp32", "fp16"), ("fp32", {}, "bf16", "fp32")])
def test_another_accumulator_without_zero_is_rejected_before_compiling(dtype: str, extra: dict, key: str,
                                                                        model: str) -> None:
    cfg = make_config(0, dtype=dtype, data_types={"grad_accum_dtype": key}, **extra)
    with pytest.raises(zerojax.ConfigError, match=(
            rf"^data_types.grad_accum_dtype: '{key}' differs from the model dtype {model} at "
            rf"zero_optimization.stage 0; without ZeRO DeepSpeed accumulates gradients in the model dtype and "
            rf"rejects other mixes; remove the key to accumulate in {model}, or use zero_optimization.stage 1 "
            rf"or higher for a separate {key} accumulator$")):
        zerojax.plan(cfg, data_mesh(), PARAMS0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_fp32_accumulator_for_bf16_with_zero_is_kept(stage: int) -> None:
    cfg = make_config(stage, dtype="bf16", data_types={"grad_accum_dtype": "fp32"})
    assert zerojax.plan(cfg, data_mesh(), PARAMS0).policy.accum == jnp.dtype(jnp.float32)
