"""RLHF with one engine: GRPO on the embedded GPT, generating and training on the same ZeRO-3 shards.

    python examples/rlhf.py [--steps 30] [--out runs/rlhf] [--seed 0] [--lora R]
    zerojax plot runs/rlhf -o runs/rlhf/curves.png      (loss, reward, KL, ...)

Each step: `engine.generate` samples GROUP completions of every prompt from the live weights (the
shards gathered once inside the generate program), a rule scores them (the reward is the share of
the NEW tokens that are TARGET: something a tiny untrained model finds within tens of steps), the
rewards are normalised within each prompt's group, and `engine.train_batch` takes one step of
GRPO's clipped policy-gradient loss with a KL term to the starting policy
(`zerojax.models.rl.make_grpo_loss`, which recomputes the completions' log-probabilities under the
current weights inside the train step).

The reference policy costs no device memory while the loop trains or generates: its parameters are
a host numpy copy (`zerojax.models.rl.Reference`), put onto the devices in the policy's ZeRO-3
shards for the one forward that scores a batch, and deleted before the train step runs. With `--lora R`
only rank-R adapters train (the `lora` section; the base frozen) and the reference is the policy's own
base, its adapters switched off (`zerojax.models.rl.BaseReference`): no copy of the weights at all. The reward
and the KL (k3 estimate, per generated token, of the sampling policy against the reference) are
written with the step's own metrics to OUT/metrics.jsonl by the trainer's Monitor, so
`zerojax plot OUT` draws them.
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zerojax  # noqa: E402

zerojax.request_cpu_devices(8)  # on a CPU-only machine: 8 virtual devices, before JAX starts

import numpy as np  # noqa: E402

from zerojax.app.monitor import Monitor  # noqa: E402
from zerojax.models import decode, gpt, rl  # noqa: E402
from zerojax.runtime.compile_cache import Compilations  # noqa: E402

PROMPTS, GROUP, NEW = 4, 8, 8   # prompts per step, completions per prompt, new tokens per completion
PROMPT_MAX = 6                  # prompts hold 2..PROMPT_MAX tokens (the batch's width is fixed)
TARGET, EOS = 3, 0              # the rewarded token; the end token (a row stops after it)


def make_config(steps: int, lora_rank: int = 0) -> zerojax.Config:
    lora = {"lora": {"enabled": True, "r": lora_rank, "lora_alpha": 2 * lora_rank}} if lora_rank else {}
    return zerojax.load_config({**lora,
        "train_batch_size": PROMPTS * GROUP, "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 5e-2 if lora_rank else 1e-2}},  # adapters take a larger lr
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, "max_out_tokens": PROMPT_MAX + NEW},
        "model": {"name": "gpt", "vocab_size": 16, "seq_len": PROMPT_MAX + NEW, "d_model": 32, "n_heads": 2,
                  "n_layers": 2, "remat": False},
        "steps_per_print": max(1, steps // 10), "run": {"progress": False, "log_every": 1}})


def reward(tokens: np.ndarray) -> np.ndarray:
    """The share of each row's NEW slots holding TARGET (slots after an early eos hold eos: no reward)."""
    return (tokens == TARGET).mean(axis=1).astype(np.float32)


def sample_prompts(rng: np.random.Generator, vocab: int) -> list[list[int]]:
    """PROMPTS random prompts of 2..PROMPT_MAX tokens (no eos, no target), each repeated GROUP times."""
    prompts = [list(rng.integers(4, vocab, rng.integers(2, PROMPT_MAX + 1))) for _ in range(PROMPTS)]
    return [p for p in prompts for _ in range(GROUP)]


def padded(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """[B, PROMPT_MAX] right-padded prompts and their lengths (a fixed width: one train-step program)."""
    out = np.zeros((len(prompts), PROMPT_MAX), np.int32)
    for r, p in enumerate(prompts):
        out[r, :len(p)] = p
    return out, np.asarray([len(p) for p in prompts], np.int32)


def masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    return float((x * mask).sum() / max(mask.sum(), 1.0))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=os.path.join("runs", "rlhf"), help="folder of metrics.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", type=int, default=0, metavar="R",
                        help="train only rank-R LoRA adapters; the reference is the frozen base (default 0: "
                             "train every weight)")
    args = parser.parse_args(argv)

    config = make_config(args.steps, args.lora)
    cfg = config.model
    engine = zerojax.initialize(config, params=gpt.init_params(cfg, args.seed), loss_fn=rl.make_grpo_loss(cfg),
                                decode=decode.decoder(cfg))
    reference = rl.reference(cfg, engine)  # a host copy, or with --lora the policy's own base
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    monitor = Monitor(config, out, args.steps, PROMPTS * GROUP * NEW, PROMPTS * GROUP)
    rng = np.random.default_rng(args.seed)
    rewards = []
    try:
        with Compilations() as compiled:  # prompts of 2..PROMPT_MAX tokens share one generate program
            for step in range(1, args.steps + 1):
                prompts = sample_prompts(rng, cfg.vocab_size)
                gen = engine.generate(prompts, NEW, temperature=1.0, seed=args.seed * 100_003 + step, eos_id=EOS)
                tokens, logps, lengths = (np.asarray(x) for x in gen)
                score = reward(tokens)
                batch = rl.rollout_batch(*padded(prompts), tokens, lengths, logps)
                batch["ref_logp"] = reference.logprobs(batch["tokens"])
                batch["advantages"] = rl.group_advantages(score, GROUP)
                kl = masked_mean(np.asarray(rl.kl_k3(batch["old_logp"], batch["ref_logp"])), batch["mask"])
                metrics = engine.train_batch(batch)
                rewards.append(float(score.mean()))
                monitor.step(step, metrics, {"reward": rewards[-1], "kl": kl})
    finally:
        monitor.close()
    k = max(1, len(rewards) // 5)
    first, last = float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
    print(f"mean reward: first {k} steps {first:.3f}, last {k} steps {last:.3f}")
    print(f"programs compiled: {compiled.count} over {args.steps} steps")
    print(f"curves: zerojax plot {out} -o {out / 'curves.png'}")
    return {"first": first, "last": last, "rewards": rewards}


if __name__ == "__main__":
    main()
