"""`zerojax estimate`: DeepSpeed's estimator formulas, plan-exact bytes against the compiled step,
Hugging Face parameter counts, the recommendation, HLO work counting, the step-time model and the
tensor-parallel rows."""
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.tools import estimate as E
from zerojax.tools.estimate import axes as AX, tensor as TP
from zerojax.measure import hlo
from zerojax.app.cli import main
from zerojax.config import load_config
from zerojax.errors import ConfigError
from zerojax.planner.plan import make_plan
from zerojax.planner.mesh import make_mesh
from zerojax.models import gpt
from zerojax.planner.settings import policy
from zerojax.core.state import abstract_state
from zerojax.planner.api import make_train_step

FIXTURES = Path(__file__).parent / "fixtures"
TINY = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage3_param_persistence_threshold": 0},
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 8, "vocab_size": 64}}


# ---------------------------------------------------------------------------------------------
# DeepSpeed's formulas.

def test_deepspeed_formulas_equal_deepspeed_outputs() -> None:
    """Every case recorded from DeepSpeed's own functions (tests/fixtures/make_deepspeed_estimates.py)."""
    ref = json.loads((FIXTURES / "deepspeed_estimates.json").read_text())
    assert len(ref["zero2"]) == 100 and len(ref["zero3"]) == 400
    for r in ref["zero2"]:
        assert E.deepspeed_zero2(r["total_params"], r["num_gpus_per_node"], r["num_nodes"], r["cpu_offload"],
                                 r["additional_buffer_factor"]) == (r["cpu_mem"], r["gpu_mem"]), r
    for r in ref["zero3"]:
        got = E.deepspeed_zero3(r["total_params"], r["largest_layer_params"], r["num_gpus_per_node"], r["num_nodes"],
                                r["cpu_offload"], r["cpu_offload_params"], r["zero_init"],
                                r["additional_buffer_factor"])
        assert got == (r["cpu_mem"], r["gpu_mem"], r["largest_layer_memory"]), r


def test_deepspeed_formulas_by_hand() -> None:
    total, largest, per_node, nodes = 10**9, 5 * 10**7, 8, 2
    # ZeRO-2, no offload: 2 bytes/param of fp16 params + 18 bytes/param over 16 GPUs; CPU 4 per GPU x 1.5.
    assert E.deepspeed_zero2(total, per_node, nodes, cpu_offload=False) == (48 * 10**9, 2 * 10**9 + 1_125_000_000)
    # ZeRO-2, offload: 2 bytes/param on the GPU; CPU max(4 x 16 GPUs, 16) = 64 bytes/param x 1.5.
    assert E.deepspeed_zero2(total, per_node, nodes, cpu_offload=True) == (96 * 10**9, 2 * 10**9)
    # ZeRO-3, params and optimizer offloaded, zero_init: largest layer x 4 on the GPU, 18/2 nodes x 1.5 on the CPU.
    assert E.deepspeed_zero3(total, largest, per_node, nodes) == (13_500_000_000, 2 * 10**8, 2 * 10**8)
    # ZeRO-3 on the GPU: largest layer x 4 + 18 bytes/param over 16 GPUs; CPU: largest layer x 4 x 8 GPUs x 1.5.
    assert E.deepspeed_zero3(total, largest, per_node, nodes, cpu_offload=False, cpu_offload_params=False) == (
        2_400_000_000, 2 * 10**8 + 1_125_000_000, 2 * 10**8)
    # ZeRO-3, optimizer offloaded, no zero_init: CPU max(4 x 8, 16 / 2) = 32 bytes/param x 1.5.
    assert E.deepspeed_zero3(total, largest, per_node, nodes, cpu_offload_params=False, zero_init=False) == (
        48 * 10**9, 2 * 10**8 + 125_000_000, 2 * 10**8)


def test_deepspeed_estimate_rows_use_nodes_and_gpus_per_node() -> None:
    model = E.counts_model(10**9, 5 * 10**7)
    e = E.deepspeed_estimate(model, 16, 8, E.Choice(3, "cpu optimizer"))
    assert (e.host_bytes, e.device_bytes) == E.deepspeed_zero3(10**9, 5 * 10**7, 8, 2, True, False)[:2]
    assert E.deepspeed_estimate(model, 16, 8, E.Choice(0)) is None
    assert E.deepspeed_estimate(model, 16, 8, E.Choice(1)).device_bytes == E.deepspeed_zero2(10**9, 8, 2, False)[1]


