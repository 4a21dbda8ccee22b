"""``sigmanens eval``: score a trained ensemble on the held-out test set, under shift and against OOD data.

For each set of weights (raw, and EMA when the run kept one) :func:`run_eval` runs:

* the k-member sub-ensembles, k = 1…K, each a real k-member model (:func:`sub_ensemble`), with accuracy, NLL, ECE,
  adaptive ECE, Brier, AURC and the measured forward time; the K-member one gives the headline metrics, per member
  and for the ensemble, and member disagreement and mutual information;
* corruptions (CIFAR-C style, applied to [0, 1] pixels before normalisation) at each severity, or a pre-generated
  ImageNet-C folder: the test corruptions on the test split, or the validation corruptions on the validation split
  (``shift_split``), each with the diagnosis (mean member NLL and ECE, disagreement, mutual information and the AUROC
  of telling corrupted from clean inputs by it); each corruption × severity in its own batches, or
  (``shift_batches: mixed``) all of them and the clean images in one shuffled stream (:mod:`.mixed`);
* OOD detection against an OOD set (OOD positive) for the max-softmax, entropy and mutual-information scores;
* when asked, a temperature and conformal thresholds fitted on the calibration split (``data.calib_split``), else on
  the validation split (:mod:`.posthoc`), scored with the K-member ensemble on the scored split's clean and shift
  passes;

then writes ``eval.json``, ``eval.md`` and PNG plots into ``out_dir`` and logs them to the run's MLflow run (those
outputs: :mod:`sigmanens_dist.evaluation.report`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets
from torchvision.transforms import v2

from sigmanens_dist.catalog.corruption_table import SHIFT_SPLITS, VAL_CORRUPTIONS
from sigmanens_dist.catalog.datasets import DATASETS
from sigmanens_dist.config import Config, EvalConfig
from sigmanens_dist.data.corruptions import corrupt
from sigmanens_dist.data.ood import SVHNOOD, DigitsOOD
from sigmanens_dist.data.raw import Evaluated
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.errors import UsageError
from sigmanens_dist.evaluation.metrics import SampleMetrics, diagnosis
from sigmanens_dist.evaluation.mixed import CLEAN, Stream, build_stream, check_stream_folder, score_stream, write_stream
from sigmanens_dist.evaluation.ood import score_ood
from sigmanens_dist.evaluation.posthoc import PostHoc, fit_posthoc_on
from sigmanens_dist.evaluation.report import (
    SHIFT_KEYS,
    SUB_KEYS,
    _log_mlflow,
    _plots,
    _write,
    flat_metrics,
    markdown,
    shift_mean,
)
from sigmanens_dist.evaluation.scoring import Transform, score_pass
from sigmanens_dist.inference.norm_stats import norm_stats_problem, with_norm_stats
from sigmanens_dist.methods.base import EnsembleMethod
from sigmanens_dist.program_meta import NormStats

__all__ = ["OOD_SETS", "check_options", "flat_metrics", "markdown", "run_eval", "score_pass"]

log = logging.getLogger("sigmanens")

OOD_SETS = {"digits": ("fashion_mnist",), "svhn": ("cifar10", "cifar100")}  # OOD set → datasets it is OOD for
IMAGENET_C_DATASETS = ("imagenet", "imagefolder")


def _corruption(name: str, severity: int, mean: Sequence[float], std: Sequence[float], seed: int) -> Transform:
    """Undo the normalisation, corrupt the [0, 1] pixels, normalise again (a seed per batch: reproducible)."""
    def apply(x: torch.Tensor, batch: int) -> torch.Tensor:
        m = torch.tensor(mean, device=x.device, dtype=x.dtype).view(-1, 1, 1)
        s = torch.tensor(std, device=x.device, dtype=x.dtype).view(-1, 1, 1)
        pixels = (x * s + m).clamp(0, 1)
        return (corrupt(pixels, name, severity, seed=seed * 100_003 + batch) - m) / s

    return apply


# -- checks before any work ----------------------------------------------------------------------------------------
def check_options(cfg: Config, model: EnsembleMethod, options: EvalConfig) -> list[str]:
    """Every problem with ``options`` for this model and data, in one ``UsageError``; returns the corruption names
    to run (``all`` expanded)."""
    problems = []
    m = model.num_members
    if options.members is not None and options.members > m:
        problems.append(f"--members {options.members}: the model has only M={m} members (choose 1..{m})")
    elif options.members not in (None, m) and not model.supports_sub_ensembles:
        problems.append(f"--members {options.members}: model.method={cfg.model.method!r} cannot run a sub-ensemble "
                        f"(no sub_ensemble(members)); score all {m} members")
    # corruption names, severities and the shift split are already checked by EvalConfig
    names = list(SHIFT_SPLITS[options.shift]) if "all" in options.corruptions else list(options.corruptions)
    images = [name for name, spec in DATASETS.items() if spec.kind == "image"]
    if names and cfg.data.dataset not in images:
        problems.append(f"corruptions need an image dataset with known pixel statistics ({', '.join(images)}); "
                        f"data.dataset={cfg.data.dataset!r}")
    if options.ood is not None:
        allowed = [k for k, ds in OOD_SETS.items() if cfg.data.dataset in ds]
        if options.ood not in allowed:
            problems.append(f"--ood {options.ood!r}: for data.dataset={cfg.data.dataset!r} the OOD sets are "
                            f"{', '.join(allowed) or 'none yet'} (all: {', '.join(OOD_SETS)})")
        elif options.ood == "svhn" and options.ood_root is None:
            problems.append("--ood svhn needs --ood-root, the folder with SVHN's test_32x32.mat")
    if options.imagenet_c is not None:
        if options.shift == "val":
            problems.append(f"--imagenet-c {options.imagenet_c}: a pre-generated ImageNet-C folder corrupts the test "
                            "set, not the validation split (shift split val): drop --imagenet-c")
        elif cfg.data.dataset not in IMAGENET_C_DATASETS:
            problems.append(f"--imagenet-c is for data.dataset in {IMAGENET_C_DATASETS}, not {cfg.data.dataset!r}")
        elif not Path(options.imagenet_c).is_dir():
            problems.append(f"--imagenet-c {options.imagenet_c}: no such folder")
        else:
            problems.extend(_imagenet_c_problems(Path(options.imagenet_c), names, options.severities))
    norm_problem = norm_stats_problem(model, options.norm_stats, f"model.method={cfg.model.method!r} "
                                                                 f"(model.name={cfg.model.name!r})")
    if norm_problem is not None:
        problems.append(norm_problem)
    batch = options.batch_size or cfg.train.batch_size
    if batch < NormStats(options.norm_stats, options.norm_stats_prior).min_batch:
        problems.append(f"--batch-size {batch} with --norm-stats batch and prior 0: one image normalised by its own "
                        "statistics alone maps every input alike; give a batch of 2 or more, or a prior "
                        "(--norm-stats-prior N, e.g. 16)")
    if options.shift_batches == "mixed":
        if options.imagenet_c is not None:
            problems.append("--shift-batches mixed corrupts the split's own images (--corruptions); a pre-generated "
                            "--imagenet-c folder is scored per corruption only: drop one of them")
        elif not names:
            problems.append("--shift-batches mixed mixes the corruptions asked for with the clean images: give "
                            "--corruptions (all, or names)")
    if (options.calibration != "none" or options.conformal) and not cfg.data.calib_split:
        # with a calibration split they fit on it, which neither the test nor the validation split overlaps
        asked = "--calibration/--conformal (fitted on the validation split)"
        if options.split == "val":
            problems.append(f"{asked} cannot be scored on the split they are fitted on: use --split test, or train "
                            "with a calibration split (data.calib_split) to fit on")
        elif cfg.data.val_from_test:
            problems.append(f"{asked}: this run validates on the test set (data.val_from_test), so fitting would read "
                            "the test set; give it a validation split (data.val_split)")
    if problems:
        raise UsageError("; ".join(problems))
    return names


def _imagenet_c_problems(root: Path, names: list[str], severities: list[int]) -> list[str]:
    wanted = names or _imagenet_c_names(root)
    missing = [f"{root / n / str(s)}" for n in wanted for s in severities if not (root / n / str(s)).is_dir()]
    return [f"--imagenet-c: missing folder(s) {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''} (layout: "
            "<dir>/<corruption>/<severity>/<class>/<image>)"] if missing else []


# -- the evaluation ------------------------------------------------------------------------------------------------
def run_eval(cfg: Config, model: EnsembleMethod, ema: EnsembleMethod | None = None,
             options: EvalConfig | None = None, *, out_dir: Path, run_id: str | None = None, step: int = 0,
             checkpoint: Path | None = None, env: DistEnv | None = None, stream_images: Path | None = None
             ) -> dict[str, Any]:
    """Evaluate ``model`` (and ``ema``) as ``options`` (default ``cfg.eval``) says; write ``eval.json``, ``eval.md``
    and plots into ``out_dir``; log them to MLflow run ``run_id`` when tracking is on. Returns the report. With
    ``stream_images`` (a mixed stream on one process) the stream's images are written there as files, in its order
    (:func:`~sigmanens_dist.evaluation.mixed.write_stream`).

    Single process by default (``env`` None: every sample on this rank, no cross-rank sync), which is what the end
    of training calls on rank 0. With a multi-rank ``env`` every rank must call it; each scores its own shard."""
    from sigmanens_dist.data.loaders import build_data  # looked up per call: tests replace loaders.build_data

    options = options or cfg.eval
    device = next(model.parameters()).device
    env = env or DistEnv(0, 1, 0, device)
    names = check_options(cfg, model, options)
    if stream_images is not None:
        if options.shift_batches != "mixed" or env.world_size > 1:
            raise UsageError(f"--stream-images {stream_images}: writes the one stream of --shift-batches mixed, on "
                             "one process (not under torchrun)")
        check_stream_folder(Path(stream_images))
    k_max = options.members or model.num_members
    batch = options.batch_size or cfg.train.batch_size
    # One image per prediction with a prior: each image normalised by its own statistics, computed for a batch of
    # train.batch_size images at once (the same predictions as one at a time, in a fraction of the time;
    # tests/evaluation/test_norm_stats.py); a model whose norms pool its members' rows is run one image at a time.
    per_sample = options.norm_stats == "batch" and batch == 1 and not model.pools_member_rows
    compute = cfg.train.batch_size if per_sample else batch  # the batches the model is called on
    data = build_data(cfg.data, compute, cfg.seed, env)
    eval_set = data.test if options.split == "test" else data.val
    fit_split, fit_set = data.posthoc_split()  # calib when the run carved it, else val
    ood_batches = _ood_batches(cfg, options, compute) if options.ood else None
    sync = env.world_size > 1
    notes = _notes(cfg, options)
    # the mixed stream: built once (the corrupted images of every cell), scored by each set of weights; its images
    # are corrupted in batches of train.batch_size whatever the prediction batch (a corruption's noise is drawn per
    # batch), so streams scored at different batch sizes hold the same images: the default per-corruption passes'
    stream = None
    if options.shift_batches == "mixed" and names:
        source = data if compute == cfg.train.batch_size else build_data(cfg.data, cfg.train.batch_size, cfg.seed, env)
        stream = build_stream(source.test if options.split == "test" else source.val, _cells(cfg, options, names),
                              *_pixel_stats(cfg), _stream_seed(cfg, env), options.split)
    if stream is not None and stream_images is not None:
        write_stream(stream, Path(stream_images))

    report: dict[str, Any] = {"checkpoint": str(checkpoint) if checkpoint else None, "step": step,
                              "method": cfg.model.method, "dataset": cfg.data.dataset, "split": options.split,
                              "shift_split": options.shift if names or options.imagenet_c else None,
                              "num_members": model.num_members, "members": k_max, "notes": notes,
                              "norm_stats": NormStats(options.norm_stats, options.norm_stats_prior).to_dict(),
                              "weights": {}}
    if names or options.imagenet_c:
        report["shift_batches"] = {"composition": options.shift_batches, "batch_size": batch} | (
            {"images": len(stream) * env.world_size, "order_seed": cfg.seed} if stream is not None else {})
    plots: list[Path] = []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    variants = {"raw": model} | ({"ema": ema} if ema is not None else {})
    for variant, weights in variants.items():
        # a prediction copy whose BatchNorms use each batch's statistics (--norm-stats batch), or the model itself
        weights = with_norm_stats(weights, options.norm_stats, options.norm_stats_prior, per_sample)
        part: dict[str, Any] = {"sub_ensembles": []}
        scored = None
        full = weights.select_members(range(k_max))
        posthoc = (fit_posthoc_on(full, fit_set, options, device, variant, fit_split)  # before any scored batch
                   if options.calibration != "none" or options.conformal else None)
        # methods that cannot run k of their members, and runs that ask for the full ensemble only, score k = K
        ks = range(1, k_max + 1) if options.sub_ensembles and weights.supports_sub_ensembles else [k_max]
        for k in ks:
            sub = weights.select_members(range(k))
            extra = posthoc.metrics(data.num_classes, k, sync) if posthoc is not None and k == k_max else {}
            metrics, seconds = score_pass(sub, eval_set(), data.num_classes, device,
                                          f"{variant} {options.split} k={k}", sync=sync, also=list(extra.values()))
            if extra:
                posthoc.record(extra)
            values = metrics.compute()
            n = values["num_samples"]
            part["sub_ensembles"].append({"k": k, **{key: values[key] for key in SUB_KEYS},
                                          "forward_s": seconds, "ms_per_image": 1000 * seconds / n})
            if k == k_max:
                part["metrics"], scored = values, metrics
        scores = scored.scores()
        if names or options.imagenet_c:
            if stream is not None:
                part |= _mixed_shift(options, stream, full, data.num_classes, device, variant, compute, sync, posthoc,
                                     *_pixel_stats(cfg))
            else:
                part["shift"] = _shift(cfg, options, names, full, eval_set, data.num_classes, device, variant, compute,
                                       sync, posthoc, scores["mutual_information"])
        if posthoc is not None:
            part |= posthoc.parts
        if ood_batches is not None:
            part["ood"] = score_ood(full, scores, ood_batches, data.num_classes, device, variant, options.ood)
        sharing = weights.sharing()
        if sharing is not None:
            part["sharing"] = sharing
        report["weights"][variant] = part
        if env.is_main:
            plots += _plots(out_dir, variant, weights, scores, part)
    if env.is_main:
        files = _write(out_dir, report) + plots
        if run_id is not None and cfg.tracking.enabled:
            _log_mlflow(cfg, run_id, report, files, step, checkpoint)
    return report


def _notes(cfg: Config, options: EvalConfig) -> list[str]:
    notes = []
    if cfg.data.val_from_test:
        notes.append("this run validated on the test set (data.val_from_test): best.pt and any tuning saw the "
                     "test set, so test numbers are not held out")
    if options.split == "val":
        notes.append("scored on the validation split (carved from the training data), not the test set")
    if options.norm_stats == "batch":
        batch = options.batch_size or cfg.train.batch_size
        composition = ("batches mixing every corruption × severity and clean images" if options.shift_batches == "mixed"
                       else "the shift passes' batches each of one corruption at one severity")
        notes.append(f"BatchNorm statistics re-estimated from each batch of {batch} (prior N = "
                     f"{options.norm_stats_prior:g}; {composition}): the scores depend on the batch size and "
                     "composition" + ("; each image alone, computed for batches of images at once" if batch == 1
                                      else ""))
    return notes


def _pixel_stats(cfg: Config) -> tuple[Sequence[float], Sequence[float]]:
    """The mean and std the recipe normalises its [0, 1] pixels with."""
    spec = DATASETS[cfg.data.dataset]
    return spec.mean, spec.std


def _cells(cfg: Config, options: EvalConfig, names: list[str]) -> list[tuple[str, int, Transform]]:
    """Every corruption × severity asked for, with the transform its per-corruption pass applies."""
    mean, std = _pixel_stats(cfg)
    return [(name, severity, _corruption(name, severity, mean, std, cfg.seed))
            for name in names for severity in options.severities]


def _stream_seed(cfg: Config, env: DistEnv) -> int:
    """The mixed stream's order: the run's seed (each rank shuffles its own shard, under its own seed)."""
    return cfg.seed + 1_000_003 * env.rank


def _shift(cfg: Config, options: EvalConfig, names: list[str], model: nn.Module, eval_set: Callable[[], Iterable],
           num_classes: int, device: torch.device, variant: str, batch: int, sync: bool, posthoc: PostHoc | None,
           clean_mi: torch.Tensor) -> dict[str, Any]:
    """``{corruption: {severity: {acc, nll, ece, <diagnosis>}}, "mean": {severity: …}}`` over the corruptions asked
    for, the diagnosis (:func:`~sigmanens_dist.evaluation.metrics.diagnosis`) against ``clean_mi``, the clean pass's
    per-sample mutual information; the calibrated and conformal scores of the same passes go to ``posthoc``."""
    out: dict[str, Any] = {}
    members = model.num_members
    if options.imagenet_c is not None:
        for name, severity, dataset in _imagenet_c_sets(cfg, Path(options.imagenet_c), names, options.severities):
            loader = DataLoader(dataset, batch_size=batch, num_workers=cfg.data.num_workers)
            # not sharded: every rank scores the whole folder, so nothing is synced (or counted twice)
            extra = posthoc.metrics(num_classes, members, False) if posthoc is not None else {}
            metrics, _ = score_pass(model, loader, num_classes, device, f"{variant} {name} s{severity}",
                                    also=list(extra.values()))
            out.setdefault(name, {})[str(severity)] = _cell(metrics, members, clean_mi)
            if posthoc is not None:
                posthoc.record(extra, name, severity)
    else:
        for name, severity, transform in _cells(cfg, options, names):
            extra = posthoc.metrics(num_classes, members, sync) if posthoc is not None else {}
            metrics, _ = score_pass(model, eval_set(), num_classes, device, f"{variant} {name} s{severity}",
                                    transform, sync=sync, also=list(extra.values()))
            out.setdefault(name, {})[str(severity)] = _cell(metrics, members, clean_mi)
            if posthoc is not None:
                posthoc.record(extra, name, severity)
    return _with_mean(out, options.severities, posthoc)


def _with_mean(table: dict[str, Any], severities: list[int], posthoc: PostHoc | None) -> dict[str, Any]:
    """``table`` with its mean row over corruptions, and the post-hoc parts' shift tables theirs."""
    table["mean"] = shift_mean(table, severities)
    if posthoc is not None:
        posthoc.finish_shift(severities)
    return table


