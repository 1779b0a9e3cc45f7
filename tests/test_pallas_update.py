"""`kernels: pallas` inside the ZeRO step: selection, equivalence with `kernels: xla`, CUDA lowering.

On CPU `pallas` runs the kernels in interpret mode, so these runs execute the kernel bodies on each
device's own shards inside shard_map. Every stage must give the parameters, master weights and
optimizer state of the optax path (tightly: the same float32 operations, up to rounding), with the
same state pytree, so checkpoints cannot tell the paths apart. Lowering the whole step for CUDA
shows what a GPU would run: two kernel launches per step, reading and writing the state in place.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import zerojax
from helpers import ADAM, data_mesh, make_batch, make_config, mlp_params, mse_loss, to_numpy, train_steps
from zerojax.core.mesh import expert_axis
from zerojax.models import llama
from zerojax.pallas.backend import resolve
from zerojax.pallas import multi_tensor
from zerojax.core.fused_update import sum_groups
from zerojax.planner.mesh import make_mesh

TBS = 32
PARAMS0 = mlp_params(0)
BATCHES = [make_batch(TBS, i) for i in range(3)]
REL = 1e-6




def assert_states_match(got: zerojax.TrainState, want: zerojax.TrainState, rel: float = REL) -> None:
    """Same pytree (structure, dtypes, shardings); every float leaf within `rel` of its own scale;
    integer leaves (counts, steps, the scaler's counters) equal."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        where = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), where
        a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
        if not np.issubdtype(a.dtype, np.floating) and a.dtype != jnp.bfloat16:
            np.testing.assert_array_equal(a, b, err_msg=where)
        elif b.size:
            a, b = a.astype(np.float64), b.astype(np.float64)
            err, scale = np.max(np.abs(a - b)), np.max(np.abs(b))
            assert err <= rel * scale, f"{where}: max |diff| {err:.3g} > {rel} * {scale:.3g}"


# ------------------------------------------------------------------------------------------------
# Selection.

@pytest.mark.parametrize("kernels, platform, optimizer, want", [
    ("auto", "cpu", "Adam", "xla"), ("auto", "gpu", "AdamW", "triton"), ("auto", "gpu", "Lamb", "xla"),
    ("auto", "tpu", "Adam", "xla"), ("pallas", "cpu", "adam", "interpret"), ("pallas", "gpu", "Adam", "triton"),
    ("xla", "gpu", "Adam", "xla"), ("xla", "cpu", "SGD", "xla"),
])
def test_kernel_selection(kernels: str, platform: str, optimizer: str, want: str) -> None:
    assert resolve(kernels, platform, optimizer) == want


@pytest.mark.parametrize("kernels, platform, optimizer, message", [
    ("pallas", "cpu", "Lamb", r"^kernels: 'pallas' has fused kernels for Adam and AdamW only, and optimizer.type "
                              r"is 'Lamb'; use kernels: auto or xla$"),
    ("pallas", "tpu", "Adam", r"^kernels: 'pallas' runs on GPU \(Triton\) or in interpret mode on CPU, not on "
                              r"'tpu' devices; use kernels: auto or xla$"),
])
def test_kernel_selection_errors(kernels: str, platform: str, optimizer: str, message: str) -> None:
    with pytest.raises(zerojax.ConfigError, match=message):
        resolve(kernels, platform, optimizer)


def test_plan_rejects_pallas_without_a_kernel_before_compiling() -> None:
    cfg = make_config(2, optimizer={"type": "Lamb", "params": {"lr": 1e-3}}, kernels="pallas")
    with pytest.raises(zerojax.ConfigError, match="^kernels: 'pallas' has fused kernels for Adam and AdamW only"):
        zerojax.plan(cfg, data_mesh(), PARAMS0)


def test_auto_on_cpu_is_the_optax_path() -> None:
    assert zerojax.plan(make_config(1), data_mesh(), PARAMS0).kernels == "xla"
    assert zerojax.plan(make_config(1, kernels="pallas"), data_mesh(), PARAMS0).kernels == "interpret"


# ------------------------------------------------------------------------------------------------
# The kernels inside the ZeRO step equal the optax path.

CASES = {
    "stage0-fp32": dict(stage=0),
    "stage1-bf16": dict(stage=1, dtype="bf16"),
    "stage2-fp32-clipped": dict(stage=2, clip=0.05),
    "stage3-fp32-gas2": dict(stage=3, gas=2),
    "stage3-bf16": dict(stage=3, dtype="bf16"),
    # Classic Adam (L2 into the gradient, no bias correction) with OneCycle cycling beta1 per step.
    "stage1-l2-onecycle": dict(stage=1, optimizer={"type": "Adam", "params": {
        "lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False, "bias_correction": False}},
        scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                                  "cycle_first_step_size": 2}}),
}


@pytest.mark.parametrize("case", CASES)
def test_pallas_step_equals_xla_step(case: str) -> None:
    kw = {"optimizer": ADAM, **CASES[case]}
    p_pallas, s_pallas, m_pallas = train_steps(make_config(kernels="pallas", **kw), BATCHES)
    p_xla, s_xla, m_xla = train_steps(make_config(kernels="xla", **kw), BATCHES)
    assert p_pallas.kernels == "interpret" and p_xla.kernels == "xla"
    assert_states_match(s_pallas, s_xla)
    for a, b in zip(m_pallas, m_xla):
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=REL)
        np.testing.assert_allclose(a["lr"], b["lr"], rtol=0)
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=REL)
    if "clip" in kw:
        assert all(float(m["grad_norm"]) > 2 * kw["clip"] for m in m_xla), "clipping never engaged"
    moved = max(float(np.max(np.abs(np.asarray(a, np.float64) - b)))
                for a, b in zip(jax.tree.leaves(to_numpy(s_pallas.params)), jax.tree.leaves(PARAMS0)))
    assert moved > 1e-3


