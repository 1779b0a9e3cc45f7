"""Decoding from the shards (zerojax.models.decode_layout): at ZeRO-3 x tensor 2 x data 4 every layout
generates the one-device tokens, and the chosen `tensor` layout holds no more than the plan's bytes."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import zerojax
from helpers import computations_with, while_bodies
from test_generate import N, PROMPTS
from zerojax.models import generate as gen
from zerojax.models import decode, llama
from zerojax.planner.mesh import make_mesh

SMALL = dict(name="llama", vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2)
#: weights dominate the program's memory: 4.7 MB of weights against a cache of a few KB
WIDE = dict(SMALL, d_model=256, d_ff=512)
#: a real model's depth: one layer's weights are 1/32 of them
DEEP = dict(WIDE, n_layers=32)


@functools.lru_cache(maxsize=None)
def engine(model: tuple) -> zerojax.Engine:
    cfg = zerojax.load_config({
        "train_batch_size": 8, "gradient_clipping": 0.0, "mesh": {"tensor": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "model": dict(model)})
    params, loss_fn = llama.build(cfg.model, seed=0)
    return zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg), decode=decode.decoder(cfg.model))


def one_device(eng: zerojax.Engine, prompts: list[list[int]]) -> gen.Generation:
    host = jax.device_get(eng.state.params)
    return gen.generate(eng.decoder, jax.device_put(host, jax.devices()[0]), prompts, None, N)


@pytest.mark.parametrize("rows", [8, 3])
@pytest.mark.parametrize("layout", [None, "layers"])
def test_zero3_tensor2_data4_generates_the_one_device_tokens(layout: str | None, rows: int) -> None:
    eng = engine(tuple(SMALL.items()))
    assert dict(eng.plan.mesh.shape) == {"data": 4, "tensor": 2} and eng.plan.stage == 3
    prompts = PROMPTS[:rows]  # 3 rows: the data axis does not divide them (padded to 4 under `layers`)
    want = one_device(eng, prompts)
    got = gen.generate(eng.decoder, eng.state.params, prompts, None, N, plan=eng.plan, layout=layout)
    assert np.asarray(got.tokens).shape == (rows, N)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))


def test_tensor_decoding_peaks_within_a_tenth_of_the_plans_bytes() -> None:
    """The compiled program's peak per device (arguments + temporaries + outputs, from memory_analysis) at
    a real model's depth (32 layers, as Llama-7B's; d_model 256 so the CPU compiles it) and a short
    generation (one row, 8 + 8 positions: a KV cache small next to the weights) is at most 1.1x the
    plan's parameter bytes: the parameters as stored, one layer's slice of the stacked weights (the
    layers run as a loop; unrolled, every layer's slice was copied at once: 2.0x), the KV cache, and a
    few KiB of activations and logits. Gathering the weights once per call holds the whole model."""
    from zerojax.models import decode_layout
    eng = engine(tuple(DEEP.items()))
    prompts = PROMPTS[:1]
    whole = sum(x.nbytes for x in jax.tree.leaves(eng.state.params))
    tensor = gen.memory_report(eng.decoder, eng.state.params, prompts, None, 2, plan=eng.plan)
    layer = decode_layout.one_layer_bytes(eng.decoder, eng.state.params) // 8  # every weight split 8 ways
    assert tensor.layout == "tensor" and tensor.planned * 8 < whole * 1.01
    assert tensor.weights <= tensor.planned
    assert tensor.peak <= 1.1 * tensor.planned, tensor.line()
    assert tensor.peak <= tensor.planned + layer + tensor.cache + 64 * 2**10, (tensor.peak, tensor.planned, layer)
    assert "tensor layout" in tensor.line() and "peak" in tensor.line()
    eng = engine(tuple(WIDE.items()))
    gathered = gen.memory_report(eng.decoder, eng.state.params, prompts, None, 2, plan=eng.plan, layout="gathered")
    assert gathered.peak > sum(x.nbytes for x in jax.tree.leaves(eng.state.params)), gathered.line()


def test_layers_gather_inside_the_decode_loop_tensor_moves_less_than_one_copy_of_the_weights() -> None:
    """`layers` all-gathers inside the decode loop (every step); `tensor` moves only activations: all it
    gathers over the whole call (loop trip counts multiplied) is less than one gather of the weights."""
    from zerojax.measure.hlo import collectives
    eng = engine(tuple(WIDE.items()))
    whole = sum(x.nbytes for x in jax.tree.leaves(eng.state.params))
    for name in ("tensor", "layers"):
        hlo = gen.generate(eng.decoder, eng.state.params, PROMPTS[:1], None, N, plan=eng.plan, layout=name,
                           _lower=lambda args: gen._program.lower(*args).compile().as_text())
        # the decode loop runs N - 1 times (a traced count: the new-token bucket's program serves several)
        gathered = sum(c.bytes_per_device for c in collectives(hlo, unknown_trips=N - 1) if c.kind == "all-gather")
        if name == "layers":
            assert computations_with(hlo, "all-gather") & while_bodies(hlo) and gathered > whole / 2
        else:
            assert gathered < whole / 8, gathered


def test_the_choice_follows_the_batch_and_the_devices_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tensor` for a few rows; `layers` when a step's activations outweigh the weights, or when only its
    weights and cache fit the free memory; one error naming what to cut when neither fits (nothing compiles)."""
    from zerojax.models import decode_layout
    eng = engine(tuple(SMALL.items()))
    params = eng.state.params

    def choose(batch: int, max_len: int = 32) -> decode_layout.Layout:
        return decode_layout.choose(eng.plan, eng.decoder, params, batch, max_len, None, gen.cache_bytes)

    assert choose(8).name == "tensor" and choose(8).weight_bytes == choose(8).planned_bytes
    assert choose(4096).name == "layers" and "outweigh" in choose(4096).why
    cache = gen.cache_bytes(eng.decoder, params, 8, 1024)  # a long generation: the cache outweighs the weights
    layer = decode_layout.one_layer_bytes(eng.decoder, params)
    monkeypatch.setattr(decode_layout, "_free_bytes", lambda: 2 * layer + cache // 4)  # the rows' cache, not all of it
    assert choose(8, 1024).name == "layers" and "does not fit" in choose(8, 1024).why
    monkeypatch.setattr(decode_layout, "_free_bytes", lambda: 100)
    with pytest.raises(ValueError, match="fewer rows"):
        choose(8)
    with pytest.raises(ValueError, match="layout must be one of"):
        decode_layout.choose(eng.plan, eng.decoder, params, 8, 32, "sharded")


def test_padding_rows_leaves_the_sampled_rows_as_on_one_device() -> None:
    """3 rows padded to the 4 data shards: the sampled tokens of the 3 are those of the unpadded run (a
    pad row draws its own random numbers after theirs)."""
    eng = engine(tuple(SMALL.items()))
    host = jax.device_put(jax.device_get(eng.state.params), jax.devices()[0])
    want = gen.generate(eng.decoder, host, PROMPTS[:3], None, N, temperature=1.0, seed=5)
    got = gen.generate(eng.decoder, eng.state.params, PROMPTS[:3], None, N, temperature=1.0, seed=5, plan=eng.plan,
                       layout="layers")
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_a_rolled_decoder_keeps_a_bf16_cache_as_bits_and_decodes_as_the_unrolled_one() -> None:
    """`rolled()` (the `tensor` layout's decoder) keeps a bf16 cache as uint16 bits (XLA:CPU would convert
    a whole bf16 cache to f32 in every step of the layer loop) and computes what the unrolled decoder
    does: the same cache bits and logits after a prefill and a decode step."""
    import jax.numpy as jnp
    eng = engine(tuple(SMALL.items()))
    params = jax.device_put(jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), jax.device_get(eng.state.params)),
                            jax.devices()[0])
    tokens, lengths = gen.pad_prompts(PROMPTS[:2])
    out = {}
    for name, d in (("unrolled", eng.decoder), ("rolled", eng.decoder.rolled())):
        cache = d.init_cache(params, 2, 16)
        logits, cache = jax.jit(d.prefill)(params, cache, tokens[:, :8], np.minimum(lengths, 8))
        step, cache = jax.jit(d.decode_step)(params, cache, np.asarray([1, 2], np.int32), np.minimum(lengths, 8))
        out[name] = (logits, step, {k: jax.lax.bitcast_convert_type(c, jnp.uint16) if c.dtype != jnp.uint16 else c
                                    for k, c in cache.items()}, cache["k"].dtype)
    assert out["unrolled"][3] == jnp.bfloat16 and out["rolled"][3] == jnp.uint16
    for a, b in zip(jax.tree.leaves(out["unrolled"][:3]), jax.tree.leaves(out["rolled"][:3])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