def _mixed_shift(options: EvalConfig, stream: Stream, model: nn.Module, num_classes: int, device: torch.device,
                 variant: str, batch: int, sync: bool, posthoc: PostHoc | None, mean: Sequence[float],
                 std: Sequence[float]) -> dict[str, Any]:
    """The report's ``shift`` table (as :func:`_shift`'s) and ``shift_stream`` (its clean images and every image of
    the stream) from one pass of the mixed stream; each prediction credited to its group and to the overall. The
    diagnosis's mutual-information AUROC tells each group from the stream's clean images (scored in the same
    batches), not from the clean pass."""
    members = model.num_members
    groups = [*stream.names, "overall"]
    metrics = [SampleMetrics(num_classes, members, sync_on_compute=sync).to(device) for _ in groups]
    extras = [posthoc.metrics(num_classes, members, sync) if posthoc is not None else {} for _ in groups]
    extras = [{k: v.to(device) for k, v in extra.items()} for extra in extras]

    def update(logits: torch.Tensor, target: torch.Tensor, group: torch.Tensor) -> None:
        for g, rows in [(len(groups) - 1, None), *((g, group == g) for g in group.unique().tolist())]:
            lg, y = (logits, target) if rows is None else (logits[:, rows], target[rows])
            for metric in (metrics[g], *extras[g].values()):
                metric.update(lg, y)

    least = NormStats(options.norm_stats, options.norm_stats_prior).min_batch
    score_stream(model, stream, batch, least, mean, std, device, variant, update)
    clean_mi = metrics[0].scores()["mutual_information"]
    out: dict[str, Any] = {}
    for name, metric, extra in zip(groups, metrics, extras, strict=True):
        if isinstance(name, tuple):
            corruption, severity = name
            out.setdefault(corruption, {})[str(severity)] = _cell(metric, members, clean_mi)
            if posthoc is not None:
                posthoc.record(extra, corruption, severity)
    _with_mean(out, options.severities, posthoc)
    if posthoc is not None:
        for which, extra in ((CLEAN, extras[0]), ("overall", extras[-1])):
            posthoc.record_stream(extra, which)
    return {"shift": out, "shift_stream": {CLEAN: _cell(metrics[0], members, None),
                                           "overall": _cell(metrics[-1], members, None)}}


