"""A program's metadata (``sigmanens.json``) as one typed, versioned record: :class:`ProgramMeta` is what the exporter
writes (:meth:`ProgramMeta.to_json`) and what every reader checks (:meth:`ProgramMeta.from_json`): ``sigmanens
predict``, the registry, and a registered program's MLflow pyfunc where sigmanens_dist is not installed. The output
names a program returns are defined here too, once.

Standalone on purpose (the standard library only, nothing of sigmanens_dist, no torch): the same file is logged
beside a registered program (sigmanens_dist/registry/pyfunc_program.py) and read where the package is not
installed, as ``program_check.py`` is. Its refusals are :class:`ProgramMetaError`; the package's readers turn them
into its own error types.

Versions (:data:`FORMAT_VERSION` is the one this code writes; every older one is read):

1. every program written up to and including release 0.3.0 (those of the first releases may lack ``program_format``,
   ``class_names``, ``input.name``, ``weights``, ``norm_stats`` and ``conformal.qhat_fitted``: read as a torch
   program of the raw weights, training statistics, no class names).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["CONFORMAL_OUTPUT", "FORMAT_NAME", "FORMAT_VERSION", "METADATA_FILE", "NORM_STATS", "OUTPUTS",
           "ConformalFit", "LaterFormatError", "NormStats", "Normalisation", "ProgramInput", "ProgramMeta",
           "ProgramMetaError"]

FORMAT_NAME = "sigmanens-program"  # the metadata's "format" is FORMAT_NAME/<version>
#: The metadata layout this code writes; a program of a higher one is refused.
FORMAT_VERSION = 1
METADATA_FILE = "sigmanens.json"  # the metadata's name: the .pt2's extra_files key, the .onnx's metadata_props key
OUTPUTS = ("probabilities", "prediction", "confidence", "entropy", "mutual_information", "disagreement")
CONFORMAL_OUTPUT = "conformal_set"  # with --conformal, after OUTPUTS
_FORMAT = re.compile(re.escape(FORMAT_NAME) + r"/(\d+)")


class ProgramMetaError(ValueError):
    """Metadata that is not a sigmanens program's (one line saying what it lacks)."""


class LaterFormatError(ProgramMetaError):
    """A program written by a later sigmanens, in a metadata layout this one does not know."""


@dataclass(frozen=True)
class ProgramInput:
    """What the program takes: ``shape`` ``["B", C, H, W]``, float32 images in ``range`` (before normalisation);
    ``crop_ratio``: how an image file of any size is made one (``image_input.py``: the centre ``crop_ratio`` of the
    shorter side, resized), None for a program exported before it was recorded (its exact size only)."""

    shape: list[Any]
    channels: int
    size: int
    name: str = "images"
    dtype: str = "float32"
    range: tuple[float, float] = (0.0, 1.0)
    crop_ratio: float | None = None

    @property
    def chw(self) -> tuple[int, int, int]:
        """(channels, height, width) of one image."""
        c, h, w = (int(v) for v in self.shape[1:])
        return c, h, w

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "channels": self.channels, "size": self.size,
                "dtype": self.dtype, "range": list(self.range),
                **({} if self.crop_ratio is None else {"crop_ratio": self.crop_ratio})}


@dataclass(frozen=True)
class Normalisation:
    """The recipe's per-channel mean/std the program normalises its [0, 1] input with."""

    mean: list[float]
    std: list[float]


#: the BatchNorm statistics a program can normalise with (``--norm-stats``): here, torch- and pydantic-free, for
#: ``sigmanens predict``; the config's ``eval.norm_stats`` allows the same (a test holds them equal)
NORM_STATS = ("train", "batch")


@dataclass(frozen=True)
class NormStats:
    """Which BatchNorm statistics the program normalises with: the training ones, or each batch's mixed with them
    by ``prior``."""

    mode: str = "train"
    prior: float = 0.0

    @property
    def min_batch(self) -> int:
        """The fewest images one call may hold: 2 where each batch is normalised by its own statistics alone (one
        image has no variance: every input would map to one output), else 1."""
        return 2 if self.mode == "batch" and self.prior == 0 else 1

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode} if self.mode == "train" else {"mode": self.mode, "prior": self.prior}


