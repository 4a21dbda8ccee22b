"""CIFAR-10-C corruptions (Hendrycks & Dietterich, ICLR 2019), applied on the fly to float images in [0, 1].

Severity tables are those of the reference ``make_cifar_c.py``. Corruptions work on ``(C, H, W)`` or
``(B, C, H, W)`` tensors before normalisation, so an ensemble can be scored under shift without a pre-rendered
copy of the test set. The reference works on uint8 PIL images; here values stay float (no 1/255 rounding), except
where the corruption is itself a uint8 codec (JPEG). Given the same ``seed`` the output is the same, on any device.

All fifteen of the benchmark but frost (it blends in six photographs of frost that the reference ships beside its
script), and its four extras speckle_noise, gaussian_blur, spatter and saturate, which ``sigmanens eval`` keeps for
the validation shift (:data:`~sigmanens_dist.catalog.corruption_table.SHIFT_SPLITS`). Motion blur (and the snow
streaks, which use it) is ImageMagick's kernel in the reference: here the same one-sided Gaussian along a random
direction, sampled at whole pixels with the edge pixel repeated; sizes that the reference ties to 32 px (glass blur's
sweep, elastic's displacement, fog's fractal) follow the image's own size. Spatter's water edges use OpenCV's
operators in the reference (Canny, the 5 × 5 chamfer distance, histogram equalisation, box filters): here the same
operators in torch, checked against OpenCV in the tests. A one-channel image is a grey RGB image whose colours
(spatter's water and mud, saturate's result) are read back as their luma, 0.299 R + 0.587 G + 0.114 B, as OpenCV's
RGB-to-grey does.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from sigmanens_dist.catalog.corruption_table import CORRUPTIONS, PARAMETERS, SEVERITIES, unknown
from sigmanens_dist.errors import UsageError

__all__ = ["CORRUPTIONS", "SEVERITIES", "corrupt"]


def corrupt(x: torch.Tensor, name: str, severity: int, seed: int = 0) -> torch.Tensor:
    """``x`` (float, values in [0, 1], ``(C, H, W)`` or ``(B, C, H, W)``) under corruption ``name`` at ``severity``
    1–5; a new tensor of the same shape, dtype and device, in [0, 1]."""
    if name not in PARAMETERS:
        raise UsageError(unknown([name]))
    if isinstance(severity, bool) or severity not in SEVERITIES:
        raise UsageError(f"severity {severity!r} is not one of {', '.join(map(str, SEVERITIES))}")
    # an invariant: eval hands normalised float batches (a bug if hit)
    if not x.is_floating_point() or x.ndim not in (3, 4):
        raise ValueError(f"expected a float image tensor (C, H, W) or (B, C, H, W) in [0, 1]; got {x.dtype} "
                         f"{tuple(x.shape)}")
    batched = x if x.ndim == 4 else x.unsqueeze(0)
    g = torch.Generator(device=x.device).manual_seed(seed)
    out = _FUNCS[name](batched.float(), PARAMETERS[name][severity - 1], g).clamp_(0, 1).to(x.dtype)
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


def _speckle_noise(x: torch.Tensor, std: float, g: torch.Generator) -> torch.Tensor:
    return x + x * std * torch.randn(x.shape, generator=g, device=x.device)


def _conv_same(x: torch.Tensor, kernel: torch.Tensor, mode: str = "reflect") -> torch.Tensor:
    """Every channel convolved with the 2-D ``kernel`` (odd sides), borders padded by ``mode``."""
    kh, kw = kernel.shape
    c = x.shape[1]
    y = F.pad(x, (kw // 2, kw // 2, kh // 2, kh // 2), mode=mode)
    return F.conv2d(y, kernel.to(x).expand(c, 1, kh, kw), groups=c)


def _defocus_blur(x: torch.Tensor, params: tuple[float, float], _: torch.Generator) -> torch.Tensor:
    # A disk of the given radius on a 17 x 17 grid, anti-aliased by a 3 x 3 Gaussian (OpenCV's GaussianBlur with
    # its reflect-101 border), then filtered over the image with reflect-101 borders (cv2.filter2D's default).
    radius, alias = params
    t = torch.arange(-8, 9, dtype=torch.float64)
    disk = ((t[:, None] ** 2 + t[None, :] ** 2) <= radius ** 2).double()
    disk = disk / disk.sum()
    g3 = torch.exp(-0.5 * (torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64) / alias) ** 2)
    g3 = g3 / g3.sum()
    disk = _conv_same(disk[None, None], g3[:, None] * g3[None, :])[0, 0]
    return _conv_same(x, disk.float())


def _glass_blur(x: torch.Tensor, params: tuple[float, int, int], g: torch.Generator) -> torch.Tensor:
    # Blur, quantise to 8 bits, then sweep the image from the bottom-right corner swapping each pixel with a random
    # neighbour up to `delta` away (numpy's randint(-delta, delta): the upper end excluded), then blur again.
    sigma, delta, sweeps = params
    y = (_gaussian_blur(x, sigma, g).clamp(0, 1) * 255).floor() / 255
    b, _, h, w = y.shape
    rows = torch.arange(b, device=x.device)
    for _ in range(sweeps):
        for i in range(h - delta, delta, -1):
            for j in range(w - delta, delta, -1):
                d = torch.randint(-delta, delta, (2, b), generator=g, device=x.device)
                i2, j2 = i + d[1], j + d[0]
                here, there = y[rows, :, i, j].clone(), y[rows, :, i2, j2].clone()
                y[rows, :, i, j], y[rows, :, i2, j2] = there, here
    return _gaussian_blur(y, sigma, g)


def _shift_sum(x: torch.Tensor, weights: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Sum over k of ``weights[k]`` × the image sampled k pixels away along ``angle`` (radians, one per image),
    rounded to whole pixels, the edge pixel repeated beyond the border."""
    b, _, h, w = x.shape
    rows = torch.arange(h, device=x.device)
    cols = torch.arange(w, device=x.device)
    batch = torch.arange(b, device=x.device)[:, None, None]
    out = torch.zeros_like(x)
    for k, weight in enumerate(weights.tolist()):
        dy = torch.round(k * torch.sin(angle)).long()[:, None, None]
        dx = torch.round(k * torch.cos(angle)).long()[:, None, None]
        r = (rows[None, :, None] + dy).clamp(0, h - 1).expand(b, h, w)
        c = (cols[None, None, :] + dx).clamp(0, w - 1).expand(b, h, w)
        out += weight * x[batch, :, r, c].permute(0, 3, 1, 2)
    return out


