"""sigmanens-dist: train σN-Ens ensembles (a shared backbone with M member σ-norms) at scale."""

from __future__ import annotations

__all__ = ["SigmaEnsemble", "convert_to_sigma_ensemble", "diversity_loss", "members_on", "optimal_members_on"]
__version__ = "0.3.0"

# name -> the module defining it, imported on first use: these import torch, which `sigmanens --help`, `--check` and
# the other commands that need no model should not wait for (tests/cli/test_cli_startup.py).
_LAZY = {"SigmaEnsemble": "sigmanens_dist.methods.sigma", "convert_to_sigma_ensemble": "sigmanens_dist.methods.sigma",
         "diversity_loss": "sigmanens_dist.sigma.regularizer", "members_on": "sigmanens_dist.sigma.regularizer",
         "optimal_members_on": "sigmanens_dist.sigma.regularizer"}


def __getattr__(name: str) -> object:  # nothing imported up front: `-m sigmanens_dist.train` runs this before its guard
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