@dataclass(frozen=True)
class ConformalFit:
    """The conformal set inside the program: score ``score`` ≤ ``qhat`` (None: +inf, every class), fitted at
    miscoverage ``alpha`` on ``fitted_on``: the calibration split when the run has one (``data.calib_split``), else
    the validation split (``qhat_fitted``: the quantile before the program's rounding; ``val_coverage`` and
    ``val_set_size`` are on that split)."""

    alpha: float
    score: str
    qhat: float | None
    fitted_on: str
    num_calibration: int
    val_coverage: float
    val_set_size: float
    qhat_fitted: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "score": self.score, "qhat": self.qhat, "qhat_fitted": self.qhat_fitted,
                "fitted_on": self.fitted_on, "num_calibration": self.num_calibration,
                "val_coverage": self.val_coverage, "val_set_size": self.val_set_size}


@dataclass(frozen=True)
class ProgramMeta:
    """Everything a program says about itself. ``fitted_on`` … ``val_nll_after`` describe the temperature fit and
    are None (and not written) without ``--calibration temperature``; ``conformal`` is None without
    ``--conformal``."""

    num_classes: int
    input: ProgramInput
    normalisation: Normalisation
    members: list[int]
    trained_members: int
    method: str
    tau: float | None
    run_id: str | None
    step: int
    dataset: str
    package_version: str
    calibration: str
    temperature: float
    outputs: list[str]
    program_format: str = "torch"
    class_names: list[str] | None = None
    weights: str = "raw"
    norm_stats: NormStats = NormStats()
    fitted_on: str | None = None
    num_fit: int | None = None
    val_nll_before: float | None = None
    val_nll_after: float | None = None
    conformal: ConformalFit | None = None
    format_version: int = FORMAT_VERSION

    # -- the writer ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The metadata as JSON values, at :attr:`format_version` (``format``: ``sigmanens-program/N``)."""
        fit = {key: getattr(self, key) for key in ("fitted_on", "num_fit", "val_nll_before", "val_nll_after")
               if getattr(self, key) is not None}
        return {"format": f"{FORMAT_NAME}/{self.format_version}", "program_format": self.program_format,
                "num_classes": self.num_classes, "class_names": self.class_names, "input": self.input.to_dict(),
                "normalisation": {"mean": self.normalisation.mean, "std": self.normalisation.std},
                "members": self.members, "trained_members": self.trained_members, "weights": self.weights,
                "norm_stats": self.norm_stats.to_dict(), "method": self.method, "tau": self.tau,
                "run_id": self.run_id, "step": self.step, "dataset": self.dataset,
                "package_version": self.package_version, "calibration": self.calibration,
                "temperature": self.temperature, **fit,
                **({} if self.conformal is None else {"conformal": self.conformal.to_dict()}),
                "outputs": self.outputs}

    def to_json(self) -> str:
        """The text written into the program (strict JSON: a non-finite number is a bug, not a value)."""
        return json.dumps(self.to_dict(), allow_nan=False)

    # -- the reader ------------------------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str | None) -> ProgramMeta:
        """The metadata a program file carries (None or "": it carries none)."""
        try:
            raw = json.loads(text or "")
        except ValueError:
            raise ProgramMetaError(f"not a sigmanens program: it has no {METADATA_FILE} (or not JSON)") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Any) -> ProgramMeta:
        """The record of parsed metadata: its format version checked first (a later one refused, naming both
        versions), then the input shape and every output of :data:`OUTPUTS`, which every reader needs."""
        found = _FORMAT.fullmatch(str(raw.get("format", ""))) if isinstance(raw, dict) else None
        if found is None or int(found[1]) < 1:
            raise ProgramMetaError(f"not a sigmanens program: its {METADATA_FILE} lacks format ({FORMAT_NAME}/N)")
        version = int(found[1])
        if version > FORMAT_VERSION:
            raise LaterFormatError(f"its {METADATA_FILE} says format {FORMAT_NAME}/{version}, written by a later "
                                   f"sigmanens; this one reads {FORMAT_NAME}/1 to {FORMAT_NAME}/{FORMAT_VERSION}: "
                                   "upgrade sigmanens-dist to run it, or export it again with this one")
        try:
            meta = _record(raw, version)
            channels, height, width = meta.input.chw
        except KeyError as err:
            raise ProgramMetaError(f"not a sigmanens program: its {METADATA_FILE} lacks {err.args[0]}") from None
        except (TypeError, ValueError) as err:
            raise ProgramMetaError(f"not a sigmanens program: its {METADATA_FILE} holds a value of another type "
                                   f"({str(err)[:200]})") from None
        missing = [name for name in OUTPUTS if name not in meta.outputs]
        if missing or min(channels, height, width) < 1:
            raise ProgramMetaError(f"not a sigmanens program: its {METADATA_FILE} lacks "
                                   f"{missing[0] if missing else 'input.shape'}")
        problem = _problem(meta)
        if problem is not None:
            raise ProgramMetaError(f"not a sigmanens program: its {METADATA_FILE} holds {problem}")
        return meta


