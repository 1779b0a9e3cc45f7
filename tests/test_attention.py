"""Blockwise causal attention (online softmax, memory linear in T) against the dense form: the same loss
and gradients for the Llama (grouped-query heads, a loss mask, a length the block does not divide) and
the GPT, on Ulysses over tensor slices, and a compiled step whose temporaries shrink with it."""
from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from helpers import assert_tree_close, to_numpy
from zerojax.config import ModelConfig
from zerojax.errors import ConfigError
from zerojax.models import attention, gpt, llama
from zerojax.planner.mesh import make_mesh

LLAMA = dict(name="llama", vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2)


def qkv(t: int, dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q with 4 heads over k and v with 2 (grouped-query), [2, t, heads, 16]."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kq, (2, t, 4, 16), dtype), jax.random.normal(kk, (2, t, 2, 16), dtype),
            jax.random.normal(kv, (2, t, 2, 16), dtype))


def value_and_grads(fn: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, Any]:
    """A loss that weighs every output element differently, and its gradients in q, k and v."""
    w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32).reshape(q.shape))
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("t", [32, 29])  # 4 blocks of 8; and a length padded to 4 blocks
def test_blockwise_equals_dense_with_grouped_heads(t: int) -> None:
    q, k, v = qkv(t)
    want, want_grads = value_and_grads(attention.dense, q, k, v)
    got, got_grads = value_and_grads(lambda *a: attention.blockwise(*a, block=8), q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_blockwise_is_causal() -> None:
    """Changing the keys and values after position p leaves the outputs up to p as they were."""
    q, k, v = qkv(20)
    p = 11
    k2, v2 = k.at[:, p + 1:].multiply(-3.0), v.at[:, p + 1:].add(5.0)
    run = jax.jit(lambda *a: attention.blockwise(*a, block=8))
    before, after = run(q, k, v), run(q, k2, v2)
    np.testing.assert_allclose(after[:, :p + 1], before[:, :p + 1], atol=1e-6)
    assert not np.allclose(after[:, p + 1:], before[:, p + 1:])


def test_blockwise_in_bf16_is_close_to_dense() -> None:
    q, k, v = qkv(32, jnp.bfloat16)
    got, want = jax.jit(lambda *a: attention.blockwise(*a, block=8))(q, k, v), jax.jit(attention.dense)(q, k, v)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=3e-2)


def test_auto_is_dense_up_to_one_block() -> None:
    assert not attention.uses_blockwise("auto", 512, 512) and attention.uses_blockwise("auto", 512, 513)
    assert attention.uses_blockwise("blockwise", 512, 16) and not attention.uses_blockwise("dense", 8, 4096)


def llama_loss_and_grads(t: int, **model: Any) -> tuple[jax.Array, Any]:
    cfg = ModelConfig(**LLAMA, seq_len=t, **model)
    graphdef, params = nnx.split(llama.Llama(cfg, rngs=nnx.Rngs(params=0)))
    rng = np.random.default_rng(0)
    batch = {"tokens": jnp.asarray(rng.integers(0, 64, (2, t + 1)), jnp.int32),
             "loss_mask": jnp.asarray(rng.random((2, t)) > 0.2, jnp.float32)}  # dropped predictions
    return jax.jit(jax.value_and_grad(lambda p: llama.loss(nnx.merge(graphdef, p), batch)))(params)


def test_llama_blockwise_loss_and_gradients_equal_dense() -> None:
    want, want_grads = llama_loss_and_grads(30, attention="dense")
    got, got_grads = llama_loss_and_grads(30, attention="blockwise", attention_block=8)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_tree_close(to_numpy(nnx.to_pure_dict(got_grads)), to_numpy(nnx.to_pure_dict(want_grads)), rtol=1e-4,
                      atol=1e-6, what="llama gradients, blockwise vs dense")


