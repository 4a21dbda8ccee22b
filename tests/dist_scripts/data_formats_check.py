"""Run under torchrun: every rank reads the same webdataset shards and .beton through its loader, for a full epoch
and from a resume point, and saves what it saw (keys, labels, sample order, images) for the test to compare.

    data_formats_check.py OUT_DIR MANIFEST BETON
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sigmanens_dist.data.ffcv_io import FFCVLoader
from sigmanens_dist.data.webdataset_io import WebDatasetLoader, image_transform
from sigmanens_dist.distributed.env import all_gather_object, init_distributed

out, manifest, beton = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
env = init_distributed("gloo")
B, SEED, EPOCH, RESUME_AT = 4, 7, 1, 3
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
result: dict[str, dict] = {}

wds = WebDatasetLoader(manifest, B, env.rank, env.world_size, num_workers=2, seed=SEED,
                       transform=image_transform(True, 24, MEAN, STD), shuffle_buffer=16, return_keys=True)
full = list(wds.iter_epoch(EPOCH))
resumed = list(wds.iter_epoch(EPOCH, RESUME_AT))
result["wds"] = {
    "len": len(wds), "batches": len(full), "keys": [b[2] for b in full], "labels": [b[1] for b in full],
    "shape": tuple(full[0][0].shape), "dtypes": (full[0][0].dtype, full[0][1].dtype),
    "resumed_keys": [b[2] for b in resumed],
    "resumed_images_equal": all(torch.equal(a[0], b[0]) for a, b in zip(full[RESUME_AT:], resumed, strict=True)),
    "next_epoch_keys": [b[2] for b in wds.iter_epoch(EPOCH + 1)],
}

train = FFCVLoader(beton, B, env.rank, env.world_size, num_workers=1, seed=SEED, train=True, img_size=24, mean=MEAN,
                   std=STD)
full = [(x.clone(), y.clone()) for x, y in train.iter_epoch(EPOCH)]
resumed = [(x.clone(), y.clone()) for x, y in train.iter_epoch(EPOCH, RESUME_AT)]
result["ffcv"] = {
    "len": len(train), "batches": len(full), "order": train.rank_order(EPOCH).astype("int64"),
    "labels": torch.cat([y for _, y in full]), "shape": tuple(full[0][0].shape),
    "dtypes": (full[0][0].dtype, full[0][1].dtype), "finite": all(bool(x.isfinite().all()) for x, _ in full),
    "resumed_labels": torch.cat([y for _, y in resumed]),
    "resumed_order": train.rank_order(EPOCH, RESUME_AT).astype("int64"),
    "resumed_images_equal": all(torch.equal(a[0], b[0]) for a, b in zip(full[RESUME_AT:], resumed, strict=True)),
}

# Eval: full-size centre crop of ratio 1 and mean 0 / std 1, so images compare with the source pixels directly.
val = FFCVLoader(beton, B, env.rank, env.world_size, num_workers=1, seed=SEED, train=False, img_size=32,
                 mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), crop_ratio=1.0)
batches = [(x.clone(), y.clone()) for x, y in val.iter_epoch(0)]
result["ffcv_eval"] = {"len": len(val), "batches": len(batches), "order": val.rank_order(0).astype("int64"),
                       "images": torch.cat([x for x, _ in batches]), "labels": torch.cat([y for _, y in batches])}

# What a DDP step loop relies on: every rank agrees on the number of steps it ran.
result["gathered_steps"] = all_gather_object((result["wds"]["batches"], result["ffcv"]["batches"]), env)
torch.save(result, out / f"rank{env.rank}.pt")
dist.barrier()
dist.destroy_process_group()
