"""Data as people have it: Parquet, Arrow and Hugging Face `datasets` folders (read with pyarrow alone),
a text or a token-id column, the model's own tokenizer.json, packed or padded rows, and resume.

The fixtures (tests/fixtures/data/make_data_fixtures.py) hold the same 48 documents as JSONL text, as a
Parquet and an Arrow table with a `text` and an `input_ids` column, and as a DatasetDict saved with
`save_to_disk` (40 train, 8 validation documents)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zerojax.config import load_config
from zerojax.errors import ConfigError
from zerojax.runtime.data import Loader, PackedBatches, PaddedBatches, load_corpus, make_batches

DATA = Path(__file__).resolve().parent / "fixtures" / "data"
TOKENIZER = str(DATA / "tokenizer.json")
QWEN3 = Path(__file__).resolve().parent / "fixtures" / "hf" / "qwen3"


def data_config(**data: Any) -> Any:
    return load_config({"train_batch_size": 8, "data": data}).data


def test_every_format_gives_the_same_packed_batches() -> None:
    """JSONL text, Parquet and Arrow text columns through the tokenizer, and their token-id columns as
    they are (with the same end-of-document id): the same ids, so the same batches and masks."""
    configs = {
        "jsonl": data_config(path=str(DATA / "finetune.jsonl"), tokenizer=TOKENIZER),
        "parquet text": data_config(path=str(DATA / "finetune.parquet"), tokenizer=TOKENIZER),
        "arrow text": data_config(path=str(DATA / "finetune.arrow"), tokenizer=TOKENIZER),
        "parquet ids": data_config(path=str(DATA / "finetune.parquet"), tokens_key="input_ids", eos_id=0),
        "arrow ids": data_config(path=str(DATA / "finetune.arrow"), tokens_key="input_ids", eos_id=0),
    }
    assert [c.source for c in configs.values()] == ["jsonl", "parquet", "arrow", "parquet", "arrow"]  # by name
    batches = {name: make_batches(cfg, rows=8, seq_len=16, vocab_size=128)[0] for name, cfg in configs.items()}
    reference = batches.pop("jsonl")
    assert isinstance(reference, PackedBatches) and reference.eos_id == 0  # the tokenizer's <|endoftext|>
    for name, b in batches.items():
        for k in range(3):
            for key in ("tokens", "loss_mask"):
                np.testing.assert_array_equal(b.batch(k)[key], reference.batch(k)[key], err_msg=f"{name} {key}")


def test_a_datasets_folder_trains_on_its_split_and_validates_on_its_validation_split() -> None:
    """save_to_disk's DatasetDict, padded: a document a row, its own next tokens in the loss, the
    padding and the row after its end-of-document id out of it; validation is the `validation` split."""
    cfg = data_config(path=str(DATA / "finetune_hf"), tokenizer=TOKENIZER, packing="pad")
    assert cfg.source == "datasets"  # a folder save_to_disk wrote
    seq = 24  # most documents are longer (cut there), some shorter (padded)
    train, val = make_batches(cfg, rows=8, seq_len=seq, vocab_size=128)
    assert isinstance(train, PaddedBatches) and (train.windows, val.windows) == (40, 8)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(TOKENIZER)
    docs = [json.loads(line)["text"] for line in (DATA / "finetune.jsonl").read_text().splitlines()]
    ids = [tok.encode(d, add_special_tokens=False).ids + [0] for d in docs]

    def which(row: np.ndarray, mask: np.ndarray) -> int:
        n = int(mask.sum()) + 1  # the document's tokens in the row
        (doc,) = [i for i, d in enumerate(ids) if d[:seq + 1] == row[:n].tolist()]
        assert n == min(len(ids[doc]), seq + 1) and row[n:].tolist() == [0] * (seq + 1 - n)  # cut, or padded
        np.testing.assert_array_equal(mask, (np.arange(seq) < n - 1).astype(np.float32))
        return doc

    lengths = {min(len(d), seq + 1) for d in ids}
    assert min(lengths) < seq + 1 and max(lengths) == seq + 1  # both cases happen
    seen = [which(r, m) for k in range(5) for r, m in zip(train.batch(k)["tokens"], train.batch(k)["loss_mask"])]
    assert sorted(seen) == list(range(40))  # one epoch: each training document once
    assert {which(r, m) for r, m in zip(val.batch(0)["tokens"], val.batch(0)["loss_mask"])} == set(range(40, 48))
    # the validation split named, or a part of the training split
    train2, val2 = make_batches(data_config(path=str(DATA / "finetune_hf"), tokenizer=TOKENIZER, packing="pad",
                                            split="validation", val_fraction=0.25), 4, 32, 128)
    assert (train2.windows, val2.windows) == (6, 2)


def test_the_models_own_tokenizer_is_the_default(tmp_path: Path) -> None:
    """model.hf_checkpoint's folder holding tokenizer.json tokenizes the text when data.tokenizer is unset."""
    ckpt = tmp_path / "qwen3"
    shutil.copytree(QWEN3, ckpt)
    shutil.copy(TOKENIZER, ckpt / "tokenizer.json")
    config = load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(ckpt), "seq_len": 16},
                          "data": {"path": str(DATA / "finetune.parquet")}})
    assert config.data.tokenizer == str(ckpt / "tokenizer.json")
    assert "hf_checkpoint" in config.sources["data.tokenizer"]
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"data.tokenizer: data.source: parquet needs a tokenizer .* "
                                          r"model.hf_checkpoint folder holding its tokenizer.json, or data.tokens_key"):
        load_config({"train_batch_size": 8, "model": {"hf_checkpoint": str(ckpt), "seq_len": 16},
                     "data": {"path": str(DATA / "finetune.parquet")}})