def test_gpt_blockwise_loss_and_gradients_equal_dense() -> None:
    def run(**model: Any) -> tuple[jax.Array, Any]:
        cfg = ModelConfig(name="gpt", vocab_size=64, seq_len=32, d_model=32, n_heads=4, d_ff=64, n_layers=2, **model)
        tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 33)), jnp.int32)
        return jax.jit(jax.value_and_grad(gpt.make_loss_fn(cfg)))(gpt.init_params(cfg, 0), {"tokens": tokens})

    want, want_grads = run(attention="dense")
    got, got_grads = run(attention="blockwise", attention_block=8)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_tree_close(to_numpy(got_grads), to_numpy(want_grads), rtol=1e-4, atol=1e-6, what="gpt gradients")


def test_ulysses_over_tensor_slices_with_blockwise_attention_equals_one_dense_device(
        caplog: pytest.LogCaptureFixture) -> None:
    """data 2 x sequence 2 x tensor 2: the blockwise scans run on each tensor slice's heads, for the whole
    sequence gathered by Ulysses' all-to-alls, and train as one device with the dense attention does."""
    def trained(n: int, sp: int, tensor: int, **model: Any) -> tuple[list[float], Any]:
        cfg = zerojax.load_config({
            "train_batch_size": 4, "gradient_clipping": 0.0, "sequence_parallel_size": sp,
            "mesh": {"tensor": tensor} if tensor > 1 else {},
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 1},
            "model": dict(name="llama", vocab_size=64, seq_len=16, d_model=32, n_heads=8, n_kv_heads=4, d_ff=64,
                          n_layers=1, **model)})
        params, loss_fn = llama.build(cfg.model, seed=0)
        e = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg, jax.devices()[:n]))
        rng = np.random.default_rng(3)
        loss = float(e.train_batch({"tokens": rng.integers(0, 64, (4, 17), dtype=np.int32)})["loss"])
        return loss, to_numpy(e.params)

    want = trained(1, 1, 1, attention="dense")
    with caplog.at_level(logging.WARNING, logger="zerojax.rewrite.tensor_slices"):
        got = trained(8, 2, 2, attention="blockwise", attention_block=4)
    assert not caplog.records  # every equation, the scans' included, ran on tensor slices
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert_tree_close(got[1], want[1], rtol=1e-4, atol=1e-5, what="sequence 2 x tensor 2, blockwise")


def test_blockwise_step_needs_far_less_temporary_memory() -> None:
    """A compiled value-and-grad at T=512: the dense form holds [heads, T, T] scores, the blockwise one
    [heads, 64, 64] tiles."""
    def temp_bytes(mode: str) -> int:
        cfg = ModelConfig(**{**LLAMA, "n_layers": 1}, seq_len=512, attention=mode, attention_block=64)
        graphdef, params = nnx.split(llama.Llama(cfg, rngs=nnx.Rngs(params=0)))

        def loss(p: Any, tokens: jax.Array) -> jax.Array:
            return llama.loss(nnx.merge(graphdef, p), {"tokens": tokens})

        tokens = jax.ShapeDtypeStruct((1, 513), jnp.int32)
        compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    dense, blockwise = temp_bytes("dense"), temp_bytes("blockwise")
    assert blockwise < 0.5 * dense, (blockwise, dense)


def test_an_unknown_attention_form_is_one_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="model.attention"):
        zerojax.load_config({"train_batch_size": 8, "model": {"attention": "flash"}})


