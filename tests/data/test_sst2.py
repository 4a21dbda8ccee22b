"""SST-2 end to end: GLUE TSV reading and its errors, the offline tokenizer, HF backbones, a text training run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from sigmanens_dist.config import ConfigError, load_config
from sigmanens_dist.data.raw import build_datasets
from sigmanens_dist.data.sst2 import Sst2Dataset, load_tokenizer, read_sst2_tsv, train_wordpiece
from sigmanens_dist.models import SingleModel, build_model
from sigmanens_dist.sigma.layers import SigmaNorm
from tests.helpers import NEGATIVE, POSITIVE, TINY_BERT, losses, run_train, write_sst2

transformers = pytest.importorskip("transformers")



def _cfg(root: Path, *extra: str):
    return load_config(None, [*TINY_BERT, "data.dataset=sst2", f"data.root={root}", "data.max_length=16", *extra])


# -- TSV reading -------------------------------------------------------------------------------------------------
def test_reads_glue_tsv(tmp_path: Path) -> None:
    root = write_sst2(tmp_path / "sst2", n_train=50, n_dev=10)
    sentences, labels = read_sst2_tsv(root / "train.tsv")
    assert len(sentences) == len(labels) == 50
    assert set(labels) == {0, 1}
    assert all(s.endswith("'s \"") for s in sentences)  # quotes are text, not CSV quoting
    for s, y in zip(sentences, labels, strict=True):
        assert any(w in s.split() for w in (POSITIVE if y else NEGATIVE))


@pytest.mark.parametrize(("line", "needle"), [
    ("a fine film\t2", "train.tsv:3: label '2' is not 0 or 1"),
    ("a fine film\tyes", "train.tsv:3: label 'yes' is not 0 or 1"),
    ("a fine film", "train.tsv:3: 1 tab-separated fields, the header has 2"),
    ("a fine\tfilm\t1", "train.tsv:3: 3 tab-separated fields, the header has 2"),
    ("  \t1", "train.tsv:3: empty sentence"),
])
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "train.tsv"
    path.write_text(f"sentence\tlabel\ngood film\t1\n{line}\nbad film\t0\n")
    with pytest.raises(ValueError) as info:
        read_sst2_tsv(path)
    assert needle in str(info.value) and str(tmp_path) in str(info.value)


def test_missing_header_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "dev.tsv"
    path.write_text("good film\t1\n")
    with pytest.raises(ValueError, match=r"dev.tsv:1: header 'good film\\t1' lacks"):
        read_sst2_tsv(path)
    with pytest.raises(FileNotFoundError, match=r"nope\.tsv is missing"):
        read_sst2_tsv(tmp_path / "nope.tsv")


# -- tokenizer ---------------------------------------------------------------------------------------------------
def test_tokenizer_training_is_deterministic(tmp_path: Path) -> None:
    sentences, _ = read_sst2_tsv(write_sst2(tmp_path / "sst2", n_train=200) / "train.tsv")
    a, b = train_wordpiece(sentences), train_wordpiece(list(sentences))
    assert a.get_vocab() == b.get_vocab()
    assert "good" in a.get_vocab() and "terrible" in a.get_vocab()
    assert a.tokenize("beat") == ["b", "##e", "##a", "##t"]  # an unseen word splits into seen characters
    other = train_wordpiece(["completely different words here"] * 5)
    assert other.get_vocab() != a.get_vocab()
    enc = a(["the movie was good"], padding="max_length", max_length=10, truncation=True)
    ids = enc["input_ids"][0]
    assert ids[0] == a.cls_token_id and ids[5] == a.sep_token_id and ids[6:] == [a.pad_token_id] * 4
    assert enc["attention_mask"][0] == [1] * 6 + [0] * 4


def test_tokenizer_is_saved_once_and_reloaded(tmp_path: Path) -> None:
    root = write_sst2(tmp_path / "sst2", n_train=100)
    first = load_tokenizer(None, root)
    saved = root / "tokenizer" / "tokenizer.json"
    assert saved.is_file() and not list(root.glob(".tokenizer.*"))
    stamp = saved.stat().st_mtime_ns
    second = load_tokenizer(None, root)
    assert saved.stat().st_mtime_ns == stamp  # reused, not retrained
    assert first.get_vocab() == second.get_vocab()
    # a given folder wins, and a wrong one is a clear error
    assert load_tokenizer(root / "tokenizer", tmp_path).get_vocab() == first.get_vocab()
    with pytest.raises(FileNotFoundError, match="not a Hugging Face tokenizer folder"):
        load_tokenizer(tmp_path, root)


def test_dataset_items_are_fixed_length_dicts(tmp_path: Path) -> None:
    root = write_sst2(tmp_path / "sst2", n_train=60, n_dev=20)
    bundle = build_datasets(_cfg(root, "data.train_subset=40").data, root)
    # val_split 0.1 of the 40-sentence training pool; dev.tsv is the test set
    assert (len(bundle.train), len(bundle.val), len(bundle.test), bundle.num_classes) == (36, 4, 20, 2)
    assert bundle.vocab_size == len(load_tokenizer(None, root))
    x, y = bundle.train[(3, 12345)]
    assert set(x) == {"input_ids", "attention_mask"} and y in (0, 1)
    assert x["input_ids"].shape == x["attention_mask"].shape == (16,)
    assert int(x["input_ids"].max()) < bundle.vocab_size
    batch = next(iter(torch.utils.data.DataLoader(bundle.test, batch_size=8)))
    assert batch[0]["input_ids"].shape == (8, 16) and batch[1].shape == (8,)
    with pytest.raises(ValueError, match="3 sentences but 2 labels"):
        Sst2Dataset(["a", "b", "c"], [0, 1], load_tokenizer(None, root), 8)


# -- config and model --------------------------------------------------------------------------------------------
def test_config_pairs_text_data_with_hf_models(tmp_path: Path) -> None:
    cfg = load_config(None, [*TINY_BERT, "data.dataset=sst2", f"data.root={tmp_path}"])
    assert (cfg.model.source, cfg.model.name, cfg.data.max_length, cfg.data.tokenizer) == ("hf", "bert", 64, None)
    with pytest.raises(ConfigError, match=r"model.source: data.dataset='sst2' needs model.source=hf"):
        load_config(None, ["data.dataset=sst2", f"data.root={tmp_path}"])
    with pytest.raises(ConfigError, match=r"needs model\.source=timm"):
        load_config(None, [*TINY_BERT, "data.dataset=synthetic"])
    with pytest.raises(ConfigError, match=r"train.mixup_alpha: an image augmentation"):
        load_config(None, [*TINY_BERT, "data.dataset=sst2", f"data.root={tmp_path}", "train.mixup_alpha=0.2"])
    with pytest.raises(ConfigError, match=r"data.max_length: must be >= 8"):
        load_config(None, [*TINY_BERT, "data.dataset=sst2", f"data.root={tmp_path}", "data.max_length=4"])
    with pytest.raises(ConfigError, match=r"model.kwargs: num_labels must not be set"):
        load_config(None, [*TINY_BERT, "model.kwargs.num_labels=3", "data.dataset=sst2", f"data.root={tmp_path}"])


def test_hf_model_has_every_layernorm_converted(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "model.num_members=3")
    model = build_model(cfg, num_classes=2, in_chans=0, vocab_size=90)
    assert model.backbone.config.vocab_size == 90 and model.backbone.config.num_hidden_layers == 1
    plain = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm) and not isinstance(m, SigmaNorm)]
    assert plain == []
    # embeddings + (attention output + block output) per layer
    assert len(model.sigma_layers()) == 3
    x = {"input_ids": torch.randint(0, 90, (5, 12)), "attention_mask": torch.ones(5, 12, dtype=torch.long)}
    assert model(x).shape == (3, 5, 2)
    single = build_model(_cfg(tmp_path, "model.method=single"), 2, 0, vocab_size=90)
    assert isinstance(single, SingleModel) and single(x).shape == (1, 5, 2)


def test_hf_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs the tokenizer's vocabulary size"):
        build_model(_cfg(tmp_path), 2, 0, vocab_size=None)
    with pytest.raises(FileNotFoundError, match=r"must be a local Hugging Face model folder; .*config.json"):
        build_model(_cfg(tmp_path, "model.pretrained=true", "model.name=bert-base-uncased"), 2, 0, vocab_size=90)
    # a local pretrained folder loads, and a tokenizer larger than its embedding table is refused
    folder = tmp_path / "tiny-bert"
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    pretrained = _cfg(tmp_path, "model.pretrained=true", f"model.name={folder}", "model.kwargs={}")
    assert build_model(pretrained, 2, 0, vocab_size=50).backbone.config.vocab_size == 50
    with pytest.raises(ValueError, match=r"the tokenizer has 60 tokens but .* embeds only 50"):
        build_model(pretrained, 2, 0, vocab_size=60)


# -- training ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_text_training_run_learns(tmp_path: Path) -> None:
    root = write_sst2(tmp_path / "sst2", n_train=400, n_dev=200)
    run = tmp_path / "run"
    run_train(run, *TINY_BERT, "model.kwargs.hidden_size=64", "model.kwargs.intermediate_size=128",
              "data.dataset=sst2", f"data.root={root}", "data.max_length=16", "data.num_workers=0",
              "model.num_members=2", "optim.name=adamw", "optim.lr=0.003", "optim.weight_decay=0.0",
              "schedule.warmup_steps=3", "train.batch_size=32", "train.max_steps=30", "train.log_every_steps=5",
              "checkpoint.every_steps=30")
    metrics = json.loads((run / "final_metrics.json").read_text())
    assert metrics["acc"] > 0.8, metrics  # chance is 0.5; seeds 0-2 all reach 1.0
    assert metrics["member1/acc"] > 0.8, metrics
    steps = losses(run)
    assert sorted(steps) == [5, 10, 15, 20, 25, 30] and steps[30] < steps[5]
    assert (root / "tokenizer" / "tokenizer.json").is_file()
