"""``sigmanens compare --records``: a records file is input like any other. A bad record is refused in one line naming
the file, the line, the field, the value and what is allowed (exit 2, no traceback); the names it carries reach the
CSVs and table.md as text that a spreadsheet will not run and that cannot break the table. No training: records are
written by hand."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from sigmanens_dist.cli.compare import main as compare_main
from sigmanens_dist.errors import UsageError
from sigmanens_dist.experiments.compare import CompareError, read_records


def _row(seed: int = 0, /, **fields: Any) -> dict[str, Any]:
    """A record of ``seed`` as save_records writes it, with ``fields`` in place of its own."""
    row = {"run_id": f"r{seed}", "name": f"sigma-M4-s{seed}", "status": "FINISHED", "method": "sigma", "members": 4,
           "tau": 0.5, "lam": 0.01, "seed": seed, "budget": 1, "variant": "", "values": {"params": 1e5},
           "split_values": {"val": {"acc": 0.8 + seed / 100, "nll": 0.5}}, "severity_ece": {"3": 0.1},
           "severity_nll": {"3": 1.0}, "sharing_history": {"250": [1.5, [0.5, 0.5]], "500": [1.0, [0.75, 0.25]]}}
    return row | fields


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_record_as_written_is_read_back(tmp_path: Path) -> None:
    (record,), notes = read_records([_write(tmp_path / "ok.jsonl", [_row(tau=1, values={"acc": float("nan")})])])
    assert notes == []
    assert (record.members, record.tau, record.seed) == (4, 1.0, 0) and isinstance(record.tau, float)
    assert record.severity_ece == {3: 0.1} and record.sharing_history[250] == (1.5, [0.5, 0.5])


@pytest.mark.parametrize(("fields", "problem"), [
    ({"members": "abc"}, "members: must be an integer from 1 to 4096 (got 'abc')"),
    ({"seed": [1, 2]}, "seed: must be an integer from 0 to 2**63 - 1 (got [1, 2])"),
    ({"members": 0}, "members: must be an integer from 1 to 4096 (got 0)"),
    ({"members": -3}, "members: must be an integer from 1 to 4096 (got -3)"),
    ({"members": 10**18}, "members: must be an integer from 1 to 4096 (got 1000000000000000000)"),
    ({"members": True}, "members: must be an integer from 1 to 4096 (got True)"),
    ({"members": "4"}, "members: must be an integer from 1 to 4096 (got '4')"),
    ({"seed": -1}, "seed: must be an integer from 0 to 2**63 - 1 (got -1)"),
    ({"tau": 0}, "tau: must be null or a finite number > 0 (got 0)"),
    ({"lam": "0.01"}, "lam: must be null or a finite number >= 0 (got '0.01')"),
    ({"budget": 0}, "budget: must be an integer from 1 to 1000 (got 0)"),
    ({"name": ""}, "name: must be a non-empty string (got '')"),
    ({"method": 7}, "method: must be a non-empty string (got 7)"),
    ({"variant": None}, "variant: must be a string (got None)"),
    ({"values": {"acc": "high"}}, "values['acc']: must be a mapping of column name to number (got 'high')"),
    ({"split_values": {"train": {}}}, "split_values['train']: must be a mapping of split (val, test)"),
    ({"severity_ece": {"x": 0.1}}, "severity_ece['x']: must be a mapping of corruption severity (an integer >= 1)"),
    ({"sharing_history": {"250": 1.5}}, "sharing_history['250']: must be a mapping of validation step"),
    ({"colour": "red"}, "colour: unknown field (a record has: run_id, name, status, method, members"),
])
def test_a_bad_field_is_one_line_naming_file_line_field_and_value(tmp_path: Path, fields: dict[str, Any],
                                                                  problem: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "bad.jsonl", [_row(0), _row(1, **fields)])
    assert compare_main(["--records", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --records {path}, line 2: not a run record: {problem}")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_line_that_is_no_record_at_all_is_one_line(tmp_path: Path) -> None:
    row = _row()
    del row["members"], row["seed"]
    for text, problem in (("{not json\n", "the line is not JSON ("), ("[1, 2]\n", "must be a JSON object (got [1, 2])"),
                          (json.dumps(row) + "\n", "missing fields: members, seed")):
        (tmp_path / "bad.jsonl").write_text("\n" + text)  # a blank line is skipped, the numbering is the file's
        with pytest.raises(CompareError) as caught:
            read_records([tmp_path / "bad.jsonl"])
        assert isinstance(caught.value, UsageError) and "\n" not in str(caught.value)
        assert str(caught.value).startswith(f"--records {tmp_path / 'bad.jsonl'}, line 2: not a run record: ")
        assert problem in str(caught.value)


def test_names_reach_the_csvs_as_text_and_the_markdown_table_intact(tmp_path: Path) -> None:
    """Run, method and variant names are whatever was logged: ``=HYPERLINK(…)`` must stay text in a spreadsheet (a
    leading ``'``, OWASP's advice), a ``|`` must not split a cell of table.md; numbers, negative ones too, are written
    as numbers."""
    formula = '=HYPERLINK("http://x","y")'
    rows = [_row(s, method="single", members=1, tau=None, lam=None, run_id=f"-s{s}", name=f"@single-s{s}",
                 split_values={"val": {"acc": 0.9}}, sharing_history={}) for s in range(2)]
    rows += [_row(s, method=formula, variant="a|b", name=f"+x-s{s}", run_id=f"\tr{s}") for s in range(2)]
    out = tmp_path / "out"
    assert compare_main(["--records", str(_write(tmp_path / "r.jsonl", rows)), "--out", str(out)]) == 0

    with (out / "table.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["method"] for r in table] == ["single", f"'{formula} (a|b)"]
    diff = next(r for r in table if r["method"] != "single")["diff_acc_vs_single_mean"]
    assert float(diff) < 0 and not diff.startswith("'")  # a number stays a number
    with (out / "runs.csv").open(newline="") as f:
        runs = list(csv.DictReader(f))
    assert {(r["run_id"], r["name"], r["method"]) for r in runs} == {
        *((f"'-s{s}", f"'@single-s{s}", "single") for s in range(2)),
        *((f"'\tr{s}", f"'+x-s{s}", f"'{formula}") for s in range(2))}

    table_md = (out / "table.md").read_text().splitlines()
    row = next(line for line in table_md if "HYPERLINK" in line)
    assert f"| {formula} (a\\|b) | 4 |" in row
    header_cells = table_md[0].count(" | ") + 1
    assert row.replace("\\|", "").count(" | ") + 1 == header_cells  # as many cells as the header
