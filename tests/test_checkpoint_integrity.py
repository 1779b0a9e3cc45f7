"""Checkpoints a user can trust: relative paths, a save that survives the script's exit, damaged
files found before they are read, NaN tags never `latest`, exports that never clobber a file."""
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

from test_checkpoint import assert_trees_equal, host, set_step, small_setup
from zerojax import checkpoint as ckpt
from zerojax.app.cli import main as cli

REPO = Path(__file__).resolve().parents[1]


def child_env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    return env


# ---------------------------------------------------------------------------------------------
# Relative paths (orbax wants absolute ones; a user types relative ones).

def test_relative_paths_in_the_library_and_the_cli(tmp_path, monkeypatch, capsys) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    plan, state = small_setup()
    ckpt.save("ckpts", None, set_step(state, 1, plan), plan, async_save=False)
    # An async save resolves its folder once: a chdir while it is written does not move it.
    pending = ckpt.save("ckpts", None, set_step(state, 2, plan), plan, async_save=True)
    monkeypatch.chdir(tmp_path)
    pending.wait()
    monkeypatch.chdir(work)
    assert (work / "ckpts" / "global_step2" / "meta.json").is_file()
    assert ckpt.list_tags("ckpts") == ["global_step1", "global_step2"] and ckpt.latest_tag("ckpts") == "global_step2"
    restored, _ = ckpt.load("ckpts", None, plan)
    assert int(restored.step) == 2
    assert ckpt.verify("./ckpts/../ckpts") == "global_step2"
    assert ckpt.metadata("ckpts", "global_step1")["step"] == 1

    assert cli(["export", "ckpts", "--out", "out/model.safetensors"]) == 0
    assert (work / "out" / "model.safetensors").is_file()
    assert_trees_equal(ckpt.load_exported("out/model.safetensors"), host(state.master))
    home_relative = ckpt.absolute("~/x")
    assert home_relative.is_absolute() and "~" not in str(home_relative)


def test_relative_paths_in_the_engine(tmp_path, monkeypatch) -> None:
    import zerojax
    monkeypatch.chdir(tmp_path)
    params = {"w": np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 100}
    engine = zerojax.initialize({"train_batch_size": 8, "zero_optimization": {"stage": 3},
                                 "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}},
                                params=params, loss_fn=lambda p, b: ((b["x"] @ p["w"]) ** 2).mean())
    engine.train_batch({"x": np.ones((8, 64), np.float32)})
    assert engine.save_checkpoint("ckpts", client_state={"epoch": 1}) == "global_step1"
    assert (tmp_path / "ckpts" / "latest").read_text().strip() == "global_step1"  # durable on return
    path, client = engine.load_checkpoint("ckpts")
    assert client == {"epoch": 1} and path.endswith("global_step1")


def test_train_export_and_resume_with_relative_paths(tmp_path) -> None:
    """The README's command shape from another folder: relative run.output_dir, --resume, export."""
    small = ["run.steps=4", "run.save_every=2", "run.log_every=2", "model.d_model=32", "model.n_layers=1",
             "model.seq_len=16", "data.max_bytes=100000", "run.eval_batches=1", "run.progress=false",
             "scheduler.params.total_num_steps=6", "scheduler.params.warmup_num_steps=1",
             "run.output_dir=runs/rel"]

    def run(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)

    config = str(REPO / "configs" / "zero3.yaml")
    first = run(str(REPO / "train.py"), "--config", config, "--set", *small)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = tmp_path / "runs" / "rel" / "checkpoints"
    assert ckpt.list_tags(ckpts) == ["global_step2", "global_step4"]
    again = run(str(REPO / "train.py"), "--config", config, "--resume", "--set", *small[:-1],
                "run.steps=6", "run.output_dir=runs/rel")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and ckpt.latest_tag(ckpts) == "global_step6"
    export = run("-m", "zerojax.cli", "export", "runs/rel/checkpoints", "--out", "model.safetensors")
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "model.safetensors").stat().st_size > 0

    # A damaged latest tag: --resume stops before training with one line that says what to type.
    victim = largest_array_file(ckpts / "global_step6")
    truncate(victim)
    broken = run(str(REPO / "train.py"), "--config", config, "--resume", "--set", *small[:-1],
                 "run.steps=8", "run.output_dir=runs/rel")
    assert broken.returncode == 2 and "Traceback" not in broken.stderr, broken.stderr[-3000:]
    errors = [line for line in broken.stderr.splitlines() if line.startswith("zerojax: error:")]
    assert len(errors) == 1 and str(victim) in errors[0] and "`--resume global_step4`" in errors[0]
    fixed = run(str(REPO / "train.py"), "--config", config, "--resume", "global_step4", "--set", *small[:-1],
                "run.steps=5", "run.output_dir=runs/rel")
    assert fixed.returncode == 0 and "resumed from runs/rel/checkpoints/global_step4" in fixed.stdout, \
        fixed.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# A script that saves and exits keeps its checkpoint.

