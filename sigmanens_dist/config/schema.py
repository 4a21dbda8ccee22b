"""The run configuration: typed sections checked by pydantic, read from a YAML recipe plus ``key.sub=value`` overrides.

Everything wrong with a config is reported at once, in one :class:`ConfigError` with a ``dotted.path: what is wrong
(got value)`` line per problem, so a job that waited hours in a queue fails in seconds with the whole list to fix,
not one typo per resubmission. Unknown keys are errors everywhere: a misspelt key must never silently train with the
default instead.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from sigmanens_dist.atomic import write_text
from sigmanens_dist.data.datasets import DATASETS, DatasetName, resolve_root
from sigmanens_dist.errors import UsageError

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "ModelConfig", "OptimConfig",
           "RegConfig", "ScheduleConfig", "StrategyConfig", "TrackingConfig", "TrainConfig", "check_paths", "flatten",
           "load_config", "save_config"]


class ConfigError(UsageError):
    """Every problem found in one config, one ``  - dotted.path: what is wrong (got value)`` line each."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source, self.problems = source, list(problems)
        count = len(self.problems)
        super().__init__(f"{source}: {count} problem{'' if count == 1 else 's'} in the config:\n"
                         + "\n".join(self.problems))


def _cross_field(field: str, message: str, got: Any) -> PydanticCustomError:
    """An error from a section-level check that still points at one field (pydantic would only name the section)."""
    return PydanticCustomError("config_field", message, {"field": field, "got": got})


