"""ZeRO-Infinity's NVMe tier: optimizer state in files, streamed through a bounded set of host buffers.

DeepSpeed (`runtime/swap_tensor/`) keeps each sub-group's fp32 master copy and optimizer moments in
files under `nvme_path` and runs the CPU optimizer one sub-group at a time: the sub-group's arrays are
read into a pool of pinned buffers (`buffer_count` of them), updated, and written back; with
`pipeline_read` the next sub-group is read while this one computes, with `pipeline_write` the
previous one is still being written. Here the same schedule runs over *tiles*: `sub_group_size`
elements of one parameter shard, every state array of the tile (master, moments) in its own buffer.
A tile takes `arrays` buffers, so `buffer_count // arrays` tiles are in flight at once (a ring of
buffer sets): one computing, the next being read, earlier ones being written.

The I/O path is `os.preadv` / `os.pwritev` of whole tiles into preallocated numpy buffers, issued
from a thread pool of `aio.thread_count` threads (the calls release the GIL), not memory maps: a
mapped file's pages count in the process's resident set, preallocated buffers bound it.

The parameters' tier (`offload_param.device: nvme`, `core.param_swap`) uses the same files and stream:
one compute-dtype array per region, passes that only read (before a step) or only write (after it).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import shutil
import tempfile
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

SWAP_PREFIX = "zerojax-swap-"
OWNER = "owner"  # in each swap folder: "<host> <pid>" of the process working in it

log = logging.getLogger(__name__)


def _owner_gone(folder: Path) -> bool:
    """Whether `folder`'s owner file names a process of this host that no longer runs. A folder
    without one, of another host, or whose process may still run is never judged gone."""
    try:
        host, pid = (folder / OWNER).read_text().split()
        if host != socket.gethostname():
            return False
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):  # no or unreadable owner file, or a process we may not signal
        return False
    return False


def remove_abandoned(root: Path) -> list[Path]:
    """Remove the swap folders under `root` left by killed processes of this host (a SIGKILL skips
    every cleanup, and the folder is as large as the state it held). Only `zerojax-swap-*` folders
    whose owner file names a process that no longer exists are touched."""
    gone = [f for f in sorted(root.glob(SWAP_PREFIX + "*")) if f.is_dir() and _owner_gone(f)]
    for folder in gone:
        log.info("removing %s, the swap folder of a process that no longer runs", folder)
        shutil.rmtree(folder, ignore_errors=True)
    return gone


@dataclasses.dataclass(frozen=True)
class Swap:
    """How state is swapped to files (the planner's reading of `offload_optimizer` or `offload_param`, and `aio`)."""
    path: str                   # folder on the local disk; each engine works in a fresh subfolder of it
    buffer_count: int = 4       # host buffers of `tile` fp32 elements each
    tile: int = 1_000_000_000   # elements per tile (sub_group_size), capped at the largest shard
    read_ahead: bool = False    # pipeline_read: read the next tile while this one computes
    write_behind: bool = False  # pipeline_write: write a tile while the next ones compute
    threads: int = 1            # aio.thread_count: parallel reads and writes
    in_memory: int = 0          # parameters' max_in_cpu: elements per device kept in host memory, not in files

    def describe(self) -> str:
        pipe = [n for n, on in (("read ahead", self.read_ahead), ("write behind", self.write_behind)) if on]
        return (f"files under {self.path}, streamed through {self.buffer_count} host buffers"
                + (f" ({', '.join(pipe)})" if pipe else ""))


class Tile(NamedTuple):
    """A run of elements of one stored shard: `region` names the shard, [start, stop) its elements."""
    region: int
    start: int
    stop: int


class StreamStats(NamedTuple):
    """One streamed pass: how long the update waited on the disk, and the bytes it moved."""
    read_wait_s: float = 0.0
    write_wait_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0


class SwapFiles:
    """One file per state array (`names`), each the concatenation of `sizes` regions of `dtype` elements
    (fp32 for the optimizer's state, the compute dtype for parameters).

    The folder is a fresh `zerojax-swap-*` subfolder of `swap.path` (nothing already there is read or
    written) and is removed when the object is collected or the interpreter exits: the files are
    working state, checkpoints hold the run.
    """

    def __init__(self, swap: Swap, names: Sequence[str], sizes: Sequence[int], extra: int = 0,
                 dtype: Any = np.float32):
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        root = Path(swap.path)
        root.mkdir(parents=True, exist_ok=True)
        remove_abandoned(root)
        self.folder = Path(tempfile.mkdtemp(prefix=SWAP_PREFIX, dir=root))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, True)
        (self.folder / OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
        self.swap, self.names, self.sizes = swap, list(names), [int(n) for n in sizes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        total = int(self.offsets[-1])
        self._fds: list[int] = []
        self._close_fds = weakref.finalize(self, _close_all, self._fds)  # before rmtree, at collection too
        for name in self.names:
            suffix = "f32" if self.dtype == np.float32 else self.dtype.name
            fd = os.open(self.folder / f"{name}.{suffix}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._fds.append(fd)
            os.ftruncate(fd, total * self.itemsize)
        self.tile = max(1, min(swap.tile, max(self.sizes, default=1)))
        # buffers[s][a]: state array a of the tile in flight in set s; after the files' arrays, `extra`
        # buffers the caller fills itself (the gradient tile)
        self.sets = max(1, swap.buffer_count // (len(self.names) + extra))
        self.buffers = [[np.empty(self.tile, self.dtype) for _ in range(len(self.names) + extra)]
                        for _ in range(self.sets)]
        self._pool = ThreadPoolExecutor(max_workers=max(1, swap.threads), thread_name_prefix="zerojax-swap")
        weakref.finalize(self, self._pool.shutdown, True)
        self.last = StreamStats()  # the latest `stream`'s waits and bytes

    @property
    def buffer_bytes(self) -> int:
        """Host bytes of the buffer pool: the bound on what the swapped state occupies in memory."""
        return sum(b.nbytes for s in self.buffers for b in s)

    @property
    def file_bytes(self) -> int:
        return int(self.offsets[-1]) * self.itemsize * len(self.names)

    def tiles(self, region: int) -> list[Tile]:
        n = self.sizes[region]
        return [Tile(region, a, min(a + self.tile, n)) for a in range(0, n, self.tile)]

    # -- whole regions (initialisation, checkpoints) ----------------------------------------------
    def write_region(self, array: int, region: int, values: np.ndarray) -> None:
        flat = np.ascontiguousarray(values, self.dtype).reshape(-1)
        assert flat.size == self.sizes[region], (flat.size, self.sizes[region])
        _pwrite_all(self._fds[array], _bytes(flat), int(self.offsets[region]) * self.itemsize)

    def read_region(self, array: int, region: int) -> np.ndarray:
        out = np.empty(self.sizes[region], self.dtype)
        _pread_all(self._fds[array], _bytes(out), int(self.offsets[region]) * self.itemsize)
        return out

    def read_range(self, array: int, region: int, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) of one region (a layer of a stacked shard, read at use)."""
        return self.read_into(array, region, start, np.empty(stop - start, self.dtype))

    def read_into(self, array: int, region: int, start: int, out: np.ndarray) -> np.ndarray:
        """Elements [start, start + out.size) of one region into `out` (a preallocated buffer); `out`."""
        _pread_all(self._fds[array], _bytes(out), (int(self.offsets[region]) + start) * self.itemsize)
        return out

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """`fn(*args)` on the swap's I/O threads (`aio.thread_count`): reads issued ahead of use."""
        return self._pool.submit(fn, *args)

    # -- the streamed pass ------------------------------------------------------------------------
    def _io(self, fn: Callable[[int, memoryview, int], None], s: int, t: Tile) -> list[Future]:
        n = t.stop - t.start
        offset = (int(self.offsets[t.region]) + t.start) * self.itemsize
        return [self._pool.submit(fn, fd, _bytes(self.buffers[s][a][:n]), offset)
                for a, fd in enumerate(self._fds)]  # the files' arrays only, not the caller's extras

    def stream(self, tiles: Sequence[Tile], compute: Callable[[int, Tile, list[np.ndarray]], None], *,
               read: bool = True, write: bool = True) -> None:
        """Read each tile's arrays, `compute(i, tile, buffers)` them in place (each buffer `tile` long,
        the tile's elements first), and write them back. Reads run ahead and writes behind as `swap` allows and the buffer sets leave room: set
        `i % sets` holds tile i, so a set is read again only once its last write is done.
        `read=False`: `compute` fills the buffers (a pass that only writes, the parameters going out);
        `write=False`: the files keep their bytes (a pass that only reads, the parameters coming in)."""
        reads: dict[int, list[Future]] = {}
        writes: dict[int, list[Future]] = {}
        waited = {"read": 0.0, "write": 0.0}

        def wait(fs: list[Future], kind: str) -> None:
            t0 = time.perf_counter()
            for f in fs:
                f.result()
            waited[kind] += time.perf_counter() - t0

        def start_read(i: int) -> None:
            s = i % self.sets
            wait(writes.pop(s, []), "write")
            reads[i] = self._io(_pread_all, s, tiles[i]) if read else []

        for i, t in enumerate(tiles):
            if i not in reads:
                start_read(i)
            wait(reads.pop(i), "read")
            if self.swap.read_ahead and i + 1 < len(tiles) and (i + 1) % self.sets != i % self.sets:
                start_read(i + 1)
            s = i % self.sets
            compute(i, t, self.buffers[s])
            if not write:
                continue
            writes[s] = self._io(_pwrite_all, s, t)
            if not self.swap.write_behind:
                wait(writes.pop(s), "write")
        for fs in writes.values():
            wait(fs, "write")
        moved = sum(t.stop - t.start for t in tiles) * self.itemsize * len(self.names)
        self.last = StreamStats(read_wait_s=waited["read"], write_wait_s=waited["write"],
                                bytes_read=moved if read else 0, bytes_written=moved if write else 0)

    def close(self) -> None:
        """Close and remove the working files now (also done when the object is collected): a removed
        file still open would keep its disk space."""
        self._pool.shutdown(wait=True)
        self._close_fds()
        self._cleanup()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _bytes(array: np.ndarray) -> memoryview:
    """A contiguous array's bytes (through a uint8 view: bfloat16 has no buffer-protocol format)."""
    return memoryview(array.view(np.uint8))


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from `offset` (a read may return short: keep reading)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"swap file: short read at byte {offset + done}")
        done += got


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)

