"""Checkpoints across tensor sizes: a run saved with its weights split over the tensor axis resumes
at another tensor size (and ZeRO stage) with the same state and the same next losses as the run
that went on at its own size, through the engine's save_checkpoint / load_checkpoint.

A small Llama with two key/value heads: at tensor 4 its k and v stay whole while q, o and the MLP
split, so the sizes below also change which weights are split, not only how finely.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

import zerojax
from helpers import SavedRun as Run, assert_resumes_like, save_and_go_on
from zerojax.core.mesh import tensor_size
from zerojax.models import llama
from zerojax.planner.mesh import make_mesh

ROWS = 8
TINY = dict(name="llama", vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2)
SAVED_AT, MORE = 2, 2  # steps before the save, and after it


def config(tensor: int, stage: int) -> zerojax.Config:
    return zerojax.load_config({
        "train_batch_size": ROWS, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "mesh": {"tensor": tensor}, "model": TINY})


def batch(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(200 + i)
    return {"tokens": rng.integers(0, TINY["vocab_size"], size=(ROWS, TINY["seq_len"] + 1), dtype=np.int32)}


def engine(tensor: int, stage: int) -> zerojax.Engine:
    cfg = config(tensor, stage)
    params, loss_fn = llama.build(cfg.model, seed=0)
    return zerojax.initialize(cfg, params=params, loss_fn=loss_fn, mesh=make_mesh(cfg))


@functools.cache
def run(tensor: int, stage: int, root: Path) -> Run:
    """Train SAVED_AT steps at (tensor, stage), save, then go on MORE steps at the same size. The
    engine is kept: later it loads the other sizes' checkpoints (one compile per size)."""
    e = engine(tensor, stage)
    assert tensor_size(e.plan.mesh) == tensor
    return save_and_go_on(e, root / f"tensor{tensor}_stage{stage}", batch, SAVED_AT, MORE)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tensor_ckpt")


@pytest.mark.parametrize("source, target", [
    ((2, 3), (1, 1)),  # tensor 2 -> 1, ZeRO-3 -> ZeRO-1
    ((2, 3), (4, 0)),  # tensor 2 -> 4 (k and v become whole), ZeRO-3 -> none
    ((1, 1), (2, 3)),  # tensor 1 -> 2
    ((4, 0), (2, 3)),  # tensor 4 -> 2
], ids=lambda t: f"tensor{t[0]}-stage{t[1]}")
def test_a_checkpoint_resumes_at_another_tensor_size(source: tuple[int, int], target: tuple[int, int],
                                                     root: Path) -> None:
    src, e = run(*source, root), run(*target, root).engine
    assert_resumes_like(e, src, batch, SAVED_AT, MORE)
