"""EMA of a σN-Ens: every storage averaged once, integer buffers copied, state round-trips."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.training.ema import EMA


def _ens() -> nn.Module:
    torch.manual_seed(0)
    return convert_to_sigma_ensemble(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                                                   nn.LazyLinear(2)), 2)


def test_stats_and_weights_move_by_one_minus_decay_once() -> None:
    model = _ens()
    model(torch.randn(2, 3, 6, 6))  # materialise the lazy layer
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        model.sigma.running_stats.fill_(1.0)
        ema.module.sigma.running_stats.fill_(0.0)
        model.sigma.flat.fill_(1.0)
        ema.module.sigma.flat.fill_(0.0)
    ema.update(model)
    torch.testing.assert_close(ema.module.sigma.running_stats, torch.full_like(model.sigma.running_stats, 0.1))
    torch.testing.assert_close(ema.module.sigma.flat, torch.full_like(model.sigma.flat, 0.1))
    torch.testing.assert_close(ema.module.backbone[1].running_mean, torch.full((2, 4), 0.1))  # views follow


def test_integer_buffers_are_copied_and_state_round_trips() -> None:
    model = _ens()
    model.train()(torch.randn(4, 3, 6, 6))
    ema = EMA(model, decay=0.99996)
    for _ in range(3):
        model(torch.randn(4, 3, 6, 6))
        ema.update(model)
    assert torch.equal(ema.module.sigma.layout, model.sigma.layout)
    assert int(ema.module.backbone[1].num_batches_tracked) == 4
    again = EMA(model, decay=0.99996)
    again.load_state_dict(ema.state_dict())  # the layout check would refuse a corrupted checksum
    torch.testing.assert_close(again.module.sigma.flat, ema.module.sigma.flat)


def test_bad_decay() -> None:
    with pytest.raises(ValueError, match=r"EMA decay must be in \(0, 1\), got 1.0"):
        EMA(_ens(), 1.0)
