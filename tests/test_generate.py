"""Generation with a KV cache from the training engine's own (sharded) weights: zerojax.models.generate,
zerojax.models.decode and `engine.generate`, checked against greedy decoding by full recomputation."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import zerojax
from helpers import computations_with, data_mesh, greedy_by_recompute, while_bodies
from zerojax.models import decode_layout, generate as gen
from zerojax.engine.pipeline import PipelineEngine
from zerojax.models import decode, gpt, llama
from zerojax.planner.mesh import make_mesh

GPT = dict(name="gpt", vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=2)
LLAMA = dict(name="llama", vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, n_layers=2)
MODELS = {"gpt": GPT, "llama": LLAMA}
N = 6
#: Eight prompts of different lengths (rows split one per device over the data axis).
PROMPTS = [[(7 * r + 3 * i) % 64 for i in range(n)] for r, n in enumerate([5, 2, 9, 1, 3, 7, 4, 6])]


def config(model: str, stage: int) -> zerojax.Config:
    return zerojax.load_config({
        "train_batch_size": 8, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "model": MODELS[model]})


@functools.lru_cache(maxsize=None)
def engine(model: str, stage: int, with_decoder: bool = True) -> zerojax.Engine:
    cfg = config(model, stage)
    if model == "llama":
        params, loss_fn = llama.build(cfg.model, seed=0)
    else:
        params, loss_fn = gpt.init_params(cfg.model, 0), gpt.make_loss_fn(cfg.model)
    return zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=data_mesh(),
                              decode=decode.decoder(cfg.model) if with_decoder else None)


@functools.lru_cache(maxsize=None)
def _forward(model: str) -> Any:
    cfg = config(model, 0).model
    apply = llama.apply if model == "llama" else gpt.apply
    return jax.jit(lambda p, t: apply(cfg, p, t))


def reference(model: str, params: Any, prompts: list[list[int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and their log-probabilities by full recomputation with the model's own `apply`."""
    return greedy_by_recompute(_forward(model), params, prompts, n, config(model, 0).model.seq_len)


