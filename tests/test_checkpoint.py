"""Checkpoints: exact resume, any mesh and stage, crash safety, retention, export."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from safetensors.numpy import load_file

from zerojax import checkpoint as ckpt
from zerojax.config import ModelConfig, load_config
from zerojax.planner.plan import make_plan
from zerojax.models import gpt
from zerojax.core.state import TrainState
from zerojax.planner.api import init_state
from zerojax.planner.api import make_train_step

REPO = Path(__file__).resolve().parents[1]
GPT = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64)
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 3e-2}}


def mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def config(stage: int = 2, bf16: bool = True, optimizer: str = "Adam", **batch):
    """Adam with weight decay and a warmup schedule; stage 3 shards every parameter."""
    return load_config({**(batch or {"train_batch_size": 16, "gradient_accumulation_steps": 2}),
                        "optimizer": {"type": optimizer, "params": {"lr": 3e-2, "weight_decay": 0.01}},
                        "scheduler": SCHEDULER, "bf16": {"enabled": bf16},
                        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                        "zero_allow_untested_optimizer": True})


# A small dict-of-arrays model: cheap to compile, every leaf divisible by 8 devices.
def small_params(extra_leaf: bool = False, width: int = 64) -> dict:
    rng = np.random.default_rng(0)
    p = {"dense": {"kernel": rng.normal(size=(16, width)).astype(np.float32) / 4,
                   "bias": rng.normal(size=(width,)).astype(np.float32) / 10},
         "out": rng.normal(size=(width, 8)).astype(np.float32) / 8}
    if extra_leaf:
        p["extra"] = np.zeros((3,), np.float32)
    return p


def mlp_loss(params: dict, batch: dict) -> jax.Array:
    h = jnp.tanh(batch["x"].astype(params["out"].dtype) @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.mean(jnp.square((h @ params["out"]).astype(jnp.float32) - batch["y"]))


def batch(step: int, rows: int) -> dict:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(rows, 16)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :8] * 2).astype(np.float32)}


def host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for path, x, y in zip([jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(a)],
                          jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=path)


def set_step(state: TrainState, step: int, plan) -> TrainState:
    return state._replace(step=jax.device_put(np.int32(step), plan.replicated))


def small_setup(n: int = 8, stage: int = 2, bf16: bool = True, params=None, optimizer: str = "Adam"):
    cfg = config(stage, bf16, optimizer, train_batch_size=8)
    params = small_params() if params is None else params
    plan = make_plan(cfg, mesh(n), params)
    return plan, init_state(cfg, plan, params)


# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_is_bitwise(tmp_path, stage) -> None:
    """10 steps == 5 steps + async save + load onto a fresh plan + 5 steps, bit for bit (bf16, scheduler)."""
    cfg = config(stage, bf16=True)
    params = small_params()
    plan = make_plan(cfg, mesh(8), params)
    step = make_train_step(cfg, plan, mlp_loss)
    state = init_state(cfg, plan, params)
    for i in range(10):
        if i == 5:  # save, then keep training (and donating the state) while the write goes on
            pending = ckpt.save(tmp_path, None, state, plan, extra={"data_position": i})
        state, _ = step(state, batch(i, 16))
        if i == 5:
            pending.wait()
    expected = host(state)

    plan2 = make_plan(cfg, mesh(8), jax.eval_shape(lambda: params))
    restored, extra = ckpt.load(tmp_path, None, plan2)
    assert ckpt.latest_tag(tmp_path) == "global_step5" and extra == {"data_position": 5}
    assert int(restored.step) == 5
    step2 = make_train_step(cfg, plan2, mlp_loss)
    for i in range(extra["data_position"], 10):
        restored, _ = step2(restored, batch(i, 16))
    assert_trees_equal(host(restored), expected)


RESUME_CHILD = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    import test_checkpoint as t
    from zerojax import checkpoint as ckpt
    from zerojax.planner.plan import make_plan
    from zerojax.planner.api import make_train_step

    out = {}
    for name in sys.argv[3:]:
        cfg = t.RESUME_CASES[name]
        plan = make_plan(cfg, t.mesh(8), jax.eval_shape(t.small_params))
        state, extra = ckpt.load(f"{sys.argv[1]}/{name}", None, plan)
        step = make_train_step(cfg, plan, t.mlp_loss)
        for i in range(extra["data_position"], 10):
            state, _ = step(state, t.resume_batch(i, name))
        out.update(t.as_bytes(name, state))
    np.savez(f"{sys.argv[1]}/resumed.npz", **out)
""")