def _shapes(jaxpr: Any, out: set[tuple[int, ...]]) -> set[tuple[int, ...]]:
    """Every value's shape in `jaxpr` and the jaxprs inside it (jit, shard_map, scan, remat)."""
    for eqn in jaxpr.eqns:
        out.update(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _shapes(inner, out)
    return out


def test_model_attention_set_on_the_command_line_reaches_the_ulysses_step() -> None:
    """configs/long_context.yaml shrunk, with `--set model.attention=dense | blockwise`: the model train.py
    builds (the Llama through from_nnx, attention inside Ulysses' all-to-alls on a sequence axis of 4)
    traces the chosen form into its step: the dense form's [.., T, T] scores, or the blockwise form's
    [.., block, block] tiles and no [T, T] value. In fp32 the two losses can agree to the last bit at
    such sizes (measured: 5 steps of this config, identical losses, step 5's grad_norm one ulp apart),
    so the forms are told apart by the traced step and by the logits, which differ by float32
    rounding only."""
    from zerojax.app.trainer import build_model
    from zerojax.core.state import init_state
    from zerojax.planner.api import make_train_step

    t, block = 64, 8
    logits, traced = {}, {}
    for mode in ("dense", "blockwise"):
        cfg = zerojax.load_config("configs/long_context.yaml", [
            f"model.attention={mode}", f"model.seq_len={t}", f"model.attention_block={block}", "model.d_model=32",
            "model.d_ff=96", "model.n_layers=1", "bf16.enabled=false"])
        mesh = make_mesh(cfg)
        assert dict(mesh.shape)["sequence"] == 4
        model = build_model(cfg, mesh)
        state = jax.eval_shape(lambda: init_state(model.plan, model.params))
        step = make_train_step(model.plan, model.loss_fn)
        batch = {"tokens": jax.ShapeDtypeStruct((4, t + 1), jnp.int32)}
        traced[mode] = {s[-2:] for s in _shapes(jax.make_jaxpr(step)(state, batch).jaxpr, set()) if len(s) >= 2}
        graphdef, params = nnx.split(llama.constructor(cfg.model, cfg.run.seed)())
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, t)), jnp.int32)
        logits[mode] = np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(tokens))(params))
    assert (t, t) in traced["dense"] and (block, block) not in traced["dense"]
    assert (block, block) in traced["blockwise"] and (t, t) not in traced["blockwise"]
    gap = float(np.abs(logits["dense"] - logits["blockwise"]).max())
    assert 0 < gap < 1e-5, gap


@pytest.mark.parametrize("window,scale", [(None, None), (5, None), (None, 0.3)])
def test_fused_equals_dense_with_grouped_heads(window: Any, scale: Any) -> None:
    """jax.nn.dot_product_attention (cuDNN's flash attention on a GPU, XLA here) is the same attention:
    grouped heads, Mistral's sliding window and a given scale mean what `dense`'s do."""
    q, k, v = qkv(24)
    want, want_grads = value_and_grads(lambda *a: attention.dense(*a, window=window, scale=scale), q, k, v)
    got, got_grads = value_and_grads(lambda *a: attention.causal(*a, mode="fused", window=window, scale=scale), q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_fused_runs_soft_capped_or_per_layer_windows_as_auto() -> None:
    """What dot_product_attention cannot express (Gemma's soft-capping, a window traced per layer) is not
    dropped: that attention runs in the form auto picks, with the cap and the window."""
    q, k, v = qkv(24)
    capped = jax.jit(lambda *a: attention.causal(*a, mode="fused", softcap=2.0))(q, k, v)
    np.testing.assert_allclose(capped, attention.dense(q, k, v, softcap=2.0), rtol=1e-5, atol=1e-6)
    traced = jax.jit(lambda w, *a: attention.causal(*a, mode="fused", window=w))(jnp.int32(5), q, k, v)
    np.testing.assert_allclose(traced, attention.dense(q, k, v, window=5), rtol=1e-5, atol=1e-6)
    assert not np.allclose(capped, attention.dense(q, k, v), atol=1e-3)


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_model_attention_fused_trains_as_dense(name: str) -> None:
    if name == "llama":
        want, want_grads = llama_loss_and_grads(30, attention="dense")
        got, got_grads = llama_loss_and_grads(30, attention="fused")
        want_grads, got_grads = nnx.to_pure_dict(want_grads), nnx.to_pure_dict(got_grads)
    else:
        def run(**model: Any) -> tuple[jax.Array, Any]:
            cfg = ModelConfig(name="gpt", vocab_size=64, seq_len=32, d_model=32, n_heads=4, d_ff=64, n_layers=2, **model)
            tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 33)), jnp.int32)
            return jax.jit(jax.value_and_grad(gpt.make_loss_fn(cfg)))(gpt.init_params(cfg, 0), {"tokens": tokens})
        want, want_grads = run(attention="dense")
        got, got_grads = run(attention="fused")
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_tree_close(to_numpy(got_grads), to_numpy(want_grads), rtol=1e-4, atol=1e-6, what=f"{name} gradients, fused")