# ---------------------------------------------------------------------------------------------
# Models.

def test_hugging_face_parameter_counts() -> None:
    """The published parameter counts of GPT-2 (124,439,808), Llama-2-7B and Llama-3-8B (grouped-query)."""
    gpt2 = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
            "n_positions": 1024}
    assert E.hf_model(gpt2).total_params == 124_439_808
    llama2 = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32}
    m = E.hf_model(llama2)
    assert m.total_params == 6_738_415_616
    assert m.largest_layer_params == 32000 * 4096  # the embedding (and the untied head)
    llama3 = dict(llama2, vocab_size=128256, intermediate_size=14336, num_key_value_heads=8)
    assert E.hf_model(llama3).total_params == 8_030_261_248
    tied = E.hf_model(dict(llama2, tie_word_embeddings=True))
    assert tied.total_params == 6_738_415_616 - 32000 * 4096


def test_hf_config_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(ConfigError, match="config.json: needs one of hidden_size"):
        E.hf_model(path)
    with pytest.raises(ConfigError, match="no such file"):
        E.hf_model(tmp_path / "missing.json")


def test_embedded_model_counts_match_real_parameters() -> None:
    cfg = load_config(TINY)
    params = gpt.init_params(cfg.model, 0)
    m = E.embedded_model(cfg)
    assert m.total_params == sum(x.size for x in jax.tree.leaves(params))
    d, v = cfg.model.d_model, cfg.model.vocab_size
    assert m.largest_layer_params == max(v * d, d * 4 * d + 4 * d)  # embedding / head vs the MLP's fc


def test_counts_model_keeps_both_counts() -> None:
    m = E.counts_model(1_000_003, 999)
    assert (m.total_params, m.largest_layer_params) == (1_000_003, 999)
    with pytest.raises(ConfigError, match="largest layer"):
        E.counts_model(10, 11)


# ---------------------------------------------------------------------------------------------
# Plan-exact.

def test_plan_exact_on_an_abstract_mesh_equals_the_real_plan() -> None:
    cfg = load_config(TINY)
    model = E.embedded_model(cfg)
    for choice in E.CHOICES:
        est = E.plan_exact(cfg, model, 8, 8, choice)
        real = make_plan(E.variant(cfg, choice), make_mesh(cfg), model.abstract_params).report()
        assert est.report._replace(memory="") == real._replace(memory=""), choice  # bytes; not where updates run


def test_hierarchical_abstract_mesh_counts_the_same_bytes() -> None:
    cfg = load_config(TINY)
    model = E.hf_model({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 2, "n_head": 12,
                        "n_positions": 1024})
    assert tuple(E.abstract_mesh(64, 8).axis_names) == ("data_outer", "data_inner")
    for choice in E.CHOICES:
        split = E.plan_exact(cfg, model, 64, 8, choice)
        flat = E.plan_exact(cfg, model, 64, 64, choice)
        assert split.device_bytes == flat.device_bytes and split.host_bytes == flat.host_bytes // 8, choice


def test_plan_exact_scales_with_devices_the_paper_way() -> None:
    """Leaves that divide N: stage 3 holds (P + G + 12) Ψ / N bytes per device, stage 1 P Ψ + G Ψ + 12 Ψ / N
    (plus the optimizer's replicated counters)."""
    cfg = load_config(TINY)
    pol = policy(cfg)
    psi = 2 ** 20 * 3
    model = E.counts_model(psi, 2 ** 20)
    p = make_plan(cfg, make_mesh(cfg), model.abstract_params)
    counters = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(p.abstract_opt_state) if x.size <= 1)
    assert 0 < counters <= 64
    for n in (16, 64, 512):
        s3 = E.plan_exact(cfg, model, n, 8, E.Choice(3))
        assert s3.device_bytes == (pol.param.itemsize + pol.accum.itemsize + 12) * psi // n + counters
        s1 = E.plan_exact(cfg, model, n, 8, E.Choice(1))
        assert s1.device_bytes == (pol.param.itemsize + pol.accum.itemsize) * psi + 12 * psi // n + counters
        # parameter offload: parameters, fp32 master and Adam moments on the host, 8 devices per host.
        off = E.plan_exact(cfg, model, n, 8, E.Choice(3, "cpu params"))
        assert off.host_bytes == 8 * (pol.param.itemsize + 12) * psi // n
        assert off.device_bytes == pol.accum.itemsize * psi // n + counters


