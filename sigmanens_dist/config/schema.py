"""The run configuration's schema: typed sections checked by pydantic (``model``, ``train``, ``data``, …), their
defaults and the checks between fields. Unknown keys are errors everywhere: a misspelt key must never silently train
with the default instead. The ``model``, ``train`` and ``optim``/``schedule`` sections live in their own
``*_section.py`` files and are re-exported here; the checks that need the whole run stay on :class:`Config`."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from sigmanens_dist.catalog.corruption_table import CORRUPTIONS, shift_split_problem, unknown
from sigmanens_dist.catalog.datasets import DATASETS, DatasetName, resolve_root, take_augmix, take_randaugment
from sigmanens_dist.config.model_section import Float, Int, ModelConfig, _cross_field, _number, _Section
from sigmanens_dist.config.optim_section import OptimConfig, ScheduleConfig
from sigmanens_dist.config.train_section import AugMixConfig, TrainConfig
from sigmanens_dist.storage.remote import RemotePath, RemoteSettings

Alpha = Annotated[Float, Field(gt=0, lt=1)]  # a miscoverage level of conformal sets

__all__ = ["AugMixConfig", "CheckpointConfig", "Config", "DataConfig", "EvalConfig", "ModelConfig", "OptimConfig",
           "RegConfig", "RemoteConfig", "ScheduleConfig", "StrategyConfig", "TrackingConfig", "TrainConfig", "choices"]


def choices(section: type[BaseModel], field: str) -> tuple[Any, ...]:
    """The values a ``Literal`` field of a section allows, in order: the one list of them that command-line choices
    and the registries (methods, strategies, data formats; a test holds their keys equal) are read from."""
    annotation = section.model_fields[field].annotation
    literals = [annotation] if get_origin(annotation) is Literal else get_args(annotation)  # Literal[...] | None
    return tuple(value for lit in literals if get_origin(lit) is Literal for value in get_args(lit))


class RegConfig(_Section):
    """The diversity regularizer: ``loss = task + lam * diversity(tau)``."""

    tau: Float = Field(0.5, gt=0, allow_inf_nan=False)
    # 0.01 with τ = 0.5: the best measured recipe at the long budget (README "Long budget", docs/quality.md); 0 turns
    # L_div off (τ then does nothing); with normalize=members use λ·M of an unnormalised λ
    lam: Float = Field(0.01, ge=0, allow_inf_nan=False, alias="lambda")
    # L_div as the sum over members and features (none), / M (members) or / (M·F) (mean); see regularizer.py
    normalize: Literal["none", "members", "mean"] = "none"
    regularize: list[str] | None = None  # fnmatch patterns of σ layers the regularizer sees; None: all

    @model_validator(mode="before")
    @classmethod
    def _one_spelling(cls, data: Any) -> Any:
        """Without this, giving both would report the name as an 'unknown key', which misleads."""
        if isinstance(data, dict) and "lam" in data and "lambda" in data:
            raise _cross_field("lambda", "given twice, as reg.lam and as reg.lambda; keep one", data["lambda"])
        return data


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # http://, https://, s3://, gs://, …


class RemoteConfig(_Section):
    """How webdataset shards are read from an ``http(s)://`` or ``s3://`` ``data.root``; credentials come from the
    environment (AWS_ACCESS_KEY_ID, …), never from the config, which is logged and saved."""

    # failed attempts in a row on one object before the run stops; each waits twice the last (0.5 s first, ≤ 30 s)
    retries: Int = Field(5, ge=0)
    timeout_s: Float = Field(60.0, gt=0, allow_inf_nan=False)  # each connect and each read
    # whole shards each stream (rank × DataLoader worker) downloads ahead of the one it reads, in memory or past
    # 64 MiB in a TMPDIR file: read_ahead + 1 shards per stream at once; 0 streams the shard being read
    read_ahead: Int = Field(1, ge=0)
    # a node-local folder keeping a copy of each shard read (named by its sha256), so later epochs, ranks and member
    # streams on the node read it from disk; None: every read streams. cache_gb: the least recently used copies
    # go beyond it. A folder that cannot take a copy (read-only, full) is one warning and the shards are streamed;
    # cache_required: true stops the run instead (exit 2)
    cache_dir: Path | None = None
    cache_gb: Float = Field(20.0, gt=0, allow_inf_nan=False)
    cache_required: bool = False

    @model_validator(mode="after")
    def _required_cache_is_named(self) -> RemoteConfig:
        if self.cache_required and self.cache_dir is None:
            raise _cross_field("cache_required", "true needs data.remote.cache_dir (the folder to cache in)", True)
        return self


class DataConfig(_Section):
    """Which dataset, in which format, from where; nothing is ever downloaded (webdataset shards may be streamed)."""

    dataset: DatasetName = "fashion_mnist"  # sigmanens_dist/catalog/datasets.py names them all
    format: Literal["raw", "ffcv", "webdataset"] = "raw"  # raw: the dataset's native on-disk format
    # None: /usr/share/datasets/fashion-mnist for fashion_mnist; required otherwise. webdataset also streams from
    # http(s)://HOST/PATH or s3://BUCKET/PREFIX (docs/data.md "Remote shards")
    root: Path | RemotePath | None = None
    num_workers: Int = Field(2, ge=0)
    img_size: Int | None = Field(None, ge=1)  # None: the dataset's native size
    train_subset: Int | None = Field(None, ge=1)  # only the first N train samples
    val_subset: Int | None = Field(None, ge=1)  # only the first N samples of the validation split
    test_subset: Int | None = Field(None, ge=1)  # only the first N samples of the test set (what `eval` scores)
    # The validation split, carved from the training set (after train_subset) by a permutation drawn from the run's
    # seed: a fraction in (0, 1) or a count ≥ 1. It is what the loop evaluates and what picks best.pt. 0 uses the
    # test set as validation instead, and only with val_from_test: true (a warning is logged).
    val_split: float | int = 0.1
    val_from_test: bool = False
    # The split is drawn from this seed, not from `seed`: runs of different seeds (and a Deep Ensemble's members,
    # which read seed+k's data order) then validate on the same samples, as paired comparisons need.
    split_seed: Int = Field(0, ge=0)
    # The calibration split: this many more pool samples (after val, same permutation), never trained on: what eval's
    # and export's --calibration/--conformal fit on instead of val, which picked best.pt; 0: none. Raw data only.
    calib_split: Int = Field(0, ge=0)
    max_length: Int = Field(64, ge=8)  # text: tokens per sample, padded or truncated to it
    # text: a local Hugging Face tokenizer folder (a pretrained backbone's own); None: <root>/tokenizer/, which a raw
    # run trains (WordPiece, on the training sentences) when absent and `sigmanens data convert` writes
    tokenizer: Path | None = None
    # an unreadable sample or out-of-range label: stop naming it, or skip it and count it (logged data/bad_samples)
    on_bad_sample: Literal["error", "skip"] = "error"
    remote: RemoteConfig = Field(default_factory=RemoteConfig)

    @model_validator(mode="before")
    @classmethod
    def _no_credentials_in_root(cls, data: Any) -> Any:
        """Here, not in the field's check: a field error would echo the URL, password included."""
        root = data.get("root") if isinstance(data, dict) else None
        if isinstance(root, str) and _URL.match(root) and "@" in urlsplit(root).netloc:
            parts = urlsplit(root)
            raise _cross_field("root", "credentials do not belong in a URL (it is logged and saved with the config); "
                                       "give them in the environment (AWS_ACCESS_KEY_ID, …)",
                               f"{parts.scheme}://…@{parts.hostname}{parts.path}")
        return data

    @field_validator("root", mode="before")
    @classmethod
    def _remote_root_streams_webdataset(cls, value: Any, info: ValidationInfo) -> Any:
        """A URL would become a Path (``https:/host/…``) and be reported as a missing folder, with advice to install
        Fashion-MNIST. Only webdataset streams (whole shards, in order); the other readers seek in local files."""
        if isinstance(value, RemotePath):
            value = str(value)
        if isinstance(value, str) and _URL.match(value):
            fmt = info.data.get("format")  # absent: itself invalid, and reported
            if fmt != "webdataset":
                raise ValueError(f"a remote root is read by data.format=webdataset only"
                                 f"{f', not data.format={fmt}' if fmt else ''}: give a local folder (copy or mount the "
                                 "data there), or convert it to webdataset shards and serve those")
            return RemotePath(value)  # refuses other schemes and credentials in the URL, naming them
        return value

    @model_validator(mode="after")
    def _remote_settings(self) -> DataConfig:
        """Every read below a remote root (manifests, shards, also in DataLoader workers) carries data.remote."""
        if isinstance(self.root, RemotePath):
            if self.dataset == "sst2" and self.tokenizer is None:
                raise _cross_field("tokenizer", f"a remote data.root ({self.root}) has its tokenizer/ read from a "
                                                "local folder: set data.tokenizer to a copy of it (sigmanens data "
                                                "convert writes it beside the shards)", None)
            r = self.remote
            self.root = self.root.with_settings(RemoteSettings(r.retries, r.timeout_s, r.read_ahead, r.cache_dir,
                                                             r.cache_gb, r.cache_required))
        return self

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
    def _calibration_split_is_carved_when_read(self) -> DataConfig:
        """Converted folders hold their converted splits: a calibration split of their ``train`` would be trained on."""
        if self.format != "raw" and self.calib_split:
            raise _cross_field("calib_split", f"applies to data.format=raw only: data.format={self.format} reads the "
                                              "train/val/test splits `sigmanens data convert` wrote; set it to 0",
                               self.calib_split)
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
    fsdp_replicate: Int | None = Field(None, ge=1)  # fsdp only: HSDP, replicas × shards mesh (None: 1, plain FSDP)
    zero_stage: Annotated[Literal[1, 2, 3], _number("1, 2 or 3")] | None = None  # deepspeed only (None: 2)
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
            if importlib.util.find_spec("deepspeed") is None:
                raise _cross_field("name", "DeepSpeed is not installed: pip install 'sigmanens-dist[deepspeed]'",
                                   self.name)
            if self.deepspeed_config is not None and not self.deepspeed_config.is_file():
                raise _cross_field("deepspeed_config", "no such file", str(self.deepspeed_config))
        return self


