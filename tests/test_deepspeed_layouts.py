"""DeepSpeed checkpoints of every kind, each written by DeepSpeed 0.19.8 itself
(tests/fixtures/deepspeed/make_more.py): the universal layout of ds_to_universal.py, a tensor-parallel
(AutoTP, mp_rank_01) ZeRO-1 run and an expert-parallel MoE ZeRO-2 run. Each is read to what DeepSpeed
itself makes of it, imported at another mesh and stage than it was written at, and continued; reading
and importing hold one parameter at a time in host memory, not the model."""
import dataclasses
import os
import tracemalloc
import weakref
from collections.abc import Mapping

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from zerojax.checkpoint import deepspeed_format as ds, torch_zip as tz
from zerojax.checkpoint.deepspeed_import import import_state, mapping_sources, schedule_count
from zerojax.app.deepspeed import sources_for
from zerojax.checkpoint.format import leaf_names
from zerojax.config import load_config
from zerojax.models import gpt, hf, llama
from zerojax.planner.api import make_train_step
from zerojax.planner.plan import make_plan

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "deepspeed")
GPT2 = {"vocab_size": 256, "seq_len": 16, "d_model": 4, "n_layers": 1, "n_heads": 1, "tie_embeddings": True}
LLAMA = {"name": "llama", "vocab_size": 64, "seq_len": 16, "d_model": 8, "n_layers": 1, "n_heads": 2,
         "n_kv_heads": 2, "d_ff": 16, "tie_embeddings": False}


def _same(a: Mapping, b: Mapping) -> None:
    assert list(a) == list(b)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)


@pytest.mark.parametrize("source", ["zero2", "zero3"])
def test_universal_folder_reads_as_the_zero_checkpoint_it_was_made_from(source):
    """ds_to_universal.py's output of DeepSpeed's own ZeRO-2 and ZeRO-3 checkpoints (stage 3's parameters
    saved flat, its step inside optimizer_state.pt) reads to the same tensors and counters."""
    zero = ds.read_checkpoint(os.path.join(FIXTURES, source))
    universal = "universal" if source == "zero2" else "zero3_universal"
    for path in (universal, f"{universal}/global_step2_universal"):  # run folder (latest_universal) or the tag
        uni = ds.read_checkpoint(os.path.join(FIXTURES, path))
        assert uni.layout == "universal" and uni.tag == "global_step2_universal"
        for key in ("params", "exp_avg", "exp_avg_sq"):
            _same(getattr(uni, key), getattr(zero, key))
        assert (uni.step, uni.lr, uni.global_steps, uni.global_samples, uni.zero_stage, uni.loss_scale,
                uni.client_state) == \
            (zero.step, zero.lr, zero.global_steps, zero.global_samples, zero.zero_stage, zero.loss_scale,
             zero.client_state)
        assert (uni.step, uni.lr, uni.global_steps, uni.client_state) == (2, 1e-3, 2, {"epoch": 1})
    assert uni.params.shapes["transformer.wte.weight"] == (256, 4)


def test_tensor_parallel_slices_join_as_deepspeed_joins_them():
    """tp2 is AutoTP size 2 (q/k/v, gate/up column-parallel; o/down row-parallel; lm_head vocabulary-
    parallel; norms and the embedding replicated); tp2_universal is ds_to_universal.py's join of it."""
    tp = ds.read_checkpoint(os.path.join(FIXTURES, "tp2"))
    assert tp.tp_degree == 2 and tp.params.shapes["model.layers.0.self_attn.o_proj.weight"] == (8, 8)
    assert tp.params.shapes["lm_head.weight"] == (64, 8) and tp.params.shapes["model.layers.0.mlp.up_proj.weight"] \
        == (16, 8)
    reference = ds.read_checkpoint(os.path.join(FIXTURES, "tp2_universal"))
    for key in ("params", "exp_avg", "exp_avg_sq"):
        _same(getattr(tp, key), getattr(reference, key))
    # the same join from the name patterns alone (runs that record no affine_map)
    tag = os.path.join(FIXTURES, "tp2", "global_step2")
    parts = [ds._read_mp_rank("global_step2", tag, mp) for mp in (0, 1)]
    info = {k: v for k, v in parts[0].universal_info.items() if k != "affine_map"}
    by_patterns = ds._join_tensor_parallel([dataclasses.replace(p, universal_info=info) for p in parts], tag)
    _same(by_patterns.params, reference.params)
    _same(by_patterns.exp_avg_sq, reference.exp_avg_sq)