RESUME_CASES = {f"stage{s}": config(s, bf16=True) for s in range(4)}
RESUME_CASES["fp16-stage3"] = load_config({
    "train_batch_size": 16, "gradient_accumulation_steps": 2, "scheduler": SCHEDULER,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "weight_decay": 0.01}},
    "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 3},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})


def resume_batch(i: int, case: str) -> dict:
    """In the fp16 case steps 2 and 6 overflow (a non-finite input), so the saved scale has moved."""
    b = batch(i, 16)
    if case.startswith("fp16") and i in (2, 6):
        b["x"][0, 0] = np.inf
    return b


def as_bytes(case: str, state: TrainState) -> dict[str, np.ndarray]:
    """Every leaf's raw bytes and dtype name (npz cannot hold bfloat16), for a bitwise comparison."""
    out = {}
    for path, leaf in zip(ckpt.leaf_names(state), jax.tree.leaves(state)):
        x = np.asarray(jax.device_get(leaf))
        out[f"{case}/{path}"] = np.frombuffer(x.tobytes(), np.uint8)
        out[f"{case}/{path}:dtype"] = np.array(x.dtype.name)
    return out


def test_resume_in_a_fresh_process_is_bitwise(tmp_path) -> None:
    """10 steps == 5 steps + save + load in another process + 5 steps, bit for bit, for stages 0-3
    (bf16, a schedule) and fp16 with a dynamic scale that moved; the data position comes back."""
    expected = {}
    for name, cfg in RESUME_CASES.items():
        plan = make_plan(cfg, mesh(8), small_params())
        step = make_train_step(cfg, plan, mlp_loss)
        state = init_state(cfg, plan, small_params())
        for i in range(10):
            if i == 5:
                ckpt.save(tmp_path / name, None, state, plan, extra={"data_position": i}, async_save=False)
            state, _ = step(state, resume_batch(i, name))
        if name.startswith("fp16"):
            assert int(state.skipped) == 2 and float(state.scaler.scale) == 2.0 ** 6
        assert np.all(np.isfinite(np.asarray(jax.device_get(state.params["out"]), np.float32)))
        expected.update(as_bytes(name, state))

    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", RESUME_CHILD, str(tmp_path), str(Path(__file__).parent),
                           *RESUME_CASES], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = dict(np.load(tmp_path / "resumed.npz"))
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        np.testing.assert_array_equal(got[key], want, err_msg=key)


def test_restore_onto_other_meshes_and_stages(tmp_path) -> None:
    """Saved on 8 devices at stage 3; resumed on 4 devices at stage 1 and 1 device at stage 0."""
    params = small_params()
    cfg = config(3, bf16=False, train_batch_size=8)
    plan = make_plan(cfg, mesh(8), params)
    step = make_train_step(cfg, plan, mlp_loss)
    state = init_state(cfg, plan, params)
    for i in range(10):
        if i == 5:
            ckpt.save(tmp_path, None, state, plan, async_save=False)
        state, _ = step(state, batch(i, 8))
    expected = host(state)

    for n, stage in [(4, 1), (1, 0)]:
        cfg2 = config(stage, bf16=False, train_batch_size=8)
        plan2 = make_plan(cfg2, mesh(n), jax.eval_shape(lambda: params))
        restored, _ = ckpt.load(tmp_path, "global_step5", plan2)
        assert restored.params["dense"]["kernel"].sharding == plan2.param_shardings["dense"]["kernel"]
        assert [x.sharding for x in jax.tree.leaves(restored.opt_state)] == jax.tree.leaves(
            plan2.opt_state_shardings)
        step2 = make_train_step(cfg2, plan2, mlp_loss)
        for i in range(5, 10):
            restored, _ = step2(restored, batch(i, 8))
        got = host(restored)
        assert int(got.step) == 10
        for a, b in zip(jax.tree.leaves((got.params, got.opt_state)),
                        jax.tree.leaves((expected.params, expected.opt_state))):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(b))))


