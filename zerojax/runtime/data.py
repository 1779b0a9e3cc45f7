"""Training data: the embedded corpus, text, JSONL and token files, as deterministic, resumable batches.

The default corpus is the source of Python's standard library, read in sorted path order, so every
machine has the same bytes with nothing downloaded. Batch `k` depends only on (seed, k), so a run
resumes at any position by index alone.

Your own data comes as a flat token file (the nanoGPT/Megatron `.bin`: uint16 or uint32 ids end to
end, memory-mapped, never read whole), as text/JSONL, or as a text or token-id column of a Parquet
file, an Arrow file or a Hugging Face `datasets` folder (`tables`, with pyarrow), text tokenized at
start-up with a `tokenizers` tokenizer.json (the model's own by default). Documents are packed:
concatenated with an end-of-document id and cut into windows of seq_len + 1 tokens, visited in an
order that grain shuffles afresh each epoch; the loss skips the prediction across a document
boundary (`loss_mask`). Attention still sees the previous document inside a window, as in
GPT-2/nanoGPT packing. Or padded (`data.packing: pad`): a document a row, the padding out of the loss.

`Loader` runs any of these through grain: a MapDataset of batch indices whose iterator builds the
batches in a background thread and whose state (`{"next_index": k}`) is what a checkpoint saves.
Every process builds only its rows of the same global batch `k`, so that one small state serves
all processes of a run.
"""
from __future__ import annotations

import codecs
import dataclasses
import json
import os
import queue
import sysconfig
import threading
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Iterator, NamedTuple, TypeVar

import numpy as np

from zerojax.config import DataConfig
from zerojax.errors import ConfigError
from zerojax.runtime import tables

T = TypeVar("T")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


# ---------------------------------------------------------------------------------------------
# What a data file holds. A binary file read as text trains on its bytes without a word, so every
# text or JSONL path is checked by its first (and last) bytes and by its name before it is read.

#: What zerojax reads, said in every refusal.
READS = ("zerojax reads UTF-8 text and JSONL (data.source: file | jsonl), token ids (a flat .bin or a 1-D "
         "integer .npy, data.source: tokens), and a text or token-id column of a Parquet file, an Arrow file or a "
         "Hugging Face datasets folder (data.source: parquet | arrow | datasets)")
_TABLE = ("write its text column as JSONL (one {\"text\": ...} object a line) and give that with data.tokenizer, "
          "or tokenize that JSONL once to a .bin with `zerojax tokenize`")
#: format -> (how it is named in a sentence, what to give instead)
_FORMATS = {
    "Parquet": ("a Parquet file", "read it as a table with data.source: parquet (its text column named by "
                                  "data.text_key, or token ids by data.tokens_key), or " + _TABLE),
    "Arrow": ("an Arrow file", "read it as a table with data.source: arrow (its text column named by "
                               "data.text_key, or token ids by data.tokens_key), or " + _TABLE),
    "NumPy": ("a NumPy file", "a 1-D integer .npy of token ids is read as one with data.source: tokens "
                              "(the default for a *.npy data.path)"),
    "zip": ("a zip file", "extract the text, JSONL or token file it holds and give that"),
    "tar": ("a tar file", "extract the text, JSONL or token file it holds and give that"),
    "gzip": ("a gzip file", "decompress it first (gunzip -k) and give the file it holds"),
    "bzip2": ("a bzip2 file", "decompress it first (bunzip2 -k) and give the file it holds"),
    "xz": ("an xz file", "decompress it first (unxz -k) and give the file it holds"),
    "zstd": ("a zstd file", "decompress it first (unzstd) and give the file it holds"),
    "HDF5": ("an HDF5 file", "write its text as JSONL, or its token ids as a .bin or .npy"),
    "PyTorch": ("a PyTorch file", "write its text as JSONL, or its token ids as a .bin or .npy"),
    "pickle": ("a pickle file", "write its text as JSONL, or its token ids as a .bin or .npy"),
    "safetensors": ("a safetensors file", "write its token ids as a .bin or .npy"),
}
_SUFFIXES = {".parquet": "Parquet", ".pq": "Parquet", ".arrow": "Arrow", ".arrows": "Arrow", ".feather": "Arrow",
             ".ipc": "Arrow", ".npy": "NumPy", ".npz": "zip", ".zip": "zip", ".tar": "tar", ".gz": "gzip",
             ".tgz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd", ".zstd": "zstd", ".h5": "HDF5",
             ".hdf5": "HDF5", ".pt": "PyTorch", ".pth": "PyTorch", ".pkl": "pickle", ".pickle": "pickle",
             ".safetensors": "safetensors"}
NEWLINE = b"\n"
_HEAD = 64 * 1024  # bytes sniffed at the start of a file
_TAIL = 65_557     # a zip's end-of-directory record lies in its last 65,557 bytes


def _ends(path: Path) -> tuple[bytes, bytes]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_HEAD)
        f.seek(max(size - _TAIL, 0))
        return head, f.read()


