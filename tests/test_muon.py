"""Muon (DeepSpeed's `optimizer.type: Muon`, MuonWithAuxAdam): against optax.contrib.muon where the two
define the same update, at ZeRO stages on the 8-device mesh against one device, and its config keys."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax.optim.deepspeed import make_optimizer
from zerojax.optim.schedules import make_schedule
from zerojax.optim.groups import muon_labels
from zerojax.optim.transforms import newton_schulz, scale_by_muon

sys.path.insert(0, str(Path(__file__).parent))
import helpers as h  # noqa: E402

# DeepSpeed's own example (docs/_pages/config-json.md), "standard" so optax's iteration is the same map.
MUON = {"type": "Muon", "params": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.1, "muon_lr": 0.02,
                                   "ns_method": "standard"}}


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {"w1": rng.normal(size=(6, 10)).astype(np.float32), "w2": rng.normal(size=(10, 4)).astype(np.float32),
            "b": rng.normal(size=(4,)).astype(np.float32)}


def _grads(seed: int) -> dict:
    return jax.tree.map(lambda x: np.random.default_rng(seed).normal(size=x.shape).astype(np.float32), _params())


def _run(tx: optax.GradientTransformation, params: dict, steps: int) -> dict:
    state = tx.init(params)
    for s in range(steps):
        updates, state = tx.update(_grads(s), state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_config_optimizer_equals_optax_contrib_muon_where_they_agree() -> None:
    """optax.contrib.muon (nesterov=False) is DeepSpeed's update at the first step (both orthogonalise a
    multiple of the gradient), and for the Adam leaves at every step; the Muon momentum itself agrees
    at every step once Nesterov is off in both (optax's bias correction is a scalar the Frobenius
    normalisation removes)."""
    cfg = zerojax.load_config({"train_batch_size": 8, "optimizer": {**MUON, "params": {
        **MUON["params"], "eps": 1e-7, "betas": [0.9, 0.999]}}})
    ours = make_optimizer(cfg.optimizer, make_schedule(None, 0.01).lr)
    theirs = optax.contrib.muon(0.02, beta=0.9, eps=1e-7, weight_decay=0.1, nesterov=False, adam_b1=0.9,
                                adam_b2=0.999, adam_weight_decay=0.1, adam_learning_rate=0.01)
    one = jax.tree.map(np.asarray, (_run(ours, _params(), 1), _run(theirs, _params(), 1)))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *one)
    three = (_run(ours, _params(), 3), _run(theirs, _params(), 3))
    np.testing.assert_allclose(three[0]["b"], three[1]["b"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(three[0]["w1"], three[1]["w1"], atol=1e-4)  # DeepSpeed's Nesterov differs

    mats = {k: v for k, v in _params().items() if k != "b"}
    ours_m = optax.chain(scale_by_muon(0.9, "standard", nesterov=False), optax.scale(-0.02))
    theirs_m = optax.contrib.muon(0.02, beta=0.9, eps=1e-7, nesterov=False)  # every leaf a matrix: all Muon
    state_a, state_b, pa, pb = ours_m.init(mats), theirs_m.init(mats), mats, mats
    for s in range(3):
        g = {k: _grads(s)[k] for k in mats}
        ua, state_a = ours_m.update(g, state_a, pa)
        ub, state_b = theirs_m.update(g, state_b, pb)
        pa, pb = optax.apply_updates(pa, ua), optax.apply_updates(pb, ub)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), pa, pb)


def test_gram_newton_schulz_is_the_standard_iteration() -> None:
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 20))
    for g in (x, jnp.swapaxes(x, -1, -2)):
        np.testing.assert_allclose(newton_schulz(g, 5, "gram"), newton_schulz(g, 5, "standard"), atol=1e-5)


def test_labels_follow_deepspeed_and_the_layer_axes() -> None:
    params = {"embed": {"embedding": np.zeros((9, 4))}, "blocks": {"w": np.zeros((2, 4, 4)), "b": np.zeros((2, 4))},
              "head": {"kernel": np.zeros((4, 9))}, "pos": np.zeros((5, 4))}
    got = muon_labels(params, {"embed": 0, "blocks": 1, "head": 0, "pos": 0})
    assert got == {"embed": {"embedding": "adam"}, "blocks": {"w": "muon", "b": "adam"},
                   "head": {"kernel": "adam"}, "pos": "adam"}


LAYER_AXES = {"layers": 1, "w_in": 0, "b_in": 0, "w_out": 0, "b_out": 0}


@functools.lru_cache(maxsize=None)
def _train(stage: int, n: int, steps: int = 3) -> tuple[dict, zerojax.Plan]:
    cfg = h.make_config(stage, optimizer={**MUON, "params": {**MUON["params"], "ns_method": "gram"}},
                        zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0,
                                           "save_muon_momentum_buffer_in_memory": True})
    params = h.mlp_params(0, divisible=True)
    p = zerojax.plan(cfg, h.data_mesh(n), params, layer_axes=LAYER_AXES)
    state = zerojax.init_state(cfg, p, params)
    step = zerojax.make_train_step(cfg, p, h.layerwise_loss)
    for s in range(steps):
        state, _ = step(state, h.make_batch(32, s))
    return h.to_numpy(state.params), p


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_stage_on_8_devices_trains_as_one_device(stage: int) -> None:
    want, _ = _train(0, 1)
    got, p = _train(stage, 8)
    h.assert_tree_close(got, want, rtol=2e-4, atol=2e-5)
    # memory: one fp32 momentum per Muon matrix, two moments per Adam leaf (fp32 run: no master copy)
    labels = muon_labels(h.mlp_params(0, divisible=True), LAYER_AXES)
    sizes = jax.tree.map(np.size, h.mlp_params(0, divisible=True))
    per_param = sum(4 * s if l == "muon" else 8 * s for s, l in zip(jax.tree.leaves(sizes), jax.tree.leaves(labels)))
    assert labels["layers"] == {"w": "muon", "b": "adam"} and labels["w_out"] == "muon"
    report = p.report()
    assert report.formula_optimizer == pytest.approx(per_param / (8 if stage else 1))
    assert report.optimizer - report.formula_optimizer < 64  # allocated: the same, plus the step counters
    assert p.opt_state_shardings.inner_state[0].momentum["b_in"] is None  # an Adam leaf keeps no momentum


def test_deepspeed_keys_load_and_a_bad_ns_method_is_one_error() -> None:
    raw = {"train_batch_size": 8, "optimizer": {"type": "Muon", "params": {
        "lr": 0.001, "momentum": 0.9, "weight_decay": 0.0, "muon_lr": 0.001, "ns_method": "gram"}},
        "zero_optimization": {"stage": 3, "save_muon_momentum_buffer_in_memory": True}}
    cfg = zerojax.load_config(raw)
    assert cfg.optimizer.type == "muon" and cfg.optimizer.params.muon_rate == 0.001
    assert cfg.optimizer.params.adam_rate == 0.001 and cfg.zero_optimization.save_muon_momentum_buffer_in_memory
    bad = {**raw, "optimizer": {"type": "Muon", "params": {"ns_method": "newton"}}}
    with pytest.raises(zerojax.ConfigError, match=r"^optimizer\.params\.ns_method: 'newton' is not one of gram, "
                                                  r"standard$"):
        zerojax.load_config(bad)


def test_estimate_counts_one_momentum_per_matrix_and_two_moments_for_the_rest() -> None:
    from zerojax.tools.estimate import embedded_model
    from zerojax.tools.estimate.axes import _role_bytes
    raw = {"train_batch_size": 8, "bf16": {"enabled": True}, "optimizer": {"type": "Muon", "params": {"lr": 1e-3}},
           "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16, "vocab_size": 64}}
    cfg = zerojax.load_config(raw)
    model = embedded_model(cfg)
    labels = muon_labels(model.abstract_params, {k: int(k == "blocks") for k in model.abstract_params})
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(model.abstract_params)]
    assert set(jax.tree.leaves(labels)) == {"muon", "adam"}
    state = sum(4 * s if l == "muon" else 8 * s for s, l in zip(sizes, jax.tree.leaves(labels)))
    assert _role_bytes(cfg, model)[0].optimizer == pytest.approx(4 + state / sum(sizes))  # + the fp32 master
    assert _role_bytes(zerojax.load_config({**raw, "optimizer": {"type": "AdamW"}}), model)[0].optimizer == 12


def test_stage_3_gathers_each_muon_matrix_once() -> None:
    """The replicated constraint around the iteration: Muon's extra traffic over AdamW is one fp32
    all-gather of its matrices (without it XLA splits every product and moves ~13x that)."""
    from zerojax.measure.hlo import collectives, summarize
    params = h.mlp_params(0, divisible=True)

    def sent(optimizer: dict) -> float:
        cfg = h.make_config(3, optimizer=optimizer)
        p = zerojax.plan(cfg, h.data_mesh(), params, layer_axes=LAYER_AXES)
        step = zerojax.make_train_step(cfg, p, h.layerwise_loss)
        text = step.lower(zerojax.init_state(cfg, p, params), h.make_batch(32, 0)).compile().as_text()
        return summarize(collectives(text))["bytes"]
    labels, sizes = jax.tree.leaves(muon_labels(params, LAYER_AXES)), [x.size for x in jax.tree.leaves(params)]
    muon_elements = sum(s for s, l in zip(sizes, labels) if l == "muon")
    extra = sent(MUON) - sent({"type": "AdamW", "params": {"lr": 0.01}})
    assert extra == pytest.approx(4 * muon_elements * 7 / 8)


def test_stage_3_checkpoint_resumes_on_another_mesh_size(tmp_path) -> None:
    """The momentum (and the Adam leaves' moments) are saved and read into another layout; an Adam leaf's
    empty momentum slot is no array to save."""
    raw = {"train_batch_size": 32, "gradient_clipping": 1.0, "optimizer": MUON,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

    def engine(n: int) -> zerojax.Engine:
        return zerojax.initialize(raw, params=h.mlp_params(0, divisible=True), loss_fn=h.layerwise_loss,
                                  mesh=h.data_mesh(n), layer_axes=LAYER_AXES)
    batch = lambda i: h.make_batch(32, i)  # noqa: E731
    src = h.save_and_go_on(engine(8), tmp_path, batch, saved_at=2, more=2)
    h.assert_resumes_like(engine(4), src, batch, saved_at=2, more=2)
