"""zerojax as a library inside a hand-written Flax NNX + optax loop.

    python examples/flax_loop.py [--stage 3] [--steps 40]

You keep your model, your loss and your loop; zerojax supplies the layout (`plan`), the sharded
state (`init_state`) and one jitted step (`make_train_step`). Nothing else of zerojax is used.
The model is given as a constructor, so it is built straight into its shards (DeepSpeed's
`zero.Init`): no device ever holds the whole model, and the loss needs no changes for ZeRO-3
(each parameter is gathered where it is used).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zerojax  # noqa: E402

zerojax.request_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402


class TinyLM(nnx.Module):
    """A bigram-plus-MLP byte model: small, but every parameter is a matrix worth sharding."""

    def __init__(self, vocab: int, width: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.mlp = nnx.Linear(width, 4 * width, rngs=rngs)
        self.proj = nnx.Linear(4 * width, width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        h = self.embed(tokens)
        h = h + self.proj(nnx.relu(self.mlp(h)))
        return self.head(h).astype(jnp.float32)


def loss(model: TinyLM, batch: dict) -> jnp.ndarray:
    logits = model(batch["tokens"][:, :-1])
    labels = jax.nn.one_hot(batch["tokens"][:, 1:], logits.shape[-1])
    return -(labels * jax.nn.log_softmax(logits)).sum(-1).mean()


def text_batches(rows: int, length: int, seed: int):
    """Windows of this file's own bytes: a corpus every machine has."""
    data = np.frombuffer(open(__file__, "rb").read(), dtype=np.uint8)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - length - 1, size=rows)
        yield {"tokens": data[starts[:, None] + np.arange(length + 1)].astype(np.int32)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)

    config = zerojax.load_config({
        "train_batch_size": 32,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
    })
    mesh = zerojax.make_mesh(config)

    def make_model() -> TinyLM:
        return TinyLM(256, 64, rngs=nnx.Rngs(0))

    params, loss_fn = zerojax.from_nnx(make_model, loss)  # nothing built yet: shapes only

    plan = zerojax.plan(config, mesh, params)
    print(plan.report().table())
    state = zerojax.init_state(config, plan, params)
    step = zerojax.make_train_step(config, plan, loss_fn)

    data = text_batches(plan.batch.train_batch_size, 64, seed=0)
    losses = []
    for i in range(args.steps):
        state, metrics = step(state, next(data))
        losses.append(float(metrics["loss"]))
        if i % 10 == 0:
            print(f"step {i}: loss {losses[-1]:.4f} grad_norm {float(metrics['grad_norm']):.3f}")
    # the fp32 master weights into a module: the state itself (its `master` is None in an fp32 run,
    # where the parameters are their own master copy)
    model = zerojax.to_nnx(make_model, state)
    print(f"trained module: {type(model).__name__}, head kernel {model.head.kernel[...].shape}")
    print(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")
    return {"first": losses[0], "last": losses[-1]}


if __name__ == "__main__":
    main()