SAVE_AND_EXIT = textwrap.dedent("""
    import sys
    import numpy as np
    import zerojax
    from zerojax import checkpoint as ckpt

    mode = sys.argv[1]
    params = {"w": np.arange(256 * 512, dtype=np.float32).reshape(256, 512) / 1000}
    engine = zerojax.initialize({"train_batch_size": 8, "zero_optimization": {"stage": 2},
                                 "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}},
                                params=params, loss_fn=lambda p, b: ((b["x"] @ p["w"]) ** 2).mean())
    engine.train_batch({"x": np.ones((8, 256), np.float32)})
    if mode == "default":       # the DeepSpeed pattern: save, then the script ends
        engine.save_checkpoint("ckpts", client_state={"mode": mode})
    elif mode == "async":       # background write opted in, never waited for
        engine.save_checkpoint("ckpts", client_state={"mode": mode}, async_save=True)
    elif mode == "del":         # background write, then the engine is dropped
        engine.save_checkpoint("ckpts", client_state={"mode": mode}, async_save=True)
        del engine
        print("COMPLETE" if ckpt.latest_tag("ckpts") == "global_step1" else "INCOMPLETE", flush=True)
    elif mode == "library":     # the pure function, async, never waited for
        ckpt.save("ckpts", None, engine.state, engine.plan, extra={"client_state": {"mode": mode}})
""")


