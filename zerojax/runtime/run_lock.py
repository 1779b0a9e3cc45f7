"""An exclusive lock on a run folder, held for the run: two runs never write into one folder.

`fcntl.flock` on `<folder>/.zerojax.lock`: the kernel drops it when the holder exits, however it
exits, so a crashed run never blocks the next one; the file keeps the holder's process id, host and
start time, so a second run can name the first. A clean release empties the file: a lock file that
still names a holder when its lock is free was left by a process that was killed, and the next run
takes it over and says so. One process holds each folder's lock once (`holder_elsewhere` asks
without taking it), so the run's output and checkpoint folders may be the same folder.
"""
from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from zerojax.errors import ConfigError

__all__ = ["RunLock", "LOCK_FILE", "holder_elsewhere", "pid_alive"]

LOCK_FILE = ".zerojax.lock"


_HELD: dict[str, "RunLock"] = {}   # lock file (real path) -> this process's lock on it


def _key(path: Path) -> str:
    return os.path.realpath(path)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _left_by(text: str) -> str:
    """Why the lock a file still names is free: the holder is gone (this host) or no longer holds it."""
    words = text.split()
    here = socket.gethostname()
    if len(words) >= 4 and words[0] == "process" and words[1].isdigit() and words[3].rstrip(",") == here:
        pid = int(words[1])
        return "which is no longer running" if not pid_alive(pid) else "which no longer holds it"
    return "which no longer holds it"


class RunLock:
    """`RunLock(folder, key)` takes the lock or raises one ConfigError naming the holder; `release()`."""

    def __init__(self, folder: Path, key: str = "run.output_dir"):
        self.path = Path(folder) / LOCK_FILE
        self.key = key
        self.taken_over: str | None = None   # the holder a killed process left in the file, if any
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "a process that has not written its id yet"
            os.close(fd)
            raise ConfigError(f"{key}: {folder} is in use by another run ({holder}; lock {self.path}); wait for it "
                              f"to finish, or choose another folder (--set {key}=...)") from None
        previous = os.read(fd, 512).decode(errors="replace").strip()
        if previous:
            self.taken_over = previous
            print(f"zerojax: {key}: took over the lock {self.path} left by {previous}, {_left_by(previous)} "
                  f"(it ended without releasing it, e.g. killed)", file=sys.stderr, flush=True)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()}, started "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self._fd: int | None = fd
        _HELD[_key(self.path)] = self

    @classmethod
    def hold(cls, folder: Path, key: str = "run.output_dir") -> "RunLock":
        """This process's lock on `folder`: the one it holds already, or a new one."""
        return _HELD.get(_key(Path(folder) / LOCK_FILE)) or cls(folder, key)

    def release(self, remove: bool = False) -> None:
        """Let go: the file is emptied (a file that still names a holder marks a killed one), or
        removed with `remove`; a second call does nothing."""
        if self._fd is None:
            return
        _HELD.pop(_key(self.path), None)
        if remove:
            self.path.unlink(missing_ok=True)
        else:
            os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def holder_elsewhere(folder: Path) -> str | None:
    """Who holds `folder`'s lock, when another process does (None: free, or held by this process);
    asks without taking it."""
    path = Path(folder) / LOCK_FILE
    if _key(path) in _HELD or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.read(fd, 512).decode(errors="replace").strip() or "a process that has not written its id yet"
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops a shared lock taken here
    return None