class _Section(BaseModel):
    """Base of every section: unknown keys are errors; ``lambda`` and ``lam`` both name :attr:`RegConfig.lam`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


_PACKED_EXAMPLES = ("resnet10t", "resnet18", "resnet50", "wide_resnet50_2", "resnext50_32x4d")


class ModelConfig(_Section):
    """The backbone and how it becomes a σN-Ens ensemble.

    ``source: timm``: ``name`` is a timm model. ``source: hf`` (text): with ``pretrained: true`` ``name`` is a local
    Hugging Face model folder (``AutoModelForSequenceClassification``; nothing downloads); with ``pretrained: false``
    it is ``bert`` (a ``BertConfig`` from ``kwargs``) or a local folder whose ``config.json`` is built untrained.
    """

    source: Literal["timm", "hf"] = "timm"  # before name: name's check reads it
    name: str = "resnet18"
    pretrained: bool = False
    num_classes: int | None = Field(None, ge=1)  # None: the dataset's
    in_chans: int | None = Field(None, ge=1)  # None: the dataset's
    kwargs: dict[str, Any] = Field(default_factory=dict)  # more timm.create_model kwargs, e.g. img_size, patch_size
    # sigma: σN-Ens; single: the plain backbone; deep: Deep Ensemble; batch: BatchEnsemble; packed: Packed-Ensembles
    # (timm ResNet family); film: per-member norms without σ gate or L_div (docs/methods.md)
    method: Literal["sigma", "single", "deep", "batch", "packed", "film"] = "sigma"
    num_members: int = Field(4, ge=1)  # M (not used by method=single)
    # independent: each member reads its own data order (member k that of a run with seed+k); shared: every member
    # sees the same batch. None: the method's default (independent for deep, shared for the others)
    member_batches: Literal["shared", "independent"] | None = None
    packed_alpha: float = Field(2.0, gt=0, allow_inf_nan=False)  # packed: width factor α
    packed_gamma: int = Field(1, ge=1)  # packed: sub-groups per member γ
    fast_weight_init_std: float = Field(0.5, ge=0, allow_inf_nan=False)  # batch: r, s ~ N(1, std)
    film_init_std: float = Field(0.1, ge=0, allow_inf_nan=False)  # film: member scales = source × N(1, std)
    # γ ~ N(mean, std²); 2 and 0.1 start every member "on" (σ(γ) ≈ 0.88) where σ' is still large enough for L_div
    # to switch members off (at 3, σ'(3) ≈ 0.045, τ did nothing in a trained model): README "Long budget"
    gamma_init_mean: float = Field(2.0, allow_inf_nan=False)
    gamma_init_std: float = Field(0.1, ge=0, allow_inf_nan=False)
    # divide: member affine = source affine / σ(γ_m), every member starts as the source (the conversion); perturb:
    # member affine = source affine, member m starts as the source with feature i scaled by σ(γ_m,i) at every norm (a
    # random perturbation of a trained network, which needs model.init_from or model.pretrained); plain: member affine
    # = the backbone's fresh init (from scratch, where there is no function to preserve); auto: divide with a source,
    # plain without. README "Converting a trained network" measures divide against perturb.
    affine_init: Literal["auto", "divide", "perturb", "plain"] = "auto"
    layers: list[str] | None = None  # fnmatch patterns of norm layers to convert; None: every norm
    # a trained network to convert (loaded into the backbone before conversion): a run directory (its best
    # checkpoint, else its newest), a checkpoint file or folder of any strategy of a single-model run, or a plain
    # state dict (`sigmanens export`, or any file timm's model loads); None: model.pretrained or random init
    init_from: str | None = None

    @field_validator("name")
    @classmethod
    def _timm_knows_it(cls, name: str, info: ValidationInfo) -> str:
        """A misspelt model name should fail here, with a suggestion, not after the data has loaded."""
        from sigmanens_dist.timm_names import registered_without_import

        if info.data.get("source", "hf") == "hf":  # absent: source itself is invalid and already reported
            return name
        if name.startswith(("hf-hub:", "hf_hub:", "local-dir:")) or registered_without_import(name):
            return name  # known without importing timm (and so torch): `--check` answers at once
        import timm

        if timm.is_model(name):
            return name
        raise ValueError(f"timm has no model {name!r}{_did_you_mean(name, timm.list_models())}")

    @field_validator("kwargs")
    @classmethod
    def _no_clash_with_fields(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """These are passed from their own fields; a second copy in kwargs would be a TypeError in create_model."""
        clash = sorted({"model_name", "pretrained", "num_classes", "in_chans"} & kwargs.keys())
        if clash:
            raise ValueError(f"set {', '.join(clash)} as model.<key>, not inside model.kwargs")
        return kwargs

    @model_validator(mode="before")
    @classmethod
    def _ensemble_is_method(cls, data: Any) -> Any:
        """Deprecated ``model.ensemble: true|false`` still reads as ``model.method: sigma|single``."""
        if isinstance(data, dict) and "ensemble" in data:
            data = dict(data)
            flag = data.pop("ensemble")
            if not isinstance(flag, bool):
                raise _cross_field("ensemble", "deprecated boolean; use model.method", flag)
            implied = "sigma" if flag else "single"
            if data.get("method", implied) != implied:
                raise _cross_field("ensemble", f"model.ensemble={flag} (deprecated) contradicts model.method="
                                               f"{data['method']!r}; keep only model.method", flag)
            data["method"] = implied
            warnings.warn("model.ensemble is deprecated; use model.method: sigma | single", DeprecationWarning,
                          stacklevel=2)
        return data

    @model_validator(mode="after")
    def _method_knobs(self) -> ModelConfig:
        """A knob of another method changed from its default (a saved config repeats the defaults), or a family the
        method does not support, is an error before anything runs."""
        owners = {"packed_alpha": "packed", "packed_gamma": "packed", "fast_weight_init_std": "batch",
                  "film_init_std": "film"}
        for key, method in owners.items():
            value = getattr(self, key)
            if self.method != method and value != type(self).model_fields[key].default:
                raise _cross_field(key, f"applies to model.method={method} only, not {self.method!r}", value)
        if self.method == "packed":
            import timm

            family = timm.list_models(module="resnet")
            if self.source != "timm" or self.name not in family:
                raise _cross_field("method", f"packed supports the timm ResNet family (timm.models.resnet: "
                                             f"{', '.join(n for n in family if n in _PACKED_EXAMPLES)}, …); got "
                                             f"model.name={self.name!r}", self.method)
        return self

    @model_validator(mode="after")
    def _resolve_affine_init(self) -> ModelConfig:
        """``auto`` becomes what it means here, so the saved config says what ran. ``plain`` on a trained source is
        the perturbed start under another name (runs before 0.2 saved it so): it runs, is saved as ``perturb``, and
        says so in one line; ``perturb`` with nothing to perturb is an error."""
        has_source = bool(self.pretrained or self.init_from)
        if self.affine_init == "auto":
            self.affine_init = "divide" if has_source else "plain"
        elif self.affine_init == "plain" and has_source:
            warnings.warn("model.affine_init=plain on a trained source is the perturbed start (member m = the source "
                          "with each feature scaled by σ(γ_m) at every norm), saved as model.affine_init=perturb; "
                          "model.affine_init=divide (or auto) starts every member as the source", UserWarning,
                          stacklevel=2)
            self.affine_init = "perturb"
        elif self.affine_init == "perturb" and not has_source:
            raise _cross_field("affine_init", "perturbs a trained network: it needs model.init_from or "
                                              "model.pretrained=true; from scratch use plain (or auto)",
                               self.affine_init)
        return self

    @model_validator(mode="after")
    def _one_weight_source(self) -> ModelConfig:
        """init_from and pretrained both name the backbone's starting weights. (Whether init_from exists is checked
        when the model is built: a resumed run or an evaluation reads its weights from the checkpoint instead.)"""
        if self.init_from is not None and self.pretrained:
            raise _cross_field("init_from", "loads the backbone's weights itself; drop model.pretrained=true",
                               self.init_from)
        return self

    @model_validator(mode="after")
    def _hf_kwargs_from_elsewhere(self) -> ModelConfig:
        """For text backbones the label count comes from num_classes and the vocabulary from the tokenizer."""
        if self.source == "hf":
            clash = sorted({"num_labels", "vocab_size"} & self.kwargs.keys())
            if clash:
                raise _cross_field("kwargs", f"{', '.join(clash)} must not be set for model.source=hf: the label "
                                             "count is model.num_classes (or the dataset's), the vocabulary the "
                                             "tokenizer's", {k: self.kwargs[k] for k in clash})
        return self


class RegConfig(_Section):
    """The diversity regulariser: ``loss = task + lam * diversity(tau)``."""

    tau: float = Field(0.5, gt=0, allow_inf_nan=False)
    # 0.01 with τ = 0.5: the best measured recipe at the long budget (README "Long budget", docs/quality.md); 0 turns
    # L_div off (τ then does nothing); with normalize=members use λ·M of an unnormalised λ
    lam: float = Field(0.01, ge=0, allow_inf_nan=False, alias="lambda")
    # L_div as the sum over members and features (none), / M (members) or / (M·F) (mean); see regularizer.py
    normalize: Literal["none", "members", "mean"] = "none"
    regularize: list[str] | None = None  # fnmatch patterns of σ layers the regulariser sees; None: all

    @model_validator(mode="before")
    @classmethod
    def _one_spelling(cls, data: Any) -> Any:
        """Without this, giving both would report the name as an 'unknown key', which misleads."""
        if isinstance(data, dict) and "lam" in data and "lambda" in data:
            raise _cross_field("lambda", "given twice, as reg.lam and as reg.lambda; keep one", data["lambda"])
        return data


class OptimConfig(_Section):
    """The optimiser; ``lr`` is the peak rate after warm-up, for the global batch the recipe states."""

    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0, allow_inf_nan=False)
    momentum: float = Field(0.9, ge=0, lt=1)  # SGD only
    nesterov: bool = False  # SGD only
    weight_decay: float = Field(5e-4, ge=0, allow_inf_nan=False)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW only
    # lr multiplier of the σ store (γ, member affines); num_members: M, which undoes the 1/M of a member-mean loss
    sigma_lr_scale: float | Literal["num_members"] = "num_members"
    # lr multiplier of BatchEnsemble's fast weights r, s (uncertainty-baselines: 0.5 for ResNet-32x4, 1 for WRN-28-10)
    fast_weight_lr_scale: float = Field(1.0, gt=0, allow_inf_nan=False)

    @field_validator("sigma_lr_scale")
    @classmethod
    def _positive_scale(cls, scale: float | str) -> float | str:
        if isinstance(scale, float) and not (math.isfinite(scale) and scale > 0):
            raise ValueError("must be a finite number > 0 or 'num_members'")
        return scale

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("both betas must be in [0, 1)")
        return betas

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OptimConfig:
        """torch.optim.SGD rejects this only when the optimiser is built, after the model and data are up."""
        if self.name == "sgd" and self.nesterov and self.momentum == 0:
            raise _cross_field("nesterov", "Nesterov SGD needs optim.momentum > 0", self.nesterov)
        return self


class ScheduleConfig(_Section):
    """Learning-rate schedule over optimiser steps: linear warm-up, then cosine to ``min_lr_ratio * lr`` or flat."""

    name: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class TrainConfig(_Section):
    """The step loop. Exactly one of ``epochs`` / ``max_steps`` gives the budget; ``batch_size`` is per rank."""

    epochs: int | None = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    batch_size: int = Field(128, ge=1)
    grad_accum: int = Field(1, ge=1)
    # reduction of the member task losses over members (objective.py); None: the method's (sum for deep, else mean)
    member_loss: Literal["mean", "sum"] | None = None
    clip_grad: float | None = Field(None, gt=0, allow_inf_nan=False)
    amp: Literal["none", "bf16", "fp16"] = "none"
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    ema_decay: float | None = Field(None, gt=0, lt=1)
    eval_every_steps: int | None = Field(None, ge=1)  # None: at each epoch end (and at the end)
    log_every_steps: int = Field(10, ge=1)
    mixup_alpha: float = Field(0.0, ge=0, allow_inf_nan=False)
    cutmix_alpha: float = Field(0.0, ge=0, allow_inf_nan=False)
    randaugment: str | None = None  # a timm auto-augment string, e.g. "rand-m9-mstd0.5-inc1"
    # torch.compile the model (not the DDP/FSDP wrapper); state-dict keys stay the same, so checkpoints are too
    compile: bool = False
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"  # aot_eager: tracing without codegen
    # recompute each block's activations in backward (timm set_grad_checkpointing, Hugging Face
    # gradient_checkpointing_enable): activation memory of one block instead of all, for about one more forward
    grad_checkpointing: bool = False

    @model_validator(mode="before")
    @classmethod
    def _given_max_steps_replaces_default_epochs(cls, data: Any) -> Any:
        """A recipe that states ``max_steps`` need not also write ``epochs: null`` to drop the default budget."""
        if isinstance(data, dict) and data.get("max_steps") is not None and "epochs" not in data:
            data = {**data, "epochs": None}
        return data

    @model_validator(mode="after")
    def _exactly_one_budget(self) -> TrainConfig:
        if self.epochs is not None and self.max_steps is not None:
            raise _cross_field("max_steps", f"set only one of train.epochs (here {self.epochs}) and train.max_steps; "
                                            "set the other to null", self.max_steps)
        if self.epochs is None and self.max_steps is None:
            raise _cross_field("epochs", "set one of train.epochs and train.max_steps", None)
        return self


class DataConfig(_Section):
    """Which dataset, in which on-disk format, from where; nothing is ever downloaded."""

    dataset: DatasetName = "fashion_mnist"  # sigmanens_dist/data/datasets.py names them all
    format: Literal["raw", "ffcv", "webdataset"] = "raw"  # raw: the dataset's native on-disk format
    root: Path | None = None  # None: /usr/share/datasets/fashion-mnist for fashion_mnist; required otherwise
    num_workers: int = Field(2, ge=0)
    img_size: int | None = Field(None, ge=1)  # None: the dataset's native size
    train_subset: int | None = Field(None, ge=1)  # only the first N train samples
    val_subset: int | None = Field(None, ge=1)  # only the first N samples of the validation split
    test_subset: int | None = Field(None, ge=1)  # only the first N samples of the test set (what `eval` scores)
    # The validation split, carved from the training set (after train_subset) by a permutation drawn from the run's
    # seed: a fraction in (0, 1) or a count ≥ 1. It is what the loop evaluates and what picks best.pt. 0 uses the
    # test set as validation instead, and only with val_from_test: true (a warning is logged).
    val_split: float | int = 0.1
    val_from_test: bool = False
    # The split is drawn from this seed, not from `seed`: runs of different seeds (and a Deep Ensemble's members,
    # which read seed+k's data order) then validate on the same samples, as paired comparisons need.
    split_seed: int = Field(0, ge=0)
    max_length: int = Field(64, ge=8)  # text: tokens per sample, padded or truncated to it
    # text: a local Hugging Face tokenizer folder (a pretrained backbone's own); None: <root>/tokenizer/, which a raw
    # run trains (WordPiece, on the training sentences) when absent and `sigmanens data convert` writes
    tokenizer: Path | None = None
    # an unreadable sample or out-of-range label: stop naming it, or skip it and count it (logged data/bad_samples)
    on_bad_sample: Literal["error", "skip"] = "error"

    @field_validator("val_split", mode="before")
    @classmethod
    def _fraction_or_count(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("must be a fraction in (0, 1), a count ≥ 1, or 0")
        if isinstance(value, float) and value.is_integer() and value >= 1:
            raise ValueError("a fraction must be < 1; write a count as an integer (e.g. 5000)")
        if value < 0 or (isinstance(value, float) and not value < 1):
            raise ValueError("must be a fraction in (0, 1), a count ≥ 1, or 0")
        return value

    @model_validator(mode="after")
    def _honest_validation(self) -> DataConfig:
        """The test set doubles as validation only when asked for (converted data: ``data.loaders`` checks the split
        against the one recorded at conversion)."""
        if self.val_split == 0 and not self.val_from_test:
            raise _cross_field("val_split", "0 means validating on the test set; say so with "
                                            "data.val_from_test=true, or carve a split (e.g. 0.1)", self.val_split)
        if self.val_split != 0 and self.val_from_test:
            raise _cross_field("val_from_test", f"true needs data.val_split=0 (got {self.val_split}): the "
                                                "validation set is either carved or the test set", True)
        return self

    @model_validator(mode="after")
    def _converted_data_is_what_was_written(self) -> DataConfig:
        """Converted readers stream whole files: a subset asked for here would be silently ignored."""
        for key in ("train_subset", "val_subset", "test_subset"):
            if self.format != "raw" and getattr(self, key) is not None:
                flag = {"val_subset": "--val-split"}.get(key, f"--{key.replace('_', '-')}")
                raise _cross_field(key, f"applies to data.format=raw only: data.format={self.format} reads what "
                                        f"`sigmanens data convert {flag} …` wrote; set it to null",
                                   getattr(self, key))
        return self

    @model_validator(mode="after")
    def _ffcv_cannot_skip(self) -> DataConfig:
        if self.format == "ffcv" and self.on_bad_sample == "skip":
            raise _cross_field("on_bad_sample", "FFCV decodes whole batches in compiled code and cannot skip one "
                                                "sample; check the .beton when writing it, or use raw/webdataset",
                               self.on_bad_sample)
        return self


class StrategyConfig(_Section):
    """How the model is spread over ranks."""

    name: Literal["ddp", "fsdp", "deepspeed"] = "ddp"
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl with CUDA, else gloo
    # fsdp only: reshard each block's parameters after its forward (less memory, one more all-gather in backward)
    fsdp_reshard_after_forward: bool | None = None  # None: true
    fsdp_replicate: int | None = Field(None, ge=1)  # fsdp only: HSDP, replicas × shards mesh (None: 1, plain FSDP)
    zero_stage: Literal[1, 2, 3] | None = None  # deepspeed only (None: 2)
    deepspeed_config: Path | None = None  # deepspeed only: a JSON merged over the config built from this one

    @model_validator(mode="after")
    def _options_apply(self) -> StrategyConfig:
        owners = {"fsdp_reshard_after_forward": "fsdp", "fsdp_replicate": "fsdp", "zero_stage": "deepspeed",
                  "deepspeed_config": "deepspeed"}
        for key, owner in owners.items():
            if getattr(self, key) is not None and self.name != owner:
                raise _cross_field(key, f"strategy.{key} applies to strategy.name={owner} only, not "
                                        f"strategy.name={self.name}", getattr(self, key))
        if self.name == "deepspeed":
            import importlib.util

            if importlib.util.find_spec("deepspeed") is None:
                raise _cross_field("name", "DeepSpeed is not installed: pip install 'sigmanens-dist[deepspeed]'",
                                   self.name)
            if self.deepspeed_config is not None and not self.deepspeed_config.is_file():
                raise _cross_field("deepspeed_config", "no such file", str(self.deepspeed_config))
        return self


class CheckpointConfig(_Section):
    """When to checkpoint, how many to keep, and where to resume from."""

    every_steps: int | None = Field(None, ge=1)  # None: at each epoch end
    keep_last: int = Field(2, ge=1)
    resume: str = Field("none", min_length=1)  # "none", "auto" (latest in run_dir) or a checkpoint path


class TrackingConfig(_Section):
    """MLflow; ``uri`` None means ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<run_dir parent>/mlflow.db``."""

    enabled: bool = True
    uri: str | None = None
    experiment: str = Field("sigmanens", min_length=1)
    run_name: str | None = None  # None: the run directory's name
    # Nest this run under another (a study's parent run, `sigmanens study`); it is logged in the parent's experiment
    parent_run_id: str | None = Field(None, min_length=1)


class EvalConfig(_Section):
    """``sigmanens eval`` run at the end of training (``at_end``), with these options (see docs/eval.md)."""

    at_end: bool = False
    split: Literal["test", "val"] = "test"
    corruptions: list[str] = Field(default_factory=list)  # names from data.corruptions.CORRUPTIONS, or ["all"]
    severities: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5])
    ood: str | None = None  # an OOD set name (eval.ood_sets), e.g. digits for Fashion-MNIST, svhn for CIFAR
    ood_root: Path | None = None  # where the OOD set's files are (svhn)
    members: int | None = Field(None, ge=1)  # score the first K members (default: all)
    sub_ensembles: bool = True  # also score k = 1..K-1 (one more pass of the eval set each; the M-scaling table)
    imagenet_c: Path | None = None  # a pre-generated ImageNet-C folder: <dir>/<corruption>/<severity>/<class>/<img>
    batch_size: int | None = Field(None, ge=1)  # None: train.batch_size

    @field_validator("corruptions")
    @classmethod
    def _known_corruptions(cls, names: list[str]) -> list[str]:
        if not names:
            return names
        from sigmanens_dist.data.corruptions import CORRUPTIONS, unknown  # only when asked for: it imports torch

        bad = [n for n in names if n not in (*CORRUPTIONS, "all")]
        if bad:
            raise ValueError(unknown(bad))
        return names

    @field_validator("severities")
    @classmethod
    def _known_severities(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if v not in (1, 2, 3, 4, 5)]
        if bad or not values:
            raise ValueError(f"severities must be a non-empty list of 1..5, got {values}")
        return values


class Config(_Section):
    """A whole run. Build it with :func:`load_config`, which also checks that the data is where the config says."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    reg: RegConfig = Field(default_factory=RegConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run_dir: Path = Path("runs/default")
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _sharded_limits(self) -> Config:
        """What the sharded strategies do not do (yet), refused before anything starts."""
        if self.strategy.name == "deepspeed" and self.strategy.zero_stage == 3 and self.train.ema_decay is not None:
            raise _cross_field("train.ema_decay", "EMA is not supported with ZeRO-3 (its parameters exist only "
                                                  "while gathered); use strategy.zero_stage 1 or 2, strategy.name="
                                                  "fsdp (a sharded EMA), or set it to null", self.train.ema_decay)
        if self.strategy.name != "ddp" and self.train.amp == "fp16":
            raise _cross_field("train.amp", f"fp16 loss scaling is not supported with strategy.name="
                                            f"{self.strategy.name}; use bf16", self.train.amp)
        return self

    @model_validator(mode="after")
    def _fast_weights_need_batch(self) -> Config:
        if self.model.method != "batch" and self.optim.fast_weight_lr_scale != 1:
            raise _cross_field("optim.fast_weight_lr_scale", "applies to model.method=batch only (its fast weights),"
                                                             f" not {self.model.method!r}",
                               self.optim.fast_weight_lr_scale)
        return self

    @model_validator(mode="after")
    def _eval_members_exist(self) -> Config:
        """Checked here so that eval.at_end cannot fail only after the whole training run."""
        if self.eval.members is not None and self.eval.members > self.model.num_members:
            raise _cross_field("eval.members", f"the model has only model.num_members={self.model.num_members} "
                                               "members", self.eval.members)
        return self

    @model_validator(mode="after")
    def _text_needs_text_model(self) -> Config:
        """A text batch is a dict of token ids: image augmentations or a timm model would fail on it mid-start."""
        text = self.data.dataset == "sst2"
        if text != (self.model.source == "hf"):
            raise _cross_field("model.source", f"data.dataset={self.data.dataset!r} needs model.source="
                                               f"{'hf' if text else 'timm'}", self.model.source)
        for key in ("mixup_alpha", "cutmix_alpha", "randaugment"):
            if text and getattr(self.train, key):
                raise _cross_field(f"train.{key}", "an image augmentation; set it to 0/null for text data",
                                   getattr(self.train, key))
        return self

    def without_source_weights(self) -> Config:
        """This config with the backbone built untrained (no ``model.pretrained`` read, no ``model.init_from``):
        for a model whose weights come next from a checkpoint, or from rank 0 when wrapping broadcasts them.
        Everything else, ``affine_init`` as resolved included, stays as it is."""
        return self.model_copy(update={"model": self.model.model_copy(update={"pretrained": False,
                                                                              "init_from": None})})

    def data_root(self) -> Path | None:
        """``data.root``, or the Debian package's folder for Fashion-MNIST; None for synthetic data or if unset."""
        return resolve_root(self.data.dataset, self.data.root)


