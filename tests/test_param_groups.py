"""Weight-decay masks (`optimizer.no_decay`) and parameter groups against a float64 AdamW reference."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax.config import ModelConfig, load_config
from zerojax.errors import ConfigError
from zerojax.models import gpt
from zerojax.core.names import dotted
from zerojax.optim.deepspeed import make_optimizer, param_groups
from zerojax.optim.groups import name_matches

sys.path.insert(0, str(Path(__file__).parent))
import helpers as h  # noqa: E402

B1, B2, EPS, WD = 0.9, 0.95, 1e-8, 0.1
GROUPS = {"no_decay": ["b_*", "*.b"],
          "param_groups": [{"match": "w_out", "lr_scale": 0.5, "weight_decay": 0.3},
                           {"match": ["layers.*"], "lr_scale": 2.0}]}
# name -> (weight decay, lr scale) that GROUPS means for the helpers' MLP
WANT = {"b_in": (0.0, 1.0), "b_out": (0.0, 1.0), "w_in": (WD, 1.0), "w_out": (0.3, 0.5),
        "layers.b": (0.0, 2.0), "layers.w": (WD, 2.0)}


def adamw(lr: float = 1e-2, **groups: Any) -> dict[str, Any]:
    return {"type": "AdamW", "params": {"lr": lr, "betas": [B1, B2], "eps": EPS, "weight_decay": WD}, **groups}


def names(tree: Any) -> list[str]:
    return [dotted(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def ref_adamw_step(ps: dict, ms: dict, vs: dict, grads: dict, lr: float, t: int) -> None:
    """torch.optim.AdamW, float64, one tensor at a time, with each tensor's group wd and lr scale."""
    for name, g in grads.items():
        wd, scale = WANT[name]
        lr_i = lr * scale
        ps[name] = ps[name] * (1 - lr_i * wd)
        ms[name] = B1 * ms[name] + (1 - B1) * g
        vs[name] = B2 * vs[name] + (1 - B2) * g * g
        denom = np.sqrt(vs[name]) / np.sqrt(1 - B2 ** t) + EPS
        ps[name] = ps[name] - (lr_i / (1 - B1 ** t)) * ms[name] / denom