def test_precision_changes_take_the_master_as_truth(tmp_path) -> None:
    plan16, state16 = small_setup(stage=3, bf16=True)
    ckpt.save(tmp_path, "mixed", state16, plan16, async_save=False)
    plan32, state32 = small_setup(n=4, stage=1, bf16=False)
    ckpt.save(tmp_path, "full", set_step(state32, 7, plan32), plan32, async_save=False)

    got32, _ = ckpt.load(tmp_path, "mixed", small_setup(n=2, stage=2, bf16=False)[0])
    assert got32.master is None
    assert_trees_equal(host(got32.params), host(state16.master))
    assert_trees_equal(host(got32.opt_state), host(state16.opt_state))

    plan, _ = small_setup(n=8, stage=3, bf16=True)
    got16, _ = ckpt.load(tmp_path, "full", plan)
    assert_trees_equal(host(got16.master), host(state32.params))
    assert_trees_equal(host(got16.params), jax.tree.map(lambda x: x.astype(jnp.bfloat16), host(state32.params)))
    assert int(got16.step) == 7
    assert ckpt.metadata(tmp_path, "mixed")["precision"] == {"param": "bfloat16", "master": "float32"}


def test_module_only_and_fresh_optimizer(tmp_path) -> None:
    plan, state = small_setup(stage=1)
    trained = set_step(state, 4, plan)._replace(
        opt_state=jax.tree.map(lambda x: x + 1 if x.ndim else x, state.opt_state))
    ckpt.save(tmp_path, "t", trained, plan, async_save=False)
    fresh_opt = host(state.opt_state)

    only, _ = ckpt.load(tmp_path, "t", plan, load_module_only=True)
    assert int(only.step) == 0 and int(only.skipped) == 0
    assert_trees_equal(host(only.opt_state), fresh_opt)
    assert_trees_equal(host(only.master), host(state.master))

    no_opt, _ = ckpt.load(tmp_path, "t", plan, load_optimizer_states=False)
    assert int(no_opt.step) == 4
    assert_trees_equal(host(no_opt.opt_state), fresh_opt)

    full, _ = ckpt.load(tmp_path, "t", plan)
    assert_trees_equal(host(full.opt_state), host(trained.opt_state))


def test_async_save_then_wait(tmp_path) -> None:
    plan, state = small_setup()
    pending = ckpt.save(tmp_path, "a", state, plan, extra={"client": [1, 2]})
    pending.wait()
    assert pending.done() and pending.path == tmp_path / "a"
    assert ckpt.list_tags(tmp_path) == ["a"] and ckpt.latest_tag(tmp_path) == "a"
    assert (tmp_path / "latest").read_text().strip() == "a"
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert meta["params"]["dense.kernel"] == {"shape": [16, 64], "dtype": "float32"}
    assert meta["extra"] == {"client": [1, 2]} and meta["step"] == 0
    # A load right after an unfinished save waits for it.
    ckpt.save(tmp_path, "b", set_step(state, 1, plan), plan)
    restored, extra = ckpt.load(tmp_path, None, plan)
    assert int(restored.step) == 1 and extra == {}
    with pytest.raises(Exception, match="JSON-serializable"):
        ckpt.save(tmp_path, "c", state, plan, extra={"bad": object()})


