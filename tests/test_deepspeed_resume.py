"""Continuing a DeepSpeed run: a ZeRO checkpoint in DeepSpeed's layout (written by the project's own
writer, as torch is not a dependency) imported and continued on 8 devices at every stage, exactly."""
import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from zerojax import checkpoint as ck
from zerojax.app.deepspeed import export_fp32_state_dict, import_into
from zerojax.checkpoint import deepspeed_format as ds, torch_zip
from zerojax.checkpoint.deepspeed_import import DeepSpeedImportError, is_deepspeed_checkpoint
from zerojax.config import load_config
from zerojax.core.names import dotted
from zerojax.models import gpt, hf
from zerojax.planner.api import init_state, make_train_step
from zerojax.planner.plan import make_plan

MODEL = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}
N, K = 3, 2  # steps before the checkpoint, steps after


def config(stage, **model):
    return load_config({"train_batch_size": 16, "gradient_clipping": 1.0,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
                        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                        "model": {**MODEL, **model}})


def mesh():
    return Mesh(np.array(jax.devices()), ("data",))


def batch(i):
    return {"tokens": np.random.default_rng(i).integers(0, 64, (16, 17), dtype=np.int32)}


def setup(stage):
    cfg = config(stage)
    plan = make_plan(cfg, mesh(), gpt.abstract_params(cfg.model))
    return cfg, plan, make_train_step(cfg, plan, gpt.make_loss_fn(cfg.model))


def hf_named(cfg, tree):
    """A zerojax parameter-shaped tree as the HF Trainer's DeepSpeed names (GPT2LMHeadModel, untied)."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        out.update(hf.named_tensors(cfg.model, tuple(dotted(path, "").split(".")), np.asarray(x)))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """N steps at stage 2, written in DeepSpeed's layout at stages 2 and 3 on dp 2; then K more steps."""
    cfg, plan, step = setup(2)
    state = init_state(cfg, plan, jax.jit(lambda: gpt.init_params(cfg.model, 0))())
    for i in range(N):
        state, _ = step(state, batch(i))
    opt = jax.device_get(state.opt_state)
    moments = opt.inner_state[0]
    folders = {}
    for ds_stage in (2, 3):
        folder = tmp_path_factory.mktemp(f"ds{ds_stage}")
        ds.write_checkpoint(folder, f"global_step{N}", hf_named(cfg, jax.device_get(state.params)),
                            hf_named(cfg, moments.mu), hf_named(cfg, moments.nu), stage=ds_stage, dp=2,
                            step=int(moments.count), global_steps=N, global_samples=16 * N, skipped_steps=0,
                            lr=float(opt.hyperparams["learning_rate"]), lr_scheduler={"last_batch_iteration": N - 1},
                            weight_decay=0.01, client_state={"epoch": 1})
        folders[ds_stage] = folder
    losses = []
    for i in range(N, N + K):
        state, m = step(state, batch(i))
        losses.append(float(m["loss"]))
    return folders, losses, jax.device_get(state)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_continue_deepspeed_run_at_every_stage(tmp_path, run, stage):
    folders, want_losses, want = run
    cfg, plan, step = setup(stage)
    for ds_stage, folder in folders.items():
        where = tmp_path / f"from{ds_stage}"
        source = folder / f"global_step{N}" if ds_stage == 3 else folder  # a tag folder, or the run with `latest`
        tag_dir = import_into(source, where, plan, cfg)
        state, extra = ck.load(where, tag_dir.name, plan)
        assert int(state.step) == N and extra["data_position"] == N and extra["client_state"] == {"epoch": 1}
        losses = []
        for i in range(N, N + K):
            state, m = step(state, batch(i))
            losses.append(float(m["loss"]))
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, err_msg=f"DeepSpeed stage {ds_stage}")
        got = jax.device_get(state)
        for a, b in zip(jax.tree.leaves((got.params, got.opt_state)), jax.tree.leaves((want.params, want.opt_state))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.max(np.abs(b)))))


def test_shape_mismatch_names_file_leaf_and_fix(tmp_path, run):
    folders, _, _ = run
    cfg = config(2, d_ff=128)
    plan = make_plan(cfg, mesh(), gpt.abstract_params(cfg.model))
    with pytest.raises(DeepSpeedImportError) as e:
        import_into(folders[2], tmp_path / "x", plan, cfg)
    msg = str(e.value)
    assert "mp_rank_00_model_states.pt" in msg and "transformer.h.0.mlp.c_fc.bias" in msg
    assert "has shape [64]" in msg and "needs [128]" in msg and "blocks.fc.bias" in msg and "model.d_model" in msg
    assert not (tmp_path / "x").exists()