def test_padded_batches_resume_exactly_through_the_loader() -> None:
    """The grain loader's state over padded documents: stopping after 3 batches and starting a new
    loader from the saved state gives exactly the batches one loader would have given."""
    cfg = data_config(path=str(DATA / "finetune_hf"), tokenizer=TOKENIZER, packing="pad")
    train, _ = make_batches(cfg, rows=8, seq_len=32, vocab_size=128)
    with Loader(train, depth=2) as straight:
        expected = [next(straight) for _ in range(8)]  # past the end of an epoch (5 batches)
    with Loader(train, depth=2) as first:
        got = [next(first) for _ in range(3)]
        state = first.state()
    assert state == {"next_index": 3}
    with Loader(make_batches(cfg, rows=8, seq_len=32, vocab_size=128)[0], depth=2, state=json.loads(json.dumps(state))) as again:
        got += [next(again) for _ in range(5)]
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])


def test_bad_tables_are_one_error_naming_the_key_the_file_and_the_fix(tmp_path: Path) -> None:
    parquet = str(DATA / "finetune.parquet")
    with pytest.raises(ConfigError, match=r"data.text_key: .*finetune.parquet has no column 'body' \(it has: text, "
                                          r"input_ids\); set data.text_key"):
        load_corpus(data_config(path=parquet, tokenizer=TOKENIZER, text_key="body"), 128)
    with pytest.raises(ConfigError, match=r"data.tokens_key: column 'text' of .*finetune.arrow is string, not a list "
                                          r"of integers"):
        load_corpus(data_config(path=str(DATA / "finetune.arrow"), tokens_key="text"), 128)
    with pytest.raises(ConfigError, match=r"data.split: .*finetune_hf holds the splits train, validation, not 'test'"):
        load_corpus(data_config(path=str(DATA / "finetune_hf"), tokenizer=TOKENIZER, split="test"), 128)
    with pytest.raises(ConfigError, match=r"data.path: .*nothing is not a folder; data.source: datasets"):
        load_corpus(data_config(path=str(tmp_path / "nothing"), source="datasets", tokenizer=TOKENIZER), 128)
    folder = tmp_path / "copy"
    shutil.copytree(DATA / "finetune_hf" / "train", folder)
    (folder / "data-00000-of-00001.arrow").unlink()
    with pytest.raises(ConfigError, match=r"data.path: .*copy's state.json lists data-00000-of-00001.arrow, which is "
                                          r"not there"):
        load_corpus(data_config(path=str(folder), tokenizer=TOKENIZER), 128)
    not_parquet = tmp_path / "docs.parquet"
    not_parquet.write_text("{\"text\": \"hello\"}\n")
    with pytest.raises(ConfigError, match=r"data.path: .*docs.parquet is not a Parquet file pyarrow can read"):
        load_corpus(data_config(path=str(not_parquet), tokenizer=TOKENIZER), 128)
    with pytest.raises(ConfigError, match=r"model.vocab_size: .*finetune.parquet holds token id 127"):
        load_corpus(data_config(path=parquet, tokens_key="input_ids"), 100)
    with pytest.raises(ConfigError, match=r"data.val_split: .* holds the splits train, validation, not 'dev'"):
        make_batches(data_config(path=str(DATA / "finetune_hf"), tokenizer=TOKENIZER, val_split="dev"), 8, 16, 128)
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps({"input_ids": "oops"}) + "\n")
    with pytest.raises(ConfigError, match=r"data.tokens_key: line 2 of .*ids.jsonl has no list of token ids under "
                                          r"'input_ids'"):
        load_corpus(data_config(path=str(jsonl), tokens_key="input_ids"), 128)
