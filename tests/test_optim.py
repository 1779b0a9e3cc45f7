"""zerojax.optim.transforms against float64 numpy re-implementations of the torch / DeepSpeed updates.

Each reference is written from the source of the implementation DeepSpeed runs (FusedAdam's and
FusedLamb's CUDA kernels, FusedLion's kernel, torch.optim.Adagrad and torch.optim.SGD), one parameter
tensor at a time, in the form that source uses — not by composing optax pieces.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.config import load_config
from zerojax.errors import ConfigError
from zerojax.optim.deepspeed import has_betas, make_optimizer

STEPS = 4
Leaves = list[np.ndarray]


# ---------------------------------------------------------------------------------------------
# Fixtures: a small nested pytree, a gradient sequence, schedules.

def make_params(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"dense": {"w": rng.normal(size=(4, 3)).astype(np.float32),
                      "b": rng.normal(size=(3,)).astype(np.float32)},
            "scale": np.float32(rng.normal())}


def make_grads(params: Any, seed: int = 1, steps: int = STEPS) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [jax.tree.map(lambda p: rng.normal(size=np.shape(p)).astype(np.float32), params)
            for _ in range(steps)]


def rising_lr(count: jax.Array) -> jax.Array:
    """A different lr for every update, so using lr(k-1) or lr(k+1) would show."""
    return 1e-2 * (1.0 + count) ** 1.5


def lr_values(fn: Callable[[int], Any], steps: int = STEPS) -> list[float]:
    return [float(fn(k)) for k in range(steps)]


def optimizer_config(section: dict[str, Any]):
    return load_config({"train_batch_size": 8, "optimizer": section}).optimizer


def run(opt: optax.GradientTransformation, params: Any, grads_seq: Sequence[Any],
        jit: bool = False) -> tuple[Any, Any]:
    """Apply the updates one by one (eagerly by default: compiling every case would dominate)."""
    params = jax.tree.map(jnp.asarray, params)
    state = opt.init(params)

    def step(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    if jit:
        step = jax.jit(step)

    for grads in grads_seq:
        params, state = step(grads, state, params)
    return params, state


def leaves64(tree: Any) -> Leaves:
    return [np.asarray(x, dtype=np.float64) for x in jax.tree.leaves(tree)]


def assert_tree_close(got: Any, want_leaves: Leaves, rtol: float = 2e-5, atol: float = 1e-6) -> None:
    got_leaves = leaves64(got)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# Reference updates (float64, per tensor, in the source's own form).

def ref_adam(params: Any, grads_seq: Sequence[Any], lrs: Sequence[float], b1s: Sequence[float],
             b2: float, eps: float, wd: float, adamw: bool, bias_correction: bool) -> Leaves:
    """torch.optim.AdamW (decay first: p *= 1 - lr*wd) / torch.optim.Adam (g += wd*p)."""
    ps = leaves64(params)
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    for k, grads in enumerate(grads_seq):
        t, lr, b1 = k + 1, lrs[k], b1s[k]
        for i, g in enumerate(leaves64(grads)):
            if adamw:
                ps[i] = ps[i] * (1 - lr * wd)
            else:
                g = g + wd * ps[i]
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            bc1 = 1 - b1 ** t if bias_correction else 1.0
            bc2 = 1 - b2 ** t if bias_correction else 1.0
            denom = np.sqrt(vs[i]) / np.sqrt(bc2) + eps
            ps[i] = ps[i] - (lr / bc1) * ms[i] / denom
    return ps


def ref_lamb(params: Any, grads_seq: Sequence[Any], lrs: Sequence[float], b1s: Sequence[float],
             b2: float, eps: float, wd: float, bias_correction: bool, min_coeff: float,
             max_coeff: float) -> tuple[Leaves, list[list[float]]]:
    """FusedLamb's kernel (parts 1-3) per tensor; also returns every step's coefficients."""
    ps = leaves64(params)
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    coeffs = []
    for k, grads in enumerate(grads_seq):
        t, lr, b1 = k + 1, lrs[k], b1s[k]
        bc1 = 1 - b1 ** t if bias_correction else 1.0
        bc2 = 1 - b2 ** t if bias_correction else 1.0
        step_coeffs = []
        for i, g in enumerate(leaves64(grads)):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            update = (ms[i] / bc1) / (np.sqrt(vs[i] / bc2) + eps) + wd * ps[i]
            w_norm, u_norm = np.sqrt(np.sum(ps[i] ** 2)), np.sqrt(np.sum(update ** 2))
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = w_norm / u_norm
                if coeff > max_coeff:
                    coeff = max_coeff
                if coeff < min_coeff:
                    coeff = min_coeff
            step_coeffs.append(coeff)
            ps[i] = ps[i] - lr * coeff * update
        coeffs.append(step_coeffs)
    return ps, coeffs


def ref_lion(params: Any, grads_seq: Sequence[Any], lrs: Sequence[float], b1s: Sequence[float],
             b2: float, wd: float) -> Leaves:
    """FusedLion: p = p*(1 - lr*wd) + (c > 0 ? -lr : lr), c = b1*m + (1-b1)*g; then m's EMA."""
    ps = leaves64(params)
    ms = [np.zeros_like(p) for p in ps]
    for k, grads in enumerate(grads_seq):
        lr, b1 = lrs[k], b1s[k]
        for i, g in enumerate(leaves64(grads)):
            c = b1 * ms[i] + (1 - b1) * g
            assert np.all(c != 0)  # the kernels disagree at exactly 0; keep the data away from it
            ps[i] = ps[i] * (1 - lr * wd) + np.where(c > 0, -lr, lr)
            ms[i] = b2 * ms[i] + (1 - b2) * g
    return ps


