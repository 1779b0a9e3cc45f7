"""Activation checkpointing (`activation_checkpointing.*`): every policy trains to the same numbers
as no checkpointing, for the embedded GPT and for a user's scanned loss at stages 0 and 3; the
compiled step shows that the policy changes what the backward pass keeps; offloading puts the kept
layer inputs in host memory; bad values fail at load time."""
from __future__ import annotations

import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from benchmarks.user_models import SHAPES
from helpers import assert_tree_close, data_mesh, to_numpy
from zerojax.core import remat
from zerojax.rewrite.remat import for_loss
from zerojax.planner.settings import checkpoint, remat_policy
from zerojax.config import ModelConfig
from zerojax.models import gpt

ROWS = 16
BIG = 2048  # rows of the memory checks: activations dominate the step's temp
SGD = {"type": "SGD", "params": {"lr": 0.1}}
CFG = ModelConfig(d_model=32, n_layers=3, n_heads=4, seq_len=16)


def config(stage: int, policy: str | None = None, cpu: bool = False, **zero: Any) -> zerojax.Config:
    ac: dict[str, Any] = {"cpu_checkpointing": cpu}
    if policy is not None:
        ac["policy"] = policy
    return zerojax.load_config({
        "train_batch_size": ROWS, "gradient_clipping": 0.0, "optimizer": SGD,
        "zero_allow_untested_optimizer": True, "activation_checkpointing": ac,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}})


def plain_scan(width: int = 32, layers: int = 3) -> tuple[Any, Any, Any]:
    """A user's loss over stacked layers with `lax.scan` and no remat of its own."""
    from benchmarks.activation_checkpointing import scanned_mlp
    return scanned_mlp(width, layers)


MODELS = {"plain_scan": plain_scan, "lax_scan_remat": lambda: SHAPES["lax_scan"](width=32, layers=3),
          "nnx_scan": lambda: SHAPES["nnx_scan"](width=32, layers=3)}


def train_user(model: str, cfg: zerojax.Config, steps: int = 3) -> tuple[list[float], Any]:
    params, loss_fn, make_batch = MODELS[model]()
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=data_mesh())
    losses = [float(engine.train_batch(make_batch(ROWS, i))["loss"]) for i in range(steps)]
    return losses, to_numpy(engine.params)


def train_gpt(cfg: zerojax.Config, model: ModelConfig = CFG, steps: int = 3) -> tuple[list[float], Any]:
    loss_fn = gpt.make_loss_fn(model, cfg.activation_checkpointing)
    engine = zerojax.initialize(cfg, params=gpt.init_params(model, 0), loss_fn=loss_fn, mesh=data_mesh())
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        tokens = rng.integers(0, model.vocab_size, size=(ROWS, model.seq_len + 1), dtype=np.int32)
        losses.append(float(engine.train_batch({"tokens": tokens})["loss"]))
    return losses, to_numpy(engine.params)


@functools.lru_cache(maxsize=None)
def reference_gpt(stage: int) -> tuple[list[float], Any]:
    """No checkpointing at all: model.remat false and no policy."""
    return train_gpt(config(stage), ModelConfig(**{**CFG.__dict__, "remat": False}))


@functools.lru_cache(maxsize=None)
def reference_user(model: str, stage: int) -> tuple[list[float], Any]:
    return train_user(model, config(stage))


@pytest.mark.parametrize("stage, policy, cpu", [
    (0, "nothing", False), (0, "dots_no_batch", False), (0, "dots", False), (0, "everything", False),
    (0, "nothing", True), (3, "nothing", True), (3, "dots", False), (3, "dots_no_batch", True)])
def test_gpt_every_policy_trains_like_no_checkpointing(stage: int, policy: str, cpu: bool) -> None:
    want_loss, want = reference_gpt(stage)
    got_loss, got = train_gpt(config(stage, policy, cpu))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-5, atol=1e-6, what=f"gpt stage {stage} {policy} cpu={cpu}")


@pytest.mark.parametrize("model, stage, policy, cpu", [
    ("plain_scan", 0, "nothing", False), ("plain_scan", 0, "dots", False), ("plain_scan", 0, "everything", False),
    ("plain_scan", 0, "dots_no_batch", True), ("plain_scan", 3, "nothing", True), ("plain_scan", 3, "dots", False),
    ("lax_scan_remat", 3, "dots", True), ("nnx_scan", 0, "dots", False), ("nnx_scan", 3, "nothing", True)])
