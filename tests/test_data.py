"""The embedded corpus and the resumable batch stream."""
import threading
import time
import numpy as np
import pytest

from zerojax.config import DataConfig, load_config
from zerojax.runtime.data import Batches, Prefetch, read_corpus, split_corpus
from zerojax.errors import ConfigError


def test_stdlib_corpus_is_deterministic_text() -> None:
    cfg = DataConfig(max_bytes=100_000)
    a, b = read_corpus(cfg), read_corpus(cfg)
    assert len(a) == 100_000 and np.array_equal(a, b)
    assert b"def " in a.tobytes() and b"import" in a.tobytes()


def test_split_and_errors() -> None:
    tokens = np.arange(1000, dtype=np.uint8)
    s = split_corpus(tokens, 0.1, 16)
    assert len(s.train) == 900 and len(s.val) == 100
    with pytest.raises(ConfigError, match="raise data.max_bytes or lower model.seq_len"):
        split_corpus(tokens, 0.01, 64)


def test_batches_resume_by_position() -> None:
    tokens = read_corpus(DataConfig(max_bytes=50_000))
    stream = Batches(tokens, rows=8, seq_len=32, seed=3)
    first = [next(stream)["tokens"] for _ in range(5)]
    resumed = Batches(tokens, rows=8, seq_len=32, seed=3, position=3)
    np.testing.assert_array_equal(next(resumed)["tokens"], first[3])
    assert first[0].shape == (8, 33) and first[0].dtype == np.int32
    # windows are contiguous slices of the corpus
    row = first[0][0]
    start = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(tokens, 33) == row, axis=1))[0])
    np.testing.assert_array_equal(tokens[start:start + 33], row)


def test_file_source(tmp_path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"hello world " * 100)
    cfg = load_config({"train_batch_size": 8, "data": {"source": "file", "path": str(path)}})
    assert read_corpus(cfg.data).tobytes().startswith(b"hello world")
    missing = load_config({"train_batch_size": 8, "data": {"source": "file", "path": str(tmp_path / "x")}})
    with pytest.raises(ConfigError, match="data.path"):
        read_corpus(missing.data)


def test_each_process_builds_exactly_its_rows() -> None:
    """Two processes that each build their half reproduce the batch one process builds."""
    tokens = read_corpus(DataConfig(max_bytes=50_000))
    whole = Batches(tokens, rows=8, seq_len=16, seed=1)
    halves = [Batches(tokens, rows=8, seq_len=16, seed=1, local=np.arange(4) + 4 * p) for p in range(2)]
    for _ in range(3):
        want = next(whole)["tokens"]
        got = np.concatenate([next(h)["tokens"] for h in halves])
        np.testing.assert_array_equal(got, want)
    assert halves[0].position == whole.position == 3
    odd = Batches(tokens, rows=8, seq_len=16, seed=1).batch(5, np.array([1, 6]))["tokens"]
    np.testing.assert_array_equal(odd, whole.batch(5)["tokens"][[1, 6]])


def test_prefetch_hands_out_the_same_batches_and_counts_only_those_taken() -> None:
    """Built ahead in a thread, the stream is the plain one, and `position` (what a checkpoint saves)
    counts batches taken, not built: a stream resumed there continues with the next batch."""
    tokens = read_corpus(DataConfig(max_bytes=50_000))
    plain = [next(Batches(tokens, rows=8, seq_len=32, seed=3, position=i))["tokens"] for i in range(2, 8)]
    source = Batches(tokens, rows=8, seq_len=32, seed=3, position=2)
    with Prefetch(source, depth=2, start=source.position) as ahead:
        got = [next(ahead)["tokens"] for _ in range(3)]
        deadline = time.monotonic() + 10
        while source.position < 7 and time.monotonic() < deadline:  # the thread fills its queue
            time.sleep(0.01)
        assert source.position > ahead.position == 5  # built ahead, but only 3 taken from 2 on
    resumed = Batches(tokens, rows=8, seq_len=32, seed=3, position=ahead.position)
    got += [next(resumed)["tokens"] for _ in range(3)]
    for a, b in zip(got, plain):
        np.testing.assert_array_equal(a, b)


def test_prefetch_raises_the_producers_error_in_order_and_stops() -> None:
    def items():
        yield 1
        yield 2
        raise OSError("disk gone")

    ahead = Prefetch(items(), depth=2)
    assert [next(ahead), next(ahead)] == [1, 2]
    with pytest.raises(OSError, match="disk gone"):
        next(ahead)
    assert ahead.position == 2 and not ahead._thread.is_alive()
    with pytest.raises(StopIteration):
        next(ahead)
    assert list(Prefetch(iter(range(4)), depth=3)) == [0, 1, 2, 3]  # a finite source ends cleanly


def test_prefetch_close_stops_a_thread_blocked_on_a_full_queue() -> None:
    """Leaving the loop early (an error, an interrupt) must not leave a thread behind."""
    ahead = Prefetch(iter(range(10**9)), depth=2, name="test-prefetch")
    assert next(ahead) == 0
    time.sleep(0.2)  # the queue is full: the thread waits to put
    ahead.close()
    assert not ahead._thread.is_alive()
    assert not any(t.name == "test-prefetch" for t in threading.enumerate())
    assert list(Prefetch(iter("ab"), depth=0)) == ["a", "b"]  # depth 0: no thread
