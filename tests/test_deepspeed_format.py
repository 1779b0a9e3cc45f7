"""DeepSpeed ZeRO checkpoints and torch.save files, read and written without torch."""
import os
import pickle
import pickletools
import struct
import zipfile
import zlib
from collections import OrderedDict

import ml_dtypes
import numpy as np
import pytest

from zerojax.checkpoint import deepspeed_format as ds, torch_zip as tz


# --------------------------------------------------------------------------- helpers

def _params(kind="cut"):
    rng = np.random.default_rng(0)
    shapes = {
        # 15 + 7 + 8 = 30 elements: at dp=2 (align 4 -> 32, 16 per rank) the cut falls inside "b";
        # at dp=3 (align 6 -> 30, 10 per rank) cuts fall inside "a" and "b"; 7 % 2, 7 % 3, 15 % 2 != 0.
        "cut": {"embed.weight": (3, 5), "block.bias": (7,), "head.kernel": (2, 2, 2)},
        "groups": {"a.w": (5, 3), "a.b": (1,), "b.w": (4, 4), "b.scalar": ()},
    }[kind]
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def _write(tmp_path, params, stage, dp, **kw):
    exp_avg = {n: (v * 0.5 + 1).astype(np.float32) for n, v in params.items()}
    exp_avg_sq = {n: (v * v).astype(np.float32) for n, v in params.items()}
    args = dict(stage=stage, dp=dp, step=12, global_steps=12, global_samples=96, skipped_steps=2, lr=3e-4,
                lr_scheduler={"last_batch_iteration": 11}, client_state={"epoch": 3, "note": "hi"})
    args.update(kw)
    ds.write_checkpoint(tmp_path, "global_step12", params, exp_avg, exp_avg_sq, **args)
    return exp_avg, exp_avg_sq


