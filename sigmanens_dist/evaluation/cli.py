"""Deprecated since 0.3: the ``sigmanens eval`` parser is :mod:`sigmanens_dist.cli.eval`; this module
re-exports it for one release (``python -m sigmanens_dist.evaluation.cli`` still runs it)."""

import sys
import warnings

from sigmanens_dist.cli.eval import main, parse_corruptions, parse_severities

__all__ = ["main", "parse_corruptions", "parse_severities"]

warnings.warn("sigmanens_dist.evaluation.cli moved to sigmanens_dist.cli.eval", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    sys.exit(main())