def test_latest_list_and_prune(tmp_path) -> None:
    plan, state = small_setup(stage=0)
    for k in range(1, 7):
        ckpt.save(tmp_path, None, set_step(state, k, plan), plan, async_save=False)
    assert ckpt.list_tags(tmp_path) == [f"global_step{k}" for k in range(1, 7)]
    assert ckpt.latest_tag(tmp_path) == "global_step6"
    assert ckpt.prune(tmp_path, max_to_keep=2, keep_every_n_steps=3) == ["global_step1", "global_step2",
                                                                          "global_step4"]
    assert ckpt.list_tags(tmp_path) == ["global_step3", "global_step5", "global_step6"]
    # `latest` is the last save, even at an older step, and pruning never removes it.
    ckpt.save(tmp_path, "best", set_step(state, 2, plan), plan, async_save=False)
    assert ckpt.latest_tag(tmp_path) == "best"
    assert ckpt.prune(tmp_path, max_to_keep=1) == ["global_step3", "global_step5"]
    assert ckpt.list_tags(tmp_path) == ["best", "global_step6"]
    # Retention can run as part of a save.
    ckpt.save(tmp_path, None, set_step(state, 9, plan), plan, max_to_keep=1).wait()
    assert ckpt.list_tags(tmp_path) == ["global_step9"]
    # A `latest` naming a vanished tag falls back to the newest complete one.
    (tmp_path / "latest").write_text("gone\n")
    assert ckpt.latest_tag(tmp_path) == "global_step9"
    assert ckpt.list_tags(tmp_path / "nothing") == [] and ckpt.latest_tag(tmp_path / "nothing") is None


def test_the_best_pointer_is_kept_by_retention_and_read_as_tag_best(tmp_path) -> None:
    """save(best=True) points the hidden `.best` at the tag once complete; retention keeps that tag
    whatever max_to_keep says; `--tag best` reads it, unless a tag called best exists (it wins)."""
    plan, state = small_setup(stage=0)
    ckpt.save(tmp_path, None, set_step(state, 1, plan), plan, async_save=False)
    ckpt.save(tmp_path, None, set_step(state, 2, plan), plan, async_save=True, best=True).wait()
    assert ckpt.best_tag(tmp_path) == "global_step2" and (tmp_path / ".best").is_file()
    for k in (3, 4):
        ckpt.save(tmp_path, None, set_step(state, k, plan), plan, async_save=False, max_to_keep=1)
    assert ckpt.list_tags(tmp_path) == ["global_step2", "global_step4"]
    assert ckpt.resolve_tag(tmp_path, "best").name == "global_step2"
    ckpt.save(tmp_path, "best", set_step(state, 5, plan), plan, async_save=False)  # a tag of that name
    assert ckpt.resolve_tag(tmp_path, "best").name == "best"


def test_latest_naming_a_path_is_never_followed(tmp_path) -> None:
    """A `latest` holding `..` (or a path) is ignored even where it leads to a complete checkpoint:
    a resume never leaves the folder it was pointed at."""
    plan, state = small_setup(stage=0)
    ckpt.save(tmp_path, "a", state, plan, async_save=False)
    inner = tmp_path / "a" / "inner"
    inner.mkdir()
    for pointer in ("..", "../a", str(tmp_path / "a")):
        (inner / "latest").write_text(pointer + "\n")
        assert ckpt.latest_tag(inner) is None, pointer


def test_existing_tag_is_never_overwritten(tmp_path) -> None:
    plan, state = small_setup()
    ckpt.save(tmp_path, "t", set_step(state, 3, plan), plan).wait()
    with pytest.raises(FileExistsError, match=r"checkpoint .*/t already exists .* another tag"):
        ckpt.save(tmp_path, "t", set_step(state, 4, plan), plan)
    assert ckpt.metadata(tmp_path, "t")["step"] == 3
    with pytest.raises(ValueError, match="not a usable folder name"):
        ckpt.save(tmp_path, "../x", state, plan)


