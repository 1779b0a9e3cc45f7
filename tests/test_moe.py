"""The mixture-of-experts layer against DeepSpeed's gating rules, and the MoE Llama under ZeRO."""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from helpers import assert_tree_close, data_mesh, to_numpy
from test_cli import run
from zerojax.models import llama, moe
from zerojax.models.nnx import to_nnx
from zerojax.planner.mesh import make_mesh

S, E = 32, 4


def logits(seed: int = 0) -> np.ndarray:
    """Router logits with a favoured expert, so that some experts overflow their capacity."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(S, E)) * 1.5 + np.array([1.0, 0.3, 0.0, -0.5])).astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    p = np.exp(x - x.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def ds_capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    # DeepSpeed: ceil((tokens / experts) * torch.tensor(factor)), a float32 product
    return max(int(np.ceil(np.float32(tokens / experts) * np.float32(factor))), min_capacity)


def reference_top1(x: np.ndarray, factor: float, min_capacity: int, drop: bool) -> dict:
    """DeepSpeed's top1gating without noise or RTS, token by token: each expert keeps its first tokens."""
    gates = softmax(x)
    n = len(x)
    first = gates.argmax(1)
    counts = np.bincount(first, minlength=E)
    cap = ds_capacity(n, E, factor, min_capacity) if drop else min(counts.max(), n)
    l_aux = np.sum(gates.mean(0) * np.bincount(first, minlength=E) / n) * E
    combine = np.zeros((n, E, cap))
    used = np.zeros(E, int)
    for s in range(n):
        e = first[s]
        if used[e] < cap:
            combine[s, e, used[e]] = gates[s, e]
            used[e] += 1
    return dict(combine=combine, l_aux=l_aux, counts=counts, kept=used, capacity=cap)


def reference_top2(x: np.ndarray, factor: float, min_capacity: int, drop: bool) -> dict:
    """DeepSpeed's top2gating without sampling: every first choice takes its slot before any second
    choice; the kept gates renormalized to one."""
    gates = softmax(x)
    n = len(x)
    first = gates.argmax(1)
    second = np.where(np.eye(E, dtype=bool)[first], -np.inf, x).argmax(1)
    counts = np.bincount(first, minlength=E) + np.bincount(second, minlength=E)
    cap = ds_capacity(n, E, 2 * factor, min_capacity) if drop else counts.max()
    l_aux = np.mean(gates.mean(0) * np.bincount(first, minlength=E) / n) * E * E
    slot = {}
    used = np.zeros(E, int)
    for choice in (first, second):
        for s in range(n):
            e = choice[s]
            if used[e] < cap:
                slot[s, e] = used[e]
            used[e] += 1
    combine = np.zeros((n, E, cap))
    for s in range(n):
        kept = [e for e in (first[s], second[s]) if (s, e) in slot]
        denom = max(sum(gates[s, e] for e in kept), np.finfo(np.float32).eps)
        for e in kept:
            combine[s, e, slot[s, e]] = gates[s, e] / denom
    return dict(combine=combine, l_aux=l_aux, counts=counts, kept=(combine > 0).sum((0, 2)), capacity=cap)


def assert_gating_is(got: moe.Gating, want: dict) -> tuple[int, np.ndarray, np.ndarray]:
    """The gate's counts, l_aux, combine weights, dispatch mask and kept tokens per expert are the
    reference's; returns (capacity, combine weights, kept tokens per expert) for the caller's checks."""
    cap = want["capacity"]
    combine = np.asarray(got.combine, np.float64)
    np.testing.assert_array_equal(np.asarray(got.exp_counts), want["counts"])
    np.testing.assert_allclose(float(got.l_aux), want["l_aux"], rtol=1e-6)
    assert not combine[:, :, cap:].any()  # past the capacity (without dropping the buffer holds every token) nothing
    np.testing.assert_allclose(combine[:, :, :cap], want["combine"], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got.dispatch)[:, :, :cap], want["combine"] > 0)
    kept = np.asarray(got.dispatch).sum((0, 2))
    np.testing.assert_array_equal(kept, want["kept"])
    return cap, combine, kept


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop", [True, False])
def test_gating_matches_deepspeeds_rules(k: int, drop: bool) -> None:
    x = logits(k)
    gate = moe.top1_gating if k == 1 else moe.top2_gating
    want = (reference_top1 if k == 1 else reference_top2)(x, 1.0, 4, drop)
    got = jax.jit(lambda l: gate(l, 1.0, 4, drop_tokens=drop))(jnp.asarray(x))
    cap, combine, kept = assert_gating_is(got, want)
    if drop:
        assert combine.shape[2] == cap and kept.max() == cap and kept.sum() < k * S  # some tokens were dropped
        assert cap == (8 if k == 1 else 16)
    else:
        assert kept.sum() == k * S and cap == want["counts"].max()


