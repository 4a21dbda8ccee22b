"""The validation shift's corruptions (CIFAR-10-C's extras) against the reference formulas, and the two shift splits'
corruption sets: disjoint, so a choice made on the validation shift never saw a test corruption."""

from __future__ import annotations

import colorsys

import numpy as np
import pytest
import torch

from sigmanens_dist.catalog.corruption_table import (
    CORRUPTIONS,
    PARAMETERS,
    SHIFT_SPLITS,
    TEST_CORRUPTIONS,
    VAL_CORRUPTIONS,
    shift_split_problem,
)
from sigmanens_dist.data import corruptions as C
from sigmanens_dist.data.corruptions import corrupt

LUMA = (0.299, 0.587, 0.114)


def test_shift_splits_are_disjoint_and_cover_every_corruption() -> None:
    assert set(VAL_CORRUPTIONS) == {"speckle_noise", "gaussian_blur", "spatter", "saturate"}
    assert not set(VAL_CORRUPTIONS) & set(TEST_CORRUPTIONS)
    assert sorted(VAL_CORRUPTIONS + TEST_CORRUPTIONS) == sorted(CORRUPTIONS)
    assert len(TEST_CORRUPTIONS) == 14 and "frost" not in TEST_CORRUPTIONS  # the benchmark's 15 but frost
    assert SHIFT_SPLITS == {"test": TEST_CORRUPTIONS, "val": VAL_CORRUPTIONS}
    assert shift_split_problem(["all"], "val") is None and shift_split_problem(["fog", "snow"], "test") is None
    assert shift_split_problem(["fog"], "val").startswith("fog: test corruption(s), not scored on eval.shift_split=val")
    assert shift_split_problem(["contrast", "spatter"], "test").startswith("spatter: validation corruption(s)")


def test_saturate_is_the_hsv_saturation_map() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 6, 6, generator=g)
    x[:, 0, 0], x[:, 0, 1] = 0.4, 0.0  # grey (hue 0: a red tint at b > 0) and black
    for severity, (a, b) in enumerate(PARAMETERS["saturate"], 1):
        want = torch.empty_like(x)
        for i in range(6):
            for j in range(6):
                h, s, v = colorsys.rgb_to_hsv(*x[:, i, j].tolist())
                want[:, i, j] = torch.tensor(colorsys.hsv_to_rgb(h, min(max(s * a + b, 0.0), 1.0), v))
        torch.testing.assert_close(corrupt(x, "saturate", severity), want, msg=str(severity))
    # one channel: a grey RGB pixel (v, v, v) becomes (v, v(1 − b), v(1 − b)), read back as its luma
    grey = torch.rand(1, 5, 5, generator=g)
    torch.testing.assert_close(corrupt(grey, "saturate", 5), grey * (LUMA[0] + (1 - LUMA[0]) * (1 - 0.2)))
    torch.testing.assert_close(corrupt(grey, "saturate", 2), grey)


def _reference_water(layer: np.ndarray) -> np.ndarray:
    """The reference's water shading with OpenCV, for one uint8 liquid layer: edges, distance to them capped at 20,
    blurred, equalised, embossed, blurred; times the layer, scaled to a maximum of 1."""
    cv2 = pytest.importorskip("cv2")
    dist = cv2.distanceTransform(255 - cv2.Canny(layer, 50, 150), cv2.DIST_L2, 5)
    dist = cv2.blur(cv2.threshold(dist, 20, 20, cv2.THRESH_TRUNC)[1], (3, 3)).astype(np.uint8)
    dist = cv2.filter2D(cv2.equalizeHist(dist), cv2.CV_8U, np.array([[-2, -1, 0], [-1, 1, 1], [0, 1, 2]]))
    m = layer * cv2.blur(dist, (3, 3)).astype(np.float32)
    return m / m.max()


def test_spatter_water_matches_opencv() -> None:
    """The torch Canny, chamfer distance, equalisation and filters give OpenCV's shading to float rounding, on
    liquid layers drawn as the reference draws them (severities 1-3, CIFAR and Fashion-MNIST sizes)."""
    pytest.importorskip("cv2")
    rng = np.random.default_rng(0)
    for trial in range(12):
        loc, scale, sigma, threshold, _, mud = PARAMETERS["spatter"][trial % 3]
        assert not mud
        size = (32, 28)[trial % 2]
        liquid = C._gaussian_blur(torch.from_numpy(rng.normal(loc, scale, (1, 1, size, size))), sigma, None)
        layer = (torch.where(liquid < threshold, 0, liquid).clamp(0, 1) * 255).floor()
        want = _reference_water(layer[0, 0].numpy().astype(np.uint8))
        np.testing.assert_allclose(C._water(layer)[0, 0].numpy(), want, atol=1e-6, err_msg=str(trial))


@pytest.mark.parametrize("channels", [3, 1])
def test_spatter_adds_water_and_blends_mud_in_one_colour(channels: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = 0.2 + 0.3 * torch.rand(4, channels, 32, 32, generator=g)  # no clipping at 1 after the water
    water, mud = (175 / 255, 238 / 255, 238 / 255), (63 / 255, 42 / 255, 20 / 255)
    if channels == 1:
        water, mud = ((sum(w * c for w, c in zip(LUMA, rgb, strict=True)),) for rgb in (water, mud))
    water_t, mud_t = (torch.tensor(c).view(1, -1, 1, 1) for c in (water, mud))
    wet = corrupt(x, "spatter", 3, seed=0)  # water: x + m · colour, m in [0, strength 0.5]
    m = (wet - x) / water_t
    assert (m[:, :1] > 0).float().mean() > 0.05 and m.min() >= -1e-6 and m.max() <= 0.5 + 1e-6
    torch.testing.assert_close(m, m[:, :1].expand_as(m), atol=1e-5, rtol=0)
    x = 0.5 + 0.3 * torch.rand(4, channels, 32, 32, generator=g)  # away from the mud colour: a stable ratio
    muddy = corrupt(x, "spatter", 5, seed=0)  # mud: x (1 − m) + colour · m, m in {0} ∪ [0.8, 1]
    m = (muddy - x) / (mud_t - x)
    assert (m[:, :1] > 0).float().mean() > 0.01 and ((m < 1e-6) | ((m > 0.8 - 1e-5) & (m < 1 + 1e-5))).all()
    torch.testing.assert_close(m, m[:, :1].expand_as(m), atol=1e-5, rtol=0)
    assert torch.equal(corrupt(x, "spatter", 5, seed=0), muddy)  # seeded
