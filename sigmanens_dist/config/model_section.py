"""The ``model`` section of the config: the backbone (timm or Hugging Face), the ensemble method and its knobs, and
how σN-Ens converts and initialises it; with the base every section shares (unknown keys are errors)."""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from sigmanens_dist.config.messages import _did_you_mean
from sigmanens_dist.timm_names import registered_without_import

__all__ = ["Float", "Int", "ModelConfig"]


def _cross_field(field: str, message: str, got: Any) -> PydanticCustomError:
    """An error from a section-level check that still points at one field (pydantic would only name the section)."""
    return PydanticCustomError("config_field", message, {"field": field, "got": got})


def _number(what: str) -> BeforeValidator:
    """Refuse booleans and strings where ``what`` is wanted: pydantic would read ``true`` (and YAML's ``yes``, ``on``)
    as 1 and ``"5"`` as 5, so ``model.num_members=true`` trained one member without a word."""

    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise PydanticCustomError("number_type", f"must be {what}, not a boolean (YAML reads yes/no and on/off "
                                                     "as true/false)")
        if isinstance(value, str):
            raise PydanticCustomError("number_type", f"must be {what}, not a string")
        return value

    return BeforeValidator(check)


# The config's number types; every int or float field uses one. A float field takes an int, an int field a whole float
# (``1e4`` steps); neither takes a boolean or a string.
Int = Annotated[int, _number("an integer")]
Float = Annotated[float, _number("a number")]


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
    num_classes: Int | None = Field(None, ge=1)  # None: the dataset's
    in_chans: Int | None = Field(None, ge=1)  # None: the dataset's
    kwargs: dict[str, Any] = Field(default_factory=dict)  # more timm.create_model kwargs, e.g. img_size, patch_size
    # sigma: σN-Ens; single: the plain backbone; deep: Deep Ensemble; batch: BatchEnsemble; packed: Packed-Ensembles
    # (timm ResNet family); film: per-member norms without σ gate or L_div (docs/methods.md)
    method: Literal["sigma", "single", "deep", "batch", "packed", "film"] = "sigma"
    num_members: Int = Field(4, ge=1)  # M (not used by method=single)
    # independent: each member reads its own data order (member k that of a run with seed+k); shared: every member
    # sees the same batch. None: the method's default (independent for sigma, film and deep; shared for the others)
    member_batches: Literal["shared", "independent"] | None = None
    packed_alpha: Float = Field(2.0, gt=0, allow_inf_nan=False)  # packed: width factor α
    packed_gamma: Int = Field(1, ge=1)  # packed: sub-groups per member γ
    fast_weight_init_std: Float = Field(0.5, ge=0, allow_inf_nan=False)  # batch: r, s ~ N(1, std)
    film_init_std: Float = Field(0.1, ge=0, allow_inf_nan=False)  # film: member scales = source × N(1, std)
    # γ ~ N(mean, std²); 2 and 0.1 start every member "on" (σ(γ) ≈ 0.88) where σ' is still large enough for L_div
    # to switch members off (at 3, σ'(3) ≈ 0.045, τ did nothing in a trained model): README "Long budget"
    gamma_init_mean: Float = Field(2.0, allow_inf_nan=False)
    gamma_init_std: Float = Field(0.1, ge=0, allow_inf_nan=False)
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
            import timm  # lazy: timm imports torch; `--check` answers without it

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
