"""Frozen parameters (`model.frozen` / `model.trainable`, `plan(..., trainable=)`): a layout with no gradient,
master or optimizer state, at every ZeRO stage, against a one-device optax run with those leaves masked."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax.checkpoint import load, save
from zerojax.core.measure import step_memory
from zerojax.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
import helpers as h  # noqa: E402

FROZEN = ["w_in", "layers.b", "b_out"]   # half the leaves: w_in (16x32), layers.b (2x32), b_out (8,)
FROZEN_NAMES = {"w_in", "layers.b", "b_out"}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}


def mask_of(params: Any) -> Any:
    """True where the leaf is trained (the reference's optax mask)."""
    return {k: ({kk: f"{k}.{kk}" not in FROZEN_NAMES for kk in v} if isinstance(v, dict) else k not in FROZEN_NAMES)
            for k, v in params.items()}


def masked_reference(tx: optax.GradientTransformation, params: Any, batches: list, clip: float) -> list[dict]:
    """One device: gradients of the frozen leaves stopped, their updates set to zero (optax.masked)."""
    mask = mask_of(params)
    inverse = jax.tree.map(lambda t: not t, mask)

    def loss(p: Any, batch: Any) -> jax.Array:
        p = jax.tree.map(lambda x, t: x if t else jax.lax.stop_gradient(x), p, mask)
        return h.mse_loss(p, batch)

    ref_tx = optax.chain(optax.masked(tx, mask), optax.masked(optax.set_to_zero(), inverse))
    return h.reference_run(ref_tx, jnp.float32, loss, params, batches, clip)


@pytest.mark.parametrize("stage, optimizer, loss_fn", [(0, ADAMW, h.mse_loss), (1, h.SGD, h.mse_loss),
                                                     (2, ADAMW, h.mse_loss), (3, ADAMW, h.mse_loss),
                                                     (3, h.SGD, h.layerwise_loss)])
def test_frozen_training_equals_masked_optax(stage: int, optimizer: dict, loss_fn: Any) -> None:
    """Half the leaves frozen by name: the trained ones follow the masked one-device run, the frozen
    ones stay bit-identical, ZeRO-3 shards them (gathered by the evaluator, or by a loss that gathers its
    own layer by layer), and the state holds no master or moments for them."""
    params = h.mlp_params(0, divisible=True)
    cfg = h.make_config(stage, optimizer=optimizer, gas=2, model={"frozen": FROZEN})
    batches = [h.make_batch(32, i) for i in range(3)]
    p, state, metrics = h.train_steps(cfg, batches, params=params, loss_fn=loss_fn)
    ref = masked_reference(p.tx, params, batches, clip=1.0)

    got = h.to_numpy(state.params)
    h.assert_tree_close(got, ref[-1]["master"], rtol=2e-5, atol=2e-6, what="params")
    np.testing.assert_allclose([m["grad_norm"] for m in metrics], [r["grad_norm"] for r in ref], rtol=1e-5)
    for name in ("w_in", "b_out"):  # frozen: exactly what was given
        np.testing.assert_array_equal(np.asarray(state.params[name]), params[name])
        assert state.params[name].dtype == p.policy.param
    np.testing.assert_array_equal(np.asarray(state.params["layers"]["b"]), params["layers"]["b"])
    assert not np.array_equal(got["w_out"], params["w_out"])  # a trained leaf moved

    trained = [k for k, t in zip(p.leaf_paths, jax.tree.leaves(p.trainable)) if t]
    assert trained == ["['b_in']", "['layers']['w']", "['w_out']"] == p.trained_paths
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert len(moments) == (2 if optimizer is ADAMW else 0) * len(trained)
    assert {tuple(x.shape) for x in moments} <= {(32,), (2, 32, 32), (32, 8)}
    assert state.scaler.first_bad.shape == (len(trained),)
    spec = state.params["w_in"].sharding.spec
    assert (spec == jax.sharding.PartitionSpec("data", None)) == (stage == 3), spec


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_bytes_match_the_formula_and_the_compiled_step(stage: int) -> None:
    """bf16 + AdamW: a frozen leaf costs 2 bytes x its size (/ N at stage 3), nothing else; the plan's
    bytes equal the formula's and the compiled step's arguments."""
    params = h.mlp_params(0, divisible=True)
    cfg = h.make_config(stage, dtype="bf16", optimizer=ADAMW, model={"frozen": FROZEN})
    p = zerojax.plan(cfg, h.data_mesh(), params)
    size = {k: x.size for k, x in zip(p.leaf_paths, jax.tree.leaves(params))}
    psi = sum(size.values())
    psi_t = sum(s for k, s, t in zip(size, size.values(), jax.tree.leaves(p.trainable)) if t)
    n = 8
    r = p.report()
    assert r.n_frozen == psi - psi_t == 16 * 32 + 2 * 32 + 8
    assert r.params == 2 * psi / (n if stage == 3 else 1)
    assert r.grads == p.policy.accum.itemsize * psi_t / (n if stage >= 2 else 1)  # trainable leaves only
    scalars = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(p.abstract_opt_state) if x.size <= 1)
    assert r.optimizer == 12 * psi_t / (n if stage >= 1 else 1) + scalars  # master + m + v; counters, lr
    assert r.formula_params == r.params and r.formula_grads == r.grads
    assert abs(r.formula_optimizer - (r.optimizer - scalars)) < 1
    assert "(584 frozen)" in r.table()

    state = zerojax.init_state(cfg, p, params)
    assert state.master["w_in"] is None and state.master["layers"]["b"] is None
    stepped = zerojax.make_train_step(cfg, p, h.mse_loss)
    batch = h.make_batch(32, 0)
    compiled = stepped.lower(state, batch).compile()
    used = step_memory(compiled)
    # no gradient of a frozen leaf is reduced: the reduce-scatters (stages 1-3) or the all-reduce (0)
    # carry the trainable leaves' elements only
    text = compiled.as_text()
    reduced = sum(h.numel(s) for op in ("reduce-scatter", "all-reduce") for s in h.collective_shapes(text, op)
                  if h.numel(s) > 1)  # not the loss's mean
    assert reduced == (psi_t / n if stage >= 1 else psi_t), (reduced, psi_t)
    # the step's arguments: the state (stored parameters, master, moments, a few scalars) and the batch
    batch_bytes = sum(x.nbytes for x in batch.values()) // n  # its rows split over the devices
    state_bytes = used.device_arguments - batch_bytes
    assert r.params + r.optimizer <= state_bytes < r.params + r.optimizer + 256, (state_bytes, r)