class CheckpointConfig(_Section):
    """When to checkpoint, how many to keep, and where to resume from."""

    every_steps: Int | None = Field(None, ge=1)  # None: at each epoch end
    keep_last: Int = Field(2, ge=1)
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
    corruptions: list[str] = Field(default_factory=list)  # names from catalog.corruption_table.CORRUPTIONS, or ["all"]
    severities: list[Int] = Field(default_factory=lambda: [1, 2, 3, 4, 5])
    ood: str | None = None  # an OOD set name (eval.ood_sets), e.g. digits for Fashion-MNIST, svhn for CIFAR
    ood_root: Path | None = None  # where the OOD set's files are (svhn)
    members: Int | None = Field(None, ge=1)  # score the first K members (default: all)
    sub_ensembles: bool = True  # also score k = 1..K-1 (one more pass of the eval set each; the M-scaling table)
    imagenet_c: Path | None = None  # a pre-generated ImageNet-C folder: <dir>/<corruption>/<severity>/<class>/<img>
    batch_size: Int | None = Field(None, ge=1)  # None: train.batch_size
    # temperature: one T fitted on the calibration split (data.calib_split) when the run has one, else on the val
    # split, scored before/after; member-temperature: also one T per member
    calibration: Literal["none", "temperature", "member-temperature"] = "none"
    # which corruptions corrupt which split (catalog.corruption_table.SHIFT_SPLITS): test, the test corruptions on the
    # test split (read once, at the end); val, the validation corruptions on the validation split (where choices are
    # made). None: eval.split's; given, it must be eval.split, so a shift pass never reads the other split
    shift_split: Literal["test", "val"] | None = None
    # miscoverages α of split conformal sets, fitted on the split calibration fits on (calib, else val)
    conformal: list[Alpha] = Field(default_factory=list)
    # the BatchNorm statistics at prediction: the training ones, or each batch's own mixed with them by the prior N
    # (evaluation/norm_stats.py; N = 0: the batch's alone); program_meta.py's NORM_STATS, for predict (a test)
    norm_stats: Literal["train", "batch"] = "train"
    norm_stats_prior: Float = Field(0.0, ge=0, allow_inf_nan=False)
    # how the shift passes batch their images: per-corruption, each corruption × severity in its own batches; mixed,
    # one shuffled stream of every corruption × severity and the clean images, as a deployment meets them
    # (evaluation/mixed.py), at batch_size
    shift_batches: Literal["per-corruption", "mixed"] = "per-corruption"

    @field_validator("conformal", mode="before")
    @classmethod
    def _alphas(cls, value: object) -> object:
        """``0.1`` is ``[0.1]``, null is none: the YAML and ``eval.conformal=0.1`` forms of one α."""
        return [] if value is None else value if isinstance(value, list | tuple) else [value]

    @model_validator(mode="after")
    def _prior_needs_batch_stats(self) -> EvalConfig:
        if self.norm_stats_prior and self.norm_stats != "batch":
            raise _cross_field("norm_stats_prior", f"{self.norm_stats_prior:g} goes with eval.norm_stats=batch (it "
                               "weights the training statistics against the batch's)", self.norm_stats_prior)
        return self

    @property
    def shift(self) -> str:
        """The shift split in force: ``shift_split``, else the split's."""
        return self.shift_split or self.split

    @model_validator(mode="after")
    def _shift_split_fits(self) -> EvalConfig:
        if self.shift != self.split:
            raise _cross_field("shift_split", f"{self.shift} corrupts the {self.shift} split, but eval.split is "
                               f"{self.split}: the clean and corrupted passes read one split; set both alike",
                               self.shift)
        problem = shift_split_problem(self.corruptions, self.shift)
        if problem is not None:
            raise _cross_field("corruptions", problem, self.corruptions)
        return self

    @field_validator("corruptions")
    @classmethod
    def _known_corruptions(cls, names: list[str]) -> list[str]:
        if not names:
            return names
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
    seed: Int = Field(0, ge=0)

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

    @model_validator(mode="after")
    def _randaugment_is_applied(self) -> Config:
        """Only the datasets catalog.datasets marks apply RandAugment: elsewhere it would be dropped without a word."""
        if self.train.randaugment and not DATASETS[self.data.dataset].randaugment:
            raise _cross_field("train.randaugment", f"data.dataset={self.data.dataset!r} does not apply it (its "
                               "readers keep their own augmentation); it applies to data.dataset "
                               f"{', '.join(take_randaugment())} only; set it to null", self.train.randaugment)
        return self

    @model_validator(mode="after")
    def _augmix_is_applied(self) -> Config:
        """Only the raw readers catalog.datasets marks apply AugMix: elsewhere it would be dropped without a word; and
        one auto-augmentation at a time."""
        augmix, data = self.train.augmix, self.data
        if augmix is None:
            return self
        got = augmix.model_dump(exclude_none=True)
        if self.train.randaugment:
            raise _cross_field("train.augmix", f"two auto-augmentations: train.randaugment={self.train.randaugment!r}"
                                               " is set too; set one of them to null", got)
        if not DATASETS[data.dataset].augmix:
            raise _cross_field("train.augmix", f"data.dataset={data.dataset!r} does not apply it (its readers keep "
                                               "their own augmentation); it applies to data.dataset "
                                               f"{', '.join(take_augmix())} only; set it to null", got)
        if data.format != "raw":
            raise _cross_field("train.augmix", f"data.format={data.format!r} does not apply it (its readers keep "
                                               "their own crop recipe); it applies to data.format=raw only; set it "
                                               "to null", got)
        return self

    @model_validator(mode="after")
    def _member_severity_has_members(self) -> Config:
        """``train.augmix.member_severity`` gives member k its own dataset: it needs one entry per member and members
        that read their own batches. What the config knows is checked here; a method whose default is to share one
        batch (model.member_batches unset) is refused at trainer set-up (data/member_streams.py), which knows it."""
        severities = self.train.augmix.member_severity if self.train.augmix is not None else None
        if severities is None:
            return self
        model, key = self.model, "train.augmix.member_severity"
        if model.method == "single" or model.num_members == 1:
            one = "model.method=single" if model.method == "single" else "model.num_members=1"
            raise _cross_field(key, f"needs an ensemble: {one} has one member; it applies to model.num_members >= 2 "
                                    "(set severity for one network)", severities)
        if len(severities) != model.num_members:
            raise _cross_field(key, f"gives {len(severities)} severities for model.num_members={model.num_members}; "
                                    "it takes exactly one per member", severities)
        if model.member_batches == "shared":
            raise _cross_field(key, "needs members that read their own batches, but model.member_batches='shared' "
                                    "gives every member one batch; set model.member_batches=independent (or null "
                                    "for sigma, film, deep)", severities)
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