def stop_at(toks: np.ndarray, logps: np.ndarray, eos: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a per-row stop at `eos` makes of full greedy rows: eos repeated after it, log-prob 0."""
    toks, logps = toks.copy(), logps.copy()
    lengths = np.full(len(toks), toks.shape[1], np.int32)
    for r in range(len(toks)):
        hits = np.flatnonzero(toks[r] == eos)
        if hits.size:
            lengths[r] = hits[0] + 1
            toks[r, hits[0] + 1:], logps[r, hits[0] + 1:] = eos, 0.0
    return toks, logps, lengths


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("stage", [0, 3])
def test_greedy_equals_full_recomputation(model: str, stage: int) -> None:
    eng = engine(model, stage)
    leaf = jax.tree.leaves(eng.state.params)[-1]
    assert leaf.sharding.is_fully_replicated == (stage == 0)  # stage 3: generated from the shards
    toks, logps = reference(model, eng.state.params, PROMPTS, N)
    eos = int(toks[0, 2])  # row 0 stops at its third token at the latest; the others run on (or stop too)
    want_toks, want_logps, want_lengths = stop_at(toks, logps, eos)
    assert want_lengths[0] <= 3 and want_lengths.max() == N
    out = eng.generate(PROMPTS, N, eos_id=eos)
    np.testing.assert_array_equal(np.asarray(out.tokens), want_toks)
    np.testing.assert_array_equal(np.asarray(out.lengths), want_lengths)
    np.testing.assert_allclose(np.asarray(out.logprobs), want_logps, atol=1e-5, rtol=0)


def test_zero3_gathers_once_per_call_not_per_token() -> None:
    """At ZeRO-3 the `gathered` layout's all-gathers sit outside every loop: once per call, never per token."""
    eng = engine("gpt", 3)
    tokens, lengths = gen.pad_prompts(PROMPTS)
    width = gen.bucket(int(lengths.max()), N, eng.decoder.max_positions)
    padded = np.zeros((len(PROMPTS), width), np.int32)
    padded[:, :tokens.shape[1]] = tokens
    route = decode_layout.choose(eng.plan, eng.decoder, eng.state.params, len(PROMPTS),
                                 width + gen.new_token_bucket(N), "gathered")
    hlo = gen._program.lower(eng.decoder, eng.state.params, *gen._rows(padded, lengths, route), jnp.uint32(0),
                             jnp.int32(N), gen.new_token_bucket(N), 0.0, None, None, (), 0, route).compile().as_text()
    gathers = computations_with(hlo, "all-gather")
    assert gathers and not gathers & while_bodies(hlo)


def test_cache_bytes_are_its_shape() -> None:
    for model, kv in (("gpt", 4), ("llama", 2)):
        cfg = config(model, 0).model
        dec = decode.decoder(cfg)
        params = engine(model, 0).state.params
        cache = dec.init_cache(params, 3, 20)
        shape = (cfg.n_layers, 3, 20, kv, cfg.d_model // cfg.n_heads)
        assert cache["k"].shape == cache["v"].shape == shape
        assert gen.cache_bytes(dec, params, 3, 20) == 2 * int(np.prod(shape)) * 4
        assert sum(x.nbytes for x in jax.tree.leaves(cache)) == gen.cache_bytes(dec, params, 3, 20)


def test_sampling_is_seeded_top_k_1_is_greedy_and_compiles_once() -> None:
    eng = engine("gpt", 0)
    prompts = PROMPTS[:3]  # a batch the 8 devices do not divide: every device decodes it whole
    greedy = eng.generate(prompts, N)
    a = eng.generate(prompts, N, temperature=1.0, seed=1)
    compiled = gen._program._cache_size()
    b = eng.generate(prompts, N, temperature=1.0, seed=1)
    c = eng.generate(prompts, N, temperature=1.0, seed=2)
    eng.generate([p + [1] for p in prompts], N, temperature=1.0, seed=1)  # longer prompts, same width bucket
    assert gen._program._cache_size() == compiled  # same shapes, another seed or length: no new program
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    one = eng.generate(prompts, N, temperature=1.0, top_k=1, seed=3)
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(greedy.tokens))
    nucleus = eng.generate(prompts, N, temperature=1.0, top_p=1e-6, seed=4)  # only the likeliest survives
    np.testing.assert_array_equal(np.asarray(nucleus.tokens), np.asarray(greedy.tokens))


def test_prompt_lengths_share_a_bucket() -> None:
    assert [gen.bucket(n, 4, None) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 32]
    assert gen.bucket(20, 4, 32) == 28  # within the GPT's learned positions
    with pytest.raises(ValueError, match="positions"):
        gen.bucket(30, 4, 32)


def test_without_a_decoder_or_in_a_pipeline_generate_says_what_to_do() -> None:
    with pytest.raises(TypeError, match="decode="):
        engine("gpt", 0, with_decoder=False).generate(PROMPTS, N)
    with pytest.raises(NotImplementedError, match="mesh.stage: 1"):
        PipelineEngine.generate(object.__new__(PipelineEngine), PROMPTS, N)


def test_generate_reads_the_live_state_and_leaves_nothing_behind() -> None:
    """After a train step at ZeRO-3, generation follows the updated shards; the state is untouched and
    only the results outlive the call (the gathered weights and the cache are gone)."""
    cfg = config("gpt", 3)
    eng = zerojax.initialize(cfg, params=gpt.init_params(cfg.model, 1), loss_fn=gpt.make_loss_fn(cfg.model),
                             mesh=data_mesh(), decode=decode.decoder(cfg.model))
    rng = np.random.default_rng(0)
    eng.train_batch({"tokens": rng.integers(0, 64, (8, 33), dtype=np.int32)})
    before = jax.device_get(eng.state.params)
    jax.block_until_ready(eng.state)
    live = {id(x) for x in jax.live_arrays()}
    out = eng.generate(PROMPTS[:3], N)
    jax.block_until_ready(out)
    assert {id(x) for x in jax.live_arrays()} - live == {id(x) for x in (*out, out.sampled_logprobs)}
    toks, logps = reference("gpt", eng.state.params, PROMPTS[:3], N)
    np.testing.assert_array_equal(np.asarray(out.tokens), toks)
    np.testing.assert_allclose(np.asarray(out.logprobs), logps, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(eng.state.params))):
        np.testing.assert_array_equal(a, b)


def test_bf16_weights_and_tied_llama_embeddings() -> None:
    """bf16 compute weights decode with a bf16 cache (half the bytes); a Llama with tied embeddings
    decodes as its full forward does."""
    cfg = zerojax.load_config(config("gpt", 3), ["bf16.enabled=true"])
    eng = zerojax.initialize(cfg, params=gpt.init_params(cfg.model, 0), loss_fn=gpt.make_loss_fn(cfg.model),
                             mesh=data_mesh(), decode=decode.decoder(cfg.model))
    out = eng.generate(PROMPTS, N, temperature=0.7, top_k=8, top_p=0.9, seed=5)
    assert out.tokens.shape == out.logprobs.shape == (8, N) and np.all(np.asarray(out.logprobs) <= 0)
    assert gen.cache_bytes(eng.decoder, eng.state.params, 8, 24) == 2 * 2 * 8 * 24 * 4 * 8 * 2

    tied = zerojax.load_config(config("llama", 0), ["model.tie_embeddings=true"]).model
    from flax import nnx
    params = nnx.to_pure_dict(nnx.state(llama.constructor(tied, 2)(), nnx.Param))
    assert "head" not in params
    got = gen.generate(decode.decoder(tied), params, PROMPTS[:2], None, 4)
    want = []
    for p in PROMPTS[:2]:
        seq = list(p)
        for _ in range(4):
            seq.append(int(np.argmax(np.asarray(llama.apply(tied, params, jnp.asarray([seq]))[0, -1]))))
        want.append(seq[len(p):])
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want))


