"""The embedded corpus and deterministic, resumable batches of byte windows.

The default corpus is the source of Python's standard library, read in sorted path order, so every
machine has the same bytes with nothing downloaded. Batch `k` depends only on (seed, k), so a run
resumes at any position by index alone.
"""
from __future__ import annotations

import os
import queue
import sysconfig
import threading
from pathlib import Path
from types import TracebackType
from typing import Generic, Iterator, NamedTuple, TypeVar

import numpy as np

from zerojax.config import DataConfig
from zerojax.errors import ConfigError

T = TypeVar("T")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_corpus(cfg: DataConfig) -> np.ndarray:
    """Up to `cfg.max_bytes` bytes of text as uint8."""
    if cfg.source == "file":
        path = Path(cfg.path or "")
        if not path.is_file():
            raise ConfigError(f"data.path: {path} is not a file; give a text file or use source: stdlib")
        with open(path, "rb") as f:
            return np.frombuffer(f.read(cfg.max_bytes), dtype=np.uint8)
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


class Batches:
    """Global batches of `rows` random windows of `seq_len + 1` bytes from `tokens`.

    `position` counts batches handed out, which is all a checkpoint needs to resume the stream.
    In a multi-process run each process iterates over its `local` rows only.
    """

    def __init__(self, tokens: np.ndarray, rows: int, seq_len: int, seed: int, position: int = 0,
                 local: np.ndarray | None = None):
        self.tokens, self.rows, self.seq_len, self.seed = tokens, rows, seq_len, seed
        self.position = position
        self.local = local  # the rows this process builds when iterating (None: all)

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

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = self.batch(self.position, self.local)
        self.position += 1
        return out


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
