"""Data as people have it in tables: Parquet, Arrow and Hugging Face `datasets` folders, one column at a time.

A `datasets` folder is what `Dataset.save_to_disk` (or `DatasetDict.save_to_disk`) writes: Arrow stream
files listed in `state.json` beside `dataset_info.json` (a DatasetDict: one such folder per split, named
in `dataset_dict.json`). Every format is read here with pyarrow alone, a record batch at a time, so the
`datasets` package is never needed and memory holds one batch of one column. pyarrow is imported
only when a table is read.

Each reader yields the documents of one column: a `str` for a text column, a 1-D int64 array for a
column of token ids (a list of integers a row). A missing column, a column of the wrong type or a
null row is one ConfigError naming the key that chose it, the file, what the file holds and the fix.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from zerojax.errors import ConfigError

#: data.source values read by this module
SOURCES = ("parquet", "arrow", "datasets")
_BATCH_ROWS = 1024


def pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError("data.source: Parquet, Arrow and datasets folders are read with pyarrow; "
                          "pip install pyarrow (a dependency of zerojax)") from None
    return pa


def is_datasets_folder(path: Path) -> bool:
    """Whether `path` is a folder `datasets`' save_to_disk wrote (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def dataset_splits(path: Path) -> list[str] | None:
    """The splits of a DatasetDict folder, in its order; None for a single Dataset's folder."""
    listing = path / "dataset_dict.json"
    if not listing.is_file():
        return None
    try:
        splits = json.loads(listing.read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"data.path: {listing} is not the dataset_dict.json save_to_disk writes ({e}); save "
                          f"the DatasetDict again") from None
    return [str(s) for s in splits]


def dataset_files(path: Path, split: str | None, key: str = "data.path") -> list[Path]:
    """The Arrow files of a `datasets` folder, in row order: a Dataset's, or split `split` of a DatasetDict's."""
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is not a folder; data.source: datasets reads the folder "
                          f"Dataset.save_to_disk or DatasetDict.save_to_disk wrote")
    splits = dataset_splits(path)
    if splits is not None:
        want = split or "train"
        if want not in splits:
            raise ConfigError(f"data.split: {path} holds the splits {', '.join(splits)}, not {want!r}; set "
                              f"data.split (and data.val_split) to one of them")
        path = path / want
    state = path / "state.json"
    if not state.is_file():
        raise ConfigError(f"{key}: {path} has no state.json nor dataset_dict.json, so it is not a folder "
                          f"datasets' save_to_disk wrote; give such a folder, or a Parquet, Arrow or JSONL file "
                          f"with data.source: parquet | arrow | jsonl")
    try:
        info = json.loads(state.read_text())
        files = [path / str(f["filename"]) for f in info["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{key}: {state} is not the state.json save_to_disk writes ({e}); save the dataset "
                          f"again") from None
    if info.get("_indices_data_files"):
        raise ConfigError(f"{key}: {path} stores an indices mapping (a select/shuffle not written out); save it "
                          f"with dataset.flatten_indices().save_to_disk(...) so its rows are the Arrow files' rows")
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise ConfigError(f"{key}: {path}'s state.json lists {', '.join(missing) if missing else 'no data files'}, "
                          f"which {'are' if len(missing) != 1 else 'is'} not there; copy the whole folder "
                          f"save_to_disk wrote")
    return files


def _arrow_batches(pa: Any, file: Path, key: str) -> tuple[Any, Iterator[Any]]:
    """(schema, record batches) of an Arrow IPC file (Feather v2) or stream (what `datasets` writes)."""
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(file)))
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except (pa.ArrowInvalid, OSError):
        pass
    try:
        stream = pa.ipc.open_stream(pa.memory_map(str(file)))
    except (pa.ArrowInvalid, OSError) as e:
        raise ConfigError(f"{key}: {file} is neither an Arrow IPC file nor an Arrow stream pyarrow can read "
                          f"({e}); give an Arrow, Parquet or JSONL file with the right data.source") from None
    return stream.schema, iter(stream)


def _parquet_batches(pa: Any, file: Path, column: str, key: str) -> tuple[Any, Iterator[Any]]:
    try:
        parquet = pa.parquet.ParquetFile(str(file))
    except (pa.ArrowInvalid, OSError) as e:
        raise ConfigError(f"{key}: {file} is not a Parquet file pyarrow can read ({e}); give a Parquet file, or "
                          f"set data.source to what it is") from None
    schema = parquet.schema_arrow
    if column not in schema.names:
        return schema, iter(())
    return schema, parquet.iter_batches(batch_size=_BATCH_ROWS, columns=[column])


def _check_type(pa: Any, schema: Any, column: str, tokens: bool, where: Path, column_key: str) -> None:
    if column not in schema.names:
        other = "data.text_key" if tokens else "data.tokens_key"
        raise ConfigError(f"{column_key}: {where} has no column {column!r} (it has: {', '.join(schema.names)}); set "
                          f"{column_key} to the column that holds the {'token ids' if tokens else 'text'}"
                          f"{'' if tokens else f' (or {other} to a column of token ids)'}")
    kind = schema.field(column).type
    types = pa.types
    if tokens:
        ok = ((types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind))
              and types.is_integer(kind.value_type))
        need = "a list of integers a row (token ids)"
    else:
        ok = types.is_string(kind) or types.is_large_string(kind)
        need = "a string a row (text)"
    if not ok:
        raise ConfigError(f"{column_key}: column {column!r} of {where} is {kind}, not {need}; set {column_key} to "
                          f"such a column" + ("" if tokens else ", or name a column of token ids with "
                                                                "data.tokens_key"))


def column_documents(source: str, path: Path, column: str, tokens: bool, *, split: str | None = None,
                     key: str = "data.path", column_key: str = "data.text_key") -> Iterator[str | np.ndarray]:
    """The documents of `column` of a Parquet file, an Arrow file or a `datasets` folder, in row
    order: a str each (`tokens` False) or the row's token ids as int64 (`tokens` True)."""
    pa = pyarrow()
    files = dataset_files(path, split, key) if source == "datasets" else [path]
    if source != "datasets" and not path.is_file():
        raise ConfigError(f"{key}: {path} is not a file; give the path of "
                          f"{'a Parquet' if source == 'parquet' else 'an Arrow'} file (or a datasets folder "
                          f"with data.source: datasets)")
    row = 0
    for file in files:
        if source == "parquet":
            schema, batches = _parquet_batches(pa, file, column, key)
        else:
            schema, batches = _arrow_batches(pa, file, key)
        where = path if source != "datasets" else file
        _check_type(pa, schema, column, tokens, where, column_key)
        for batch in batches:
            values = batch.column(batch.schema.get_field_index(column))
            if values.null_count:
                first = row + int(np.flatnonzero(np.asarray(values.is_null()))[0])
                raise ConfigError(f"{column_key}: row {first} of column {column!r} in {where} is null; drop the "
                                  f"empty rows (e.g. dataset.filter(...)) or fill them")
            if tokens:
                flat = values.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
                lengths = np.asarray(values.value_lengths().fill_null(0), dtype=np.int64)
                yield from np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else ()
            else:
                yield from values.to_pylist()
            row += len(values)
