"""fp16 and DeepSpeed's dynamic loss scaler (zerojax/precision.py) and overflow skipping in the step.

The scaler is checked step by step against `DeepSpeedScaler`, a plain-Python transcription of the
rules of DeepSpeed's `DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py); the step is checked by forcing
overflows with non-finite inputs: those steps are skipped and the run then equals one that never saw
them.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from helpers import (ADAM, assert_relative_close, assert_tree_close, data_mesh, make_batch, make_config, mlp_params,
                     mse_loss, to_numpy, train_steps)
from zerojax.core.precision import LossScaleState, ScalerConfig, init_loss_scale, update_loss_scale


class DeepSpeedScaler:
    """DeepSpeed's dynamic loss scaler, transcribed from the rules (host Python, no JAX)."""

    def __init__(self, init_scale: float, window: int, min_scale: float, hysteresis: int, consecutive: bool):
        self.scale, self.window, self.min_scale = init_scale, window, min_scale
        self.delayed_shift = self.cur_hysteresis = hysteresis
        self.consecutive = consecutive
        self.iter, self.last_overflow = 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale:
                    raise FloatingPointError("loss scale already at minimum")
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow = self.iter
        else:
            if self.consecutive:
                self.cur_hysteresis = self.delayed_shift
            stable = self.iter - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive:
                    self.cur_hysteresis = self.delayed_shift
                self.scale *= 2
        self.iter += 1


def scaler_cfg(**kw: Any) -> ScalerConfig:
    base = dict(dynamic=True, check_finite=True, initial=2.0 ** 4, window=3, hysteresis=2, consecutive=False,
                min_scale=1.0)
    base.update(kw)
    return ScalerConfig(**base)


