"""Errors that are the user's to fix, told apart from bugs.

A :class:`UsageError` (a bad config value, a path that is not there, a checkpoint of another run or strategy) is
reported by the command-line entry points as its message alone, from rank 0, with exit status 2, and the Slurm
scripts do not requeue it: retrying cannot help. Any other exception is a bug and keeps its traceback. The
subclasses keep the built-in types callers already catch.
"""

from __future__ import annotations

__all__ = ["EXIT_USAGE", "USAGE_MARKER", "MissingPathError", "RunExistsError", "UnsupportedError", "UsageError"]

EXIT_USAGE = 2  # argparse's status for a bad command line: the same contract for a bad config
# in a run directory, the refusal of the last attempt: batch scripts (slurm/common.sh) read it and do not requeue
USAGE_MARKER = "usage_error.txt"


class UsageError(ValueError):
    """A mistake in what was asked for; the message says what and how to fix it."""


class MissingPathError(UsageError, FileNotFoundError):
    """A file or folder the user named is not there."""


class RunExistsError(UsageError, FileExistsError):
    """A new run was started in a run directory that holds another run's checkpoints."""


class UnsupportedError(UsageError, TypeError):
    """A model or value of a kind that cannot do what was asked (a backbone a method cannot convert, a method
    without per-member models)."""