def test_fused_asks_for_cudnn_only_where_it_applies() -> None:
    """JAX's dot_product_attention runs XLA's form unless cuDNN is asked for by name: 16-bit inputs on a
    GPU with a head width cuDNN takes get it; everything else (this CPU, float32) XLA's."""
    assert attention.cudnn_applies(jnp.bfloat16, 64, "gpu") and attention.cudnn_applies(jnp.float16, 128, "cuda")
    assert not attention.cudnn_applies(jnp.float32, 64, "gpu") and not attention.cudnn_applies(jnp.bfloat16, 64, "cpu")
    assert not attention.cudnn_applies(jnp.bfloat16, 256, "gpu") and not attention.cudnn_applies(jnp.bfloat16, 60, "gpu")
    assert not attention.cudnn_applies(jnp.bfloat16, 64)  # this machine's backend


def test_auto_takes_cudnn_where_it_applies_and_its_own_forms_where_cudnn_refuses(monkeypatch) -> None:
    """On a GPU `auto` asks cuDNN first (4.2x the blockwise form's tokens/s at 2048 tokens on an H200); a
    shape cuDNN refuses, or a machine without it, keeps blockwise past one block and dense below."""
    asked = []

    def library(q, k, v, *, scale, is_causal, local_window_size, implementation):
        asked.append(implementation)
        if implementation == "cudnn" and q.shape[1] == 24:
            raise NotImplementedError("cuDNN refuses this shape")
        return attention.dense(q, k, v) * (2.0 if implementation == "cudnn" else 1.0)  # tell them apart

    monkeypatch.setattr(attention, "cudnn_applies", lambda dtype, head_dim, backend=None: True)
    monkeypatch.setattr(jax.nn, "dot_product_attention", library)
    q, k, v = qkv(16)
    np.testing.assert_allclose(attention.causal(q, k, v, "auto", block=8), 2.0 * attention.dense(q, k, v), rtol=1e-6)
    assert asked == ["cudnn"]
    q, k, v = qkv(24)  # refused: blockwise, since 24 tokens are more than one block of 8
    np.testing.assert_allclose(attention.causal(q, k, v, "auto", block=8), attention.blockwise(q, k, v, 8), rtol=1e-6)
    np.testing.assert_allclose(attention.causal(q, k, v, "fused", block=8), attention.dense(q, k, v), rtol=1e-6)
    assert asked == ["cudnn", "cudnn", "cudnn", "xla"]
    asked.clear()
    attention.causal(q, k, v, "auto", block=8, softcap=2.0)  # what cuDNN cannot express is never sent
    assert asked == []


def test_auto_keeps_the_plain_forms_under_a_tensor_axis(monkeypatch) -> None:
    """The tensor-slice evaluator has no rule for cuDNN's call (it would gather every head), so under a
    tensor axis `auto` does not ask for it."""
    from jax.sharding import Mesh, PartitionSpec as P
    asked = []
    monkeypatch.setattr(attention, "cudnn_applies", lambda dtype, head_dim, backend=None: True)
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, implementation, **k: asked.append(implementation))
    q, k, v = qkv(16)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    run = jax.shard_map(lambda *a: attention.causal(*a, "auto", block=8), mesh=mesh, in_specs=P(), out_specs=P(),
                        check_vma=False)
    np.testing.assert_allclose(run(q, k, v), attention.blockwise(q, k, v, 8), rtol=1e-6)
    assert asked == []
    attention.causal(q, k, v, "auto", block=8)  # no tensor axis: asked
    assert asked == ["cudnn"]
