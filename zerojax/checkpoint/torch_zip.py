"""PyTorch's `torch.save` zip format, read and written with numpy alone, never running pickled code.

A `.pt` file written by torch >= 1.6 is a zip archive whose entries share one top folder
(`<archive>/`, torch names it after the file)::

    <archive>/data.pkl               pickle protocol 2: the object tree; tensors are reduce calls
                                     `torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
                                     requires_grad, backward_hooks[, metadata])` whose storage is a
                                     persistent id ('storage', torch.<Type>Storage, key, location, numel)
    <archive>/data/<key>             the raw bytes of one storage, little-endian, 64-byte aligned
    <archive>/byteorder              "little" (older files lack it; torch then reads little-endian)
    <archive>/version                "3\\n"

(torch/serialization.py `_save`/`_load`, caffe2/serialize/inline_container.cc.)

Reading never calls `pickle.load` on the user's bytes: `_RestrictedUnpickler.find_class` admits only
the globals in `ALLOWED_GLOBALS` - the tensor rebuild functions (with `_rebuild_from_type_v2` for a
tensor carrying attributes, as torch's `weights_only` loader admits it), `collections.OrderedDict`,
`torch.Size`, torch dtypes and the few DeepSpeed classes its checkpoints pickle (loss scalers,
`ZeroStageEnum`, `fragment_address`), which become inert records (`PickledObject`, `PickledEnum`).
Anything else - `os.system`, `builtins.eval`, a user class - is refused before it is looked up, with
a `TorchFileError` naming the file and the global (or, with `opaque=True`, kept as an inert record
that is never imported or called). Storages become numpy arrays: fp32/fp64/fp16, bf16 and fp8 (via
ml_dtypes), signed/unsigned ints, bool and complex; a tensor's offset and strides are checked
against its storage before any element is read.

A file is untrusted, so what it can cost is bounded by its real size: a FIFO or device is refused
before it is read, zip entries may not overlap and a compressed one may declare at most
`_MAX_RATIO` times its bytes, each storage is read once however many tensors alias it, tensors that
view or expand (stride 0) a storage are views of it, and the loaded object may be at most
`_MAX_DEPTH` deep and expand to at most `_MAX_NODES` values.

Writing produces the same layout torch does (same entry order, alignment, protocol, persistent ids
and reduce calls), so `torch.load` reads it, and the records read here are written back unchanged -
that is how DeepSpeed-format checkpoints are built without torch.
"""
from __future__ import annotations

import codecs
import errno
import io
import math
import os
import pickle
import shutil
import stat
import struct
import sys
import zipfile
import zlib
from collections import OrderedDict
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np

__all__ = [
    "ALLOWED_GLOBALS", "AttributedTensor", "LazyArray", "PickledEnum", "PickledObject", "TorchDtype", "TorchFileError", "TorchSize",
    "load", "save",
]


class TorchFileError(ValueError):
    """A `.pt` file that cannot be read safely: corrupt, truncated, not torch's zip format, or holding
    a pickled global outside the allowlist. The message names the file; `refused` is the global's
    `module.name` when that was the reason (so a caller can say what to do on its own route)."""

    def __init__(self, message: str, refused: str | None = None) -> None:
        super().__init__(message)
        self.refused = refused


# torch/storage.py `_dtype_to_storage_type_map`: the legacy storage class each dtype pickles as.
_STORAGE_DTYPES: dict[str, np.dtype] = {
    "DoubleStorage": np.dtype(np.float64), "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16), "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64), "IntStorage": np.dtype(np.int32), "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8), "ByteStorage": np.dtype(np.uint8), "BoolStorage": np.dtype(np.bool_),
    "ComplexFloatStorage": np.dtype(np.complex64), "ComplexDoubleStorage": np.dtype(np.complex128),
    # Newer dtypes pickle as raw bytes plus a torch dtype (`_rebuild_tensor_v3`).
    "UntypedStorage": np.dtype(np.uint8),
}
_STORAGE_NAMES = {dt: name for name, dt in _STORAGE_DTYPES.items() if name != "UntypedStorage"}

# torch dtype attribute names (what `torch.float16` pickles as: GLOBAL 'torch float16') -> numpy.
_TORCH_DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64), "double": np.dtype(np.float64),
    "float32": np.dtype(np.float32), "float": np.dtype(np.float32),
    "float16": np.dtype(np.float16), "half": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz), "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "int64": np.dtype(np.int64), "long": np.dtype(np.int64), "int32": np.dtype(np.int32), "int": np.dtype(np.int32),
    "int16": np.dtype(np.int16), "short": np.dtype(np.int16), "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8), "uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64), "bool": np.dtype(np.bool_),
    "complex64": np.dtype(np.complex64), "cfloat": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128), "cdouble": np.dtype(np.complex128),
}
_CANONICAL_DTYPE_NAME = {dt: name for name, dt in reversed(list(_TORCH_DTYPES.items()))}

