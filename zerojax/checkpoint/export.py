"""Parameters out of a checkpoint, one leaf at a time: a safetensors file (`zerojax export`) and plain
numpy trees.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Iterator, Mapping

import ml_dtypes
import numpy as np

from zerojax.checkpoint.format import PIPELINE_ROWS, PathLike, STATE_DIR, absolute, truth_name
from zerojax.checkpoint.integrity import read_meta
from zerojax.checkpoint.pending import resolve_tag
from zerojax.checkpoint.loading import read_leaves, reading, verified
from zerojax.errors import ConfigError
from zerojax.core.names import join


_SAFETENSORS_DTYPES = {"fp32": (np.dtype(np.float32), "F32"), "bf16": (np.dtype(ml_dtypes.bfloat16), "BF16"),
                       "fp16": (np.dtype(np.float16), "F16")}


def unpipelined_tag(directory: PathLike, tag: str | None, what: str) -> tuple[Path, dict[str, Any]]:
    """(folder, metadata) of a complete tag whose files verify, for an export by model names (`what`,
    e.g. "export --format hf"): a pipelined run's flat stage rows have none, so it is one error."""
    tag_dir = resolve_tag(absolute(directory), tag)
    meta = read_meta(tag_dir)
    verified(tag_dir, meta)
    if meta.get("extra", {}).get(PIPELINE_ROWS):
        raise ConfigError(f"{what}: this checkpoint is of a pipelined run (mesh.stage > 1); export it with "
                          f"--format safetensors (the default) instead")
    return tag_dir, meta


