"""The output folder of ``sigmanens predict``::

    DIR/manifest.json           what DIR holds: the program's sha256, the inputs and their units, the format
    DIR/parts/<unit>.parquet    one per finished unit (or .jsonl), written atomically: present means complete
    DIR/summary.json            counts, per-class predictions, means, skipped inputs, throughput (rank 0, at the end)
    DIR/.lock                   held while a predict writes DIR: a second one is refused in one line naming it

A rerun with the same program and inputs skips the units whose part exists; one with another program, other inputs
or another format is refused unless ``--force``, which starts over. A part's skipped inputs travel with it (parquet:
the file's key-value metadata ``sigmanens.part``; jsonl: its first line), so the summary of a resumed run still
names those of the first.

Nothing lost: predict writes only into a new or empty folder or one holding its own ``manifest.json``, and
``--force`` deletes only what that manifest names (its part files) and the summary, never another file; an ``--out``
that is or holds an input, or lies inside an input folder, is refused before any work (:func:`check_out`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sigmanens_dist.atomic import atomic_write, check_writable_folder, write_text
from sigmanens_dist.errors import UsageError
from sigmanens_dist.program_meta import ProgramMeta
from sigmanens_dist.training.run_lock import LOCK_FILE

__all__ = ["FORMAT", "MANIFEST", "PARTS", "PART_KEY", "SUMMARY", "check_claimable", "check_out", "claim", "part_path",
           "read_part", "summarise", "write_part"]

FORMAT = "sigmanens-predictions/1"
MANIFEST, PARTS, SUMMARY = "manifest.json", "parts", "summary.json"
PART_KEY = "sigmanens.part"  # the parquet metadata key holding a part's header
_UNIT_ID = re.compile(r"\d{6}-[\w.-]+")  # inputs.discover's ids: a file name, never a path
_FORMATS = ("parquet", "jsonl")


def part_path(out: Path, unit_id: str, fmt: str) -> Path:
    return out / PARTS / f"{unit_id}.{fmt}"


def check_out(out: Path, inputs: Sequence[Path]) -> None:
    """Refuse, before any work, an ``out`` that cannot be a folder predict writes into (a file, a path under one, a
    folder that cannot be written) or that overlaps an input: equal to it, inside an input folder (its parts would
    be read as inputs, or an input deleted by ``--force``) or holding an input (inputs are never read from the
    output folder)."""
    check_writable_folder(out, "--out ")
    target = out.resolve()
    for path in inputs:
        source = path.resolve()
        if target == source:
            relation = "is"
        elif path.is_dir() and target.is_relative_to(source):
            relation = "is inside"
        elif source.is_relative_to(target):
            relation = "holds"
        else:
            continue
        raise UsageError(f"--out {out} {relation} INPUT {path}: predict never writes among its inputs nor reads them "
                         "from its output folder; give an --out outside every input")


def claim(out: Path, manifest: dict[str, Any], force: bool) -> int:
    """Make ``out`` the folder of ``manifest``'s predictions (rank 0 only): refuse one that holds other predictions
    (another program, other inputs, chunking or format) unless ``force``, which deletes the parts its old manifest
    names and the summary; refuse, even with ``force``, a folder of files predict did not write. Remove the
    temporary files a killed writer left. Returns how many parts are already there."""
    old = check_claimable(out)
    ours = set() if old is None else {part_path(out, u["id"], old["output_format"]) for u in old["units"]}
    if old is not None:
        why = _difference(old, manifest)
        if why and not force:
            raise UsageError(f"--out {out} holds predictions of {why}; give another --out, or pass --force to "
                             f"replace them (it deletes only the part files its {MANIFEST} names)")
        if force:
            new = [p for u in manifest["units"] if (p := part_path(out, u["id"], manifest["output_format"])) not in
                   ours and p.exists()]
            if new:
                raise UsageError(f"--out {out} holds {new[0]}, which its {MANIFEST} does not name (predict did not "
                                 "write it); move it away or give another --out")
            for part in ours:
                part.unlink(missing_ok=True)
            (out / SUMMARY).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / MANIFEST, json.dumps(manifest, indent=1))  # first: from now on the folder is predict's
    (out / PARTS).mkdir(exist_ok=True)
    parts = [part_path(out, u["id"], manifest["output_format"]) for u in manifest["units"]]
    names = {p.name for p in parts} | {p.name for p in ours}
    for stale in (out / PARTS).glob(".*.tmp"):  # atomic_write's temporaries of this manifest's parts only
        if stale.name.rpartition(".")[0].rpartition(".")[0][1:] in names:
            stale.unlink(missing_ok=True)
    return sum(1 for p in parts if p.exists())


def check_claimable(out: Path) -> dict[str, Any] | None:
    """Refuse an ``out`` that holds files predict did not write (checked before its lock is taken, which would add
    one); its own manifest, or None for a new or empty folder."""
    old = _own_manifest(out)
    if old is None and out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir()):
        raise UsageError(f"--out {out} is a folder of other files (no {MANIFEST} of sigmanens predict); give a new or "
                         "empty folder (predict, even with --force, never deletes files it did not write)")
    return old


def _own_manifest(out: Path) -> dict[str, Any] | None:
    """``out``'s manifest when sigmanens predict wrote it (its unit ids plain file names), None when there is none;
    a ``manifest.json`` of anything else is refused, since replacing it would lose another tool's file."""
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text())
        own = (old["format"] == FORMAT and old["output_format"] in _FORMATS
               and {"path", "sha256"} <= old["program"].keys()
               and {"inputs", "inputs_sha256", "chunk_size"} <= old.keys()
               and all(_UNIT_ID.fullmatch(u["id"]) for u in old["units"]))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        own = False
    if not own:
        raise UsageError(f"--out {out}: its {MANIFEST} is not sigmanens predict's; give another --out (predict, "
                         "even with --force, never replaces files it did not write)")
    return old