def _compiled_state_bytes(cfg) -> int:
    """Per-device argument bytes of the compiled step, less this device's rows of the batch."""
    p = make_plan(cfg, make_mesh(cfg), gpt.abstract_params(cfg.model))
    rows = p.batch.micro_batch_size * p.data_size
    batch = {"tokens": jax.ShapeDtypeStruct((rows, cfg.model.seq_len + 1), np.int32, sharding=p.batch_sharding)}
    mem = make_train_step(cfg, p, gpt.make_loss_fn(cfg.model)).lower(abstract_state(p), batch).compile() \
        .memory_analysis()
    per_device_batch = p.batch.micro_batch_size * (cfg.model.seq_len + 1) * 4
    return mem.argument_size_in_bytes + mem.host_argument_size_in_bytes - per_device_batch


@pytest.mark.parametrize("choice", [E.Choice(0), E.Choice(2, "cpu optimizer"), E.Choice(3, "cpu params")],
                         ids=lambda c: c.label)
def test_plan_exact_matches_the_compiled_step(choice) -> None:
    """Parameters, master copy and optimizer state the step takes as arguments, within 2%
    (the rest: step counters, loss scale and PRNG key)."""
    cfg = E.variant(load_config(TINY), choice)
    est = E.plan_exact(cfg, E.embedded_model(cfg), 8, 8, choice).report
    measured = _compiled_state_bytes(cfg)
    assert abs(measured - (est.params + est.optimizer)) <= 0.02 * measured, (measured, est)


# ---------------------------------------------------------------------------------------------
# Recommendation and the command.

def test_recommend_takes_the_cheapest_that_fits() -> None:
    cfg = load_config(TINY)
    model = E.counts_model(10**9, 10**8)
    exact = [E.plan_exact(cfg, model, 64, 8, c) for c in E.CHOICES]
    by = {e.choice: e for e in exact}
    # Just above stage 2's need: stages 0 and 1 need more, so stage 2 wins.
    assert E.recommend(exact, by[E.Choice(2)].device_bytes + 1).choice == E.Choice(2)
    assert by[E.Choice(1)].device_bytes > by[E.Choice(2)].device_bytes + 1
    # Activations count against the device too.
    assert E.recommend(exact, by[E.Choice(2)].device_bytes + 1, activations=2).choice == E.Choice(3)
    # Only parameter offload fits; a host limit below its host share leaves nothing.
    tight = by[E.Choice(3, "cpu params")].device_bytes
    assert E.recommend(exact, tight).choice == E.Choice(3, "cpu params")
    assert E.recommend(exact, tight, host_memory=by[E.Choice(3, "cpu params")].host_bytes - 1) is None
    assert E.recommend(exact, tight - 1) is None


def test_parse_bytes() -> None:
    assert E.parse_bytes("80GB") == 80e9
    assert E.parse_bytes("80GiB") == E.parse_bytes("80G") == 80 * 2**30
    assert E.parse_bytes("1024") == 1024
    with pytest.raises(ConfigError, match="--device-memory"):
        E.parse_bytes("eighty")


