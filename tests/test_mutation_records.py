"""checks/mutation.py keeps each group's outcome as a record, so that its report holds every group whichever were run
on this machine: a record reads back as the outcome it was, its survivors explained against today's equivalent list,
and goes stale when a module it mutated changed since."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
MODULE = "sigmanens_dist/sigma/regularizer.py"


@pytest.fixture(scope="module")
def mutation() -> ModuleType:
    sys.path.insert(0, str(REPO / "checks"))
    try:
        import mutation as module  # checks/mutation.py: a script, not a package module
    finally:
        sys.path.remove(str(REPO / "checks"))
    return module


def _outcome(mutation: ModuleType, equivalent_diff: tuple[list[str], list[str]]) -> object:
    outcome = mutation.Outcome("regularizer", seconds=61.0)
    outcome.counts = {MODULE: {"killed": 90, "survived": 3}}
    removed, added = equivalent_diff
    outcome.survivors = {MODULE: [
        mutation.Survivor("sigmanens_dist.sigma.regularizer.x_f__mutmut_1", "survived", ["a"], ["b"], "-a\n+b"),
        mutation.Survivor("sigmanens_dist.sigma.regularizer.x_f__mutmut_2", "survived", ["raise E('x')"],
                          ["raise E('y')"], "…", message_only=True),
        mutation.Survivor("sigmanens_dist.sigma.regularizer.x_diversity_loss__mutmut_9", "survived", removed, added,
                          "…")]}
    return outcome


def test_a_record_reads_back_and_goes_stale_when_its_module_changes(mutation: ModuleType, tmp_path: Path) -> None:
    _, removed, added, why = next(e for e in mutation.read_equivalents()
                                  if e[0] == "sigmanens_dist.sigma.regularizer.x_diversity_loss")
    group = mutation.GROUPS["regularizer"]
    work, records = tmp_path / "work", tmp_path / "records"
    (work / MODULE).parent.mkdir(parents=True)
    shutil.copy(REPO / MODULE, work / MODULE)  # the group's copy, as it was mutated
    mutation.save_record(_outcome(mutation, (removed, added)), group, work, records)

    loaded = mutation.load_record("regularizer", group, records)
    assert loaded.error is None and loaded.counts == {MODULE: {"killed": 90, "survived": 3}} and loaded.seconds == 61
    reasons = [s.reason for s in loaded.survivors[MODULE]]
    assert reasons == [None, mutation.MESSAGE, why]  # unexplained, message only, the written-down equivalent
    text, unexplained = mutation.report([loaded], "test")
    assert unexplained == 1 and "x_f__mutmut_1: survived" in text

    (work / MODULE).write_text((REPO / MODULE).read_text() + "\n# changed\n")  # mutated as another text
    mutation.save_record(_outcome(mutation, (removed, added)), group, work, records)
    stale = mutation.load_record("regularizer", group, records)
    assert stale.error is not None and stale.error.startswith(f"stale: {MODULE} changed")
    assert mutation.report([stale], "test")[1] == 2  # the survivor and the stale group
    assert "no run of this group on record" in mutation.load_record("sigma", mutation.GROUPS["sigma"], records).error
