"""The embedded corpus and deterministic, resumable batches of byte windows.

The default corpus is the source of Python's standard library, read in sorted path order, so every
machine has the same bytes with nothing downloaded. Batch `k` depends only on (seed, k), so a run
resumes at any position by index alone.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from zerojax.config import DataConfig
from zerojax.errors import ConfigError


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


def split_corpus(tokens: np.ndarray, val_fraction: float, seq_len: int) -> Split:
    """The last `val_fraction` of the bytes is validation; both parts must hold a window."""
    cut = int(len(tokens) * (1 - val_fraction))
    train, val = tokens[:cut], tokens[cut:]
    for name, part in (("train", train), ("validation", val)):
        if len(part) <= seq_len + 1:
            raise ConfigError(f"data: the {name} split has {len(part)} bytes, fewer than model.seq_len + 2 "
                              f"= {seq_len + 2}; raise data.max_bytes or lower model.seq_len")
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