def _zip_with_pickle(path, data_pkl, storages=(), byteorder=b"little", prefix="archive"):
    """A torch-style archive built with plain zipfile (no alignment), for hand-made pickles."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{prefix}/data.pkl", data_pkl)
        zf.writestr(f"{prefix}/byteorder", byteorder)
        for key, raw in storages:
            zf.writestr(f"{prefix}/data/{key}", raw)
        zf.writestr(f"{prefix}/version", b"3\n")


def _g(module, name):
    return b"c" + f"{module}\n{name}\n".encode()


def _s(text):
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _i(n):
    if -2**31 <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _tuple(*items):
    return b"(" + b"".join(items) + b"t"


def _tensor_pickle(storage_type, key, numel, offset, size, stride):
    """Protocol-2 bytes of torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, {})."""
    pid = _tuple(_s("storage"), _g("torch", storage_type), _s(key), _s("cpu"), _i(numel)) + b"Q"
    args = b"(" + pid + _i(offset) + _tuple(*map(_i, size)) + _tuple(*map(_i, stride)) + b"\x89}" + b"t"
    return _g("torch._utils", "_rebuild_tensor_v2") + args + b"R"


# --------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_round_trip(tmp_path, stage, dp):
    params = _params()
    exp_avg, exp_avg_sq = _write(tmp_path, params, stage, dp, precision="fp16",
                                 loss_scaler={"cur_scale": 1024.0, "cur_iter": 12, "last_overflow_iter": 4,
                                              "cur_hysteresis": 1})
    ck = ds.read_checkpoint(tmp_path)
    assert ck.tag == "global_step12" and ck.zero_stage == stage and ck.dp_world_size == dp
    assert list(ck.params) == list(params)
    for n in params:
        np.testing.assert_array_equal(ck.params[n], params[n])
        np.testing.assert_array_equal(ck.exp_avg[n], exp_avg[n])
        np.testing.assert_array_equal(ck.exp_avg_sq[n], exp_avg_sq[n])
        assert ck.params[n].dtype == np.float32 and ck.params[n].shape == params[n].shape
    assert (ck.step, ck.global_steps, ck.global_samples, ck.skipped_steps) == (12, 12, 96, 2)
    assert ck.lr == pytest.approx(3e-4)
    assert ck.param_groups[0]["betas"] == (0.9, 0.999) and ck.param_groups[0]["eps"] == 1e-8
    assert ck.lr_scheduler == {"last_batch_iteration": 11}
    assert ck.client_state == {"epoch": 3, "note": "hi"}
    ls = ck.loss_scale
    assert ls["type"] == "DynamicLossScaler" and ls["cur_scale"] == 1024.0 and ls["cur_iter"] == 12
    assert ls["last_overflow_iter"] == 4 and ls["cur_hysteresis"] == 1 and ls["dtype"] == "float16"
    if stage <= 2:  # full fp16 weights in the model-states file
        np.testing.assert_array_equal(ck.module["block.bias"], params["block.bias"].astype(np.float16))
    else:  # stage 3 keeps empty placeholders there
        assert ck.module["block.bias"].shape == (0,)
    # the same result whether the run folder (via `latest`) or the tag folder is given
    again = ds.read_checkpoint(tmp_path / "global_step12")
    np.testing.assert_array_equal(again.params["head.kernel"], params["head.kernel"])


@pytest.mark.parametrize("stage", [2, 3])
def test_param_groups_buffers_bf16(tmp_path, stage):
    params = _params("groups")
    groups = [["a.w", "a.b"], ["b.w", "b.scalar"]]
    buffers = {"bn.running_mean": np.arange(3, dtype=np.float32), "bn.count": np.array(5, dtype=np.int64)}
    _write(tmp_path, params, stage, 2, param_groups=groups, precision="bf16", buffers=buffers)
    names = sorted(os.listdir(tmp_path / "global_step12"))
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in names  # engine.py: "bf16_" prefix under bf16
    ck = ds.read_checkpoint(tmp_path)
    assert ck.group_names == groups and len(ck.param_groups) == 2
    assert ck.params["b.scalar"].shape == ()
    for n in params:
        np.testing.assert_array_equal(ck.params[n], params[n])
    assert ck.loss_scale == {"type": "LossScaler", "cur_scale": 1.0, "dynamic": False}
    np.testing.assert_array_equal(ck.buffers["bn.count"], 5)
    full = ck.fp32_state_dict()  # zero_to_fp32.py: buffers first, as fp32
    assert list(full)[:2] == ["bn.running_mean", "bn.count"] and full["bn.count"].dtype == np.float32
    if stage == 2:
        assert ck.module["a.w"].dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("stage", [1, 3])
def test_without_optimizer_moments(tmp_path, stage):
    """Saved before the first optimizer step: no exp_avg/exp_avg_sq, step from the param group."""
    params = _params()
    ds.write_checkpoint(tmp_path, "global_step0", params, stage=stage, dp=3, step=0, global_steps=0, global_samples=0,
                        skipped_steps=0, lr=1e-3, lr_scheduler=None, ds_config={"gradient_clipping": 1.0})
    ck = ds.read_checkpoint(tmp_path)
    assert ck.exp_avg is None and ck.exp_avg_sq is None and ck.step == 0 and ck.lr_scheduler is None
    assert ck.ds_config == {"gradient_clipping": 1.0} and ck.client_state == {}
    np.testing.assert_array_equal(ck.params["embed.weight"], params["embed.weight"])


def test_stage12_layout_matches_deepspeed(tmp_path):
    """The bytes DeepSpeed's stage_1_and_2.py would hold, checked without our reader's reassembly."""
    params = _params()
    _write(tmp_path, params, 2, 2)
    flat = np.concatenate([v.reshape(-1) for v in params.values()])  # 30 elements, padded to 32
    tag = tmp_path / "global_step12"
    r0 = tz.load(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    r1 = tz.load(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert list(r0) == ["loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "base_optimizer_state",
                        "single_partition_of_fp32_groups", "zero_stage", "group_paddings", "partition_count",
                        "ds_version", "param_slice_mappings"]
    np.testing.assert_array_equal(r0["single_partition_of_fp32_groups"][0], flat[:16])
    np.testing.assert_array_equal(r1["single_partition_of_fp32_groups"][0], flat[16:])  # lean: 14, not 16
    assert (r0["group_paddings"], r1["group_paddings"], r1["partition_count"]) == ([0], [2], [2])
    assert r0["zero_stage"] == 2 and r0["zero_stage"].name == "ZeroStageEnum"
    base = r1["base_optimizer_state"]  # rigid: the optimizer's own state over the padded partition
    assert base["state"][0]["exp_avg"].shape == (16,) and base["state"][0]["step"] == 12
    assert base["param_groups"][0]["params"] == [0] and base["param_groups"][0]["lr"] == 3e-4
    # the cut at 16 falls inside block.bias (elements 15..21): rank 0 holds 1 of its 7, rank 1 the other 6
    m0, m1 = r0["param_slice_mappings"][0], r1["param_slice_mappings"][0]
    assert m0["block.bias"].state == {"numel": 1, "start": 15} and "head.kernel" not in m0
    assert m1["block.bias"].state == {"numel": 6, "start": 0} and m1["head.kernel"].state == {"numel": 8, "start": 6}
    model = tz.load(tag / "mp_rank_00_model_states.pt")
    assert model["param_shapes"] == [OrderedDict([("embed.weight", (3, 5)), ("block.bias", (7,)),
                                                  ("head.kernel", (2, 2, 2))])]
    assert isinstance(model["param_shapes"][0]["block.bias"], tz.TorchSize)
    assert model["dp_world_size"] == 2 and model["frozen_param_shapes"] == OrderedDict()
    assert (tmp_path / "latest").read_text() == "global_step12"


def test_stage3_layout_matches_deepspeed(tmp_path):
    """stage3.py: each parameter split on its own into ceil(numel/dp) slices, zero-padded."""
    params = _params()
    _write(tmp_path, params, 3, 3)
    tag = tmp_path / "global_step12"
    b = params["block.bias"]  # 7 elements -> 3 per rank, rank 2 holds [b6, 0, 0]
    for rank in range(3):
        opt = tz.load(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert list(opt) == ["zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "partition_count",
                             "optimizer_state_dict", "fp32_flat_groups"]
        assert opt["partition_count"] == 3 and opt["zero_stage"] == 3
        flat = opt["fp32_flat_groups"][0]
        assert flat.shape == (5 + 3 + 3,)
        np.testing.assert_array_equal(flat[:5], params["embed.weight"].reshape(-1)[5 * rank:5 * rank + 5])
        expect_b = np.zeros(3, np.float32)
        expect_b[:len(b[3 * rank:3 * rank + 3])] = b[3 * rank:3 * rank + 3]
        np.testing.assert_array_equal(flat[5:8], expect_b)
        assert opt["optimizer_state_dict"]["state"][0]["exp_avg_sq"].shape == (11,)
        assert os.path.exists(tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")


def test_reader_accepts_elastic_and_torch_adam_variants(tmp_path):
    """Files this writer does not produce: elastic per-group state lists, and torch.optim's tensor step."""
    params = _params()
    exp_avg, _ = _write(tmp_path, params, 2, 2)
    tag = tmp_path / "global_step12"
    for rank in range(2):
        path = tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        top = tz.load(path)
        opt = top["optimizer_state_dict"]
        lean = opt["single_partition_of_fp32_groups"][0].size
        state = opt["base_optimizer_state"]["state"][0]
        # stage_1_and_2.py with elastic_checkpoint: lean per-group states + base_optimizer_state_step
        opt["base_optimizer_state"] = [{"exp_avg": state["exp_avg"][:lean], "exp_avg_sq": state["exp_avg_sq"][:lean],
                                        "step": np.array(12.0, np.float32)}]
        opt["base_optimizer_state_step"] = np.array(12.0, np.float32)
        tz.save(top, path)
    ck = ds.read_checkpoint(tmp_path)
    assert ck.step == 12 and ck.lr is None
    np.testing.assert_array_equal(ck.exp_avg["block.bias"], exp_avg["block.bias"])


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_and_shared_params_and_namespace(tmp_path, stage):
    """Frozen weights (engine.py `frozen_param_fragments`: whole at stage 2, per-rank slices at stage 3),
    shared aliases and a Megatron-style argparse.Namespace in the client state."""
    params = _params()
    args = tz.PickledObject.make("argparse", "Namespace", {"lr": 0.1, "seq_length": 16})
    _write(tmp_path, params, stage, 2, client_state={"args": args})
    frozen = np.arange(6, dtype=np.float32).reshape(2, 3)
    tag = tmp_path / "global_step12"
    files = [tag / "mp_rank_00_model_states.pt"] if stage == 2 else \
        [tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)]
    for rank, path in enumerate(files):
        model = tz.load(path)
        model["frozen_param_shapes"] = OrderedDict(emb=tz.TorchSize((2, 3)))
        piece = frozen if stage == 2 else frozen.reshape(-1)[3 * rank:3 * rank + 3]
        model["frozen_param_fragments"] = OrderedDict(emb=piece)
        model["shared_params"] = {"lm_head.weight": "embed.weight"}
        tz.save(model, path)
    ck = ds.read_checkpoint(tmp_path)
    np.testing.assert_array_equal(ck.frozen_params["emb"], frozen)
    full = ck.fp32_state_dict()
    assert list(full) == ["emb", "embed.weight", "block.bias", "head.kernel", "lm_head.weight"]
    assert full["lm_head.weight"] is full["embed.weight"]
    assert ck.client_state["args"] == args and ck.client_state["args"].get("seq_length") == 16


