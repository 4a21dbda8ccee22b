"""GLUE SST-2 (binary sentiment) for a Hugging Face text backbone: TSV reading, tokenisation, fixed-length batches.

On disk (``data.root``)::

    <root>/train.tsv, <root>/dev.tsv      header ``sentence<TAB>label``, labels 0/1 (GLUE's own files)
    <root>/tokenizer/                     written on first use when ``data.tokenizer`` is unset (see below)

Tokenizer: ``data.tokenizer`` names a local Hugging Face tokenizer folder (``AutoTokenizer.from_pretrained``). A
*pretrained* backbone (e.g. a local ``bert-base-uncased`` folder as ``model.name``) only understands the token ids
of its own tokenizer, so with one ``data.tokenizer`` MUST be that backbone's tokenizer folder (usually the same
folder). When it is unset, a WordPiece tokenizer is built here from ``train.tsv`` (deterministic, offline, seconds)
and saved to ``<root>/tokenizer/``; later runs load that folder, so ids stay stable across runs and checkpoints
(delete it to retrain). That only suits a backbone trained from scratch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from sigmanens_dist.config import DataConfig
from sigmanens_dist.errors import MissingPathError, UsageError

__all__ = ["SPECIAL_TOKENS", "SST2_CLASSES", "Sst2Dataset", "TextBatcher", "TextDataset", "load_tokenizer",
           "read_sst2", "read_sst2_tsv", "save_default_tokenizer", "train_wordpiece"]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
SST2_CLASSES = ("negative", "positive")
TOKENIZER_DIR = "tokenizer"


def read_sst2_tsv(path: Path) -> tuple[list[str], list[int]]:
    """Sentences and 0/1 labels of a GLUE SST-2 TSV. Split on tabs only: the sentences contain quote characters
    that a CSV reader would take as field quoting."""
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"{path} is missing: data.root must hold GLUE SST-2's train.tsv and dev.tsv")
    with path.open(encoding="utf-8") as f:
        lines = f.read().splitlines()
    if not lines:
        raise UsageError(f"{path}: empty file; expected a header line 'sentence<TAB>label'")
    header = lines[0].split("\t")
    if "sentence" not in header or "label" not in header:
        raise UsageError(f"{path}:1: header {lines[0]!r} lacks the columns 'sentence' and 'label'")
    s_col, l_col = header.index("sentence"), header.index("label")
    sentences, labels = [], []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(header):
            raise UsageError(f"{path}:{number}: {len(fields)} tab-separated fields, the header has {len(header)}: "
                             f"{line[:80]!r}")
        label = fields[l_col].strip()
        if label not in ("0", "1"):
            raise UsageError(f"{path}:{number}: label {label!r} is not 0 or 1")
        if not fields[s_col].strip():
            raise UsageError(f"{path}:{number}: empty sentence")
        sentences.append(fields[s_col])
        labels.append(int(label))
    if not sentences:
        raise UsageError(f"{path}: no samples after the header")
    return sentences, labels


def train_wordpiece(sentences: list[str], vocab_size: int = 8000) -> Any:
    """A BERT-style uncased WordPiece tokenizer for ``sentences``, wrapped as ``PreTrainedTokenizerFast`` so it pads
    and truncates like any Hugging Face tokenizer.

    The vocabulary is every character seen (alone and as a ``##`` continuation, so no word is ever ``[UNK]``) plus the
    most frequent whole words up to ``vocab_size``, ties broken alphabetically. Not ``tokenizers``'
    ``WordPieceTrainer``: it breaks merge ties in hash-map order, so two runs on the same sentences give different
    vocabularies, and a checkpoint would no longer match the ids of a retrained tokenizer.
    """
    # optional extra: text (tokenizers, transformers)
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for sentence in sentences:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(sentence)))
    chars = sorted({c for word in counts for c in word})
    pieces = [*SPECIAL_TOKENS, *chars, *(f"##{c}" for c in chars)]
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if len(w) > 1]
    vocab = {token: i for i, token in enumerate(pieces + words[:max(0, vocab_size - len(pieces))])}

    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre_tokenizer, decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=512)


def load_tokenizer(tokenizer_dir: Path | None, root: Path) -> Any:
    """``tokenizer_dir`` if given; else ``<root>/tokenizer/``, trained on ``<root>/train.tsv`` and saved there first
    if absent. Saving goes through a temporary folder renamed into place, so ranks racing to write it never leave
    (or read) a half-written tokenizer; they all train the same one."""
    from transformers import AutoTokenizer  # optional extra: text (transformers)

    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        if not (tokenizer_dir / "tokenizer_config.json").is_file() and not (tokenizer_dir / "tokenizer.json").is_file():
            raise MissingPathError(f"data.tokenizer={tokenizer_dir}: not a Hugging Face tokenizer folder (no "
                                   "tokenizer.json or tokenizer_config.json); give the pretrained backbone's folder")
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    target = Path(root) / TOKENIZER_DIR
    if not (target / "tokenizer.json").is_file():
        _save_into_place(train_wordpiece(read_sst2_tsv(Path(root) / "train.tsv")[0]), target, replace=False)
    return AutoTokenizer.from_pretrained(str(target))


def save_default_tokenizer(root: Path, out: Path) -> Path:
    """Saves the tokenizer a run on ``root`` uses when ``data.tokenizer`` is unset (``root/tokenizer/``, or one
    trained on ``root/train.tsv``, as :func:`load_tokenizer` would, without writing into ``root``) to
    ``out/tokenizer/``; returns that folder. A complete tokenizer is always at that path, except between two
    renames when one is replaced."""
    from transformers import AutoTokenizer  # optional extra: text (transformers)

    existing = Path(root) / TOKENIZER_DIR
    tokenizer = (AutoTokenizer.from_pretrained(str(existing)) if (existing / "tokenizer.json").is_file()
                 else train_wordpiece(read_sst2_tsv(Path(root) / "train.tsv")[0]))
    target = Path(out) / TOKENIZER_DIR
    _save_into_place(tokenizer, target, replace=True)
    return target


def _save_into_place(tokenizer: Any, target: Path, replace: bool) -> None:
    """Saves to a temporary folder beside ``target`` and renames it into place, so ``target`` never holds a
    half-written tokenizer. ``replace=False`` keeps a ``target`` that appeared meanwhile (ranks racing to write the
    same tokenizer); ``replace=True`` sets the old one aside first (a folder cannot be renamed over a non-empty
    one) and deletes it once the new one is in place."""
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    old = tmp.with_name(tmp.name + ".old")
    try:
        tokenizer.save_pretrained(str(tmp))
        if replace and target.exists():
            os.rename(target, old)
        os.rename(tmp, target)
    except OSError:
        if replace or not (target / "tokenizer.json").is_file():  # not a lost race: a real failure (read-only, …)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


class TextBatcher:
    """Sentences → ``{"input_ids": (B, L), "attention_mask": (B, L)}`` with ``L = max_length`` (padded and
    truncated): the one tokenisation every text reader uses, so raw, FFCV and webdataset data give the same ids."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        # Batchers run in DataLoader workers, forked from a parent that may already have used the tokenizers
        # library's thread pool; it then disables itself in each worker with a warning. Its threads buy nothing on
        # one batch of short sentences, so they stay off in any process that tokenises text for training.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, sentences: list[str]) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(list(sentences), padding="max_length", truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


class TextDataset(Dataset):
    """``(sentence, label)`` items: the untokenised source the converters store, so converted data does not depend
    on the tokenizer (which the training config may change)."""

    classes = SST2_CLASSES

    def __init__(self, sentences: list[str], labels: list[int]) -> None:
        if len(sentences) != len(labels):
            raise UsageError(f"{len(sentences)} sentences but {len(labels)} labels")
        empty = next((i for i, s in enumerate(sentences) if not s.strip()), None)
        if empty is not None:
            raise UsageError(f"sentence {empty} is empty")
        self.sentences, self.labels = sentences, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[str, int]:
        return self.sentences[index], self.labels[index]


class Sst2Dataset(Dataset):
    """``({"input_ids": (L,), "attention_mask": (L,)}, label)`` with ``L = max_length``: padded and truncated up
    front so the default collate stacks a batch, and tokenisation runs once, not every epoch."""

    def __init__(self, sentences: list[str], labels: list[int], tokenizer: Any, max_length: int) -> None:
        if len(sentences) != len(labels):
            raise UsageError(f"{len(sentences)} sentences but {len(labels)} labels")
        enc = TextBatcher(tokenizer, max_length)(sentences)
        self.input_ids, self.attention_mask = enc["input_ids"], enc["attention_mask"]
        self.labels = torch.tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], int]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index]}, int(
            self.labels[index])


def read_sst2(root: Path, train_subset: int | None = None, val_subset: int | None = None
              ) -> tuple[TextDataset, TextDataset]:
    """``root``'s train.tsv and dev.tsv as sentences (the first ``train_subset`` / ``val_subset`` samples)."""
    splits = []
    for name, subset in (("train.tsv", train_subset), ("dev.tsv", val_subset)):
        sentences, labels = read_sst2_tsv(Path(root) / name)
        splits.append(TextDataset(sentences[:subset], labels[:subset]))
    return splits[0], splits[1]


def build_sst2(data_cfg: DataConfig, root: Path) -> tuple[Sst2Dataset, Sst2Dataset, int]:
    """Train (first ``train_subset`` samples) and dev sets and the tokenizer's vocabulary size, which a from-scratch
    backbone's embedding table must match. Dev is the test set; data/raw.py carves validation from train."""
    root = Path(root)
    tokenizer = load_tokenizer(data_cfg.tokenizer, root)
    train, val = read_sst2(root, data_cfg.train_subset)
    return (Sst2Dataset(train.sentences, train.labels, tokenizer, data_cfg.max_length),
            Sst2Dataset(val.sentences, val.labels, tokenizer, data_cfg.max_length), len(tokenizer))
