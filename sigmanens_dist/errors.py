"""Errors that are the user's to fix, told apart from bugs.

A :class:`UsageError` (a bad config value, a path that is not there, a checkpoint of another run or strategy) is
reported by the command-line entry points as its message alone, from rank 0, with exit status 2, and the Slurm
scripts do not requeue it: retrying cannot help. It is raised where the bad value is found, and only for a value
that comes from the user (a config value, a path, a dataset, a command-line option, a public function's argument);
nothing else becomes exit 2. An :class:`UnavailableError` (a server that does not answer) is one line too, but
exit 1, which batch scripts retry. Any other exception keeps its traceback (exit 1). The subclasses keep the
built-in types callers already catch. The rule is kept by tests/test_error_model.py.
"""

from __future__ import annotations

__all__ = ["EXIT_UNAVAILABLE", "EXIT_USAGE", "USAGE_MARKER", "MissingPathError", "RunExistsError", "UnavailableError",
           "UnsupportedError", "UsageError"]

EXIT_USAGE = 2  # argparse's status for a bad command line: the same contract for a bad config
EXIT_UNAVAILABLE = 1  # a failure like any other for a batch script, which retries it a bounded number of times
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


class UnavailableError(ConnectionError):
    """A server the command needs (the data server, the tracking server) did not answer, after the retries: maybe
    transient, so not a :class:`UsageError` (exit 1, which a batch script retries) but one line naming the server,
    since its traceback would show only a client library's retry loop."""