def test_tensor_parallel_without_a_join_rule_or_with_a_bad_one_is_one_error():
    tag = os.path.join(FIXTURES, "tp2", "global_step2")
    parts = [ds._read_mp_rank("global_step2", tag, mp) for mp in (0, 1)]
    with pytest.raises(ds.DeepSpeedCheckpointError, match="2 tensor-parallel ranks but records no universal_checkp"):
        ds._join_tensor_parallel([dataclasses.replace(p, universal_info=None) for p in parts], tag)
    info = parts[0].universal_info
    spec = info["affine_map"]["params"][r"^model\.layers\.0\.self_attn\.q_proj\.weight$"]
    far = {**spec, "ranks": {**spec["ranks"], 1: {**spec["ranks"][1], "pieces": [
        {**spec["ranks"][1]["pieces"][0], "source": [60, [8, 1]]}]}}}
    bad = {**info, "affine_map": {**info["affine_map"], "params": {
        **info["affine_map"]["params"], r"^model\.layers\.0\.self_attn\.q_proj\.weight$": far}}}
    with pytest.raises(ds.DeepSpeedCheckpointError, match="q_proj.weight reaches past its tensor's 64 elements"):
        ds._join_tensor_parallel([dataclasses.replace(p, universal_info=bad) for p in parts], tag)