def test_write_fp32_state_dict_streams(tmp_path):
    params = {"w": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.ones(4, np.float16)}
    path = ds.write_fp32_state_dict(tmp_path, params)
    assert path.endswith("pytorch_model.bin")
    back = tz.load(path)
    assert list(back) == ["w", "b"] and all(v.dtype == np.float32 for v in back.values())
    np.testing.assert_array_equal(back["w"], params["w"])
    calls = []
    lazy = tz.LazyArray((3,), np.float32, lambda: calls.append(1) or np.ones(3, np.float32))
    tz.save({"x": lazy}, tmp_path / "lazy.pt")
    assert calls == [1]
    np.testing.assert_array_equal(tz.load(tmp_path / "lazy.pt", mmap=True)["x"], np.ones(3))


# --------------------------------------------------------------------------- the torch.save format

def test_written_zip_has_torch_structure(tmp_path):
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "h": np.ones(2, np.float16),
              "bf": np.zeros((1, 2), ml_dtypes.bfloat16), "i": np.array([1, 2], np.int64), "s": np.array(2.0)}
    path = tmp_path / "pytorch_model.bin"
    tz.save(OrderedDict(params), path)
    raw = path.read_bytes()
    zf = zipfile.ZipFile(path)
    names = zf.namelist()
    assert names == ["pytorch_model/data.pkl", "pytorch_model/.format_version", "pytorch_model/.storage_alignment",
                     "pytorch_model/byteorder"] + [f"pytorch_model/data/{k}" for k in range(5)] + \
        ["pytorch_model/version", "pytorch_model/.data/serialization_id"]
    assert zf.read("pytorch_model/version") == b"3\n" and zf.read("pytorch_model/byteorder") == b"little"
    for info in zf.infolist():  # stored, and data 64-byte aligned like caffe2's PyTorchStreamWriter
        assert info.compress_type == zipfile.ZIP_STORED
        name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
        assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0
    data = zf.read("pytorch_model/data.pkl")
    assert data[:2] == b"\x80\x02" and max(op.proto for op, _, _ in pickletools.genops(data)) == 2
    assert zf.read("pytorch_model/data/0") == params["w"].tobytes()

    # An independent look at the pickle: which globals, persistent ids and rebuild arguments.
    seen, pids = [], []

    class Named:
        def __init__(self, q):
            self.q = q

        def __call__(self, *args):
            return (self.q, args)

    class Spy(pickle.Unpickler):
        def find_class(self, module, name):
            seen.append(f"{module}.{name}")
            return OrderedDict if (module, name) == ("collections", "OrderedDict") else Named(f"{module}.{name}")

        def persistent_load(self, pid):
            pids.append((pid[0], pid[1].q, *pid[2:]))
            return "storage-" + pid[2]

    tree = Spy(__import__("io").BytesIO(data)).load()
    assert set(seen) == {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch.FloatStorage",
                         "torch.HalfStorage", "torch.BFloat16Storage", "torch.LongStorage", "torch.DoubleStorage"}
    assert pids == [("storage", "torch.FloatStorage", "0", "cpu", 6), ("storage", "torch.HalfStorage", "1", "cpu", 2),
                    ("storage", "torch.BFloat16Storage", "2", "cpu", 2),
                    ("storage", "torch.LongStorage", "3", "cpu", 2), ("storage", "torch.DoubleStorage", "4", "cpu", 1)]
    assert tree["w"] == ("torch._utils._rebuild_tensor_v2", ("storage-0", 0, (2, 3), (3, 1), False, OrderedDict()))
    assert tree["s"][1][2:4] == ((), ())