def _difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    if old["program"]["sha256"] != new["program"]["sha256"]:
        return (f"another program ({old['program']['path']}, sha256 {old['program']['sha256'][:12]}…; this one "
                f"is {new['program']['sha256'][:12]}…)")
    if old["inputs"] != new["inputs"] or old["inputs_sha256"] != new["inputs_sha256"]:
        return f"other inputs ({' '.join(old['inputs'])[:200]})" if old["inputs"] != new["inputs"] else \
            "other inputs (the same paths, but their files or contents changed)"
    if old["chunk_size"] != new["chunk_size"]:
        return f"--chunk-size {old['chunk_size']} (this run: {new['chunk_size']})"
    if old["output_format"] != new["output_format"]:
        return f"--format {old['output_format']} (this run: {new['output_format']})"
    return None


def _rows(unit: str, ids: list[str], outputs: dict[str, np.ndarray], class_names: list[str] | None
          ) -> dict[str, Any]:
    """The columns of a part: id, unit, the scalar outputs, probabilities, class name and conformal set (as class
    indices) where the program has them."""
    cols: dict[str, Any] = {"id": ids, "unit": [unit] * len(ids)}
    cols["prediction"] = outputs["prediction"].astype(np.int64)
    for name in ("confidence", "entropy", "mutual_information", "disagreement"):
        cols[name] = outputs[name].astype(np.float32)
    cols["probabilities"] = outputs["probabilities"].astype(np.float32)
    if class_names is not None:
        cols["class_name"] = [class_names[int(p)] for p in cols["prediction"]]
    if "conformal_set" in outputs:
        cols["conformal_set"] = [np.flatnonzero(row).tolist() for row in outputs["conformal_set"]]
    return cols


def write_part(path: Path, unit: str, ids: list[str], outputs: dict[str, np.ndarray], skipped: list[dict[str, str]],
               class_names: list[str] | None) -> None:
    """One unit's predictions and skipped inputs, published atomically at ``path`` (its format by its suffix)."""
    cols = _rows(unit, ids, outputs, class_names)
    header = {"unit": unit, "predicted": len(ids), "skipped": skipped}
    if path.suffix == ".jsonl":
        lines = [json.dumps(header)]
        for i in range(len(ids)):
            lines.append(json.dumps({k: (v[i].tolist() if isinstance(v, np.ndarray) else v[i])
                                     for k, v in cols.items()}))
        write_text(path, "\n".join(lines) + "\n")
        return
    import pyarrow as pa  # optional extra: deploy (pyarrow)
    import pyarrow.parquet as pq

    probs = cols.pop("probabilities")
    k = probs.shape[1]
    arrays = {key: pa.array(value) for key, value in cols.items() if key != "conformal_set"}
    arrays["probabilities"] = pa.FixedSizeListArray.from_arrays(pa.array(probs.reshape(-1)), k).cast(
        pa.list_(pa.float32()))
    if "conformal_set" in cols:
        arrays["conformal_set"] = pa.array(cols["conformal_set"], type=pa.list_(pa.int32()))
    table = pa.table(arrays).replace_schema_metadata({PART_KEY: json.dumps(header)})
    atomic_write(path, lambda f: pq.write_table(table, f))


def read_part(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A part's header and its prediction, confidence, entropy and mutual_information columns."""
    names = ("prediction", "confidence", "entropy", "mutual_information")
    if path.suffix == ".jsonl":
        lines = path.read_text().splitlines()
        rows = [json.loads(line) for line in lines[1:]]
        return json.loads(lines[0]), {n: np.array([r[n] for r in rows]) for n in names}
    import pyarrow.parquet as pq  # optional extra: deploy (pyarrow)

    table = pq.read_table(path, columns=list(names))
    header = json.loads(table.schema.metadata[PART_KEY.encode()])
    return header, {n: table.column(n).to_numpy() for n in names}


def summarise(out: Path, manifest: dict[str, Any], meta: ProgramMeta, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json`` from every part of ``manifest`` (this run's and earlier ones') and this run's per-rank
    statistics ``runs``; written atomically, returned."""
    fmt = manifest["output_format"]
    counts: Counter[int] = Counter()
    totals = dict.fromkeys(("confidence", "entropy", "mutual_information"), 0.0)
    skipped: list[dict[str, str]] = []
    predicted = 0
    for unit in manifest["units"]:
        header, cols = read_part(part_path(out, unit["id"], fmt))
        predicted += header["predicted"]
        skipped += header["skipped"]
        counts.update(cols["prediction"].tolist())
        for name in totals:
            totals[name] += float(cols[name].sum())
    names = meta.class_names
    seconds = max((r["seconds"] for r in runs), default=0.0)
    this_run = sum(r["predicted"] for r in runs)
    summary = {
        "format": FORMAT, "predicted": predicted, "skipped": len(skipped),
        "per_class": {(names[c] if names else str(c)): counts[c] for c in range(meta.num_classes)},
        "mean": {name: total / predicted if predicted else None for name, total in totals.items()},
        "skipped_inputs": skipped,
        "units": {"total": len(manifest["units"]), "this_run": sum(r["units"] for r in runs),
                  "done_before": len(manifest["units"]) - sum(r["units"] for r in runs)},
        "throughput": {"predicted_this_run": this_run, "seconds": round(seconds, 3),
                       "images_per_s": round(this_run / seconds, 2) if seconds > 0 else None,
                       "ranks": len(runs)},
        "program": {**manifest["program"], "metadata": meta.to_dict()},
        "inputs": manifest["inputs"], "output_format": fmt,
    }
    write_text(out / SUMMARY, json.dumps(summary, indent=1))
    return summary
