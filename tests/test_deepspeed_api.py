"""A training loop written the way DeepSpeed's examples write one runs on the zerojax engine.

The loop below follows DeepSpeedExamples' style (written here, not copied): `loss = engine(batch)`,
`engine.backward(loss)`, `engine.step()` per micro-batch, printing with the engine's accessors.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

import zerojax
from helpers import assert_tree_close, data_mesh, make_batch, mlp_params, mse_loss, to_numpy
from zerojax.engine.deepspeed_api import DEEPSPEED_ONLY, MicroBatchLoss

MICRO, GAS = 2, 2   # 2 rows per device per micro-batch, 2 micro-batches per step, 8 devices


def ds_config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0, **extra}


def micro_batches(n: int) -> list[dict]:
    return [make_batch(MICRO * 8, 100 + i) for i in range(n)]


def deepspeed_style_loop(engine: zerojax.Engine, batches: list[dict]) -> list[float]:
    """What a ported script does; returns the losses it prints."""
    printed = []
    for batch in batches:
        loss = engine(batch)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary and engine.global_rank == 0:
            printed.append(loss.item())
    return printed


@pytest.mark.parametrize("stage", [0, 3])
def test_the_trio_equals_train_batch_on_the_same_rows(stage: int) -> None:
    mbs = micro_batches(2 * GAS)
    trio = zerojax.initialize(ds_config(stage), params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh())
    printed = deepspeed_style_loop(trio, mbs)
    whole = zerojax.initialize(ds_config(stage), params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh())
    losses = []
    for k in range(2):  # the global batch: micro-batch i is rows [i*m*dp, (i+1)*m*dp)
        batch = jax.tree.map(lambda *xs: np.concatenate(xs), *mbs[k * GAS:(k + 1) * GAS])
        losses.append(np.asarray(whole.train_batch(batch)["micro_losses"]))
    assert trio.global_steps == whole.global_steps == 2 and trio.micro_steps == 2 * GAS
    np.testing.assert_allclose(printed, [x[-1] for x in losses], rtol=1e-6)
    assert_tree_close(to_numpy(trio.params), to_numpy(whole.params), rtol=1e-6, atol=1e-7, what=f"stage {stage}")


def test_a_micro_batch_loss_is_known_once_its_step_ran() -> None:
    engine = zerojax.initialize(ds_config(2), params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh())
    first = engine(micro_batches(1)[0])
    engine.backward(first)
    assert not engine.is_gradient_accumulation_boundary()
    engine.step()                      # not a boundary: nothing runs
    assert engine.global_steps == 0 and isinstance(first, MicroBatchLoss)
    with pytest.raises(RuntimeError, match=r"known once engine.step\(\) has run that step"):
        first.item()
    second = engine(micro_batches(2)[1])
    with pytest.raises(RuntimeError, match="pass the loss engine"):
        engine.backward(first)
    engine.backward(second)
    assert engine.is_gradient_accumulation_boundary()
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    assert np.isfinite(first.item()) and f"{second:.3f}" and first.item() != second.item()
    assert engine.get_global_grad_norm() > 0


def test_eval_mode_returns_the_loss_at_once() -> None:
    engine = zerojax.initialize(ds_config(3), params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh())
    batch = micro_batches(1)[0]
    engine.eval()
    value = engine(batch)
    assert float(value) == pytest.approx(float(engine.eval_batch(batch)))
    engine.train()
    assert isinstance(engine(batch), MicroBatchLoss)


def test_accessors_answer_as_deepspeed_does() -> None:
    engine = zerojax.initialize(ds_config(3, fp16={"enabled": False}), params=mlp_params(0), loss_fn=mse_loss,
                                mesh=data_mesh())
    assert engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.zero_optimization() and engine.zero_optimization_stage() == 3
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size) == (0, 0, 8, 8)
    assert engine.get_batch_info() == (MICRO * GAS * 8, MICRO, GAS)
    assert engine.gradient_clipping() == 1.0 and engine.loss_scale() == 1.0
    assert engine.get_global_grad_norm() is None and not engine.was_step_applied()
    assert engine.get_mom() == [(0.9, 0.999)]
    assert engine.get_lr() == [pytest.approx(1e-2)]
    assert engine.global_samples == 0


@pytest.mark.parametrize("name", sorted(DEEPSPEED_ONLY))
def test_deepspeed_only_attributes_name_the_zerojax_way(name: str) -> None:
    engine = zerojax.initialize(ds_config(0), params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh())
    with pytest.raises(AttributeError, match=rf"^engine\.{name}: DeepSpeedEngine's {name} has no zerojax counterpart; "):
        getattr(engine, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        engine.no_such_thing  # noqa: B018
