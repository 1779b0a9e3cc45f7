"""Generation with a KV cache for the MoE Llama (zerojax.models.decode.MoELlamaDecoder): the greedy
tokens and log-probabilities of full recomputation, at ZeRO-0, ZeRO-3 and with an expert axis."""
from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
import pytest

import zerojax
from helpers import data_mesh, greedy_by_recompute
from zerojax.models import decode, llama
from zerojax.planner.mesh import make_mesh

#: One group of (a dense layer, a MoE layer), top-2 of 4 experts with a PR-MoE residual branch; no
#: token dropped (Mixtral's setting), so the cached decode and the full window route alike.
MOE = dict(name="llama", vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2,
           n_experts=4, experts_per_token=2, moe_every=2, use_residual=True, drop_tokens=False)
N = 5
PROMPTS = [[(7 * r + 3 * i) % 64 for i in range(n)] for r, n in enumerate([5, 2, 9, 1, 3, 7, 4, 6])]


def config(stage: int, **model: Any) -> zerojax.Config:
    return zerojax.load_config({
        "train_batch_size": 8, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "model": {**MOE, **model}})


@functools.lru_cache(maxsize=None)
def initial(model: Any) -> Any:
    """Random params of the model's shapes, drawn on the host (building the NNX model's initializer
    compiles for seconds; the equivalence holds for any weights)."""
    params, _ = llama.build(model, seed=0)
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(a.dtype), params.abstract)


def engine(cfg: zerojax.Config, mesh: Any = None) -> zerojax.Engine:
    _, loss_fn = llama.build(cfg.model, seed=0)
    return zerojax.initialize(cfg, params=initial(cfg.model), loss_fn=loss_fn,
                              mesh=data_mesh() if mesh is None else mesh, decode=decode.decoder(cfg.model))


@functools.lru_cache(maxsize=None)
def _forward(model: Any) -> Any:
    return jax.jit(lambda p, t: llama.apply(model, p, t))


def reference(model: Any, params: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and their log-probabilities by full recomputation with the model's evaluation forward."""
    return greedy_by_recompute(_forward(model), params, PROMPTS, n, model.seq_len)


def check(eng: zerojax.Engine, model: Any, n: int = N) -> None:
    toks, logps = reference(model, eng.state.params, n)
    out = eng.generate(PROMPTS, n)
    np.testing.assert_array_equal(np.asarray(out.tokens), toks)
    np.testing.assert_allclose(np.asarray(out.logprobs), logps, atol=1e-5, rtol=0)


def test_decoder_of_a_moe_config_is_the_moe_decoder() -> None:
    cfg = config(0).model
    assert isinstance(decode.decoder(cfg), decode.MoELlamaDecoder)
    assert type(decode.decoder(config(0, n_experts=0).model)) is decode.LlamaDecoder


@pytest.mark.parametrize("stage", [0, 3])
def test_greedy_equals_full_recomputation(stage: int) -> None:
    cfg = config(stage)
    eng = engine(cfg)
    leaf = eng.state.params["layers"]["moe"]["experts"]["gate"]
    assert leaf.sharding.is_fully_replicated == (stage == 0)  # stage 3: generated from the shards
    check(eng, cfg.model)


def test_top1_every_layer_with_experts_split_over_an_expert_axis() -> None:
    """Mixtral's shape (every layer MoE) with top-1 routing and a decode step routing fewer tokens
    (the 8 rows) than min_capacity; the experts split over mesh.expert 2 under ZeRO-3."""
    cfg = zerojax.load_config(config(3, n_layers=2, moe_every=1, experts_per_token=1, use_residual=False,
                                     min_capacity=16), ["mesh.expert=2"])
    eng = engine(cfg, make_mesh(cfg))
    gate = eng.state.params["layers"]["moe"]["experts"]["gate"]
    assert gate.addressable_shards[0].data.shape[1] == 2  # two of the four experts per device
    check(eng, cfg.model)


def test_top3_gate() -> None:
    """DeepSpeed's top-k gate (3 of 4 experts, one MoE layer, nothing dropped): the prefill and a
    decode step give what the full window computes; the decoder runs the model's own gate, whatever k."""
    cfg = config(0, n_layers=1, moe_every=1, experts_per_token=3, use_residual=False)
    check(engine(cfg), cfg.model, n=2)