def poisoned(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = batch["x"].copy()
    x[5, 3] = np.inf
    return {"x": x, "y": batch["y"]}


def test_fp16_overflow_skipping_with_kernels_equals_xla() -> None:
    """The loss-scale kernel finds the overflow, the Adam kernel skips it, the scaler reacts alike."""
    kw = dict(optimizer=ADAM, gas=2, fp16={"enabled": True, "initial_scale_power": 10, "hysteresis": 1})
    bad = [BATCHES[0], poisoned(BATCHES[1]), BATCHES[1], BATCHES[2]]
    _, s_pallas, m_pallas = train_steps(make_config(2, kernels="pallas", **kw), bad)
    _, s_xla, m_xla = train_steps(make_config(2, kernels="xla", **kw), bad)
    assert [bool(m["skipped"]) for m in m_pallas] == [bool(m["skipped"]) for m in m_xla] == [False, True, False, False]
    assert [float(m["loss_scale"]) for m in m_pallas] == [float(m["loss_scale"]) for m in m_xla] == [1024, 1024, 512, 512]
    assert_states_match(s_pallas, s_xla)
    # The poisoned input feeds w_in only: the per-leaf finite check (which names culprits) agrees.
    assert int(s_pallas.skipped) == 1
    paths = zerojax.plan(make_config(2, kernels="xla", **kw), data_mesh(), PARAMS0).leaf_paths
    assert [k for k, bad in zip(paths, np.asarray(s_pallas.scaler.first_bad)) if bad] == ["['w_in']"]


# ------------------------------------------------------------------------------------------------
# Leaves split over mesh axes besides the data axes (tensor, expert, a pipeline's stage): their
# gradient statistics add up over those axes too. Each run trains a clean step, a step whose loss
# is finite but whose gradient has one NaN element in a block held away from device 0 (skipped:
# the per-leaf finiteness must see it), and a clean step; clipping is engaged on both updates.

CLIP = 0.05


def nan_gradient(leaf: jax.Array, where: jax.Array) -> jax.Array:
    """0 in value; its gradient is NaN where `where` is 1 and 0 elsewhere (d sqrt(u)/du is inf at
    u = 0, and |x - x| has slope 0 there). Elementwise on the whole leaf, so each device's block of
    the gradient is computed from its own block: the NaN lands in one block only."""
    return jnp.sum(jnp.sqrt(jnp.abs(leaf - leaf) + 1.0 - where) - jnp.sqrt(1.0 - where))


def poisonable(loss_fn: Callable[..., jax.Array], leaf: Callable[[Any], jax.Array], index: tuple[int, ...],
               local: Callable[[jax.Array], bool] = lambda x: False) -> Callable[..., jax.Array]:
    """`loss_fn` on the batch's other keys, plus a NaN gradient at `leaf(params)[index]` for a batch
    whose `poison` column is 1. Where `local(leaf)` (the loss is handed each device's own block of
    the leaf along the expert axis), only the last expert device's block gets it."""
    @functools.wraps(loss_fn)  # keeps the model's logical_axes and signature (a key as `rng`)
    def loss(params: Any, batch: dict[str, Any], **kwargs: Any) -> jax.Array:
        rest = {k: v for k, v in batch.items() if k != "poison"}
        x = leaf(params)
        flag = jnp.max(batch["poison"])
        if local(x):
            axis = expert_axis()
            flag = flag * (jax.lax.axis_index(axis) == jax.lax.axis_size(axis) - 1)
        where = jnp.zeros(x.shape, jnp.float32).at[index].set(flag)
        return loss_fn(params, rest, **kwargs) + nan_gradient(x, where)
    return loss


def with_poison(batch: dict[str, np.ndarray], value: float) -> dict[str, np.ndarray]:
    rows = len(next(iter(batch.values())))
    return {**batch, "poison": np.full((rows,), value, np.float32)}


def three_steps(batches: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Clean, poisoned, clean."""
    return [with_poison(batches[0], 0.0), with_poison(batches[1], 1.0), with_poison(batches[2], 0.0)]


def assert_fused_matches_optax(make_engine: Callable[[str], zerojax.Engine], data: Sequence[Any],
                               rel: float = REL, poisoned: Sequence[bool] = (False, True, False)) -> None:
    """The same runs with `kernels: pallas` and `xla`: the `poisoned` steps (a NaN gradient) skipped
    by both and blamed on the same leaf, the clipped gradient norms and the final states equal, to
    `rel` of each leaf's scale (a statistic summed over the wrong axes is off by far more: a missed
    skip moves every leaf by about the learning rate)."""
    runs = {}
    for kernels in ("pallas", "xla"):
        e = make_engine(kernels)
        runs[kernels] = (e, [jax.device_get(e.train_batch(b)) for b in data])
    (fused, m_fused), (optax_, m_optax) = runs["pallas"], runs["xla"]
    assert fused.plan.kernels == "interpret" and optax_.plan.kernels == "xla"
    assert [bool(m["skipped"]) for m in m_fused] == [bool(m["skipped"]) for m in m_optax] == list(poisoned)
    blamed = np.asarray(fused.state.scaler.first_bad)
    assert blamed.sum() == any(poisoned) and np.array_equal(blamed, np.asarray(optax_.state.scaler.first_bad))
    for i in (i for i, bad in enumerate(poisoned) if not bad):
        np.testing.assert_allclose(m_fused[i]["grad_norm"], m_optax[i]["grad_norm"], rtol=rel)
        assert float(m_optax[i]["grad_norm"]) > 2 * CLIP, "clipping never engaged"
    assert_states_match(fused.state, optax_.state, rel)


TP_PARAMS = mlp_params(0, divisible=True)
TP_DIMS = {"w_in": 1, "b_in": None, "layers": {"w": 1, "b": None}, "w_out": 0, "b_out": None}  # the loss's pairs


def tensor_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))


@pytest.mark.parametrize("stage, want", [
    (0, {("tensor",): ["['layers']['w']", "['w_in']", "['w_out']"]}),  # the biases are whole: no sum
    (3, {("data",): ["['b_in']", "['b_out']", "['layers']['b']"],
         ("data", "tensor"): ["['layers']['w']", "['w_in']", "['w_out']"]}),
])
def test_statistics_are_summed_once_per_set_of_split_axes(stage: int, want: dict) -> None:
    cfg = make_config(stage, optimizer=ADAM, kernels="pallas", mesh={"tensor": 2})
    plan = zerojax.plan(cfg, tensor_mesh(), TP_PARAMS, tensor_dims=TP_DIMS)
    paths = plan.leaf_paths
    assert {axes: [paths[i] for i in leaves] for axes, leaves in sum_groups(plan)} == want


@pytest.mark.parametrize("stage", [0, 3])
def test_tensor_split_leaves_with_kernels_equal_xla(stage: int) -> None:
    """data 4 x tensor 2: w_in's last column (the NaN) lives in tensor slice 1 only."""
    loss_fn = poisonable(mse_loss, lambda p: p["w_in"], (0, -1))

    def make(kernels: str) -> zerojax.Engine:
        cfg = make_config(stage, optimizer=ADAM, clip=CLIP, kernels=kernels, mesh={"tensor": 2})
        return zerojax.initialize(cfg, params=TP_PARAMS, loss_fn=loss_fn, mesh=tensor_mesh(), tensor_dims=TP_DIMS)

    assert_fused_matches_optax(make, three_steps(BATCHES))


MOE = dict(name="llama", vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_kv_heads=2, d_ff=16, n_layers=1,
           n_experts=4, experts_per_token=1, moe_aux_loss_coef=0.0, drop_tokens=False, use_rts=False)


def moe_batch(i: int) -> dict[str, np.ndarray]:
    return {"tokens": np.random.default_rng(100 + i).integers(0, 32, size=(16, 9), dtype=np.int32)}


def moe_engine(stage: int, kernels: str) -> zerojax.Engine:
    """The MoE Llama at data 4 x expert 2, with a NaN gradient on expert device 1's last expert."""
    cfg = zerojax.load_config({
        "train_batch_size": 16, "gradient_clipping": CLIP, "optimizer": ADAM, "kernels": kernels,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "mesh": {"expert": 2}, "model": MOE})
    params, loss_fn = llama.build(cfg.model, seed=0)
    loss_fn = poisonable(loss_fn, lambda p: p["layers"]["moe"]["experts"]["down"], (0, -1, 0, 0),
                         local=lambda x: x.shape[1] < MOE["n_experts"])
    return zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg))


