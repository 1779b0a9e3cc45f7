"""GRPO that has to learn the task: copy the prompt's digits, at ZeRO-3 with tensor 2, a KL penalty to
the reference, and reward and KL curves drawn at the end.

    python examples/grpo_copy.py [--steps 200] [--digits 2] [--out runs/grpo_copy] [--seed 0]

The task is verifiable and collapse does not pay. Each prompt is `--digits` random digits and "=",
e.g. "4 0 =", and the answer is the same digits then an end token, "4 0 <eos>". The reward is the
share of those answer slots the completion gets right, so a policy that always writes the same digit
(the collapse examples/rlhf.py's one-token reward invites) copies 1/10 of the digits, what a random
one does; only reading the prompt scores more. The vocabulary is the task's own: ids 0-9 the digits,
10 "=", 11 the end token (no tokenizer file ships with zerojax; a real run's ids come from its
checkpoint's tokenizer.json).

Each step: `engine.generate` samples GROUP completions of each of `--prompts` prompts from the live
weights (split over tensor 2 and ZeRO-3 shards over data 4 of the 8 devices), each is scored, the
rewards are normalised within each prompt's group, and `engine.train_batch` takes one step of GRPO's
clipped policy-gradient loss plus BETA times the k3 KL to the starting policy (`zerojax.models.rl`).
The reward, the share of digits copied and the KL (per generated token, of the sampling policy
against the reference) are written with the step's own metrics to OUT/metrics.jsonl and drawn to
OUT/curves.png (matplotlib, imported only then). The run ends by printing how many programs it
compiled: the generate program and the train step once, whatever the step
(zerojax.runtime.compile_cache.Compilations counts them).
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zerojax  # noqa: E402

zerojax.request_cpu_devices(8)  # on a CPU-only machine: 8 virtual devices, before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402

from zerojax.app.monitor import Monitor  # noqa: E402
from zerojax.models import generate as gen  # noqa: E402
from zerojax.models import decode, gpt, rl  # noqa: E402
from zerojax.runtime.compile_cache import Compilations  # noqa: E402

EQUALS, EOS, VOCAB = 10, 11, 12
GROUP = 8                       # completions per prompt
BETA = 0.05                     # the KL penalty's weight


def make_config(steps: int, digits: int, prompts: int = 8, lr: float = 3e-3) -> zerojax.Config:
    width = 2 * digits + 2  # the prompt (digits and "="), the answer (digits and the end token)
    return zerojax.load_config({
        "train_batch_size": prompts * GROUP, "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": lr}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "mesh": {"tensor": 2},
        "hybrid_engine": {"enabled": True, "max_out_tokens": width},
        "model": {"name": "gpt", "vocab_size": VOCAB, "seq_len": width, "d_model": 64, "n_heads": 4,
                  "n_layers": 2, "remat": False},
        "steps_per_print": max(1, steps // 10), "run": {"progress": False, "log_every": 1}})


def sample_prompts(rng: np.random.Generator, digits: int, n: int) -> np.ndarray:
    """[n * GROUP, digits + 1]: n random digit strings and "=", each repeated GROUP times."""
    digits = rng.integers(0, 10, (n, digits))
    prompts = np.concatenate([digits, np.full((n, 1), EQUALS)], axis=1).astype(np.int32)
    return np.repeat(prompts, GROUP, axis=0)


def matches(prompts: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The share of the answer's slots (the prompt's digits, then EOS) each completion has right. A
    completion that stops early is padded with "=" (`pad_id`), which matches no slot: stopping at once
    scores 0, not the EOS slot's share. [B, digits + 1] bools; the reward is their mean per row."""
    answer = np.concatenate([prompts[:, :-1], np.full((len(prompts), 1), EOS)], axis=1)
    return tokens[:, :answer.shape[1]] == answer


def masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    return float((x * mask).sum() / max(mask.sum(), 1.0))


def draw(out: Path) -> Path | None:
    """OUT/curves.png from metrics.jsonl: loss, lr, grad norm, tokens/s, reward and KL against step."""
    from zerojax.errors import ConfigError
    from zerojax.tools.plot import plot_runs  # matplotlib loads here, not at start-up
    try:
        return plot_runs([out], out / "curves.png", title="GRPO, copy the digits (ZeRO-3, tensor 2)")
    except ConfigError as e:  # no matplotlib: the curves stay in metrics.jsonl
        print(f"no plot: {e}")
        return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=os.path.join("runs", "grpo_copy"), help="folder of metrics.jsonl, curves.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", type=int, default=2, help="digits a prompt holds")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (each sampled GROUP times)")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    config = make_config(args.steps, args.digits, args.prompts, args.lr)
    rows = args.prompts * GROUP
    new = args.digits + 1
    cfg = config.model
    engine = zerojax.initialize(config, params=gpt.init_params(cfg, args.seed),
                                loss_fn=rl.make_grpo_loss(cfg, beta=BETA), decode=decode.decoder(cfg))
    reference = rl.Reference(cfg, engine.params, jax.tree.map(lambda x: x.sharding, engine.state.params))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    monitor = Monitor(config, out, args.steps, rows * new, rows)
    rng = np.random.default_rng(args.seed)
    rewards, kls, copied = [], [], []
    lengths = np.full(rows, args.digits + 1, np.int32)
    try:
        with Compilations() as compiled:
            for step in range(1, args.steps + 1):
                prompts = sample_prompts(rng, args.digits, args.prompts)
                g = engine.generate(prompts, new, lengths=lengths, temperature=1.0, seed=args.seed * 100_003 + step,
                                    eos_id=EOS, pad_id=EQUALS)  # after a stop: "=", which no answer slot holds
                tokens, logps, counts = (np.asarray(x) for x in g)
                right = matches(prompts, tokens)
                score = right.mean(axis=1).astype(np.float32)
                batch = rl.rollout_batch(prompts, lengths, tokens, counts, logps)
                batch["ref_logp"] = reference.logprobs(batch["tokens"])
                batch["advantages"] = rl.group_advantages(score, GROUP)
                kls.append(masked_mean(np.asarray(rl.kl_k3(batch["old_logp"], batch["ref_logp"])), batch["mask"]))
                metrics = engine.train_batch(batch)
                rewards.append(float(score.mean()))
                copied.append(float(right[:, :-1].mean()))  # the digits alone: a collapsed policy gets ~0.1
                monitor.step(step, metrics, {"reward": rewards[-1], "kl": kls[-1], "copied": copied[-1]})
    finally:
        monitor.close()
    k = max(1, len(rewards) // 5)
    first, last = float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
    print(f"mean reward: first {k} steps {first:.3f}, last {k} steps {last:.3f}")
    print(f"digits copied: first {k} steps {float(np.mean(copied[:k])):.3f}, last {k} steps "
          f"{float(np.mean(copied[-k:])):.3f} (one constant digit: 0.1)")
    print(f"mean kl to the reference: last {k} steps {float(np.mean(kls[-k:])):.4f}")
    print(f"programs compiled: {compiled.count} over {args.steps} steps "
          f"({gen._program._cache_size()} generate program(s))")
    png = draw(out)
    if png is not None:
        print(f"curves: {png}")
    return {"first": first, "last": last, "rewards": rewards, "kl": kls, "copied": copied, "compiled": compiled.count}


if __name__ == "__main__":
    main()