# ---------------------------------------------------------------------------------------------------------------------
# Loading

# Set by an override, one of these pairs replaces the other even when the recipe sets it: `train.max_steps=50` on an
# epochs recipe means "50 steps instead", not a both-set error.
_REPLACES = {"train.max_steps": "train.epochs", "train.epochs": "train.max_steps"}
_FILE = "(file)"  # the path shown for problems with the file as a whole


class _Loader(yaml.SafeLoader):
    """safe_load, plus: ``1e-3`` is a float (YAML 1.1 wants ``1.0e-3``), dates stay strings (a run name like
    2024-05-01 must not become a date), and a key given twice is recorded instead of the first one silently losing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[str] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                self.duplicates.append(_line(key, f"key given twice, on lines {seen[key]} and {line}", key))
            elif isinstance(key, str):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _parse_yaml(text: str) -> tuple[Any, list[str]]:
    loader = _Loader(text)
    try:
        return loader.get_single_data(), loader.duplicates
    finally:
        loader.dispose()


def _recipes_dir() -> Path:
    """Where the recipes are: inside the package in an installed wheel (pyproject's force-include copies them there),
    else the checkout's top-level ``configs/`` (a source tree or an editable install: the one copy)."""
    package = Path(__file__).resolve().parent
    shipped = package / "configs"
    return shipped if shipped.is_dir() else package.parent / "configs"


RECIPES = _recipes_dir()


def recipe_path(path: str | Path) -> Path:
    """``path`` itself when it exists or names a folder; else the packaged recipe of that name (``demo`` or
    ``demo.yaml``), so ``--config NAME`` works after a plain ``pip install``."""
    p = Path(path)
    if p.exists() or p.parent != Path("."):
        return p
    packaged = RECIPES / (p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml")
    return packaged if packaged.is_file() else p


def recipes() -> list[str]:
    """The names of the packaged recipes."""
    return sorted(q.stem for q in RECIPES.glob("*.yaml"))


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, check_data: bool = True) -> Config:
    """The config in the YAML file ``path`` (None: the defaults) with ``dotted.key=value`` ``overrides`` applied.

    Override values are YAML (``8``, ``0.25``, ``true``, ``null``, ``[a, b]``); a dotted key may reach into a
    dict field (``model.kwargs.img_size=32``). With ``check_data`` the data root must exist unless the data is
    synthetic. Raises one :class:`ConfigError` listing every problem found.
    """
    path = recipe_path(path) if path is not None else None
    source = str(path) if path is not None else "<defaults>"
    problems: list[str] = []
    raw = _read_file(path, problems) if path is not None else {}
    _apply_overrides(raw if raw is not None else {}, overrides, problems)
    if raw is None:  # the file itself is unusable: validating the rest would only add misleading lines
        raise ConfigError(source, problems)
    cfg: Config | None = None
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        problems.extend(_from_pydantic(e) for e in err.errors(include_url=False))
    if check_data:
        data = cfg.data if cfg is not None else _valid_or_none(DataConfig, raw.get("data", {}))
        if data is not None:
            problems.extend(_data_problems(data))
    if problems:
        raise ConfigError(source, problems)
    assert cfg is not None
    return cfg


def check_paths(cfg: Config, source: str = "<config>") -> None:
    """Raise :class:`ConfigError` if the data root is unset or missing (synthetic data needs none)."""
    problems = _data_problems(cfg.data)
    if problems:
        raise ConfigError(source, problems)


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write ``cfg`` fully resolved (every default spelt out) as YAML, atomically: a reader or a crash mid-write
    never sees half a file. :func:`load_config` on the result gives back an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False, default_flow_style=False)
    return write_text(path, text)


