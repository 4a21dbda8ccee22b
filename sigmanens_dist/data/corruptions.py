"""CIFAR-10-C corruptions (Hendrycks & Dietterich, ICLR 2019), applied on the fly to float images in [0, 1].

Severity tables are those of the reference ``make_cifar_c.py``. Corruptions work on ``(C, H, W)`` or
``(B, C, H, W)`` tensors before normalisation, so an ensemble can be scored under shift without a pre-rendered
copy of the test set. The reference works on uint8 PIL images; here values stay float (no 1/255 rounding), except
where the corruption is itself a uint8 codec (JPEG). Given the same ``seed`` the output is the same, on any device.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = ["CORRUPTIONS", "SEVERITIES", "corrupt"]

SEVERITIES = (1, 2, 3, 4, 5)

_PARAMS: dict[str, tuple[float, ...]] = {
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),  # noise std
    "shot_noise": (500, 250, 100, 75, 50),  # photons at full intensity (fewer: noisier)
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),  # fraction of values replaced by salt or pepper
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),  # blur sigma, pixels
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),  # factor on the distance from the per-channel mean
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),  # added to HSV value
    "jpeg_compression": (80, 65, 58, 50, 40),  # JPEG quality
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),  # down-scale factor before box up-scaling
}
CORRUPTIONS = tuple(_PARAMS)


def corrupt(x: torch.Tensor, name: str, severity: int, seed: int = 0) -> torch.Tensor:
    """``x`` (float, values in [0, 1], ``(C, H, W)`` or ``(B, C, H, W)``) under corruption ``name`` at ``severity``
    1–5; a new tensor of the same shape, dtype and device, in [0, 1]."""
    if name not in _PARAMS:
        raise ValueError(f"corruption {name!r} is not one of {', '.join(CORRUPTIONS)}")
    if isinstance(severity, bool) or severity not in SEVERITIES:
        raise ValueError(f"severity {severity!r} is not one of {', '.join(map(str, SEVERITIES))}")
    if not x.is_floating_point() or x.ndim not in (3, 4):
        raise ValueError(f"expected a float image tensor (C, H, W) or (B, C, H, W) in [0, 1]; got {x.dtype} "
                         f"{tuple(x.shape)}")
    batched = x if x.ndim == 4 else x.unsqueeze(0)
    g = torch.Generator(device=x.device).manual_seed(seed)
    out = _FUNCS[name](batched.float(), _PARAMS[name][severity - 1], g).clamp_(0, 1).to(x.dtype)
    return out if x.ndim == 4 else out.squeeze(0)


def _gaussian_noise(x: torch.Tensor, std: float, g: torch.Generator) -> torch.Tensor:
    return x + std * torch.randn(x.shape, generator=g, device=x.device)


def _shot_noise(x: torch.Tensor, photons: float, g: torch.Generator) -> torch.Tensor:
    return torch.poisson(x.clamp(0, 1) * photons, generator=g) / photons


def _impulse_noise(x: torch.Tensor, amount: float, g: torch.Generator) -> torch.Tensor:
    # skimage's 's&p': each value independently replaced with probability `amount`, half by 1 and half by 0.
    hit = torch.rand(x.shape, generator=g, device=x.device) < amount
    salt = torch.rand(x.shape, generator=g, device=x.device) < 0.5
    return torch.where(hit, salt.to(x.dtype), x)


def _gaussian_blur(x: torch.Tensor, sigma: float, _: torch.Generator) -> torch.Tensor:
    # skimage.filters.gaussian: truncate at 4 sigma, edges extended by the nearest pixel.
    radius = int(4 * sigma + 0.5)
    t = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    k = k / k.sum()
    c = x.shape[1]
    y = F.pad(x, (radius, radius, radius, radius), mode="replicate")
    y = F.conv2d(y, k.view(1, 1, 1, -1).repeat(c, 1, 1, 1), groups=c)
    return F.conv2d(y, k.view(1, 1, -1, 1).repeat(c, 1, 1, 1), groups=c)


def _contrast(x: torch.Tensor, factor: float, _: torch.Generator) -> torch.Tensor:
    mean = x.mean(dim=(2, 3), keepdim=True)
    return (x - mean) * factor + mean


def _brightness(x: torch.Tensor, delta: float, _: torch.Generator) -> torch.Tensor:
    # HSV value + delta with hue and saturation kept: for fixed (h, s) every channel is proportional to v, so scale
    # by v'/v. A black pixel has s = 0 and becomes grey v'.
    if x.shape[1] == 1:
        return x + delta
    v = x.amax(dim=1, keepdim=True)
    v_new = (v + delta).clamp(max=1.0)
    return torch.where(v > 0, x * (v_new / v.clamp(min=1e-12)), v_new.expand_as(x))


def _per_image(x: torch.Tensor, fn: Callable[[np.ndarray], np.ndarray]) -> torch.Tensor:
    """Applies a numpy ``(H, W, C) -> (H, W, C)`` function image by image, on the CPU."""
    out = [torch.from_numpy(fn(img.permute(1, 2, 0).cpu().numpy())).permute(2, 0, 1) for img in x]
    return torch.stack(out).to(x.device, x.dtype)


def _jpeg_compression(x: torch.Tensor, quality: float, _: torch.Generator) -> torch.Tensor:
    def codec(img: np.ndarray) -> np.ndarray:
        pixels = (img.clip(0, 1) * 255).round().astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels[..., 0] if pixels.shape[2] == 1 else pixels).save(buf, "JPEG", quality=int(quality))
        decoded = np.asarray(Image.open(buf), dtype=np.float32) / 255
        return decoded.reshape(img.shape)

    return _per_image(x, codec)


def _pixelate(x: torch.Tensor, factor: float, _: torch.Generator) -> torch.Tensor:
    def box(img: np.ndarray) -> np.ndarray:
        h, w, _ = img.shape
        small = (int(w * factor), int(h * factor))
        channels = [np.asarray(Image.fromarray(np.ascontiguousarray(img[..., c], dtype=np.float32), "F")
                               .resize(small, Image.BOX).resize((w, h), Image.BOX)) for c in range(img.shape[2])]
        return np.stack(channels, axis=2)

    return _per_image(x, box)


_FUNCS: dict[str, Callable[[torch.Tensor, float, torch.Generator], torch.Tensor]] = {
    "gaussian_noise": _gaussian_noise,
    "shot_noise": _shot_noise,
    "impulse_noise": _impulse_noise,
    "gaussian_blur": _gaussian_blur,
    "contrast": _contrast,
    "brightness": _brightness,
    "jpeg_compression": _jpeg_compression,
    "pixelate": _pixelate,
}