def ref_adagrad(params: Any, grads_seq: Sequence[Any], lrs: Sequence[float], eps: float, wd: float,
                initial_accumulator_value: float) -> Leaves:
    """torch.optim.Adagrad._single_tensor_adagrad with lr_decay 0."""
    ps = leaves64(params)
    sums = [np.full_like(p, initial_accumulator_value) for p in ps]
    for k, grads in enumerate(grads_seq):
        for i, g in enumerate(leaves64(grads)):
            if wd != 0:
                g = g + wd * ps[i]
            sums[i] = sums[i] + g * g
            ps[i] = ps[i] - lrs[k] * g / (np.sqrt(sums[i]) + eps)
    return ps


def ref_sgd(params: Any, grads_seq: Sequence[Any], lrs: Sequence[float], momentum: float,
            dampening: float, wd: float, nesterov: bool) -> Leaves:
    """torch.optim.SGD._single_tensor_sgd."""
    ps = leaves64(params)
    bufs: list[np.ndarray | None] = [None] * len(ps)
    for k, grads in enumerate(grads_seq):
        for i, g in enumerate(leaves64(grads)):
            if wd != 0:
                g = g + wd * ps[i]
            if momentum != 0:
                if bufs[i] is None:
                    bufs[i] = g.copy()
                else:
                    bufs[i] = momentum * bufs[i] + (1 - dampening) * g
                g = g + momentum * bufs[i] if nesterov else bufs[i]
            ps[i] = ps[i] - lrs[k] * g
    return ps


# ---------------------------------------------------------------------------------------------
# Adam / AdamW.

@pytest.mark.parametrize("section, adamw", [
    ({"type": "Adam", "params": {"weight_decay": 0.1}}, True),                        # adam_w_mode default
    ({"type": "AdamW", "params": {"weight_decay": 0.1}}, True),
    ({"type": "Adam", "params": {"weight_decay": 0.1, "adam_w_mode": False}}, False),  # L2
    ({"type": "Adam", "params": {"weight_decay": 0.1, "adam_w_mode": 0}}, False),
    ({"type": "Adam", "params": {"betas": [0.8, 0.99], "eps": 1e-3}}, True),           # no decay
])
def test_adam_modes(section: dict, adamw: bool) -> None:
    cfg = optimizer_config(section)
    p = cfg.params
    params, grads = make_params(), make_grads(make_params())
    got, _ = run(make_optimizer(cfg, rising_lr), params, grads)
    want = ref_adam(params, grads, lr_values(rising_lr), [p.betas[0]] * STEPS, p.betas[1], p.eps,
                    p.weight_decay, adamw, bias_correction=True)
    assert_tree_close(got, want)


