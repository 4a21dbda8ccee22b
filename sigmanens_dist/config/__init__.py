"""The run configuration: typed sections checked by pydantic, read from a YAML recipe plus ``key.sub=value`` overrides.

Everything wrong with a config is reported at once, in one :class:`ConfigError` with a ``dotted.path: what is wrong
(got value)`` line per problem, so a job that waited hours in a queue fails in seconds with the whole list to fix,
not one typo per resubmission. Unknown keys are errors everywhere: a misspelt key must never silently train with the
default instead.

Three parts: ``schema`` (the sections and their checks; the ``model``, ``train`` and ``optim``/``schedule`` sections
in their own ``*_section.py`` files, re-exported by ``schema``), ``loading`` (YAML + overrides → a validated config;
save, flatten, the packaged recipes), ``messages`` (:class:`ConfigError` and the wording of its lines). Everything
public is importable from here.
"""

from __future__ import annotations

from sigmanens_dist.config.loading import (
    RECIPES,
    check_paths,
    check_run_paths,
    config_from_dict,
    flatten,
    from_options,
    load_config,
    recipe_path,
    recipes,
    save_config,
)
from sigmanens_dist.config.messages import ConfigError
from sigmanens_dist.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RegConfig,
    ScheduleConfig,
    StrategyConfig,
    TrackingConfig,
    TrainConfig,
    choices,
)

__all__ = ["RECIPES", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "ModelConfig",
           "OptimConfig", "RegConfig", "ScheduleConfig", "StrategyConfig", "TrackingConfig", "TrainConfig",
           "check_paths", "check_run_paths", "choices", "config_from_dict", "flatten", "from_options", "load_config",
           "recipe_path", "recipes", "save_config"]
