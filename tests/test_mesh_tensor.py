"""The `tensor` mesh axis: `mesh.tensor`, `mesh.logical_axis_rules` and DeepSpeed's `tensor_parallel`
section in the config, and the (stage, data, tensor) meshes they build on the 8 CPU devices."""
from __future__ import annotations

from typing import Any

import jax
import pytest

from zerojax.config import BatchSize, ConfigError, ConfigWarning, check_supported, load_config
from zerojax.core.mesh import (DATA, DATA_INNER, DATA_OUTER, STAGE, TENSOR, data_axes, data_size, tensor_axis,
                               tensor_size)
from zerojax.planner.mesh import hierarchical_sizes, make_mesh


def config(**keys: Any) -> Any:
    return load_config({"train_batch_size": 16, **keys})


def ids(mesh: Any) -> list:
    return [[d.id for d in row] for row in mesh.devices.reshape(-1, mesh.devices.shape[-1])]


# ---------------------------------------------------------------------------------------------
# Config: where mesh.tensor comes from.

def test_tensor_defaults_to_one_and_deepspeeds_keys_set_it() -> None:
    assert config().mesh.tensor == 1
    auto = config(tensor_parallel={"autotp_size": 2})
    assert auto.mesh.tensor == 2 and auto.sources["mesh.tensor"] == "derived (tensor_parallel.autotp_size)"
    legacy = config(tensor_parallel={"tp": {"tp_size": 4}})
    assert legacy.mesh.tensor == 4 and legacy.sources["mesh.tensor"] == "derived (tensor_parallel.tp.tp_size)"
    # DeepSpeed's TPConfig field is `tensor_parallel` with the alias `tp`: both spellings load
    assert config(tensor_parallel={"tensor_parallel": {"tp_size": 4}}).mesh.tensor == 4
    # DeepSpeed lets tp.tp_size be 1 beside any autotp_size; 0 and 1 are "off"
    assert config(tensor_parallel={"autotp_size": 2, "tp": {"tp_size": 1}}).mesh.tensor == 2
    assert config(tensor_parallel={"autotp_size": 0}).mesh.tensor == 1
    assert config(mesh={"tensor": 2}, tensor_parallel={"autotp_size": 2, "tp": {"tp_size": 2}}).mesh.tensor == 2
    assert config(mesh={"tensor": 4}, tensor_parallel={"autotp_size": 1}).mesh.tensor == 4