def test_checkpoint_round_trip_with_frozen_leaves(tmp_path: Path) -> None:
    """Saved and restored at another stage: every leaf back (frozen ones from their stored copy), training
    goes on identically; the checkpoint names the frozen leaves; the same tag also loads into a plan that
    trains everything (the frozen leaves' masters start from their stored values)."""
    params = h.mlp_params(0, divisible=True)
    batches = [h.make_batch(32, i) for i in range(2)]
    cfg3 = h.make_config(3, dtype="bf16", optimizer=ADAMW, model={"frozen": FROZEN})
    p3, state, _ = h.train_steps(cfg3, batches[:1], params=params)
    save(tmp_path, "t", state, p3, async_save=False)
    meta = zerojax.checkpoint.metadata(tmp_path, "t")
    assert sorted(meta["frozen"]) == ["b_out", "layers.b", "w_in"]
    assert "master.w_in" not in meta["leaves"] and "params.w_in" in meta["leaves"]

    cfg1 = h.make_config(1, dtype="bf16", optimizer=ADAMW, model={"frozen": FROZEN})
    p1 = zerojax.plan(cfg1, h.data_mesh(), params)
    restored, _ = load(tmp_path, "t", p1)
    h.assert_tree_close(h.to_numpy(restored), h.to_numpy(state), rtol=0, atol=0, what="restored")
    w_in = np.asarray(state.params["w_in"].astype(jnp.float32))
    step3, step1 = zerojax.make_train_step(p3, h.mse_loss), zerojax.make_train_step(p1, h.mse_loss)
    a, _ = step3(state, batches[1])
    b, _ = step1(restored, batches[1])
    h.assert_tree_close(h.to_numpy(b.params), h.to_numpy(a.params), rtol=1e-6, atol=1e-7, what="after resume")

    everything = zerojax.plan(h.make_config(1, dtype="bf16", optimizer=ADAMW), h.data_mesh(), params)
    full, _ = load(tmp_path, "t", everything, load_optimizer_states=False)
    np.testing.assert_array_equal(np.asarray(full.master["w_in"]), w_in)