def test_adamw_and_l2_differ() -> None:
    """The mode switch must change the result (guards against both paths collapsing into one)."""
    params, grads = make_params(), make_grads(make_params())
    lr = optax.constant_schedule(0.05)
    w, _ = run(make_optimizer(optimizer_config({"type": "Adam", "params": {"weight_decay": 0.5}}), lr),
               params, grads)
    l2, _ = run(make_optimizer(optimizer_config(
        {"type": "Adam", "params": {"weight_decay": 0.5, "adam_w_mode": False}}), lr), params, grads)
    assert not np.allclose(leaves64(w)[0], leaves64(l2)[0], rtol=1e-4)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_without_bias_correction(adam_w_mode: bool) -> None:
    cfg = optimizer_config({"type": "Adam", "params": {"bias_correction": False, "weight_decay": 0.05,
                                                        "adam_w_mode": adam_w_mode}})
    params, grads = make_params(), make_grads(make_params())
    got, _ = run(make_optimizer(cfg, rising_lr), params, grads)
    want = ref_adam(params, grads, lr_values(rising_lr), [0.9] * STEPS, 0.999, 1e-8, 0.05, adam_w_mode,
                    bias_correction=False)
    assert_tree_close(got, want)


@pytest.mark.parametrize("params_section, weight_decay", [({}, 0.0), ({"torch_adam": True}, 0.01)])
def test_adam_default_weight_decay(params_section: dict, weight_decay: float) -> None:
    """FusedAdam defaults to no decay; torch_adam selects torch.optim.AdamW and its 0.01."""
    cfg = optimizer_config({"type": "Adam", "params": params_section})
    assert cfg.params.weight_decay == weight_decay
    params, grads = make_params(), make_grads(make_params())
    lr = optax.constant_schedule(0.5)  # large, so a 0.01 decay is well above float32 noise
    got, _ = run(make_optimizer(cfg, lr), params, grads)
    want = ref_adam(params, grads, [0.5] * STEPS, [0.9] * STEPS, 0.999, 1e-8, weight_decay, True, True)
    assert_tree_close(got, want)