def flat64(tree: Any) -> dict[str, np.ndarray]:
    return {dotted(p): np.asarray(x, np.float64) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_names_of_the_embedded_gpt() -> None:
    cfg = load_config({"train_batch_size": 8, "optimizer": adamw(no_decay=["bias", "norm", "embed"])})
    groups = param_groups(cfg.optimizer)
    table = {n: wd for n, wd, _ in groups.table(gpt.abstract_params(ModelConfig()), WD)}
    decayed = sorted(n for n, wd in table.items() if wd)
    assert decayed == ["blocks.fc.kernel", "blocks.out.kernel", "blocks.proj.kernel", "blocks.qkv.kernel",
                       "head.kernel"]
    assert name_matches("norm", "model.layers.input_layernorm.weight") and name_matches("embed", "wte")
    assert not name_matches("norm", "blocks.fc.kernel") and name_matches("bias", "blocks.qkv.bias")
    assert name_matches("blocks.*.bias", "blocks.qkv.bias") and not name_matches("blocks.*.bias", "ln_f.bias")
    assert param_groups(load_config({"train_batch_size": 8, "optimizer": adamw()}).optimizer) is None


def test_groups_update_equals_float64_reference() -> None:
    """make_optimizer on a fixed gradient sequence: each tensor follows its own decay and lr."""
    params = h.mlp_params(0)
    cfg = load_config({"train_batch_size": 8, "optimizer": adamw(**GROUPS)}).optimizer
    lr = lambda count: 1e-2 * (1.0 + count)  # noqa: E731 - a different lr every update
    tx = make_optimizer(cfg, lr)
    rng = np.random.default_rng(3)
    seq = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params) for _ in range(4)]
    state, cur = tx.init(jax.tree.map(jnp.asarray, params)), jax.tree.map(jnp.asarray, params)
    ps, ms, vs = flat64(params), {}, {}
    ms = {k: np.zeros_like(v) for k, v in ps.items()}
    vs = {k: np.zeros_like(v) for k, v in ps.items()}
    for t, grads in enumerate(seq, 1):
        updates, state = tx.update(grads, state, cur)
        cur = optax.apply_updates(cur, updates)
        ref_adamw_step(ps, ms, vs, flat64(grads), float(lr(t - 1)), t)
    got = flat64(cur)
    assert set(got) == set(WANT)
    for name in got:
        np.testing.assert_allclose(got[name], ps[name], rtol=2e-5, atol=1e-6, err_msg=name)
    # and the groups made a difference: the same optimizer without them ends elsewhere
    plain = make_optimizer(load_config({"train_batch_size": 8, "optimizer": adamw()}).optimizer, lr)
    pcur = jax.tree.map(jnp.asarray, params)
    pstate = plain.init(pcur)
    for grads in seq:
        u, pstate = plain.update(grads, pstate, pcur)
        pcur = optax.apply_updates(pcur, u)
    assert not np.allclose(flat64(pcur)["layers.w"], ps["layers.w"], rtol=1e-3)


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_with_groups_trains_as_the_float64_reference(stage: int) -> None:
    """Sharded state (stage 3: every tensor split over 8 devices) follows the same per-group update."""
    params = h.mlp_params(0, divisible=True)
    cfg = h.make_config(stage, optimizer=adamw(**GROUPS), clip=0.0)
    batches = [h.make_batch(32, s) for s in range(3)]
    plan, state, metrics = h.train_steps(cfg, batches, params=params)
    ps = flat64(params)
    ms = {k: np.zeros_like(v) for k, v in ps.items()}
    vs = {k: np.zeros_like(v) for k, v in ps.items()}
    for t, b in enumerate(batches, 1):
        cur = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _unflat(params, ps))
        grads = flat64(jax.grad(h.mse_loss)(cur, b))
        ref_adamw_step(ps, ms, vs, grads, 1e-2, t)
    got = flat64(h.to_numpy(state.master if state.master is not None else state.params))
    if stage == 3:
        assert state.params["layers"]["w"].sharding.spec != jax.sharding.PartitionSpec()
    for name in got:
        np.testing.assert_allclose(got[name], ps[name], rtol=2e-5, atol=2e-6, err_msg=name)


def _unflat(template: Any, flat: dict[str, np.ndarray]) -> Any:
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[dotted(p)] for p, _ in paths])


def test_group_errors() -> None:
    with pytest.raises(ConfigError, match=r"optimizer.no_decay: 'nrom' matches no parameter of the model; "
                                          r"its parameters are b_in, b_out"):
        zerojax.plan(h.make_config(1, optimizer=adamw(no_decay=["nrom"])), h.data_mesh(), h.mlp_params(0))
    with pytest.raises(ConfigError, match=r"optimizer.param_groups\[0\]: sets neither lr_scale nor weight_decay"):
        h.make_config(1, optimizer=adamw(param_groups=[{"match": "w_in"}]))
    with pytest.raises(ConfigError, match=r"optimizer.param_groups\[0\].lr: unknown key"):
        h.make_config(1, optimizer=adamw(param_groups=[{"match": "w_in", "lr": 0.1}]))
    with pytest.raises(ConfigError, match=r"optimizer.param_groups\[0\].match: required"):
        h.make_config(1, optimizer=adamw(param_groups=[{"lr_scale": 0.1}]))
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer.no_decy'.*no_decay"):
        h.make_config(1, optimizer={**adamw(), "no_decy": ["bias"]})
    cfg = h.make_config(1, optimizer=adamw(**GROUPS), kernels="pallas")
    with pytest.raises(ConfigError, match="kernels: 'pallas' fuses one weight decay"):
        zerojax.plan(cfg, h.data_mesh(), h.mlp_params(0))
    auto = zerojax.plan(h.make_config(1, optimizer=adamw(**GROUPS)), h.data_mesh(), h.mlp_params(0))
    assert auto.kernels == "xla"
    # the groups survive config.json
    cfg = h.make_config(1, optimizer=adamw(**GROUPS))
    assert load_config(cfg.to_dict()).optimizer == cfg.optimizer
