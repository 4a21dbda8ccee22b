"""Deprecated since 0.3: the ``sigmanens train`` parser is :mod:`sigmanens_dist.cli.train`; this module
re-exports it for one release (``python -m sigmanens_dist.train_cli`` still runs it)."""

import sys
import warnings

from sigmanens_dist.cli.train import main, parser
from sigmanens_dist.errors import USAGE_MARKER

__all__ = ["USAGE_MARKER", "main", "parser"]

warnings.warn("sigmanens_dist.train_cli moved to sigmanens_dist.cli.train", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    sys.exit(main())
