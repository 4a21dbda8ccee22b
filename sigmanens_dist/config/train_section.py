"""The ``train`` section of the config: the step loop (budget, batch, precision, augmentation) and its AugMix
subsection. Its own file, as ``model_section.py`` is, so that schema.py stays the whole-run view (the cross-section
checks on :class:`~sigmanens_dist.config.schema.Config`) and each section is read in one short file."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from sigmanens_dist.config.model_section import Float, Int, _cross_field, _Section

__all__ = ["AugMixConfig", "TrainConfig"]


class AugMixConfig(_Section):
    """``train.augmix``: torchvision's AugMix (Hendrycks et al. 2020) on each training sample, restricted to the
    operations disjoint from the test corruptions (``all_ops=False``: autocontrast, equalize, posterize, rotate,
    solarize, shear, translate; never brightness, contrast, colour or sharpness), so a shift score measures
    robustness to corruptions the network never trained on."""

    severity: Int = Field(3, ge=1, le=10)  # the operations' strength: magnitudes drawn from the first `severity` of 10
    mixture_width: Int = Field(3, ge=1)  # augmentation chains mixed per sample
    chain_depth: Int = Field(-1, ge=-1)  # operations per chain; -1: drawn from 1–3 per chain
    alpha: Float = Field(1.0, gt=0, allow_inf_nan=False)  # Dirichlet and Beta parameter of the mixing weights
    # member k's severity (one per member, for members that read their own batches): a spread of strengths makes the
    # members differ by their data; null: every member uses severity
    member_severity: list[Int] | None = None

    @field_validator("chain_depth")
    @classmethod
    def _depth_given(cls, depth: int) -> int:
        """torchvision reads 0 as a random depth too: one spelling for it."""
        if depth == 0:
            raise ValueError("must be -1 (a depth drawn from 1–3 per chain) or >= 1")
        return depth

    @field_validator("member_severity")
    @classmethod
    def _severities_in_range(cls, severities: list[int] | None) -> list[int] | None:
        bad = [s for s in severities or () if not 1 <= s <= 10]
        if bad:
            raise ValueError(f"every entry must be a severity 1–10, one per member; {bad} are not")
        return severities

    @model_validator(mode="after")
    def _one_severity_source(self) -> AugMixConfig:
        """With member_severity, severity is not read: a changed one would be dropped without a word (a saved config
        repeats the default)."""
        default = type(self).model_fields["severity"].default
        if self.member_severity is not None and self.severity != default:
            raise _cross_field("severity", f"is not used with member_severity={self.member_severity} (member k "
                                           f"trains at its k-th entry); drop one of them", self.severity)
        return self


class TrainConfig(_Section):
    """The step loop. Exactly one of ``epochs`` / ``max_steps`` gives the budget; ``batch_size`` is per rank."""

    epochs: Int | None = Field(1, ge=1)
    max_steps: Int | None = Field(None, ge=1)
    batch_size: Int = Field(128, ge=1)
    grad_accum: Int = Field(1, ge=1)
    # reduction of the member task losses over members (objective.py); None: the method's (sum for deep, else mean)
    member_loss: Literal["mean", "sum"] | None = None
    clip_grad: Float | None = Field(None, gt=0, allow_inf_nan=False)
    amp: Literal["none", "bf16", "fp16"] = "none"
    label_smoothing: Float = Field(0.0, ge=0, lt=1)
    ema_decay: Float | None = Field(None, gt=0, lt=1)
    eval_every_steps: Int | None = Field(None, ge=1)  # None: at each epoch end (and at the end)
    log_every_steps: Int = Field(10, ge=1)
    mixup_alpha: Float = Field(0.0, ge=0, allow_inf_nan=False)
    cutmix_alpha: Float = Field(0.0, ge=0, allow_inf_nan=False)
    randaugment: str | None = None  # a timm auto-augment string, e.g. "rand-m9-mstd0.5-inc1"
    # AugMix of the training samples (raw Fashion-MNIST and CIFAR); null: off; true or {}: the defaults
    augmix: AugMixConfig | None = None
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

    @field_validator("augmix", mode="before")
    @classmethod
    def _augmix_switch(cls, value: Any) -> Any:
        """``train.augmix=true`` switches it on with the defaults, as ``{}`` does; false is off, as null is."""
        if isinstance(value, bool):
            return {} if value else None
        if value is not None and not isinstance(value, dict | AugMixConfig):
            raise ValueError("must be a mapping of severity, mixture_width, chain_depth and alpha, true (the "
                             "defaults) or null (off)")
        return value

    @model_validator(mode="after")
    def _exactly_one_budget(self) -> TrainConfig:
        if self.epochs is not None and self.max_steps is not None:
            raise _cross_field("max_steps", f"set only one of train.epochs (here {self.epochs}) and train.max_steps; "
                                            "set the other to null", self.max_steps)
        if self.epochs is None and self.max_steps is None:
            raise _cross_field("epochs", "set one of train.epochs and train.max_steps", None)
        return self
