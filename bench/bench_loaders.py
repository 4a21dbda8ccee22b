"""Training-loader throughput on the same JPEGs, at the same transforms and the same number of workers; every number
is also given as a ratio against torchvision ``ImageFolder`` + ``DataLoader`` (PIL) measured in the same run.

    python bench/bench_loaders.py                       # 2000 JPEGs of 160 px, crops of 128, 2 workers
    python bench/bench_loaders.py --images 5000 --workers 4 --epochs 3

Transforms (the ffcv-imagenet train recipe): random-resized crop to ``--img``, horizontal flip, normalise to float.
FFCV's "workers" are numba threads, the others' are DataLoader processes. FFCV is measured with every image stored
as JPEG (the same decode work as the others) and as ffcv-imagenet writes ImageNet (50% JPEG for its ResNet-50
recipe, 10% for ResNet-18, the rest raw pixels, which need no decoding), each with
FFCV's own decoder and with ``ffcv_decode.SeededCropDecoder`` (the trainer's: reproducible crop and flip draws),
and all-JPEG with ``train.randaugment`` as ImageNet's recipe sets it (timm's RandAugment of each crop in ``--workers``
processes, ``ffcv_augment``), next to ImageFolder with the same RandAugment.
An epoch is timed from the loader's first request to its last batch, so worker start-up counts; one untimed epoch
first pays one-off costs (FFCV's JIT compilation, the OS page cache). The last line is a ceiling for any loader that
decodes every JPEG whole: the rate of JPEG decoding alone, times the number of workers.

Streaming: where Debian's nginx is installed, the same webdataset shards are also read over HTTP from an nginx
started here on 127.0.0.1 (``data.remote.read_ahead`` 1, the default), and the rate is given as a ratio to the same
shards read from local disk.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets

from sigmanens_dist.data.raw import timm_train_transform
from sigmanens_dist.data.synthetic_tree import make_image_folder
from sigmanens_dist.data.webdataset_io import WebDatasetLoader, image_transform
from sigmanens_dist.data.webdataset_write import write_shards
from sigmanens_dist.storage.remote import RemotePath

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
RANDAUGMENT = "rand-m9-mstd0.5-inc1"  # configs/imagenet_vit.yaml's


def _rates(candidates: dict[str, Callable[[int], Iterable]], epochs: int) -> dict[str, float]:
    """Median images/s of each candidate over ``epochs`` timed epochs, after one untimed one. Candidates take turns
    epoch by epoch, so a slow spell of a shared machine hits them all rather than one."""
    rates: dict[str, list[float]] = {name: [] for name in candidates}
    for epoch in range(epochs + 1):
        for name, make_epoch in candidates.items():
            t, n = time.perf_counter(), 0
            for batch in make_epoch(epoch):
                n += len(batch[1])
            if epoch:
                rates[name].append(n / (time.perf_counter() - t))
    return {name: statistics.median(r) for name, r in rates.items()}


def _decode_epoch(files: list[str], workers: int) -> Callable[[int], Iterable]:
    """Decoding every JPEG whole and nothing else, scaled by ``workers`` as if they split it perfectly: a ceiling
    for any loader that decodes each JPEG in full. Yields one pseudo-batch whose length credits ``workers`` images
    per decoded one."""

    def epoch(_: int) -> Iterable:
        for path in files:
            Image.open(path).convert("RGB")
        yield None, range(len(files) * workers)

    return epoch


def _nginx(root: Path, port: int) -> subprocess.Popen | None:
    """Debian's nginx serving ``root`` on 127.0.0.1:``port`` with a config of its own; None when not installed."""
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if exe is None:
        return None
    conf = Path(tempfile.mkdtemp(prefix="bench_nginx_"))
    temp = " ".join(f"{k}_temp_path {conf / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (conf / "nginx.conf").write_text(
        f"daemon off; user root; worker_processes 1; pid {conf / 'pid'}; error_log {conf / 'error.log'};\n"
        f"events {{ worker_connections 64; }}\nhttp {{ access_log off; {temp}\n"
        f"  server {{ listen 127.0.0.1:{port}; root {root}; }} }}\n")
    proc = subprocess.Popen([exe, "-p", str(conf), "-e", str(conf / "error.log"), "-c", str(conf / "nginx.conf")])
    time.sleep(1.0)
    return proc if proc.poll() is None else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path("/tmp/sigmanens_bench_loaders"))
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--size", type=int, default=160, help="side of the generated JPEGs")
    p.add_argument("--img", type=int, default=128, help="crop size fed to the model")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()

    classes = 10
    tree = args.root / f"jpeg_{args.images}_{args.size}"
    if not (tree / "train").is_dir():
        make_image_folder(tree, classes, args.images // classes, args.size, seed=0, val_per_class=1)
    folder = datasets.ImageFolder(str(tree / "train"), transform=image_transform(True, args.img, MEAN, STD))
    n = len(folder)
    # Enough shards for 2 × workers streams (so the webdataset loader also runs with more workers).
    manifest = write_shards(datasets.ImageFolder(str(tree / "train")), args.root / f"wds_{args.images}_{args.size}",
                            max_count=-(-n // (4 * max(1, args.workers))))

    def folder_epoch(epoch: int) -> Iterable:
        g = torch.Generator().manual_seed(epoch)
        return DataLoader(folder, batch_size=args.batch, shuffle=True, drop_last=True, num_workers=args.workers,
                          generator=g)

    wds = WebDatasetLoader(manifest, args.batch, 0, 1, args.workers, seed=0,
                           transform=image_transform(True, args.img, MEAN, STD))
    def folder_randaugment_epoch(epoch: int) -> Iterable:
        g = torch.Generator().manual_seed(epoch)
        return DataLoader(folder_rand, batch_size=args.batch, shuffle=True, drop_last=True,
                          num_workers=args.workers, generator=g)

    folder_rand = datasets.ImageFolder(str(tree / "train"),
                                       transform=timm_train_transform(args.img, RANDAUGMENT, MEAN, STD))
    candidates: dict[str, Callable[[int], Iterable]] = {"ImageFolder + DataLoader (PIL)": folder_epoch,
                                                        "webdataset shards": wds.iter_epoch,
                                                        "ImageFolder + RandAugment": folder_randaugment_epoch}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = _nginx(args.root, port)
    if server is None:
        print("nginx not installed or not started: the streaming row is skipped (launch/setup.sh installs it)")
    else:
        url = f"http://127.0.0.1:{port}/{manifest.relative_to(args.root).as_posix()}"
        remote = WebDatasetLoader(RemotePath(url), args.batch, 0, 1, args.workers, seed=0,
                                  transform=image_transform(True, args.img, MEAN, STD))
        candidates["webdataset shards over HTTP (nginx)"] = remote.iter_epoch
    try:
        from sigmanens_dist.data.ffcv_io import FFCVLoader, write_beton
    except ImportError:
        print("FFCV not installed: skipped (pip install 'sigmanens-dist[ffcv]')")
    else:
        # ffcv-imagenet stores 50% of images as JPEG for ResNet-50 and 10% for ResNet-18, the rest raw.
        for storage, jpeg_share in (("all JPEG", 1.0), ("50% JPEG", 0.5), ("10% JPEG", 0.1)):
            beton = args.root / f"ffcv_{jpeg_share}_{args.images}_{args.size}.beton"
            if not beton.is_file():
                write_beton(datasets.ImageFolder(str(tree / "train")), beton, max_resolution=None, jpeg_quality=90,
                            write_mode="proportion", compress_probability=jpeg_share, num_workers=args.workers)
            for decoder, stock in (("FFCV decoder", True), ("seeded crop decoder", False)):
                loader = FFCVLoader(beton, args.batch, 0, 1, args.workers, seed=0, train=True, img_size=args.img,
                                    mean=MEAN, std=STD, stock_decoder=stock)
                candidates[f"FFCV {storage}, {decoder}"] = loader.iter_epoch
            if jpeg_share == 1.0:
                augmented = FFCVLoader(beton, args.batch, 0, 1, args.workers, seed=0, train=True, img_size=args.img,
                                       mean=MEAN, std=STD, randaugment=RANDAUGMENT)
                candidates["FFCV all JPEG, seeded crop decoder + RandAugment"] = augmented.iter_epoch

    files = [path for path, _ in folder.samples]
    candidates["ceiling: JPEG decode alone × workers"] = _decode_epoch(files, args.workers)

    print(f"\n{n} JPEGs of {args.size} px → random-resized crop {args.img} + flip + normalise; batch {args.batch}, "
          f"{args.workers} workers, median of {args.epochs} epochs")
    try:
        rates = _rates(candidates, args.epochs)
    finally:
        if server is not None:
            server.terminate()
    base = rates["ImageFolder + DataLoader (PIL)"]
    for name, rate in rates.items():
        print(f"  {name:<48} {rate:8.0f} img/s   {rate / base:5.2f}× ImageFolder")
    print(f"  (the ceiling: PIL/libjpeg-turbo decoding in one process, times {args.workers}; no crop, resize or "
          f"normalise)")
    if "webdataset shards over HTTP (nginx)" in rates:
        ratio = rates["webdataset shards over HTTP (nginx)"] / rates["webdataset shards"]
        print(f"  streaming: the same shards over HTTP from nginx on 127.0.0.1 run at {ratio:.2f}× local disk")


if __name__ == "__main__":
    main()
