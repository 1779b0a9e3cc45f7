"""Your own data: token files, JSONL/text through a tokenizer.json, packing, the grain loader and resume."""
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zerojax
from zerojax.config import load_config
from zerojax.runtime.data import Loader, PackedBatches, load_corpus, make_batches
from zerojax.errors import ConfigError

EOS = "<|endoftext|>"
DOCS = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(5 + i % 9)) for i in range(300)]


def make_tokenizer(path: Path, docs: list[str] = DOCS, vocab: int = 120) -> Path:
    """A small word-level BPE tokenizer trained here with the library's own trainer (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", EOS]))
    tok.save(str(path))
    return path


def write_jsonl(path: Path, docs: list[str] = DOCS, key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def data_config(**data: Any) -> Any:
    return load_config({"train_batch_size": 8, "data": data}).data


def test_token_file_is_memory_mapped_and_packed(tmp_path) -> None:
    ids = np.arange(1000, dtype=np.uint16)
    ids[::37] = 999  # the end-of-document id
    path = tmp_path / "train.bin"
    ids.tofile(path)
    cfg = load_config({"train_batch_size": 8, "data": {"path": str(path), "eos_id": 999}}).data
    assert cfg.source == "tokens"  # derived from the .bin suffix
    corpus = load_corpus(cfg, vocab_size=1000)
    assert isinstance(corpus.tokens, np.memmap) and corpus.packed and corpus.eos_id == 999
    train, val = make_batches(cfg, rows=8, seq_len=16, vocab_size=1000)
    seen = []
    for k in range(train.windows // 8):  # one epoch: every window once
        b = train.batch(k)
        assert b["tokens"].shape == (8, 17) and b["tokens"].dtype == np.int32
        for row, mask in zip(b["tokens"], b["loss_mask"]):
            start = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(ids, 17) == row, axis=1))[0])
            assert start % 16 == 0  # windows are cut end to end, one token of overlap
            seen.append(start // 16)
            np.testing.assert_array_equal(mask, (row[:-1] != 999).astype(np.float32))
    assert len(set(seen)) == len(seen)  # an epoch visits each window once
    assert train.batch(0)["tokens"].tolist() != train.batch(train.windows // 8)["tokens"].tolist()  # reshuffled
    assert val.tokens[0] == ids[int(len(ids) * 0.95)]  # validation is the end of the stream


def test_token_file_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"data.path: .*missing.bin is not a file"):
        make_batches(data_config(path=str(tmp_path / "missing.bin")), 8, 16, 256)
    path = tmp_path / "big.bin"
    np.array([1, 2, 70000, 3] * 100, dtype=np.uint32).tofile(path)
    with pytest.raises(ConfigError, match="model.vocab_size: .* holds token id 70000.*set model.vocab_size: 70001"):
        make_batches(data_config(path=str(path), dtype="uint32"), 8, 16, 50257)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="data.dtype"):
        make_batches(data_config(path=str(odd)), 8, 16, 256)
    short = tmp_path / "short.bin"
    np.arange(100, dtype=np.uint16).tofile(short)
    with pytest.raises(ConfigError, match="fewer than one batch of 8 rows"):
        make_batches(data_config(path=str(short)), 8, 16, 256)


def test_jsonl_through_a_tokenizer(tmp_path) -> None:
    tok_path = make_tokenizer(tmp_path / "tokenizer.json")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id(EOS)
    cfg = data_config(path=str(write_jsonl(tmp_path / "docs.jsonl")), tokenizer=str(tok_path))
    assert cfg.source == "jsonl"
    corpus = load_corpus(cfg, vocab_size=128)
    assert corpus.eos_id == eos
    want = np.concatenate([tok.encode(d, add_special_tokens=False).ids + [eos] for d in DOCS])
    np.testing.assert_array_equal(corpus.tokens, want)
    # the documents come back out of the stream between the separators
    docs = np.split(corpus.tokens, np.flatnonzero(corpus.tokens == eos) + 1)[:-1]
    assert tok.decode(docs[3][:-1].tolist()) == tok.decode(tok.encode(DOCS[3]).ids)
    train, _ = make_batches(cfg, rows=8, seq_len=16, vocab_size=128)
    b = train.batch(0)
    assert (b["loss_mask"] == 0).any() and np.array_equal(b["loss_mask"] == 0, b["tokens"][:, :-1] == eos)
    # a text file through the same tokenizer: one document
    text = tmp_path / "a.txt"
    text.write_text(" ".join(DOCS))
    tcorpus = load_corpus(data_config(path=str(text), tokenizer=str(tok_path)), vocab_size=128)
    assert tcorpus.packed and tcorpus.tokens[-1] == eos and (tcorpus.tokens == eos).sum() == 1


def test_tokenizer_errors(tmp_path) -> None:
    tok_path = make_tokenizer(tmp_path / "tokenizer.json")
    docs = write_jsonl(tmp_path / "docs.jsonl")
    with pytest.raises(ConfigError, match=r"data.tokenizer: .* has 120 tokens but model.vocab_size is 64; "
                                          r"set model.vocab_size: 120"):
        load_corpus(data_config(path=str(docs), tokenizer=str(tok_path)), vocab_size=64)
    with pytest.raises(ConfigError, match="data.tokenizer: .*nope.json is not a file"):
        load_corpus(data_config(path=str(docs), tokenizer=str(tmp_path / "nope.json")), vocab_size=128)
    with pytest.raises(ConfigError, match="data.tokenizer: data.source: jsonl needs a tokenizer"):
        data_config(path=str(docs))
    with pytest.raises(ConfigError, match="data.text_key: line 1 .* has no text field 'body'"):
        load_corpus(data_config(path=str(docs), tokenizer=str(tok_path), text_key="body"), vocab_size=128)
    few = write_jsonl(tmp_path / "few.jsonl", DOCS[:3])
    with pytest.raises(ConfigError, match="fewer than one batch"):
        make_batches(data_config(path=str(few), tokenizer=str(tok_path)), 8, 16, 128)


def test_loader_resumes_from_its_state_and_counts_only_taken_batches(tmp_path) -> None:
    ids = np.random.default_rng(0).integers(0, 300, 20_000).astype(np.uint16)
    source = PackedBatches(ids, rows=8, seq_len=16, seed=5, eos_id=7)
    with Loader(source, depth=3) as whole:
        want = [next(whole) for _ in range(10)]
        assert any(t.name.startswith("grain-") for t in threading.enumerate())  # built in the background
    assert not [t for t in threading.enumerate() if t.name.startswith("grain-") and t.is_alive()]
    with Loader(source, depth=3) as first:
        for _ in range(4):
            next(first)
        state = first.state()
    assert state == {"next_index": 4} and json.loads(json.dumps(state)) == state  # taken, not built ahead
    with Loader(source, depth=2, state=state) as resumed:
        got = [next(resumed) for _ in range(6)]
    for a, b in zip(want[4:], got):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
    # the first batch comes from the caller's thread; the pipeline starts at the second
    with Loader(source, depth=2, state={"next_index": 3}) as late:
        np.testing.assert_array_equal(next(late)["tokens"], want[3]["tokens"])
        assert not [t for t in threading.enumerate() if t.name.startswith("grain-") and t.is_alive()]
        assert late.state() == {"next_index": 4}
        np.testing.assert_array_equal(next(late)["tokens"], want[4]["tokens"])
        assert any(t.name.startswith("grain-") for t in threading.enumerate())
        assert late.state() == {"next_index": 5}
    # two processes that each build their half hold exactly the batch one process builds
    halves = [PackedBatches(ids, 8, 16, 5, eos_id=7, local=np.arange(4) + 4 * p) for p in range(2)]
    loaders = [Loader(h, depth=0) for h in halves]
    for k in range(3):
        np.testing.assert_array_equal(np.concatenate([next(x)["tokens"] for x in loaders]), want[k]["tokens"])


SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.seq_len=16", "run.eval_batches=1",
         "run.progress=false", "run.log_every=1", "steps_per_print=1", "scheduler.params.total_num_steps=6",
         "scheduler.params.warmup_num_steps=1"]


def test_training_on_jsonl_resumes_with_the_same_batches(tmp_path, monkeypatch) -> None:
    """Train 6 steps; train 3, stop, resume to 6: steps 4-6 see exactly the same tokens, same losses."""
    from zerojax.engine.engine import Engine
    from zerojax.app.trainer import train

    tok = make_tokenizer(tmp_path / "tokenizer.json")
    docs = write_jsonl(tmp_path / "docs.jsonl")
    seen: list[np.ndarray] = []
    real = Engine.train_batch
    monkeypatch.setattr(Engine, "train_batch", lambda self, batch: (seen.append(batch["tokens"].copy()),
                                                                    real(self, batch))[1])
    data = [f"data.path={docs}", f"data.tokenizer={tok}", "model.vocab_size=128"]

    def run(name: str, steps: int, resume: str | None = None) -> dict[str, Any]:
        cfg = zerojax.load_config("configs/zero3.yaml", [*SMALL, *data, f"run.steps={steps}",
                                                         f"run.output_dir={tmp_path / name}"])
        return train(cfg, resume=resume)

    whole = run("whole", 6)
    straight = list(seen)
    seen.clear()
    run("parted", 3)
    meta = json.loads((tmp_path / "parted" / "checkpoints" / "global_step3" / "meta.json").read_text())
    assert meta["extra"]["data_state"] == {"next_index": 3} and meta["extra"]["data_position"] == 3
    seen.clear()
    resumed = run("parted", 6, resume="latest")
    assert len(seen) == 3
    for a, b in zip(straight[3:], seen):
        np.testing.assert_array_equal(a, b)
    rows = [json.loads(r) for r in (tmp_path / "parted" / "metrics.jsonl").read_text().splitlines()]
    full = [json.loads(r) for r in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows if r["step"] > 3] == [r["loss"] for r in full if r["step"] > 3]
    assert resumed["val_loss"] == whole["val_loss"]


def test_loss_skips_masked_predictions() -> None:
    """The GPT's loss is the mean over the predictions loss_mask keeps, not over all of them."""
    import jax
    import optax
    from zerojax.config import ModelConfig
    from zerojax.models import gpt
    cfg = ModelConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    params = gpt.init_params(cfg, 0)
    tokens = np.random.default_rng(0).integers(0, 64, (2, 9)).astype(np.int32)
    tokens[0, 3] = 63
    mask = (tokens[:, :-1] != 63).astype(np.float32)
    per_token = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
        gpt.apply(cfg, params, tokens[:, :-1]), tokens[:, 1:]))
    loss = gpt.make_loss_fn(cfg)
    got = float(jax.jit(loss)(params, {"tokens": tokens, "loss_mask": mask}))
    np.testing.assert_allclose(got, per_token[mask > 0].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(loss(params, {"tokens": tokens})), per_token.mean(), rtol=1e-6)
    assert abs(per_token[mask > 0].mean() - per_token.mean()) > 1e-4  # the masked term mattered