def _motion_kernel(radius: float, sigma: float) -> torch.Tensor:
    # ImageMagick's MotionBlurImage: 2 * radius + 1 one-sided Gaussian weights, normalised
    k = torch.arange(2 * int(radius) + 1, dtype=torch.float32)
    weights = torch.exp(-(k ** 2) / (2 * sigma ** 2))
    return weights / weights.sum()


def _motion_blur(x: torch.Tensor, params: tuple[float, float], g: torch.Generator) -> torch.Tensor:
    angle = (torch.rand(x.shape[0], generator=g, device=x.device) * 90 - 45).deg2rad()
    return _shift_sum(x, _motion_kernel(*params), angle)


def _clipped_zoom(x: torch.Tensor, factor: float) -> torch.Tensor:
    """The centre ceil(size / factor) crop zoomed back (linear, corners aligned as scipy's ``zoom(order=1)``) and
    trimmed to the input's size."""
    h, w = x.shape[-2:]
    ch, cw = math.ceil(h / factor), math.ceil(w / factor)
    top, left = (h - ch) // 2, (w - cw) // 2
    crop = x[..., top:top + ch, left:left + cw]
    zh, zw = round(ch * factor), round(cw * factor)
    zoomed = F.interpolate(crop, size=(zh, zw), mode="bilinear", align_corners=True)
    t, lft = (zh - h) // 2, (zw - w) // 2
    return zoomed[..., t:t + h, lft:lft + w]