@pytest.mark.parametrize("mode", ["default", "async", "del", "library"])
def test_a_script_that_saves_and_exits_keeps_its_checkpoint(tmp_path, mode) -> None:
    proc = subprocess.run([sys.executable, "-c", SAVE_AND_EXIT, mode], env=child_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if mode == "del":
        assert proc.stdout.split() == ["COMPLETE"]
    # Loaded here, in another process than the one that saved.
    assert ckpt.latest_tag(tmp_path / "ckpts") == "global_step1"
    assert ckpt.verify(tmp_path / "ckpts") == "global_step1"
    plan, _ = small_setup()  # any plan: only the metadata and files are checked against the save
    meta = ckpt.metadata(tmp_path / "ckpts")
    assert meta["extra"]["client_state"] == {"mode": mode} and meta["step"] == 1


# ---------------------------------------------------------------------------------------------
# Corrupt files: one clear error naming the tag, the file and the tag to resume from.

def two_tags(root: Path):
    plan, state = small_setup(stage=3)
    ckpt.save(root, None, set_step(state, 1, plan), plan, async_save=False)
    ckpt.save(root, None, set_step(state, 2, plan), plan, async_save=False)
    return plan, state


def largest_array_file(tag_dir: Path) -> Path:
    files = [p for p in (tag_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def zero_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    n = min(2000, len(data) // 2)
    data[len(data) // 4: len(data) // 4 + n] = bytes(n)
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "zero-bytes": (largest_array_file, zero_bytes, "does not match its checksum"),
    "truncated": (largest_array_file, truncate, "bytes, the save wrote"),
    "bit-flip": (largest_array_file, flip_bit, "does not match its checksum"),
    "missing": (largest_array_file, Path.unlink, "is missing"),
    "meta-truncated": (lambda d: d / "meta.json", truncate, "is not readable JSON"),
    "meta-edited": (lambda d: d / "meta.json",
                    lambda p: p.write_text(p.read_text().replace('"step": 2', '"step": 3')),
                    "does not match its own checksum"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_each_corruption_is_one_clear_error(tmp_path, kind) -> None:
    plan, _ = two_tags(tmp_path)
    pick, damage, what = CORRUPTIONS[kind]
    tag_dir = tmp_path / "global_step2"
    victim = pick(tag_dir)
    damage(victim)
    for attempt in (lambda: ckpt.load(tmp_path, None, plan),
                    lambda: ckpt.load(tmp_path, "global_step2", plan),
                    lambda: ckpt.export_safetensors(tmp_path, None, tmp_path / "m.safetensors"),
                    lambda: ckpt.verify(tmp_path)):
        with pytest.raises(ckpt.CheckpointError) as err:
            attempt()
        text = str(err.value)
        assert "\n" not in text and err.value.__cause__ is None  # one line, no chained traceback
        assert err.value.__context__ is None or err.value.__suppress_context__
        assert f"checkpoint {tag_dir} is corrupt: {victim}" in text and what in text
        assert "the newest older checkpoint that verifies is global_step1" in text
        assert "`--resume global_step1`" in text
    assert not (tmp_path / "m.safetensors").exists()
    assert int(ckpt.load(tmp_path, "global_step1", plan)[0].step) == 1


def test_cli_reports_corruption_in_one_line(tmp_path) -> None:
    two_tags(tmp_path)
    truncate(largest_array_file(tmp_path / "global_step2"))
    proc = subprocess.run([sys.executable, "-m", "zerojax.cli", "export", str(tmp_path), "--out",
                           str(tmp_path / "m.safetensors")], env=child_env(), capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerojax: error: checkpoint ") and "--resume global_step1" in lines[0]


def test_no_older_tag_verifies(tmp_path) -> None:
    plan, state = small_setup()
    ckpt.save(tmp_path, None, state, plan, async_save=False)
    flip_bit(largest_array_file(tmp_path / "global_step0"))
    with pytest.raises(ckpt.CheckpointError, match="no older checkpoint in .* verifies: start again without"):
        ckpt.load(tmp_path, None, plan)


def test_a_checkpoint_without_checksums_still_loads(tmp_path) -> None:
    """Tags written before checksums existed (version 1) load; orbax errors still come out as one."""
    plan, state = small_setup()
    ckpt.save(tmp_path, "old", state, plan, async_save=False)
    meta_path = tmp_path / "old" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for key in ("files", "meta_crc32", "finite", "nonfinite"):
        meta.pop(key)
    meta_path.write_text(json.dumps({**meta, "version": 1}))
    assert_trees_equal(host(ckpt.load(tmp_path, "old", plan)[0].master), host(state.master))
    for f in (tmp_path / "old" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match=r"is corrupt: orbax could not read .*old/state"):
        ckpt.load(tmp_path, "old", plan)


def damage_randomly(tag_dir: Path, rng: random.Random) -> str:
    files = sorted(p for p in tag_dir.rglob("*") if p.is_file())
    victim = rng.choice(files)
    data = bytearray(victim.read_bytes())
    kind = rng.choice(["truncate", "flip", "flip", "zero", "delete"])
    if kind == "delete":
        victim.unlink()
    elif kind == "truncate":
        victim.write_bytes(bytes(data[: rng.randrange(len(data))]))
    elif kind == "flip" and data:
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))
    elif data:
        start = rng.randrange(len(data))
        end = min(len(data), start + rng.randint(1, 4096))
        data[start:end] = bytes(end - start)
        victim.write_bytes(bytes(data))
    return f"{kind} {victim.relative_to(tag_dir)}"


def test_random_damage_is_an_error_or_a_verified_load(tmp_path) -> None:
    """Random truncations, bit flips, zeroed ranges and deleted files in the newest tag: every case is
    one CheckpointError naming the tag or a load equal, bit for bit, to a state that was saved."""
    pristine = tmp_path / "pristine"
    plan, state = two_tags(pristine)
    saved = {1: host(set_step(state, 1, plan)), 2: host(set_step(state, 2, plan))}
    rng = random.Random(18)
    outcomes = {"error": 0, "loaded": 0}
    for case in range(40):
        root = tmp_path / f"case{case}"
        shutil.copytree(pristine, root)
        what = damage_randomly(root / "global_step2", rng)
        try:
            restored, _ = ckpt.load(root, None, plan)
        except ckpt.CheckpointError as e:
            text = str(e)
            assert str(root / "global_step2") in text and "\n" not in text, (what, text)
            outcomes["error"] += 1
        else:  # e.g. a flipped space in meta.json, or meta.json removed (an interrupted save)
            got = host(restored)
            assert_trees_equal(got, saved[int(got.step)])
            outcomes["loaded"] += 1
        shutil.rmtree(root)
    assert outcomes["error"] >= 30, outcomes


# ---------------------------------------------------------------------------------------------
# Non-finite parameters never become `latest`.

def test_nonfinite_tag_is_written_but_never_latest(tmp_path) -> None:
    plan, state = small_setup(stage=3)
    ckpt.save(tmp_path, None, set_step(state, 1, plan), plan, async_save=False)
    bad_master = jax.tree.map(lambda x: x, state.master)
    bad_master["dense"]["kernel"] = bad_master["dense"]["kernel"].at[0, 0].set(np.nan)
    bad = set_step(state, 2, plan)._replace(master=bad_master)
    assert ckpt.nonfinite_params(bad, plan) == ["master.dense.kernel"]
    assert ckpt.nonfinite_params(state, plan) == []
    with pytest.warns(RuntimeWarning, match=r"not finite \(master.dense.kernel\).*`latest` keeps naming global_step1"):
        pending = ckpt.save(tmp_path, None, bad, plan)
    pending.wait()
    assert not pending.finite and pending.nonfinite == ["master.dense.kernel"]
    meta = ckpt.metadata(tmp_path, "global_step2")
    assert meta["finite"] is False and meta["nonfinite"] == ["master.dense.kernel"]
    assert ckpt.list_tags(tmp_path) == ["global_step1", "global_step2"]
    assert (tmp_path / "latest").read_text().strip() == "global_step1"
    (tmp_path / "latest").unlink()  # even the fallback (no pointer) skips it
    assert ckpt.latest_tag(tmp_path) == "global_step1"
    assert int(ckpt.load(tmp_path, None, plan)[0].step) == 1


# ---------------------------------------------------------------------------------------------
# Export never overwrites a file unless asked, and never leaves a partial one.

def test_export_refuses_to_overwrite_and_never_leaves_partial_files(tmp_path, monkeypatch) -> None:
    plan, state = small_setup()
    ckpt.save(tmp_path / "ck", None, state, plan, async_save=False)
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"my own file")
    with pytest.raises(FileExistsError, match="already exists .* pass --force"):
        ckpt.export_safetensors(tmp_path / "ck", None, out)
    assert out.read_bytes() == b"my own file"
    assert cli(["export", str(tmp_path / "ck"), "--out", str(out)]) == 2
    assert out.read_bytes() == b"my own file"

    def failing(*args):
        yield np.zeros(3, np.float32)
        raise OSError("disk full")
    monkeypatch.setattr(ckpt.export, "_exported_arrays", failing)
    with pytest.raises(OSError, match="disk full"):
        ckpt.export_safetensors(tmp_path / "ck", None, out, overwrite=True)
    with pytest.raises(OSError, match="disk full"):
        ckpt.export_safetensors(tmp_path / "ck", None, tmp_path / "new.safetensors")
    assert out.read_bytes() == b"my own file" and not (tmp_path / "new.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "model.safetensors"]  # no temporary left
    monkeypatch.undo()

    assert cli(["export", str(tmp_path / "ck"), "--out", str(out), "--force"]) == 0
    assert_trees_equal(ckpt.load_exported(out), host(state.master))


def test_checksums_cover_every_file(tmp_path) -> None:
    plan, state = small_setup()
    ckpt.save(tmp_path, "t", state, plan, async_save=False)
    files = ckpt.metadata(tmp_path, "t")["files"]
    on_disk = sorted(p.relative_to(tmp_path / "t").as_posix() for p in (tmp_path / "t" / "state").rglob("*")
                     if p.is_file())
    assert sorted(files) == on_disk and len(on_disk) > 3
    for name, entry in files.items():
        data = (tmp_path / "t" / name).read_bytes()
        assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def test_fallback_is_older_even_when_the_metadata_is_unreadable(tmp_path) -> None:
    plan, state = two_tags(tmp_path)
    ckpt.save(tmp_path, None, set_step(state, 3, plan), plan, async_save=False)
    truncate(tmp_path / "global_step2" / "meta.json")
    assert ckpt.list_tags(tmp_path) == ["global_step1", "global_step3"]  # unreadable: never listed
    with pytest.raises(ckpt.CheckpointError, match=r"global_step2/meta.json is not readable JSON .*"
                                                    r"verifies is global_step1: continue from it with"):
        ckpt.load(tmp_path, "global_step2", plan)
    assert int(ckpt.load(tmp_path, None, plan)[0].step) == 3