def test_tokenize_command_writes_the_token_file_a_jsonl_run_would_build(tmp_path, capsys) -> None:
    """`zerojax tokenize` once, then `data.source: tokens`: the same train and validation batches (ids
    and loss masks) as tokenizing the JSONL at start-up."""
    from zerojax.app.cli import main
    tok = make_tokenizer(tmp_path / "tokenizer.json")
    docs = write_jsonl(tmp_path / "docs.jsonl")
    out = tmp_path / "train.bin"
    assert main(["tokenize", str(docs), "--tokenizer", str(tok), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    eos = json.loads(tok.read_text())["model"]["vocab"][EOS]
    assert "(uint16)" in said and f"data.eos_id={eos}" in said and "300 documents" in said
    ids = np.fromfile(out, np.uint16)
    assert (ids == eos).sum() == len(DOCS) and ids[-1] == eos

    from_jsonl = make_batches(data_config(path=str(docs), tokenizer=str(tok)), 8, 16, 128)
    from_file = make_batches(data_config(source="tokens", path=str(out), dtype="uint16", eos_id=eos), 8, 16, 128)
    for a, b in zip(from_jsonl, from_file):
        assert a.windows == b.windows
        for k in (0, 1, 7, a.windows // 8 + 3):  # into the second epoch
            x, y = a.batch(k), b.batch(k)
            assert x.keys() == y.keys() == {"tokens", "loss_mask"}
            for key in x:
                np.testing.assert_array_equal(x[key], y[key])

    assert main(["tokenize", str(docs), "--tokenizer", str(tok), "--out", str(out)]) == 2  # never overwritten
    assert "--force" in capsys.readouterr().err
    assert main(["tokenize", str(docs), "--tokenizer", str(tok), "--out", str(out), "--force", "--dtype",
                 "uint32"]) == 0
    np.testing.assert_array_equal(np.fromfile(out, np.uint32), ids)
    assert main(["tokenize", str(tmp_path / "missing.jsonl"), "--tokenizer", str(tok), "--out",
                 str(tmp_path / "x.bin")]) == 2
    assert "data.path" in capsys.readouterr().err and not (tmp_path / "x.bin").exists()

    text = tmp_path / "book.txt"  # a text file is one document, read whole (no data.max_bytes cut)
    text.write_text("\n".join(DOCS) * 300)
    assert text.stat().st_size > 4_000_000  # past data.max_bytes' default
    assert main(["tokenize", str(text), "--tokenizer", str(tok), "--out", str(tmp_path / "book.bin")]) == 0
    from tokenizers import Tokenizer
    want = Tokenizer.from_file(str(tok)).encode(text.read_text(), add_special_tokens=False).ids + [eos]
    np.testing.assert_array_equal(np.fromfile(tmp_path / "book.bin", np.uint16), want)


# ---------------------------------------------------------------------------------------------
# Files that are not text, given as text: refused by what they hold, whatever their name.

def _binary_files(tmp_path: Path) -> dict[str, bytes]:
    """Each container format's bytes, made as its writer lays them out (Parquet and Arrow IPC files:
    their magic at both ends around the data, per the two formats' specifications)."""
    import gzip
    import io
    import zipfile
    npy = io.BytesIO()
    np.save(npy, np.arange(300, dtype=np.int32))
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("docs.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in DOCS[:20]))
    return {"Parquet": b"PAR1" + bytes(range(40)) + b"\x15\x00\x00\x00PAR1",
            "Arrow": b"ARROW1\x00\x00" + b"\xff\xff\xff\xff" + bytes(64) + b"\x40\x00\x00\x00ARROW1",
            "NumPy": npy.getvalue(), "zip": archive.getvalue(),
            "gzip": gzip.compress(" ".join(DOCS).encode())}


@pytest.mark.parametrize("fmt", ["Parquet", "Arrow", "NumPy", "zip", "gzip"])
def test_a_binary_file_renamed_as_text_is_refused_naming_its_format(tmp_path, fmt: str) -> None:
    """Read as text it trained on its bytes (no error); now its first bytes name what it is, with
    or without a tokenizer, JSONL or text, and the message says what to give instead."""
    blob = _binary_files(tmp_path)[fmt]
    tok = make_tokenizer(tmp_path / "tokenizer.json")
    for name, extra in (("corpus.txt", {}), ("corpus.txt", {"tokenizer": str(tok)}),
                        ("docs.jsonl", {"tokenizer": str(tok)})):
        path = tmp_path / name
        path.write_bytes(blob * 40)  # long enough to hold batches when read as bytes
        with pytest.raises(ConfigError, match=rf"data.path: .*{name} is an? {fmt} file.*not text.*JSONL"):
            make_batches(data_config(path=str(path), **extra), 8, 16, 256)


def test_binary_formats_are_refused_by_their_extension_too(tmp_path) -> None:
    """An Arrow IPC stream has no magic at its start; its name says it is not text."""
    path = tmp_path / "train.arrows"
    path.write_bytes(b"\xff\xff\xff\xff\x10\x00\x00\x00" + bytes(range(200)) * 20)
    with pytest.raises(ConfigError, match=r"data.path: .*train.arrows is an Arrow file.*zerojax tokenize"):
        make_batches(data_config(path=str(path)), 8, 16, 256)
    parquet = tmp_path / "train.parquet"
    parquet.write_bytes(_binary_files(tmp_path)["Parquet"] * 40)
    with pytest.raises(ConfigError, match=r"data.path: .*train.parquet is a Parquet file"):
        make_batches(data_config(path=str(parquet), source="tokens"), 8, 16, 256)  # not token ids either


def test_text_that_is_not_utf8_is_refused_naming_where(tmp_path) -> None:
    """NUL bytes, UTF-16 and Latin-1 trained as bytes (or had bad bytes silently replaced in JSONL)."""
    tok = make_tokenizer(tmp_path / "tokenizer.json")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(("word " * 50).encode() + "caf\xe9 ".encode("latin-1") * 400)
    with pytest.raises(ConfigError, match=r"data.path: .*latin.txt is not UTF-8 text: byte 253 .*0xe9.*iconv"):
        make_batches(data_config(path=str(latin)), 8, 16, 256)
    nul = tmp_path / "nul.txt"
    nul.write_bytes((b"some text\x00\x00\x01" * 300))
    with pytest.raises(ConfigError, match=r"data.path: .*nul.txt holds NUL bytes .*byte 9.*binary"):
        make_batches(data_config(path=str(nul)), 8, 16, 256)
    wide = tmp_path / "wide.txt"
    wide.write_bytes(" ".join(DOCS).encode("utf-16"))
    with pytest.raises(ConfigError, match=r"data.path: .*wide.txt is UTF-16 text.*UTF-8"):
        make_batches(data_config(path=str(wide), tokenizer=str(tok)), 8, 16, 128)
    docs = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d}).encode() for d in DOCS]
    bad = b'{"text": "caf\xe9"}'
    docs.write_bytes(b"\n".join(lines[:200] + [bad] + lines[201:]) + b"\n")  # in the first 64 KiB
    with pytest.raises(ConfigError, match=r"data.path: .*docs.jsonl is not UTF-8 text: byte \d+ \(line 201: 0xe9\)"):
        load_corpus(data_config(path=str(docs), tokenizer=str(tok)), vocab_size=128)
    docs.write_bytes(b"\n".join(lines * 30 + [bad]) + b"\n")  # past them: found as it is read
    with pytest.raises(ConfigError, match=r"data.path: .*docs.jsonl line 9001 is not UTF-8 text: .*0xe9"):
        load_corpus(data_config(path=str(docs), tokenizer=str(tok)), vocab_size=128)


def test_a_npy_of_token_ids_is_read_as_token_ids(tmp_path) -> None:
    """np.save(ids) trained as the bytes of its header and array; it is now the token file it is:
    memory-mapped, its own dtype, the same batches as the flat .bin of the same ids."""
    ids = np.random.default_rng(0).integers(0, 1000, 3000).astype(np.int32)
    ids[::41] = 999
    np.save(tmp_path / "train.npy", ids)
    ids.astype(np.uint16).tofile(tmp_path / "train.bin")
    cfg = data_config(path=str(tmp_path / "train.npy"), eos_id=999)
    assert cfg.source == "tokens"  # derived from the .npy suffix
    corpus = load_corpus(cfg, vocab_size=1000)
    assert isinstance(corpus.tokens, np.memmap) and corpus.tokens.dtype == np.int32
    np.testing.assert_array_equal(corpus.tokens, ids)
    from_npy = make_batches(cfg, 8, 16, 1000)
    from_bin = make_batches(data_config(path=str(tmp_path / "train.bin"), eos_id=999), 8, 16, 1000)
    for a, b in zip(from_npy, from_bin):
        for k in (0, 3):
            for key in ("tokens", "loss_mask"):
                np.testing.assert_array_equal(a.batch(k)[key], b.batch(k)[key])
    renamed = tmp_path / "ids.dat"  # any name: data.source: tokens with .npy content reads its header
    renamed.write_bytes((tmp_path / "train.npy").read_bytes())
    np.testing.assert_array_equal(load_corpus(data_config(path=str(renamed), source="tokens"), 1000).tokens, ids)
    with pytest.raises(ConfigError, match=r"data.path: .*train.npy is a NumPy file, not text.*data.source: tokens"):
        load_corpus(data_config(path=str(tmp_path / "train.npy"), source="file"), 1000)
    for name, bad, why in (("rows.npy", ids.reshape(30, 100), r"2-D int32 array of shape \(30, 100\)"),
                           ("floats.npy", ids.astype(np.float32), "1-D float32 array"),
                           ("negative.npy", ids - 5, "token id -5")):
        np.save(tmp_path / name, bad)
        with pytest.raises(ConfigError, match=rf"data.path: .*{name} .*{why}"):
            load_corpus(data_config(path=str(tmp_path / name)), 1000)
    np.save(tmp_path / "big.npy", np.array([1, 2, 5000], np.int64))
    with pytest.raises(ConfigError, match="model.vocab_size: .* holds token id 5000"):
        load_corpus(data_config(path=str(tmp_path / "big.npy")), 1000)


def test_tokenize_refuses_a_binary_file(tmp_path, capsys) -> None:
    from zerojax.app.cli import main
    tok = make_tokenizer(tmp_path / "tokenizer.json")
    src = tmp_path / "docs.jsonl"
    src.write_bytes(_binary_files(tmp_path)["Parquet"])
    assert main(["tokenize", str(src), "--tokenizer", str(tok), "--out", str(tmp_path / "x.bin")]) == 2
    assert "is a Parquet file" in capsys.readouterr().err and not (tmp_path / "x.bin").exists()
