"""Porting a DeepSpeed training script: the same JSON config, the same engine calls.

    python examples/port_from_deepspeed.py [--steps 30]

The DeepSpeed version of this loop reads
    engine, _, _, _ = deepspeed.initialize(model=model, config="ds_config.json", ...)
    loss = engine(batch); engine.backward(loss); engine.step()
In zerojax the forward, backward and step are one pure function, so a step is `train_batch`.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zerojax  # noqa: E402

zerojax.request_cpu_devices(8)  # on a CPU-only machine: 8 virtual devices, before JAX starts

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402


class MLP(nnx.Module):
    """A small classifier standing in for the user's torch.nn.Module."""

    def __init__(self, features: int, hidden: int, classes: int, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(features, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return self.head(nnx.gelu(self.fc2(nnx.gelu(self.fc1(x)))))


def cross_entropy(model: MLP, batch: dict) -> jnp.ndarray:
    logits = model(batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_data(rows: int, features: int, classes: int, seed: int) -> dict:
    """A learnable toy task: the label is the argmax of a fixed projection of the input."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    w = np.random.default_rng(1234).normal(size=(features, classes)).astype(np.float32)
    return {"x": x, "y": (x @ w).argmax(-1).astype(np.int32)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "ds_config.json"))
    args = parser.parse_args(argv)

    # DeepSpeed builds big models under `deepspeed.zero.Init()`; here a constructor does the same:
    # the engine runs it straight into the ZeRO shards of the config's stage.
    def make_model() -> MLP:
        return MLP(32, 256, 8, rngs=nnx.Rngs(0))

    params, loss_fn = zerojax.from_nnx(make_model, cross_entropy)
    engine = zerojax.initialize(args.config, params=params, loss_fn=loss_fn)
    rows = engine.train_batch_size()
    print(f"ZeRO stage {engine.zero_optimization_stage()}, batch {rows} = micro "
          f"{engine.train_micro_batch_size_per_gpu()} x accumulation {engine.gradient_accumulation_steps()} "
          f"x data {engine.plan.data_size}")
    losses = []
    for step in range(args.steps):
        metrics = engine.train_batch(make_data(rows, 32, 8, seed=step))
        losses.append(float(metrics["loss"]))
        if (step + 1) % engine.config.steps_per_print == 0:
            print(f"step {engine.global_steps}: loss {losses[-1]:.4f}, lr {engine.get_lr()[0]:.2e}")
    val = float(engine.eval_batch(make_data(256, 32, 8, seed=10_000)))
    model = zerojax.to_nnx(make_model, engine.params)  # trained weights in an NNX module
    print(f"trained module: {type(model).__name__}, fc1 kernel {model.fc1.kernel[...].shape}")
    print(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}, validation loss {val:.4f}")
    return {"first": losses[0], "last": losses[-1], "val": val}


if __name__ == "__main__":
    main()