def test_a_missing_tensor_parallel_rank_is_named(tmp_path):
    import shutil
    shutil.copytree(os.path.join(FIXTURES, "tp2"), tmp_path / "tp2")
    tag = tmp_path / "tp2" / "global_step2"
    (tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(ds.DeepSpeedCheckpointError, match="zero_pp_rank_0_mp_rank_01_optim_states.pt is missing"):
        ds.read_checkpoint(tmp_path / "tp2")
    (tag / "mp_rank_01_model_states.pt").unlink()  # rank 0 still says 2 ranks saved it
    with pytest.raises(ds.DeepSpeedCheckpointError, match="says 2 model-parallel ranks .* of 1 are present"):
        ds.read_checkpoint(tmp_path / "tp2")


def test_moe_experts_are_read_under_their_global_ids():
    """moe: 2 ranks, ep_size 2, ZeRO-2: the experts' group is partitioned over 1 rank, the rest over 2;
    each rank holds its own expert as local expert 0."""
    moe = ds.read_checkpoint(os.path.join(FIXTURES, "moe"))
    for rank in (0, 1):  # each rank's module weights, as DeepSpeed held them when it saved
        for name, value in np.load(os.path.join(FIXTURES, f"moe_rank{rank}_weights.npz")).items():
            np.testing.assert_array_equal(moe.params[name.replace("experts.0.", f"experts.{rank}.")], value)
    for e in (0, 1):  # DeepSpeed's own per-expert files name the experts globally
        for name, value in tz.load(os.path.join(FIXTURES, "moe", "global_step2",
                                                f"layer_0_expert_{e}_mp_rank_00_model_states.pt")).items():
            np.testing.assert_array_equal(moe.params[name], value)
    assert len(moe.params) == 12 and moe.step == 2 and moe.exp_avg is not None


class _Held(Mapping):
    """A checkpoint table that records the bytes of the tensors it handed out that are still alive."""

    def __init__(self, table, meter):
        self.table, self.meter = table, meter
        self.shapes = table.shapes

    def __getitem__(self, name):
        out = self.table[name]
        self.meter["live"] += out.nbytes
        self.meter["peak"] = max(self.meter["peak"], self.meter["live"])
        weakref.finalize(out, self._release, out.nbytes)
        return out

    def _release(self, nbytes):
        self.meter["live"] -= nbytes

    def __iter__(self):
        return iter(self.table)

    def __len__(self):
        return len(self.table)


@pytest.mark.parametrize("stage", [2, 3])
def test_reading_holds_one_parameter_at_a_time(tmp_path, stage):
    """16 parameters of 256 KiB at dp 2, with Adam moments: reading the checkpoint and assembling every
    tensor peaks near one parameter (tracemalloc: ~0.4 MiB), not the 12 MiB the model's state is."""
    rng = np.random.default_rng(0)
    params = {f"layers.{i}.weight": rng.standard_normal((256, 256)).astype(np.float32) for i in range(16)}
    ds.write_checkpoint(tmp_path, "global_step1", params, params, params, stage=stage, dp=2, step=1, global_steps=1,
                        global_samples=8, skipped_steps=0, lr=1e-3, lr_scheduler=None)
    one = 256 * 256 * 4
    tracemalloc.start()
    try:
        ck = ds.read_checkpoint(tmp_path)
        for table in (ck.params, ck.exp_avg, ck.exp_avg_sq):
            for name in table:
                assert table[name].shape == (256, 256)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    model = 3 * len(params) * one
    assert peak < 3 * one, f"peak {peak} bytes while reading a {model}-byte state (one parameter: {one})"
    np.testing.assert_array_equal(ck.params["layers.7.weight"], params["layers.7.weight"])


def _gpt2(stage):
    return load_config({"train_batch_size": 8, "gradient_clipping": 1.0,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                        "model": GPT2})


def _mesh():
    return Mesh(np.array(jax.devices()), ("data",))


def _import(ckpt, cfg, abstract, sources=None):
    plan = make_plan(cfg, _mesh(), abstract)
    if sources is None:
        sources = sources_for(cfg, ckpt.params, None, leaf_names(plan.abstract_params))
    return plan, import_state(ckpt, plan, sources, count=schedule_count(ckpt, None))


def _continue(cfg, plan, state, loss_fn, vocab, steps=2):
    step = make_train_step(cfg, plan, loss_fn)
    losses = []
    for i in range(steps):
        tokens = np.random.default_rng(i).integers(0, vocab, (8, cfg.model.seq_len + 1), dtype=np.int32)
        state, m = step(state, {"tokens": tokens})
        losses.append(float(m["loss"]))
    return losses, jax.device_get((state.params, state.opt_state))


def test_universal_continues_as_the_zero_checkpoint_at_another_mesh_and_stage():
    """Written on one rank at ZeRO-2; the ZeRO files imported at stage 1, the universal folder at
    stage 3, both on 8 devices: the next steps are the same."""
    zero = ds.read_checkpoint(os.path.join(FIXTURES, "zero2"))
    uni = ds.read_checkpoint(os.path.join(FIXTURES, "universal"))
    runs = []
    for ckpt, stage in ((zero, 1), (uni, 3)):
        cfg = _gpt2(stage)
        plan, state = _import(ckpt, cfg, gpt.abstract_params(cfg.model))
        assert int(state.step) == 2
        runs.append(_continue(cfg, plan, state, gpt.make_loss_fn(cfg.model), 256))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_tensor_parallel_checkpoint_continues_as_deepspeeds_universal_join():
    """The AutoTP checkpoint (2 tensor-parallel ranks) imported at stage 3 and DeepSpeed's universal join
    of it imported at stage 0, on 8 devices: the same state, the same next steps."""
    runs = []
    for folder, stage in (("tp2", 3), ("tp2_universal", 0)):
        cfg = load_config({"train_batch_size": 8, "gradient_clipping": 1.0,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                           "model": LLAMA})
        ckpt = ds.read_checkpoint(os.path.join(FIXTURES, folder))
        plan, state = _import(ckpt, cfg, hf.abstract_params(cfg.model))
        wq = jax.device_get(state.params["layers"]["q"]["kernel"])[0]
        np.testing.assert_array_equal(wq, ckpt.params["model.layers.0.self_attn.q_proj.weight"].T)
        runs.append(_continue(cfg, plan, state, llama.build(cfg.model)[1], 64))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _moe_checkpoint() -> tuple[ds.DeepSpeedCheckpoint, dict]:
    """The MoE fixture and its parameter tree, nested by DeepSpeed's dotted names (fp32 shapes)."""
    ckpt = ds.read_checkpoint(os.path.join(FIXTURES, "moe"))
    tree: dict = {}
    for name, shape in ckpt.params.shapes.items():
        node = tree
        *path, last = name.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = jax.ShapeDtypeStruct(shape, np.float32)
    return ckpt, tree


def test_moe_checkpoint_imports_into_a_stage3_plan():
    """The MoE run's experts land in their own leaves (names as DeepSpeed's per-expert files give them),
    with their fp32 weights, Adam moments and step, sharded over 8 devices at stage 3."""
    ckpt, tree = _moe_checkpoint()
    cfg = _gpt2(3)
    plan, state = _import(ckpt, cfg, tree, mapping_sources({n: n for n in ckpt.params}))
    names = leaf_names(plan.abstract_params)
    master = dict(zip(names, jax.tree.leaves(jax.device_get(state.params))))
    for name in ckpt.params:
        np.testing.assert_array_equal(master[name], ckpt.params[name])
    adam = state.opt_state.inner_state[0]
    np.testing.assert_array_equal(
        dict(zip(names, jax.tree.leaves(jax.device_get(adam.nu))))["moe.deepspeed_moe.experts.deepspeed_experts.1.0.weight"],
        ckpt.exp_avg_sq["moe.deepspeed_moe.experts.deepspeed_experts.1.0.weight"])
    assert int(adam.count) == 2


def _moe_loss(params, batch):
    """make_more.py's MoE net in JAX: embedding -> DeepSpeed's top-1 gate (top1gating: softmax, argmax,
    l_aux = sum(mean gates * token fractions) * experts) -> each token through its expert, weighted by
    its gate -> head over x + y; cross-entropy + 0.01 * l_aux. No token is dropped (checked)."""
    import jax.numpy as jnp
    tokens = batch["tokens"]
    xs = params["embed"]["weight"][tokens].reshape(-1, 4)
    moe = params["moe"]["deepspeed_moe"]
    gates = jax.nn.softmax(xs @ moe["gate"]["wg"]["weight"].T, axis=1)
    mask = jax.nn.one_hot(jnp.argmax(gates, axis=1), 2)
    l_aux = jnp.sum(gates.mean(0) * mask.mean(0)) * 2
    y = 0.0
    for e in range(2):
        ex = moe["experts"]["deepspeed_experts"][str(e)]
        out = jax.nn.relu(xs @ ex["0"]["weight"].T + ex["0"]["bias"]) @ ex["2"]["weight"].T + ex["2"]["bias"]
        y = y + (mask[:, e] * gates[:, e])[:, None] * out
    logits = (xs + y) @ params["head"]["weight"].T + params["head"]["bias"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens.reshape(-1, 1), axis=1)
    return nll.mean() + 0.01 * l_aux


def test_moe_checkpoint_continues_as_deepspeed_continued_it():
    """Imported at stage 3 on 8 devices (written at ZeRO-2 on 2 ranks, ep_size 2), one step on the batch
    DeepSpeed took after its save gives DeepSpeed's loss and DeepSpeed's weights after that step, for
    the experts of both ranks and the dense part alike."""
    ckpt, tree = _moe_checkpoint()
    cfg = load_config({"train_batch_size": 16, "gradient_clipping": 1.0,
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "model": GPT2})
    plan, state = _import(ckpt, cfg, tree, mapping_sources({n: n for n in ckpt.params}))
    tokens = np.load(os.path.join(FIXTURES, "moe_step3_tokens.npy"))  # DeepSpeed's batch (seed 2), 2 x 16
    # each device gets the 2 rows each DeepSpeed rank had: the gate's l_aux is over the same 32 tokens
    batch = {"tokens": np.tile(tokens, (8, 1)).astype(np.int32)}
    gates = np.asarray(ckpt.params["moe.deepspeed_moe.gate.wg.weight"])
    counts = np.bincount((ckpt.params["embed.weight"][tokens.reshape(-1)] @ gates.T).argmax(1), minlength=2)
    assert counts.max() <= 16, counts  # DeepSpeed's capacity for 32 tokens, 2 experts: no token was dropped
    state, metrics = make_train_step(cfg, plan, _moe_loss)(state, batch)
    want = [np.load(os.path.join(FIXTURES, f"moe_rank{r}_step3.npz")) for r in (0, 1)]
    np.testing.assert_allclose(float(metrics["loss"]), float(want[0]["loss"]), rtol=1e-6)
    got = dict(zip(leaf_names(plan.abstract_params), jax.tree.leaves(jax.device_get(state.params))))
    for r, w in enumerate(want):
        for name in w.files:
            if name != "loss":
                np.testing.assert_allclose(got[name.replace("experts.0.", f"experts.{r}.")], w[name],
                                           rtol=0, atol=3e-7, err_msg=name)


def test_import_holds_one_leaf_of_checkpoint_tensors_at_a_time():
    """import_state asks the checkpoint for one leaf's tensors, places them, and lets them go before
    the next leaf: the checkpoint tensors alive at once never exceed the largest parameter."""
    ckpt = ds.read_checkpoint(os.path.join(FIXTURES, "universal"))
    meter = {"live": 0, "peak": 0}
    held = dataclasses.replace(ckpt, **{k: _Held(getattr(ckpt, k), meter) for k in ("params", "exp_avg",
                                                                                    "exp_avg_sq")})
    cfg = _gpt2(3)
    _import(held, cfg, gpt.abstract_params(cfg.model))
    largest = max(int(np.prod(s)) * 4 for s in ckpt.params.shapes.values())
    total = 3 * sum(int(np.prod(s)) * 4 for s in ckpt.params.shapes.values())
    assert 0 < meter["peak"] <= largest < total / 3


def _damage(folder, damage):
    tag = os.path.join(folder, "global_step2_universal")
    param = os.path.join(tag, "zero", "transformer.h.0.attn.c_attn.weight")
    if damage == "truncated fp32.pt":
        with open(os.path.join(param, "fp32.pt"), "r+b") as f:
            f.truncate(os.path.getsize(f.name) // 2)
    elif damage == "missing exp_avg.pt":
        os.remove(os.path.join(param, "exp_avg.pt"))
    else:
        os.remove(os.path.join(folder, "latest_universal"))


@pytest.mark.parametrize("damage, says", [
    ("truncated fp32.pt", r"\S+/zero/transformer\.h\.0\.attn\.c_attn\.weight/fp32\.pt is truncated or corrupt .*use "
                          r"an earlier checkpoint or save it again"),
    ("missing exp_avg.pt", r"\S+/zero/transformer\.h\.0\.attn\.c_attn\.weight/exp_avg\.pt is missing .*run "
                           r"ds_to_universal\.py on the original checkpoint again, or copy the missing files"),
    ("missing latest_universal", r"\S+/universal has no `latest` \(nor ds_to_universal\.py's `latest_universal`\) "
                                 r"file .*pass one of them \(e\.g\. \S+/universal/global_step2_universal\)"),
])
def test_a_damaged_universal_folder_is_one_error_on_every_route(tmp_path, capsys, damage, says):
    """`train.py --resume DS_FOLDER` and `zerojax import-deepspeed`: one line naming the file and the fix,
    before any run folder is made or anything compiled; the DeepSpeed folder is left as it was."""
    import json
    import re
    import shutil
    from zerojax.app.cli import main
    folder = str(tmp_path / "universal")
    shutil.copytree(os.path.join(FIXTURES, "universal"), folder)
    _damage(folder, damage)
    before = {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(folder) for f in fs}
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps({"train_batch_size": 8, "mesh": {"cpu_devices": 8}, "model": GPT2,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                                  "zero_optimization": {"stage": 3}, "run": {"output_dir": str(tmp_path / "run")}}))
    for command in (["train", "--config", str(config), "--resume", folder],
                    ["import-deepspeed", folder, str(tmp_path / "zj"), "--config", str(config)]):
        code = main(command)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and re.fullmatch(f"zerojax: error: {says}\n", err), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "zj").exists()
    assert {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(folder) for f in fs} \
        == before
