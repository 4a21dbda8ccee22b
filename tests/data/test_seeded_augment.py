"""``sampler.seeded``: a training sample's augmentation, RandAugment included, is a function of its seed alone, so a
resumed run replays it; and the caller's own generators come back as they were."""

from __future__ import annotations

import random

import numpy as np
import torch
from PIL import Image

from sigmanens_dist.data.raw import SeededAugment, image_folder_transforms
from sigmanens_dist.data.sampler import sample_seed


def _images() -> list[tuple[Image.Image, int]]:
    rng = np.random.default_rng(0)
    return [(Image.fromarray(rng.integers(0, 256, (20, 26, 3), dtype=np.uint8)), i) for i in range(4)]


def _disturb(k: int) -> None:
    """What a worker or a resumed run may hold: global generators anywhere else than where the first pass had them."""
    np.random.seed(100 + k)
    random.seed(200 + k)
    torch.manual_seed(300 + k)


def test_randaugment_replays_from_the_sample_seed_alone() -> None:
    """The same (sample, epoch, position) gives the same tensor after the global generators moved (timm's
    RandAugment picks its operations with numpy's, its magnitudes with python's); the caller's generators are
    restored, so its next draws (timm's Mixup on the training thread) do not depend on the augmentation."""
    train, _ = image_folder_transforms("imagenet", 16, "rand-m9-mstd0.5-inc1")
    data = SeededAugment(_images(), train)
    keys = [(i, sample_seed(7, 3, position)) for position, i in enumerate((2, 0, 3, 1, 2))]
    _disturb(0)
    first = [data[key][0] for key in keys]
    for k in (1, 2):
        _disturb(k)
        states = np.random.get_state(), random.getstate(), torch.get_rng_state()
        again = [data[key][0] for key in reversed(keys)][::-1]
        assert np.random.get_state()[1].tolist() == states[0][1].tolist() and np.random.get_state()[2] == states[0][2]
        assert random.getstate() == states[1] and torch.equal(torch.get_rng_state(), states[2])
        for position, (x, y) in enumerate(zip(first, again, strict=True)):
            assert torch.equal(x, y), position
    assert not torch.equal(first[0], first[4])  # the same image at another position: other draws


def test_randaugment_at_its_strongest_posterize_gives_black_images_instead_of_failing() -> None:
    """timm keeps 0 bits at magnitude 10 (PosterizeIncreasing; the ImageNet recipe's mstd0.5 draws it about once in
    660 images), which Pillow 13 refuses: the transform gives the black image Pillow used to, never a ValueError."""
    train, _ = image_folder_transforms("imagenet", 8, "rand-n3-m10-mstd0-inc1")
    black = image_folder_transforms("imagenet", 8, None)[1](Image.new("RGB", (8, 8)))
    data = SeededAugment(_images(), train)
    outputs = [data[(i % 4, sample_seed(0, 0, i))][0] for i in range(60)]
    assert any(torch.equal(x, black) for x in outputs)  # posterize last: nothing after it changed the black