def test_reads_hand_made_torch_pickle_with_offset_stride_and_big_endian(tmp_path):
    storage = np.arange(8, dtype=np.float32)
    body = b"\x80\x02}(" + _s("t") + _tensor_pickle("FloatStorage", "0", 8, 1, (2, 3), (1, 2)) + \
        _s("flag") + _tensor_pickle("BoolStorage", "1", 2, 0, (2,), (1,)) + b"u."
    _zip_with_pickle(tmp_path / "a.pt", body, [("0", storage.tobytes()), ("1", b"\x01\x00")])
    out = tz.load(tmp_path / "a.pt")
    np.testing.assert_array_equal(out["t"], np.lib.stride_tricks.as_strided(storage[1:], (2, 3), (4, 8)))
    assert out["t"].flags.writeable and out["flag"].tolist() == [True, False]
    _zip_with_pickle(tmp_path / "b.pt", b"\x80\x02" + _tensor_pickle("FloatStorage", "0", 3, 0, (3,), (1,)) + b".",
                     [("0", np.array([1, 2, 3], ">f4").tobytes())], byteorder=b"big")
    np.testing.assert_array_equal(tz.load(tmp_path / "b.pt"), [1, 2, 3])
    # a view reaching past its storage is an error, not an out-of-bounds read
    _zip_with_pickle(tmp_path / "c.pt", b"\x80\x02" + _tensor_pickle("FloatStorage", "0", 3, 2, (3,), (1,)) + b".",
                     [("0", np.zeros(3, np.float32).tobytes())])
    with pytest.raises(tz.TorchFileError, match="c.pt"):
        tz.load(tmp_path / "c.pt")


# --------------------------------------------------------------------------- refusing unsafe files

