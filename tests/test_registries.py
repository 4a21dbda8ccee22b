"""Each list of names has one source: the config's ``Literal`` choices (``config.choices``), or the dataset table.
The registries that map those names to code (strategies, data formats, dataset readers) cover exactly them, so a new
strategy or dataset is one module plus one line (CONTRIBUTING.md), and a name the config accepts always has code.
Config sections reach the code typed: no function takes a config section as ``Any``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sigmanens_dist.catalog.datasets import DATASETS, take_augmix, take_randaugment
from sigmanens_dist.config import DataConfig, EvalConfig, ModelConfig, StrategyConfig, choices
from sigmanens_dist.data import raw
from sigmanens_dist.data.loaders import FORMATS
from sigmanens_dist.data.raw import READERS
from sigmanens_dist.distributed.strategies import CHECKPOINT_FORMATS, STRATEGIES, strategy_class
from sigmanens_dist.program_meta import NORM_STATS
from tests.helpers import parse_source

PACKAGE = Path(__file__).resolve().parent.parent / "sigmanens_dist"
CONFIG_NAMES = {"cfg", "config", "d", "data_cfg", "section"}  # how the package names a config (section) parameter


def test_choices_reads_a_literal_field_with_or_without_none() -> None:
    assert choices(StrategyConfig, "name") == ("ddp", "fsdp", "deepspeed")
    assert choices(EvalConfig, "calibration") == ("none", "temperature", "member-temperature")
    assert choices(ModelConfig, "member_batches") == ("shared", "independent")  # Literal[...] | None


def test_every_strategy_name_has_a_class_and_a_checkpoint_format() -> None:
    assert set(CHECKPOINT_FORMATS) == set(STRATEGIES) == {"ddp", "fsdp", "deepspeed"}
    for name in STRATEGIES:  # each class is imported here (DeepSpeed: the extra CI installs)
        cls = strategy_class(name)
        assert cls.name == name and cls.checkpoint_format == CHECKPOINT_FORMATS[name]


def test_predict_reads_the_norm_stats_modes_of_the_config() -> None:
    """``sigmanens predict`` imports no pydantic: its --norm-stats choices are program_meta.py's, held equal to
    ``eval.norm_stats`` here."""
    assert choices(EvalConfig, "norm_stats") == NORM_STATS


def test_every_data_format_has_a_reader() -> None:
    assert tuple(FORMATS) == choices(DataConfig, "format")


def test_every_dataset_has_a_reader_of_its_native_files() -> None:
    assert set(READERS) == set(DATASETS)
    assert choices(DataConfig, "dataset") == tuple(DATASETS)


def test_the_datasets_marked_for_randaugment_are_those_whose_readers_apply_it() -> None:
    """The dataset table's ``randaugment`` is what the config refuses by and what raw.IMAGE_FOLDERS (the datasets
    webdataset reads through the ImageFolder transforms) is; the raw reader applies it to ImageFolder trees alone."""
    assert {name for name, read in READERS.items() if read is raw._image_folder} == set(take_randaugment())


def test_the_datasets_marked_for_augmix_are_those_whose_raw_readers_give_normalised_pixels() -> None:
    """The dataset table's ``augmix`` is what the config refuses by and what ``raw.build_datasets`` augmixes: the
    image readers whose training samples are pixels normalised by the table's statistics (Fashion-MNIST's IDX
    reader, CIFAR's), which :class:`raw.PixelAugMix` takes back to uint8; not ImageFolder trees (timm's recipe, with
    ``train.randaugment`` for auto-augmentation), nor generated or text data."""
    assert {name for name, read in READERS.items() if read in (raw._fashion_mnist, raw._cifar)} == set(take_augmix())
    assert not set(take_augmix()) & set(take_randaugment())


def test_command_line_choices_come_from_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    from sigmanens_dist.cli.data import main as data_main

    with pytest.raises(SystemExit) as err:
        data_main(["convert", "--dataset", "fashion_mnist", "--format", "raw", "--out", "x"])
    assert err.value.code == 2
    assert "'ffcv', 'webdataset'" in capsys.readouterr().err


def _config_params_typed_any() -> list[str]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(parse_source(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                    if arg.arg in CONFIG_NAMES and arg.annotation is not None and ast.unparse(arg.annotation) == "Any":
                        found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}({arg.arg})")
    return found


def test_no_config_section_is_typed_any() -> None:
    assert _config_params_typed_any() == []
