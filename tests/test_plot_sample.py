"""`zerojax plot` draws runs' metrics into one PNG; `zerojax sample` and the end of a run generate text."""
from pathlib import Path

import jax
import numpy as np
import pytest

import zerojax
from zerojax.app.cli import main
from zerojax.models import gpt
from zerojax.app.sample import generate, load_run

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.seq_len=16", "data.max_bytes=50000",
        "run.eval_batches=0", "run.progress=false", "run.log_every=1", "steps_per_print=1", "run.steps=3",
        "scheduler.params.total_num_steps=3", "scheduler.params.warmup_num_steps=1", "run.sample_tokens=12"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two small runs (ZeRO-0 and ZeRO-3) of the embedded GPT, with metrics.jsonl and a checkpoint."""
    from zerojax.app.trainer import train
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for stage in (0, 3):
        cfg = zerojax.load_config(f"configs/zero{stage}.yaml", [*TINY, f"run.output_dir={root / f'zero{stage}'}"])
        out[stage] = Path(train(cfg)["output_dir"])
    return out


def test_plot_overlays_runs_in_one_png(runs, tmp_path, capsys) -> None:
    png = tmp_path / "curves.png"
    assert main(["plot", str(runs[0]), str(runs[3]), "-o", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 500 and image.shape[1] > 800
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 50  # curves, text: not a blank page
    from zerojax.tools.plot import read_metrics
    assert [r["step"] for r in read_metrics(runs[3])] == [1, 2, 3]
    assert main(["plot", str(tmp_path / "nothing"), "-o", str(tmp_path / "x.png")]) == 2
    assert "nothing does not exist; give the folder of a run" in capsys.readouterr().err


def test_end_of_run_prints_a_sample(runs) -> None:
    # the fixture's runs printed theirs; check the text comes from the trained parameters
    config, params, where = load_run(runs[0])
    assert where.endswith("global_step3")
    ids = list(b"def ")
    got = generate(config.model, params, ids, 6, temperature=0.0)
    # greedy generation with the padded window equals argmax over the growing, unpadded context
    want, ctx = [], list(ids)
    for _ in range(6):
        logits = gpt.apply(config.model, jax.tree.map(np.asarray, params), np.asarray([ctx], np.int32))
        ctx.append(int(np.argmax(np.asarray(logits[0, -1]))))
        want.append(ctx[-1])
    assert got == want


def test_sample_command_is_deterministic_with_a_seed(runs, capsys) -> None:
    args = ["sample", "--run", str(runs[3]), "--tokens", "24", "--seed", "1", "--prompt", "import "]
    assert main(args) == 0
    first = capsys.readouterr()
    assert main(args) == 0
    again = capsys.readouterr()
    assert first.out == again.out and first.out.startswith("import ") and len(first.out) > len("import ") + 5
    assert "global_step3" in first.err
    assert main(["sample", "--run", str(runs[3]), "--tokens", "24", "--seed", "2", "--prompt", "import "]) == 0
    assert capsys.readouterr().out != first.out  # another seed, another draw
    assert main(["sample", "--run", str(runs[3].parent / "none")]) == 2
    assert "config.json does not exist" in capsys.readouterr().err


def test_train_prints_the_sample(tmp_path, capsys) -> None:
    from zerojax.app.trainer import train
    cfg = zerojax.load_config("configs/zero1.yaml", [*TINY, "run.steps=1", "scheduler.params.total_num_steps=1",
                                                     f"run.output_dir={tmp_path}"])
    train(cfg)
    out = capsys.readouterr().out
    assert "sample (12 tokens" in out and out.split("sample RUN_DIR):\n", 1)[1].startswith("def ")  # may hold newlines
    train(zerojax.load_config(cfg, ["run.sample_tokens=0", f"run.output_dir={tmp_path / 'off'}"]))
    assert "sample (" not in capsys.readouterr().out
