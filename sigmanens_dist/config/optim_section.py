"""The ``optim`` and ``schedule`` sections of the config: the optimiser and its learning-rate schedule over steps.
Their own file, as ``model_section.py`` is, so that schema.py stays the whole-run view and each section is read in
one short file."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from sigmanens_dist.config.model_section import Float, Int, _cross_field, _Section

__all__ = ["OptimConfig", "ScheduleConfig"]


class OptimConfig(_Section):
    """The optimiser; ``lr`` is the peak rate after warm-up, for the global batch the recipe states."""

    name: Literal["sgd", "adamw"] = "sgd"
    lr: Float = Field(0.1, gt=0, allow_inf_nan=False)
    momentum: Float = Field(0.9, ge=0, lt=1)  # SGD only
    nesterov: bool = False  # SGD only
    weight_decay: Float = Field(5e-4, ge=0, allow_inf_nan=False)
    betas: tuple[Float, Float] = (0.9, 0.999)  # AdamW only
    # lr multiplier of the σ store (γ, member affines); num_members: M, which undoes the 1/M of a member-mean loss
    sigma_lr_scale: Float | Literal["num_members"] = "num_members"
    # lr multiplier of BatchEnsemble's fast weights r, s (uncertainty-baselines: 0.5 for ResNet-32x4, 1 for WRN-28-10)
    fast_weight_lr_scale: Float = Field(1.0, gt=0, allow_inf_nan=False)

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
    warmup_steps: Int = Field(0, ge=0)
    min_lr_ratio: Float = Field(0.0, ge=0, le=1)