@pytest.mark.parametrize("keys, named", [
    (dict(tensor_parallel={"autotp_size": 2, "tp": {"tp_size": 4}}),
     r"tensor_parallel\.autotp_size: 2, tensor_parallel\.tp\.tp_size: 4"),
    (dict(mesh={"tensor": 4}, tensor_parallel={"autotp_size": 2}),
     r"tensor_parallel\.autotp_size: 2, mesh\.tensor: 4"),
    (dict(mesh={"tensor": 8}, tensor_parallel={"tp": {"tp_size": 2}}),
     r"tensor_parallel\.tp\.tp_size: 2, mesh\.tensor: 8"),
])
def test_sizes_that_disagree_are_one_error_naming_every_key(keys: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.\S+|^mesh\.tensor") as e:
        config(**keys)
    message = str(e.value)
    assert "the tensor-parallel sizes disagree (" in message
    assert __import__("re").search(named, message), message
    assert message.endswith("give one size (mesh.tensor, or DeepSpeed's tensor_parallel.autotp_size) or the same "
                            "value in each")


def test_an_override_rederives_the_size_and_the_written_config_loads_again() -> None:
    base = config(tensor_parallel={"autotp_size": 2})
    assert load_config(base, ["tensor_parallel.autotp_size=4"]).mesh.tensor == 4
    with pytest.raises(ConfigError, match=r"mesh\.tensor: 8"):
        load_config(base, ["mesh.tensor=8"])
    for c in (base, config(mesh={"tensor": 2})):  # config.json holds autotp_size 0 beside mesh.tensor
        again = load_config(c.to_dict())
        assert again == c and again.mesh.tensor == 2


def test_the_data_parallel_size_is_what_stage_and_tensor_leave() -> None:
    assert config().mesh.data_parallel(8) == 8
    assert config(mesh={"tensor": 2}).mesh.data_parallel(8) == 4
    assert config(mesh={"tensor": 2, "stage": 2}).mesh.data_parallel(8) == 2
    assert config(mesh={"tensor": 2, "data": 2}).mesh.data_parallel(8) == 2
    # the batch triad counts data-parallel shards only: 16 rows over 4 of them
    c = config(mesh={"tensor": 2}, gradient_accumulation_steps=2)
    assert c.batch(data_size(make_mesh(c))) == BatchSize(16, 2, 2)
    assert c.batch(c.mesh.data_parallel(8)) == BatchSize(16, 2, 2)


def test_config_explain_counts_the_data_parallel_size_without_tensor(capsys: pytest.CaptureFixture,
                                                                     tmp_path) -> None:
    from zerojax.app.cli import main
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 16, "tensor_parallel": {"autotp_size": 2}}')
    assert main(["config", "explain", str(path)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["train_micro_batch_size_per_gpu"].split()[1] == str(16 // (jax.device_count() // 2))
    assert "derived (tensor_parallel.autotp_size)" in rows["mesh.tensor"]


# ---------------------------------------------------------------------------------------------
# Config: logical axis rules and AutoTP's partition_config.

def test_logical_axis_rules_map_names_to_mesh_axes() -> None:
    rules = config(mesh={"logical_axis_rules": {"embed": None, "mlp": "tensor", "batch": "data"}}).mesh
    assert dict(rules.logical_axis_rules) == {"embed": None, "mlp": "tensor", "batch": "data"}
    assert rules.logical_axis_rules["mlp"] == "tensor"
    hash(rules)  # the config stays a frozen, hashable value
    pairs = config(mesh={"logical_axis_rules": [["embed", None], ["mlp", "tensor"], ["layers", "stage"]]}).mesh
    assert list(pairs.logical_axis_rules.items()) == [("embed", None), ("mlp", "tensor"), ("layers", "stage")]
    assert dict(config().mesh.logical_axis_rules) == {}
    c = config(mesh={"logical_axis_rules": {"mlp": "tensor"}})
    assert load_config(c.to_dict()) == c
    assert c.to_dict()["mesh"]["logical_axis_rules"] == {"mlp": "tensor"}
    row = next(line for line in c.explain().splitlines() if line.startswith("mesh.logical_axis_rules.mlp"))
    assert row.split()[1:] == ['"tensor"', "file"]


@pytest.mark.parametrize("rules, match", [
    ({"embed": "model"}, r'^mesh\.logical_axis_rules\.embed: "model" is not a mesh axis; use one of tensor, data, '
                         r"stage, or null to keep it replicated$"),
    ([["mlp", "tensor"], ["mlp", None]], r"^mesh\.logical_axis_rules\.mlp: given twice"),
    ("tensor", r"^mesh\.logical_axis_rules: expected a mapping from logical axis names to a mesh axis"),
])
def test_bad_logical_axis_rules_name_the_key_and_the_allowed_axes(rules: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config(mesh={"logical_axis_rules": rules})


def test_partition_config_is_read_as_deepspeed_writes_it() -> None:
    """The example of DeepSpeed's AutoTP training tutorial (docs/_tutorials/autotp-training.md)."""
    c = config(tensor_parallel={
        "autotp_size": 4,
        "partition_config": {
            "use_default_specs": False,
            "layer_specs": [
                {"patterns": [".*\\.o_proj\\.weight$", ".*\\.down_proj\\.weight$"], "partition_type": "row"},
                {"patterns": [".*\\.[qkv]_proj\\.weight$"], "partition_type": "column"},
                {"patterns": [".*\\.gate_up_proj\\.weight$"], "partition_type": "column", "shape": [2, -1],
                 "partition_dim": 0},
            ]}})
    tp = c.tensor_parallel
    assert c.mesh.tensor == 4 and tp.use_default_specs is False and tp.preset_model is None
    assert [(s.patterns, s.partition_type) for s in tp.layer_specs] == [
        ((".*\\.o_proj\\.weight$", ".*\\.down_proj\\.weight$"), "row"),
        ((".*\\.[qkv]_proj\\.weight$",), "column"), ((".*\\.gate_up_proj\\.weight$",), "column")]
    assert tp.layer_specs[2].shape == (2, -1) and tp.layer_specs[2].partition_dim == 0
    # DeepSpeed lower-cases partition_type and preset_model
    spec = config(tensor_parallel={"preset_model": "Llama", "partition_config": {
        "layer_specs": [{"patterns": ["lm_head"], "partition_type": "SKIP"}]}}).tensor_parallel
    assert spec.layer_specs[0].partition_type == "skip" and spec.preset_model == "llama"
    assert spec.use_default_specs is True
    nested = config(tensor_parallel={"partition_config": {"layer_specs": [
        {"patterns": ["qkv"], "shape": [[4096, 1024, 1024], -1], "partition_dim": 0}]}})
    assert nested.tensor_parallel.layer_specs[0].shape == ((4096, 1024, 1024), -1)
    assert load_config(c.to_dict()) == c


def _spec(**spec: Any) -> dict:
    return {"tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": ["x"], **spec}]}}}