def _zoom_blur(x: torch.Tensor, factors: tuple[float, ...], _: torch.Generator) -> torch.Tensor:
    return (x + sum(_clipped_zoom(x, f) for f in factors)) / (len(factors) + 1)


def _snow(x: torch.Tensor, params: tuple[float, ...], g: torch.Generator) -> torch.Tensor:
    # Gaussian flakes, zoomed, thresholded, 8-bit, streaked by a motion blur pointing downwards (-135..-45 degrees),
    # added twice (the second copy rotated half a turn) over the image brightened towards its grey level.
    mean, std, zoom, threshold, radius, sigma, keep = params
    b, c, h, w = x.shape
    flakes = mean + std * torch.randn((b, 1, h, w), generator=g, device=x.device)
    flakes = _clipped_zoom(flakes, zoom)
    flakes = torch.where(flakes < threshold, torch.zeros_like(flakes), flakes)
    flakes = (flakes.clamp(0, 1) * 255).floor() / 255
    angle = (torch.rand(b, generator=g, device=x.device) * 90 - 135).deg2rad()
    flakes = (_shift_sum(flakes, _motion_kernel(radius, sigma), angle) * 255).round() / 255
    grey = x if c == 1 else (0.299 * x[:, :1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])
    x = keep * x + (1 - keep) * torch.maximum(x, grey * 1.5 + 0.5)
    return x + flakes + flakes.flip(-1, -2)


