"""``sigmanens compare … --register-best NAME [--by val/nll]``: the child of a study that is best on a validation
metric, exported as a program and registered (docs/deploy.md). Never chosen on the test set: a model picked by its
test score has no unbiased test score left."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from sigmanens_dist.checkpoint import resolve_checkpoint
from sigmanens_dist.errors import UsageError
from sigmanens_dist.experiments.compare import RunRecord, mlflow_client
from sigmanens_dist.export.program import export_program
from sigmanens_dist.models import load_trained
from sigmanens_dist.registry.register import TAG_PREFIX, check_registration, register_program

__all__ = ["BY", "parse_by", "register_best"]

# --by: the validation metric (as the trainer logs it) -> whether higher is better
BY = {"val/nll": False, "val/acc": True, "val/ece": False, "val/brier": False}


def parse_by(text: str) -> str:
    """``--by``, refused in one line unless it is a validation metric of :data:`BY`."""
    if text in BY:
        return text
    if "test" in text.split("/"):
        raise UsageError(f"--by {text}: a test-set metric; the best child is chosen on validation only (a test "
                         f"score that chose the model no longer measures it): choose {', '.join(BY)}")
    raise UsageError(f"--by {text!r}: choose one of {', '.join(BY)} (validation metrics)")


def _best(records: list[RunRecord], by: str) -> tuple[RunRecord, float, int]:
    """The record best on ``by``, its value, and how many records had a finite value of it (ties: the first given).
    A child whose value is NaN or infinite (a run that diverged) is never best: each is named on stdout."""
    column = by.removeprefix("val/")
    scored = [(r, r.split_values.get("val", {})[column]) for r in records if column in r.split_values.get("val", {})]
    for record, value in scored:
        if not math.isfinite(value):
            print(f"skipped {record.name}: its {by} is {value} (the run diverged); a non-finite metric is never best")
    finite = [(record, value) for record, value in scored if math.isfinite(value)]
    if not finite:
        why = "a finite value of" if scored else "the validation metric"
        raise UsageError(f"--register-best: no compared run has {why} {by} (logged by the training loop's "
                         "validation)")
    sign = -1.0 if BY[by] else 1.0
    best, value = min(finite, key=lambda pair: sign * pair[1])
    return best, value, len(finite)


def register_best(uri: str, records: list[RunRecord], name: str, by: str, alias: str | None,
                  study: str | None) -> Any:
    """Export the run of ``records`` best on validation metric ``by`` (its checkpoint as ``sigmanens export RUN``
    picks it, found through the run's ``run_dir`` param) and register it as a version of ``name``, tagged with the
    study and the choice; returns the version."""
    best, value, candidates = _best(records, by)
    run_dir = mlflow_client(uri).get_run(best.run_id).data.params.get("run_dir")
    if run_dir is None or not Path(run_dir).is_dir():
        raise UsageError(f"--register-best: the best child {best.name} ({by} {value:.4g}) has no run directory here "
                         f"({run_dir}); export and register it where it is: sigmanens export RUN --program OUT "
                         f"--register {name}")
    checkpoint, which = resolve_checkpoint(run_dir, "--register-best")
    run = check_registration(uri, best.run_id, name, alias)  # before the program is exported for it
    print(f"best on {by}: {best.name} ({value:.4g}, of {candidates}); exporting {which}")
    tags = {f"{TAG_PREFIX}chosen_by": by, f"{TAG_PREFIX}chosen_value": repr(value),
            f"{TAG_PREFIX}chosen_among": str(candidates), f"{TAG_PREFIX}child": best.name}
    if study is not None:
        tags[f"{TAG_PREFIX}study"] = study
    with tempfile.TemporaryDirectory(prefix="sigmanens-best-") as tmp:
        program = Path(tmp) / f"{best.name}.pt2"
        export_program(load_trained(checkpoint), program)
        return register_program(program, name, uri=uri, run=run, alias=alias, tags=tags)