def _cell(metrics: SampleMetrics, members: int, clean_mi: torch.Tensor | None) -> dict[str, float | None]:
    """One corruption at one severity: accuracy, NLL, ECE and the diagnosis against the clean images' mutual
    information (none given: no AUROC)."""
    values = metrics.compute()
    return ({k: values[k] for k in SHIFT_KEYS}
            | diagnosis(values, members, clean_mi, metrics.scores()["mutual_information"]))


def _imagenet_c_names(root: Path) -> list[str]:
    """The corruption folders of an ImageNet-C folder, but the validation corruptions (its extras, when present):
    they never make a test column."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in VAL_CORRUPTIONS)


def _imagenet_c_sets(cfg: Config, root: Path, names: list[str], severities: list[int]
                     ) -> Iterable[tuple[str, int, Dataset]]:
    """ImageNet-C's ``<root>/<corruption>/<severity>/<class>/<image>`` folders, read like the test set (resized to
    the model's input size, normalised); class folders must match the training classes."""
    spec = DATASETS[cfg.data.dataset]
    mean, std, size = spec.mean, spec.std, cfg.data.img_size or spec.size
    classes = sorted(p.name for p in (Path(cfg.data_root()) / "train").iterdir() if p.is_dir())
    transform = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Resize(size, antialias=True),
                            v2.CenterCrop(size), v2.Normalize(mean, std)])
    for name in names or _imagenet_c_names(root):
        for severity in severities:
            folder = root / name / str(severity)
            dataset = datasets.ImageFolder(str(folder), transform=transform)
            if dataset.classes != classes:
                raise UsageError(f"{folder}: class folders {dataset.classes[:5]}… differ from the training classes "
                                 f"{classes[:5]}… of {cfg.data_root()}/train")
            yield name, severity, dataset


def _ood_batches(cfg: Config, options: EvalConfig, batch: int) -> Callable[[], Iterable]:
    if options.ood == "digits":
        dataset: Dataset = DigitsOOD()
        if cfg.data.img_size and cfg.data.img_size != 28:
            dataset = Evaluated(dataset, v2.Resize(cfg.data.img_size, antialias=True))
    else:
        dataset = SVHNOOD(options.ood_root, cfg.data.dataset)
    return lambda: DataLoader(dataset, batch_size=batch, num_workers=cfg.data.num_workers)