K_E = 6  # top-k's tests: 3 of 6 experts, so a token's three experts are a real choice


def topk_logits(seed: int = 0) -> np.ndarray:
    """Router logits [S, 6] with favoured experts that overflow; float32, as the gate receives them."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(S, K_E)) * 1.5 + np.array([1.5, 0.8, 0.3, 0.0, -0.5, -1.0])).astype(np.float32)


def reference_topk(x: np.ndarray, k: int, factor: float, min_capacity: int, drop: bool, policy: str) -> dict:
    """DeepSpeed's topkgating, route by route: each token's k most probable experts; an over-full expert
    keeps its first routes (position) or the routes of largest softmax probability (probs); the kept
    tokens take an expert's slots in token order; each token's kept probabilities renormalized to one."""
    gates = softmax(x)
    n, e = x.shape
    routes = [sorted(np.argsort(-gates[s])[:k]) for s in range(n)]
    counts = np.bincount(np.concatenate(routes), minlength=e)
    ce = counts / n  # every route counts, before any drop
    l_aux = np.mean(gates.mean(0) * ce) * e * e / k
    cap = ds_capacity(n, e, k * factor, min_capacity) if drop else counts.max()
    kept = {(s, j) for s in range(n) for j in routes[s]}
    if drop:
        for j in range(e):
            mine = [s for s in range(n) if j in routes[s]]
            if policy == "probs":
                mine = sorted(mine, key=lambda s: -gates[s, j])
            kept -= {(s, j) for s in mine[cap:]}
    combine = np.zeros((n, e, cap))
    used = np.zeros(e, int)
    for s in range(n):
        mine = [j for j in routes[s] if (s, j) in kept]
        denom = max(sum(gates[s, j] for j in mine), np.finfo(np.float32).eps)
        for j in mine:
            combine[s, j, used[j]] = gates[s, j] / denom
            used[j] += 1
    return dict(combine=combine, l_aux=l_aux, counts=counts, kept=used, capacity=cap)


@pytest.mark.parametrize("k, drop, policy", [(3, True, "probs"), (3, True, "position"), (3, False, "probs"),
                                             (1, True, "probs"), (1, False, "probs")])
def test_topk_gating_matches_deepspeeds_rules(k: int, drop: bool, policy: str) -> None:
    x = topk_logits(k)
    want = reference_topk(x, k, 1.0, 4, drop, policy)
    got = jax.jit(lambda l: moe.topk_gating(l, k, 1.0, 4, drop_tokens=drop, drop_policy=policy))(jnp.asarray(x))
    cap, combine, kept = assert_gating_is(got, want)
    np.testing.assert_allclose(combine.sum((1, 2))[combine.any((1, 2))], 1.0, rtol=1e-6)  # renormalized
    if drop:
        assert combine.shape[2] == cap == (16 if k == 3 else 6) and kept.max() == cap and kept.sum() < k * S
    else:
        assert kept.sum() == k * S and cap == want["counts"].max()


def test_topk_drop_policies_keep_different_tokens() -> None:
    """On the same logits "probs" keeps an over-full expert's most probable tokens, "position" its first."""
    x = jnp.asarray(topk_logits(3))
    probs, first = (moe.topk_gating(x, 3, 1.0, 4, drop_policy=p).dispatch.any(2) for p in ("probs", "position"))
    assert (np.asarray(probs) != np.asarray(first)).any()
    gates = softmax(np.asarray(x))
    busy = int(np.asarray(first).sum(0).argmax())
    assert gates[np.asarray(probs)[:, busy], busy].min() >= gates[np.asarray(first)[:, busy], busy].min()
    with pytest.raises(ValueError, match="drop_policy 'random'"):
        moe.topk_gating(x, 3, 1.0, 4, drop_policy="random")


def test_capacity_rounds_like_deepspeed() -> None:
    assert moe.capacity(10, 1, 1.2, 0) == 12  # float32: 10 * 1.2f ties to 12; float64 would give 13
    assert moe.capacity(64, 8, 1.25, 4) == 10
    assert moe.capacity(16, 8, 1.0, 4) == 4  # min_capacity


