"""bench/gpu_check.sh before a GPU is at hand: its CPU smoke run end to end, as a dry run of the GPU machine (only the
GPU image's packages importable, the carried wheels installed into an empty target), and the data path its trainer
row times (persistent loader workers, exact replay)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from sigmanens_dist.data.loaders import MapStyleStream
from sigmanens_dist.data.raw import SeededAugment, SyntheticImages
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.training.throughput import Throughput
from tests.helpers import REPO, SYNTHETIC, TINY_VIT, env, losses, run_train

BENCH = REPO / "bench"


def _names(path: Path) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {re.sub(r"[-_.]+", "-", re.split(r"[=<>!~ ;\[]", line)[0]).lower() for line in lines if line}


def _repack(name: str, out: Path) -> Path:
    """A wheel of an installed distribution, made from its installed files (no network): the carried-wheel folder
    of this machine's Python, as bench/gpu_wheels.sh --python-version makes it from PyPI."""
    dist = importlib.metadata.distribution(name)
    tag = next(line.split(": ", 1)[1] for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag: "))
    files = [f for f in dist.files or [] if ".." not in f.parts and "__pycache__" not in f.parts
             and f.name not in ("RECORD", "INSTALLER", "direct_url.json", "REQUESTED")]
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    wheel = out / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in files:
            z.write(f.locate(), str(f))
        z.writestr(f"{info}/RECORD", "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n")
    return wheel


def test_the_carried_wheels_and_the_image_hold_every_dependency() -> None:
    """What the trainer needs is in the GPU image or in bench/gpu_wheels.txt, and so is what a carried wheel needs."""
    image, carried = _names(BENCH / "gpu_image_packages.txt"), _names(BENCH / "gpu_wheels.txt")
    assert "torch" in image and "pydantic" not in image
    block = re.search(r"^dependencies = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(), flags=re.S | re.M)
    deps = re.findall(r'"([^"]+)"', block.group(1))
    needs = {re.sub(r"[-_.]+", "-", re.split(r"[=<>!~ ;\[]", d)[0]).lower() for d in deps}
    for name in carried:
        for req in importlib.metadata.requires(name) or []:
            if "extra ==" not in req:
                needs.add(re.sub(r"[-_.]+", "-", re.split(r"[=<>!~ ;\[(]", req)[0]).lower())
    assert needs - image - carried == set()


def test_throughput_times_steps_on_the_cpu_clock() -> None:
    window = Throughput(torch.device("cpu"))
    start = window.start()
    window.stop(start, 64)
    assert isinstance(start, float) and window.take_rate() > 0 and window.images == 0


def test_persistent_workers_replay_every_pass_like_a_fresh_loader() -> None:
    """One DataLoader with a persistent worker serves every epoch; a pass from any batch, and a pass after one that
    was abandoned midway, give what a loader without workers gives."""
    cpu = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    data = SeededAugment(SyntheticImages(48, size=4), lambda x: x + torch.rand(()))  # seeded per sample: any worker

    def passes(stream: MapStyleStream) -> list[list[torch.Tensor]]:
        out = [[x for x, _ in stream.iter_epoch(epoch)] for epoch in (0, 1)]
        out.append([x for x, _ in stream.iter_epoch(1, 3)])
        return out

    plain, persistent = MapStyleStream(data, 8, cpu, 5, 0), MapStyleStream(data, 8, cpu, 5, 1)
    want, got = passes(plain), passes(persistent)
    loader = persistent.loader
    assert loader is not None
    for again in (got, passes(persistent)):  # the second time through the same workers
        assert all(torch.equal(a, b) for w, g in zip(want, again, strict=True) for a, b in zip(w, g, strict=True))
    assert persistent.loader is loader
    assert [len(p) for p in got] == [6, 6, 3]
    cut = persistent.iter_epoch(2)
    next(cut)
    cut.close()  # the end of training, or a preemption: the workers stop
    assert persistent.loader is None
    again = [x for x, _ in persistent.iter_epoch(2, 1)]
    assert all(torch.equal(a, b) for a, b in zip(again, [x for x, _ in plain.iter_epoch(2, 1)], strict=True))


@pytest.mark.slow
def test_a_run_resumed_mid_epoch_with_persistent_workers_trains_the_same_steps(tmp_path: Path) -> None:
    """σN-Ens with its members' streams read by persistent workers, resumed from a mid-epoch checkpoint, across an
    epoch boundary: the same losses as the uninterrupted run."""
    common = [*TINY_VIT, *SYNTHETIC, "data.num_workers=1", "data.train_subset=136", "data.val_split=8",
              "model.num_members=2", "train.batch_size=16", "train.max_steps=12", "train.log_every_steps=1",
              "checkpoint.every_steps=6", "checkpoint.keep_last=2", "eval.at_end=false", "train.eval_every_steps=12"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, *common)  # 8 steps an epoch: step 6 is mid-epoch, and the run crosses into epoch 1
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(straight / "checkpoints" / "step_00000006.pt", resumed / "checkpoints")
    run_train(resumed, *common, "checkpoint.resume=auto")
    assert sorted(losses(resumed)) == list(range(7, 13))
    assert all(losses(resumed)[k] == losses(straight)[k] for k in range(7, 13))


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu_with_only_the_gpu_images_packages(tmp_path: Path) -> None:
    """The eager part at smoke sizes, as on the GPU machine: the carried wheels (repacked from this venv: no
    network) installed into an empty target, everything else the image lacks blocked (bench/gpu_image_site); the
    summary holds every row, the best-format lines, the profiles and the trainer's ratios; OUT holds two files."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in sorted(_names(BENCH / "gpu_wheels.txt")):
        _repack(name, wheels)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", str(out), "--part", "eager", "--device", "cpu", "--wheels", str(wheels),
         "--models", "resnet50,vit_tiny_patch16_224"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**env(), "PYTHON": sys.executable, "PYTHONPATH": str(BENCH / "gpu_image_site")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["logs_eager.tar.gz", "summary_eager.md"]
    summary = (out / "summary_eager.md").read_text()
    site = re.search(r"installed into (\S+):", summary).group(1)
    pin = re.search(r"^pydantic==(\S+)", (BENCH / "gpu_wheels.txt").read_text(), flags=re.M).group(1)
    assert f"pydantic {pin} from {site}" in summary  # the carried wheel, not the venv's
    assert f"torch {torch.__version__} (" in summary  # the interpreter's own torch, said
    rows = re.findall(r"^\| (resnet50|vit_tiny_patch16_224) \S+ \| (\d+) \| \d+ \(\d+\) \| (\w+) \| [\d.]+ \| [\d.]+ "
                      r"\| [\d.]+ \| [\d.]+× \|", summary, flags=re.M)
    assert sorted(rows) == sorted([("resnet50", m, f) for m in ("4", "16") for f in ("nchw", "channels_last")]
                                  + [("vit_tiny_patch16_224", m, "nchw") for m in ("4", "16")])
    best = re.findall(r"^\| (\S+) \S+ \| (\d+) \| [\d.]+ ms \(\w+\) \| [\d.]+ ms \(\w+\) \| [\d.]+× \|$", summary,
                      flags=re.M)
    assert len(best) == 4
    assert summary.count("top-10 ops by self time") == 4  # σN-Ens and plain, ResNet-50 and ViT-Ti
    assert re.search(r"trainer / bare loop = [\d.]+x", summary)
    assert "| table | pass |" in summary and "| trainer | pass |" in summary
    assert not os.path.exists(site)  # the target goes with the run


def test_gpu_check_refuses_a_missing_part(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "bench/gpu_check.sh", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 2 and "--part eager, compiled or checks" in proc.stderr