def _problem(meta: ProgramMeta) -> str | None:
    """What in ``meta`` a reader would trip over after the work (a class name per prediction, the statistics a
    batch is normalised with), or None: checked on read, before any input."""
    names, stats = meta.class_names, meta.norm_stats
    if names is not None and (not isinstance(names, list) or len(names) != meta.num_classes
                              or not all(isinstance(n, str) for n in names)):
        return (f"class_names {str(names)[:80]!r}: null or a list of num_classes={meta.num_classes} strings is "
                "allowed")
    crop = meta.input.crop_ratio
    if crop is not None and (isinstance(crop, bool) or not isinstance(crop, int | float) or not 0 < crop <= 1):
        return f"input.crop_ratio {crop!r}: null or a number in (0, 1] is allowed"
    if stats.mode not in NORM_STATS:
        return f"norm_stats.mode {stats.mode!r}: one of {', '.join(NORM_STATS)} is allowed"
    if isinstance(stats.prior, bool) or not isinstance(stats.prior, int | float) or not 0 <= stats.prior < math.inf:
        return f"norm_stats.prior {stats.prior!r}: a finite number ≥ 0 is allowed"
    return None


def _record(raw: dict[str, Any], version: int) -> ProgramMeta:
    """``raw`` (a dict of format ``version``) as a record; a missing key is a ``KeyError`` naming it."""
    given, conformal = raw["input"], raw.get("conformal")
    shape = list(_key(given, "shape", "input.shape"))
    return ProgramMeta(
        num_classes=int(raw["num_classes"]),
        input=ProgramInput(shape=shape, channels=int(given.get("channels", shape[1])),
                           size=int(given.get("size", shape[-1])), name=str(given.get("name", "images")),
                           dtype=str(given.get("dtype", "float32")),
                           range=tuple(float(v) for v in given.get("range", (0.0, 1.0))),
                           crop_ratio=given.get("crop_ratio")),
        normalisation=Normalisation(**raw["normalisation"]), members=list(raw["members"]),
        trained_members=int(raw["trained_members"]), method=str(raw["method"]), tau=raw.get("tau"),
        run_id=raw.get("run_id"), step=int(raw["step"]), dataset=str(raw["dataset"]),
        package_version=str(raw["package_version"]), calibration=str(raw.get("calibration", "none")),
        temperature=float(raw["temperature"]), outputs=[str(name) for name in raw["outputs"]],
        program_format=str(raw.get("program_format", "torch")), class_names=raw.get("class_names"),
        weights=str(raw.get("weights", "raw")), norm_stats=NormStats(**(raw.get("norm_stats") or {})),
        fitted_on=raw.get("fitted_on"), num_fit=raw.get("num_fit"), val_nll_before=raw.get("val_nll_before"),
        val_nll_after=raw.get("val_nll_after"), conformal=None if conformal is None else ConformalFit(**conformal),
        format_version=version)


def _key(mapping: dict[str, Any], key: str, name: str) -> Any:
    """``mapping[key]``, or a ``KeyError`` naming the dotted ``name``."""
    if key not in mapping:
        raise KeyError(name)
    return mapping[key]