def flatten(cfg: Config) -> dict[str, Any]:
    """``{"model.num_members": 4, "reg.lambda": 0.001, ...}``: scalars under dotted keys, for MLflow params.
    Lists and empty dicts become JSON strings; dict fields such as ``model.kwargs`` are flattened too."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        elif isinstance(value, (dict, list)):
            out[prefix] = json.dumps(value)
        else:
            out[prefix] = value

    walk("", cfg.model_dump(mode="json", by_alias=True))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def _read_file(path: Path, problems: list[str]) -> dict[str, Any] | None:
    """The file's mapping with null sections as ``{}``; None (and a problem) if it cannot be used at all."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        problems.append(_line(_FILE, f"cannot read the config file: {err.strerror or err} (a path, or a packaged "
                                     f"recipe: {', '.join(recipes())})", str(path)))
        return None
    try:
        raw, duplicates = _parse_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problems.append(_line(_FILE, f"not valid YAML: {getattr(err, 'problem', None) or err}{where}", str(path)))
        return None
    problems.extend(duplicates)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(_line(_FILE, "the top level must be a mapping of sections (model:, train:, ...)", raw))
        return None
    for key in _SECTIONS:
        if key in raw and raw[key] is None:
            raw[key] = {}
    return raw


def _apply_overrides(raw: dict[str, Any], overrides: Sequence[str], problems: list[str]) -> None:
    top = _keys_of(Config)
    given: dict[str, Any] = {}
    for text in overrides:
        key, sep, value_text = text.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not all(parts):
            problems.append(_line(key or text, "an override must look like dotted.key=value", text))
            continue
        if parts[0] not in top:
            problems.append(_line(key, f"unknown top-level key {parts[0]!r}{_did_you_mean(parts[0], top)}; known: "
                                       f"{', '.join(sorted(Config.model_fields))}", text))
            continue
        try:
            value, _ = _parse_yaml(value_text)
        except yaml.YAMLError as err:
            problems.append(_line(key, f"the value is not valid YAML ({getattr(err, 'problem', None) or err})",
                                  value_text))
            continue
        node = raw
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                problems.append(_line(key, f"{'.'.join(parts[:depth + 1])} is not a mapping, so it has no key "
                                           f"{parts[depth + 1]!r}", text))
                break
            node = child
        else:
            for twin in _twins(parts):  # `reg.lambda=` over a recipe's `lam:` replaces it, not a both-given error
                node.pop(twin, None)
            node[parts[-1]] = value
            given[key] = value
    for key, value in given.items():
        other = _REPLACES.get(key)
        if value is not None and other is not None and other not in given:
            section, field = other.split(".")
            raw.setdefault(section, {})[field] = None


