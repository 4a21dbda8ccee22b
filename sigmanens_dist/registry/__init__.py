"""The hand-off to MLflow's Model Registry: a program as a registered, served MLflow Model (docs/deploy.md).

``register`` logs and registers a program and fetches one back by its ``models:/`` URI; ``pyfunc_program`` is the
code file logged with the model, which runs without this package (it is never imported from here: loading it
declares the model to MLflow).
"""

from __future__ import annotations

from sigmanens_dist.registry.register import (
    MODEL_URI,
    check_alias,
    check_name,
    check_registration,
    check_store,
    fetch_program,
    recorded_tracking_uri,
    register_program,
)

__all__ = ["MODEL_URI", "check_alias", "check_name", "check_registration", "check_store", "fetch_program",
           "recorded_tracking_uri", "register_program"]
