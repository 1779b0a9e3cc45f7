"""Two processes train a tiny ZeRO-3 GPT for hundreds of steps, generating and evaluating in between,
and must end with the same state on both and without a hang.

    python -m benchmarks.two_processes [--steps 300] [--every 50] [--timeout 1200]

It runs `zerojax launch -n 2` of itself (2 processes x 4 CPU devices, gloo collectives). Each
process feeds only its own rows of each batch; every `--every` steps both generate from the live
ZeRO-3 shards (greedy, then sampled with an end token: the rows end at different steps) and
evaluate a held-out batch. At the end each process hashes what it saw - every loss, eval loss and
generated token, and the parameters gathered from every process - and the hashes are compared
across processes (`process_allgather`): the command exits 0 only when they are equal, and prints
the wall time. Too slow for the CI suite (minutes on 2 cores); run it after a change to the step,
generation or collectives.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = [[5, 9, 2], [3, 3, 3, 3], [20], [33, 17, 50], [1, 2, 3, 4, 5, 6], [7], [8, 8], [40, 41, 42]]
NEW = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50, help="steps between generate + eval")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds before the launch is stopped (a hang)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import zerojax
    from zerojax.models import decode, gpt
    from zerojax.runtime.distributed import local_rows, start

    config = zerojax.load_config({
        "train_batch_size": 16, "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "mesh": {"cpu_devices": 8}, "hybrid_engine": {"enabled": True, "max_out_tokens": 16},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "model": {"name": "gpt", "vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 2}})
    start(config)
    me, n = jax.process_index(), jax.process_count()
    assert n == 2 and jax.device_count() == 8, (n, jax.device_count())
    engine = zerojax.initialize(config, params=gpt.init_params(config.model, 0), loss_fn=gpt.make_loss_fn(config.model),
                                decode=decode.decoder(config.model))
    rows = engine.train_batch_size()
    mine = local_rows(engine.plan.batch_sharding, rows)

    def batch(seed: int) -> dict:
        """A learnable global batch (each row counts up from a random start), the same on every process."""
        start_ = np.random.default_rng(seed).integers(0, 64, (rows, 1))
        return {"tokens": ((start_ + np.arange(config.model.seq_len + 1)) % 64).astype(np.int32)}

    seen = hashlib.sha256()
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = float(engine.train_batch({k: v[mine] for k, v in batch(step).items()})["loss"])
        seen.update(np.float32(loss).tobytes())
        if step % args.every == 0 or step == args.steps:
            greedy = engine.generate(PROMPTS, NEW)
            sampled = engine.generate(PROMPTS, NEW, temperature=1.0, seed=step, eos_id=int(greedy.tokens[0, 2]))
            held_out = float(engine.eval_batch({k: v[mine] for k, v in batch(10 ** 6).items()}))
            for x in (greedy.tokens, sampled.tokens, sampled.lengths, np.float32(held_out)):
                seen.update(np.asarray(x).tobytes())
            print(f"process {me} step {step}: loss {loss:.4f}, eval {held_out:.4f}, greedy row 0 "
                  f"{np.asarray(greedy.tokens[0]).tolist()}, sampled lengths {np.asarray(sampled.lengths).tolist()}",
                  flush=True)
    seconds = time.perf_counter() - t0
    whole = multihost_utils.process_allgather(engine.params, tiled=True)
    for leaf in jax.tree.leaves(whole):
        seen.update(np.asarray(leaf, np.float32).tobytes())
    digest = np.frombuffer(seen.digest(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(n, -1)
    same = all((every[i] == every[0]).all() for i in range(n))
    print(f"process {me}: {args.steps} steps in {seconds:.1f} s, state hash {seen.hexdigest()[:16]}, "
          f"{'equal on' if same else 'DIFFERENT across'} {n} processes", flush=True)
    if not same:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "zerojax.cli", "launch", "-n", "2", "--timeout", str(args.timeout),
           os.path.abspath(__file__), "--worker", "--steps", str(args.steps), "--every", str(args.every)]
    t = time.perf_counter()
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    print(f"two processes, {args.steps} steps, generate + eval every {args.every}: exit {code}, "
          f"{time.perf_counter() - t:.0f} s wall")
    return code


if __name__ == "__main__":
    sys.exit(main())