def test_library_mask_and_bad_patterns() -> None:
    """`trainable=` a tree of bools is the same layout as the patterns; a pattern picking nothing, both ways
    at once, or nothing left to train is one error naming the key, before anything compiles."""
    params = h.mlp_params(0, divisible=True)
    mesh = h.data_mesh()
    by_name = zerojax.plan(h.make_config(3, model={"frozen": FROZEN}), mesh, params)
    by_mask = zerojax.plan(h.make_config(3), mesh, params, trainable=mask_of(params))
    assert jax.tree.leaves(by_name.trainable) == jax.tree.leaves(by_mask.trainable)
    only = zerojax.plan(h.make_config(3, model={"trainable": ["w_out", "b_in", "layers.w"]}), mesh, params)
    assert jax.tree.leaves(only.trainable) == jax.tree.leaves(by_name.trainable)

    with pytest.raises(ConfigError, match=r"model.frozen: 'encoder' matches no parameter of the model; its "
                                          r"parameters are b_in, b_out, layers.b"):
        zerojax.plan(h.make_config(3, model={"frozen": ["w_in", "encoder"]}), mesh, params)
    with pytest.raises(ConfigError, match=r"model.trainable: 'lora\*' matches no parameter"):
        zerojax.plan(h.make_config(0, model={"trainable": ["lora*"]}), mesh, params)
    with pytest.raises(ConfigError, match="every parameter is frozen"):
        zerojax.plan(h.make_config(0, model={"frozen": ["*"]}), mesh, params)
    with pytest.raises(ConfigError, match="choose one"):
        zerojax.plan(h.make_config(0, model={"frozen": ["w_in"]}), mesh, params, trainable=mask_of(params))
    with pytest.raises(ValueError, match="trainable= must be shaped like the parameters"):
        zerojax.plan(h.make_config(0), mesh, params, trainable={"w_in": False})


def test_estimate_counts_frozen_parameters_as_stored_only(tmp_path: Path, capsys) -> None:
    """`zerojax estimate` with model.trainable: the plan-exact rows drop the frozen leaves' gradients, master
    and moments (bf16 + AdamW: 2 + 12 bytes each, / N where the stage shards them) and say how many are frozen."""
    from zerojax.app.cli import main
    from zerojax.tools import estimate as E
    tiny = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage3_param_persistence_threshold": 0},
            "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 8, "vocab_size": 64}}
    lora_like = {**tiny, "model": {**tiny["model"], "trainable": ["head"]}}
    full_cfg, frozen_cfg = zerojax.load_config(tiny), zerojax.load_config(lora_like)
    model = E.embedded_model(full_cfg)
    head = sum(x.size for x in jax.tree.leaves(model.abstract_params["head"]))
    psi_f = model.total_params - head
    for choice, n_grad, n_opt in ((E.Choice(0), 1, 1), (E.Choice(1), 1, 8), (E.Choice(2), 8, 8), (E.Choice(3), 8, 8)):
        full = E.plan_exact(full_cfg, model, 8, 8, choice)
        frozen = E.plan_exact(frozen_cfg, model, 8, 8, choice)
        assert frozen.report.n_frozen == psi_f
        assert full.device_bytes - frozen.device_bytes == 2 * psi_f / n_grad + 12 * psi_f / n_opt, choice
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(lora_like))
    assert main(["estimate", "--config", str(cfg), "--devices", "8", "--no-step-time"]) == 0
    out = capsys.readouterr().out
    assert f"frozen: {psi_f:,} of {model.total_params:,} parameters" in out