def test_cli_estimate_prints_both_modes_and_a_recommendation(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(TINY))
    llama = tmp_path / "config.json"
    llama.write_text(json.dumps({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
                                 "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32}))
    rc = main(["estimate", "--config", str(cfg), "--hf-config", str(llama), "--devices", "64",
               "--devices-per-host", "8", "--device-memory", "16GiB", "--no-step-time"])
    out = capsys.readouterr().out
    assert rc == 0
    model = E.hf_model(llama)
    exact = {c: E.plan_exact(load_config(TINY), model, 64, 8, c) for c in E.CHOICES}
    s3 = [l for l in out.splitlines() if l.startswith("stage 3, offload none")][0].split()
    assert float(s3[4]) == round(exact[E.Choice(3)].device_bytes / 2**30, 2)
    ds = E.deepspeed_zero3(model.total_params, model.largest_layer_params, 8, 8, False, False)
    assert float(s3[6]) == round(ds[1] / 2**30, 2) and float(s3[7]) == round(ds[0] / 2**30, 2)
    best = E.recommend(list(exact.values()), 16 * 2**30)
    assert f"recommendation: {best.choice.label}" in out
    assert "model states only" in out
    assert "note: every parameter has fewer than" not in out   # a 7B model's leaves are partitioned


def test_estimate_says_when_the_persistence_threshold_keeps_every_leaf_whole(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({**TINY, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10**9}}))
    assert main(["estimate", "--config", str(cfg), "--devices", "8", "--no-step-time"]) == 0
    out = capsys.readouterr().out
    assert "note: every parameter has fewer than zero_optimization.stage3_param_persistence_threshold = " \
           "1,000,000,000 elements" in out and "set zero_optimization.stage3_param_persistence_threshold=0" in out


def test_cli_estimate_errors(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(TINY))
    assert main(["estimate", "--config", str(cfg), "--params", "100", "--no-step-time"]) == 2
    assert "--params and --largest-layer go together" in capsys.readouterr().err
    assert main(["estimate", "--config", str(cfg), "--device", "b200", "--no-step-time"]) == 2
    assert "presets are h100, a100, tpu-v5p" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Work and step time.

def test_hlo_work_counts_loop_bodies_trip_count_times() -> None:
    w = jax.ShapeDtypeStruct((4, 64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)

    def scanned(w, x):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0].sum()

    def single(w, x):
        return jnp.tanh(x @ w[0]).sum()

    one = jax.jit(single).lower(w, x).compile()
    dots = hlo.work(one.as_text()).flops
    assert dots == 2 * 32 * 64 * 64
    # XLA's count adds the elementwise tanh and sum: within 1% here
    assert dots <= one.cost_analysis()["flops"] <= 1.01 * dots
    loop = hlo.work(jax.jit(jax.grad(scanned)).lower(w, x).compile().as_text())
    # forward dot, and dX and dW in the backward pass, for each of the 4 layers
    assert loop.flops == 4 * 3 * 2 * 32 * 64 * 64


def test_compiled_costs_of_the_embedded_gpt() -> None:
    """Matmul FLOPs by hand: each block's forward F = 2 tok (3d² + d² + 4d² + 4d²) + 4 tok T d,
    backward 2F, remat recomputes F less the MLP's output projection (its output is not needed);
    the head 2 tok d V forward and twice that backward. Gradients all-reduced in fp32: 2·4·Ψ·(N-1)/N."""
    cfg = load_config(dict(TINY, bf16={"enabled": False}, train_micro_batch_size_per_gpu=2,
                           model=dict(TINY["model"], n_layers=2)))
    flops, nbytes, comm, n = E.compiled_costs(cfg)
    m = cfg.model
    d, t, layers, v, tok = m.d_model, m.seq_len, m.n_layers, m.vocab_size, 2 * m.seq_len
    f = 2 * tok * 12 * d * d + 4 * tok * t * d
    assert flops == layers * (4 * f - 2 * tok * 4 * d * d) + 3 * 2 * tok * d * v
    psi = E.embedded_model(cfg).total_params
    assert n == 8
    assert 2 * 4 * psi * 7 / 8 <= comm <= 1.001 * 2 * 4 * psi * 7 / 8
    assert nbytes > 4 * psi  # at least every parameter read once


def test_estimate_answers_from_shapes_without_compiling(tmp_path: Path, capsys, monkeypatch) -> None:
    """The whole report, step time included, from shapes and formulas: no program is compiled (or read
    from the compile cache). `--compiled` asks for the embedded GPT's compiled step instead."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(dict(TINY, model=dict(TINY["model"], d_model=48))))  # shapes no other test compiles
    programs: list[float] = []

    def count(event: str, secs: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            programs.append(secs)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        assert main(["estimate", "--config", str(cfg), "--devices", "8", "--device", "h100"]) == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    out = capsys.readouterr().out
    assert programs == []
    assert out.count("; analytic: ") == 4  # one line per stage, from the formulas

    monkeypatch.setattr(E, "compiled_costs", lambda config: (1e9, 1e8, 1e6, 8))
    assert main(["estimate", "--config", str(cfg), "--devices", "8", "--device", "h100", "--compiled"]) == 0
    assert capsys.readouterr().out.count("compiled on 8 local cpu devices") == 4


def test_step_time_arithmetic() -> None:
    dev = E.DeviceSpec("test", flops=1e12, hbm=1e11, intra=1e10, inter=1e9, memory=1e9)
    t = E.step_time(2e12, 1e11, 1e9, dev, devices=16, devices_per_host=8, source="x")
    assert (t.compute_s, t.memory_s, t.comm_s, t.link) == (2.0, 1.0, 1.0, "between hosts")
    assert t.seconds == 3.0 and t.bound == 2.0
    inside = E.step_time(2e12, 1e11, 1e9, dev, devices=8, devices_per_host=8, source="x")
    assert inside.comm_s == 0.1 and inside.link == "within a host"
    assert E.scale_comm(7.0, 8, 64) == pytest.approx(7.0 * (63 / 64) / (7 / 8))
    pol = policy(load_config(TINY))
    assert math.isclose(E.analytic_costs(load_config(TINY), E.counts_model(1000, 100), 0, 8)[2],
                        1000 * 7 / 8 * 2 * pol.accum.itemsize)  # stage 0: one all-reduce in the accumulation dtype


# ---------------------------------------------------------------------------------------------
# Tensor parallelism.

# A small Llama with grouped-query attention: one KV head, so at T=2 each device holds it whole.
SMALL_LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1}
LLAMA_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32}


def _request(devices: int, per_host: int, **kw) -> E.Request:
    return E.Request(devices=devices, devices_per_host=per_host, device=E.PRESETS["h100"], **kw)


def test_tensor_slice_bytes_by_hand() -> None:
    """T=2 over 16 devices (data 8): one device's slice, by hand from Megatron's slicing, then ZeRO's
    (param + gradient + 12) bytes per slice parameter over data at stage 3, and 2 + 2 whole plus 12 / data
    at stage 1; activations and both kinds of bytes sent from their formulas."""
    cfg = load_config(TINY)
    model = E.hf_model(SMALL_LLAMA)
    h, inter, vocab, layers, heads, d, t, data = 64, 128, 96, 2, 4, 16, 2, 8
    per_layer = (h * h // t          # q: heads split
                 + 2 * h * d         # k, v: the one KV head, replicated
                 + (h // t) * h      # o: input split
                 + 3 * h * inter // t  # gate, up (output split), down (input split)
                 + 2 * h)            # the two norms, whole
    psi_t = layers * per_layer + 2 * (vocab // t) * h + h  # embedding and head split by vocabulary; final norm
    assert TP.local_params(model.abstract_params, model.arch, t) == psi_t
    assert E.shard_model(model, t).total_params == psi_t

    pol = policy(cfg)
    p = make_plan(cfg, make_mesh(cfg), model.abstract_params, layer_axes=model.layer_axes)
    counters = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(p.abstract_opt_state) if x.size <= 1)
    req = _request(16, 8)
    s3 = E.tensor_row(cfg, model, req, t, E.Choice(3), E.PRESETS["h100"])
    assert s3.data == data
    assert s3.state_bytes == (pol.param.itemsize + pol.accum.itemsize + 12) * psi_t // data + counters
    s1 = E.tensor_row(cfg, model, req, t, E.Choice(1), E.PRESETS["h100"])
    assert s1.state_bytes == (pol.param.itemsize + pol.accum.itemsize) * psi_t + 12 * psi_t // data + counters

    # Activations (bf16, remat, micro-batch 1 x 8 tokens): block inputs kept per layer, one block in
    # full (6 whole hidden-wide tensors; q and the attention output split, k and v one head each; 3 MLP
    # tensors split; scores and probabilities split by head), fp32 logits and gradient split by vocabulary.
    seq, w = cfg.model.seq_len, 2
    assert cfg.model.remat and cfg.compute_dtype == "bf16"
    block = seq * (6 * h + 2 * h // t + 2 * d + 3 * inter // t + 2 * heads * seq // t) * w
    assert s3.activation_bytes == layers * seq * h * w + block + seq * (vocab // t) * 8
    # Tensor group: (6 per layer with recomputation + 2) all-reduces of [1, seq, h] bf16, 2(T-1)/T each.
    assert s3.tensor_bytes == (6 * layers + 2) * 2 * (t - 1) / t * seq * h * w
    # Data group (bf16 reductions and gathers): stage 3 reduce-scatters gradients and gathers twice.
    assert s3.data_bytes == pytest.approx(psi_t * (data - 1) / data * (2 + 2 * 2))
    assert s1.data_bytes == pytest.approx(psi_t * (data - 1) / data * (2 + 2))
    assert s3.tensor_s == s3.tensor_bytes / 450e9 and s3.data_s == s3.data_bytes / 50e9  # data spans hosts
    assert s3.tokens == data * seq


def test_tensor_rows_at_t1_are_the_plan_exact_rows() -> None:
    cfg = load_config(TINY)
    for model in (E.hf_model(LLAMA_7B), E.embedded_model(cfg)):
        req = _request(64, 8)
        rows = [r for r in E.tensor_rows(cfg, model, req)[0] if r.tensor == 1]
        assert [r.choice for r in rows] == list(E.CHOICES[:4])
        for r in rows:
            assert r.state_bytes == E.plan_exact(cfg, model, 64, 8, r.choice).device_bytes
            assert r.tensor_bytes == 0 and r.data == 64
            assert r.data_bytes == E.analytic_costs(E.variant(cfg, r.choice), model, r.choice.stage, 64)[2]
    from zerojax.runtime.preflight import activation_bytes
    gpt_row = E.tensor_row(cfg, E.embedded_model(cfg), _request(8, 8), 1, E.Choice(0), E.PRESETS["h100"])
    assert gpt_row.activation_bytes == activation_bytes(cfg, 1)  # the trainer's pre-flight estimate


def test_tensor_sizes_follow_the_host_and_the_heads() -> None:
    arch = E.hf_model(SMALL_LLAMA).arch
    assert E.tensor_sizes(_request(16, 8), arch) == ([1, 2, 4], ["4 attention heads do not divide by T=8"])
    assert E.tensor_sizes(_request(16, 8, tensor=(2,)), arch) == ([2], [])
    assert "tensor stays in a host" in E.tensor_sizes(_request(16, 2, tensor=(4,)), arch)[1][0]
    gqa = E.hf_model(dict(LLAMA_7B, num_key_value_heads=8)).arch
    assert (TP.local_kv_heads(gqa, 4), TP.local_kv_heads(gqa, 16)) == (2, 8)  # split, then kept whole
    odd = E.hf_model(dict(LLAMA_7B, num_key_value_heads=6, num_attention_heads=48)).arch
    assert TP.invalid(odd, 4) is None and TP.local_kv_heads(odd, 4) == 6
    assert E.parse_tensor("1,2, 4") == E.parse_tensor(["4", "2 1"]) == (1, 2, 4)
    assert E.parse_tensor(8) == (8,) and E.parse_tensor(None) is None
    with pytest.raises(ConfigError, match="--tensor"):
        E.parse_tensor("two")


def test_tensor_recommendation_picks_a_tensor_row_when_data_parallel_does_not_fit() -> None:
    cfg = load_config(dict(TINY, model=dict(TINY["model"], seq_len=2048)))
    rows, _ = E.tensor_rows(cfg, E.hf_model(LLAMA_7B), _request(8, 8))
    tight = min(r.device_bytes for r in rows if r.tensor == 1) - 1
    best = E.recommend_tensor(rows, tight)
    assert best is not None and best.tensor > 1 and best.device_bytes <= tight
    fitting = [r for r in rows if r.device_bytes <= tight]
    assert best.comm_s_per_token == min(r.comm_s_per_token for r in fitting)
    # With room for everything, data parallelism alone sends the least per token.
    assert E.recommend_tensor(rows, 10 ** 15).tensor == 1
    assert E.recommend_tensor(rows, min(r.device_bytes for r in rows) - 1) is None


def test_cli_estimate_prints_tensor_rows(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(TINY))
    llama = tmp_path / "config.json"
    llama.write_text(json.dumps(LLAMA_7B))
    assert main(["estimate", "--config", str(cfg), "--hf-config", str(llama), "--devices", "64",
                 "--devices-per-host", "8", "--device", "h100", "--no-step-time"]) == 0
    out = capsys.readouterr().out
    rows, _ = E.tensor_rows(load_config(TINY), E.hf_model(llama), _request(64, 8))
    assert [r.tensor for r in rows] == [1] * 4 + [2] * 4 + [4] * 4 + [8] * 4
    line = [l for l in out.splitlines() if l.startswith("T=8 x data 8, stage 3")][0].split()
    assert float(line[6]) == round(rows[-1].state_bytes / 2**30, 2)
    best = E.recommend_tensor(rows, 80 * 2**30)
    assert f"tensor-parallel recommendation: {best.label}" in out and f"mesh.tensor={best.tensor}" in out
    assert "no sequence parallelism" in out


def test_a_config_with_a_tensor_axis_is_estimated_at_its_size(tmp_path: Path, capsys) -> None:
    """mesh.tensor 2 in the config: the data-parallel table is T=1 and the tensor table shows T=1 and 2."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({**TINY, "mesh": {**TINY.get("mesh", {}), "tensor": 2}}))
    llama = tmp_path / "config.json"
    llama.write_text(json.dumps(LLAMA_7B))
    assert main(["estimate", "--config", str(cfg), "--hf-config", str(llama), "--devices", "64",
                 "--devices-per-host", "8", "--device", "h100", "--no-step-time"]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith("T=2 x data 32, stage 3") for line in out.splitlines()), out
    assert not any(line.startswith("T=4 x") for line in out.splitlines())


# ---------------------------------------------------------------------------------------------
# Expert and sequence rows (ZeRO's formulas per group of weights; DeepSpeed has no estimator for them).

MOE = dict(TINY, model={"name": "llama", "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
                        "seq_len": 8, "vocab_size": 64, "n_experts": 4, "experts_per_token": 2})


def test_expert_rows_are_the_plans_bytes_on_an_expert_mesh() -> None:
    """Each row's state (non-expert weights ZeRO over all 8 devices, 1/E of the experts ZeRO over 8 / E)
    is what the real plan on a data x expert mesh holds, less the optimizer's step counters."""
    from zerojax.core.mesh import DATA, EXPERT
    from zerojax.models import llama
    cfg = load_config(MOE)
    model, req = E.embedded_model(cfg), _request(8, 8)
    rows = E.expert_rows(cfg, model, req)
    assert [(r.size, r.choice) for r in rows] == [(e, c) for e in (1, 2, 4) for c in E.CHOICES[:4]]
    params, loss_fn = llama.build(cfg.model, seed=0)
    for r in rows:
        mesh = jax.sharding.AbstractMesh((8 // r.size, r.size), (DATA, EXPERT))
        rep = make_plan(load_config(E.variant(cfg, r.choice), [f"mesh.expert={r.size}"]), mesh, params,
                        logical_axes=loss_fn.logical_axes).report()
        assert r.state_bytes == rep.formula_total and 0 < rep.device - r.state_bytes <= 32, r.label
    # the stage-3 rows are the same at any E (everything is divided over 8 devices either way); below it
    # the expert split divides what ZeRO leaves whole, and the all-to-alls grow with E
    by = {(r.size, r.choice.stage): r for r in rows}
    assert by[1, 3].state_bytes == by[4, 3].state_bytes and by[4, 0].state_bytes < by[2, 0].state_bytes
    psi_e = AX.expert_params(model.abstract_params)
    assert psi_e == 2 * 4 * 3 * 32 * 64  # layers x experts x (gate, up, down) x d_model x d_ff
    # per MoE layer 2 all-to-alls forward, 2 backward, 2 in the recomputed forward (remat), of 8 tokens
    # x top-2 x capacity 1.0 x 32 bf16 values, half of each sent
    assert cfg.model.remat
    assert by[2, 0].all_to_all_bytes == 2 * 6 * (1 / 2) * 8 * 2 * 1.0 * 32 * 2
    assert by[1, 0].all_to_all_bytes == 0


def test_sequence_rows_divide_activations_and_send_attentions_all_to_alls() -> None:
    cfg = load_config(dict(MOE, model=dict(MOE["model"], n_experts=None)))
    model, req = E.embedded_model(cfg), _request(8, 8)
    rows, skipped = E.sequence_rows(cfg, model, req)
    assert sorted({r.size for r in rows}) == [1, 2] and skipped == [
        "S=4 does not divide the 2 key/value heads", "S=8 does not divide the 4 query heads"]
    by = {(r.size, r.choice.stage): r for r in rows}
    for stage in range(4):  # ZeRO over all 8 devices whatever S: the plan-exact rows' state
        exact = E.plan_exact(cfg, model, 8, 8, E.Choice(stage))
        assert by[1, stage].state_bytes == by[2, stage].state_bytes == exact.report.formula_total
    # the same micro-batch per row shard, half of each row's tokens per device
    assert by[2, 0].activation_bytes == by[1, 0].activation_bytes / 2
    # per layer q (4 heads), k, v (2 heads each) and the output (4 heads) of 8 / 2 tokens, head_dim 8,
    # bf16, half of it sent; forward, backward and remat's replay
    assert by[2, 0].all_to_all_bytes == 2 * 3 * (1 / 2) * 8 / 2 * (4 + 2 + 2 + 4) * 8 * 2
    assert by[1, 0].all_to_all_bytes == 0


def test_cli_estimate_prints_expert_and_sequence_rows(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(dict(MOE, mesh={"expert": 2})))
    assert main(["estimate", "--config", str(cfg), "--devices", "8", "--no-step-time"]) == 0
    out = capsys.readouterr().out
    assert "expert parallelism (mesh data x expert" in out and "E=4 x data 2, stage 3" in out
    assert "sequence parallelism (DeepSpeed-Ulysses" not in out
    dense = dict(MOE, model=dict(MOE["model"], n_experts=None), mesh={"sequence": 2})
    cfg.write_text(json.dumps(dense))
    assert main(["estimate", "--config", str(cfg), "--no-step-time"]) == 0
    out = capsys.readouterr().out
    assert "expert parallelism" not in out and "S=2 x data 4, stage 3" in out
    assert "cluster: 8 devices" in out  # every device ZeRO shards over, not the 4 row shards


def test_the_nvme_row_moves_the_offloaded_optimizer_state_to_files() -> None:
    """offload_optimizer.device: nvme (ZeRO-Infinity): the bytes the cpu-optimizer row keeps in host
    memory are in swap files; host memory keeps the buffers they stream through. DeepSpeed's
    estimators take no NVMe argument, so that side has no row."""
    cfg = load_config(TINY)
    model = E.embedded_model(cfg)
    cpu = E.plan_exact(cfg, model, 8, 8, E.Choice(3, "cpu optimizer"))
    nvme = E.plan_exact(cfg, model, 8, 8, E.Choice(3, "nvme optimizer"))
    assert nvme.nvme_bytes == cpu.host_bytes > 0 and nvme.device_bytes == cpu.device_bytes
    assert nvme.host_bytes == nvme.report.nvme_buffers * 8 > 0
    assert E.deepspeed_estimate(model, 8, 8, E.Choice(3, "nvme optimizer")) is None
    assert "zero_optimization.offload_optimizer.nvme_path=/local_nvme" in E.Choice(3, "nvme optimizer").overrides()


def test_the_nvme_params_row_moves_the_parameters_to_files_too() -> None:
    """ZeRO-Infinity's NVMe setting (offload_param and offload_optimizer device nvme): parameters, master and
    moments in files; host memory keeps both tiers' buffers; the partitions are counted on the device too,
    where the step holds them (docs/offload.md)."""
    cfg = load_config(TINY)
    model = E.embedded_model(cfg)
    opt = E.plan_exact(cfg, model, 8, 8, E.Choice(3, "nvme optimizer"))
    both = E.plan_exact(cfg, model, 8, 8, E.Choice(3, "nvme params"))
    rep = both.report
    assert rep.params_nvme == opt.report.params > 0 and rep.params_host == 0
    assert both.nvme_bytes == opt.nvme_bytes + 8 * rep.params_nvme
    assert both.device_bytes == opt.device_bytes
    assert both.host_bytes == 8 * (rep.nvme_buffers + rep.param_buffers) > 0
    assert E.deepspeed_estimate(model, 8, 8, E.Choice(3, "nvme params")) is None
    assert "zero_optimization.offload_param.nvme_path=/local_nvme" in E.Choice(3, "nvme params").overrides()


def test_the_nvme_params_row_holds_two_layers_of_the_stacks_read_at_use() -> None:
    """A mixed-precision step reads its stacked layers from the files layer by layer (core.param_swap):
    the per-device figure counts two layers of each such stack (the one in use and the next), not the
    whole stack, and the plan's table says so."""
    cfg = load_config({**TINY, "model": {**TINY["model"], "n_layers": 4}})
    model = E.embedded_model(cfg)
    opt = E.plan_exact(cfg, model, 8, 8, E.Choice(3, "nvme optimizer"))
    both = E.plan_exact(cfg, model, 8, 8, E.Choice(3, "nvme params"))
    rep = both.report
    # Every stacked matrix (4 layers, its other dimensions split over the 8 devices), bf16.
    stacked = sum(math.prod(x.shape) // 8 * 2 for x in jax.tree.leaves(model.abstract_params) if x.ndim >= 3)
    assert rep.params_at_use == stacked > 0 and rep.params_at_use_held == stacked // 2
    assert both.device_bytes == opt.device_bytes - stacked // 2
    assert "read layer by layer inside the step" in rep.table()