def _twins(parts: Sequence[str]) -> list[str]:
    """The other spellings (name or alias) of the field at ``parts``."""
    model = _model_at(parts[:-1])
    if model is None:
        return []
    for name, field in model.model_fields.items():
        spellings = {name, field.alias} - {None}
        if parts[-1] in spellings:
            return sorted(spellings - {parts[-1]})
    return []


def _model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    """The section class at a dotted location (``()`` is :class:`Config`); None inside non-section fields."""
    model: type[BaseModel] = Config
    for part in loc:
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def _keys_of(model: type[BaseModel]) -> list[str]:
    return [k for n, f in model.model_fields.items() for k in (n, f.alias) if k]


_SECTIONS = [n for n, f in Config.model_fields.items() if issubclass(f.annotation, BaseModel)]
_MESSAGES = {"greater_than": "must be > {gt}", "greater_than_equal": "must be >= {ge}", "less_than": "must be < {lt}",
             "less_than_equal": "must be <= {le}", "finite_number": "must be a finite number",
             "int_parsing": "must be an integer", "int_from_float": "must be a whole number",
             "float_parsing": "must be a number", "bool_parsing": "must be true or false",
             "string_too_short": "must not be empty", "literal_error": "must be {expected}",
             "string_type": "must be a string", "dict_type": "must be a mapping", "list_type": "must be a list",
             "tuple_type": "must be a list", "too_short": "must have {min_length} items",
             "too_long": "must have {max_length} items"}