def test_incomplete_leftover_is_ignored_and_replaced(tmp_path, monkeypatch) -> None:
    plan, state = small_setup()
    ckpt.save(tmp_path, "global_step1", set_step(state, 1, plan), plan, async_save=False)
    leftover = tmp_path / "global_step2"
    with monkeypatch.context() as m:  # the save is interrupted after orbax, before meta.json
        m.setattr(ckpt.saving, "_commit", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(tmp_path, "global_step2", set_step(state, 2, plan), plan, async_save=False)
    assert (leftover / ckpt.format.SAVING_FILE).is_file() and not (leftover / "meta.json").exists()
    (leftover / "state.orbax-checkpoint-tmp-1").mkdir()
    assert ckpt.list_tags(tmp_path) == ["global_step1"] and ckpt.latest_tag(tmp_path) == "global_step1"
    with pytest.raises(ValueError, match="incomplete"):
        ckpt.load(tmp_path, "global_step2", plan)
    assert int(ckpt.load(tmp_path, None, plan)[0].step) == 1
    ckpt.save(tmp_path, "global_step2", set_step(state, 2, plan), plan).wait()  # zerojax's own leftover: replaced
    assert not (leftover / "state.orbax-checkpoint-tmp-1").exists()
    assert not (leftover / ckpt.format.SAVING_FILE).exists()  # complete: the in-progress mark is gone
    assert ckpt.list_tags(tmp_path) == ["global_step1", "global_step2"]


def test_a_users_folder_in_the_way_is_never_deleted(tmp_path) -> None:
    """A folder without meta.json that zerojax did not mark as its own interrupted save (a DeepSpeed tag,
    the user's notes) is one error naming it, and every file stays."""
    plan, state = small_setup()
    mine = tmp_path / "global_step2"
    mine.mkdir()
    (mine / "mp_rank_00_model_states.pt").write_bytes(b"user's bytes")
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint {mine} exists and is not a zerojax checkpoint "
                                                   rf"\(no meta.json\) .* it is never deleted: move it away"):
        ckpt.save(tmp_path, None, set_step(state, 2, plan), plan)
    assert sorted(p.name for p in mine.iterdir()) == ["mp_rank_00_model_states.pt"]
    assert (mine / "mp_rank_00_model_states.pt").read_bytes() == b"user's bytes"
    assert not (tmp_path / "latest").exists()


def test_retention_deletes_only_this_runs_tags(tmp_path, monkeypatch) -> None:
    """max_to_keep prunes the tags of the run that saves (a resumed run is the same run), never another
    run's nor a folder zerojax did not write."""
    plan, state = small_setup(stage=0)
    user = tmp_path / "notes"  # looks like a tag to a careless scan: meta.json with a step, and state/
    (user / "state").mkdir(parents=True)
    (user / "meta.json").write_text('{"step": 0, "what": "my own notes"}')
    monkeypatch.setattr(ckpt.pending, "_RUNS", {}, raising=False)  # run A (a process of its own)
    for k in (1, 2):
        ckpt.save(tmp_path, None, set_step(state, k, plan), plan, async_save=False)
    monkeypatch.setattr(ckpt.pending, "_RUNS", {}, raising=False)  # run B, another process, same folder
    for k in (3, 4):
        ckpt.save(tmp_path, None, set_step(state, k, plan), plan, async_save=False, max_to_keep=1)
    assert ckpt.list_tags(tmp_path) == ["notes", "global_step1", "global_step2", "global_step4"]
    monkeypatch.setattr(ckpt.pending, "_RUNS", {}, raising=False)  # run A resumed: its later saves prune its own tags
    restored, _ = ckpt.load(tmp_path, "global_step2", plan)
    ckpt.save(tmp_path, None, set_step(restored, 5, plan), plan, async_save=False, max_to_keep=1)
    assert ckpt.list_tags(tmp_path) == ["notes", "global_step4", "global_step5"]
    assert (user / "meta.json").read_text() == '{"step": 0, "what": "my own notes"}'


