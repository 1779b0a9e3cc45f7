"""Saves still being written: one background commit per tag, finished before that folder is read and
at interpreter exit (before the thread pools orbax writes with are shut down).
"""
from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - see _finish_at_exit: its exit hook must be older than ours
import threading
from pathlib import Path
from typing import Any, Iterable


from zerojax.checkpoint.format import BEST, CheckpointError, META_FILE, best_tag, check_tag, is_complete, latest_tag, list_tags


class PendingSave:
    """A save whose arrays may still be being written.

    The tag becomes complete (checksums, meta.json, then `latest`, then retention) in a background
    thread once orbax has committed; training goes on meanwhile. `wait()` blocks until then and
    re-raises a failure. Every pending save is also finished at interpreter exit (before Python
    stops the thread pools orbax writes with), so a script that saves and ends keeps its checkpoint.
    `nonfinite` names the parameters that held NaN or inf (then the tag is not made `latest`).
    """

    def __init__(self, directory: Path, tag: str, work: Any = None, nonfinite: Iterable[str] = ()):
        self.directory, self.tag = directory, tag
        self.nonfinite = list(nonfinite)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if work is not None:
            self._thread = threading.Thread(target=self._run, args=(work,), name=f"zerojax-save-{tag}")
            self._thread.start()

    def _run(self, work: Any) -> None:
        try:
            work()
        except BaseException as e:  # surfaced by wait()
            self._error = e

    @property
    def path(self) -> Path:
        return self.directory / self.tag

    @property
    def finite(self) -> bool:
        return not self.nonfinite

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint save of {self.path} failed; the tag stays incomplete") from error

    def __repr__(self) -> str:
        return f"PendingSave({str(self.path)!r}, done={self.done()})"


_PENDING: dict[Path, PendingSave] = {}


_PENDING_LOCK = threading.Lock()


def track(root: Path, pending: PendingSave) -> None:
    """Remember this process's save into `root`, to be finished before the folder is read again."""
    with _PENDING_LOCK:
        _PENDING[root.resolve()] = pending


def wait_pending(root: Path) -> None:
    """Finish this process's in-flight save into `root` (one at a time keeps `latest` ordered)."""
    with _PENDING_LOCK:
        pending = _PENDING.pop(root.resolve(), None)
    if pending is not None:
        pending.wait()


def wait_all() -> None:
    """Finish every save this process has in flight (raises the first failure)."""
    with _PENDING_LOCK:
        pending = list(_PENDING.values())
        _PENDING.clear()
    errors = []
    for p in pending:
        try:
            p.wait()
        except RuntimeError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def _finish_at_exit() -> None:
    """Interpreter exit: complete pending saves while orbax's thread pools still accept work.

    Registered with threading's exit hooks, which run before concurrent.futures shuts its pools
    (hooks run in reverse order of registration) and long before `atexit`: by `atexit` time an
    unfinished orbax save can no longer be committed. concurrent.futures registers its hook when its
    thread module is first imported, which orbax may do only during a save, after this module: so
    this module imports it first, making that hook older than this one.
    """
    try:
        wait_all()
    except RuntimeError as e:
        import sys
        print(f"zerojax: {e}: {e.__cause__!r}", file=sys.stderr)


_RUNS: dict[Path, str] = {}


def run_of(root: Path) -> str:
    """The id of the run this process continues in `root`: the one of the tag it loaded from there,
    else a new one. Saves record it in meta.json; retention deletes only tags with this run's id."""
    import uuid
    with _PENDING_LOCK:
        return _RUNS.setdefault(root.resolve(), uuid.uuid4().hex)


def continue_run(root: Path, meta: dict) -> None:
    """A load from `root`: this process continues the run that saved that tag (a tag written
    before run ids existed leaves the id as it is)."""
    if isinstance(meta.get("run_id"), str):
        with _PENDING_LOCK:
            _RUNS[root.resolve()] = meta["run_id"]


def resolve_tag(root: Path, tag: str | None) -> Path:
    """The folder of a complete tag, or an error that names the path and what exists instead."""
    wait_pending(root)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    if tag is None:
        tag = latest_tag(root)
        if tag is None:
            raise FileNotFoundError(f"no complete checkpoint in {root} (no tag folder with {META_FILE})")
    elif tag == BEST and not is_complete(root / BEST):  # the pointer (a user's own tag "best" wins)
        tag = best_tag(root)
        if tag is None:
            raise FileNotFoundError(f"no best checkpoint in {root}: its .best pointer is written by a run that validates "
                                    f"(run.eval_every with run.save_best); complete tags: {list_tags(root) or 'none'}")
    tag_dir = root / check_tag(tag)
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"checkpoint {tag_dir} does not exist; complete tags in {root}: "
                                f"{list_tags(root) or 'none'}")
    if not is_complete(tag_dir):
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete (its save was interrupted: no "
                              f"{META_FILE}); use a complete tag: {list_tags(root) or 'none'}")
    return tag_dir


_register = getattr(threading, "_register_atexit", None)


if _register is not None:
    _register(_finish_at_exit)
else:  # pragma: no cover - every CPython zerojax supports has the hook
    import atexit
    atexit.register(_finish_at_exit)
