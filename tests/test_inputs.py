"""Input that used to be dropped without a word: every `--set` group, a second `--config`, a data path
without a source, config files by content rather than extension, and the config a public function takes."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

import zerojax
from zerojax.app.cli import main
from zerojax.config import load_config
from zerojax.runtime.data import split_corpus
from zerojax.errors import ConfigError

from helpers import data_mesh, make_batch, mlp_params, mse_loss

ROOT = Path(__file__).resolve().parents[1]
YAML = """\
train_batch_size: 16
zero_optimization:
  stage: 2
optimizer:
  type: AdamW
  params:
    lr: 3.0e-4
"""


def _explain(capsys: pytest.CaptureFixture, *argv: str) -> dict[str, str]:
    assert main(["config", "explain", *argv]) == 0
    return {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}


def test_every_set_group_applies_in_order(capsys: pytest.CaptureFixture) -> None:
    lines = _explain(capsys, "configs/zero2.yaml", "--set", "run.steps=7", "run.seed=5",
                     "--set", "run.eval_batches=2", "--set", "run.steps=9")
    for key, value in (("run.steps", "9"), ("run.seed", "5"), ("run.eval_batches", "2")):
        assert lines[key].split()[1] == value and "override" in lines[key]


def test_two_config_files_are_an_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    b = tmp_path / "b.yaml"
    b.write_text(YAML)
    assert main(["train", "--config", "configs/zero3.yaml", "--config", str(b)]) == 2
    err = capsys.readouterr().err
    assert "--config given 2 times" in err and "configs/zero3.yaml" in err and "--set" in err


def test_data_path_implies_the_file_source() -> None:
    cfg = load_config({"train_batch_size": 8, "data": {"path": "corpus.txt"}})
    assert cfg.data.source == "file" and cfg.sources["data.source"].startswith("derived")
    again = load_config(cfg, ["run.steps=3"])  # an override keeps the derivation
    assert again.data.source == "file"
    assert load_config(json.loads(json.dumps(cfg.to_dict()))).data.source == "file"  # config.json reloads
    with pytest.raises(ConfigError, match="data.source is 'stdlib', which ignores it"):
        load_config({"train_batch_size": 8, "data": {"path": "corpus.txt", "source": "stdlib"}})


@pytest.mark.parametrize("name", ["ds.txt", "ds.cfg", "ds"])
def test_yaml_under_any_extension_reads_as_yaml(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(YAML)
    cfg = load_config(path)
    assert cfg.zero_optimization.stage == 2 and cfg.optimizer.params.lr == 3e-4
    path.write_text('{"train_batch_size": 16, // a comment\n "zero_optimization": {"stage": 1},}')
    assert load_config(path).zero_optimization.stage == 1  # hjson still reads
    path.write_text("train_batch_size: [1, 2\n")
    with pytest.raises(ConfigError, match=f"{name}: cannot parse it as JSON, YAML or hjson"):
        load_config(path)


def test_split_hint_for_a_short_file() -> None:
    short = np.arange(60, dtype=np.uint8)
    with pytest.raises(ConfigError) as e:
        split_corpus(short, 0.05, 32, max_bytes=4_000_000)
    assert "raise data.max_bytes" not in str(e.value) and "only 60 bytes" in str(e.value)
    assert "longer" in str(e.value) and "model.seq_len" in str(e.value)
    with pytest.raises(ConfigError, match="raise data.max_bytes"):  # the limit cut it: raising helps
        split_corpus(short, 0.05, 32, max_bytes=60)


RAW = {"train_batch_size": 16, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2}, "mesh": {"data": 8}}


@pytest.mark.parametrize("form", ["dict", "path", "config"])
def test_public_functions_take_what_initialize_takes(tmp_path: Path, form: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(RAW))
    given = {"dict": RAW, "path": str(path), "config": load_config(RAW)}[form]
    params = mlp_params(0)
    mesh = zerojax.make_mesh(given)
    p = zerojax.plan(given, mesh, params)
    assert p.stage == 2 and p.batch.train_batch_size == 16
    state = zerojax.init_state(given, p, params)
    step = zerojax.make_train_step(given, p, mse_loss)
    state, metrics = step(state, make_batch(16, 0))
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))


def test_a_config_other_than_the_plans_is_an_error() -> None:
    params = mlp_params(0)
    p = zerojax.plan(RAW, data_mesh(), params)
    other = {**RAW, "gradient_clipping": 0.5}
    with pytest.raises(ConfigError, match=r"make_train_step: .*gradient_clipping 0.5 \(plan: 1.0\)"):
        zerojax.make_train_step(other, p, mse_loss)
    with pytest.raises(ConfigError, match="init_state: .*gradient_clipping"):
        zerojax.init_state(other, p, params)


KEYS = ["run.steps", "zero_optimization.stage", "train_batch_size", "optimizer.params.lr", "bf16.enabled",
        "fp16.enabled", "data.path", "data.source", "scheduler.type", "mesh.data", "model.n_heads",
        "gradient_clipping", "zero_optimization.offload_optimizer.device", "no.such.key", "run", "bf16",
        "optimizer", "optimizer.type", "steps_per_print", "model.d_model", "data.val_fraction", "run.",
        "", "zero_optimization.stage.x"]
VALUES = ["1", "0", "-1", "2.5", "1e12", ".inf", ".nan", "true", "null", "auto", "x", "[1, 2]", "{a: 1}",
          "", "'3'", "Adam", "cpu", "file", "a: [", "WarmupLR", "{type: Adam}", "0.9"]


def test_cli_set_fuzz(capsys: pytest.CaptureFixture) -> None:
    """Random --set sequences: a resolved config (exit 0) or one `zerojax: error:` line (exit 2)."""
    rng = random.Random(18)
    outcomes = set()
    for _ in range(300):
        argv = ["config", "explain", "configs/zero2.yaml"]
        for _ in range(rng.randint(1, 3)):
            group = [f"{rng.choice(KEYS)}={rng.choice(VALUES)}" if rng.random() < 0.95 else rng.choice(VALUES)
                     for _ in range(rng.randint(1, 3))]
            argv += ["--set", *group]
        code = main(argv)
        out, err = capsys.readouterr()
        outcomes.add(code)
        if code == 0:
            assert err == "" and "run.steps" in out, argv
        else:
            assert code == 2, (argv, err)
            lines = err.strip().splitlines()
            # one error: its first line says what is wrong (a list of "auto" fills may follow it)
            assert lines[0].startswith("zerojax: error: "), (argv, err)
            assert sum(ln.startswith("zerojax: error: ") for ln in lines) == 1 and "Traceback" not in err, (argv, err)
    assert outcomes == {0, 2}


@pytest.mark.parametrize("stages", [1, 2])
def test_train_without_an_optimizer_section_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                         stages: int) -> None:
    """The command line cannot pass an optimizer in code: a config without a section says what to add."""
    text = Path("configs/zero3.yaml").read_text()
    start, end = text.index("optimizer:"), text.index("scheduler:")
    cfg = tmp_path / "no_optimizer.yaml"
    cfg.write_text(text[:start] + text[end:].replace("WarmupCosineLR", "WarmupLR").replace(
        "    cos_min_ratio: 0.1\n", "").replace("    total_num_steps: 200\n", "").replace(
        "    warmup_type: linear\n", "    warmup_type: linear\n    warmup_max_lr: 0.001\n"))
    code = main(["train", "--config", str(cfg), "--set", f"mesh.stage={stages}",
                 f"run.output_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert code == 2 and "train.py" in err and "--set optimizer.type=AdamW" in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()