def test_random_token_selection_keeps_a_random_subset() -> None:
    x = jnp.asarray(logits(1))
    plain = moe.top1_gating(x, 1.0, 4)
    rts = moe.top1_gating(x, 1.0, 4, rts_key=jax.random.key(0))
    d0, d1 = np.asarray(plain.dispatch).any(2), np.asarray(rts.dispatch).any(2)
    counts = np.asarray(plain.exp_counts)
    np.testing.assert_array_equal(d1.sum(0), np.minimum(counts, 8))  # as many kept per expert
    routed = np.eye(E, dtype=bool)[np.asarray(softmax(logits(1))).argmax(1)]
    assert not (d1 & ~routed).any() and (d0 != d1).any()  # only routed tokens, not the first ones
    loc = np.asarray(rts.dispatch).argmax(2)
    for e in range(E):  # slots are still taken in token order
        assert list(loc[d1[:, e], e]) == list(range(d1[:, e].sum()))


@pytest.mark.parametrize("k, gating", [(2, "auto"), (3, "auto"), (1, "topk")])
def test_layer_output_is_the_gated_sum_of_experts(k: int, gating: str) -> None:
    """The layer gates with DeepSpeed's TopKGate choice (top-2; top-k from 3) or, with gating="topk",
    with topkgating for any k (at k = 1 a kept token's weight is 1)."""
    layer = moe.MoE(16, 24, E, k=k, capacity_factor=0.5, min_capacity=2, use_residual=True, gating=gating,
                    rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (2, 8, 16))
    out, l_aux, counts = layer(x)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
    t = np.asarray(x, np.float64).reshape(-1, 16)
    router = t @ p["router"]["kernel"]  # S = 16 tokens
    g = reference_top2(router, 0.5, 2, True) if k == 2 else reference_topk(router, k, 0.5, 2, True, "probs")
    ex = p["experts"]

    def swiglu(v: np.ndarray, gw: np.ndarray, uw: np.ndarray, dw: np.ndarray) -> np.ndarray:
        a = v @ gw
        return (a / (1 + np.exp(-a)) * (v @ uw)) @ dw

    w = g["combine"].sum(2)  # [S, E]: each token's weight on each expert
    y = sum(w[:, e:e + 1] * swiglu(t, ex["gate"][e], ex["up"][e], ex["down"][e]) for e in range(E))
    c = softmax(t @ p["coefficient"]["kernel"] + p["coefficient"]["bias"])
    m = p["mlp"]
    y = y * c[:, :1] + swiglu(t, m["gate"]["kernel"], m["up"]["kernel"], m["down"]["kernel"]) * c[:, 1:]
    assert (w > 0).sum() < k * 16  # capacity 2 (top-1), 4 (top-2), 6 (top-3) per expert: some choices dropped
    if k == 1:
        assert set(np.unique(w)) == {0.0, 1.0}  # the top-k gate's renormalized weight, not the probability
    np.testing.assert_allclose(np.asarray(out).reshape(-1, 16), y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(l_aux), g["l_aux"], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(counts), g["counts"])


def test_noise_only_in_training() -> None:
    layer = moe.MoE(16, 24, E, k=1, noisy_gate_policy="Jitter", rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (32, 16))
    base = layer(x)[0]
    noisy = layer(x, jax.random.key(3))[0]
    assert not np.allclose(base, noisy)
    layer.eval()
    np.testing.assert_array_equal(layer(x, jax.random.key(3))[0], base)  # eval: no jitter, no RTS


ROWS = 16
SMALL = dict(name="llama", vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2)


def batch(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + i)
    return {"tokens": rng.integers(0, 64, size=(ROWS, 17), dtype=np.int32)}


def train(stage: int, model: dict, steps: int = 3) -> tuple[zerojax.Engine, list[float]]:
    cfg = zerojax.load_config({
        "train_batch_size": ROWS, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "model": {**SMALL, **model}})
    params, loss_fn = llama.build(cfg.model, seed=0)
    engine = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=data_mesh())
    return engine, [float(engine.train_batch(batch(0))["loss"]) for _ in range(steps)]


@pytest.mark.parametrize("model", [
    dict(n_experts=4, experts_per_token=1, drop_tokens=False, moe_aux_loss_coef=0.1),
    dict(n_experts=4, experts_per_token=2, moe_every=2, drop_tokens=False, top2_2nd_expert_sampling=False),
], ids=["top1", "top2-every-other"])
def test_moe_llama_stage3_trains_to_the_stage0_parameters(model: dict) -> None:
    e0, l0 = train(0, model)
    e3, l3 = train(3, model)
    assert sum(any(s.spec) for s in jax.tree.leaves(e3.plan.update_shardings)) >= 10  # really sharded
    np.testing.assert_allclose(l3, l0, rtol=1e-5)
    assert l0[-1] < l0[0]
    assert_tree_close(to_numpy(e3.params), to_numpy(e0.params), rtol=1e-5, atol=1e-6, what="moe llama stage 3 vs 0")