@pytest.mark.parametrize("keys, match", [
    (_spec(patterns=["(unclosed"]), r'^tensor_parallel\.partition_config\.layer_specs\[0\]\.patterns\[0\]: '
                                    r'"\(unclosed" is not a regular expression \(missing \), '),
    (_spec(patterns=[]), r"^tensor_parallel\.partition_config\.layer_specs\[0\]\.patterns: expected a non-empty "
                         r"list of regular expressions"),
    ({"tensor_parallel": {"partition_config": {"layer_specs": [{"partition_type": "row"}]}}},
     r"^tensor_parallel\.partition_config\.layer_specs\[0\]\.patterns: required"),
    (_spec(partition_type="diagonal"), r"^tensor_parallel\.partition_config\.layer_specs\[0\]\.partition_type: "
                                       r"'diagonal' is not one of row, column, skip$"),
    (_spec(partiton_type="row"), r"^unknown key 'tensor_parallel\.partition_config\.layer_specs\[0\]\."
                                 r"partiton_type'; did you mean 'partition_type'\?$"),
    (_spec(shape=[0, -1]), r"^tensor_parallel\.partition_config\.layer_specs\[0\]\.shape: expected a list of "
                           r"positive integers or -1"),
    ({"tensor_parallel": {"partition_config": {"layer_specs": {"patterns": ["x"]}}}},
     r"^tensor_parallel\.partition_config\.layer_specs: expected a list of sections"),
    ({"tensor_parallel": {"preset_model": "gpt2"}},
     r"^tensor_parallel\.preset_model: 'gpt2' is not one of llama, bloom, chatglm, mixtral, deepseek_v2, qwen2, phi3$"),
    ({"tensor_parallel": {"autotp_size": -1}}, r"^tensor_parallel\.autotp_size: -1 must be >= 0$"),
    ({"tensor_parallel": {"injection_policy_tuple": ["LlamaDecoderLayer"]}},
     r"^tensor_parallel\.injection_policy_tuple: DeepSpeed's AutoTP injection policy .* it names torch module "
     r"classes; alternative: tensor_parallel\.partition_config\.layer_specs or preset_model"),
    ({"mesh": {"tensor": 0}}, r"^mesh\.tensor: 0 must be > 0$"),
])
def test_bad_tensor_parallel_keys_name_the_key_and_the_fix(keys: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config(**keys)


def test_keys_without_an_effect_load_and_unbuilt_ones_are_refused() -> None:
    with pytest.warns(ConfigWarning) as caught:
        c = config(tensor_parallel={"autotp_size": 2, "tp_overlap_comm": True, "keep_module_on_host": True,
                                    "dtype": "bf16", "tp": {"tp_grain_size": 64, "mpu": None, "tp_group": None}})
    assert sorted(str(w.message).split(":")[0] for w in caught) == ["tensor_parallel.tp.mpu",
                                                                   "tensor_parallel.tp.tp_group"]
    check_supported(c)
    assert c.tensor_parallel.tp_overlap_comm and c.tensor_parallel.tp.tp_grain_size == 64
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.replace_with_kernel_inject: DeepSpeed's inference "
                                          r"kernels are not built"):
        check_supported(config(tensor_parallel={"kernel_inject": True}))
    with pytest.raises(ConfigError, match=r"^tensor_parallel\.partition_config\.strict_mode: not supported yet"):
        check_supported(config(tensor_parallel={"partition_config": {"strict_mode": True}}))


# ---------------------------------------------------------------------------------------------
# The mesh: tensor innermost, consecutive devices one tensor group.

def test_without_tensor_the_mesh_is_as_before() -> None:
    assert make_mesh(config()).axis_names == (DATA,)
    assert make_mesh(config(mesh={"stage": 2})).axis_names == (STAGE, DATA)
    assert make_mesh(config(mesh={"data_outer": 2})).axis_names == (DATA_OUTER, DATA_INNER)
    assert tensor_size(make_mesh(config())) == 1


def test_data_by_tensor_mesh() -> None:
    mesh = make_mesh(config(mesh={"tensor": 2}))
    assert mesh.axis_names == (DATA, TENSOR) and dict(mesh.shape) == {DATA: 4, TENSOR: 2}
    assert ids(mesh) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # each tensor group is two neighbours
    assert data_axes(mesh) == DATA and data_size(mesh) == 4 and tensor_size(mesh) == 2
    small = make_mesh(config(mesh={"tensor": 2, "data": 2}))
    assert dict(small.shape) == {DATA: 2, TENSOR: 2} and ids(small) == [[0, 1], [2, 3]]
    whole = make_mesh(config(mesh={"tensor": 8}))
    assert dict(whole.shape) == {DATA: 1, TENSOR: 8} and data_size(whole) == 1