class _RunsShell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Evals:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize("payload, refused", [(_RunsShell, "system"), (_Evals, "builtins.eval")])
def test_malicious_pickle_is_refused_without_running(tmp_path, payload, refused):
    marker = tmp_path / "pwned"
    evil = pickle.dumps({"module": OrderedDict(), "x": payload(marker)}, protocol=2)
    _zip_with_pickle(tmp_path / "evil.pt", evil)
    with pytest.raises(tz.TorchFileError, match=refused) as err:
        tz.load(tmp_path / "evil.pt")
    assert "evil.pt" in str(err.value) and not marker.exists()

    # opaque mode keeps it as an inert record of the call it would have made; still nothing runs
    kept = tz.load(tmp_path / "evil.pt", opaque=True)["x"]
    assert isinstance(kept, tz.PickledObject) and kept.name in ("system", "eval") and not marker.exists()

    # the same payload planted in a DeepSpeed checkpoint's rank file
    _write(tmp_path / "run", _params(), 2, 2)
    rank1 = tmp_path / "run" / "global_step12" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _zip_with_pickle(rank1, evil, prefix="zero_pp_rank_1_mp_rank_00_optim_states")
    with pytest.raises(ds.DeepSpeedCheckpointError, match=refused) as err:
        ds.read_checkpoint(tmp_path / "run")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in str(err.value) and not marker.exists()


def test_opaque_client_state(tmp_path):
    """Megatron-DeepSpeed keeps numpy's RNG state in the client state: kept inert on every route (the
    CLI cannot pass opaque=True); the same object inside DeepSpeed's own entries is refused, and the
    message gives advice a CLI user can follow."""
    _write(tmp_path, _params(), 1, 1)
    model_path = tmp_path / "global_step12" / "mp_rank_00_model_states.pt"
    model = tz.load(model_path)
    rng = tz.PickledObject.make("numpy.core.multiarray", "_reconstruct",
                                args=(tz.PickledObject.make("numpy", "ndarray"), (0,), b"b"))
    tz.save({**model, "np_rng_state": rng}, model_path)
    for ck in (ds.read_checkpoint(tmp_path), ds.read_checkpoint(tmp_path, opaque=True)):
        assert ck.client_state["np_rng_state"].qualname == "numpy.core.multiarray._reconstruct"
        np.testing.assert_array_equal(ck.params["block.bias"], _params()["block.bias"])
    tz.save({**model, "lr_scheduler": {"state": rng}}, model_path)
    with pytest.raises(ds.DeepSpeedCheckpointError,
                       match="mp_rank_00_model_states.pt: holds a pickled 'numpy.core.multiarray._reconstruct' "
                             "under its 'lr_scheduler' entry") as err:
        ds.read_checkpoint(tmp_path)
    assert "opaque=True" not in str(err.value) and "load it with torch" in str(err.value)


def test_other_unlisted_globals_are_refused(tmp_path):
    for module, name in [("builtins", "getattr"), ("__builtin__", "exec"), ("subprocess", "Popen"),
                         ("numpy.core.multiarray", "_reconstruct"), ("torch.nn.modules.linear", "Linear")]:
        _zip_with_pickle(tmp_path / "g.pt", b"\x80\x02" + _g(module, name) + b")R.")
        with pytest.raises(tz.TorchFileError, match="refused to unpickle global") as err:
            tz.load(tmp_path / "g.pt")
        assert name in str(err.value)


# --------------------------------------------------------------------------- clear errors

def test_truncated_and_corrupt_archives(tmp_path):
    _write(tmp_path, _params(), 2, 2)
    rank1 = tmp_path / "global_step12" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    raw = rank1.read_bytes()
    rank1.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ds.DeepSpeedCheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt.*truncated"):
        ds.read_checkpoint(tmp_path)
    # a flipped byte inside a storage: the CRC catches it
    info = zipfile.ZipFile(tmp_path / "global_step12" / "mp_rank_00_model_states.pt").getinfo(
        "mp_rank_00_model_states/data/0")
    rank1.write_bytes(raw)
    model = tmp_path / "global_step12" / "mp_rank_00_model_states.pt"
    blob = bytearray(model.read_bytes())
    name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
    blob[info.header_offset + 30 + name_len + extra_len] ^= 0xFF
    model.write_bytes(bytes(blob))
    with pytest.raises(ds.DeepSpeedCheckpointError, match="mp_rank_00_model_states.pt is corrupt"):
        ds.read_checkpoint(tmp_path)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(tz.TorchFileError, match="empty.pt is empty"):
        tz.load(tmp_path / "empty.pt")
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2))
    with pytest.raises(tz.TorchFileError, match="legacy.pt is not a zip archive"):
        tz.load(tmp_path / "legacy.pt")


