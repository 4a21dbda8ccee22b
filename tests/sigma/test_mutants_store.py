"""The σ store's own bookkeeping against the members it came from: a sub-ensemble keeps exactly the chosen members'
rows, statistics and outputs, in the order asked; a checkpoint of another layout is refused saying what differs
(checks/mutation.py's survivors in sigma/layers/store.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sigmanens_dist import convert_to_sigma_ensemble


def _net(width: int = 4) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, width, 3), nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, width, 1),
                         nn.GroupNorm(2, width), nn.Flatten(), nn.Linear(width * 36, 3))


def _trained(m: int, width: int = 4) -> nn.Module:
    torch.manual_seed(0)
    ens = convert_to_sigma_ensemble(_net(width), m)
    with torch.no_grad():
        ens.sigma.flat.copy_(torch.randn_like(ens.sigma.flat))
    ens.train()
    for _ in range(2):
        ens(torch.randn(6, 1, 8, 8))
    return ens.eval()


def test_a_sub_ensemble_is_its_members_in_the_order_asked() -> None:
    ens = _trained(4)
    sub = ens.sub_ensemble([3, 1])
    assert sub.sigma.num_members == 2
    torch.testing.assert_close(sub.sigma.flat, ens.sigma.flat[[3, 1]], rtol=0, atol=0)
    for (_, before), (_, after) in zip(ens.sigma_layers(), sub.sigma_layers(), strict=True):
        if before.keeps_running_stats():
            for theirs, ours in zip(ens.sigma.stats(before._slot.stats, before.num_features),
                                    sub.sigma.stats(after._slot.stats, after.num_features), strict=True):
                torch.testing.assert_close(ours, theirs[[3, 1]], rtol=0, atol=0)
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(sub(x), ens(x)[[3, 1]], rtol=1e-5, atol=1e-6)


def test_the_same_layout_loads_and_another_is_refused_saying_what_differs() -> None:
    ens = _trained(2)
    state = ens.state_dict()
    twin = convert_to_sigma_ensemble(_net(), 2)
    twin.load_state_dict(state)
    torch.testing.assert_close(twin.sigma.flat, ens.sigma.flat, rtol=0, atol=0)
    with pytest.raises(RuntimeError) as caught:
        convert_to_sigma_ensemble(_net(), 3).load_state_dict(state)
    assert ("cannot load σN-Ens state: the checkpoint has num_members=2, this ensemble has num_members=3; convert the "
            "model with the checkpoint's M") in str(caught.value)
    with pytest.raises(RuntimeError) as caught:
        convert_to_sigma_ensemble(_net(6), 2).load_state_dict(state)
    message = str(caught.value)
    assert "cannot load σN-Ens state: the checkpoint comes from a different architecture or conversion (" in message
    assert "num_gamma: checkpoint 8 vs model 12" in message and "num_columns: checkpoint 24 vs model 36" in message
    # same sizes, other layer kinds: only the checksum tells them apart
    swapped = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4),
                            nn.Flatten(), nn.Linear(4 * 36, 3))
    with pytest.raises(RuntimeError, match="same sizes but the σ layers differ in name, kind or order"):
        convert_to_sigma_ensemble(swapped, 2).load_state_dict(state, strict=False)


def test_a_sub_ensemble_saves_as_a_fresh_conversion_of_its_size() -> None:
    ens = _trained(4)
    sub = ens.sub_ensemble([2, 0])
    fresh = convert_to_sigma_ensemble(_net(), 2)
    fresh.load_state_dict(sub.state_dict())  # same layout: sizes, offsets and checksum
    fresh.eval()
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), sub(x), rtol=0, atol=0)
    assert ens.double().sub_ensemble([1]).sigma.flat.dtype == torch.float64


def test_a_mismatch_names_every_field_that_differs() -> None:
    state = _trained(2).state_dict()
    deeper = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.GroupNorm(2, 4),
                           nn.Conv2d(4, 4, 1), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4 * 36, 3))
    with pytest.raises(RuntimeError) as caught:
        convert_to_sigma_ensemble(deeper, 2).load_state_dict(state, strict=False)
    model = convert_to_sigma_ensemble(deeper, 2).sigma.layout.tolist()
    theirs = state["sigma.layout"].tolist()
    assert str(caught.value) == (
        "cannot load σN-Ens state: the checkpoint comes from a different architecture or conversion (num_layers: "
        f"checkpoint 2 vs model 3; num_gamma: checkpoint 8 vs model 12; num_regularized: checkpoint 8 vs model 12; "
        f"num_columns: checkpoint 24 vs model 36; crc: checkpoint {theirs[-1]} vs model {model[-1]})")


def test_the_store_reports_missing_unexpected_and_misshapen_entries() -> None:
    state = _trained(2).state_dict()
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"sigma\.flat\""):
        convert_to_sigma_ensemble(_net(), 2).load_state_dict({k: v for k, v in state.items() if k != "sigma.flat"})
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"sigma\.extra\""):
        convert_to_sigma_ensemble(_net(), 2).load_state_dict({**state, "sigma.extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match=r"size mismatch for sigma\.running_stats"):
        convert_to_sigma_ensemble(_net(), 2).load_state_dict({**state, "sigma.running_stats": torch.zeros(3)})


def test_running_statistics_are_saved_once_in_the_store() -> None:
    keys = list(_trained(2).state_dict())
    assert "sigma.running_stats" in keys
    assert not [k for k in keys if k.endswith(("running_mean", "running_var"))]  # the layers' views are not saved


def test_a_sub_ensemble_of_two_batchnorms_reads_each_layers_own_statistics() -> None:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 1), nn.BatchNorm2d(5),
                        nn.Flatten(), nn.Linear(5 * 36, 3))
    ens = convert_to_sigma_ensemble(net, 3)
    ens.train()
    for _ in range(2):
        ens(torch.randn(6, 1, 8, 8))
    ens.eval()
    sub = ens.sub_ensemble([2, 1])  # the second layer's statistics sit after the first's, at a k-member offset
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(sub(x), ens(x)[[2, 1]], rtol=1e-5, atol=1e-6)
    assert [s.stats for s in sub.sigma.slots] == [0, 2 * 2 * 4]