def test_missing_rank_file_is_named(tmp_path, run):
    import shutil
    folders, _, _ = run
    copy = tmp_path / "ds"
    shutil.copytree(folders[3], copy)
    (copy / f"global_step{N}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    cfg, plan, _ = setup(1)
    with pytest.raises(DeepSpeedImportError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"):
        import_into(copy, tmp_path / "x", plan, cfg)


def test_custom_model_mapping_and_loss_scale(tmp_path):
    """A model outside the name table, through a names mapping (stacked `{i}`, transposed); fp16's
    dynamic loss scaler carried over."""
    rng = np.random.default_rng(0)
    params = {"blocks": {"w": rng.normal(size=(2, 8, 4)).astype(np.float32)}, "out": rng.normal(size=(4,)).astype(np.float32)}
    named = {f"layers.{i}.linear.weight": params["blocks"]["w"][i].T for i in range(2)}
    named["head.bias"] = params["out"]
    moments = {k: v * 0.5 for k, v in named.items()}
    squares = {k: v * v for k, v in named.items()}
    scaler = {"type": "DynamicLossScaler", "cur_scale": 512.0, "cur_iter": 7, "last_overflow_iter": 5, "cur_hysteresis": 1}
    ds.write_checkpoint(tmp_path / "ds", "global_step7", named, moments, squares, stage=3, dp=2, step=6,
                        global_steps=7, global_samples=56, skipped_steps=1, lr=1e-3, loss_scaler=scaler,
                        lr_scheduler=None, precision="fp16")
    assert is_deepspeed_checkpoint(tmp_path / "ds") and is_deepspeed_checkpoint(tmp_path / "ds" / "global_step7")
    cfg = load_config({"train_batch_size": 8, "fp16": {"enabled": True},
                       "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}})
    plan = make_plan(cfg, mesh(), jax.eval_shape(lambda: params))
    names = {"layers.{i}.linear.weight": {"leaf": "blocks.w", "transpose": True}, "head.bias": "out"}
    tag_dir = import_into(tmp_path / "ds", tmp_path / "zj", plan, cfg, names=names)
    state, _ = ck.load(tmp_path / "zj", tag_dir.name, plan)
    np.testing.assert_array_equal(np.asarray(state.master["blocks"]["w"]), params["blocks"]["w"])
    adam = state.opt_state.inner_state[0]
    np.testing.assert_array_equal(np.asarray(adam.mu["blocks"]["w"]), params["blocks"]["w"] * 0.5)
    assert int(adam.count) == 6 and int(state.opt_state.count) == 6  # no scheduler: global - skipped
    assert (int(state.step), int(state.skipped)) == (7, 1)
    assert float(state.scaler.scale) == 512.0 and int(state.scaler.hysteresis) == 1
    assert int(state.scaler.last_overflow) == 5
    with pytest.raises(DeepSpeedImportError, match=r"no DeepSpeed parameter is mapped to model leaves \['out'\]"):
        import_into(tmp_path / "ds", tmp_path / "zj2", plan, cfg, names={"layers.{i}.linear.weight": {
            "leaf": "blocks.w", "transpose": True}})
    small = make_plan(cfg, mesh(), {"out": jax.ShapeDtypeStruct((4,), np.float32)})
    with pytest.raises(DeepSpeedImportError, match=r"layers.0.linear.weight.*map to no model leaf"):
        import_into(tmp_path / "ds", tmp_path / "zj3", small, cfg, names={"head.bias": "out"})


def test_export_deepspeed_fp32_state_dict(tmp_path, run):
    folders, _, _ = run
    cfg, plan, _ = setup(3)
    tag_dir = import_into(folders[2], tmp_path / "zj", plan, cfg)
    out = export_fp32_state_dict(tmp_path / "zj", tag_dir.name, tmp_path)
    assert out.name == "pytorch_model.bin"
    # `--out new/`: a trailing slash names a folder, made if missing (not a file called `new`)
    assert export_fp32_state_dict(tmp_path / "zj", tag_dir.name, f"{tmp_path / 'new'}/") == \
        tmp_path / "new" / "pytorch_model.bin"
    assert torch_zip.load(tmp_path / "new" / "pytorch_model.bin").keys() == torch_zip.load(out).keys()
    exported = torch_zip.load(out)
    expected = ds.read_checkpoint(folders[2]).params
    assert list(exported) == sorted(expected, key=list(exported).index) and set(exported) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def _python_in(root):
    """`python ARGS` as a user runs it from the repository root (its own devices, not the tests' eight);
    returns a runner that asserts the exit code (`rc`, 0 by default) and hands back the finished process."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)

    def run(*args, rc=0):
        done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, cwd=root)
        assert done.returncode == rc, done.stderr[-3000:]
        return done
    return run


def test_train_py_resumes_a_deepspeed_folder_and_cli(tmp_path):
    """`train.py --resume DS/global_stepN` imports into a new run and continues; `zerojax
    import-deepspeed` and `export --format deepspeed` as a user runs them."""
    from pathlib import Path

    from zerojax.config import load_config as load

    root = Path(__file__).resolve().parents[1]
    sets = ["run.steps=5", "run.log_every=1", "model.d_model=32", "model.n_layers=2", "model.seq_len=16",
            "data.max_bytes=50000", "run.eval_batches=1", "run.progress=false", "run.sample_tokens=0",
            "scheduler.params.total_num_steps=5", "scheduler.params.warmup_num_steps=3"]
    cfg = load(str(root / "configs" / "zero2.yaml"), sets)
    params = jax.device_get(jax.jit(lambda: gpt.init_params(cfg.model, 1))())
    named = hf_named(cfg, params)
    zeros = {k: np.zeros_like(v) for k, v in named.items()}
    ds.write_checkpoint(tmp_path / "ds", "global_step3", named, zeros, zeros, stage=3, dp=2, step=3, global_steps=3,
                        global_samples=3 * cfg.train_batch_size, skipped_steps=0, lr=1e-3,
                        lr_scheduler={"last_batch_iteration": 2})
    run = _python_in(root)

    out = run("train.py", "--config", "configs/zero2.yaml", "--set", *sets, f"run.output_dir={tmp_path / 'run'}",
              "--resume", str(tmp_path / "ds" / "global_step3")).stdout
    assert "imported DeepSpeed checkpoint" in out and "at step 3" in out
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 5]
    done = run("-m", "zerojax.cli", "import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "zj"), "--config",
               "configs/zero2.yaml", "--set", *sets)
    assert "--resume" in done.stdout and (tmp_path / "zj" / "global_step3" / "meta.json").is_file()
    before = _files(tmp_path / "ds")  # into the DeepSpeed folder itself: refused, every file kept
    refused = run("-m", "zerojax.cli", "import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "ds"), "--config",
                  "configs/zero2.yaml", "--set", *sets, rc=2)
    assert "never writes into the checkpoint it reads" in refused.stderr, refused.stderr
    assert _files(tmp_path / "ds") == before
    run("-m", "zerojax.cli", "export", str(tmp_path / "zj"), "--format", "deepspeed", "--out", str(tmp_path / "sd.bin"))
    exported = torch_zip.load(tmp_path / "sd.bin")
    assert set(exported) == set(named)
    np.testing.assert_array_equal(exported["transformer.h.1.attn.c_attn.weight"], named["transformer.h.1.attn.c_attn.weight"])


def test_a_checkpoint_deepspeed_wrote_itself_on_every_route(tmp_path):
    """tests/fixtures/deepspeed/zero3 was written by DeepSpeed 0.19.8 + torch 2.13 (ZeRO-3, one rank; its
    flat fp32 group carries `ds_id`, pickled via torch._tensor._rebuild_from_type_v2). `train.py --resume`
    continues it and `zerojax import-deepspeed` imports it; exported back with `--out folder/` (a folder
    that does not exist yet), the weights are exactly what DeepSpeed's own zero_to_fp32 makes of it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    fixture = root / "tests" / "fixtures" / "deepspeed" / "zero3"
    model = ["model.d_model=4", "model.n_layers=1", "model.n_heads=1", "model.seq_len=16", "model.tie_embeddings=true"]
    run = _python_in(root)

    out = run("train.py", "--config", "configs/zero2.yaml", "--set", *model, "run.steps=3", "run.log_every=1",
              "data.max_bytes=50000", "run.eval_batches=1", "run.progress=false", "run.sample_tokens=0",
              f"run.output_dir={tmp_path / 'run'}", "--resume", str(fixture)).stdout
    assert "imported DeepSpeed checkpoint" in out and "at step 2" in out
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3]
    run("-m", "zerojax.cli", "import-deepspeed", str(fixture), str(tmp_path / "zj"), "--config", "configs/zero2.yaml",
        "--set", *model)
    run("-m", "zerojax.cli", "export", str(tmp_path / "zj"), "--format", "deepspeed", "--out", f"{tmp_path / 'out'}/")
    assert (tmp_path / "out").is_dir()
    exported = torch_zip.load(tmp_path / "out" / "pytorch_model.bin")
    reference = np.load(fixture.parent / "zero3_fp32.npz")
    assert set(exported) == set(reference) - {"lm_head.weight"}  # tied, as DeepSpeed saved it
    for name, value in exported.items():
        np.testing.assert_array_equal(value, reference[name], err_msg=name)


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_import_into_the_deepspeed_folder_itself_is_refused_keeping_every_file(tmp_path, run):
    """`zerojax import-deepspeed SRC SRC` (or into SRC/sub, or a tag folder into its run folder) would land
    on DeepSpeed's own tag folder and `latest`: refused before anything is read or written."""
    import shutil
    src = tmp_path / "ds"
    shutil.copytree(run[0][2], src)
    before = _files(src)
    cfg, plan, _ = setup(0)
    for source, destination in ((src, src), (src, src / "zerojax"), (src / f"global_step{N}", src),
                                (src / f"global_step{N}", src / f"global_step{N}")):
        with pytest.raises(DeepSpeedImportError, match=rf"import-deepspeed: the destination {destination} .*never "
                                                       rf"writes into the checkpoint it reads"):
            import_into(source, destination, plan, cfg)
        assert _files(src) == before
    assert not (src / "zerojax").exists()