def export_safetensors(directory: PathLike, tag: str | None, out_path: PathLike, dtype: str = "fp32", *,
                       overwrite: bool = False) -> Path:
    """Write the parameters of a checkpoint (the fp32 master when there is one) to one safetensors file.

    Tensor names are the parameter paths joined with '.'. The header is computed from the
    metadata, then leaves are read and written one by one, so host memory stays near the
    largest leaf whatever the model size. A pipelined run's parameters are written under their
    logical names, cut out of its `[stages, width]` rows (held in host memory while writing).

    The tag is verified against its checksums first. An existing `out_path` is an error unless
    `overwrite`; the file is written under a temporary name in the same folder and renamed only
    once complete, so a failed export leaves neither a partial file nor a changed old one.
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: use one of {sorted(_SAFETENSORS_DTYPES)}")
    np_dtype, st_dtype = _SAFETENSORS_DTYPES[dtype]
    out = absolute(out_path)
    if out.is_dir() or str(out_path).endswith(("/", os.sep)):
        raise FileExistsError(f"export: --out {out_path} is a folder; name the .safetensors file to write")
    if out.exists() and not overwrite:
        raise FileExistsError(f"export: {out} already exists and is never overwritten silently; pass "
                              f"--force (overwrite=True) to replace it, or choose another --out")
    tag_dir = resolve_tag(absolute(directory), tag)
    meta = read_meta(tag_dir)
    verified(tag_dir, meta)
    rows = meta.get("extra", {}).get(PIPELINE_ROWS)
    params = rows["leaves"] if rows else meta["params"]
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": str(tag_dir), "step": str(meta["step"]),
                                               "dtype": dtype}}
    offset = 0
    for name, entry in params.items():
        size = math.prod(entry["shape"]) * np_dtype.itemsize
        header[name] = {"dtype": st_dtype, "shape": entry["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # 8-byte aligned data, as the format recommends
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for array in _exported_arrays(tag_dir, meta, rows):
                np.ascontiguousarray(array.astype(np_dtype, copy=False)).tofile(f)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, out)
        else:
            try:  # a link fails, rather than replaces, if the name appeared while we wrote
                os.link(tmp, out)
            except FileExistsError:
                raise FileExistsError(f"export: {out} appeared while exporting; it was left as it is") from None
            except OSError:  # a filesystem without hard links
                os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _exported_arrays(tag_dir: Path, meta: Mapping[str, Any], rows: Mapping[str, Any] | None
                     ) -> Iterator[np.ndarray]:
    """The parameters to export, in header order: saved leaves, or slices of pipeline rows (the stage
    rows, and the expert rows an entry's `array` names)."""
    if not rows:
        sources = [truth_name(meta, name) for name in meta["params"]]
        for _, array in read_leaves(tag_dir / STATE_DIR, sources):
            yield array
        return
    names = dict.fromkeys(entry.get("array", rows["array"]) for entry in rows["leaves"].values())
    tables = dict(read_leaves(tag_dir / STATE_DIR, [join(meta["truth"], name) for name in names]))
    for entry in rows["leaves"].values():
        yield pipeline_leaf(tables[join(meta["truth"], entry.get("array", rows["array"]))], entry)


def pipeline_leaf(table: np.ndarray, entry: Mapping[str, Any]) -> np.ndarray:
    """One logical parameter out of pipeline rows: `[S, width]`, or `[S, slices, width]` whose rows hold
    tensor or expert slices (joined along the entry's `tensor_dim` or `expert_dim`; a whole leaf is read
    from slice 0)."""
    start, shape = entry["offset"], entry.get("block", entry["shape"])
    if table.ndim == 2:
        return table[entry["row"], start:start + math.prod(shape)].reshape(shape)
    blocks = [table[entry["row"], t, start:start + math.prod(shape)].reshape(shape) for t in range(table.shape[1])]
    dim = entry.get("tensor_dim", entry.get("expert_dim"))
    return blocks[0] if dim is None else np.concatenate(blocks, axis=dim)


def read_params(directory: PathLike, tag: str | None = None) -> tuple[dict[str, Any], str]:
    """A checkpoint's parameters (fp32 master where there is one) as nested dicts of numpy arrays,
    read without a plan or a mesh after verifying the tag; also the tag folder. For inspection and
    generation on one host (`zerojax sample`)."""
    tag_dir = resolve_tag(absolute(directory), tag)
    meta = read_meta(tag_dir)
    verified(tag_dir, meta)
    rows = meta.get("extra", {}).get(PIPELINE_ROWS)
    names = rows["leaves"] if rows else meta["params"]
    params: dict[str, Any] = {}
    for name, array in zip(names, _exported_arrays(tag_dir, meta, rows)):
        *parents, leaf = name.split(".")
        node = params
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = np.asarray(array)
    return params, str(tag_dir)


def load_exported(path: PathLike) -> dict[str, Any]:
    """The params pytree (nested dicts of numpy arrays) from an exported safetensors file."""
    from safetensors import safe_open

    params: dict[str, Any] = {}
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
            *parents, leaf = name.split(".")
            node = params
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = f.get_tensor(name)
    return params


def _read_by_chunks(store: Any, index: tuple[Any, ...]) -> np.ndarray:
    """`store[index]` (integers and unit-step slices) read one storage chunk at a time: a compressed
    chunk is decoded whole for any part of it, and a read spanning many chunks would hold them all."""
    box = []
    for d, n in enumerate(store.shape):
        ix = index[d] if d < len(index) else slice(None)
        if isinstance(ix, slice):
            start, stop, step = ix.indices(n)
            if step != 1:
                raise ValueError(f"LeafReader: step {step} in {index}")
            box.append((start, max(start, stop), False))
        else:
            box.append((int(ix), int(ix) + 1, True))
    chunk = [c or n for c, n in zip(store.chunk_layout.read_chunk.shape, store.shape)]
    out = np.empty([b - a for a, b, _ in box], dtype=store.dtype.numpy_dtype)
    for corner in itertools.product(*[range(a - a % c, b, c) for (a, b, _), c in zip(box, chunk)]):
        part = tuple(slice(max(a, k), min(b, k + c)) for (a, b, _), k, c in zip(box, corner, chunk))
        out[tuple(slice(p.start - a, p.stop - a) for p, (a, _, _) in zip(part, box))] = store[part].read().result()
    return out[tuple(0 if single else slice(None) for _, _, single in box)]


class LeafReader:
    """Parts of saved arrays read on the host without reading the rest: `read(name, (i,))` is one
    layer of a stacked leaf, so a caller holds one tensor at a time, not one leaf. Arrays are read
    with tensorstore from orbax's OCDBT store; a store it cannot open is read through orbax, one
    whole leaf at a time (the last one is kept for the next part)."""

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)
        self._open: dict[str, Any] = {}
        self._whole: tuple[str, np.ndarray] | None = None
        self._context: Any = None

    def _ts_context(self) -> Any:
        """One chunk decoded at a time, nothing cached: with more, the decoding threads' buffers
        (a compressed chunk is decoded whole for any part of it) stay resident in their allocator
        arenas, several chunks' worth."""
        if self._context is None:
            import tensorstore as ts
            self._context = ts.Context({"data_copy_concurrency": {"limit": 1}, "file_io_concurrency": {"limit": 1},
                                        "cache_pool": {"total_bytes_limit": 0}})
        return self._context

    def _store(self, name: str) -> Any:
        if name not in self._open:
            import tensorstore as ts
            store = None
            for driver in ("zarr", "zarr3"):
                try:
                    store = ts.open({"driver": driver, "kvstore": {"driver": "ocdbt", "base": f"file://{self.state_dir}/",
                                                                   "path": name}},
                                    context=self._ts_context(), open=True, read=True).result()
                    break
                except Exception:  # noqa: BLE001 - not this driver, or not an OCDBT store
                    continue
            self._open[name] = store
        return self._open[name]

    def read(self, name: str, index: tuple[Any, ...] = ()) -> np.ndarray:
        store = self._store(name)
        if store is not None:
            with reading(self.state_dir.parent):
                return _read_by_chunks(store, index)
        if self._whole is None or self._whole[0] != name:
            self._whole = None  # the previous leaf goes before the next is read
            (_, array), = read_leaves(self.state_dir, [name])
            self._whole = (name, array)
        return np.asarray(self._whole[1][index])