def test_forged_sizes_do_not_allocate(tmp_path):
    # a storage whose entry claims far more bytes than the archive holds
    body = b"\x80\x02" + _tensor_pickle("FloatStorage", "0", 1 << 34, 0, (1 << 34,), (1,)) + b"."
    _zip_with_pickle(tmp_path / "big.pt", body, [("0", b"\0" * 16)])
    with pytest.raises(tz.TorchFileError, match="big.pt: storage .* holds 16 bytes"):
        tz.load(tmp_path / "big.pt")
    # a stride-0 view expanding 4 bytes into 2**40 elements: counted as its storage, never materialised
    body = b"\x80\x02" + _tensor_pickle("FloatStorage", "0", 1, 0, (1 << 40,), (0,)) + b"."
    _zip_with_pickle(tmp_path / "wide.pt", body, [("0", np.float32(7).tobytes())])
    wide = tz.load(tmp_path / "wide.pt")
    assert wide.shape == (1 << 40,) and wide.strides == (0,) and tz.expanded(wide) and not wide.flags.writeable
    assert wide[0] == 7 and wide[-1] == 7


def test_missing_files(tmp_path):
    _write(tmp_path, _params(), 2, 2)
    tag = tmp_path / "global_step12"
    os.rename(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tmp_path / "aside.pt")
    with pytest.raises(ds.DeepSpeedCheckpointError,
                       match="zero_pp_rank_1_mp_rank_00_optim_states.pt is missing.*written by 2 ranks"):
        ds.read_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("global_step99")
    with pytest.raises(ds.DeepSpeedCheckpointError, match="latest names tag 'global_step99'"):
        ds.read_checkpoint(tmp_path)
    os.remove(tmp_path / "latest")
    with pytest.raises(ds.DeepSpeedCheckpointError, match=r"no `latest` .*file.*\['global_step12'\]"):
        ds.read_checkpoint(tmp_path)

    _write(tmp_path / "s3", _params(), 3, 2)
    os.remove(tmp_path / "s3" / "global_step12" / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    with pytest.raises(ds.DeepSpeedCheckpointError, match="zero_pp_rank_1_mp_rank_00_model_states.pt is missing"):
        ds.read_checkpoint(tmp_path / "s3")


def test_shapes_that_do_not_add_up(tmp_path):
    params = _params()
    _write(tmp_path, params, 2, 2)
    model_path = tmp_path / "global_step12" / "mp_rank_00_model_states.pt"
    model = tz.load(model_path)
    model["param_shapes"][0]["block.bias"] = tz.TorchSize((9,))  # 2 more elements than were saved
    tz.save(model, model_path)
    with pytest.raises(ds.DeepSpeedCheckpointError, match="mp_rank_00_model_states.pt.*do not belong"):
        ds.read_checkpoint(tmp_path)
    model["param_shapes"] = [7]  # not DeepSpeed's structure at all
    tz.save(model, model_path)
    with pytest.raises(ds.DeepSpeedCheckpointError, match="global_step12: unexpected checkpoint contents"):
        ds.read_checkpoint(tmp_path)


def test_writer_rejects_what_it_cannot_represent(tmp_path):
    with pytest.raises(TypeError, match="cannot write"):
        tz.save({"x": object()}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="DeepSpeed's own"):
        _write(tmp_path, _params(), 2, 1, client_state={"module": 1})
    assert not list(tmp_path.glob("*.tmp*"))


# --------------------------------------------------------------------------- files DeepSpeed wrote itself

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "deepspeed")


