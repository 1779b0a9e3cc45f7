"""What a run says about its expert and sequence axes: the batch arithmetic (the rows are split over
data x expert, not over the sequence axis), DeepSpeedEngine's world sizes, the start-up table and
`config explain`, the memory table's ZeRO formula with experts split, and the comms logger's axes."""
from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

import zerojax
from zerojax.app.cli import main
from zerojax.app.reports import startup_table
from zerojax.config import load_config
from zerojax.models import llama
from zerojax.planner.mesh import make_mesh

TINY = dict(name="llama", vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_kv_heads=4, d_ff=32, n_layers=2)


def config(mesh: dict, **model) -> zerojax.Config:
    return load_config({
        "train_batch_size": 8, "bf16": {"enabled": True}, "mesh": mesh,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "model": {**TINY, **model}})


@functools.cache
def engine(axis: str) -> zerojax.Engine:
    cfg = config({"sequence": 4}) if axis == "sequence" else config({"expert": 2}, n_experts=4)
    params, loss_fn = llama.build(cfg.model, seed=0)
    return zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg))


def test_the_batch_triad_and_world_sizes_count_row_shards() -> None:
    """Data 2 x sequence 4: 2 row shards of 4 rows each (DeepSpeed's world size / sequence_parallel_size);
    ZeRO and the gradient average span all 8 (its seq_dp_world_size). Expert 2 is inside the 8 data ranks."""
    e = engine("sequence")
    assert dict(e.mesh.shape) == {"data": 2, "sequence": 4}
    assert e.get_batch_info() == (8, 4, 1)
    assert (e.world_size, e.dp_world_size, e.seq_dp_world_size, e.sequence_parallel_size, e.mp_world_size) == (
        8, 2, 8, 4, 1)
    assert "batch: 8 = micro 4 x accumulation 1 x data 2;" in startup_table(e)
    x = engine("expert")
    assert dict(x.mesh.shape) == {"data": 4, "expert": 2} and x.get_batch_info() == (8, 1, 1)
    assert (x.dp_world_size, x.seq_dp_world_size, x.sequence_parallel_size) == (8, 8, 1)
    assert "batch: 8 = micro 1 x accumulation 1 x data 8;" in startup_table(x)


def test_preflight_activations_are_one_sequence_chunks() -> None:
    from zerojax.runtime.preflight import activation_bytes
    assert activation_bytes(config({"sequence": 4}), 4) * 4 == activation_bytes(config({}), 4)


def test_startup_table_shows_the_sequence_axis() -> None:
    table = startup_table(engine("sequence"))
    assert "over 8 data shards (data 2 x sequence 4)" in table
    assert ("sequence parallel (Ulysses) over 4 devices (groups {0,1,2,3} {4,5,6,7}): rows over data 2, each "
            "row's 16 tokens in chunks of 4; ZeRO over data x sequence 8") in table
    assert "1 query / 1 key-value heads on the whole row per device" in table
    assert "2 per attention layer forward" in table


def test_startup_table_shows_the_expert_axis_and_its_zero_formula() -> None:
    e = engine("expert")
    table = startup_table(e)
    assert "(expert weights: experts over 2 expert devices, ZeRO over the 4 data shards)" in table
    assert "expert parallel over 2 devices (ep_size; groups {0,1} {2,3} {4,5} ... (4 groups)): 3 of 13" in table
    for name in ("gate", "up", "down"):
        assert re.search(rf"layers\.moe\.experts\.{name} +\(2, 4, 32, 32\) +experts dim 1: 2 of 4 per device; "
                         rf"ZeRO dim \d over data", table)
    assert "2 per MoE layer forward" in table and "2 MoE layer(s)" in table
    # the ZeRO formula knows the expert split: at stage 3 every leaf divides over 8 devices, so the
    # planned bytes are the formula's (to the optimizer's step counters)
    rep = e.plan.report()
    assert rep.expert_size == 2 and rep.formula_total == pytest.approx(rep.total, rel=1e-3)


def test_config_explain_prints_the_expert_and_sequence_plans(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "explain", "configs/moe.yaml"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel over 2 devices" in out and "layers.moe.experts.gate" in out
    assert main(["config", "explain", "configs/llama.yaml", "--set", "mesh.sequence=2"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel (Ulysses) over 2 devices" in out and "rows over data 4" in out


# -- the comms logger -----------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", ["expert", "sequence"])
def test_comms_logger_names_the_all_to_alls_axis(axis: str) -> None:
    from zerojax.app.reports import compile_step, comms_report
    e = engine(axis)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, TINY["vocab_size"], size=(8, TINY["seq_len"] + 1), dtype=np.int32)}
    text = compile_step(e, batch).as_text()
    report = comms_report(text, e.config.comms_logger, mesh=e.mesh)
    kinds = {line.split("  ")[1].strip().split(" (")[1].split(")")[0]
             for line in report.splitlines() if line.strip().startswith("all-to-all (")}
    assert kinds == {axis}, report


def test_a_collective_permute_is_labelled_with_the_axes_it_crosses() -> None:
    from jax.sharding import Mesh, PartitionSpec as P
    from zerojax.measure import hlo
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    ring = [(i, (i + 1) % 4) for i in range(4)]

    @jax.jit
    def shift(x: jax.Array) -> jax.Array:
        return jax.shard_map(lambda v: jax.lax.ppermute(v, "b", ring), mesh=mesh, in_specs=P("a", "b"),
                             out_specs=P("a", "b"))(x)

    text = shift.lower(np.zeros((2, 4), np.float32)).compile().as_text()
    permutes = [c for c in hlo.collectives(text) if c.kind == "collective-permute"]
    assert permutes and all(len(c.pairs) == 8 for c in permutes)
    assert {hlo.collective_axes(c, mesh) for c in permutes} == {"b"}
    assert "collective-permute (b)" in hlo.comms_report(text, mesh=mesh)


# -- the long-context config ----------------------------------------------------------------------------

def test_long_context_config_plans_sequence_4_by_data_2() -> None:
    """configs/long_context.yaml as train.py plans it (a run takes minutes on CPU: it is run by hand)."""
    from zerojax.app.trainer import build_model
    from zerojax.planner.axes import sequence_plan
    cfg = load_config("configs/long_context.yaml")
    mesh = make_mesh(cfg)
    assert dict(mesh.shape) == {"data": 2, "sequence": 4} and cfg.model.remat
    plan = build_model(cfg, mesh).plan
    assert plan.batch.micro_batch_size == 2 and plan.batch.gradient_accumulation_steps == 1
    assert sequence_plan(plan, cfg.model.seq_len, (cfg.model.n_heads, cfg.model.n_kv_heads)).startswith(
        "sequence parallel (Ulysses) over 4 devices (groups {0,1,2,3} {4,5,6,7}): rows over data 2, each row's "
        "1024 tokens in chunks of 256; ZeRO over data x sequence 8\n  attention: all heads on a chunk -> 2 query / "
        "1 key-value heads")