def test_expert_weights_are_summed_over_expert_at_stage_0() -> None:
    """ZeRO-replicated at stage 0, an expert weight is still split over `expert`; the rest is whole."""
    cfg = zerojax.load_config({"train_batch_size": 16, "optimizer": ADAM, "kernels": "pallas",
                               "zero_optimization": {"stage": 0}, "mesh": {"expert": 2}, "model": MOE})
    params, loss_fn = llama.build(cfg.model, seed=0)
    plan = zerojax.plan(cfg, make_mesh(cfg), params, logical_axes=loss_fn.logical_axes)
    experts = [f"['layers']['moe']['experts']['{k}']" for k in ("down", "gate", "up")]
    assert [(axes, [plan.leaf_paths[i] for i in leaves]) for axes, leaves in sum_groups(plan)] == [(("expert",), experts)]


@pytest.mark.parametrize("stage", [0, 3])
def test_expert_split_leaves_with_kernels_equal_xla(stage: int) -> None:
    """At stage 0 the expert weights are ZeRO-replicated but split over `expert`. Within 1e-5: gradient
    elements near Adam's eps take sign-like first updates, where the two compiled steps' rounding
    shows at up to ~1e-6 of a leaf's scale."""
    make = functools.partial(moe_engine, stage)
    assert_fused_matches_optax(make, three_steps([moe_batch(i) for i in range(3)]), rel=1e-5)