def _plasma(batch: int, size: int, decay: float, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """Diamond-square fractal noise, ``(batch, size, size)`` in [0, 1]; ``size`` a power of two."""
    grid = torch.zeros((batch, size, size), dtype=torch.float64, device=device)
    step, wibble = size, 100.0

    def wibbled(a: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(a.shape, generator=g, device=device, dtype=torch.float64) * 2 * wibble - wibble
        return a / 4 + wibble * noise

    while step >= 2:
        half = step // 2
        corners = grid[:, 0:size:step, 0:size:step]
        squares = corners + corners.roll(-1, dims=1)
        squares = squares + squares.roll(-1, dims=2)
        grid[:, half:size:step, half:size:step] = wibbled(squares)
        centres = grid[:, half:size:step, half:size:step]
        corners = grid[:, 0:size:step, 0:size:step]
        grid[:, 0:size:step, half:size:step] = wibbled(centres + centres.roll(1, dims=1) + corners
                                                       + corners.roll(-1, dims=2))
        grid[:, half:size:step, 0:size:step] = wibbled(centres + centres.roll(1, dims=2) + corners
                                                       + corners.roll(-1, dims=1))
        step //= 2
        wibble /= decay
    low = grid.amin(dim=(1, 2), keepdim=True)
    grid = grid - low
    return grid / grid.amax(dim=(1, 2), keepdim=True)


def _fog(x: torch.Tensor, params: tuple[float, float], g: torch.Generator) -> torch.Tensor:
    strength, decay = params
    b, _, h, w = x.shape
    size = 1 << (max(h, w) - 1).bit_length()  # the next power of two (the reference's 32 for CIFAR)
    fog = _plasma(b, size, decay, g, x.device)[:, None, :h, :w].to(x.dtype)
    peak = x.amax(dim=(1, 2, 3), keepdim=True)
    return (x + strength * fog) * peak / (peak + strength)


def _sample(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``x`` read at fractional pixel positions ``(B, H, W)`` (bilinear, borders reflected about the edge pixels)."""
    h, w = x.shape[-2:]
    grid = torch.stack([cols / (w - 1) * 2 - 1, rows / (h - 1) * 2 - 1], dim=-1).to(x.dtype)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=True)


def _elastic_transform(x: torch.Tensor, params: tuple[float, float, float], g: torch.Generator) -> torch.Tensor:
    # A random affine map (three points jittered by up to `jitter` × size), then a smooth random displacement field
    # (uniform noise, Gaussian-smoothed, times `amount` × size), both read bilinearly with reflected borders.
    amount, smooth, jitter = (p * min(x.shape[-2:]) for p in params)
    b, _, h, w = x.shape
    dev = x.device
    centre = torch.tensor([h // 2, w // 2], dtype=torch.float64, device=dev)
    side = min(h, w) // 3
    src = torch.stack([centre + side, centre + torch.tensor([side, -side], device=dev), centre - side])  # (3, 2)
    dst = src + (torch.rand((b, 3, 2), generator=g, device=dev, dtype=torch.float64) * 2 - 1) * jitter
    ones = torch.ones((b, 3, 1), dtype=torch.float64, device=dev)
    # the inverse map, dst -> src: each output pixel reads the source where the affine map sends nothing else
    inverse = torch.linalg.solve(torch.cat([dst, ones], dim=2), src.expand(b, 3, 2))  # (B, 3, 2)
    rows, cols = torch.meshgrid(torch.arange(h, device=dev, dtype=torch.float64),
                                torch.arange(w, device=dev, dtype=torch.float64), indexing="ij")
    points = torch.stack([rows, cols, torch.ones_like(rows)], dim=-1).reshape(1, -1, 3)
    back = (points @ inverse).reshape(b, h, w, 2)
    y = _sample(x, back[..., 0], back[..., 1])
    if amount == 0:
        return y
    field = torch.rand((b, 2, h, w), generator=g, device=dev) * 2 - 1
    field = _gaussian_blur(field, smooth, g) * amount
    return _sample(y, rows + field[:, 1].double(), cols + field[:, 0].double())


_LUMA = (0.299, 0.587, 0.114)  # OpenCV's RGB -> grey weights


def _colour(rgb: tuple[int, int, int], x: torch.Tensor) -> torch.Tensor:
    """An 8-bit RGB colour as a ``(1, C, 1, 1)`` tensor like ``x``: the colour on three channels, its luma on one."""
    values = [c / 255 for c in rgb]
    if x.shape[1] == 1:
        values = [sum(w * v for w, v in zip(_LUMA, values, strict=True))]
    return torch.tensor(values, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)


def _filter3(x: torch.Tensor, kernel: list[list[float]], mode: str) -> torch.Tensor:
    """``x`` ``(B, 1, H, W)`` correlated with a 3 × 3 ``kernel`` (OpenCV's filter2D, not flipped), padded by
    ``mode`` (``replicate``; ``reflect`` is OpenCV's default, reflect-101)."""
    k = torch.tensor(kernel, dtype=x.dtype, device=x.device).view(1, 1, 3, 3)
    return F.conv2d(F.pad(x, (1, 1, 1, 1), mode=mode), k)


def _canny(img: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """OpenCV's ``Canny(img, low, high)`` (3 × 3 Sobel with replicated borders, L1 magnitude, non-maximum
    suppression in four directions with its tan 22.5° test and its strict/non-strict neighbour comparisons, 8-connected
    hysteresis) on 8-bit values held as float ``(B, 1, H, W)``; the edge pixels as booleans."""
    sobel = [[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]
    dx = _filter3(img, sobel, "replicate")
    dy = _filter3(img, [list(r) for r in zip(*sobel, strict=True)], "replicate")
    mag = dx.abs() + dy.abs()
    h, w = mag.shape[-2:]
    padded = F.pad(mag, (1, 1, 1, 1))  # beyond the image the magnitude is 0

    def at(di: int, dj: int) -> torch.Tensor:
        return padded[..., 1 + di:1 + di + h, 1 + dj:1 + dj + w]

    tg22x = dx.abs() * 13573  # tan(22.5°) · 2^15, rounded, as OpenCV
    ys = dy.abs() * 32768
    horizontal = ys < tg22x
    vertical = ~horizontal & (ys > tg22x + dx.abs() * 65536)
    opposite = (dx < 0) ^ (dy < 0)  # OpenCV's (dx ^ dy) < 0
    diagonal = torch.where(opposite, (mag > at(-1, 1)) & (mag > at(1, -1)), (mag > at(-1, -1)) & (mag > at(1, 1)))
    peak = torch.where(horizontal, (mag > at(0, -1)) & (mag >= at(0, 1)),
                       torch.where(vertical, (mag > at(-1, 0)) & (mag >= at(1, 0)), diagonal))
    weak = peak & (mag > low)
    edges = weak & (mag > high)
    while True:
        grown = edges | (weak & (F.max_pool2d(edges.to(img.dtype), 3, 1, 1) > 0))
        if torch.equal(grown, edges):
            return edges
        edges = grown


def _chamfer_distance(zero: torch.Tensor, cap: float) -> torch.Tensor:
    """OpenCV's ``distanceTransform(…, DIST_L2, 5)``: the 5 × 5 chamfer distance (steps 1, 1.4 and 2.1969 in its
    16-bit fixed point) of every pixel to the nearest ``zero`` pixel, exact up to ``cap`` and at least ``cap`` beyond
    (the only part the caller keeps); float32 ``(B, 1, H, W)``."""
    one = 1 << 16
    steps = [((0, 1), one), ((1, 1), 91750), ((1, 2), 143976)]  # round(1.4 · 2^16), round(2.1969 · 2^16)
    offsets = [((a * sa, b * sb), cost) for (a, b), cost in steps for sa in (1, -1) for sb in (1, -1)]
    offsets += [((b, a), cost) for (a, b), cost in offsets if a != b]
    offsets = list(dict(offsets).items())  # 4 + 4 + 8 distinct moves
    big = int(cap * one) + 4 * 143976
    dist = torch.where(zero, 0, big).long()
    h, w = dist.shape[-2:]
    for _ in range(int(cap) + 1):  # a path shorter than cap has fewer than cap + 1 steps, each at least 1
        padded = F.pad(dist, (2, 2, 2, 2), value=big)
        best = dist
        for (di, dj), cost in offsets:
            best = torch.minimum(best, padded[..., 2 + di:2 + di + h, 2 + dj:2 + dj + w] + cost)
        if torch.equal(best, dist):
            break
        dist = best.clamp(max=big)
    return (dist.double() / one).float()


def _box3(x: torch.Tensor) -> torch.Tensor:
    """OpenCV's ``blur(x, (3, 3))``: the mean of each 3 × 3 neighbourhood, borders reflect-101."""
    return F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), 3, 1)


def _equalize_hist(v: torch.Tensor) -> torch.Tensor:
    """OpenCV's ``equalizeHist`` of 8-bit values held as float ``(B, 1, H, W)``, image by image: the lowest value
    present maps to 0, value k to round(255 · #(first < value ≤ k) / #(value > first)) in float32."""
    b = v.shape[0]
    flat = v.reshape(b, -1).long()
    hist = torch.zeros((b, 256), dtype=torch.long, device=v.device).scatter_add_(1, flat, torch.ones_like(flat))
    first = (hist > 0).long().argmax(1, keepdim=True)
    cum = hist.cumsum(1)
    rest = (flat.shape[1] - hist.gather(1, first)).float()
    scale = torch.where(rest > 0, 255 / rest.clamp(min=1), 0)
    lut = ((cum - cum.gather(1, first)).float() * scale).round()
    lut = torch.where(rest > 0, lut, first.float())  # one value only: OpenCV keeps it
    return lut.gather(1, flat).view_as(v).to(v.dtype)


def _water(layer: torch.Tensor) -> torch.Tensor:
    """Spatter's water mask from the 8-bit liquid layer ``(B, 1, H, W)`` (float values 0..255), before its strength:
    the layer times a shading that rises away from the liquid's edges, scaled to a maximum of 1 per image."""
    edges = _canny(layer, 50, 150)
    dist = _chamfer_distance(edges, 20).clamp(max=20)
    dist = _box3(dist.double()).float().floor()  # float blur, then numpy's cast to uint8 (truncation)
    dist = _equalize_hist(dist.double())
    emboss = [[-2.0, -1.0, 0.0], [-1.0, 1.0, 1.0], [0.0, 1.0, 2.0]]
    dist = _filter3(dist, emboss, "reflect").clamp(0, 255)  # filter2D into uint8 saturates
    dist = (F.avg_pool2d(F.pad(dist, (1, 1, 1, 1), mode="reflect"), 3, 1, divisor_override=1) / 9).round()
    m = layer * dist
    peak = m.amax(dim=(2, 3), keepdim=True)
    return torch.where(peak > 0, m / peak.clamp(min=1e-12), 0)


def _spatter(x: torch.Tensor, params: tuple[float, ...], g: torch.Generator) -> torch.Tensor:
    # A liquid layer (Gaussian noise, blurred, thresholded), one per image. Severities 1-3: water, pale turquoise,
    # added where the layer is, shaded by the distance to its edges; 4-5: mud brown, blended in where the layer's
    # blurred mask exceeds 0.8.
    loc, scale, sigma, threshold, strength, mud = params
    b, _, h, w = x.shape
    liquid = loc + scale * torch.randn((b, 1, h, w), generator=g, device=x.device, dtype=torch.float64)
    liquid = _gaussian_blur(liquid, sigma, g)
    liquid = torch.where(liquid < threshold, 0, liquid)
    if mud:
        m = _gaussian_blur((liquid > threshold).to(x.dtype), strength, g)
        m = torch.where(m < 0.8, 0, m)
        return x * (1 - m) + _colour((63, 42, 20), x) * m
    layer = (liquid.clamp(0, 1) * 255).floor()  # the reference's uint8 layer (it wraps above 1: never seen there)
    return x + _water(layer).to(x.dtype) * strength * _colour((175, 238, 238), x)


def _saturate(x: torch.Tensor, params: tuple[float, float], _: torch.Generator) -> torch.Tensor:
    # HSV saturation s -> clip(a s + b) with hue and value kept. For fixed (h, v) each channel is v - s v w with w in
    # [0, 1] set by the hue alone, w = (v - channel) / (v - min); a grey pixel has hue 0 (red) and w = (0, 1, 1), so
    # b > 0 tints it red, as skimage's hsv2rgb does in the reference.
    a, b = params
    rgb = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
    v = rgb.amax(dim=1, keepdim=True)
    delta = v - rgb.amin(dim=1, keepdim=True)
    grey = torch.tensor([0.0, 1.0, 1.0], dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    weight = torch.where(delta > 0, (v - rgb) / delta.clamp(min=1e-12), grey)
    s = torch.where(v > 0, delta / v.clamp(min=1e-12), 0)
    out = v - (s * a + b).clamp(0, 1) * v * weight
    if x.shape[1] == 1:
        return sum(c * out[:, i:i + 1] for i, c in enumerate(_LUMA))
    return out


_FUNCS: dict[str, Callable[[torch.Tensor, Any, torch.Generator], torch.Tensor]] = {
    "gaussian_noise": _gaussian_noise,
    "shot_noise": _shot_noise,
    "impulse_noise": _impulse_noise,
    "gaussian_blur": _gaussian_blur,
    "contrast": _contrast,
    "brightness": _brightness,
    "jpeg_compression": _jpeg_compression,
    "pixelate": _pixelate,
    "speckle_noise": _speckle_noise,
    "defocus_blur": _defocus_blur,
    "glass_blur": _glass_blur,
    "motion_blur": _motion_blur,
    "zoom_blur": _zoom_blur,
    "snow": _snow,
    "fog": _fog,
    "elastic_transform": _elastic_transform,
    "spatter": _spatter,
    "saturate": _saturate,
}