def test_fused_update_sees_only_trainable_leaves() -> None:
    """kernels: pallas (interpreted on CPU) with frozen leaves: the fused Adam runs over the trainable
    leaves' shards only and gives the XLA update's state; the frozen leaves stay as given."""
    params = h.mlp_params(0, divisible=True)
    batches = [h.make_batch(32, i) for i in range(2)]
    kw = dict(dtype="bf16", optimizer=ADAMW, model={"frozen": FROZEN})
    p_fused, fused, m_fused = h.train_steps(h.make_config(3, kernels="pallas", **kw), batches, params=params)
    p_xla, xla, m_xla = h.train_steps(h.make_config(3, kernels="xla", **kw), batches, params=params)
    assert p_fused.kernels == "interpret" and p_xla.kernels == "xla"
    h.assert_tree_close(h.to_numpy(fused.master), h.to_numpy(xla.master), rtol=1e-6, atol=1e-7, what="master")
    h.assert_tree_close(h.to_numpy(fused.opt_state), h.to_numpy(xla.opt_state), rtol=1e-5, atol=1e-9, what="moments")
    np.testing.assert_allclose([m["grad_norm"] for m in m_fused], [m["grad_norm"] for m in m_xla], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(fused.params["w_in"]), np.asarray(xla.params["w_in"]))


def test_nnx_lora_params_trained_by_variable_type_and_checkpoint_without_frozen(tmp_path: Path) -> None:
    """initialize(..., trainable=nnx.LoRAParam) on a from_nnx model at stage 3: only the adapters move and
    have master copies; exclude_frozen_parameters writes no frozen weight, and the tag loads back into an
    engine holding them (and is one clear error where none are given)."""
    from flax import nnx

    class Adapted(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.base = nnx.Linear(16, 8, rngs=rngs)
            self.lora = nnx.LoRA(16, 8, 8, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.base(x) + self.lora(x)

    def loss(model: Adapted, batch: Any) -> jax.Array:
        return jnp.mean((model(batch["x"]) - batch["y"][:, :1]) ** 2)

    config = {"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    params, loss_fn = zerojax.from_nnx(Adapted(nnx.Rngs(0)), loss)
    engine = zerojax.initialize(config, params=params, loss_fn=loss_fn, trainable=nnx.LoRAParam)
    assert engine.plan.trained_paths == ["['lora']['lora_a']", "['lora']['lora_b']"]
    for i in range(2):
        engine.train_batch(h.make_batch(16, i))
    assert engine.state.master["base"]["kernel"] is None
    assert engine.state.params["base"]["kernel"].sharding.spec[0] == "data"
    np.testing.assert_array_equal(np.asarray(engine.params["base"]["kernel"]),
                                  np.asarray(jnp.asarray(params["base"]["kernel"], jnp.bfloat16)))
    assert np.abs(np.asarray(engine.params["lora"]["lora_b"])).max() > 0  # zero at the start

    engine.save_checkpoint(str(tmp_path), "t", exclude_frozen_parameters=True)
    meta = zerojax.checkpoint.metadata(tmp_path, "t")
    assert meta["excluded"] == ["base.bias", "base.kernel"]
    assert not any(name.startswith("params.base") for name in meta["leaves"])
    want = h.to_numpy(engine.state)
    fresh = zerojax.initialize(config, params=params, loss_fn=loss_fn, trainable=nnx.LoRAParam)
    fresh.load_checkpoint(str(tmp_path), "t")
    h.assert_tree_close(h.to_numpy(fresh.state), want, rtol=0, atol=0, what="loaded")
    with pytest.raises(zerojax.checkpoint.CheckpointError, match="saved with exclude_frozen_parameters: it holds no "
                                                                 "base.bias, base.kernel"):
        load(tmp_path, "t", fresh.plan)
    with pytest.raises(ValueError, match="picks parameters by their NNX Variable class"):
        zerojax.plan(config, fresh.mesh, h.mlp_params(0), trainable=nnx.LoRAParam)