# Classes DeepSpeed pickles into its checkpoints by value (`state_dict[LOSS_SCALER] = self.loss_scaler`
# in deepspeed/runtime/zero/stage_1_and_2.py and stage3.py; `fragment_address` in `param_slice_mappings`;
# `argparse.Namespace` in Megatron-DeepSpeed's client state). They are kept as `PickledObject` records.
_RECORD_CLASSES = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "argparse.Namespace",
})
# Enums pickled by value (`Enum.__reduce_ex__` -> (cls, (value,))), kept as `PickledEnum` ints.
_ENUM_CLASSES = frozenset({"deepspeed.runtime.zero.config.ZeroStageEnum"})

ALLOWED_GLOBALS: frozenset[str] = frozenset(
    {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_tensor",
     "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state", "collections.OrderedDict",
     "torch.Size", "torch._tensor._rebuild_from_type_v2", "torch.Tensor", "torch.nn.parameter.Parameter",
     "builtins.set", "builtins.frozenset", "builtins.bytes", "builtins.bytearray", "_codecs.encode"}
    | {f"torch.{name}" for name in _STORAGE_DTYPES}
    | {f"torch.{name}" for name in _TORCH_DTYPES}
    | _RECORD_CLASSES | _ENUM_CLASSES)
"""Every `module.name` a file may reference; anything else is refused."""

# Protocol-2 pickles name Python 3 modules by their Python 2 names (`pickle` fix_imports).
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


# --------------------------------------------------------------------------- records

class PickledObject:
    """An instance of an allowlisted class, kept as data instead of being rebuilt.

    `module`/`name` say which class it was, `state` is what pickle's BUILD gave it (the instance
    `__dict__` for plain classes and dataclasses), `args` the constructor arguments if any.
    Writing one back emits the same GLOBAL/NEWOBJ/BUILD sequence, so torch with DeepSpeed installed
    rebuilds the real object.
    """
    module: str = ""
    name: str = ""

    def __new__(cls, *args: Any) -> PickledObject:
        self = object.__new__(cls)
        self.module, self.name = cls.module, cls.name
        self.args, self.state = tuple(args), None
        return self

    def __init__(self, *args: Any) -> None:  # pickle's REDUCE calls the class; __new__ did the work
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @staticmethod
    def make(module: str, name: str, state: Any = None, args: tuple = ()) -> PickledObject:
        """A record to write: `make("argparse", "Namespace", {"lr": 0.1})`."""
        obj = object.__new__(PickledObject)
        obj.module, obj.name, obj.args, obj.state = module, name, tuple(args), state
        return obj

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def get(self, key: str, default: Any = None) -> Any:
        """An attribute from the pickled `__dict__` state."""
        state = self.state[0] if isinstance(self.state, tuple) and self.state else self.state
        return state.get(key, default) if isinstance(state, dict) else default

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PickledObject) and (self.qualname, self.args) == (other.qualname, other.args)
                and _equal(self.state, other.state))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PickledObject({self.qualname}, state={self.state!r})"


class PickledEnum(int):
    """An allowlisted int enum member (DeepSpeed's `ZeroStageEnum`), kept as its value."""
    module: str
    name: str

    def __new__(cls, module: str, name: str, value: int) -> PickledEnum:
        self = int.__new__(cls, value)
        self.module, self.name = module, name
        return self

    def __repr__(self) -> str:
        return f"{self.name}({int(self)})"


class TorchSize(tuple):
    """`torch.Size`: a tuple of ints. DeepSpeed's `param_shapes` hold these, and `zero_to_fp32.py`
    calls `.numel()` on them, so written shapes must be `torch.Size`, not plain tuples."""

    def numel(self) -> int:
        return math.prod(self)

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"


class TorchDtype:
    """A torch dtype object (e.g. `DynamicLossScaler.dtype`), by its torch attribute name."""
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        if name not in _TORCH_DTYPES:
            raise ValueError(f"unknown torch dtype {name!r}")
        self.name = name

    @property
    def numpy(self) -> np.dtype:
        return _TORCH_DTYPES[self.name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchDtype) and self.numpy == other.numpy

    def __hash__(self) -> int:
        return hash(self.numpy)

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class AttributedTensor(np.ndarray):
    """A tensor that carried Python attributes in the file, e.g. DeepSpeed's `ds_id` on its flat fp32
    groups. torch pickles such a tensor through `torch._tensor._rebuild_from_type_v2(rebuild, torch.Tensor,
    args, state)` with the instance `__dict__` as `state`; here it is a numpy array whose `attributes`
    hold that dict as inert data (written back the same way)."""
    attributes: dict

    def __array_finalize__(self, obj: Any) -> None:
        self.attributes = getattr(obj, "attributes", {})


