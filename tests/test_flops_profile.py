"""DeepSpeed's flops profiler by module: each matmul of the compiled step charged to the calls in the
user's model that made it (zerojax.measure.profile), on an NNX model written the Flax way."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.app.reports import flops_profile
from zerojax.measure import hlo, profile

B, D_IN, D_HID, D_OUT = 64, 16, 32, 8


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D_IN, D_HID, rngs=rngs)
        self.down = nnx.Linear(D_HID, D_OUT, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.up(x))
        return self.down(h)


def loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _engine(stage: int, **profiler):
    params, loss_fn = zerojax.from_nnx(MLP(nnx.Rngs(0)), loss)
    config = {"train_batch_size": B, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "flops_profiler": {"enabled": True, **profiler}}
    return zerojax.initialize(config, params=params, loss_fn=loss_fn)


def _batch():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(B, D_IN)).astype(np.float32), "y": rng.normal(size=(B, D_OUT)).astype(np.float32)}


@pytest.mark.parametrize("stage", [0, 3])
def test_each_layer_is_charged_its_own_matmuls(stage):
    engine = _engine(stage)
    placed = engine.place_batch(_batch(), B)
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)  # as flops_profile compiles
    try:
        text = engine.train_step_fn.lower(engine.state, placed).compile().as_text()
    finally:
        jax.config.update("jax_compilation_cache_include_metadata_in_key", False)
    found = hlo.matmuls(text)
    assert sum(m.flops for m in found) == hlo.work(text).flops
    nodes, outside = profile.call_tree(found)
    assert outside == 0
    rows = B // engine.mesh.size  # one device's program
    # the innermost frames are the two calls in MLP.__call__, each reaching flax's Linear
    up = [n for p, n in nodes.items() if len(p) == 2 and "self.up(x)" in p[1]]
    down = [n for p, n in nodes.items() if len(p) == 2 and "self.down(h)" in p[1]]
    assert len(up) == 1 and len(down) == 1, list(nodes)
    # forward x @ W; backward dW = x^T g (the first layer needs no dx: x is data)
    assert up[0].forward == 2 * rows * D_IN * D_HID and up[0].backward == 2 * rows * D_IN * D_HID
    assert down[0].forward == 2 * rows * D_HID * D_OUT and down[0].backward == 2 * 2 * rows * D_HID * D_OUT
    top = profile.top_by_depth(nodes, 1)
    assert top[1][0].path[0].startswith("loss (test_flops_profile.py:") and top[2][0] is up[0]


def test_the_profile_text_follows_the_config():
    engine = _engine(3, top_modules=2, module_depth=2, detailed=True)
    text = flops_profile(engine, _batch(), latency=0.01)
    assert text.startswith("flops profile: ") and "top 2 module(s) by FLOPs at each depth:" in text
    assert "depth 2: MLP.__call__" in text and "depth 3" not in text  # module_depth 2
    assert "`h = jax.nn.relu(self.up(x))`" in text and "`return self.down(h)`" in text
    assert text.endswith("parameters by path: 808 in all; down.bias 8, down.kernel 256, up.bias 32, up.kernel 512")
    brief = flops_profile(_engine(0, detailed=False, module_depth=1), _batch(), latency=0.01)
    assert "by module" not in brief and "depth 1: loss" in brief and "depth 2" not in brief
    assert brief.endswith("parameters by path: 808 in all; down 264, up 544")
