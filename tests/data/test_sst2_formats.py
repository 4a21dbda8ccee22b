"""SST-2 converted to FFCV and webdataset: the converted folder trains on its own, every sentence comes back once
per epoch with the raw reader's token ids and label, resume is exact, and a text backbone trains on it under
2-process torchrun."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from sigmanens_dist.config import load_config
from sigmanens_dist.data.loaders import Data, build_data
from sigmanens_dist.data.sst2 import Sst2Dataset, load_tokenizer, read_sst2, train_wordpiece
from sigmanens_dist.distributed.env import DistEnv
from tests.helpers import TINY_BERT, losses, run_train, write_sst2

pytest.importorskip("transformers")
FORMATS = ["ffcv", "webdataset"]
N_TRAIN, N_DEV, MAX_LENGTH = 96, 20, 16


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sst2(tmp_path_factory.mktemp("sst2"), n_train=N_TRAIN, n_dev=N_DEV)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Path:
    from sigmanens_dist.cli import main

    out = tmp_path_factory.mktemp("converted")
    for fmt in FORMATS:
        pytest.importorskip(fmt)
        assert main(["data", "convert", "--dataset", "sst2", "--root", str(source), "--format", fmt, "--out",
                     str(out / fmt), "--max-count", "24", "--num-workers", "1", "--val-split", "0"]) == 0  # 4 shards
    return out


def _data(root: Path, fmt: str, env: DistEnv, *extra: str) -> Data:
    cfg = load_config(None, [*TINY_BERT, "data.dataset=sst2", f"data.format={fmt}", f"data.root={root}",
                             f"data.max_length={MAX_LENGTH}", "train.batch_size=8", "data.num_workers=2",
                             "data.val_split=0", "data.val_from_test=true", *extra])
    return build_data(cfg.data, cfg.train.batch_size, cfg.seed, env)


def _rows(ids: torch.Tensor, labels: torch.Tensor) -> list[tuple[tuple[int, ...], int]]:
    return [(tuple(row.tolist()), int(y)) for row, y in zip(ids, labels, strict=True)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_converted_folder_is_self_contained(converted: Path, source: Path, fmt: str) -> None:
    out = converted / fmt
    sentences = read_sst2(source)[0].sentences
    assert json.loads((out / "classes.json").read_text()) == {
        "dataset": "sst2", "classes": ["negative", "positive"], "train_pool": len(sentences), "val_split": 0,
        "split_seed": 0}
    # The default tokenizer a raw run would train, written beside the data, and nothing written into the source.
    assert load_tokenizer(None, out).get_vocab() == train_wordpiece(sentences).get_vocab()
    assert not (source / "tokenizer").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_sentence_once_with_the_raw_ids_and_exact_resume(converted: Path, source: Path, fmt: str) -> None:
    env = DistEnv(0, 1, 0, torch.device("cpu"))
    data = _data(converted / fmt, fmt, env)
    tokenizer = load_tokenizer(None, converted / fmt)
    train_text, dev_text = read_sst2(source)
    raw_train = Sst2Dataset(train_text.sentences, train_text.labels, tokenizer, MAX_LENGTH)
    raw_dev = Sst2Dataset(dev_text.sentences, dev_text.labels, tokenizer, MAX_LENGTH)
    assert data.vocab_size == len(tokenizer) and data.in_chans == 0

    assert len(data.train) == N_TRAIN // 8
    batches = [(x["input_ids"].clone(), x["attention_mask"].clone(), y.clone()) for x, y in data.train.iter_epoch(1)]
    assert len(batches) == len(data.train)
    seen = Counter(r for ids, _, y in batches for r in _rows(ids, y))
    assert seen == Counter(_rows(raw_train.input_ids, raw_train.labels))  # every sentence once, with its label
    for ids, mask, _ in batches:
        assert torch.equal(mask, (ids != tokenizer.pad_token_id).long())
    resumed = list(data.train.iter_epoch(1, 5))
    assert all(torch.equal(a[0], b[0]["input_ids"]) and torch.equal(a[2], b[1])
               for a, b in zip(batches[5:], resumed, strict=True))
    other = [x["input_ids"] for x, _ in data.train.iter_epoch(2)]
    assert not all(torch.equal(a[0], b) for a, b in zip(batches, other, strict=True))  # reshuffled per epoch

    dev = Counter(r for x, y in data.val() for r in _rows(x["input_ids"], y))
    assert dev == Counter(_rows(raw_dev.input_ids, raw_dev.labels))


def test_text_dataset_refuses_empty_sentences() -> None:
    from sigmanens_dist.data.sst2 import TextDataset

    with pytest.raises(ValueError, match="sentence 1 is empty"):
        TextDataset(["fine", " "], [0, 1])  # every format would store it, but differently


def test_damaged_or_other_kind_of_beton_is_named(converted: Path, tmp_path: Path) -> None:
    pytest.importorskip("ffcv")
    from sigmanens_dist.data.ffcv_io import check_beton

    good = converted / "ffcv" / "train.beton"
    assert check_beton(good, "text") == N_TRAIN
    cut = tmp_path / "cut.beton"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    with pytest.raises(ValueError, match=r"cut\.beton: corrupt or truncated \.beton \(allocation table .*"
                                         r"re-run write_text_beton\(\)"):
        check_beton(cut, "text")
    with pytest.raises(ValueError, match=r"expected \{'image': 2, 'label': 1\} for image data"):
        check_beton(good, "image")


def test_converted_text_without_a_tokenizer_says_where_it_comes_from(converted: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(converted / "webdataset", root, ignore=shutil.ignore_patterns("tokenizer"))
    with pytest.raises(FileNotFoundError, match=r"copy/tokenizer is missing: `sigmanens data convert --dataset sst2`"):
        _data(root, "webdataset", DistEnv(0, 1, 0, torch.device("cpu")))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_two_rank_text_training_on_converted_format(converted: Path, tmp_path: Path, fmt: str) -> None:
    run = tmp_path / fmt
    run_train(run, *TINY_BERT, "data.dataset=sst2", f"data.format={fmt}", f"data.root={converted / fmt}",
              f"data.max_length={MAX_LENGTH}", "data.num_workers=1", "model.num_members=2", "train.batch_size=8",
              "train.max_steps=6", "train.log_every_steps=1", "data.val_split=0", "data.val_from_test=true", nproc=2)
    assert sorted(losses(run)) == list(range(1, 7))
    metrics = json.loads((run / "final_metrics.json").read_text())
    assert 0.0 <= metrics["acc"] <= 1.0 and metrics["nll"] > 0
