"""`Engine.train_batch` returns before its step has run (no host sync per step), and dynamic fp16
still stops on the step that overflowed at the minimum loss scale, with the same error."""
from __future__ import annotations

import json
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from helpers import ADAM, data_mesh, make_batch, make_config, mlp_params, mse_loss

TBS = 32
GOOD = [make_batch(TBS, i) for i in range(8)]
FP16 = {"enabled": True, "initial_scale_power": 3, "min_loss_scale": 2, "hysteresis": 2}


def poisoned(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = batch["x"].copy()
    x[5, 3] = np.inf
    return {"x": x, "y": batch["y"]}


def run_until_stuck(dispatch_ahead: bool) -> tuple[int, str, zerojax.Engine]:
    """Two clean steps, then overflows: scale 8 -> 8 (hysteresis spent) -> 4 -> 2 -> stuck at the minimum."""
    engine = zerojax.initialize(make_config(2, optimizer=ADAM, fp16=FP16), params=mlp_params(0), loss_fn=mse_loss,
                                mesh=data_mesh())
    engine.dispatch_ahead = dispatch_ahead
    for call, batch in enumerate(GOOD[:2] + [poisoned(b) for b in GOOD[2:]], start=1):
        try:
            engine.train_batch(batch)
        except zerojax.LossScaleError as e:
            return call, str(e), engine
    raise AssertionError("no LossScaleError")


def test_stuck_scale_stops_on_the_same_step_with_the_same_message() -> None:
    call, message, engine = run_until_stuck(dispatch_ahead=True)
    call_sync, message_sync, engine_sync = run_until_stuck(dispatch_ahead=False)
    assert (call, message) == (call_sync, message_sync)
    assert call == 6 and engine.global_steps == 6 and engine.skipped_steps == 4
    assert "fp16.min_loss_scale=2" in message and "4 consecutive steps skipped" in message
    assert bool(engine.state.scaler.stuck) and float(engine.state.scaler.scale) == 2.0
    np.testing.assert_array_equal(np.asarray(engine.params["w_in"]), np.asarray(engine_sync.params["w_in"]))
    # Training on after the error applies nothing (a stuck scaler skips every step) and raises again.
    before = np.asarray(engine.params["w_in"])
    with pytest.raises(zerojax.LossScaleError, match="at step 7 with the loss scale already"):
        engine.train_batch(GOOD[0])
    np.testing.assert_array_equal(np.asarray(engine.params["w_in"]), before)


class Gate:
    """A loss whose step cannot finish until the test opens the gate (a host callback waits)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def wait(self, x: Any) -> np.ndarray:
        self.event.wait(120)
        return np.zeros((), np.float32)

    def loss(self, params: Any, batch: Any) -> jax.Array:
        held = jax.pure_callback(self.wait, jax.ShapeDtypeStruct((), jnp.float32), batch["x"][0, 0])
        return mse_loss(params, batch) + held


@pytest.mark.parametrize("fp16", [FP16, None], ids=["dynamic-fp16", "fp32"])
def test_train_batch_returns_while_its_step_still_runs(fp16: dict | None) -> None:
    gate = Gate()
    cfg = make_config(2, optimizer=ADAM, **({"fp16": fp16} if fp16 else {}))
    engine = zerojax.initialize(cfg, params=mlp_params(0), loss_fn=gate.loss, mesh=data_mesh())
    gate.event.set()
    jax.block_until_ready(engine.train_batch(GOOD[0]))  # compiles, with the gate open
    gate.event.clear()
    done = threading.Event()
    caller = threading.Thread(target=lambda: (engine.train_batch(GOOD[1]), done.set()), daemon=True)
    caller.start()
    returned = done.wait(10)  # dispatching takes milliseconds; the step cannot end before the gate opens
    gate.event.set()
    caller.join(120)
    assert returned, "train_batch waited for its own step to finish"
    metrics = engine.train_batch(GOOD[2])
    assert engine.global_steps == 3 and np.isfinite(float(metrics["loss"]))


# ------------------------------------------------------------------------------------------------
# The trainer's loop: batches built in a thread, the thread gone at the end, its errors raised.

SMALL = ["run.steps=4", "run.log_every=2", "steps_per_print=2", "model.d_model=32", "model.n_layers=1",
         "model.n_heads=2", "model.seq_len=16", "data.max_bytes=50000", "run.eval_batches=0",
         "run.progress=false", "run.save_every=100", "scheduler.params.total_num_steps=4",
         "scheduler.params.warmup_num_steps=1"]


def batch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("grain-") and t.is_alive()]


def test_trainer_prefetch_thread_ends_and_its_errors_reach_the_caller(tmp_path, monkeypatch) -> None:
    from zerojax.runtime.data import Batches
    from zerojax.app.trainer import train

    config = zerojax.load_config("configs/zero1.yaml", [*SMALL, f"run.output_dir={tmp_path / 'ok'}"])
    summary = train(config)
    assert summary["steps"] == 4 and not batch_threads()
    from zerojax import checkpoint
    assert checkpoint.metadata(tmp_path / "ok" / "checkpoints")["extra"]["data_position"] == 4  # taken, not built

    real = Batches.batch

    def failing(self: Batches, index: int, rows: Any = None) -> dict[str, np.ndarray]:
        if index == 2 and self.seed == config.data.seed:
            raise OSError("corpus file vanished")
        return real(self, index, rows)

    monkeypatch.setattr(Batches, "batch", failing)
    config = zerojax.load_config("configs/zero1.yaml", [*SMALL, f"run.output_dir={tmp_path / 'bad'}"])
    with pytest.raises(OSError, match="corpus file vanished"):
        train(config)
    assert not batch_threads()
    rows = (tmp_path / "bad" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]  # steps 1 and 2 ran on batches 0 and 1
