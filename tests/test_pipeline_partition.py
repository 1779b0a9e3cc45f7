"""Partition methods and the partition report, against splits computed by hand (no devices)."""
from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

import zerojax
from zerojax.config import ModelConfig
from zerojax.models import gpt
from zerojax.pipeline import partition
from zerojax.pipeline.buffers import stage_rows


def inputs(batch):
    return batch["x"]


def mse(out, batch):
    return jnp.mean((out - batch["y"]) ** 2)


# Parameter counts (weights + biases): 8*16+16 = 144, 16*64+64 = 1088, 64*16+16 = 1040,
# 16*16+16 = 272, 16*8+8 = 136; functions have none.
LAYERS = [inputs, zerojax.LayerSpec(nnx.Linear, 8, 16), jnp.tanh, zerojax.LayerSpec(nnx.Linear, 16, 64), jnp.tanh,
          zerojax.LayerSpec(nnx.Linear, 64, 16), zerojax.LayerSpec(nnx.Linear, 16, 16), zerojax.LayerSpec(nnx.Linear, 16, 8)]
COUNTS = (0, 144, 0, 1088, 0, 1040, 272, 136)


def module(method: str) -> zerojax.PipelineModule:
    return zerojax.PipelineModule(LAYERS, loss_fn=mse, partition_method=method)


def test_parameter_counts_are_read_without_building() -> None:
    part = module("uniform").partition(3)
    assert part.counts == COUNTS
    assert part.names == ("inputs", "Linear", "tanh", "Linear", "tanh", "Linear", "Linear", "Linear")


def test_parameters_method() -> None:
    """Heaviest stage first: 1088 cannot share a stage with 1040 (2128) and joining 1040 to the tail
    gives 1448, so the best bottleneck is 144+1088 = 1232 | 1040 | 272+136. The weightless tanh at 4
    goes where layer counts are more even: stage 1 (4, 2, 2 layers rather than 5, 1, 2)."""
    part = module("parameters").partition(3)
    assert part.bounds == (0, 4, 6, 8)
    assert part.params_per_stage == (1232, 1040, 408)
    assert part.layers_per_stage == (4, 2, 2)
    # Two stages: 1232 | 1448 beats 2272 | 408; the tanh again evens the counts (4, 4).
    assert module("parameters").partition(2).bounds == (0, 4, 8)


def test_uniform_method_is_deepspeeds() -> None:
    """DeepSpeed's partition_uniform: the first n % S stages get one layer more."""
    assert module("uniform").partition(3).bounds == (0, 3, 6, 8)
    assert partition.uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition.uniform(4, 4) == [0, 1, 2, 3, 4]


def test_type_method() -> None:
    """type:Linear balances the five Linear layers: 2 | 2 | 1 matching layers over 3 stages, and
    among those the split with layer counts 3, 3, 2."""
    part = module("type:linear").partition(3)   # case-insensitive, like DeepSpeed
    assert part.bounds == (0, 3, 6, 8)
    linear = [sum(part.names[i] == "Linear" for i in part.layers(s)) for s in range(3)]
    assert linear == [1, 2, 2]
    # Two stages: 2 | 3 Linears with 4 | 4 layers (3 | 2 would need 6 | 2).
    assert module("type:Linear").partition(2).bounds == (0, 4, 8)


def test_balanced_exact_cases() -> None:
    assert partition.balanced([5, 1, 1, 1, 5], 3) == [0, 1, 4, 5]
    assert partition.bottleneck([5, 1, 1, 1, 5], 3) == 5
    assert partition.balanced([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5, 6]     # 6 | 9 | 6
    assert partition.balanced([3, 3, 3], 3) == [0, 1, 2, 3]
    assert partition.balanced([0, 0, 7, 0], 2) == [0, 2, 4]             # weightless layers even out


def test_gpt_partitions() -> None:
    """The embedded GPT: Embedding (256*32 + 16*32 = 8704), 4 Blocks of 12,704, Head (32*256 + 64 = 8256)."""
    cfg = ModelConfig(d_model=32, n_layers=4, n_heads=4, seq_len=16)
    mod = gpt.pipeline_module(cfg)
    counts = mod.partition(2).counts
    assert counts == (8704, 12704, 12704, 12704, 12704, 8256)
    # 4 stages: a Block alone is 12,704 and every cut must keep two Blocks apart; Embedding and Head
    # join the Blocks at the ends (21,408 and 20,960).
    assert mod.partition(4).bounds == (0, 2, 3, 4, 6)
    assert mod.partition(4).params_per_stage == (21408, 12704, 12704, 20960)
    assert gpt.pipeline_module(cfg, "type:Block").partition(2).bounds == (0, 3, 6)
    assert gpt.pipeline_module(cfg, "best").partition_method == "parameters"


def test_report_counts_tied_layers_where_they_run_and_stores_them_once() -> None:
    layers = [inputs, zerojax.TiedLayerSpec("io", nnx.Linear, 8, 16), jnp.tanh, zerojax.LayerSpec(nnx.Linear, 16, 16),
              zerojax.TiedLayerSpec("io", nnx.Linear, 8, 16, forward_fn=lambda m, x: x @ m.kernel[...].T)]
    mod = zerojax.PipelineModule(layers, loss_fn=mse, partition_method="uniform")
    part = mod.partition(2)
    assert part.bounds == (0, 3, 5)
    assert part.params_per_stage == (144, 272 + 144)
    assert part.stored == (144, 272)
    assert list(mod.abstract_params()) == ["tied_io", "layer_03"]
    rows = stage_rows(mod, 2, align=128)
    assert rows.stored == (144, 272) and rows.width == 384
    (tied,) = rows.tied
    assert (tied.key, tied.owner, tied.users) == ("tied_io", 0, (1,))
    table = rows.table()
    assert "0-2" in table and "3-4" in table and "tied 'tied_io': stored on stage 0, also used by 1" in table


def test_bad_partitions() -> None:
    with pytest.raises(zerojax.ConfigError, match=r"mesh.stage: 9 pipeline stages but the model has only 8 layers"):
        module("uniform").partition(9)
    with pytest.raises(zerojax.ConfigError, match=r"'type:Conv' matches no layer; layer types are inputs, Linear, tanh"):
        module("type:Conv").partition(2)
    with pytest.raises(zerojax.ConfigError, match=r"not a valid regular expression"):
        module("type:(").partition(2)
    with pytest.raises(zerojax.ConfigError, match=r"partition_method: unknown method 'best'"):
        module("best").partition(2)
    with pytest.raises(zerojax.ConfigError, match=r"num_stages is unknown"):
        module("uniform").partition()