class LazyArray:
    """A tensor to write whose data is produced only when its storage is written, so a large state
    dict can be streamed to disk one tensor at a time. `produce()` must return an array of exactly
    `shape` and `dtype`."""
    __slots__ = ("shape", "dtype", "produce")

    def __init__(self, shape: tuple[int, ...], dtype: Any, produce: Callable[[], np.ndarray]) -> None:
        self.shape, self.dtype, self.produce = tuple(int(d) for d in shape), np.dtype(dtype), produce


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                and a.dtype == b.dtype and bool(np.array_equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------- reading

class _Refused(Exception):
    def __init__(self, qualname: str) -> None:
        super().__init__(qualname)
        self.qualname = qualname


class _StorageType:
    """What `torch.FloatStorage` & co. resolve to: only a dtype for `persistent_load`."""
    __slots__ = ("name", "dtype")

    def __init__(self, name: str) -> None:
        self.name, self.dtype = name, _STORAGE_DTYPES[name]


class _TensorType:
    """What `torch.Tensor` / `torch.nn.parameter.Parameter` resolve to: only a name that
    `_rebuild_from_type_v2` accepts as its `new_type`; calling or instantiating it fails."""
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Storage:
    __slots__ = ("key", "array")

    def __init__(self, key: str, array: np.ndarray) -> None:
        self.key, self.array = key, array


_MAX_RATIO = 100
"""How much larger than its stored bytes a compressed entry may declare itself (plus `_RATIO_SLACK`).
torch writes every entry stored (ratio 1); a crafted deflate entry could otherwise declare ~1000x."""
_RATIO_SLACK = 1024


def _open_regular(path: str) -> io.BufferedReader:
    """`path` opened for reading if it is a regular file. A FIFO or a device is refused before
    anything is read: opening one without O_NONBLOCK waits for a writer, and reading it may never end."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode)
                    or stat.S_ISBLK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file")
            raise TorchFileError(f"{path} is {what}, not a file: it is not read (a checkpoint is a regular file; "
                                 "reading this could wait for a writer or never end). Pass the checkpoint file itself.")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class _Archive:
    """The zip archive: its top folder, byte order and storages."""

    def __init__(self, path: str, mmap: bool) -> None:
        self.path, self.mmap = path, mmap
        self.file = _open_regular(path)
        try:
            self._open()
        except BaseException:
            self.file.close()
            raise

    def close(self) -> None:
        self.zip.close()
        self.file.close()

    def _open(self) -> None:
        path = self.path
        self.size = os.fstat(self.file.fileno()).st_size
        head = self.file.read(4)
        if head != b"PK\x03\x04":
            what = "is empty" if not head else "is not a zip archive"
            raise TorchFileError(
                f"{path} {what}: expected torch.save's zip format (torch >= 1.6). Files written with "
                "_use_new_zipfile_serialization=False or by older torch are not supported; re-save them "
                "with a current torch.save.")
        try:
            self.zip = zipfile.ZipFile(self.file)
            infos = self.zip.infolist()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error) as e:
            raise TorchFileError(f"{path} is truncated or corrupt ({e}); the write that produced it did not "
                                 "finish - use an earlier checkpoint or save it again") from None
        try:
            names = [i.filename for i in infos]
            if not names or "/" not in names[0]:
                raise TorchFileError(f"{path} is a zip archive but not torch.save's: its entries are not in one "
                                     "folder")
            self._check_layout(infos)
            self.prefix = names[0].split("/", 1)[0] + "/"  # torch takes the first entry's folder
            self.names = set(names)
            byteorder = self.record("byteorder", required=False)
            if byteorder not in (None, b"little", b"big"):
                raise TorchFileError(f"{path}: unknown byteorder record {byteorder!r}")
        except BaseException:
            self.zip.close()
            raise
        self.big_endian = byteorder == b"big"
        self.storages: dict[str, _Storage] = {}

    def _check_layout(self, infos: list[zipfile.ZipInfo]) -> None:
        """Bound what the archive can make the reader allocate, before any entry is read: entries may
        not overlap (so their stored bytes add up to at most the file's size; a zip whose directory
        points many entries at the same bytes is refused), a stored entry declares exactly its stored
        size, and a compressed one at most `_MAX_RATIO` times it. Every byte read is then backed by
        the file, and each storage is read once however many tensors view it."""
        end = getattr(self.zip, "start_dir", self.size)
        bad = None
        for info, nxt in zip(sorted(infos, key=lambda i: i.header_offset),
                             sorted(i.header_offset for i in infos)[1:] + [end]):
            if info.compress_type == zipfile.ZIP_STORED:
                if info.compress_size != info.file_size:
                    bad = f"entry {info.filename!r} is stored but declares {info.file_size} bytes for " \
                          f"{info.compress_size} stored"
            elif info.file_size > _MAX_RATIO * info.compress_size + _RATIO_SLACK:
                bad = (f"entry {info.filename!r} declares {info.file_size} bytes from {info.compress_size} compressed "
                       f"(more than {_MAX_RATIO}x: a zip bomb; torch writes entries uncompressed)")
            if bad is None and info.header_offset + 30 + len(info.orig_filename.encode("utf-8", "replace")) \
                    + info.compress_size > nxt:
                bad = (f"entry {info.filename!r} declares {info.compress_size} stored bytes at offset "
                       f"{info.header_offset}, overlapping the next entry or beyond the {self.size}-byte file")
            if bad:
                raise TorchFileError(f"{self.path}: {bad}; the file is corrupt or crafted and is not read")

    def _checked(self, full: str) -> zipfile.ZipInfo:
        return self.zip.getinfo(full)  # its sizes were checked against the file by `_check_layout`

    def record(self, name: str, required: bool = True) -> bytes | None:
        full = self.prefix + name
        if full not in self.names:
            if required:
                raise TorchFileError(f"{self.path} has no {full!r} entry; it is not a complete torch.save file")
            return None
        self._checked(full)
        return self.zip.read(full)

    def storage(self, key: str, dtype: np.dtype, numel: int) -> _Storage:
        if key in self.storages:
            return self.storages[key]
        full = f"{self.prefix}data/{key}"
        if full not in self.names:
            raise TorchFileError(f"{self.path}: the pickle refers to storage {key!r} but there is no {full!r} entry")
        info = self._checked(full)
        nbytes = numel * dtype.itemsize
        if info.file_size != nbytes:
            raise TorchFileError(f"{self.path}: storage {full!r} holds {info.file_size} bytes, but the pickle "
                                 f"says {numel} x {dtype} = {nbytes} bytes")
        file_dtype = dtype.newbyteorder(">") if self.big_endian and dtype.itemsize > 1 else dtype
        if self.mmap and info.compress_type == zipfile.ZIP_STORED and nbytes:
            array = np.memmap(self.file, dtype=file_dtype, mode="c", offset=self._data_offset(info), shape=(numel,))
            raw, crc = array.view(np.uint8), 0
            for lo in range(0, nbytes, 16 << 20):  # the CRC over the mapped pages: they are read, not kept
                crc = zlib.crc32(raw[lo:lo + (16 << 20)], crc)
            if crc != info.CRC:
                raise TorchFileError(f"{self.path} is corrupt or not a torch checkpoint (storage {full!r} fails "
                                     "its CRC check)")
        else:
            buffer = bytearray(nbytes)
            with self.zip.open(info) as f:
                view, done = memoryview(buffer), 0
                while done < nbytes:  # in slices, so the transient copy stays small
                    n = f.readinto(view[done:done + (16 << 20)])
                    if not n:
                        raise TorchFileError(f"{self.path}: storage {full!r} ends early; the file is truncated")
                    done += n
                if f.read(1):
                    raise TorchFileError(f"{self.path}: storage {full!r} is longer than its header says")
            array = np.frombuffer(buffer, dtype=file_dtype)
        if file_dtype != dtype:
            array = array.astype(dtype)
        storage = _Storage(key, array)
        self.storages[key] = storage
        return storage

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        self.file.seek(info.header_offset)
        header = self.file.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise TorchFileError(f"{self.path}: bad local header for {info.filename!r}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.header_offset + 30 + name_len + extra_len


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise pickle.UnpicklingError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, dtype: np.dtype | None = None) -> np.ndarray:
    """A tensor as a numpy array, after checking every element it addresses lies inside its storage.

    Nothing beyond the storage is allocated: a tensor that is its whole storage is that array; one
    that views part of it, or expands it (stride 0, as `torch.expand` leaves), is a read-only view of
    it, as in torch, where such tensors share their storage's memory (read-only where the view
    repeats elements). So a file's tensors cost at most its storages, each read once however many
    tensors alias it; `np.array(t)` makes a private copy."""
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError(f"tensor storage must be a persistent storage, got {type(storage).__name__}")
    flat = storage.array
    if dtype is not None and dtype != flat.dtype:  # v3: raw bytes reinterpreted as `dtype`
        if flat.nbytes % dtype.itemsize:
            raise pickle.UnpicklingError(f"storage {storage.key!r} of {flat.nbytes} bytes is not whole {dtype} items")
        flat = flat.view(dtype)
    offset = _int(offset, "storage offset")
    if not isinstance(size, tuple) or not isinstance(stride, tuple) or len(size) != len(stride):
        raise pickle.UnpicklingError(f"tensor size {size!r} and stride {stride!r} must be tuples of one length")
    size = tuple(_int(d, "tensor size") for d in size)
    stride = tuple(_int(s, "tensor stride") for s in stride)
    if 0 in size:
        return np.zeros(size, flat.dtype)
    last = offset + sum((d - 1) * s for d, s in zip(size, stride))
    if last >= flat.size:
        raise pickle.UnpicklingError(f"tensor of size {size} stride {stride} at offset {offset} reaches element "
                                     f"{last} of storage {storage.key!r}, which has {flat.size}")
    contiguous = tuple(math.prod(size[i + 1:]) for i in range(len(size)))
    if offset == 0 and math.prod(size) == flat.size and all(s == c for d, s, c in zip(size, stride, contiguous)
                                                            if d > 1):
        return flat.reshape(size)  # the common case, a tensor that is its whole storage
    itemsize = flat.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(flat[offset:], shape=size, strides=tuple(s * itemsize for s in stride),
                                           writeable=False)
    if not expanded(view) and flat.flags.writeable:  # distinct elements: writable like torch's view
        view = np.lib.stride_tricks.as_strided(flat[offset:], shape=size, strides=view.strides)
    return view


def expanded(array: np.ndarray) -> bool:
    """Whether `array` has more elements than the memory it addresses (a stride-0 or overlapping view
    of a storage): materialising it would allocate more than the file holds."""
    if array.size <= 1:
        return False
    span = 1 + sum((d - 1) * abs(s) for d, s in zip(array.shape, array.strides)) // max(array.itemsize, 1)
    return array.size > span


_MAX_DEPTH = 100
"""Nesting a loaded object may have: DeepSpeed's deepest is ~6; JSON and repr recurse per level."""
_MAX_NODES = 10_000_000
"""Values a loaded object may expand to when shared containers are walked as a tree (as `json.dumps`
does): a pickle can reference one list from many places and build 2**100 with a few bytes."""