def test_aux_loss_is_added_in_training_only() -> None:
    cfg = zerojax.load_config({"train_batch_size": 8, "model": {**SMALL, "n_experts": 4, "moe_aux_loss_coef": 0.5,
                                                                 "use_rts": False}}).model
    params, loss_fn = llama.build(cfg, seed=0)
    p = jax.jit(params.fn)()
    b = batch(0)
    lm = float(loss_fn(p, b))  # no key: evaluation, the language-model loss alone
    train_loss = float(loss_fn(p, b, rng=jax.random.key_data(jax.random.key(0))))
    _, l_aux = to_nnx(llama.constructor(cfg), p).forward(jnp.asarray(b["tokens"][:, :-1]))
    assert float(l_aux) > 1.0  # two MoE layers' losses, summed
    np.testing.assert_allclose(train_loss - lm, 0.5 * float(l_aux), rtol=1e-4)


def test_dense_llama_param_tree_is_unchanged() -> None:
    for extra in ({}, {"n_experts": 0}):
        cfg = zerojax.load_config({"train_batch_size": 8, "model": {**SMALL, **extra}}).model
        params, loss_fn = llama.build(cfg)
        shapes = jax.tree.map(lambda x: x.shape, params.abstract)
        assert shapes == {
            "embed": {"embedding": (64, 32)}, "head": {"kernel": (32, 64)}, "norm": {"scale": (32,)},
            "layers": {"attn_norm": {"scale": (2, 32)}, "mlp_norm": {"scale": (2, 32)},
                       "q": {"kernel": (2, 32, 32)}, "k": {"kernel": (2, 32, 16)}, "v": {"kernel": (2, 32, 16)},
                       "o": {"kernel": (2, 32, 32)}, "gate": {"kernel": (2, 32, 48)},
                       "up": {"kernel": (2, 32, 48)}, "down": {"kernel": (2, 48, 32)}}}
        assert loss_fn.logical_axes is None


def test_moe_param_tree() -> None:
    cfg = zerojax.load_config({"train_batch_size": 8, "model": {**SMALL, "n_layers": 4, "n_experts": 8,
                                                                 "moe_every": 2}}).model
    params, loss_fn = llama.build(cfg)
    a = params.abstract
    assert a["layers"]["moe"]["experts"]["gate"].shape == (2, 8, 32, 48)  # [groups, experts, d, ff]
    assert a["layers"]["moe"]["router"]["kernel"].shape == (2, 32, 8)
    assert a["dense_layers"]["gate"]["kernel"].shape == (2, 1, 32, 48)  # [groups, moe_every - 1, ...]
    assert "gate" not in a["layers"]
    assert loss_fn.logical_axes["layers"]["moe"]["experts"]["down"] == ("layers", "expert", "mlp", "embed")


def test_config_rejects_bad_moe() -> None:
    with pytest.raises(zerojax.ConfigError, match="model.n_experts: 4 experts, but the gpt model"):
        zerojax.load_config({"train_batch_size": 8, "model": {"n_experts": 4}})
    with pytest.raises(zerojax.ConfigError, match="model.moe_every: 3 does not divide"):
        zerojax.load_config({"train_batch_size": 8, "model": {**SMALL, "n_experts": 4, "moe_every": 3}})
    with pytest.raises(zerojax.ConfigError, match=r"model.experts_per_token: 5, but a layer has model.n_experts 4 "
                                                  r"experts .*choose at most 4"):
        zerojax.load_config({"train_batch_size": 8, "model": {**SMALL, "n_experts": 4, "experts_per_token": 5}})
    with pytest.raises(zerojax.ConfigError, match="model.experts_per_token"):
        zerojax.load_config({"train_batch_size": 8, "model": {**SMALL, "n_experts": 4, "experts_per_token": 0}})
    with pytest.raises(zerojax.ConfigError, match="model.gating"):
        zerojax.load_config({"train_batch_size": 8, "model": {**SMALL, "n_experts": 4, "gating": "top3"}})
    m = zerojax.load_config({"train_batch_size": 8, "model": {**SMALL, "n_experts": 4, "experts_per_token": 4}}).model
    assert m.experts_per_token == 4 and m.gating == "auto"


