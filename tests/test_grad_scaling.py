"""Where the 1/dp of the gradient mean is applied: prescale_gradients, gradient_predivide_factor, and
DeepSpeed's fp16 overflow point.

In fp32 the split of 1/dp around the reduction changes nothing but rounding. In fp16 it decides what
overflows: a sum of two fp16 gradients of 2^15 is 2^16, which fp16 cannot hold, while the same
gradients divided first sum to 2^15. DeepSpeed's ranks differentiate their own mean loss times
scale/gas in fp16, so a gradient that overflows on a rank overflows there, before any averaging;
zerojax does the same, which puts its loss-scale sequence on DeepSpeed's (test_scale_sequence_*).
"""
from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from helpers import assert_tree_close, data_mesh, forward, make_batch, make_config, mlp_params, to_numpy, \
    train_steps
from zerojax.config import ConfigWarning
from zerojax.core.step import grad_average

FP16_MAX = float(jnp.finfo(jnp.float16).max)


# ------------------------------------------------------------------------------------------------
# fp32: every split of 1/dp trains the same.

@pytest.mark.parametrize("stage,extra", [
    (0, {"prescale_gradients": True}),
    (0, {"gradient_predivide_factor": 4.0}),
    (1, {"gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 1, "reduce_scatter": False}}),
    (2, {"prescale_gradients": True, "zero_optimization": {"stage": 2, "reduce_scatter": False}}),
])
def test_fp32_same_as_default(stage: int, extra: dict) -> None:
    batches = [make_batch(32, i) for i in range(2)]
    sgd = {"type": "SGD", "params": {"lr": 0.1}}  # SGD shows a gradient off by a constant factor
    _, want, _ = train_steps(make_config(stage, optimizer=sgd), batches)
    cfg = make_config(stage, optimizer=sgd, **extra)
    p, got, _ = train_steps(cfg, batches)
    avg = grad_average(p)
    assert avg.in_loss * avg.pre * avg.post == pytest.approx(1 / 8)
    assert_tree_close(to_numpy(got.params), to_numpy(want.params), rtol=1e-5, atol=1e-6)


def test_rules_follow_deepspeed() -> None:
    mesh = data_mesh(8)
    params = mlp_params(0)
    cases = {  # (stage, keys) -> (in_loss, pre, post) for dp = 8
        (0, ()): (1, 1, 1 / 8),  # sum, then divide (DeepSpeed's default postscale)
        (0, (("prescale_gradients", True),)): (1, 1 / 8, 1),
        (0, (("gradient_predivide_factor", 2.0),)): (1, 1 / 2, 2 / 8),
        (2, ()): (1, 1 / 8, 1),  # average_tensor's reduce-scatter path divides first
        (1, ()): (1, 1 / 8, 1),
        (3, ()): (1 / 8, 1, 1),  # the reduce-scatter is inside the backward pass
    }
    for (stage, keys), want in cases.items():
        p = zerojax.plan(make_config(stage, **dict(keys)), mesh, params)
        assert tuple(grad_average(p)) == pytest.approx(want), (stage, keys)


@pytest.mark.parametrize("stage", [0, 2])
def test_gradient_allreduce_op_sum_is_the_mean_times_dp(stage: int) -> None:
    """`gradient_allreduce_op: sum` keeps DeepSpeed's unscaled sum of the 8 shards' gradients: SGD at
    lr / 8 over the sum moves as SGD at lr over the mean (no clipping, which would see the larger norm)."""
    batches = [make_batch(32, i) for i in range(2)]
    _, want, _ = train_steps(make_config(stage, optimizer={"type": "SGD", "params": {"lr": 0.1}}, clip=0.0), batches)
    cfg = make_config(stage, optimizer={"type": "SGD", "params": {"lr": 0.1 / 8}}, clip=0.0,
                      gradient_allreduce_op="sum", gradient_predivide_factor=2.0 if stage == 0 else 1.0)
    p, got, _ = train_steps(cfg, batches)
    assert tuple(grad_average(p)) == (1.0, 1.0, 1.0)  # no 1/dp, and no predivide factor, as in DeepSpeed
    assert_tree_close(to_numpy(got.params), to_numpy(want.params), rtol=1e-5, atol=1e-6)


def test_refused_where_deepspeed_asserts() -> None:
    for stage in (2, 3):
        with pytest.raises(zerojax.ConfigError, match=r"prescale_gradients: .*reduce_scatter"):
            make_config(stage, prescale_gradients=True)
        with pytest.raises(zerojax.ConfigError, match=r"gradient_predivide_factor: .*reduce_scatter"):
            make_config(stage, gradient_predivide_factor=2.0)
    with pytest.raises(zerojax.ConfigError, match="stage 3: the gradient reduce-scatter"):
        make_config(3, prescale_gradients=True, zero_optimization={"stage": 3, "reduce_scatter": False})
    with pytest.warns(ConfigWarning, match="prescale_gradients: ignored at ZeRO stage 1"):
        make_config(1, prescale_gradients=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_config(0, prescale_gradients=True, gradient_predivide_factor=2.0)


# ------------------------------------------------------------------------------------------------
# fp16: the split decides whether the sum overflows.

def _linear_loss(params: dict, batch: dict) -> jax.Array:
    """Gradient w.r.t. w = the mean of x (times the loss scale): chosen exactly."""
    return jnp.mean(batch["x"].astype(params["w"].dtype) @ params["w"]).astype(jnp.float32)


def _one_fp16_step(stage: int, comm: str | None = "fp16", **extra) -> dict:
    raw = {"train_batch_size": 2, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
           "fp16": {"enabled": True, "loss_scale": 2.0 ** 15}, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True, **extra}
    if comm:
        raw["communication_data_type"] = comm
    for key, value in extra.items():
        if key == "zero_optimization":
            raw[key] = {"stage": stage, **value}
    cfg = zerojax.load_config(raw)
    params = {"w": np.zeros((4,), np.float32)}
    batch = {"x": np.ones((2, 4), np.float32)}  # each of the 2 devices: gradient 2^15 per element
    _, _, metrics = train_steps(cfg, [batch], params=params, loss_fn=_linear_loss, mesh=data_mesh(2))
    return metrics[0]


def test_fp16_sum_overflows_without_predivide() -> None:
    # Stage 0, DeepSpeed's default: fp16 sum 2^15 + 2^15 = inf -> the step is skipped.
    assert bool(_one_fp16_step(0)["skipped"])
    # Divided before the sum, it fits.
    assert not bool(_one_fp16_step(0, gradient_predivide_factor=2.0)["skipped"])
    assert not bool(_one_fp16_step(0, prescale_gradients=True)["skipped"])
    # Summed in fp32 it fits either way.
    assert not bool(_one_fp16_step(0, comm="fp32")["skipped"])
    # ZeRO-2 (reduce-scatter) divides first, as DeepSpeed's average_tensor; without reduce_scatter it
    # sums first, as its gradient_reduction_w_predivide.
    assert not bool(_one_fp16_step(2)["skipped"])
    assert bool(_one_fp16_step(2, zero_optimization={"reduce_scatter": False})["skipped"])


# ------------------------------------------------------------------------------------------------
# DeepSpeed's fp16 ZeRO-2 overflow point: the scale sequence of a naturally overflowing run.

def _deepspeed_zero2_overflow(params16: dict, rows: list[dict], scale: float, *, loss_divides_by_dp: bool) -> bool:
    """DeepSpeed's order of operations, written out independently of zerojax's step: each rank's fp16
    gradient of its mean loss times `scale` (DeepSpeed's backward of the scaled loss), divided by the
    world size in fp16 (average_tensor), summed in fp16 (the reduce in communication_data_type),
    then checked for inf/nan (has_overflow). `loss_divides_by_dp`: the order zerojax used before,
    with 1/dp folded into the loss - the one that overflowed one halving later than DeepSpeed."""
    dp = len(rows)

    def rank_grad(batch: dict) -> dict:
        def loss(p: dict) -> jax.Array:
            value = jnp.mean((forward(p, batch["x"]) - batch["y"]) ** 2)
            return value * (scale / dp if loss_divides_by_dp else scale)
        return jax.grad(loss)(params16)

    grads = [rank_grad(b) for b in rows]
    if loss_divides_by_dp:
        total = jax.tree.map(lambda *g: sum(g[1:], g[0]), *grads)
    else:
        halves = [jax.tree.map(lambda g: (g.astype(jnp.float32) / dp).astype(jnp.float16), g) for g in grads]
        total = jax.tree.map(lambda *g: sum(g[1:], g[0]), *halves)
    return not all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(total))


def _deepspeed_scales(overflows, initial: float, hysteresis: int, steps: int) -> tuple[list[float], list[bool]]:
    """DeepSpeed's DynamicLossScaler.update_scale (no growth within `steps`): the scale each step
    used, and whether it overflowed."""
    scale, hyst, used, skipped = initial, hysteresis, [], []
    for it in range(steps):
        used.append(scale)
        skipped.append(overflows(scale, it))
        if skipped[-1]:
            if hyst == 1:
                scale = max(scale / 2, 1.0)
            else:
                hyst -= 1
    return used, skipped


def test_scale_sequence_matches_deepspeed_zero2() -> None:
    """ZeRO-2, 2 ranks, fp16, a tanh MLP with an fp32 MSE loss, initial scale 2^24, hysteresis 2:
    the run overflows naturally for several steps, and zerojax skips exactly the steps DeepSpeed's
    arithmetic skips. lr 0 keeps the parameters fixed, so each step's overflow depends on its batch
    and scale alone and the reference needs no optimizer."""
    steps, dp, tbs = 14, 2, 8
    params = mlp_params(3)
    batches = []
    for i in range(steps):
        b = make_batch(tbs, 50 + i)
        batches.append({"x": b["x"] * 3.0, "y": b["y"] * 4.0})  # gradients of order 1: overflow near 2^16
    cfg = zerojax.load_config({
        "train_batch_size": tbs, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 24, "hysteresis": 2,
                 "loss_scale_window": 1000},
        "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True})
    p, _, metrics = train_steps(cfg, batches, params=params, mesh=data_mesh(dp))
    got = [float(m["loss_scale"]) for m in metrics]

    params16 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float16), params)
    m = tbs // dp

    def rows(i: int) -> list[dict]:
        return [jax.tree.map(lambda x: x[r * m:(r + 1) * m], batches[i]) for r in range(dp)]

    def scales(old_order: bool) -> tuple[list[float], list[bool]]:
        return _deepspeed_scales(
            lambda s, i: _deepspeed_zero2_overflow(params16, rows(i), s, loss_divides_by_dp=old_order),
            2.0 ** 24, 2, steps)

    want, want_skipped = scales(False)
    assert got == want
    assert [bool(m["skipped"]) for m in metrics] == want_skipped
    assert sum(want_skipped) >= 5, "the case must overflow naturally for several steps"
    assert not all(want_skipped), "the case must reach a scale that does not overflow"
    assert scales(True)[0] != want, "the case must tell DeepSpeed's order from 1/dp in the loss"


# ------------------------------------------------------------------------------------------------
# A real DeepSpeed run (tests/fixtures/deepspeed/fp16_overflow.py wrote it): the same sequence.

@jax.custom_jvp
def torch_tanh(x: jax.Array) -> jax.Array:
    """tanh whose derivative is computed as torch's tanh_backward computes it: g * (1 - y^2),
    in fp32 for a half-precision tensor, rounded once. JAX's own rule forms x = g * (1 - y) in
    fp16 and returns x + x*y; where y is near -1, 1 - y is 2 and x overflows for |g| > 32752,
    although the derivative itself is small."""
    return jnp.tanh(x)


@torch_tanh.defjvp
def _torch_tanh_jvp(primals: tuple, tangents: tuple) -> tuple:
    (x,), (t,) = primals, tangents
    y = jnp.tanh(x)
    y32 = y.astype(jnp.float32)
    return y, (t.astype(jnp.float32) * (1.0 - y32 * y32)).astype(t.dtype)


def _ds_mlp_loss(params: dict, batch: dict, tanh=torch_tanh) -> jax.Array:
    """The fixture's model: fp16 inputs, a tanh MLP in the parameters' dtype, an fp32 MSE loss."""
    dt = params["w1"].dtype
    h = tanh(batch["x"].astype(dt) @ params["w1"] + params["b1"])
    out = h @ params["w2"] + params["b2"]
    return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


def _replay(name: str, loss_fn) -> tuple[dict, list[dict]]:
    import json
    from pathlib import Path
    case = json.loads((Path(__file__).parent / "fixtures" / "deepspeed" / f"fp16_overflow_{name}.json").read_text())
    cfg = zerojax.load_config(case["config"])
    params = {k: np.asarray(v, np.float32) for k, v in case["params"].items()}
    batches = [{k: np.asarray(v, np.float32) for k, v in b.items()} for b in case["batches"]]
    _, _, metrics = train_steps(cfg, batches, params=params, loss_fn=loss_fn, mesh=data_mesh(2))
    return case, metrics


@pytest.mark.parametrize("name", ["tanh", "output"])
def test_scale_sequence_of_a_real_deepspeed_run(name: str) -> None:
    """DeepSpeed 0.19.8, ZeRO-2, 2 ranks, fp16, initial scale 2^24, hysteresis 2 (its fixture): it
    overflows for ten steps, recovers at 2^15 and overflows once more there; zerojax, on the same
    model computing tanh's derivative as torch does, follows it step for step."""
    case, metrics = _replay(name, _ds_mlp_loss)
    assert sum(case["skipped"]) >= 10
    assert [float(m["loss_scale"]) for m in metrics] == case["loss_scale"]
    assert [bool(m["skipped"]) for m in metrics] == case["skipped"]


def test_jax_tanh_derivative_overflows_earlier() -> None:
    """With jnp.tanh the same run overflows one step more (at 2^15, step 11) than DeepSpeed's: the
    difference is the derivative's fp16 formula (see torch_tanh), not the reduction."""
    case, metrics = _replay("tanh", lambda p, b: _ds_mlp_loss(p, b, tanh=jnp.tanh))
    skipped = [bool(m["skipped"]) for m in metrics]
    first = next(i for i, (a, b) in enumerate(zip(skipped, case["skipped"])) if a != b)
    assert first == 10 and skipped[first] and not case["skipped"][first]
    assert case["loss_scale"][first] == 2.0 ** 15


def test_jax_tanh_derivative_is_in_the_program_for_gpu() -> None:
    """The fp16 intermediate g * (1 - y) is written by JAX's differentiation rule, so the program
    lowered for GPU holds it too: it is not an artefact of XLA:CPU."""
    f = jax.grad(lambda x: jnp.sum(jnp.tanh(x).astype(jnp.float32)))
    text = jax.jit(f).trace(jnp.ones((4,), jnp.float16)).lower(lowering_platforms=("cuda",)).as_text()
    one_minus_y = re.search(r"(%\d+) = stablehlo.subtract %\w+, %\w+ : tensor<4xf16>", text)
    assert one_minus_y, text
    assert re.search(rf"stablehlo.multiply %\w+, {one_minus_y.group(1)} : tensor<4xf16>", text), text
    assert "f32" not in "".join(l for l in text.splitlines() if "multiply" in l), text