def test_stage_by_data_by_tensor_mesh() -> None:
    mesh = make_mesh(config(mesh={"stage": 2, "tensor": 2}))
    assert mesh.axis_names == (STAGE, DATA, TENSOR)
    assert dict(mesh.shape) == {STAGE: 2, DATA: 2, TENSOR: 2}
    assert [[d.id for d in row.flat] for row in mesh.devices] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.devices[1, 0, 1].id == 5 and data_size(mesh) == 2 and tensor_size(mesh) == 2


def test_hierarchical_data_by_tensor_mesh() -> None:
    c = config(mesh={"data_outer": 2, "tensor": 2})
    assert hierarchical_sizes(c, 8) == (2, 2)
    mesh = make_mesh(c)
    assert mesh.axis_names == (DATA_OUTER, DATA_INNER, TENSOR)
    assert dict(mesh.shape) == {DATA_OUTER: 2, DATA_INNER: 2, TENSOR: 2}
    assert data_axes(mesh) == (DATA_OUTER, DATA_INNER) and data_size(mesh) == 4 and tensor_size(mesh) == 2
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    assert dict(make_mesh(config(mesh={"data_inner": 4, "tensor": 2})).shape) == {
        DATA_OUTER: 1, DATA_INNER: 4, TENSOR: 2}
    hpz = make_mesh(config(mesh={"tensor": 2}, zero_optimization={"stage": 3, "zero_hpz_partition_size": 2}))
    assert dict(hpz.shape) == {DATA_OUTER: 2, DATA_INNER: 2, TENSOR: 2}


def test_hierarchical_tensor_groups_stay_inside_a_process() -> None:
    class Dev:  # two "processes" of four devices each
        def __init__(self, i: int) -> None:
            self.id, self.process_index, self.platform, self.device_kind = i, i // 4, "cpu", "cpu"
    mesh = make_mesh(config(mesh={"data_outer": 2, "tensor": 2}), [Dev(i) for i in range(8)])
    assert dict(mesh.shape) == {DATA_OUTER: 2, DATA_INNER: 2, TENSOR: 2}
    for outer in range(2):
        assert {d.process_index for d in mesh.devices[outer].flat} == {outer}


@pytest.mark.parametrize("mesh, match", [
    (dict(tensor=3), r"^mesh\.tensor: stage 1 x tensor 3 = 3 does not divide the 8 devices, so stage x data x tensor "
                     r"cannot fill them; choose mesh\.tensor and mesh\.stage whose product divides 8$"),
    (dict(tensor=2, stage=3), r"^mesh\.tensor: stage 3 x tensor 2 = 6 does not divide the 8 devices"),
    (dict(tensor=2, data=8), r"^mesh\.data: stage 1 x data 8 x tensor 2 = 16 devices, but only 8 exist; lower "
                             r"mesh\.data or mesh\.tensor \(on CPU, raise mesh\.cpu_devices"),
    (dict(tensor=3, data_outer=2), r"^mesh\.tensor: stage 1 x tensor 3 = 3 does not divide the 8 devices"),
    (dict(tensor=2, data_outer=2, data=8), r"^mesh\.data: 8 of the 4 devices left by mesh\.tensor 2 with a "
                                           r"hierarchical data axis; it must use every device \(remove mesh\.data, "
                                           r"or run on 16 devices\)$"),
    (dict(tensor=2, data_outer=3), r"^mesh\.data_outer: 3 does not divide the 4 data-parallel devices"),
    (dict(stage=3), r"^mesh\.stage: 3 does not divide the 8 devices; choose a divisor of 8$"),
])
def test_sizes_that_do_not_fit_the_devices_are_one_error(mesh: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_mesh(config(mesh=mesh))


def test_tensor_axis_inside_shard_map() -> None:
    from jax.sharding import PartitionSpec as P
    import jax.numpy as jnp
    seen = []

    def body(x: jax.Array) -> jax.Array:
        seen.append(tensor_axis())
        return x if tensor_axis() is None else jax.lax.psum(x, tensor_axis())

    for mesh, expect in ((make_mesh(config(mesh={"tensor": 2})), 2.0), (make_mesh(config()), 1.0)):
        spec = P(DATA)
        out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(jnp.ones(8))
        assert float(out[0]) == expect
    assert seen == [TENSOR, None]