def test_reads_a_zero3_checkpoint_deepspeed_wrote():
    """fixtures/deepspeed/zero3 was written by DeepSpeed 0.19.8 with torch 2.13 (make_zero3.py): its flat
    fp32 group carries DeepSpeed's `ds_id`, pickled through torch._tensor._rebuild_from_type_v2 with
    torch.Tensor. Read to what DeepSpeed's own zero_to_fp32 makes of it."""
    ck = ds.read_checkpoint(os.path.join(FIXTURES, "zero3"))
    reference = np.load(os.path.join(FIXTURES, "zero3_fp32.npz"))
    assert ck.zero_stage == 3 and ck.dp_world_size == 1 and ck.step == 2 and ck.global_steps == 2
    assert set(reference) - set(ck.params) == {"lm_head.weight"}  # tied: DeepSpeed saves it once
    for name, value in ck.params.items():
        np.testing.assert_array_equal(value, reference[name], err_msg=name)
    assert ck.exp_avg["transformer.wte.weight"].shape == (256, 4) and ck.client_state == {"epoch": 1}
    optim = tz.load(os.path.join(FIXTURES, "zero3", "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    flat, = optim["optimizer_state_dict"]["fp32_flat_groups"]
    assert isinstance(flat, tz.AttributedTensor) and set(flat.attributes) == {"ds_id"}


def test_tensor_attributes_round_trip_as_torch_writes_them(tmp_path):
    """A tensor with attributes is written back the way torch pickles it, and only tensor types may be
    named: torch.Tensor itself is not callable, and a foreign type or rebuild is refused."""
    tagged = np.arange(3, dtype=np.float32).view(tz.AttributedTensor)
    tagged.attributes = {"ds_id": "0_1"}
    tz.save({"t": tagged}, tmp_path / "a.pt")
    raw = zipfile.ZipFile(tmp_path / "a.pt").read("a/data.pkl")
    assert b"torch._tensor\n_rebuild_from_type_v2" in raw and b"torch\nTensor" in raw
    back = tz.load(tmp_path / "a.pt")["t"]
    assert back.attributes == {"ds_id": "0_1"} and back.tolist() == [0, 1, 2]
    for body in [_g("torch", "Tensor") + b")R.",  # Tensor() called directly
                 _g("torch._tensor", "_rebuild_from_type_v2") + b"(" + _g("builtins", "print") + _g("torch", "Tensor")
                 + b")}tR.",
                 _g("torch._tensor", "_rebuild_from_type_v2") + b"(" + _g("torch._utils", "_rebuild_tensor_v2")
                 + _g("collections", "OrderedDict") + b")}tR."]:
        _zip_with_pickle(tmp_path / "b.pt", b"\x80\x02" + body)
        with pytest.raises(tz.TorchFileError, match="b.pt"):
            tz.load(tmp_path / "b.pt")


# --------------------------------------------------------------------------- what a crafted file can cost

def test_overlapping_entries_are_refused(tmp_path):
    """A stored entry whose declared size swallows the next entry (the zip 'overlap' bomb: the same
    bytes counted by several entries): each entry fits the file, together they declare more than it
    holds - refused before any is read."""
    swallowed = 64 + 30 + len("archive/data/1") + 64  # data/0, then data/1's local header and data
    body = b"\x80\x02(" + _tensor_pickle("ByteStorage", "0", swallowed, 0, (64,), (1,)) \
        + _tensor_pickle("ByteStorage", "1", 64, 0, (64,), (1,)) + b"l."
    _zip_with_pickle(tmp_path / "a.pt", body, [("0", bytes(range(64))), ("1", bytes(64))])
    zf = zipfile.ZipFile(tmp_path / "a.pt")
    first, second = zf.getinfo("archive/data/0"), zf.getinfo("archive/data/1")
    blob = bytearray((tmp_path / "a.pt").read_bytes())
    start = first.header_offset + 30 + len(first.filename) + len(first.extra)
    covered = bytes(blob[start:second.header_offset + 30 + len(second.filename) + 64])  # data/0 through data/1
    record = blob.index(first.filename.encode(), zf.start_dir) - 46  # data/0's central directory record
    assert blob[record:record + 4] == b"PK\x01\x02"
    struct.pack_into("<III", blob, record + 16, zlib.crc32(covered), len(covered), len(covered))
    assert len(covered) == swallowed
    (tmp_path / "a.pt").write_bytes(bytes(blob))
    with pytest.raises(tz.TorchFileError, match="a.pt: entry 'archive/data/0' declares .* overlapping the next"):
        tz.load(tmp_path / "a.pt")


def test_zip_bomb_entry_is_refused(tmp_path):
    """A deflated storage declaring ~1000x its compressed size (torch never compresses)."""
    body = b"\x80\x02" + _tensor_pickle("FloatStorage", "0", 1 << 20, 0, (1 << 20,), (1,)) + b"."
    with zipfile.ZipFile(tmp_path / "bomb.pt", "w") as zf:
        zf.writestr("archive/data.pkl", body)
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/data/0", b"\0" * (4 << 20), compress_type=zipfile.ZIP_DEFLATED)
        zf.writestr("archive/version", b"3\n")
    assert zipfile.ZipFile(tmp_path / "bomb.pt").getinfo("archive/data/0").compress_size < 8 << 10
    with pytest.raises(tz.TorchFileError, match="bomb.pt: entry 'archive/data/0' declares 4194304 bytes from .*zip bomb"):
        tz.load(tmp_path / "bomb.pt")


def test_aliased_storage_is_read_once(tmp_path):
    """Many tensors viewing one storage cost that storage once: views share it, as in torch."""
    storage = np.arange(16, dtype=np.float32)
    views = b"".join(_tensor_pickle("FloatStorage", "0", 16, i, (8,), (1,)) for i in range(8))
    _zip_with_pickle(tmp_path / "a.pt", b"\x80\x02(" + views + b"l.", [("0", storage.tobytes())])
    out = tz.load(tmp_path / "a.pt")
    assert [t.tolist() for t in out] == [storage[i:i + 8].tolist() for i in range(8)]
    assert all(np.shares_memory(out[0], t) for t in out[1:])


def test_expanded_tensor_is_refused_where_it_would_be_copied(tmp_path):
    """The DeepSpeed reader copies fp32 partitions together: an expanded (stride-0) one, 4 stored bytes
    declaring 2**30 elements, is refused before the copy instead of allocating 4 GiB."""
    _write(tmp_path, {"w": np.zeros((1, 1), np.float32)}, 3, 1)  # a tiny real checkpoint, then forged
    optim = tmp_path / "global_step12" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    model = tmp_path / "global_step12" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    state = tz.load(optim)
    state["optimizer_state_dict"]["fp32_flat_groups"] = [np.broadcast_to(np.float32(1), (1 << 30,))]
    states = tz.load(model)
    states["param_shapes"] = [OrderedDict(w=tz.TorchSize((1 << 15, 1 << 15)))]
    tz.save(states, model)
    # written as torch would write torch.zeros(1).expand(2**30): one element, stride 0
    body = b"\x80\x02}(" + _s("optimizer_state_dict") + b"}(" + _s("zero_stage") + _i(3) + _s("partition_count") \
        + _i(1) + _s("fp32_flat_groups") + b"(" + _tensor_pickle("FloatStorage", "0", 1, 0, (1 << 30,), (0,)) \
        + b"lu" + b"u."
    _zip_with_pickle(optim, body, [("0", np.float32(1).tobytes())])
    with pytest.raises(ds.DeepSpeedCheckpointError, match="optim_states.pt: its fp32 partitions and Adam moments "
                                                          "declare 4294967296 bytes of tensors but the file holds"):
        ds.read_checkpoint(tmp_path)


def test_deep_or_exploding_nesting_is_one_error(tmp_path):
    """A client state nested 10**5 deep, or one list referenced so often it expands to 2**64 values
    (as json.dumps would walk it), is one clear error - no RecursionError, no endless walk."""
    deep = b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."
    _zip_with_pickle(tmp_path / "deep.pt", deep)
    with pytest.raises(tz.TorchFileError, match="deep.pt: the pickled object is nested more than 100 levels deep"):
        tz.load(tmp_path / "deep.pt")
    laughs = b"\x80\x02]q\x00" + b"".join(b"(h%ch%ctq%c" % (i, i, i + 1) for i in range(64)) + b"."
    _zip_with_pickle(tmp_path / "wide.pt", laughs)
    with pytest.raises(tz.TorchFileError, match="wide.pt: the pickled object expands to more than"):
        tz.load(tmp_path / "wide.pt")
    # a state of ordinary depth still loads
    _zip_with_pickle(tmp_path / "ok.pt", b"\x80\x02" + b"]" * 50 + b"a" * 49 + b".")
    out = tz.load(tmp_path / "ok.pt")
    for _ in range(49):
        out = out[0]
    assert out == []


def test_fifo_and_devices_are_refused_without_blocking(tmp_path):
    """A FIFO named like a checkpoint file would block `open` until some writer came; it is refused at
    once (the test would hang on unchanged code: the alarm turns that into a failure)."""
    import signal
    fifo = tmp_path / "mp_rank_00_model_states.pt"
    os.mkfifo(fifo)

    def hung(*_):
        raise TimeoutError("reading a FIFO blocked")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    try:
        with pytest.raises(tz.TorchFileError, match="mp_rank_00_model_states.pt is a FIFO .*not read"):
            tz.load(fifo)
        with pytest.raises(tz.TorchFileError, match="/dev/zero is a device"):
            tz.load("/dev/zero")
        os.makedirs(tmp_path / "run" / "global_step1")
        os.rename(fifo, tmp_path / "run" / "global_step1" / "mp_rank_00_model_states.pt")
        with pytest.raises(ds.DeepSpeedCheckpointError, match="is a FIFO"):
            ds.read_checkpoint(tmp_path / "run" / "global_step1")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_latest_naming_a_path_outside_is_refused(tmp_path):
    _write(tmp_path / "elsewhere", _params(), 2, 1)
    run = tmp_path / "run"
    run.mkdir()
    for tag in ("../elsewhere/global_step12", "..", "/etc"):
        (run / "latest").write_text(tag)
        with pytest.raises(ds.DeepSpeedCheckpointError, match=f"latest names '{tag}', which is not a tag folder"):
            ds.read_checkpoint(run)


def test_full_disk_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    import errno
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 100, 100))
    with pytest.raises(OSError, match=r"no space left to write .*a.pt: it needs \d+ bytes and 100 are free") as err:
        tz.save({"w": np.zeros(1000, np.float32)}, tmp_path / "a.pt")
    assert err.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []
    monkeypatch.undo()

    real_open = open

    def full(path, mode="r", *args, **kw):  # the disk fills while writing
        f = real_open(path, mode, *args, **kw)
        if "w" in mode:
            def write(data, f=f):
                raise OSError(errno.ENOSPC, "No space left on device")
            f.write = write
        return f

    (tmp_path / "b.pt").write_bytes(b"keep")
    monkeypatch.setattr("builtins.open", full)
    with pytest.raises(OSError, match="no space left to write .*b.pt: .*the disk filled up while writing"):
        tz.save({"w": np.zeros(1000, np.float32)}, tmp_path / "b.pt")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["b.pt"] and (tmp_path / "b.pt").read_bytes() == b"keep"
