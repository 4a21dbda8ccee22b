"""Deprecated since 0.3: ``sigmanens demo`` is :mod:`sigmanens_dist.cli.demo`; this module
re-exports it for one release (``python -m sigmanens_dist.experiments.demo`` still runs it)."""

import sys
import warnings

from sigmanens_dist.cli.demo import RECIPE, main

__all__ = ["RECIPE", "main"]

warnings.warn("sigmanens_dist.experiments.demo moved to sigmanens_dist.cli.demo", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    sys.exit(main())