def _children(obj: Any) -> tuple:
    if isinstance(obj, dict):
        return tuple(obj.keys()) + tuple(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return tuple(obj)
    if isinstance(obj, PickledObject):
        return (obj.args, obj.state)
    if isinstance(obj, AttributedTensor):
        return (obj.attributes,)
    return ()


def _check_tree(root: Any, path: str) -> None:
    """Refuse an object nested deeper than `_MAX_DEPTH` or expanding to more than `_MAX_NODES` values,
    walked without recursion (height and tree size per container, each container visited once)."""
    height: dict[int, int] = {}
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        obj, done = stack.pop()
        key = id(obj)
        kids = _children(obj)
        if done:
            on_path.discard(key)
            known = [id(k) for k in kids if id(k) in height]  # a reference back up the path adds nothing
            height[key] = 1 + max((height[k] for k in known), default=0)
            size[key] = 1 + sum(size[k] for k in known)
            if height[key] > _MAX_DEPTH or size[key] > _MAX_NODES:
                what = (f"is nested more than {_MAX_DEPTH} levels deep" if height[key] > _MAX_DEPTH else
                        f"expands to more than {_MAX_NODES} values (containers referenced from many places)")
                raise TorchFileError(f"{path}: the pickled object {what}; no checkpoint is, so the file is crafted "
                                     "or corrupt and is not read (walking it would exhaust the stack or the CPU)")
            continue
        if key in height or key in on_path:
            continue
        if not kids:
            height[key], size[key] = 1, 1
            continue
        on_path.add(key)
        stack.append((obj, True))
        stack.extend((k, False) for k in kids)


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves globals only from the allowlist; storages come from the archive."""

    def __init__(self, data: bytes, archive: _Archive, opaque: bool) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._archive, self._opaque = archive, opaque
        self._globals = self._allowed()

    def _allowed(self) -> dict[str, Any]:
        # Fresh callables per file, so nothing a pickle does to them (BUILD on a function) outlives it.
        def rebuild_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
            return _tensor(storage, offset, size, stride)

        def rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
            if not isinstance(dtype, TorchDtype):
                raise pickle.UnpicklingError(f"_rebuild_tensor_v3 needs a torch dtype, got {dtype!r}")
            return _tensor(storage, offset, size, stride, dtype.numpy)

        def rebuild_v1(storage, offset, size, stride):
            return _tensor(storage, offset, size, stride)

        def rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
            if not isinstance(data, np.ndarray):
                raise pickle.UnpicklingError("_rebuild_parameter needs a tensor")
            return data

        rebuilds = (rebuild_v2, rebuild_v3, rebuild_v1, rebuild_parameter)

        def rebuild_from_type(func, new_type, args, state):
            # torch/_tensor.py `_rebuild_from_type_v2`, what torch's weights_only loader admits for a tensor
            # with attributes: an admitted rebuild, the type Tensor or Parameter, the attributes as data.
            if not any(func is r for r in rebuilds) or not isinstance(new_type, _TensorType) \
                    or not isinstance(args, tuple):
                raise pickle.UnpicklingError("_rebuild_from_type_v2 is admitted only to rebuild a torch.Tensor or "
                                             "Parameter with an admitted tensor rebuild")
            tensor = func(*args)
            if isinstance(state, tuple) and len(state) == 2:  # torch._utils._get_obj_state: (__dict__, slots)
                state = {**(state[0] or {}), **(state[1] or {})}
            if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
                raise pickle.UnpicklingError(f"tensor attributes must be a dict of names, got {type(state).__name__}")
            if not state:
                return tensor
            out = tensor.view(AttributedTensor)
            out.attributes = dict(state)
            return out

        def ordered_dict(*args):
            if args and not isinstance(args[0], (list, tuple)):
                raise pickle.UnpicklingError("OrderedDict takes a list of pairs here")
            return OrderedDict(*args)

        def of_list(kind):
            def make(items=()):
                if not isinstance(items, (list, tuple, set, frozenset)):
                    raise pickle.UnpicklingError(f"{kind.__name__} takes a list here")
                return kind(items)
            return make

        def encode(text, encoding="latin1"):  # how protocol 2 writes bytes objects
            if not isinstance(text, str) or encoding != "latin1":
                raise pickle.UnpicklingError("_codecs.encode is admitted only for protocol-2 latin1 bytes")
            return codecs.encode(text, "latin1")

        def empty_bytes(*args):
            if args:
                raise pickle.UnpicklingError("bytes() is admitted only without arguments")
            return b""

        def size(dims=()):
            return TorchSize(_int(d, "torch.Size entry") for d in dims)

        table: dict[str, Any] = {
            "torch._utils._rebuild_tensor_v2": rebuild_v2, "torch._utils._rebuild_tensor_v3": rebuild_v3,
            "torch._utils._rebuild_tensor": rebuild_v1, "torch._utils._rebuild_parameter": rebuild_parameter,
            "torch._utils._rebuild_parameter_with_state": rebuild_parameter,
            "torch._tensor._rebuild_from_type_v2": rebuild_from_type,
            "torch.Tensor": _TensorType("Tensor"), "torch.nn.parameter.Parameter": _TensorType("Parameter"),
            "collections.OrderedDict": ordered_dict, "torch.Size": size,
            "builtins.set": of_list(set), "builtins.frozenset": of_list(frozenset),
            "builtins.bytearray": of_list(bytearray), "builtins.bytes": empty_bytes, "_codecs.encode": encode,
        }
        table.update({f"torch.{name}": _StorageType(name) for name in _STORAGE_DTYPES})
        table.update({f"torch.{name}": TorchDtype(name) for name in _TORCH_DTYPES})
        for qualname in _RECORD_CLASSES:
            module, name = qualname.rsplit(".", 1)
            table[qualname] = type(name, (PickledObject,), {"module": module, "name": name, "__slots__": ()})
        for qualname in _ENUM_CLASSES:
            module, name = qualname.rsplit(".", 1)
            table[qualname] = (lambda m, n: lambda value: PickledEnum(m, n, _int(value, n)))(module, name)
        assert table.keys() == ALLOWED_GLOBALS
        return table

    def find_class(self, module: str, name: str) -> Any:
        module = _PY2_MODULES.get(module, module)
        qualname = f"{module}.{name}"
        if qualname not in self._globals:
            if not self._opaque:
                raise _Refused(qualname)
            # An inert stand-in: calling or building it only records the arguments and state.
            self._globals[qualname] = type(name, (PickledObject,), {"module": module, "name": name})
        return self._globals[qualname]

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        kind, storage_type, key, _location, numel = pid
        if isinstance(kind, bytes):
            kind = kind.decode("ascii")
        if kind != "storage" or not isinstance(storage_type, _StorageType) or not isinstance(key, str):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._archive.storage(key, storage_type.dtype, _int(numel, "storage size"))


def load(path: str | os.PathLike, *, mmap: bool = False, opaque: bool = False) -> Any:
    """The object `torch.save` stored in `path`, with tensors as numpy arrays.

    Only `ALLOWED_GLOBALS` are resolved; any other global raises `TorchFileError` naming the file
    and the global, before anything of it is imported or called. `opaque=True` instead keeps such
    objects as inert `PickledObject` records of their arguments and state (for files whose extra
    state holds other objects, e.g. Megatron's numpy RNG state); nothing is imported or run either
    way. `mmap=True` maps uncompressed storages copy-on-write instead of reading them into
    memory (large shards: the pages are the file's, so host memory is not spent on them); their CRC
    is checked over the mapping as the read path checks it.
    """
    path = os.fspath(path)
    try:
        archive = _Archive(path, mmap)
        try:
            data = archive.record("data.pkl")
            if len(data) < 2 or data[0] != 0x80 or not 2 <= data[1] <= 5:  # torch.save's pickle_protocol
                raise pickle.UnpicklingError("data.pkl is not a pickle of protocol 2 to 5")
            obj = _RestrictedUnpickler(data, archive, opaque).load()
        finally:
            archive.close()
        _check_tree(obj, path)
        return obj
    except (TorchFileError, FileNotFoundError):
        raise
    except _Refused as e:
        raise TorchFileError(
            f"{path}: refused to unpickle global '{e.qualname}'. Only tensors, containers and the records "
            "DeepSpeed checkpoints hold are read; loading this global would import or run code from the file. "
            "Pass opaque=True to keep such objects as inert records instead, or, if you trust the file, load it "
            "with torch and re-save plain tensors.", refused=e.qualname) from None
    except (pickle.UnpicklingError, zipfile.BadZipFile, zlib.error, EOFError, struct.error, OSError,
            TypeError, ValueError, AttributeError, IndexError, KeyError, RecursionError, MemoryError) as e:
        raise TorchFileError(f"{path} is corrupt or not a torch checkpoint ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------- writing

class _Global:
    """A `module.name` written as a GLOBAL opcode without importing it (torch/deepspeed need not exist)."""
    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # save_reduce wants a callable; never called
        raise TypeError(f"{self.module}.{self.name} is a placeholder")


class _StorageRef:
    __slots__ = ("key", "type_name", "numel", "data")

    def __init__(self, key: str, type_name: str, numel: int, data: np.ndarray | LazyArray) -> None:
        self.key, self.type_name, self.numel, self.data = key, type_name, numel, data


_PLAIN_TYPES = frozenset({type(None), bool, int, float, str, bytes, list, tuple, dict, OrderedDict, set, frozenset})
_PLAIN_GLOBALS = (OrderedDict, set, frozenset, bytes, codecs.encode)


class _TorchPickler(pickle._Pickler):  # the pure-Python pickler: its save() can be extended per type
    """Pickles like torch.save: tensors as `_rebuild_tensor_v2` calls on persistent storages."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)
        self.storages: list[_StorageRef] = []
        self._global_cache: dict[tuple[str, str], _Global] = {}

    def _global(self, module: str, name: str) -> _Global:
        return self._global_cache.setdefault((module, name), _Global(module, name))

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _StorageRef:
            return ("storage", self._global("torch", obj.type_name), obj.key, "cpu", obj.numel)
        return None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if type(obj) is _StorageRef:
            return super().save(obj, save_persistent_id)
        memo = self.memo.get(id(obj))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        if type(obj) is _Global:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("utf-8"))
            self.memoize(obj)
        elif isinstance(obj, TorchDtype):
            self.save(self._global("torch", obj.name))
        elif isinstance(obj, PickledObject):
            self.save(self._global(obj.module, obj.name))
            self.save(obj.args)
            self.write(pickle.NEWOBJ)
            self.memoize(obj)
            if obj.state is not None:
                self.save(obj.state)
                self.write(pickle.BUILD)
        elif isinstance(obj, PickledEnum):
            self.save_reduce(self._global(obj.module, obj.name), (int(obj),), obj=obj)
        elif isinstance(obj, TorchSize):
            self.save_reduce(self._global("torch", "Size"), (tuple(int(d) for d in obj),), obj=obj)
        elif isinstance(obj, (np.ndarray, LazyArray)):
            self._save_tensor(obj)
        elif type(obj) in _PLAIN_TYPES or any(obj is g for g in _PLAIN_GLOBALS):
            super().save(obj, save_persistent_id)
        else:
            raise TypeError(f"cannot write a {type(obj).__module__}.{type(obj).__qualname__} into a torch file: "
                            "use numpy arrays, containers, str/int/float/bool/None, TorchSize, TorchDtype or "
                            "PickledObject/PickledEnum records")

    def _save_tensor(self, obj: np.ndarray | LazyArray) -> None:
        # torch/_tensor.py `_reduce_ex_internal`: (storage, offset, size, stride, requires_grad, OrderedDict()).
        dtype, shape = np.dtype(obj.dtype), tuple(int(d) for d in obj.shape)
        if dtype.byteorder == ">":
            dtype = dtype.newbyteorder("<")
        numel = math.prod(shape)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        key = str(len(self.storages))
        legacy = _STORAGE_NAMES.get(dtype)
        if legacy is not None:
            ref = _StorageRef(key, legacy, numel, obj)
            args: tuple = (ref, 0, shape, stride, False, OrderedDict())
            rebuild = "_rebuild_tensor_v2"
        elif dtype in _CANONICAL_DTYPE_NAME:  # newer dtypes: bytes + dtype (torch/_tensor.py, _rebuild_tensor_v3)
            ref = _StorageRef(key, "UntypedStorage", numel * dtype.itemsize, obj)
            args = (ref, 0, shape, stride, False, OrderedDict(), TorchDtype(_CANONICAL_DTYPE_NAME[dtype]))
            rebuild = "_rebuild_tensor_v3"
        else:
            raise TypeError(f"torch has no dtype for numpy {dtype}")
        self.storages.append(ref)
        attributes = getattr(obj, "attributes", None)
        if attributes:  # torch/_tensor.py `_reduce_ex_internal` for a tensor with a __dict__
            self.save_reduce(self._global("torch._tensor", "_rebuild_from_type_v2"),
                             (self._global("torch._utils", rebuild), self._global("torch", "Tensor"), args,
                              dict(attributes)), obj=obj)
        else:
            self.save_reduce(self._global("torch._utils", rebuild), args, obj=obj)


def _storage_bytes(ref: _StorageRef) -> Iterator[memoryview]:
    data = ref.data
    if isinstance(data, LazyArray):
        produced = np.asarray(data.produce())
        if produced.shape != data.shape or produced.dtype != data.dtype:
            raise ValueError(f"LazyArray produced {produced.shape} {produced.dtype}, "
                             f"declared {data.shape} {data.dtype}")
        data = produced
    array = np.ascontiguousarray(data).reshape(-1)
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    raw = array.view(np.uint8)
    chunk = 64 << 20
    for start in range(0, raw.size, chunk):
        yield memoryview(raw[start:start + chunk])


_ALIGNMENT = 64  # caffe2/serialize/inline_container.h kFieldAlignment; torch `.storage_alignment`


def _write_record(zf: zipfile.ZipFile, fp: io.BufferedWriter, name: str, size: int,
                  chunks: Iterator[bytes | memoryview]) -> int:
    """One stored (uncompressed) entry whose data starts on a 64-byte boundary, padded the way
    torch's writer pads: an extra field 'FB' + length + 'Z' * padding. Returns its CRC-32."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # the rule zipfile uses to add its zip64 extra field
    start = fp.tell() + 30 + len(name.encode("utf-8")) + 4 + (20 if zip64 else 0)
    padding = -start % _ALIGNMENT
    info.extra = b"FB" + struct.pack("<H", padding) + b"Z" * padding
    crc, written = 0, 0
    with zf.open(info, "w") as out:
        for chunk in chunks:
            out.write(chunk)
            crc = zlib.crc32(chunk, crc)
            written += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
    if written != size:
        raise ValueError(f"record {name} declared {size} bytes but wrote {written}")
    return crc


def save(obj: Any, path: str | os.PathLike, *, archive_name: str | None = None) -> None:
    """Write `obj` as torch.save would: numpy arrays become tensors; records are written back as the
    classes they stand for. The file appears atomically (written beside it, then renamed), and
    storages are written one at a time (a `LazyArray` is produced only then)."""
    path = os.fspath(path)
    if archive_name is None:  # torch names the folder after the file, minus its extension
        archive_name = os.path.splitext(os.path.basename(path))[0]
        if not archive_name or not archive_name.isascii():
            archive_name = "archive"
    buffer = io.BytesIO()
    pickler = _TorchPickler(buffer)
    pickler.dump(obj)
    data_pkl = buffer.getvalue()
    prefix = archive_name + "/"
    small = [("data.pkl", data_pkl), (".format_version", b"1"), (".storage_alignment", str(_ALIGNMENT).encode()),
             ("byteorder", b"little")]
    tmp = f"{path}.tmp{os.getpid()}"
    total = len(data_pkl) + sum(math.prod(r.data.shape) * np.dtype(r.data.dtype).itemsize for r in pickler.storages)
    folder = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else None
    if free is not None and total > free:
        raise _disk_full(path, total, free)
    try:
        with open(tmp, "wb") as fp, zipfile.ZipFile(fp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            crcs, names = [], []
            for name, payload in small:
                crcs.append(_write_record(zf, fp, prefix + name, len(payload), iter([payload])))
                names.append(name)
            for ref in pickler.storages:
                nbytes = math.prod(ref.data.shape) * np.dtype(ref.data.dtype).itemsize
                crcs.append(_write_record(zf, fp, f"{prefix}data/{ref.key}", nbytes, _storage_bytes(ref)))
                names.append(f"data/{ref.key}")
            _write_record(zf, fp, prefix + "version", 2, iter([b"3\n"]))
            names.append("version")
            # Like torch's writer: an id from the record names and the data's CRCs (40 digits).
            name_hash = zlib.crc32("\n".join(names).encode()) * 2654435761 % 10**20
            crc_mix = 0
            for crc in crcs:
                crc_mix = zlib.crc32(struct.pack("<I", crc), crc_mix)
            serialization_id = f"{name_hash:020d}{crc_mix:020d}".encode()
            _write_record(zf, fp, prefix + ".data/serialization_id", len(serialization_id), iter([serialization_id]))
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            raise _disk_full(path, total, None) from None
        raise


_DISK_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


def _disk_full(path: str, needed: int, free: int | None) -> OSError:
    """One error for a write that does not fit: what was being written, how much, and what to do
    (nothing is left behind: the partial file is removed, an existing one is untouched)."""
    room = f"{free} are free" if free is not None else "the disk filled up while writing"
    return OSError(errno.ENOSPC, f"no space left to write {path}: it needs {needed} bytes and {room}; nothing was "
                                 "written - free space there or write to another disk")
