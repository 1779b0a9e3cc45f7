"""`lora.lora_dropout` (PEFT's lora_dropout): dropout on the adapter's input only, in training only.

The masks come from the step's key as every NNX stream does (zerojax.from_nnx): micro-batch i on data
shard d draws from fold_in(fold_in(fold_in(run key, step), d), i). A step at any ZeRO stage or tensor
size equals a one-device run that evaluates each shard's rows with that shard's key; two layouts with
the same number of data shards draw the same masks, different numbers of shards different ones (same
distribution). Evaluation and generation draw none."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import zerojax
from zerojax.errors import ConfigError
from zerojax.models import llama
from zerojax.models.decode import decoder

sys.path.insert(0, str(Path(__file__).parent))
import helpers as h  # noqa: E402
from test_lora import GPT, LLAMA, LORA, ROWS, SEQ, VOCAB, adapters_mask, batch, config, start  # noqa: E402

DROP = {**LORA, "lora_dropout": 0.5}
STEPS, DP = 2, 2  # two data shards in every layout: the reference evaluates each shard's rows apart


def mesh(tensor: int) -> Mesh:
    devices = np.array(jax.devices()[:DP * tensor])
    return Mesh(devices, ("data",)) if tensor == 1 else Mesh(devices.reshape(DP, tensor), ("data", "tensor"))


def shard_keys(state_rng: Any, step: int, dp: int) -> np.ndarray:
    """Raw key data of micro-batch 0 on each data shard at `step` (the documented derivation)."""
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state_rng), step)
    return np.stack([jax.random.key_data(jax.random.fold_in(jax.random.fold_in(step_key, d), 0))
                     for d in range(dp)])


def sharded_loss(loss_fn: Any, dp: int) -> Any:
    """One device: the mean over data shards of each shard's rows under that shard's key."""
    m = ROWS // dp

    def loss(p: Any, b: dict[str, Any]) -> jax.Array:
        return jnp.mean(jnp.stack([
            loss_fn(p, {"tokens": b["tokens"][d * m:(d + 1) * m]}, rng=jax.random.wrap_key_data(b["keys"][d]))
            for d in range(dp)]))
    return loss


_RUNS: dict[Any, Any] = {}


def train(stage: int, tensor: int, section: dict) -> tuple[Any, list[float], Any]:
    key = (stage, tensor, tuple(sorted(section.items())))
    if key not in _RUNS:
        cfg = config(LLAMA, stage, section)
        engine = zerojax.initialize(cfg, params=start(cfg), loss_fn=llama.build(cfg.model)[1], mesh=mesh(tensor))
        rng = np.asarray(jax.device_get(engine.state.rng))
        losses = [float(jax.device_get(engine.train_batch(batch(i))["loss"])) for i in range(STEPS)]
        _RUNS[key] = (h.to_numpy(engine.params), losses, rng, engine.plan.tx)
    return _RUNS[key]


GRID = [(0, 1), (3, 1), (3, 2)]


def reference(rng: np.ndarray, tx: optax.GradientTransformation) -> list[dict]:
    """One device, plain optax, the base frozen; each step's shards under their documented keys (all the
    layouts here share it: the same seed and two data shards)."""
    if "run" not in _RUNS:
        cfg = config(LLAMA, 0, DROP)
        params, loss_fn = start(cfg), llama.build(cfg.model)[1]
        mask = adapters_mask(params)

        def frozen_base(p: Any, b: Any) -> jax.Array:
            return sharded_loss(loss_fn, DP)(jax.tree.map(lambda x, t: x if t else jax.lax.stop_gradient(x), p, mask), b)

        ref_tx = optax.chain(optax.masked(tx, mask),
                             optax.masked(optax.set_to_zero(), jax.tree.map(lambda t: not t, mask)))
        batches = [{**batch(i), "keys": shard_keys(rng, i, DP)} for i in range(STEPS)]
        _RUNS["run"] = h.reference_run(ref_tx, jnp.float32, frozen_base, params, batches, clip=1.0)
        # the first step's rows and parameters under the second step's keys: other masks, another loss
        other = jax.jit(sharded_loss(loss_fn, DP))(params, {**batch(0), "keys": shard_keys(rng, 1, DP)})
        assert abs(float(other) - _RUNS["run"][0]["loss"]) > 1e-4
    return _RUNS["run"]


@pytest.mark.parametrize("stage,tensor", GRID, ids=[f"z{z}-t{t}" for z, t in GRID])
def test_dropout_step_equals_one_device_run_with_each_shards_key(stage: int, tensor: int) -> None:
    got, losses, rng, tx = train(stage, tensor, DROP)
    ref = reference(rng, tx)
    np.testing.assert_allclose(losses, [r["loss"] for r in ref], rtol=2e-5)
    h.assert_tree_close(got, ref[-1]["master"], rtol=2e-4, atol=2e-5, what=f"stage {stage} x tensor {tensor}")


def test_dropout_changes_training_reproducibly_and_one_layout_matches_another() -> None:
    """p > 0 trains otherwise than p = 0; the same seed gives the same run bit for bit; ZeRO 0, ZeRO 3 and
    ZeRO 3 x tensor 2 with the same data shards draw the same masks."""
    z0, loss0, _, _ = train(0, 1, DROP)
    plain, loss_plain, _, _ = train(0, 1, LORA)
    assert all(abs(a - b) > 1e-4 for a, b in zip(loss0, loss_plain))
    for stage, tensor in GRID[1:]:
        z, loss, _, _ = train(stage, tensor, DROP)
        h.assert_tree_close(z, z0, rtol=2e-4, atol=2e-5, what=f"stage {stage} x tensor {tensor} against stage 0")
        np.testing.assert_allclose(loss, loss0, rtol=2e-5)
    cfg = config(LLAMA, 0, DROP)
    again = zerojax.initialize(cfg, params=start(cfg), loss_fn=llama.build(cfg.model)[1], mesh=mesh(1))
    assert [float(jax.device_get(again.train_batch(batch(i))["loss"])) for i in range(STEPS)] == loss0
    h.assert_tree_close(h.to_numpy(again.params), z0, rtol=0, atol=0, what="the same seed again")


def test_evaluation_and_generation_draw_no_mask() -> None:
    cfg, cfg0 = config(LLAMA, 3, DROP), config(LLAMA, 3)
    params = start(cfg)
    loss_p, loss_0 = llama.build(cfg.model)[1], llama.build(cfg0.model)[1]
    b = batch(0)
    assert float(loss_p(params, b)) == float(loss_0(params, b))  # no key: eval mode
    assert float(loss_p(params, b, rng=jax.random.key(0))) != float(loss_0(params, b))
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_p, mesh=mesh(1))
    np.testing.assert_allclose(float(engine.eval_batch(b)), float(loss_0(params, b)), rtol=1e-6)
    tokens = jnp.arange(6)[None] % VOCAB
    logits = llama.apply(cfg0.model, params, tokens)
    np.testing.assert_array_equal(llama.apply(cfg.model, params, tokens), logits)
    dec = decoder(cfg.model)
    out, _ = dec.prefill(params, dec.init_cache(params, 1, SEQ), tokens, jnp.array([6]))
    np.testing.assert_allclose(out[0], logits[0, -1], atol=1e-5)


def test_gpt_dropout_is_refused_with_its_reason() -> None:
    with pytest.raises(ConfigError, match="lora.lora_dropout: 0.5 is built for the llama model only; the gpt "
                                          "model's loss is functional"):
        config(GPT, lora_section=DROP)
    assert config(LLAMA, lora_section=DROP).lora.lora_dropout == 0.5