def test_missing_and_wrong_model_errors(tmp_path, monkeypatch) -> None:
    plan, state = small_setup()
    cfg = config(2, True, "Adam", train_batch_size=8)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "none")):
        ckpt.load(tmp_path / "none", None, plan)
    ckpt.save(tmp_path, "t", state, plan, async_save=False)
    with pytest.raises(FileNotFoundError, match=r"global_step3 does not exist; complete tags .*\['t'\]"):
        ckpt.load(tmp_path, "global_step3", plan)

    other = small_params(extra_leaf=True, width=24)
    del other["dense"]["bias"]
    other_plan = make_plan(cfg, plan.mesh, other)
    monkeypatch.setattr(ckpt.loading, "_restore", lambda *a: pytest.fail("orbax reached before the model check"))
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(tmp_path, "t", other_plan)
    text = str(err.value)
    assert "different model: 4 parameter(s) differ" in text
    assert "dense.kernel: checkpoint (16, 64), model (16, 24)" in text
    assert "out: checkpoint (64, 8), model (24, 8)" in text
    assert "extra: model (3,), not in the checkpoint" in text
    assert "dense.bias: checkpoint (64,), not in the model" in text


def test_other_optimizer_needs_fresh_optimizer_state(tmp_path) -> None:
    plan, state = small_setup(stage=0)
    ckpt.save(tmp_path, "t", state, plan, async_save=False)
    sgd_plan, _ = small_setup(stage=0, optimizer="SGD")
    with pytest.raises(ckpt.CheckpointError, match="load_optimizer_states=False"):
        ckpt.load(tmp_path, "t", sgd_plan)
    restored, _ = ckpt.load(tmp_path, "t", sgd_plan, load_optimizer_states=False)
    assert_trees_equal(host(restored.master), host(state.master))


def test_export_round_trip(tmp_path) -> None:
    plan, state = small_setup(stage=3, bf16=True)
    ckpt.save(tmp_path / "ck", "t", state, plan, async_save=False)
    master = host(state.master)

    out = ckpt.export_safetensors(tmp_path / "ck", None, tmp_path / "model.safetensors")
    assert_trees_equal(ckpt.load_exported(out), master)
    assert sorted(load_file(str(out))) == ["dense.bias", "dense.kernel", "out"]

    out16 = ckpt.export_safetensors(tmp_path / "ck", "t", tmp_path / "m16.safetensors", dtype="bf16")
    assert_trees_equal(ckpt.load_exported(out16), jax.tree.map(lambda x: x.astype(jnp.bfloat16), master))
    assert out16.stat().st_size < out.stat().st_size
    with pytest.raises(ValueError, match="export dtype"):
        ckpt.export_safetensors(tmp_path / "ck", "t", tmp_path / "x", dtype="int8")


def test_export_gpt_names(tmp_path) -> None:
    cfg = config(2, bf16=False, train_batch_size=8)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), gpt.abstract_params(GPT))
    plan = make_plan(cfg, mesh(8), params)
    ckpt.save(tmp_path, "t", init_state(cfg, plan, params), plan, async_save=False)
    exported = ckpt.load_exported(ckpt.export_safetensors(tmp_path, "t", tmp_path / "gpt.safetensors"))
    assert_trees_equal(exported, host(params))