def binary_format(path: str | os.PathLike[str]) -> str | None:
    """The binary format `path` holds (a key of `_FORMATS`), by its magic bytes, else by its name;
    None for a file that may be text or flat token ids. Each signature is long enough (or checked at
    both ends) that a flat token file does not match it by chance."""
    path = Path(path)
    head, tail = _ends(path)
    if head.startswith(b"\x93NUMPY"):
        return "NumPy"
    if head.startswith(b"PAR1") and tail.endswith(b"PAR1"):
        return "Parquet"
    if head.startswith(b"ARROW1"):
        return "Arrow"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")) and b"PK\x05\x06" in tail:
        return "zip"
    if head[257:262] == b"ustar":
        return "tar"
    if head.startswith(b"\x1f\x8b\x08") and len(head) > 3 and head[3] < 0x20:
        return "gzip"
    if head.startswith(b"BZh") and head[4:10] == b"1AY&SY":
        return "bzip2"
    for magic, name in ((b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\x89HDF\r\n\x1a\n", "HDF5")):
        if head.startswith(magic):
            return name
    return _SUFFIXES.get(path.suffix.lower())


def _refuse_format(path: Path, fmt: str, key: str = "data.path") -> ConfigError:
    what, fix = _FORMATS[fmt]
    return ConfigError(f"{key}: {path} is {what}, not text or token ids that zerojax reads as they are; {fix}. "
                       f"{READS}")


def _refuse_utf8(data: bytes, at: int, path: Path, key: str, where: str, offset: int) -> ConfigError:
    line = "" if where else f"line {data.count(NEWLINE, 0, at) + 1}: "
    return ConfigError(f"{key}: {path}{where} is not UTF-8 text: byte {offset + at} ({line}0x{data[at]:02x}) does not "
                       f"decode; re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8 {path.name} > "
                       f"{path.stem}.utf8{path.suffix}), or give token ids as data.source: tokens. {READS}")


def check_utf8(data: bytes, path: Path, final: bool = True, key: str = "data.path", where: str = "",
               offset: int = 0) -> str:
    """`data` (bytes `offset`... of `path`) decoded as UTF-8, or one error naming the first NUL or
    undecodable byte; with `final=False` a character cut at the end (a read limit) is dropped."""
    nul = data.find(b"\x00")
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
    except UnicodeDecodeError as e:
        if nul < 0 or e.start < nul:
            raise _refuse_utf8(data, e.start, path, key, where, offset) from None
        text = ""
    if nul >= 0:
        raise ConfigError(f"{key}: {path}{where} holds NUL bytes (the first at byte {offset + nul}), so it is binary, "
                          f"not text; give the text it was made from, or token ids as data.source: tokens. {READS}")
    return text


def check_text_file(path: Path, key: str = "data.path") -> None:
    """Refuse, before it is read, a text or JSONL path that holds no UTF-8 text: a binary format (by
    its first bytes or its name), UTF-16, NUL bytes or bytes UTF-8 does not decode, in its first 64
    KiB (the rest is checked as it is read)."""
    fmt = binary_format(path)
    if fmt is not None:
        raise _refuse_format(path, fmt, key)
    with open(path, "rb") as f:
        head = f.read(_HEAD)
        final = not f.read(1)
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise ConfigError(f"{key}: {path} is UTF-16 text; zerojax reads UTF-8: re-encode it (e.g. iconv -f utf-16 "
                          f"-t utf-8 {path.name} > {path.stem}.utf8{path.suffix})")
    check_utf8(head, path, final, key)


def _read_text_bytes(path: Path, limit: int) -> tuple[bytes, bool]:
    """Up to `limit` bytes of a checked text file, and whether they are all of it."""
    check_text_file(path)
    with open(path, "rb") as f:
        data = f.read(limit)
        final = not f.read(1)
    check_utf8(data, path, final)
    return data, final


def read_corpus(cfg: DataConfig) -> np.ndarray:
    """Up to `cfg.max_bytes` bytes of text as uint8."""
    if cfg.source == "file":
        path = Path(cfg.path or "")
        if not path.is_file():
            raise ConfigError(f"data.path: {path} is not a file; give a text file or use source: stdlib")
        return np.frombuffer(_read_text_bytes(path, cfg.max_bytes)[0], dtype=np.uint8)
    chunks, total = [], 0
    root = stdlib_root()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                data = (Path(dirpath) / name).read_bytes()
            except OSError:
                continue
            chunks.append(data[: cfg.max_bytes - total])
            total += len(chunks[-1])
            if total >= cfg.max_bytes:
                return np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if not chunks:
        raise ConfigError(f"data.source: no Python sources under {root}; use source: file with data.path")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class Split(NamedTuple):
    train: np.ndarray
    val: np.ndarray


def split_corpus(tokens: np.ndarray, val_fraction: float, seq_len: int, max_bytes: int | None = None) -> Split:
    """The last `val_fraction` of the bytes is validation; both parts must hold a window.

    `max_bytes` is the limit the corpus was read with: raising it helps only when it cut the
    corpus short; a text that is itself too short needs a longer text (or a shorter window).
    """
    cut = int(len(tokens) * (1 - val_fraction))
    train, val = tokens[:cut], tokens[cut:]
    for name, part in (("train", train), ("validation", val)):
        if len(part) <= seq_len + 1:
            if max_bytes is None or len(tokens) >= max_bytes:
                fix = "raise data.max_bytes or lower model.seq_len"
            else:
                fix = (f"the corpus itself has only {len(tokens)} bytes (data.max_bytes={max_bytes} is not what "
                       f"limits it): use a longer text, lower model.seq_len"
                       + (" or raise data.val_fraction" if name == "validation" else ""))
            raise ConfigError(f"data: the {name} split has {len(part)} bytes, fewer than model.seq_len + 2 "
                              f"= {seq_len + 2}; {fix}")
    return Split(train, val)


class _BatchStream:
    """Iteration over a batch source by position: `position` counts batches handed out, which is
    all a checkpoint needs to resume the stream; each process builds its `local` rows only."""
    position: int
    local: np.ndarray | None

    def batch(self, index: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = self.batch(self.position, self.local)
        self.position += 1
        return out


class Batches(_BatchStream):
    """Global batches of `rows` random windows of `seq_len + 1` bytes from `tokens`.

    `position` counts batches handed out, which is all a checkpoint needs to resume the stream.
    In a multi-process run each process iterates over its `local` rows only.
    """

    def __init__(self, tokens: np.ndarray, rows: int, seq_len: int, seed: int, position: int = 0,
                 local: np.ndarray | None = None):
        self.tokens, self.rows, self.seq_len, self.seed = tokens, rows, seq_len, seed
        self.position = position
        self.local = local  # the rows this process builds when iterating (None: all)
        self.windows = max((len(tokens) - 1) // seq_len, 1)  # an epoch: as many rows as windows cut end to end

    def batch(self, index: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Global batch `index`, or only its `rows` (ascending row indices: one process's share).

        Row r is the same window whatever `rows` is, so processes that each build their own rows
        together hold exactly the batch one process would build.
        """
        rng = np.random.default_rng((self.seed, index))
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.rows)
        if rows is not None:
            starts = starts[rows]
        windows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
        return {"tokens": windows.astype(np.int32)}


class _Failed(NamedTuple):
    error: BaseException


class _End(NamedTuple):
    pass


class Prefetch(Generic[T]):
    """`source`'s items built up to `depth` ahead in a background thread, handed out in order.

    The training loop dispatches a step and comes back for the next batch while the device still
    runs it (`Engine.train_batch` returns without waiting for its step); the next batches are then
    already built, so host and device overlap. `position` counts the items handed out from
    `start` on, never those merely built ahead: it is what a checkpoint saves, so a resumed run
    continues with exactly the batch that was next (the source must not be touched elsewhere while
    the thread runs). An exception in the thread is raised here, from `next`, at the item where it
    happened; `close()` (or leaving the `with` block) stops the thread, and a daemon thread never
    holds up interpreter exit. `depth=0` builds each item on the caller's thread, with no thread.
    """

    def __init__(self, source: Iterator[T], depth: int = 2, start: int = 0, name: str = "zerojax-prefetch"):
        if depth < 0:
            raise ValueError(f"Prefetch: depth must be >= 0, got {depth}")
        self.source, self.depth, self.position = source, depth, start
        self._stop = threading.Event()
        self._queue: queue.Queue[T | _Failed | _End] = queue.Queue(maxsize=max(depth, 1))
        self._done = False
        self._thread: threading.Thread | None = None
        if depth:
            self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        while not self._stop.is_set():
            try:
                item: T | _Failed | _End = next(self.source)
            except StopIteration:
                item = _End()
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                item = _Failed(e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, (_End, _Failed)):
                return

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        if self._thread is None:
            item = next(self.source)
        else:
            while True:
                try:
                    item = self._queue.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not self._thread.is_alive() and self._queue.empty():
                        raise RuntimeError("Prefetch: the producer thread ended without a result") from None
            if isinstance(item, _End):
                self._done = True
                raise StopIteration
            if isinstance(item, _Failed):
                self._done = True
                self.close()
                raise item.error
        self.position += 1
        return item

    def close(self) -> None:
        """Stop the thread (it finishes the item it is building, then exits); idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    def __enter__(self) -> "Prefetch[T]":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Tokenized sources: token files, and text/JSONL through a tokenizer.json.

#: data.source values whose documents are a table's column (zerojax.runtime.tables)
TABLE_SOURCES = tables.SOURCES

#: End-of-document tokens looked up in a tokenizer when `data.eos_id` is not given, in this order.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[SEP]")
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class Corpus(NamedTuple):
    """A token stream and how to cut it: `packed` streams are tokenized documents (windows end to
    end, shuffled per epoch, boundary-masked at `eos_id`); byte streams take random windows.
    `offsets` (documents read one by one): where each document starts in `tokens`, and its end
    last, so `data.packing: pad` can give each its own row."""
    tokens: np.ndarray
    eos_id: int | None
    packed: bool
    offsets: np.ndarray | None = None


def _need_file(path: str | None, key: str, what: str) -> Path:
    p = Path(path or "")
    if not p.is_file():
        raise ConfigError(f"{key}: {p} is not a file; give the path of {what}")
    return p


def load_tokenizer(path: str, vocab_size: int) -> Any:
    """A `tokenizers` Tokenizer from tokenizer.json whose ids all fit the model's embedding."""
    file = _need_file(path, "data.tokenizer", "a tokenizer.json (Hugging Face `tokenizers` format)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("data.tokenizer: needs the `tokenizers` package; pip install 'zerojax[tokenizers]'") from None
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - the library raises its own untyped errors
        raise ConfigError(f"data.tokenizer: {file} is not a tokenizer.json `tokenizers` can read ({e})") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ConfigError(f"data.tokenizer: {file} has {size} tokens but model.vocab_size is {vocab_size}; "
                          f"set model.vocab_size: {size} (or more), or use a smaller tokenizer")
    return tok


def _eos(cfg: DataConfig, tok: Any, vocab_size: int) -> int:
    if cfg.eos_id is not None:
        eos = cfg.eos_id
    else:
        found = [tok.token_to_id(t) for t in EOS_TOKENS if tok.token_to_id(t) is not None]
        if not found:
            raise ConfigError(f"data.eos_id: the tokenizer {cfg.tokenizer} has none of the end-of-document "
                              f"tokens {', '.join(EOS_TOKENS)}; set data.eos_id to the id that separates "
                              f"documents")
        eos = found[0]
    if eos >= vocab_size:
        raise ConfigError(f"data.eos_id: {eos} is not below model.vocab_size {vocab_size}; give an id the "
                          f"model has, or raise model.vocab_size")
    return eos


def _documents(cfg: DataConfig, path: Path, split: str | None = None) -> Iterator[str | np.ndarray]:
    """The documents of `path`: a str each (the text of a text file, of each JSONL line's `data.text_key`,
    of a table's `data.text_key` column) up to `data.max_bytes` bytes of text, or, with
    `data.tokens_key`, each JSONL line's or table row's token ids (int64). `split`: a datasets
    folder's split (default `data.split`)."""
    if cfg.source == "file":
        data, final = _read_text_bytes(path, cfg.max_bytes)
        yield check_utf8(data, path, final)
        return
    tokens = cfg.tokens_key is not None
    if cfg.source in TABLE_SOURCES:
        from zerojax.runtime.tables import column_documents
        column = cfg.tokens_key if tokens else cfg.text_key
        docs = column_documents(cfg.source, path, column, tokens, split=split or cfg.split,
                                column_key="data.tokens_key" if tokens else "data.text_key")
    else:
        docs = _jsonl_documents(cfg, path)
    total = 0
    for doc in docs:
        yield doc
        if not tokens:
            total += len(doc.encode("utf-8"))
            if total >= cfg.max_bytes:
                return


def _jsonl_documents(cfg: DataConfig, path: Path) -> Iterator[str | np.ndarray]:
    """Each JSONL line's `data.text_key` text, or its `data.tokens_key` list of token ids."""
    check_text_file(path)
    key = cfg.tokens_key or cfg.text_key
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = check_utf8(raw, path, where=f" line {n}", offset=offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data.path: {path} line {n} is not JSON ({e.msg}); give one JSON object "
                                  f"a line") from None
            value = doc.get(key) if isinstance(doc, dict) else None
            if cfg.tokens_key is not None:
                if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
                    keys = ", ".join(doc) if isinstance(doc, dict) else type(doc).__name__
                    raise ConfigError(f"data.tokens_key: line {n} of {path} has no list of token ids under "
                                      f"'{key}' (it has: {keys}); set data.tokens_key to the field that holds "
                                      f"them, or unset it and name the text field with data.text_key")
                yield np.asarray(value, dtype=np.int64)
                continue
            if not isinstance(value, str):
                keys = ", ".join(doc) if isinstance(doc, dict) else type(doc).__name__
                raise ConfigError(f"data.text_key: line {n} of {path} has no text field '{key}' "
                                  f"(it has: {keys}); set data.text_key to the field that holds the text")
            yield value


def _encoded(docs: Iterator[str | np.ndarray], tok: Any, eos_id: int | None, batch: int = 1024) -> Iterator[np.ndarray]:
    """Each document's ids followed by `eos_id` (int64; None: nothing appended), texts encoded `batch`
    documents at a time, token-id documents as they are."""
    end = [] if eos_id is None else [eos_id]
    chunk: list[str] = []

    def flush() -> Iterator[np.ndarray]:
        yield from (np.asarray(enc.ids + end, np.int64) for enc in tok.encode_batch(chunk, add_special_tokens=False))
        chunk.clear()

    for doc in docs:
        if isinstance(doc, str):
            chunk.append(doc)
            if len(chunk) >= batch:
                yield from flush()
            continue
        if chunk:
            yield from flush()
        yield np.concatenate([doc, np.asarray(end, np.int64)])
    if chunk:
        yield from flush()


def tokenize_documents(texts: Iterator[str], tok: Any, eos_id: int, batch: int = 1024) -> np.ndarray:
    """Documents' ids end to end, each followed by `eos_id`, as int32."""
    parts = [ids.astype(np.int32) for ids in _encoded(texts, tok, eos_id, batch)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


class TokenFile(NamedTuple):
    path: Path
    tokens: int
    documents: int
    dtype: str
    eos_id: int


def write_token_file(cfg: DataConfig, out: str | os.PathLike[str], dtype: str | None = None) -> TokenFile:
    """`zerojax tokenize`: the documents `cfg` names (`data.source: jsonl | file`, `data.path`,
    `data.tokenizer`, `data.text_key`, `data.eos_id`, `data.max_bytes`) tokenized once, exactly as a
    run tokenizes them at start-up, and written as a flat `data.source: tokens` file: documents
    streamed through in chunks (memory stays flat), written to a temporary name and renamed when
    complete. `dtype` (default: uint16 when every id of the tokenizer fits, else uint32)."""
    if cfg.source not in ("jsonl", "file"):
        raise ConfigError(f"data.source: tokenize reads a JSONL or text file (jsonl | file), not {cfg.source}")
    if cfg.tokenizer is None:
        raise ConfigError("data.tokenizer: tokenize needs a tokenizer.json")
    path = _need_file(cfg.path, "data.path", "a JSONL file" if cfg.source == "jsonl" else "a text file")
    tok = load_tokenizer(cfg.tokenizer, 1 << 32)
    size = tok.get_vocab_size(with_added_tokens=True)
    eos = _eos(cfg, tok, 1 << 32)
    dtype = dtype or ("uint16" if max(size, eos + 1) <= 1 << 16 else "uint32")
    if dtype not in _DTYPES:
        raise ConfigError(f"data.dtype: {dtype!r}; use uint16 or uint32")
    limit = np.iinfo(_DTYPES[dtype]).max
    if max(size - 1, eos) > limit:
        raise ConfigError(f"data.dtype: {dtype} holds ids up to {limit}, but the tokenizer {cfg.tokenizer} has "
                          f"{size} tokens; use uint32")
    target = Path(out)
    if target.exists() and target.is_dir():
        raise FileExistsError(f"tokenize: --out {target} is a folder; name the token file to write")
    tmp = target.with_name(target.name + ".partial")
    tokens = documents = 0
    try:
        with open(tmp, "wb") as f:
            for ids in _encoded(_documents(cfg, path), tok, eos):
                f.write(ids.astype(_DTYPES[dtype]).tobytes())
                tokens += len(ids)
                documents += 1
        if not tokens:
            raise ConfigError(f"data.path: {path} holds no documents to tokenize")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return TokenFile(target, tokens, documents, dtype, eos)


def read_token_file(cfg: DataConfig, vocab_size: int) -> np.ndarray:
    """The memory-mapped ids of a `data.source: tokens` file, checked against the model's vocabulary
    (one pass in chunks: memory stays flat whatever the file's size)."""
    path = _need_file(cfg.path, "data.path", f"a flat {cfg.dtype} token file (data.source: tokens)")
    fmt = binary_format(path)
    if fmt == "NumPy":
        tokens = _npy_ids(path)
    elif fmt is not None:
        raise _refuse_format(path, fmt)
    else:
        dtype = np.dtype(_DTYPES[cfg.dtype])
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise ConfigError(f"data.dtype: {path} has {size} bytes, not a whole number of {cfg.dtype} ids; "
                              f"set data.dtype to the type the file was written with")
        if size == 0:
            raise ConfigError(f"data.path: {path} is empty; give a token file with ids in it")
        tokens = np.memmap(path, dtype=dtype, mode="r")
    step = 1 << 24
    top = max(int(tokens[i:i + step].max()) for i in range(0, len(tokens), step))
    if tokens.dtype.kind == "i":
        low = min(int(tokens[i:i + step].min()) for i in range(0, len(tokens), step))
        if low < 0:
            raise ConfigError(f"data.path: {path} holds token id {low}; token ids are 0 or more")
    if top >= vocab_size:
        raise ConfigError(f"model.vocab_size: {path} holds token id {top}, which the model's {vocab_size} "
                          f"embeddings do not cover; set model.vocab_size: {top + 1} (or the tokenizer's size)")
    if cfg.eos_id is not None and cfg.eos_id >= vocab_size:
        raise ConfigError(f"data.eos_id: {cfg.eos_id} is not below model.vocab_size {vocab_size}")
    return tokens


def _npy_ids(path: Path) -> np.ndarray:
    """A .npy of token ids, memory-mapped in its own dtype: one 1-D integer array, documents end to end."""
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ConfigError(f"data.path: {path} is not a .npy file NumPy can read ({e}); give a 1-D integer array "
                          f"saved with np.save, or a flat .bin") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ConfigError(f"data.path: {path} holds a {tokens.ndim}-D {tokens.dtype} array of shape {tokens.shape}; "
                          f"a .npy token file is one 1-D integer array of token ids, documents end to end "
                          f"(np.save(path, ids.ravel()) when its rows are already packed)")
    if tokens.size == 0:
        raise ConfigError(f"data.path: {path} is empty; give a token file with ids in it")
    return tokens


def load_corpus(cfg: DataConfig, vocab_size: int, path: str | None = None, split: str | None = None,
                key: str = "data.path") -> Corpus:
    """The token stream `cfg` names, with every check that needs only the files (before compiling).
    `path` and `split` read another file or split the same way (the validation set); `key` is the key
    that named it, for the errors."""
    if path is not None:
        cfg = dataclasses.replace(cfg, path=path)
    if cfg.source == "tokens":
        return Corpus(read_token_file(cfg, vocab_size), cfg.eos_id, True)
    if cfg.tokenizer is None and cfg.tokens_key is None:
        if cfg.source in ("file", "stdlib"):  # bytes: a vocabulary below 256 is fine for text whose bytes it covers
            data = read_corpus(cfg)
            top = int(data.max(initial=0))
            if top >= vocab_size:  # an embedding lookup past the table gives NaN, not an error
                raise ConfigError(f"model.vocab_size: {vocab_size}, but the corpus holds byte value {top} "
                                  f"(without data.tokenizer the tokens are bytes); use a vocabulary of at least "
                                  f"{top + 1}, text whose bytes are below {vocab_size} (data.path), or give "
                                  f"data.tokenizer")
            return Corpus(data, None, False)
        raise ConfigError(f"data.tokenizer: the text of {cfg.path} (data.text_key: {cfg.text_key}) needs a tokenizer; "
                          f"give data.tokenizer (a tokenizer.json), a model.hf_checkpoint folder that holds its "
                          f"tokenizer.json, or data.tokens_key naming a field of token ids")
    where = Path(cfg.path or "")
    if cfg.source != "datasets":
        where = _need_file(cfg.path, key, {"jsonl": "a JSONL file", "parquet": "a Parquet file", "arrow":
                                            "an Arrow file"}.get(cfg.source, "a text file"))
    tok = load_tokenizer(cfg.tokenizer, vocab_size) if cfg.tokenizer else None
    eos = _eos(cfg, tok, vocab_size) if tok is not None or cfg.eos_id is not None else None
    if eos is not None and eos >= vocab_size:
        raise ConfigError(f"data.eos_id: {eos} is not below model.vocab_size {vocab_size}")
    docs = [ids for ids in _encoded(_documents(cfg, where, split), tok, eos) if len(ids)]
    if not docs:
        raise ConfigError(f"{key}: {where} holds no documents")
    lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
    tokens = np.concatenate(docs)
    top, low = int(tokens.max()), int(tokens.min())
    if low < 0:
        raise ConfigError(f"data.tokens_key: {where} holds token id {low}; token ids are 0 or more")
    if top >= vocab_size:
        raise ConfigError(f"model.vocab_size: {where} holds token id {top}, which the model's {vocab_size} "
                          f"embeddings do not cover; set model.vocab_size: {top + 1} (or the tokenizer's size)")
    return Corpus(tokens.astype(np.int32), eos, True, np.concatenate([[0], np.cumsum(lengths)]))


class PackedBatches(_BatchStream):
    """Global batches of `rows` windows of `seq_len + 1` tokens cut end to end from `tokens`.

    Window i is tokens[i*seq_len : (i+1)*seq_len + 1] (each token is a target once per epoch); the
    windows are visited in an order grain's MapDataset shuffles afresh every epoch, so batch `k`
    depends only on (seed, k): the same interface as `Batches`, so the loader, the evaluation and
    the resume logic take either. With an `eos_id`, `loss_mask` is 0 where the input is that id:
    the first token of a document is never predicted from the end of the previous one.
    """

    def __init__(self, tokens: np.ndarray, rows: int, seq_len: int, seed: int, eos_id: int | None = None,
                 position: int = 0, local: np.ndarray | None = None, mask_boundaries: bool = True):
        import grain
        self.tokens, self.rows, self.seq_len, self.seed = tokens, rows, seq_len, seed
        self.eos_id = eos_id if mask_boundaries else None
        self.position, self.local = position, local
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"PackedBatches: {len(tokens)} tokens hold no window of {seq_len + 1}")
        self.order = grain.MapDataset.range(self.windows).shuffle(seed=seed).repeat(None).batch(rows)

    def batch(self, index: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Global batch `index`, or only its `rows` (one process's share)."""
        picked = np.asarray(self.order[index], dtype=np.int64)
        if rows is not None:
            picked = picked[rows]
        windows = np.asarray(self.tokens[picked[:, None] * self.seq_len + np.arange(self.seq_len + 1)],
                             dtype=np.int32)
        out = {"tokens": windows}
        if self.eos_id is not None:
            out["loss_mask"] = (windows[:, :-1] != self.eos_id).astype(np.float32)
        return out


class PaddedBatches(_BatchStream):
    """Global batches of `rows` documents, one a row: each document's first `seq_len + 1` tokens (a
    longer one is cut there), then `pad_id` up to the row's end (`data.packing: pad`).

    The documents are visited in an order grain's MapDataset shuffles afresh every epoch, so batch `k`
    depends only on (seed, k), as with `PackedBatches`. `loss_mask` keeps exactly the predictions of
    a document's own next tokens: none from its last token, none in the padding.
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, rows: int, seq_len: int, seed: int, pad_id: int,
                 position: int = 0, local: np.ndarray | None = None):
        import grain
        self.tokens, self.offsets, self.rows, self.seq_len, self.seed = tokens, offsets, rows, seq_len, seed
        self.pad_id, self.position, self.local = pad_id, position, local
        self.windows = len(offsets) - 1  # rows an epoch: one a document
        if self.windows < 1:
            raise ValueError("PaddedBatches: no documents")
        self.order = grain.MapDataset.range(self.windows).shuffle(seed=seed).repeat(None).batch(rows)

    def batch(self, index: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Global batch `index`, or only its `rows` (one process's share)."""
        picked = np.asarray(self.order[index], dtype=np.int64)
        if rows is not None:
            picked = picked[rows]
        out = np.full((len(picked), self.seq_len + 1), self.pad_id, np.int32)
        mask = np.zeros((len(picked), self.seq_len), np.float32)
        for r, d in enumerate(picked):
            doc = self.tokens[self.offsets[d]:min(self.offsets[d + 1], self.offsets[d] + self.seq_len + 1)]
            out[r, :len(doc)] = doc
            mask[r, :len(doc) - 1] = 1.0
        return {"tokens": out, "loss_mask": mask}


BatchSource = Batches | PackedBatches | PaddedBatches


def _validation_corpus(cfg: DataConfig, vocab_size: int) -> Corpus | None:
    """The validation set named apart from the training data (`data.val_path`, `data.val_split`, or a
    DatasetDict's `validation` split), or None: the end of the training data."""
    if cfg.val_path is not None:
        if cfg.source == "stdlib" or (cfg.source == "file" and cfg.tokenizer is None):
            raise ConfigError("data.val_path: a separate validation file is read as documents (jsonl, parquet, arrow, "
                              "datasets, tokens, or a text file with data.tokenizer); unset it to validate on the "
                              "last data.val_fraction of the corpus")
        return load_corpus(cfg, vocab_size, path=cfg.val_path, split=cfg.val_split, key="data.val_path")
    if cfg.source != "datasets":
        if cfg.val_split is not None:
            raise ConfigError(f"data.val_split: {cfg.val_split!r} names a split of a datasets folder, but data.source is "
                              f"{cfg.source}; give the validation file as data.val_path, or unset data.val_split")
        return None
    splits = tables.dataset_splits(Path(cfg.path or ""))
    split = cfg.val_split or ("validation" if splits and "validation" in splits and cfg.split != "validation" else None)
    if split is None:
        return None
    if splits is None or split not in splits:
        raise ConfigError(f"data.val_split: {cfg.path} holds {'the splits ' + ', '.join(splits) if splits else 'one Dataset, no splits'}, "
                          f"not {split!r}; set data.val_split to one of them, or unset it to validate on the last "
                          f"data.val_fraction of data.split")
    return load_corpus(cfg, vocab_size, split=split)


def _cut(corpus: Corpus, fraction: float, by_document: bool) -> tuple[Corpus, Corpus]:
    """The corpus less its last `fraction` (of documents, or of tokens), and that last part."""
    if not by_document:
        cut = int(len(corpus.tokens) * (1 - fraction))
        return corpus._replace(tokens=corpus.tokens[:cut]), corpus._replace(tokens=corpus.tokens[cut:])
    offsets = corpus.offsets
    docs = len(offsets) - 1
    keep = min(max(int(round(docs * (1 - fraction))), 1), docs - 1) if docs > 1 else docs
    at = int(offsets[keep])
    return (corpus._replace(tokens=corpus.tokens[:at], offsets=offsets[:keep + 1]),
            corpus._replace(tokens=corpus.tokens[at:], offsets=offsets[keep:] - at))


def make_batches(cfg: DataConfig, rows: int, seq_len: int, vocab_size: int,
                 local: np.ndarray | None = None) -> tuple[BatchSource, BatchSource]:
    """Train and validation batch sources for a run (this process building its `local` rows).

    Raises ConfigError, before anything is compiled, for a missing file or column, a tokenizer or token
    ids beyond the model's vocabulary, or a corpus that does not hold one training batch.
    """
    corpus = load_corpus(cfg, vocab_size)
    if not corpus.packed:
        split = split_corpus(corpus.tokens, cfg.val_fraction, seq_len, cfg.max_bytes)
        return (Batches(split.train, rows, seq_len, cfg.seed, local=local),
                Batches(split.val, rows, seq_len, cfg.seed + 1, local=local))
    pad = cfg.packing == "pad"
    if pad and corpus.offsets is None:
        raise ConfigError(f"data.packing: pad gives each document its own row, but a data.source: tokens file is one "
                          f"stream of ids with no document starts; use data.packing: pack, or give the documents as "
                          f"JSONL, Parquet, Arrow or a datasets folder")
    val = _validation_corpus(cfg, vocab_size)
    named = "data.val_path" if cfg.val_path else "data.val_split"
    train, val = _cut(corpus, cfg.val_fraction, pad) if val is None else (corpus, val)
    if pad:
        if train.offsets is None or len(train.offsets) - 1 < rows:
            have = 0 if train.offsets is None else len(train.offsets) - 1
            raise ConfigError(f"data.path: {cfg.path} gives {have} training document(s), fewer than one batch of "
                              f"{rows} rows (data.packing: pad puts one document in a row); use more data or a "
                              f"smaller batch")
        if len(val.offsets) - 1 < 1:
            raise ConfigError("data.val_fraction: no document is left for validation; raise data.val_fraction, "
                              "use more data, or name a validation set (data.val_path)")
        pad_id = cfg.pad_id if cfg.pad_id is not None else (corpus.eos_id if corpus.eos_id is not None else 0)
        if pad_id >= vocab_size:
            raise ConfigError(f"data.pad_id: {pad_id} is not below model.vocab_size {vocab_size}")
        return (PaddedBatches(train.tokens, train.offsets, rows, seq_len, cfg.seed, pad_id, local=local),
                PaddedBatches(val.tokens, val.offsets, rows, seq_len, cfg.seed + 1, pad_id, local=local))
    have = (len(train.tokens) - 1) // seq_len
    if have < rows:
        raise ConfigError(f"data.path: {cfg.path} gives {len(corpus.tokens)} tokens, {len(train.tokens)} for training: "
                          f"{max(have, 0)} window(s) of model.seq_len + 1 = {seq_len + 1}, fewer than one batch "
                          f"of {rows} rows; use more data, lower model.seq_len or the batch size, or "
                          f"data.packing: pad (one document a row)")
    if (len(val.tokens) - 1) // seq_len < 1:
        if train is corpus:  # a validation set named apart
            raise ConfigError(f"{named}: the validation set has {len(val.tokens)} tokens, fewer than one window of "
                              f"model.seq_len + 1 = {seq_len + 1}; use a longer validation set or lower model.seq_len")
        raise ConfigError(f"data.val_fraction: the validation part of {cfg.path} has {len(val.tokens)} tokens, "
                          f"fewer than one window of {seq_len + 1}; raise data.val_fraction or use more data")
    kw = dict(eos_id=corpus.eos_id, local=local, mask_boundaries=cfg.mask_boundaries)
    return (PackedBatches(train.tokens, rows, seq_len, cfg.seed, **kw),
            PackedBatches(val.tokens, rows, seq_len, cfg.seed + 1, **kw))


# ---------------------------------------------------------------------------------------------
# The grain pipeline.

class Loader:
    """`source`'s batches through grain, built up to `depth` ahead in a background thread.

    A grain MapDataset maps batch index k to `source.batch(k, source.local)`; its iterator prefetches
    in order, raises a batch's error at that batch, and its state counts the batches handed out
    (never those merely built ahead), so `state()` is what a checkpoint saves and `Loader(source,
    state=...)` continues with exactly the batch that was next. `depth=0` builds each batch on the
    caller's thread. `close()` (or leaving the `with` block) stops the thread.

    The first batch is built on the caller's thread and the pipeline (grain's import, its thread)
    starts at the second: a run's first step waits for one batch, not for the pipeline, and asks for
    its second batch while that step runs (on a device apart from the host, that hides the start).
    """

    def __init__(self, source: BatchSource, depth: int = 2, state: dict[str, Any] | None = None,
                 start: int | None = None):
        if depth < 0:
            raise ValueError(f"Loader: depth must be >= 0, got {depth}")
        self.source, self.depth = source, depth
        if state is None:
            state = {"next_index": source.position if start is None else start}
        self._state = dict(state)  # until the pipeline starts: the state it starts from
        self._it: Any = None  # grain's iterator, from the second batch on
        self._took_first = False

    def _batch(self, k: int) -> dict[str, np.ndarray]:
        """Batch `k`, this process's rows of it."""
        return self.source.batch(k, self.source.local)

    def _pipeline(self) -> Any:
        import grain
        dataset = grain.MapDataset.range(1 << 62).map(self._batch)
        options = grain.ReadOptions(num_threads=1 if self.depth else 0, prefetch_buffer_size=self.depth)
        it = iter(dataset.to_iter_dataset(options))
        it.set_state(dict(self._state))
        return it

    def state(self) -> dict[str, Any]:
        """The iterator's checkpointable state (JSON): where the next batch comes from."""
        return dict(self._state) if self._it is None else dict(self._it.get_state())

    @property
    def position(self) -> int:
        """Batches handed out from the start of the run: the next batch's index."""
        return int(self.state()["next_index"])

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._it is None and not self._took_first and self._state.keys() == {"next_index"}:
            k = int(self._state["next_index"])
            batch = self._batch(k)
            self._state["next_index"], self._took_first = k + 1, True
            return batch
        if self._it is None:
            self._it = self._pipeline()
        return next(self._it)

    def close(self) -> None:
        """Stop the background thread: the batch it is building finishes, no thread outlives this."""
        executor = getattr(self._it, "_executor", None)  # grain's prefetch pool (closing does not wait)
        close = getattr(self._it, "close", None)
        if close is not None:
            close()
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
