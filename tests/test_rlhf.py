"""GRPO's pieces (zerojax.models.rl): the rollout batch lines up with what generate sampled, group
advantages, the loss's KL term, and a reference policy that leaves nothing on the devices."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import zerojax
from zerojax.models import generate as gen
from zerojax.models import decode, gpt, rl

CFG = zerojax.load_config({"train_batch_size": 8, "model": dict(name="gpt", vocab_size=32, seq_len=24, d_model=32, n_heads=2,
                                         n_layers=2)}).model
PROMPTS = [[5, 6, 7], [9], [4, 4, 4, 4, 4], [8, 1]]


def rollout(eos: int | None = None) -> tuple[Any, dict[str, np.ndarray], Any]:
    params = gpt.init_params(CFG, 0)
    out = gen.generate(decode.decoder(CFG), params, PROMPTS, None, 8, temperature=1.0, seed=3, eos_id=eos)
    tokens, logps, lengths = (np.asarray(x) for x in out)
    batch = rl.rollout_batch(*gen.pad_prompts(PROMPTS), tokens, lengths, logps)
    return params, batch, (tokens, lengths)


def test_rollout_batch_places_each_sampled_token_where_the_train_loss_predicts_it() -> None:
    params, batch, (tokens, lengths) = rollout(eos=2)
    assert batch["tokens"].shape == (4, 5 + 8) and batch["mask"].shape == (4, 12)
    np.testing.assert_array_equal(batch["mask"].sum(1), lengths)
    for r, p in enumerate(PROMPTS):
        assert batch["tokens"][r, :len(p)].tolist() == p
        assert batch["tokens"][r, len(p):len(p) + lengths[r]].tolist() == tokens[r, :lengths[r]].tolist()
    # the train path's log-probabilities of the sampled tokens are the sampler's (KV cache vs. full forward)
    logp = rl.token_logprobs(gpt.apply(CFG, params, jnp.asarray(batch["tokens"][:, :-1])), jnp.asarray(batch["tokens"]))
    mask = batch["mask"] > 0
    np.testing.assert_allclose(np.asarray(logp)[mask], batch["old_logp"][mask], atol=1e-4)


def test_group_advantages_compare_within_a_group_only() -> None:
    adv = rl.group_advantages(np.array([0, 1, 0, 1, 5, 5, 5, 5, 0.2, 0.4, 0.6, 0.8]), 4)
    a, b, c = adv.reshape(3, 4)
    np.testing.assert_allclose(a, [-1, 1, -1, 1], atol=1e-3)
    np.testing.assert_array_equal(b, 0)  # all equal: no preference
    assert np.all(np.diff(c) > 0) and abs(c.mean()) < 1e-6 and abs(c.std() - 1) < 1e-3


def test_loss_is_minus_the_advantage_at_the_reference_and_kl_grows_away_from_it() -> None:
    params, batch, _ = rollout()
    batch = {**batch, "ref_logp": batch["old_logp"], "advantages": np.array([1.0, -1.0, 2.0, 0.0], np.float32)}
    loss = rl.make_grpo_loss(CFG, beta=0.5)
    mask = batch["mask"]
    # ratio 1 and KL 0 at the sampling policy: the loss is minus the token-weighted mean advantage
    want = -(batch["advantages"][:, None] * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(loss(params, batch)), want, atol=1e-4)
    assert float(rl.kl_k3(jnp.zeros(3), jnp.zeros(3)).sum()) == 0
    assert np.all(np.asarray(rl.kl_k3(jnp.log(jnp.array([0.5, 0.9])), jnp.log(jnp.array([0.9, 0.5])))) > 0)


def test_reference_is_on_the_host_between_calls() -> None:
    from helpers import data_mesh
    from jax.sharding import NamedSharding, PartitionSpec as P
    params, batch, _ = rollout()
    mesh = data_mesh()
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, P("data") if x.shape[0] % 8 == 0 else P()), params)
    ref = rl.Reference(CFG, params, shardings)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(ref.params))
    want = rl.token_logprobs(gpt.apply(CFG, params, jnp.asarray(batch["tokens"][:, :-1])), jnp.asarray(batch["tokens"]))
    before = {id(x) for x in jax.live_arrays()}
    got = ref.logprobs(batch["tokens"])
    left = [x for x in jax.live_arrays() if id(x) not in before and not x.is_deleted()]
    assert sum(x.nbytes for x in left) < 1024, [x.shape for x in left]  # not the model's 30 kB
    np.testing.assert_allclose(got, np.asarray(want), atol=1e-5)