CHILD = textwrap.dedent("""
    import itertools, sys
    import numpy as np, jax
    from jax.sharding import Mesh
    from zerojax import checkpoint as ckpt
    from zerojax.config import load_config
    from zerojax.planner.plan import make_plan
    from zerojax.planner.api import init_state

    cfg = load_config({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    params = {"w": np.random.default_rng(0).normal(size=(1024, 4096)).astype(np.float32)}
    plan = make_plan(cfg, Mesh(np.array(jax.devices()[:1]), ("data",)), params)
    state = init_state(cfg, plan, params)
    ckpt.save(sys.argv[1], "step1", state, plan, extra={"k": 1}, async_save=False)
    for k in itertools.count(2):  # each save first waits for the previous one to complete
        state = state._replace(step=state.step + 1, params={"w": state.params["w"] + 1})
        ckpt.save(sys.argv[1], f"step{k}", state, plan, extra={"k": k})
        print("STARTED", k, flush=True)
""")


def test_kill_during_async_save_keeps_previous_checkpoint(tmp_path) -> None:
    """SIGKILL while async saves are in flight: the newest complete tag loads, partial ones are ignored."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    try:
        for line in child.stdout:
            if line.split() == ["STARTED", "3"]:  # step2 has completed, step3 is being written
                child.send_signal(signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    tags = ckpt.list_tags(tmp_path)
    newest = len(tags)
    assert newest >= 2 and tags == [f"step{k}" for k in range(1, newest + 1)]
    assert ckpt.latest_tag(tmp_path) == f"step{newest}"
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and p.name not in tags)
    assert leftovers in ([], [f"step{newest + 1}"])  # the save the kill interrupted
    assert all(not (tmp_path / t / "meta.json").exists() for t in leftovers)

    cfg = load_config({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    plan = make_plan(cfg, mesh(8), {"w": jax.ShapeDtypeStruct((1024, 4096), jnp.float32)})
    state, extra = ckpt.load(tmp_path, None, plan)
    assert extra == {"k": newest} and int(state.step) == newest - 1
    first = np.float32(np.random.default_rng(0).normal())  # the child's w[0, 0] before its updates
    assert float(state.params["w"][0, 0]) == pytest.approx(float(first) + newest - 1)


def test_a_checkpoint_written_before_the_package_was_layered_still_loads(tmp_path) -> None:
    """tests/fixtures/checkpoints/before_layers was saved by the flat package (make_before_layers.py:
    two ZeRO-2 bf16 steps); today's code restores it and it equals the same two steps run now."""
    import shutil
    import zerojax
    from helpers import assert_tree_close, data_mesh, make_batch, mlp_params, mse_loss, to_numpy
    config = {"train_batch_size": 16, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "gradient_clipping": 1.0}
    saved = shutil.copytree(Path(__file__).parent / "fixtures" / "checkpoints" / "before_layers", tmp_path / "old")
    assert ckpt.verify(saved) == "global_step2"
    restored = zerojax.initialize(config, params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh())
    _, client = restored.load_checkpoint(str(saved))
    assert restored.global_steps == 2 and client == {"note": "written before the package was layered"}
    now = zerojax.initialize(config, params=mlp_params(0), loss_fn=mse_loss, mesh=data_mesh())
    for seed in range(2):
        now.train_batch(make_batch(16, seed))
    assert_tree_close(to_numpy(restored.state.master), to_numpy(now.state.master), rtol=1e-6, atol=1e-7,
                      what="restored master vs two steps now")
    assert_tree_close(to_numpy(restored.state.opt_state), to_numpy(now.state.opt_state), rtol=1e-6, atol=1e-7,
                      what="restored Adam state vs two steps now")


def test_orbax_is_imported_at_the_first_save_not_at_start() -> None:
    """train.py's modules load without orbax (a third of a second before anything compiles); the
    first save imports it."""
    root = Path(__file__).resolve().parents[1]
    code = ("import sys\nfrom zerojax.app import cli, trainer\nimport zerojax, zerojax.checkpoint\n"
            "print('orbax.checkpoint' in sys.modules)\n"
            "from zerojax.checkpoint.saving import _handler\n_handler()\nprint('orbax.checkpoint' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "True"]