class Flagged(nnx.Module):
    """A Linear layer whose kernel's gradient is NaN at [0, 0] where its input reaches |x| = 1 (the
    poisoned batch saturates the tanh before it); its output is the Linear's."""

    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.linear.kernel[...]
        flag = (jnp.max(jnp.abs(x)) >= 1.0).astype(jnp.float32)
        return self.linear(x) + nan_gradient(kernel, jnp.zeros(kernel.shape).at[0, 0].set(flag))


def pipe_inputs(batch: dict[str, Any]) -> jax.Array:
    return batch["x"]


def pipe_mse(out: jax.Array, batch: dict[str, Any]) -> jax.Array:
    return jnp.mean((out - batch["y"]) ** 2)


# Two stages: [inputs, Linear(8, 16), tanh] and [Flagged(16, 8)], so the NaN is in stage 1's row.
PIPE = zerojax.PipelineModule([pipe_inputs, zerojax.LayerSpec(nnx.Linear, 8, 16), jnp.tanh,
                               zerojax.LayerSpec(Flagged, 16, 8)], loss_fn=pipe_mse)


def pipe_batches(rows: int) -> list[dict[str, np.ndarray]]:
    """Clean, poisoned (a column of 50s saturates the tanh), clean."""
    out = []
    for i in range(3):
        x = np.random.default_rng(200 + i).normal(size=(rows, 8)).astype(np.float32)
        out.append({"x": x, "y": np.tanh(1.5 * x[:, ::-1])})
    out[1]["x"][:, 0] = 50.0
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_rows_with_kernels_equal_xla(stage: int) -> None:
    """configs/pipeline.yaml's shape: stage 2 x data 4, 1F1B, ZeRO 0-1. The rows are split over `stage`:
    stage 1's NaN must stop the step on stage 0 too, and the norm add both stages' rows."""
    def make(kernels: str) -> zerojax.Engine:
        cfg = zerojax.load_config({
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "optimizer": ADAM,
            "gradient_clipping": CLIP, "kernels": kernels, "zero_optimization": {"stage": stage},
            "mesh": {"stage": 2, "data": 4}, "pipeline": {"schedule": "1f1b"}})
        return zerojax.initialize(cfg, model=PIPE, params=PIPE.init(0))

    engine = make("xla")
    assert [engine.pipeline.rows.owner(k) for k in sorted(PIPE.abstract_params())] == [0, 1]
    assert_fused_matches_optax(make, pipe_batches(engine.train_batch_size()))