def _from_pydantic(err: dict[str, Any]) -> str:
    loc, got, kind, ctx = list(err["loc"]), err.get("input"), err["type"], err.get("ctx") or {}
    if kind == "config_field":
        loc.append(ctx["field"])
        got, what = ctx["got"], err["msg"]
    elif kind == "extra_forbidden":
        section = _model_at(loc[:-1])
        what = "unknown key" + (_did_you_mean(str(loc[-1]), _keys_of(section)) if section else "")
    elif kind in _MESSAGES:
        what = _MESSAGES[kind].format(**ctx)
    else:
        what = err["msg"].removeprefix("Value error, ")
        what = what[:1].lower() + what[1:]
    return _line(_dotted(loc), what, got)


def _dotted(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "(top level)"


def _line(path: str, what: str, got: Any) -> str:
    shown = repr(str(got)) if isinstance(got, Path) else repr(got)
    if len(shown) > 100:
        shown = shown[:97] + "..."
    return f"  - {path}: {what} (got {shown})"


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _valid_or_none(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError:
        return None


def _data_problems(data: DataConfig) -> list[str]:
    spec = DATASETS[data.dataset]
    if spec.kind == "synthetic":
        return []
    root, hint = resolve_root(data.dataset, data.root), spec.hint
    if root is None:
        return [_line("data.root", f"must be set for data.dataset={data.dataset!r}; {hint}", None)]
    if not root.exists():
        default = f" (the default for {data.dataset})" if data.root is None else ""
        return [_line("data.root", f"{root}{default} does not exist; {hint}", data.root)]
    return []
