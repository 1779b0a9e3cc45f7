"""An exclusive lock on a run folder, held for the run: two runs never write into one folder.

`fcntl.flock` on `<folder>/.zerojax.lock`: the kernel drops it when the holder exits, however it
exits, so a crashed run leaves no stale lock; the file keeps the holder's process id, host and start
time, so a second run can name the first.
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from zerojax.errors import ConfigError

__all__ = ["RunLock", "LOCK_FILE"]

LOCK_FILE = ".zerojax.lock"


class RunLock:
    """`RunLock(folder, key)` takes the lock or raises one ConfigError naming the holder; `release()`."""

    def __init__(self, folder: Path, key: str = "run.output_dir"):
        self.path = Path(folder) / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "a process that has not written its id yet"
            os.close(fd)
            raise ConfigError(f"{key}: {folder} is in use by another run ({holder}); wait for it to finish, or "
                              f"choose another folder (--set {key}=...)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()}, started "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self._fd: int | None = fd

    def release(self, remove: bool = False) -> None:
        """Let go (the file stays, empty of meaning, unless `remove`); a second call does nothing."""
        if self._fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
