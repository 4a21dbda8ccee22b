"""The corruption names and severity tables of :mod:`sigmanens_dist.data.corruptions`, without torch: the command
line and the config check names with them before anything imports torch.

Two disjoint sets, one per shift split (``sigmanens eval --shift-split``): the test corruptions are the benchmark's
fifteen but frost (:data:`TEST_CORRUPTIONS`), read once for the test columns; the validation corruptions are
CIFAR-10-C's four extras (:data:`VAL_CORRUPTIONS`), on which every choice under shift is made."""

from __future__ import annotations

from typing import Any

__all__ = ["CORRUPTIONS", "PARAMETERS", "SEVERITIES", "SHIFT_SPLITS", "TEST_CORRUPTIONS", "UNAVAILABLE",
           "VAL_CORRUPTIONS", "shift_split_problem", "unknown"]

SEVERITIES = (1, 2, 3, 4, 5)

#: each corruption's parameter at severities 1 to 5 (what ``data.corruptions.corrupt`` applies)
PARAMETERS: dict[str, tuple[Any, ...]] = {
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),  # noise std
    "shot_noise": (500, 250, 100, 75, 50),  # photons at full intensity (fewer: noisier)
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),  # fraction of values replaced by salt or pepper
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),  # blur sigma, pixels
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),  # factor on the distance from the per-channel mean
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),  # added to HSV value
    "jpeg_compression": (80, 65, 58, 50, 40),  # JPEG quality
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),  # down-scale factor before box up-scaling
    "speckle_noise": (0.06, 0.1, 0.12, 0.16, 0.2),  # std of the multiplicative noise
    "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)),  # disk radius, its anti-alias sigma
    "glass_blur": ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)),  # sigma, max shift, sweeps
    "motion_blur": ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)),  # kernel radius, sigma (pixels)
    "zoom_blur": tuple(tuple(1 + 0.01 * i for i in range(n)) for n in (6, 11, 16, 21, 26)),  # zoom factors averaged
    "snow": ((0.1, 0.2, 1, 0.6, 8, 3, 0.95), (0.1, 0.2, 1, 0.5, 10, 4, 0.9), (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
             (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85), (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8)),
    "fog": ((0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)),  # fog strength, fractal roughness decay
    "elastic_transform": ((0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06), (0.1, 0.04, 0.05),
                          (0.1, 0.03, 0.03)),  # displacement, its smoothing, affine jitter (× image size)
    # liquid layer's mean, std and blur sigma, its threshold, then water: strength, or mud: its mask's blur sigma; mud?
    "spatter": ((0.62, 0.1, 0.7, 0.7, 0.5, 0), (0.65, 0.1, 0.8, 0.7, 0.5, 0), (0.65, 0.3, 1, 0.69, 0.5, 0),
                (0.65, 0.1, 0.7, 0.69, 0.6, 1), (0.65, 0.1, 0.5, 0.68, 0.6, 1)),
    "saturate": ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)),  # HSV saturation s -> s * a + b
}
CORRUPTIONS = tuple(PARAMETERS)  # every corruption `corrupt` knows, of both sets
VAL_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")  # CIFAR-10-C's extras
TEST_CORRUPTIONS = tuple(n for n in CORRUPTIONS if n not in VAL_CORRUPTIONS)
SHIFT_SPLITS = {"test": TEST_CORRUPTIONS, "val": VAL_CORRUPTIONS}  # shift split -> the corruptions it may use
UNAVAILABLE = {"frost": "it blends in the frost photographs that the reference implementation ships beside its "
                        "script, which are not available here"}


def unknown(names: list[str]) -> str:
    """The error for corruption names that are not in :data:`CORRUPTIONS` (and why, for one known but missing)."""
    why = "".join(f" ({n}: {UNAVAILABLE[n]})" for n in names if n in UNAVAILABLE)
    return (f"unknown corruption(s) {', '.join(map(repr, names)) or '(none)'}{why}; allowed: all, "
            + ", ".join(CORRUPTIONS))


def shift_split_problem(names: list[str], shift_split: str) -> str | None:
    """Why corruptions ``names`` (known ones, or ``all``) cannot be scored on ``shift_split``, or None: a test
    corruption must never make a choice, nor a validation corruption a test column."""
    other = "val" if shift_split == "test" else "test"
    wrong = [n for n in names if n in SHIFT_SPLITS[other]]
    if not wrong:
        return None
    kind = "validation" if other == "val" else "test"
    return (f"{', '.join(wrong)}: {kind} corruption(s), not scored on eval.shift_split={shift_split}; choose from "
            f"all, {', '.join(SHIFT_SPLITS[shift_split])} (or eval.shift_split={other})")
