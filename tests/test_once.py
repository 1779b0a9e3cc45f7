"""core/once.py: the train state's init program compiles with the options for a program run once, and
they change how long it compiles, not what it computes."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import zerojax
from zerojax.core import state as state_module
from zerojax.core.once import CPU_ONCE, once_options
from zerojax.core.sharded_init import ParamsInit
from zerojax.models import gpt
from tests.helpers import data_mesh, make_config

MODEL = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 64}


def _plan(stage: int):
    cfg = make_config(stage, dtype="bf16", model=MODEL)
    plan = zerojax.plan(cfg, data_mesh(), gpt.abstract_params(cfg.model))
    return plan, ParamsInit(functools.partial(gpt.init_params, cfg.model, 0), plan.abstract_params)


@pytest.fixture
def optimizing(monkeypatch: pytest.MonkeyPatch):
    """XLA's own levels, as a user's shell has them (the tests' conftest turns most optimizations off)."""
    was = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    yield
    jax.config.update("jax_disable_most_optimizations", was)


def test_once_options_are_the_cpus_level_1_unless_the_user_chose_a_level(optimizing, monkeypatch) -> None:
    assert once_options(data_mesh()) == CPU_ONCE == {"xla_backend_optimization_level": 1}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=3")
    assert once_options(data_mesh()) is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    jax.config.update("jax_disable_most_optimizations", True)
    assert once_options(data_mesh()) is None


def test_init_state_compiles_with_the_once_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """An option XLA does not know fails the init program's compile: the options reach it."""
    plan, params = _plan(3)
    monkeypatch.setattr(state_module, "once_options", lambda mesh: {"xla_no_such_option_for_init": True})
    with pytest.raises(Exception, match="xla_no_such_option_for_init"):
        zerojax.init_state(plan, params)


@pytest.mark.parametrize("stage", [0, 3])
def test_level_1_gives_the_state_of_xlas_default_level_bit_for_bit(stage: int, optimizing, monkeypatch) -> None:
    plan, params = _plan(stage)
    once = jax.tree.leaves(zerojax.init_state(plan, params))
    monkeypatch.setattr(state_module, "once_options", lambda mesh: {"xla_backend_optimization_level": 2})
    default = jax.tree.leaves(zerojax.init_state(plan, params))
    assert len(once) == len(default) > 10
    for a, b in zip(once, default):
        assert a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