def test_user_loss_every_policy_trains_like_no_checkpointing(model: str, stage: int, policy: str, cpu: bool) -> None:
    want_loss, want = reference_user(model, stage)
    got_loss, got = train_user(model, config(stage, policy, cpu))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-5, atol=1e-6, what=f"{model} stage {stage} {policy} cpu={cpu}")


def _temp(cfg: zerojax.Config, params: Any, loss_fn: Any, batch: Any) -> int:
    plan = zerojax.plan(cfg, data_mesh(), params)
    state = zerojax.init_state(cfg, plan, params)
    step = zerojax.make_train_step(cfg, plan, loss_fn)
    return step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("stage", [0, 3])
def test_policy_changes_what_the_user_step_keeps(stage: int) -> None:
    """More kept per layer, more temp: nothing < dots <= everything = no checkpointing (no remat in the
    loss itself), by at least one layer stack's worth of activations."""
    params, loss_fn, make_batch = plain_scan(width=64, layers=8)
    batch = make_batch(BIG, 0)
    zero = {"overlap_comm": False} if stage == 3 else {}
    temp = {p: _temp(_cfg(stage, p, zero), params, loss_fn, batch) for p in (None, "nothing", "dots", "everything")}
    # one layer's (width,) activation over the device's rows, in fp32
    act = 4 * 64 * BIG // 8
    assert temp["nothing"] + 4 * act < temp["dots"], temp
    assert temp["dots"] <= temp["everything"] + act, temp
    assert abs(temp["everything"] - temp[None]) <= act, temp


def _cfg(stage: int, policy: str | None, zero: dict) -> zerojax.Config:
    return zerojax.load_config({
        "train_batch_size": BIG, "gradient_clipping": 0.0, "optimizer": SGD,
        "zero_allow_untested_optimizer": True,
        "activation_checkpointing": {} if policy is None else {"policy": policy},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}})


def test_policy_changes_what_the_gpt_keeps() -> None:
    model = ModelConfig(d_model=64, n_layers=6, n_heads=4, seq_len=64)
    params = gpt.init_params(model, 0)

    def temp(policy: str | None, remat_default: bool = True) -> int:
        m = ModelConfig(**{**model.__dict__, "remat": remat_default})
        ac = zerojax.load_config({"train_batch_size": 8, "activation_checkpointing":
                                  {} if policy is None else {"policy": policy}}).activation_checkpointing
        loss = gpt.make_loss_fn(m, ac)
        tokens = np.zeros((8, model.seq_len + 1), np.int32)
        grad = jax.jit(jax.grad(lambda p: loss(p, {"tokens": tokens})))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    t = {p: temp(p) for p in ("nothing", "dots_no_batch", "dots", "everything")}
    assert t["nothing"] < t["dots_no_batch"] < t["dots"] <= t["everything"], t
    assert temp(None) == t["nothing"]           # model.remat: true keeps layer inputs only
    assert temp(None, False) == t["everything"]  # model.remat: false keeps everything


def _host_puts(jaxpr: Any) -> int:
    """Values placed in host memory (typed `<host>`) in a jaxpr."""
    return str(jaxpr).count("<host>")


def test_cpu_checkpointing_offloads_the_kept_layer_inputs() -> None:
    """The residuals the policy keeps go to host memory: device_puts to the host in the step's
    jaxpr, and memory-kind annotations (`pinned_host`) in the step lowered for a GPU. (The CPU
    backend lowers host placement inside a computation as a no-op: host and device are one RAM.)"""
    params, loss_fn, make_batch = plain_scan()
    batch = make_batch(ROWS, 0)
    counts = {}
    # stage 3 with overlap_comm: the prefetching scan keeps its per-layer input carries on the host
    for stage, cpu in itertools.product((0, 3), (False, True)):
        cfg = config(stage, "nothing", cpu)
        plan = zerojax.plan(cfg, data_mesh(), params)
        state = zerojax.init_state(cfg, plan, params)
        step = zerojax.make_train_step(cfg, plan, loss_fn)
        counts[stage, cpu] = _host_puts(jax.make_jaxpr(step)(state, batch))
    assert counts[0, False] == counts[3, False] == 0 and counts[0, True] >= 1, counts
    assert counts[3, True] > counts[0, True], counts

    ac = config(0, "dots", True).activation_checkpointing
    loss = gpt.make_loss_fn(CFG, ac)
    tokens = np.zeros((4, CFG.seq_len + 1), np.int32)
    p = gpt.init_params(CFG, 0)
    grad = jax.jit(jax.grad(lambda p: loss(p, {"tokens": tokens})))
    text = grad.trace(p).lower(lowering_platforms=("cuda",)).as_text()
    assert '_xla_buffer_placement = "pinned_host"' in text
    plain = jax.jit(jax.grad(lambda p: gpt.make_loss_fn(CFG)(p, {"tokens": tokens})))
    assert "pinned_host" not in plain.trace(p).lower(lowering_platforms=("cuda",)).as_text()


