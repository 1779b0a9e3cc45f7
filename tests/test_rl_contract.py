"""What an RL loop asks of `engine.generate` and of the route from a Hugging Face checkpoint:
left-padded prompts with an attention mask, stop ids and a pad id checked token for token against
transformers' `generate`; sampling checked in distribution against transformers' logits processors;
`zerojax.from_hf` training and generating; a few programs reused across calls and the train/generate
switch. The expected outputs were made by transformers (tests/fixtures/hf/make_generate_fixtures.py)."""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import numpy as np
import pytest
from scipy import stats

import zerojax
from zerojax.models import generate as gen

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
CONFIG = {"train_batch_size": 8, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


@functools.lru_cache(maxsize=None)
def hf_engine() -> zerojax.Engine:
    return zerojax.from_hf(str(FIXTURES / "llama"), dict(CONFIG, model={"seq_len": 16}))


def test_left_padded_prompts_with_stop_ids_generate_what_transformers_generates() -> None:
    want = np.load(FIXTURES / "generate" / "left_padded.npz")
    eng = hf_engine()
    assert jax.tree.leaves(eng.state.params)[0].sharding.spec != jax.sharding.PartitionSpec()  # ZeRO-3 shards
    out = eng.generate(want["ids"], 8, attention_mask=want["mask"])
    np.testing.assert_array_equal(np.asarray(out.tokens), want["greedy"])
    np.testing.assert_allclose(np.asarray(out.logprobs), want["greedy_logp"], atol=1e-4, rtol=0)
    assert not np.asarray(out.sampled_logprobs).any()  # greedy: a point mass
    stopped = eng.generate(want["ids"], 8, attention_mask=want["mask"], stop_ids=want["stops"].tolist(),
                           pad_id=int(want["pad"]))
    np.testing.assert_array_equal(np.asarray(stopped.tokens), want["stopped"])
    assert np.asarray(stopped.lengths).tolist() == [3, 1, 8, 8]
    # the same prompts as a list, and right-padded with lengths, generate the same
    rows = [list(r[m == 1]) for r, m in zip(want["ids"], want["mask"])]
    np.testing.assert_array_equal(np.asarray(eng.generate(rows, 8).tokens), want["greedy"])
    right, lengths = gen.pad_prompts(rows)
    np.testing.assert_array_equal(np.asarray(eng.generate(right, 8, lengths=lengths).tokens), want["greedy"])


def test_from_hf_trains_and_generates_from_the_live_weights() -> None:
    eng = zerojax.from_hf(str(FIXTURES / "llama"), dict(CONFIG, model={"seq_len": 16}))
    assert eng.decoder is not None and eng.config.model.name == "llama"
    before = np.asarray(eng.generate([[5, 6, 7]], 4).logprobs)
    tokens = np.random.default_rng(0).integers(0, 128, (8, 17), dtype=np.int32)
    first = float(eng.train_batch({"tokens": tokens})["loss"])
    second = float(eng.train_batch({"tokens": tokens})["loss"])
    assert np.isfinite(first) and second < first
    assert not np.allclose(np.asarray(eng.generate([[5, 6, 7]], 4).logprobs), before)


def test_from_hf_refuses_another_checkpoint_in_the_config() -> None:
    with pytest.raises(zerojax.ConfigError, match="model.hf_checkpoint: the config names"):
        zerojax.from_hf(str(FIXTURES / "llama"), dict(CONFIG, model={"hf_checkpoint": str(FIXTURES / "gpt2")}))


def test_an_attention_mask_with_a_hole_is_refused() -> None:
    with pytest.raises(ValueError, match="attention_mask row 1"):
        gen.pad_prompts(np.ones((2, 4), np.int32), attention_mask=[[0, 1, 1, 1], [1, 0, 1, 1]])
    with pytest.raises(ValueError, match="lengths= or attention_mask="):
        gen.pad_prompts(np.ones((2, 4), np.int32), [4, 4], [[1, 1, 1, 1], [1, 1, 1, 1]])


DRAWS = 20_000


@functools.lru_cache(maxsize=None)
def _picker(temperature: float, top_k: int | None, top_p: float | None):
    return jax.jit(lambda logits, key: gen.pick(logits, key, temperature, top_k, top_p))


def test_sampling_draws_from_transformers_processed_distribution() -> None:
    """For a fixed logits vector and each (temperature, top_k, top_p): DRAWS tokens from `pick` (seed
    fixed, so the test is deterministic) fit transformers' processed distribution (chi-square), never
    land where it is 0, and each carries log q(token) of that distribution and the temperature-1 log p."""
    fix = np.load(FIXTURES / "generate" / "processors.npz")
    logits = np.broadcast_to(fix["logits"], (DRAWS, fix["logits"].size)).astype(np.float32)
    logp = np.asarray(jax.nn.log_softmax(fix["logits"]))
    for (temperature, top_k, top_p), want in zip(fix["settings"], fix["probs"]):
        tok, t1, logq = (np.asarray(x) for x in _picker(float(temperature), int(top_k) or None,
                                                         float(top_p) if top_p < 1 else None)(logits, jax.random.key(7)))
        counts = np.bincount(tok, minlength=want.size)
        support = want > 0
        assert counts[~support].sum() == 0, (temperature, top_k, top_p)
        p = stats.chisquare(counts[support], DRAWS * want[support] / want[support].sum()).pvalue
        assert p > 1e-3, (temperature, top_k, top_p, p)
        np.testing.assert_allclose(logq, np.log(want[tok]), atol=1e-5)
        np.testing.assert_allclose(t1, logp[tok], atol=1e-6)
    # the test has the power to tell: top-k 5 at temperature 1.3 is far from the raw distribution
    raw = np.exp(logp.astype(np.float64))
    raw /= raw.sum()
    tok = np.asarray(_picker(1.3, 5, None)(logits, jax.random.key(7))[0])
    assert stats.chisquare(np.bincount(tok, minlength=raw.size), DRAWS * raw).pvalue < 1e-12


def test_prompt_widths_and_token_counts_share_programs_across_the_train_switch() -> None:
    """Prompts of 2..8 tokens and 3..8 new tokens are one generate program; once every shape has run,
    a second pass through generate, train, generate compiles nothing at all."""
    from zerojax.runtime.compile_cache import Compilations
    eng = hf_engine()
    tokens = np.random.default_rng(1).integers(0, 128, (8, 17), dtype=np.int32)
    before = gen._program._cache_size()

    def one_pass() -> None:
        for width, n in ((2, 3), (5, 6), (8, 8)):
            eng.generate([list(range(1, width + 1))] * 4, n, temperature=1.0, seed=width)
            eng.train_batch({"tokens": tokens})
            eng.generate([list(range(3, width + 3))] * 4, n, eos_id=2)

    one_pass()
    assert gen._program._cache_size() - before <= 2  # sampled and greedy-with-a-stop: one program each
    with Compilations() as compiled:
        one_pass()
    assert compiled.count == 0