O, C = True, False  # overflow, clean
PATTERNS = {
    "clean-growth": ([C] * 10, {}),  # grows on the (window+1)-th clean step, then every window steps
    "one-overflow-absorbed-by-hysteresis": ([C, O, C, C, C, C, C], {}),
    "two-overflows-halve": ([O, O, C, C, C, C, C, C], {}),
    "hysteresis-1-halves-at-once": ([O, C, O, O, C, C, C, C], dict(hysteresis=1)),
    "interleaved-no-refill": ([O, C, O, C, C, O, C, C, C, C], {}),
    "interleaved-consecutive-refill": ([O, C, O, C, C, O, C, C, C, C], dict(consecutive=True)),
    "down-to-minimum": ([O] * 7 + [C] * 4, dict(hysteresis=1, initial=2.0 ** 8, min_scale=2.0)),
    "hysteresis-3-window-1": ([O, O, C, O, O, O, C, C, C], dict(hysteresis=3, window=1)),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_scale_sequence_matches_deepspeed(name: str) -> None:
    pattern, kw = PATTERNS[name]
    cfg = scaler_cfg(**kw)
    ref = DeepSpeedScaler(cfg.initial, cfg.window, cfg.min_scale, cfg.hysteresis, cfg.consecutive)
    update = jax.jit(lambda s, o, i: update_loss_scale(cfg, s, o, i, jnp.zeros((1,), jnp.bool_)))
    state = init_loss_scale(cfg, 1)
    seen = set()
    for i, overflow in enumerate(pattern):
        state = update(state, jnp.asarray(overflow), jnp.asarray(i, jnp.int32))
        ref.update(overflow)
        assert float(state.scale) == ref.scale, f"step {i}: scale {float(state.scale)} != {ref.scale}"
        assert int(state.hysteresis) == ref.cur_hysteresis, f"step {i}: hysteresis"
        assert int(state.last_overflow) == ref.last_overflow, f"step {i}: last overflow"
        assert not bool(state.stuck)
        seen.add(float(state.scale))
    assert len(seen) > 1 or name == "one-overflow-absorbed-by-hysteresis"  # the pattern moves the scale


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_overflow_at_minimum_is_stuck_like_deepspeeds_error(hysteresis: int) -> None:
    cfg = scaler_cfg(initial=4.0, min_scale=2.0, hysteresis=hysteresis)
    ref = DeepSpeedScaler(cfg.initial, cfg.window, cfg.min_scale, cfg.hysteresis, cfg.consecutive)
    state = init_loss_scale(cfg, 1)
    bad = jnp.ones((1,), jnp.bool_)
    for i in range(10):
        try:
            ref.update(True)
        except FloatingPointError:
            state = update_loss_scale(cfg, state, jnp.asarray(True), jnp.asarray(i), bad)
            assert bool(state.stuck) and float(state.scale) == cfg.min_scale
            assert int(state.streak) == i + 1
            return
        state = update_loss_scale(cfg, state, jnp.asarray(True), jnp.asarray(i), bad)
        assert not bool(state.stuck) and float(state.scale) == ref.scale
    pytest.fail("DeepSpeed's rules never reached the minimum")


def test_static_scale_never_moves() -> None:
    cfg = scaler_cfg(dynamic=False, initial=128.0)
    state = init_loss_scale(cfg, 2)
    for i, overflow in enumerate([True, True, True, False, True]):
        state = update_loss_scale(cfg, state, jnp.asarray(overflow), jnp.asarray(i), jnp.array([False, True]))
    assert float(state.scale) == 128.0 and not bool(state.stuck) and int(state.streak) == 1


def test_scaler_config_from_deepspeed_keys() -> None:
    dyn = zerojax.plan(make_config(0, fp16={"enabled": True}), data_mesh(), mlp_params()).scaler
    assert dyn == ScalerConfig(dynamic=True, check_finite=True, initial=2.0 ** 16, window=1000, hysteresis=2,
                               consecutive=False, min_scale=1.0)
    static = zerojax.plan(make_config(0, fp16={"enabled": True, "loss_scale": 512}), data_mesh(),
                          mlp_params()).scaler
    assert not static.dynamic and static.initial == 512.0 and static.check_finite
    bf16 = zerojax.plan(make_config(0, dtype="bf16"), data_mesh(), mlp_params()).scaler
    assert not bf16.dynamic and bf16.check_finite and bf16.initial == 1.0 and bf16.limit == 8  # skip_step
    unchecked = zerojax.plan(make_config(0, dtype="bf16", bf16={"enabled": True, "check_grad_overflow": False}),
                             data_mesh(), mlp_params()).scaler
    assert not unchecked.check_finite and not unchecked.dynamic and unchecked.limit == 0


# ------------------------------------------------------------------------------------------------
# Skipping inside the step.

TBS = 32
GOOD = [make_batch(TBS, i) for i in range(3)]


def poisoned(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same batch with one non-finite input: every gradient of that step is NaN."""
    x = batch["x"].copy()
    x[5, 3] = np.inf
    return {"x": x, "y": batch["y"]}




SCHEDULE = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2, "warmup_type": "linear"}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("fp16", [{"enabled": True, "loss_scale": 256},
                                  {"enabled": True, "initial_scale_power": 10, "hysteresis": 2}],
                         ids=["static", "dynamic"])
def test_forced_overflows_are_skipped_then_equal_a_clean_run(stage: int, fp16: dict) -> None:
    cfg = make_config(stage, gas=2, optimizer=ADAM, fp16=fp16, scheduler=SCHEDULE)
    bad = [GOOD[0], poisoned(GOOD[1]), GOOD[1], poisoned(GOOD[2]), GOOD[2]]
    p, state, metrics = train_steps(cfg, bad)
    _, clean, clean_metrics = train_steps(cfg, GOOD)

    assert [bool(m["skipped"]) for m in metrics] == [False, True, False, True, False]
    assert int(state.step) == 5 and int(state.skipped) == 2
    assert int(clean.step) == 3 and int(clean.skipped) == 0
    # Same schedule position, so the same lr on the applied steps; the optimizer count agrees too.
    assert [float(m["lr"]) for m in metrics if not m["skipped"]] == [float(m["lr"]) for m in clean_metrics]
    # Power-of-two scales make the unscaled gradients identical: the states agree bit for bit.
    assert_tree_close(to_numpy(state.master), to_numpy(clean.master), rtol=0, atol=0, what="master")
    assert_tree_close(to_numpy(state.opt_state), to_numpy(clean.opt_state), rtol=0, atol=0, what="opt")
    assert_tree_close(to_numpy(state.params), to_numpy(clean.params), rtol=0, atol=0, what="params")
    # Two overflows with hysteresis 2: the second one halves the scale for the next step.
    want = [256.0] * 5 if "loss_scale" in fp16 else [1024.0] * 4 + [512.0]
    assert [float(m["loss_scale"]) for m in metrics] == want
    assert int(state.scaler.last_overflow) == (3 if "loss_scale" not in fp16 else -1)


def test_bf16_check_grad_overflow_skips_without_a_scale() -> None:
    cfg = make_config(2, dtype="bf16", optimizer=ADAM, bf16={"enabled": True, "check_grad_overflow": True})
    _, state, metrics = train_steps(cfg, [GOOD[0], poisoned(GOOD[1]), GOOD[1]])
    _, clean, _ = train_steps(cfg, GOOD[:2])
    assert [bool(m["skipped"]) for m in metrics] == [False, True, False]
    assert all(float(m["loss_scale"]) == 1.0 for m in metrics)
    assert_tree_close(to_numpy(state.master), to_numpy(clean.master), rtol=0, atol=0, what="master")


def test_unchecked_bf16_applies_non_finite_steps() -> None:
    """Without the check (`bf16.check_grad_overflow: false`, DeepSpeed's bf16 default), a NaN step is
    applied: it is not skipped."""
    cfg = make_config(1, dtype="bf16", optimizer=ADAM, bf16={"enabled": True, "check_grad_overflow": False})
    _, state, metrics = train_steps(cfg, [poisoned(GOOD[0])])
    assert not bool(metrics[0]["skipped"]) and int(state.skipped) == 0
    assert not np.all(np.isfinite(np.asarray(jax.device_get(state.master["w_in"]))))


def test_overflow_at_minimum_scale_stops_the_engine_with_a_diagnosis() -> None:
    cfg = make_config(3, optimizer=ADAM, fp16={"enabled": True, "initial_scale_power": 2, "min_loss_scale": 2,
                                               "hysteresis": 1})
    engine = zerojax.initialize(cfg, params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh())
    engine.train_batch(GOOD[0])
    before = to_numpy(engine.params)
    engine.train_batch(poisoned(GOOD[1]))       # scale 4 -> 2 (the minimum), skipped
    assert engine.skipped_steps == 1 and float(engine.state.scaler.scale) == 2.0
    with pytest.raises(zerojax.LossScaleError) as err:
        engine.train_batch(poisoned(GOOD[2]))   # overflow at the minimum: DeepSpeed's error
    message = str(err.value)
    assert "fp16.min_loss_scale=2" in message and "2 consecutive steps skipped" in message
    assert "['w_in']" in message and "bf16.enabled: true" in message
    assert_tree_close(to_numpy(engine.params), before, rtol=0, atol=0, what="params after the skipped steps")
    assert engine.global_steps == 3 and engine.skipped_steps == 2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_matches_fp32_reference_loosely(stage: int) -> None:
    """fp16 compute with fp32 master weights tracks an fp32 run (loss and parameters).

    The scale starts at 2^8: as in DeepSpeed, each device's fp16 gradient carries the whole loss
    scale (1/dp is applied around the reduction), so the default 2^16 would overflow these O(1)
    gradients and skip steps (tests/test_grad_scaling.py checks where)."""
    cfg16 = make_config(stage, gas=2, optimizer=ADAM, fp16={"enabled": True, "initial_scale_power": 8})
    cfg32 = make_config(stage, gas=2, optimizer=ADAM)
    _, s16, m16 = train_steps(cfg16, GOOD)
    _, s32, m32 = train_steps(cfg32, GOOD)
    assert not any(bool(m["skipped"]) for m in m16)
    for a, b in zip(m16, m32):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=2e-3)
    assert s16.params["w_in"].dtype == jnp.float16 and s16.master["w_in"].dtype == jnp.float32
    assert_relative_close(to_numpy(s16.master), to_numpy(s32.params), rel=0.05, origin=mlp_params(0),
                          what="fp16 master vs fp32")


def test_loss_scale_state_is_replicated_scalars() -> None:
    p = zerojax.plan(make_config(2, fp16={"enabled": True}), data_mesh(), mlp_params())
    state = zerojax.init_state(p, mlp_params())
    assert isinstance(state.scaler, LossScaleState)
    assert state.scaler.first_bad.shape == (p.n_leaves,)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state.scaler))


def test_norm_and_finite_is_optax_norm_and_leaf_finite_from_one_reduction_per_leaf() -> None:
    """The step's gradient norm and per-leaf finiteness come from one sum per leaf: bit for bit
    optax's norm on finite gradients, `leaf_finite`'s flags on non-finite ones (inf and NaN), and a
    finite leaf whose squares overflow is still finite (its norm is inf, as optax's)."""
    from zerojax.core.precision import leaf_finite, norm_and_finite
    import optax
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(33, 7)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32) * 1e-3,
            "c": np.float32(rng.normal(size=(2, 3, 4)) * 1e3)}
    both = jax.jit(lambda t: (norm_and_finite(t), optax.tree.norm(t), leaf_finite(t)))
    (norm, finite), want, flags = both(tree)
    assert np.asarray(norm).tobytes() == np.asarray(want).tobytes() and np.asarray(finite).all()
    for a, b, c, bad in [(np.inf, 0, 0, [0]), (0, np.nan, 0, [1]), (-np.inf, np.nan, 0, [0, 1]), (0, 0, 1e30, [])]:
        t = {"a": tree["a"].copy(), "b": tree["b"].copy(), "c": tree["c"].copy()}
        t["a"][3, 2] += a
        t["b"][1] += b
        t["c"][1, 2, 3] += c
        (norm, finite), want, flags = both(t)
        assert np.flatnonzero(~np.asarray(finite)).tolist() == bad
        assert (np.asarray(finite) == np.asarray(flags)).all()
        assert np.isnan(norm) if bad else np.isinf(norm) and np.isinf(want)
    # One reduction per leaf in the program (leaf_finite beside the norm was two).
    text = jax.jit(norm_and_finite).lower(tree).as_text()
    assert text.count("stablehlo.reduce") == 3, text


@pytest.mark.parametrize("precision", [{"bf16": {"enabled": True}}, {"fp16": {"enabled": True, "loss_scale": 256}}],
                         ids=["bf16", "fp16-static"])
def test_a_static_loss_scale_is_the_plans_constant(precision: dict) -> None:
    """A static scaler never moves, so the step folds its scale in as a constant (at bf16's 1 the
    unscale multiply is gone from the program) instead of reading the state's: a state carrying
    another value (a checkpoint of a dynamic run) trains as the config says."""
    cfg = make_config(3, dtype="bf16" if "bf16" in precision else "fp32", optimizer=ADAM, **precision)
    p = zerojax.plan(cfg, data_mesh(), mlp_params(0))
    step = zerojax.make_train_step(cfg, p, mse_loss)
    new, metrics = step(zerojax.init_state(cfg, p, mlp_params(0)), GOOD[0])  # the step donates its state
    state = zerojax.init_state(cfg, p, mlp_params(0))
    stale = state._replace(scaler=state.scaler._replace(scale=jnp.asarray(3.0, jnp.float32)))
    from_stale, stale_metrics = step(stale, GOOD[0])
    assert float(metrics["loss_scale"]) == float(stale_metrics["loss_scale"]) == p.scaler.initial
    assert_tree_close(to_numpy(from_stale.master), to_numpy(new.master), rtol=0, atol=0, what="master")


@pytest.mark.parametrize("optimizer", [ADAM, {"type": "Adagrad", "params": {"lr": 0.1}}],
                         ids=["adam", "adagrad"])
def test_skipping_non_finite_steps_costs_no_step_memory(optimizer: dict) -> None:
    """Skipping keeps the old state with a select; the optimizer's buffers must still be updated in
    place of the donated ones. Reading a buffer's new value twice (into the state and into the
    parameter update) made XLA copy every old buffer first: two copies of each moment per step."""
    params = {"w": np.full((64, 512), 0.01, np.float32)}

    def loss(p: dict, batch: dict) -> jax.Array:
        return jnp.mean((batch["x"] @ p["w"]) ** 2)

    batch = {"x": np.ones((8, 64), np.float32)}
    temps = {}
    for mode in ("skip_step", "stop"):
        cfg = make_config(3, optimizer=optimizer, train_batch_size=8, run={"non_finite": mode})
        plan = zerojax.plan(cfg, data_mesh(), params)
        state = zerojax.init_state(cfg, plan, params)
        step = zerojax.make_train_step(cfg, plan, loss)
        temps[mode] = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    buffer = 64 * 512 * 4 // 8  # one optimizer buffer's shard on one device
    assert temps["skip_step"] < temps["stop"] + buffer // 2, temps