def test_resolve_and_config_errors() -> None:
    ac = lambda **kw: zerojax.load_config({"train_batch_size": 8, "activation_checkpointing": kw})  # noqa: E731
    assert remat_policy(ac()) is None
    assert remat_policy(ac(), model_remat=True) == remat.Remat("nothing")
    assert remat_policy(ac(cpu_checkpointing=True)) == remat.Remat("nothing", True)
    assert remat_policy(ac(policy="dots", cpu_checkpointing=True)) == remat.Remat("dots", True)
    # DeepSpeed keys with no JAX counterpart load and change nothing.
    assert remat_policy(ac(partition_activations=True, contiguous_memory_optimization=True,
                         number_checkpoints=4, synchronize_checkpoint_boundary=True, profile=True)) is None
    with pytest.raises(zerojax.ConfigError, match="activation_checkpointing.policy"):
        ac(policy="all")
    with pytest.raises(zerojax.ConfigError, match="cpu_checkpointing: policy 'everything'"):
        ac(policy="everything", cpu_checkpointing=True)
    with pytest.raises(zerojax.ConfigError, match="activation_checkpointing.cpu_checkpointing"):
        ac(cpu_checkpointing="yes")
    with pytest.raises(zerojax.ConfigError, match="activation_checkpointing.policy: not applied to pipeline"):
        zerojax.load_config({"train_batch_size": 8, "mesh": {"stage": 2},
                             "activation_checkpointing": {"policy": "dots"}})


def test_loss_without_a_policy_is_left_alone() -> None:
    _, loss_fn, _ = plain_scan()
    assert for_loss(remat_policy(config(0)), loss_fn) is loss_fn
    wrapped = for_loss(remat_policy(config(0, "dots")), loss_fn)
    assert wrapped is not loss_fn and wrapped.__wrapped__ is loss_fn


def test_loss_taking_rng_keeps_its_key_and_values() -> None:
    """A loss with an `rng` parameter (dropout inside the scan) draws the same masks when checkpointed."""
    params, _, make_batch = plain_scan()
    from benchmarks.user_models import _block

    def loss_fn(params: dict, batch: dict, rng: jax.Array) -> jax.Array:
        h = batch["x"] @ params["w_in"]

        def body(h: jax.Array, xs: Any) -> tuple[jax.Array, None]:
            p, i = xs
            keep = jax.random.bernoulli(jax.random.fold_in(rng, i), 0.8, h.shape)
            return _block(jnp.where(keep, h / 0.8, 0.0), p), None

        h, _ = jax.lax.scan(body, h, (params["layers"], jnp.arange(3)))
        return jnp.mean(((h @ params["w_out"]) - batch["y"]) ** 2)

    results = []
    for policy in (None, "dots"):
        engine = zerojax.initialize(config(0, policy), params=params, loss_fn=loss_fn, mesh=data_mesh())
        losses = [float(engine.train_batch(make_batch(ROWS, i))["loss"]) for i in range(2)]
        results.append((losses, to_numpy(engine.params)))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
    assert_tree_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6, what="dropout loss, dots vs none")


def test_checkpoint_helper_wraps_one_layer_with_the_configured_policy() -> None:
    """`checkpoint(fn, config)`: DeepSpeed's checkpoint(fn, ...) for a loss that places its own remat."""
    def layer(h: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.tanh(jnp.tanh(h @ w) @ w.T)

    h = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(8, 16)), jnp.float32)
    grad = lambda f: jax.grad(lambda h, w: f(h, w).sum(), argnums=(0, 1))  # noqa: E731
    want = grad(layer)(h, w)
    for policy, cpu in (("nothing", False), ("dots", True)):
        wrapped = checkpoint(layer, config(0, policy, cpu))
        eqn = jax.make_jaxpr(wrapped)(h, w).jaxpr.eqns[0]
        assert eqn.params["policy"] == remat.Remat(policy, cpu).policy
        assert_tree_close(to_numpy(grad(wrapped)(h, w)), to_numpy(want), rtol=1e-6, atol=1e-7, what=policy)
    assert checkpoint(layer, config(0, "everything")) is layer