def test_deepspeeds_hybrid_engine_keys_load_and_bound_the_request() -> None:
    """hybrid_engine.max_out_tokens bounds prompt + new tokens; inference_tp_size > 1 is refused with the
    reason; the keys with no effect by design load without a warning."""
    import warnings
    base = config("gpt", 0).to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = zerojax.load_config({**base, "hybrid_engine": {"enabled": True, "max_out_tokens": 12,
                                                              "release_inference_cache": True, "pin_parameters": True,
                                                              "tp_gather_partition_size": 8}})
    eng = zerojax.initialize(cfg, params=gpt.init_params(cfg.model, 0), loss_fn=gpt.make_loss_fn(cfg.model),
                             mesh=data_mesh(), decode=decode.decoder(cfg.model))
    assert eng.generate([[1, 2, 3, 4]], 8).tokens.shape == (1, 8)
    with pytest.raises(ValueError, match=r"a prompt of 4 tokens plus max_new_tokens=9 exceeds "
                                         r"hybrid_engine.max_out_tokens=12"):
        eng.generate([[1, 2, 3, 4]], 9)
    with pytest.raises(zerojax.ConfigError, match=r"^hybrid_engine.inference_tp_size: 2, but zerojax generates on "
                                                  r"the training layout"):
        zerojax.load_config({**base, "hybrid_engine": {"inference_tp_size": 2}})


def test_two_processes_whose_rows_end_at_different_steps_generate_like_one(tmp_path) -> None:
    """Process 0's rows all meet the end token within a few tokens, process 1's never do: both run the
    same loop to the end (no hang), and every row equals the one-process result."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from multiprocess_worker import GEN_TOKENS, generate_all, generate_engine
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    env.pop("XLA_FLAGS", None)  # each process asks for its own share of devices
    proc = subprocess.run([sys.executable, "-m", "zerojax.cli", "launch", "-n", "2", "tests/multiprocess_worker.py",
                           "generate", str(tmp_path)], cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = dict(np.load(tmp_path / "generate.npz"))
    ends = got["greedy_lengths"]
    assert ends[:4].max() < GEN_TOKENS and ends[4:].min() == GEN_TOKENS, ends  # one process done long before
    assert "[0] generate: process 0 rows end at" in proc.stdout and "[1] generate: process 1 rows end at" in proc.stdout
    want = generate_all(generate_engine(data_mesh()))
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=key)


def test_a_tensor_2_engine_generates_what_a_tensor_1_engine_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same weights split over tensor 2 x ZeRO-3 over 4 data shards: the same greedy tokens as the
    unsplit engine (and as full recomputation), log-probabilities to float32 rounding."""
    cfg = zerojax.load_config(config("llama", 3), ["mesh.tensor=2"])
    params, loss_fn = llama.build(cfg.model, seed=0)
    split = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg),
                               decode=decode.decoder(cfg.model))
    q = split.state.params["layers"]["q"]["kernel"]
    assert q.sharding.spec == P(None, "data", "tensor") and q.addressable_shards[0].data.size * 8 == q.size
    whole = engine("llama", 0)
    toks, logps = reference("llama", whole.state.params, PROMPTS, N)
    got, want = split.generate(PROMPTS, N), whole.generate(PROMPTS, N)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.tokens), toks)
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got.logprobs), logps, atol=1e-5, rtol=0)
    # train.py's end-of-run sample generates from the split weights where they lie (the plan's path)
    from zerojax.app import sample
    from zerojax.app.sample import end_of_run_sample, sample_text
    monkeypatch.setattr(sample, "DEFAULT_PROMPT", "\x01\x02\x03 ")  # byte ids inside this model's 64 tokens
    text = end_of_run_sample(zerojax.load_config(cfg, ["run.sample_tokens=6"]), split.params, split.plan)
    assert text is not None and text == sample_text(cfg, jax.device_get(whole.params), None, 6, seed=cfg.run.seed)


def test_the_end_of_run_sample_reads_weights_stored_in_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the optimizer on NVMe, `engine.params` is the fp32 master read back into host memory: train.py's
    end-of-run sample generates from it as from the same weights on the devices."""
    from zerojax.app import sample
    from zerojax.app.sample import end_of_run_sample
    monkeypatch.setattr(sample, "DEFAULT_PROMPT", "\x01\x02\x03 ")  # byte ids inside this model's 64 tokens
    e = engine("gpt", 3)
    cfg = zerojax.load_config(e.config, ["run.sample_tokens=6"])
    on_host = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), e.params)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(on_host)} == {"pinned_host"}
    text = end_of_run_sample(cfg, on_host, e.plan)
    assert text is not None and text == end_of_run_sample(cfg, e.params, e.plan)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_a_prompt_token_outside_the_vocabulary_is_one_error(model: str) -> None:
    """An embedding lookup past the table reads a clamped or zero row: the tokens would be silently
    wrong. The request is refused before anything compiles, naming the id and the vocabulary; padding
    past a row's length is not read."""
    e = engine(model, 3)
    vocab = e.config.model.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=rf"^generate: prompt token id {bad} is outside the model's vocabulary "
                                             rf"\[0, {vocab}\)"):
            e.generate([[1, 2, 3], [4, bad]], 2)
    padded = np.asarray([[1, 2, 3], [4, 5, vocab + 7]], np.int32)  # the pad is past row 1's length
    assert e.generate(padded, 2, lengths=[3, 2]).tokens.shape == (2, 2)