GPT = dict(name="gpt", vocab_size=64, seq_len=16, d_model=32, n_heads=4, d_ff=64, n_layers=2, tie_embeddings=False)


def test_pipeline_rows_split_over_tensor_with_kernels_equal_xla() -> None:
    """stage 2 x data 2 x tensor 2, the GPT's layers as stage rows [S, tensor, width]: whole leaves
    (norms, biases of row-parallel layers) are copied into both tensor slices, and the plan's own
    norm counts them once; the fused update must too."""
    from zerojax.models import gpt

    def make(kernels: str) -> zerojax.Engine:
        cfg = zerojax.load_config({
            "train_batch_size": 16, "gradient_accumulation_steps": 2, "optimizer": ADAM, "gradient_clipping": CLIP,
            "kernels": kernels, "zero_optimization": {"stage": 1}, "mesh": {"stage": 2, "tensor": 2},
            "pipeline": {"schedule": "1f1b"}, "model": GPT})
        devices = np.array(jax.devices()).reshape(2, 2, 2)
        return zerojax.initialize(cfg, model=gpt.pipeline_module(cfg.model), mesh=Mesh(devices, ("stage", "data", "tensor")))

    tokens = [{"tokens": np.random.default_rng(7 + i).integers(0, 64, size=(16, 17), dtype=np.int32)} for i in range(2)]
    assert_fused_matches_optax(make, tokens, poisoned=(False, False))


# ------------------------------------------------------------------------------------------------
# The step as a GPU would run it, lowered for CUDA on this machine.

TENSOR = re.compile(r"tensor<([0-9x]*)x?(f32|bf16|f16)>")
BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def kernel_calls(text: str) -> list[str]:
    return [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]


def call_bytes(line: str) -> int:
    """Bytes of every operand and result of a custom call (from its type signature)."""
    signature = line[line.rindex("} :") + 3:]
    total = 0
    for dims, dtype in TENSOR.findall(signature):
        total += int(np.prod([int(d) for d in dims.split("x") if d])) * BYTES[dtype]
    return total


@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (3, "bf16")])
def test_step_lowers_for_cuda_with_two_launches_in_place(stage: int, dtype: str) -> None:
    # Stage-3 prefetch joins the peeled first/last layer to the scanned ones (a concatenate of layer
    # slices, tests/test_user_models.py); off here, so every concatenate left is the update's own.
    cfg = make_config(stage, dtype=dtype, optimizer=ADAM, kernels="pallas", zero_optimization={
        "stage": stage, "stage3_param_persistence_threshold": 0, "overlap_comm": False})
    p = zerojax.plan(cfg, data_mesh(), PARAMS0).with_kernels("triton")
    state = zerojax.init_state(cfg, p, PARAMS0)
    text = zerojax.make_train_step(cfg, p, mse_loss).trace(state, BATCHES[0]).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = kernel_calls(text)
    assert len(calls) == 2  # gradient statistics, then Adam: for all leaves at once
    stats, adam = sorted(calls, key=len)
    leaves = len(jax.tree.leaves(PARAMS0))
    assert len(re.findall(r"output_operand_alias<", adam)) == 3 * leaves
    # No flat copy of the state is built: any concatenation is of per-leaf scalars.
    for line in text.splitlines():
        if "stablehlo.concatenate" in line:
            sizes = [int(np.prod([int(d) for d in dims.split("x") if d])) for dims, _ in
                     TENSOR.findall(line[line.rindex(":"):])]
            assert max(sizes) <= 2 * leaves, line.strip()[:200]
    # Bytes per parameter the Adam kernel moves on one device: read p, g, m, v, write p, m, v
    # (fp32: 28 B); bf16 reads a 2-byte gradient and also writes the 2-byte copy the gather sends.
    local = [int(np.prod(s.shard_shape(x.shape))) for x, s in
             zip(jax.tree.leaves(p.abstract_params), jax.tree.leaves(p.update_shardings))]
    scalars = 16 * 4  # the runtime-scalar operand
    assert call_bytes(adam) - scalars == 28 * sum(local)
    # The statistics kernel reads the gradient once and writes two floats per block.
    grad_bytes = 4 if dtype == "fp32" else 2
    programs = sum(-(-n // multi_tensor.BLOCK) for n in local)
    assert call_bytes(stats) == 4 + grad_bytes * sum(local) + 2 * 4 * programs
