"""The conversion every shipped recipe runs with ``model.init_from``: each member starts as the source network
(``model.affine_init`` resolves to ``divide``), while the documented ``perturb`` start does not; through the trainer
on the small BatchNorm recipe, the converted run is its source continued for one step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from sigmanens_dist.config import load_config
from sigmanens_dist.models import build_model
from tests.helpers import REPO, run_train

RECIPES = sorted((REPO / "configs").glob("*.yaml"))


def _trained_looking(model: nn.Module) -> None:
    """Norm affines and running statistics away from their fresh values, as in a trained network: a conversion that
    ignored them (or a zero-initialised last BN, as timm ResNets have) would otherwise pass unnoticed."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for name, tensor in own:
                if "norm" not in type(module).__name__.lower() or not tensor.is_floating_point():
                    continue
                low, high = {"weight": (0.5, 1.5), "running_var": (0.5, 2.0)}.get(name, (-0.2, 0.2))
                tensor.copy_(torch.rand(tensor.shape, generator=gen) * (high - low) + low)


def _inputs(cfg, model: nn.Module) -> torch.Tensor | dict[str, torch.Tensor]:
    if cfg.model.source == "hf":
        return {"input_ids": torch.randint(0, 100, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    size = 224 if "vit" in cfg.model.name else 64
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_converts_its_source(recipe: Path, tmp_path: Path) -> None:
    root = [f"data.root={tmp_path}"] if recipe.stem not in ("demo", "fmnist_small") else []
    single = build_model(load_config(recipe, ["model.method=single", *root]), 10, 3, 100).eval()
    _trained_looking(single)
    torch.save({k.removeprefix("backbone."): v for k, v in single.state_dict().items()}, tmp_path / "source.pt")
    x = _inputs(single_cfg := load_config(recipe, root), single)
    with torch.no_grad():
        source = single(x)[0]
        scale = source.abs().max()
        for start, equal in ((None, True), ("perturb", False)):  # None: as the recipe ships
            cfg = load_config(recipe, [f"model.init_from={tmp_path / 'source.pt'}", "model.gamma_init_std=1", *root,
                                       *([f"model.affine_init={start}"] if start else [])])
            assert cfg.model.affine_init == (start or "divide")
            members = build_model(cfg, 10, 3, 100).eval()(x)
            gap = (members - source).abs().max() / scale
            assert (gap < 1e-4) == equal, (recipe.stem, start, float(gap))
    assert single_cfg.model.affine_init == "plain"  # from scratch, nothing to preserve


def _final(run: Path) -> dict[str, float]:
    return json.loads((run / "final_metrics.json").read_text())


@pytest.mark.slow
def test_converted_batchnorm_recipe_is_its_source_continued_one_step(tmp_path: Path) -> None:
    """configs/fmnist_small.yaml (BatchNorm ResNet), converted as README "Converting a trained network" says, every
    member on the same batch, one step at lr 1e-12: the ensemble scores as the source continued for that step and its
    members agree on every image; started ``perturb``, it does not."""
    small = ["--config", "configs/fmnist_small.yaml", "data.train_subset=1200", "data.val_split=200",
             "data.test_subset=200", "eval.at_end=false", "train.log_every_steps=1"]
    source = tmp_path / "source"
    run_train(source, *small, "model.method=single", "train.max_steps=40", "checkpoint.every_steps=20",
              "train.eval_every_steps=20")
    step = [*small, f"model.init_from={source}", "train.max_steps=1", "optim.lr=1e-12", "checkpoint.every_steps=1"]
    recipe = ["model.gamma_init_mean=1.5", "model.gamma_init_std=1", "reg.tau=0.5", "model.member_batches=shared"]
    run_train(tmp_path / "continued", *step, "model.method=single")
    run_train(tmp_path / "converted", *step, *recipe)
    run_train(tmp_path / "perturbed", *step, *recipe, "model.affine_init=perturb")
    continued, converted, perturbed = (_final(tmp_path / r) for r in ("continued", "converted", "perturbed"))
    assert converted["disagreement"] == 0.0
    for key in ("acc", "nll"):
        assert converted[key] == pytest.approx(continued[key], abs=1e-4), key
        for m in range(4):
            assert converted[f"member{m}/{key}"] == pytest.approx(continued[key], abs=1e-4), (m, key)
    assert perturbed["disagreement"] > 0 and abs(perturbed["nll"] - continued["nll"]) > 1e-3
    assert "affine_init: divide" in (tmp_path / "converted" / "config.yaml").read_text()