def test_moe_yaml_trains(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run("train.py", "--config", "configs/moe.yaml", "--set", "run.steps=6", "run.log_every=3",
               "steps_per_print=3", "model.d_model=64", "model.d_ff=96", "model.seq_len=32", "model.n_layers=2",
               "data.max_bytes=100000", "run.eval_batches=1", "run.progress=false", "run.sample_tokens=8",
               "scheduler.params.total_num_steps=6", "scheduler.params.warmup_num_steps=2",
               f"run.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeRO stage 3" in proc.stdout and "sample (8 tokens" in proc.stdout
    assert "mesh {'data': 4, 'expert': 2}" in proc.stdout  # configs/moe.yaml's mesh.expert: 2
    # and the experts are split over it (train.py's plan once sharded them as ordinary weights)
    assert re.search(r"expert parallel over 2 devices .*: 3 of \d+ weights split by experts", proc.stdout), proc.stdout
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["n_experts"] == 8


# -- DeepSpeed's layer, for code that ports -------------------------------------------------------------

class SwiGLU(nnx.Module):
    """A user's expert, as a porter writes one: three bias-free nnx.Linear layers (the Llama MLP)."""

    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        self.gate, self.up = nnx.Linear(d, f, use_bias=False, rngs=rngs), nnx.Linear(d, f, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(f, d, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def test_deepspeed_moe_defaults_are_deepspeeds() -> None:
    """The signature's defaults are those of deepspeed/moe/layer.py's `MoE.__init__` (DeepSpeed's
    master: num_experts=1, ep_size=1, k=1, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4,
    use_residual=False, noisy_gate_policy=None, drop_tokens=True, use_rts=True, use_tutel=False,
    enable_expert_tensor_parallelism=False, top2_2nd_expert_sampling=True), in DeepSpeed's order."""
    want = dict(num_experts=1, ep_size=1, k=1, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4,
                use_residual=False, noisy_gate_policy=None, drop_tokens=True, use_rts=True, use_tutel=False,
                enable_expert_tensor_parallelism=False, top2_2nd_expert_sampling=True)
    params = inspect.signature(moe.DeepSpeedMoE.__init__).parameters
    assert list(params)[1:3] == ["hidden_size", "expert"] and list(params)[3:3 + len(want)] == list(want)
    assert {n: params[n].default for n in want} == want
    call = list(inspect.signature(moe.DeepSpeedMoE.__call__).parameters)
    assert call[1:3] == ["hidden_states", "used_token"]  # DeepSpeed's forward(hidden_states, used_token)
    with pytest.raises(ValueError, match="ep_size 3 does not divide num_experts 4"):
        moe.DeepSpeedMoE(8, SwiGLU(8, 8, nnx.Rngs(0)), 4, ep_size=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="use_tutel"):
        moe.DeepSpeedMoE(8, SwiGLU(8, 8, nnx.Rngs(0)), 4, use_tutel=True, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("k", [1, 2])
def test_deepspeed_moe_with_a_users_expert_is_the_moe_layer(k: int) -> None:
    """Experts start as identical copies of the user's module (and the residual MLP as one more); given
    the same weights the DeepSpeed-shaped layer gives the existing layer's output, l_aux, exp_counts."""
    expert = SwiGLU(16, 24, nnx.Rngs(5))
    ds = moe.DeepSpeedMoE(16, expert, 4, k=k, capacity_factor=0.5, min_capacity=2, use_residual=True,
                          use_rts=False, top2_2nd_expert_sampling=False, rngs=nnx.Rngs(1))
    p = nnx.to_pure_dict(nnx.state(ds, nnx.Param))
    stack, one = p["experts"]["stack"], nnx.to_pure_dict(nnx.state(expert, nnx.Param))
    for name in ("gate", "up", "down"):
        w = np.asarray(stack[name]["kernel"])
        assert w.shape[0] == E and all(np.array_equal(w[e], one[name]["kernel"]) for e in range(E))
        np.testing.assert_array_equal(p["mlp"][name]["kernel"], one[name]["kernel"])
    ours = moe.MoE(16, 24, E, k=k, capacity_factor=0.5, min_capacity=2, use_residual=True, use_rts=False,
                   top2_2nd_expert_sampling=False, rngs=nnx.Rngs(9))
    # different weights in the experts, so that equal outputs do not come from equal copies
    stack = {n: {"kernel": np.asarray(stack[n]["kernel"]) * (1 + np.arange(E))[:, None, None]} for n in stack}
    nnx.update(ds.experts.stack, nnx.State(stack))
    nnx.update(ours, nnx.State({"router": p["router"], "coefficient": p["coefficient"],
                                "experts": {n: stack[n]["kernel"] for n in stack},
                                "mlp": {n: {"kernel": one[n]["kernel"]} for n in one}}))
    x = jax.random.normal(jax.random.key(2), (2, 8, 16))
    got, want = ds(x), ours(x)
    assert got[1].shape == () and got[2].shape == (E,)  # (output, l_aux, exp_counts), DeepSpeed's order
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    assert int(got[2].sum()) == k * 16


def test_used_token_masks_tokens_out_of_the_gate() -> None:
    """DeepSpeed's `used_token` (top-1): an unused token takes no slot, is not counted, and gets no
    expert output; the used tokens get what they get without the mask (no dropping)."""
    layer = moe.DeepSpeedMoE(16, SwiGLU(16, 24, nnx.Rngs(5)), E, drop_tokens=False, use_rts=False,
                             rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (2, 8, 16))
    used = (jnp.arange(16).reshape(2, 8) % 3 != 0).astype(jnp.float32)
    full, masked = layer(x), layer(x, used)
    logits = np.asarray(x).reshape(-1, 16) @ np.asarray(layer.router.kernel[...])
    first = np.eye(E, dtype=int)[logits.argmax(1)]
    keep = np.asarray(used).reshape(-1, 1)
    np.testing.assert_array_equal(np.asarray(masked[2]), (first * keep).sum(0))
    np.testing.assert_allclose(float(masked[1]), np.sum(softmax(logits).mean(0) * (first * keep).mean(0)) * E,
                               rtol=1e-5)
    out, ref = np.asarray(masked[0]), np.asarray(full[0])
    assert not out[np.asarray(used) == 0].any() and ref[np.asarray(used) == 0].any()
    np.testing.assert_allclose(out[np.asarray(used) == 1], ref[np.asarray(used) == 1], rtol=1e-6)
    two = moe.DeepSpeedMoE(16, SwiGLU(16, 24, nnx.Rngs(5)), E, k=2, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="used_token with k=2"):
        two(x, used)


class Regressor(nnx.Module):
    """A porter's model around DeepSpeed's layer: a projection, the MoE, a head."""

    def __init__(self, rngs: nnx.Rngs):
        self.proj = nnx.Linear(8, 16, rngs=rngs)
        self.moe = moe.DeepSpeedMoE(16, SwiGLU(16, 24, rngs), num_experts=4, drop_tokens=False, use_rts=False,
                                    rngs=rngs)
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        out, _, _ = self.moe(self.proj(x))
        return self.head(out)[..., 0]


def regress(stage: int, mesh: dict, devices: int) -> tuple[list[float], dict, zerojax.Engine]:
    cfg = zerojax.load_config({
        "train_batch_size": 16, "gradient_clipping": 0.0, "mesh": mesh,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    params, loss_fn = zerojax.from_nnx(Regressor(nnx.Rngs(0)),
                                       lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
    e = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg, jax.devices()[:devices]))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(2):
        b = {"x": rng.normal(size=(16, 4, 8)).astype(np.float32), "y": rng.normal(size=(16, 4)).astype(np.float32)}
        losses.append(float(e.train_batch(b)["loss"]))
    return losses, to_numpy(e.params), e


def test_deepspeed_moe_zero3_data4_expert2_trains_as_one_device() -> None:
    """ZeRO-3 on data 4 x expert 2: the user's expert copies split over the expert axis (each device
    gating its own tokens, none dropped, no noise) train to the one-device losses and weights."""
    want_losses, want, _ = regress(0, {}, 1)
    losses, got, e = regress(3, {"expert": 2}, 8)
    assert dict(e.plan.mesh.shape) == {"data": 4, "expert": 2}
    specs = jax.tree.map(lambda s: tuple(s.spec), e.plan.param_shardings)["moe"]["experts"]["stack"]
    assert specs["down"]["kernel"][0] == "expert"  # the copies are split over the expert axis
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_tree_close(got, want, rtol=1e-5, atol=1e-6, what="DeepSpeedMoE zero-3 data 4 x expert 2 vs one device")
    down = got["moe"]["experts"]["stack"]["down"]["kernel"]
    assert np.abs(down[0] - down[1]).max() > 1e-6  # the copies, identical at the start, trained apart
