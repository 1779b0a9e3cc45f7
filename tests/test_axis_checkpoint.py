"""Checkpoints across expert and sequence sizes: a run saved with its experts split over the expert axis
(DeepSpeed's ep_size), or its rows' tokens split over the sequence axis (Ulysses), resumes at another
size of that axis with the same state (parameters, fp32 master, Adam's moments) and the same next
losses as the run that went on at its own size, through the engine's save_checkpoint / load_checkpoint.

The expert sizes also change which dimension ZeRO shards an expert weight over (the expert dimension
goes to the expert axis); the sequence sizes change the axes ZeRO shards every weight over (data x
sequence). Saved at ZeRO-3 and resumed at ZeRO-1 (or the reverse), so the stage changes too.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

import zerojax
from helpers import SavedRun as Run, assert_resumes_like, save_and_go_on
from zerojax.core.mesh import expert_size, sequence_size
from zerojax.models import llama
from zerojax.planner.mesh import make_mesh

ROWS, T = 8, 8
TINY = dict(name="llama", vocab_size=64, seq_len=T, d_model=32, n_heads=4, n_kv_heads=4, d_ff=32, n_layers=2)
MOE = dict(n_experts=4, experts_per_token=1, drop_tokens=False, use_rts=False)  # the aux loss stays on
SAVED_AT, MORE = 2, 2  # steps before the save, and after it


def config(axis: str, size: int, stage: int) -> zerojax.Config:
    return zerojax.load_config({
        "train_batch_size": ROWS, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "mesh": {axis: size}, "model": {**TINY, **(MOE if axis == "expert" else {})}})


def batch(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(300 + i)
    return {"tokens": rng.integers(0, TINY["vocab_size"], size=(ROWS, T + 1), dtype=np.int32)}


@functools.cache
def run(axis: str, size: int, stage: int, root: Path) -> Run:
    """Train SAVED_AT steps at this size, save, go on MORE steps. The engine is kept: later it loads
    the other sizes' checkpoints (one compile per size)."""
    cfg = config(axis, size, stage)
    params, loss_fn = llama.build(cfg.model, seed=0)
    e = zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg))
    assert (expert_size if axis == "expert" else sequence_size)(e.plan.mesh) == size
    return save_and_go_on(e, root / f"{axis}{size}_stage{stage}", batch, SAVED_AT, MORE)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("axis_ckpt")


STAGE = {1: 1, 2: 3, 4: 1}  # the ZeRO stage each size runs at: size 2 saves/resumes at ZeRO-3


@pytest.mark.parametrize("axis", ["expert", "sequence"])
@pytest.mark.parametrize("source, target", [(2, 1), (2, 4), (1, 2), (4, 2)], ids=lambda s: str(s))
def test_a_checkpoint_resumes_at_another_axis_size(axis: str, source: int, target: int, root: Path) -> None:
    src, e = run(axis, source, STAGE[source], root), run(axis, target, STAGE[target], root).engine
    assert_resumes_like(e, src, batch, SAVED_AT, MORE)