def test_adam_beta_schedules() -> None:
    """A cycled beta1 (and OneCycle's beta2) replace the configured betas, bias correction included."""
    cfg = optimizer_config({"type": "Adam", "params": {"betas": [0.5, 0.5], "weight_decay": 0.1}})
    beta1 = lambda count: 0.95 - 0.05 * count  # noqa: E731
    beta2 = optax.constant_schedule(0.99)
    params, grads = make_params(), make_grads(make_params())
    got, state = run(make_optimizer(cfg, rising_lr, beta1=beta1, beta2=beta2), params, grads)
    want = ref_adam(params, grads, lr_values(rising_lr), lr_values(beta1), 0.99, 1e-8, 0.1, True, True)
    assert_tree_close(got, want)
    np.testing.assert_allclose(float(state.hyperparams["b1"]), beta1(STEPS - 1), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Lamb.

def test_lamb_clamps_both_bounds() -> None:
    """Huge weights hit max_coeff, tiny ones min_coeff, an all-zero tensor gets 1, others in between."""
    rng = np.random.default_rng(3)
    params = {"huge": np.full((4, 3), 100.0, np.float32), "tiny": np.full((3,), 1e-6, np.float32),
              "zero": np.float32(0.0), "mid": rng.normal(size=(4, 3)).astype(np.float32)}
    grads = make_grads(params, seed=4)
    cfg = optimizer_config({"type": "Lamb", "params": {}})
    got, _ = run(make_optimizer(cfg, rising_lr), params, grads)
    want, coeffs = ref_lamb(params, grads, lr_values(rising_lr), [0.9] * STEPS, 0.999, 1e-8, 0.0, True,
                            0.01, 10.0)
    assert_tree_close(got, want)
    order = jax.tree.leaves({k: k for k in params})  # leaf order of the dict
    first = dict(zip(order, coeffs[0]))
    assert first["huge"] == 10.0 and first["tiny"] == 0.01 and first["zero"] == 1.0
    assert 0.01 < first["mid"] < 10.0


@pytest.mark.parametrize("section", [
    {"weight_decay": 0.1, "max_coeff": 0.5, "min_coeff": 0.2},
    {"weight_decay": 0.01, "bias_correction": False, "betas": [0.8, 0.95], "eps": 1e-6},
])
def test_lamb_weight_decay_and_options(section: dict) -> None:
    cfg = optimizer_config({"type": "lamb", "params": section})
    p = cfg.params
    params, grads = make_params(), make_grads(make_params())
    got, _ = run(make_optimizer(cfg, rising_lr), params, grads)
    want, _ = ref_lamb(params, grads, lr_values(rising_lr), [p.betas[0]] * STEPS, p.betas[1], p.eps,
                       p.weight_decay, p.bias_correction, p.min_coeff, p.max_coeff)
    assert_tree_close(got, want)


def test_lamb_beta1_schedule() -> None:
    cfg = optimizer_config({"type": "Lamb", "params": {"weight_decay": 0.05}})
    beta1 = lambda count: 0.85 + 0.02 * count  # noqa: E731
    params, grads = make_params(), make_grads(make_params())
    got, _ = run(make_optimizer(cfg, rising_lr, beta1=beta1), params, grads)
    want, _ = ref_lamb(params, grads, lr_values(rising_lr), lr_values(beta1), 0.999, 1e-8, 0.05, True,
                       0.01, 10.0)
    assert_tree_close(got, want)


def test_lamb_rejects_max_grad_norm() -> None:
    with pytest.raises(ConfigError, match="gradient_clipping"):
        optimizer_config({"type": "Lamb", "params": {"max_grad_norm": 1.0}})


# ---------------------------------------------------------------------------------------------
# Lion, Adagrad, SGD.

@pytest.mark.parametrize("section", [{}, {"weight_decay": 0.3, "betas": [0.8, 0.9]}])
def test_lion(section: dict) -> None:
    cfg = optimizer_config({"type": "Lion", "params": section})
    p = cfg.params
    params, grads = make_params(), make_grads(make_params())
    got, _ = run(make_optimizer(cfg, rising_lr), params, grads)
    want = ref_lion(params, grads, lr_values(rising_lr), [p.betas[0]] * STEPS, p.betas[1], p.weight_decay)
    assert_tree_close(got, want)


def test_lion_beta1_schedule() -> None:
    cfg = optimizer_config({"type": "Lion", "params": {"weight_decay": 0.1}})
    beta1 = lambda count: 0.7 + 0.05 * count  # noqa: E731
    params, grads = make_params(), make_grads(make_params())
    got, _ = run(make_optimizer(cfg, rising_lr, beta1=beta1), params, grads)
    want = ref_lion(params, grads, lr_values(rising_lr), lr_values(beta1), 0.99, 0.1)
    assert_tree_close(got, want)


@pytest.mark.parametrize("section", [
    {}, {"weight_decay": 0.2}, {"initial_accumulator_value": 0.5, "eps": 1e-3, "weight_decay": 0.1},
])
def test_adagrad(section: dict) -> None:
    cfg = optimizer_config({"type": "Adagrad", "params": section})
    p = cfg.params
    params, grads = make_params(), make_grads(make_params())
    got, _ = run(make_optimizer(cfg, rising_lr), params, grads)
    want = ref_adagrad(params, grads, lr_values(rising_lr), p.eps, p.weight_decay,
                       p.initial_accumulator_value)
    assert_tree_close(got, want)


@pytest.mark.parametrize("section", [
    {},
    {"weight_decay": 0.1},
    {"momentum": 0.9},
    {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.05},
    {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05},
    {"momentum": 0.0, "dampening": 0.5},  # torch ignores dampening without momentum
])
def test_sgd(section: dict) -> None:
    cfg = optimizer_config({"type": "SGD", "params": section})
    p = cfg.params
    params, grads = make_params(), make_grads(make_params())
    got, _ = run(make_optimizer(cfg, rising_lr), params, grads)
    want = ref_sgd(params, grads, lr_values(rising_lr), p.momentum, p.dampening, p.weight_decay, p.nesterov)
    assert_tree_close(got, want)


@pytest.mark.parametrize("section", [{"nesterov": True}, {"nesterov": True, "momentum": 0.9,
                                                          "dampening": 0.1}])
def test_sgd_rejects_invalid_nesterov(section: dict) -> None:
    with pytest.raises(ConfigError, match="nesterov"):
        optimizer_config({"type": "SGD", "params": section})


@pytest.mark.parametrize("kind", ["SGD", "Adagrad"])
def test_momentum_schedule_ignored_without_betas(kind: str) -> None:
    """DeepSpeed's OneCycle stops cycling momentum for optimizers without betas."""
    cfg = optimizer_config({"type": kind, "params": {"momentum": 0.9} if kind == "SGD" else {}})
    assert not has_betas(cfg.type) and has_betas("AdamW")
    params, grads = make_params(), make_grads(make_params())
    plain, _ = run(make_optimizer(cfg, rising_lr), params, grads)
    cycled, _ = run(make_optimizer(cfg, rising_lr, beta1=lambda c: 0.5 + 0.0 * c), params, grads)
    assert_tree_close(cycled, leaves64(plain), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Schedules and sharding.

def test_kth_update_uses_lr_of_k() -> None:
    """Plain SGD makes each step's change exactly -lr(k) * g_k; the state records the lr used."""
    cfg = optimizer_config({"type": "SGD", "params": {"lr": 123.0}})  # params.lr is not used
    opt = make_optimizer(cfg, rising_lr)
    params = jax.tree.map(jnp.asarray, make_params())
    grads_seq = make_grads(params)
    state = opt.init(params)
    for k, grads in enumerate(grads_seq):
        updates, state = opt.update(grads, state, params)
        assert_tree_close(updates, [-float(rising_lr(k)) * g for g in leaves64(grads)], rtol=1e-6)
        np.testing.assert_allclose(float(state.hyperparams["learning_rate"]), float(rising_lr(k)), rtol=1e-6)
        params = optax.apply_updates(params, updates)


# Adam (moments + decay), Lamb (per-tensor norms across shards), SGD (a count-gated buffer); the
# others are the same elementwise patterns, and each compile costs about a second.
SHARDED_CONFIGS = [
    {"type": "AdamW", "params": {"weight_decay": 0.1}},
    {"type": "Lamb", "params": {"weight_decay": 0.01}},
    {"type": "SGD", "params": {"momentum": 0.9, "nesterov": True}},
]


@pytest.mark.parametrize("section", SHARDED_CONFIGS, ids=lambda s: s["type"])
def test_sharded_matches_unsharded(section: dict) -> None:
    """ZeRO-style: params and state sharded over 8 devices; same numbers, shardings kept."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rng = np.random.default_rng(5)
    params = {"w": rng.normal(size=(16, 4)).astype(np.float32), "b": rng.normal(size=(8,)).astype(np.float32),
              "s": np.float32(0.5)}
    specs = {"w": P("data", None), "b": P("data"), "s": P()}
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    grads_seq = make_grads(params, seed=6, steps=3)
    opt = make_optimizer(optimizer_config(section), rising_lr)

    want, _ = run(opt, params, grads_seq)

    sharded = jax.device_put(params, shardings)
    state = jax.jit(opt.init)(sharded)

    @jax.jit
    def step(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for grads in grads_seq:
        sharded, state = step(jax.device_put(grads, shardings), state, sharded)
    assert_tree_close(sharded, leaves64(want), rtol=1e-5, atol=1e-6)
    for k, arr in sharded.items():
        assert arr.sharding.is_equivalent_to(shardings[k], arr.ndim), k


# ---------------------------------------------------------------------------------------------
# No optimizer section: the optimizer passed in code trains, as DeepSpeed's client optimizer does.

def _client_setup():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    import helpers
    return helpers


# accelerate / transformers write no optimizer section: the Trainer passes its own optimizer.
NO_OPTIMIZER = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
                "zero_optimization": {"stage": 2, "_comment": "optimizer comes from the training script"}}


def test_no_optimizer_section_and_no_optimizer_is_one_clear_error() -> None:
    import zerojax
    h = _client_setup()
    with pytest.raises(ConfigError, match=(r"^optimizer: the config has no optimizer section and no optimizer "
                                           r"was passed in code\. DeepSpeed .*optimizer=optax\.adamw\(3e-4\)")):
        zerojax.initialize(NO_OPTIMIZER, params=h.mlp_params(0), loss_fn=h.mse_loss, mesh=h.data_mesh())
    with pytest.raises(ConfigError, match=r"^optimizer: the config has no optimizer section"):
        zerojax.plan(load_config(NO_OPTIMIZER), h.data_mesh(), h.mlp_params(0))


def _reference(tx: optax.GradientTransformation, params: Any, batches: list, loss_fn: Any) -> Any:
    """Single-device training with `tx` (fp32, no clipping): the parameters after each step."""
    state, out = tx.init(params), []
    params = jax.tree.map(jnp.asarray, params)
    for b in batches:
        grads = jax.grad(loss_fn)(params, b)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append(params)
    return params


@pytest.mark.parametrize("stage", [1, 3])
def test_user_optax_optimizer_trains_and_owns_the_optimizer_state(stage: int) -> None:
    import zerojax
    h = _client_setup()
    raw = {**NO_OPTIMIZER, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    tx = optax.chain(optax.clip_by_global_norm(10.0), optax.adamw(3e-3, b1=0.8, weight_decay=0.05))
    batches = [h.make_batch(16, s) for s in range(3)]
    engine = zerojax.initialize(raw, params=h.mlp_params(0), loss_fn=h.layerwise_loss, mesh=h.data_mesh(),
                                optimizer=tx)
    for b in batches:
        engine.train_batch(b)
    # the optimizer state is the user's: optax's own structure, partitioned as the stage says
    want_state = tx.init(jax.tree.map(jnp.asarray, h.mlp_params(0)))
    assert jax.tree.structure(engine.state.opt_state) == jax.tree.structure(want_state)
    assert engine.plan.tx is tx and engine.plan.rule.adam is None and engine.config.optimizer is None
    mu = engine.state.opt_state[1][0].mu["layers"]["w"]
    assert mu.sharding.spec != P() or stage == 0  # partitioned over data, not replicated
    # and it trains exactly as the same optax optimizer on one device
    want = _reference(tx, h.mlp_params(0), batches, h.mse_loss)
    h.assert_tree_close(h.to_numpy(engine.params), h.to_numpy(want), rtol=2e-5, atol=2e-6)
    assert np.isnan(engine.get_lr()[0])  # a built transformation keeps its lr to itself


def test_user_optimizer_factory_follows_lr_scheduler_and_the_config_scheduler() -> None:
    import functools
    import zerojax
    h = _client_setup()
    factory = functools.partial(optax.adamw, weight_decay=0.01)
    sched = optax.linear_schedule(1e-2, 1e-3, 3)
    batches = [h.make_batch(16, s) for s in range(3)]
    engine = zerojax.initialize(NO_OPTIMIZER, params=h.mlp_params(0), loss_fn=h.mse_loss, mesh=h.data_mesh(),
                                optimizer=factory, lr_scheduler=sched)
    lrs = [float(engine.train_batch(b)["lr"]) for b in batches]
    np.testing.assert_allclose(lrs, [float(sched(i)) for i in range(3)], rtol=1e-6)
    want = _reference(factory(sched), h.mlp_params(0), batches, h.mse_loss)
    h.assert_tree_close(h.to_numpy(engine.params), h.to_numpy(want), rtol=2e-5, atol=2e-6)
    # DeepSpeed drives a client optimizer with the config's scheduler section too
    with_section = {**NO_OPTIMIZER, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2, "total_num_steps": 10,
        "warmup_type": "linear"}}}
    engine = zerojax.initialize(with_section, params=h.mlp_params(0), loss_fn=h.mse_loss, mesh=h.data_mesh(),
                                optimizer=optax.adamw)
    lrs = [float(engine.train_batch(b)["lr"]) for b in batches]
    from zerojax.optim.schedules import make_schedule
    want_lrs = make_schedule(load_config(with_section).scheduler, 1.0).lr
    np.testing.assert_allclose(lrs, [float(want_lrs(i)) for i in range(3)], rtol=1e-6)
    assert lrs[2] > 0


@pytest.mark.parametrize("kwargs, raw, pattern", [
    ({"optimizer": optax.adamw(1e-3), "lr_scheduler": optax.constant_schedule(1e-3)}, {},
     r"^optimizer: a built optax transformation cannot be driven by the lr_scheduler=; pass a factory"),
    ({"optimizer": optax.sgd(1e-3)}, {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}}},
     r"^optimizer: a built optax transformation cannot be driven by the scheduler section \(WarmupLR\)"),
    ({"optimizer": optax.adamw}, {}, r"^optimizer: a factory needs a learning rate: pass lr_scheduler="),
    ({"optimizer": optax.adamw}, {"scheduler": {"type": "WarmupLR"}},
     r"^scheduler\.params\.warmup_max_lr: required when the optimizer is passed in code"),
    ({"optimizer": optax.adamw}, {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9}}},
     r"^scheduler\.type: WarmupCosineLR scales the optimizer's lr"),
    ({"lr_scheduler": optax.constant_schedule(1e-3)}, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
     r"^lr_scheduler: given without optimizer="),
])
def test_user_optimizer_mistakes_are_clear_errors(kwargs: dict, raw: dict, pattern: str) -> None:
    import zerojax
    h = _client_setup()
    with pytest.raises(ConfigError, match=pattern):
        zerojax.plan(load_config({**NO_OPTIMIZER, **raw}), h.data_mesh(), h.mlp_params(0), **kwargs)


def test_user_optimizer_checkpoint_resumes_exactly(tmp_path) -> None:
    import zerojax
    h = _client_setup()
    tx = optax.adamw(3e-3, weight_decay=0.05)
    batches = [h.make_batch(16, s) for s in range(4)]

    def engine() -> Any:
        return zerojax.initialize(NO_OPTIMIZER, params=h.mlp_params(0), loss_fn=h.mse_loss, mesh=h.data_mesh(),
                                  optimizer=tx)
    straight = engine()
    for b in batches:
        straight.train_batch(b)
    first = engine()
    for b in batches[:2]:
        first.train_batch(b)
    first.save_checkpoint(str(tmp_path), async_save=False)
    resumed = engine()
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.global_steps == 2
    for b in batches[2:]:
        resumed.train_batch(b)
    h.assert_tree_close(h.to_numpy(resumed.state.opt_state), h.to_numpy(straight.state.opt_state), rtol=0, atol=0)
    h.assert_tree_close(h.to_numpy(resumed.params), h.to_numpy(straight.params), rtol=0, atol=0)


def test_library_path_takes_the_optimizer_at_plan() -> None:
    """plan(optimizer=...) builds the update rule that init_state and make_train_step share."""
    import zerojax
    h = _client_setup()
    config = load_config(NO_OPTIMIZER)
    tx = optax.sgd(0.05, momentum=0.9)
    p = zerojax.plan(config, h.data_mesh(), h.mlp_params(0), optimizer=tx)
    state = zerojax.init_state(config, p, h.mlp_params(0))
    step = zerojax.make_train_step(config, p, h.mse_loss)
    batches = [h.make_batch(16, s) for s in range(2)]
    for b in batches:
        state, _ = step(state, b)
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(tx.init(h.mlp_params(0)))
    want = _reference(tx, h.mlp_params(0), batches, h.mse_loss)
    h.assert_tree_close(h.to_numpy(state.params), h.to_numpy(want), rtol=2e-5, atol=2e-6)


FIXTURES = __import__("pathlib").Path(__file__).resolve().parent / "fixtures" / "ds_configs"


@pytest.mark.parametrize("name, sets, optimizer", [
    ("deepspeed_examples_zero3.json", [], None),
    ("accelerate_zero2_offload.json", [], "adamw"),
    ("llama_factory_ds_z3_config.json", ["fp16.enabled=false", "bf16.enabled=true",
                                         "train_micro_batch_size_per_gpu=2"], "adamw"),
    ("transformers_zero2_auto.json", ["train_micro_batch_size_per_gpu=2", "fp16.enabled=false",
                                      "optimizer.params.lr=1e-3", "optimizer.params.betas=[0.9,0.999]",
                                      "optimizer.params.eps=1e-8", "optimizer.params.weight_decay=0.0",
                                      "scheduler.params.warmup_num_steps=2"], None),
])
def test_real_project_configs_train(name: str, sets: list[str], optimizer: str | None) -> None:
    """Each file as its project writes it; the Trainer-only "auto"s set on the side, the optimizer
    passed in code where the file has none, as the Trainer passes its own."""
    import warnings
    import zerojax
    h = _client_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zerojax.config.ConfigWarning)
        config = load_config(FIXTURES / name, sets, hidden_size=32)
    tx = optax.adamw(1e-3) if optimizer else None
    engine = zerojax.initialize(config, params=h.mlp_params(0), loss_fn=h.layerwise_loss, mesh=h.data_mesh(),
                                optimizer=tx)
    rows = engine.train_batch_size()
    losses = [float(engine.train_batch(h.make_batch(rows, s))["loss"]) for s in range(2)]
    assert all(np.isfinite(losses)) and engine.global_steps == 2


@pytest.mark.parametrize("kind", ["AdamW", "Lamb", "Adagrad", "Muon"])
def test_a_skipped_update_keeps_the_buffers_and_an_applied_one_is_unchanged(kind: str) -> None:
    """Told through optax's extra arguments that the step may be skipped (`transforms.SKIP`), each
    of DeepSpeed's optimizers keeps its buffers itself where it is, and computes exactly what it
    computes untold where it is not; `Keep.select` leaves the buffers it kept alone."""
    from zerojax.optim.transforms import SKIP, Keep
    params = {"lr": 1e-2, "momentum": 0.9} if kind == "Muon" else {"lr": 1e-2}
    tx = make_optimizer(load_config({"train_batch_size": 8, "optimizer": {"type": kind, "params": params}}).optimizer,
                        lambda count: jnp.float32(1e-2))
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}
    g = jax.tree.map(lambda x: x * 0.5 + 0.1, p)
    state = tx.update(g, tx.init(p), p)[1]  # non-zero buffers
    plain = tx.update(g, state, p)
    leaves = lambda t: [np.asarray(x) for x in jax.tree.leaves(t)]  # noqa: E731

    applied = tx.update(g, state, p, **{SKIP: Keep(jnp.bool_(False))})
    assert all(np.array_equal(a, b) for a, b in zip(leaves(applied), leaves(plain)))

    keep = Keep(jnp.bool_(True))
    _, skipped = tx.update(g, state, p, **{SKIP: keep})
    kept = keep.select(state, skipped)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(kept), leaves(state)))
    # the buffers came back kept by the transformation itself, not by the select
    buffers = [x for x in jax.tree.leaves(skipped) if x.size > 1]
    assert buffers and all(x is y for x, y in zip(jax.tree.leaves(kept), jax.tree.leaves(skipped)) if x.size > 1)
