"""The output half of ``sigmanens eval``: the report as files (``eval.json``, ``eval.md``, the PNG plots), as flat
MLflow metrics (``eval/<split>/<weights>/…``), and logged to the training run's MLflow run."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from sigmanens_dist.atomic import write_text
from sigmanens_dist.config import Config
from sigmanens_dist.evaluation import plots
from sigmanens_dist.evaluation.ood import OOD_SCORES
from sigmanens_dist.evaluation.plots import reliability_diagrams_from_confidence
from sigmanens_dist.methods.base import EnsembleMethod
from sigmanens_dist.training.tracking import default_tracking_uri

__all__ = ["DIAGNOSIS_COLUMNS", "FIT_SPLITS", "SHIFT_KEYS", "SUB_KEYS", "diagnosis_rows", "diversity_text",
           "flat_metrics", "markdown", "shift_mean", "temperature_label"]

log = logging.getLogger("sigmanens")

SHIFT_KEYS = ("acc", "nll", "ece")
# the split a post-hoc fit read (eval.json's fitted_on / calibrated_on) → its name in the report's words
FIT_SPLITS = {"val": "validation", "calib": "calibration"}


def shift_mean(table: dict[str, dict[str, dict[str, float | None]]], severities: list[int]
               ) -> dict[str, dict[str, float | None]]:
    """``{severity: {key: mean over corruptions}}`` of a ``{corruption: {severity: {key: value}}}`` table: the "mean"
    row of every shift table in a report (the plain scores, the calibrated ones, each conformal method's). A key that
    is undefined (None: the member-based diagnosis of one member) stays None."""
    names = list(table)
    keys = list(table[names[0]][str(severities[0])])

    def mean(values: list[float | None]) -> float | None:
        return None if any(v is None for v in values) else sum(values) / len(values)  # type: ignore[arg-type]

    return {str(s): {k: mean([table[c][str(s)][k] for c in names]) for k in keys} for s in severities}
SUB_KEYS = ("acc", "nll", "ece", "aece", "brier", "aurc")


def _plots(out_dir: Path, variant: str, model: EnsembleMethod, scores: dict[str, torch.Tensor], part: dict[str, Any]
           ) -> list[Path]:
    files = [reliability_diagrams_from_confidence({f"ensemble ({variant} weights)": (scores["confidence"].cpu(),
                                                                                     scores["correct"].cpu())},
                                                  out_dir / f"reliability_{variant}.png")]
    if "shift" in part:
        files.append(plots.severity_curves(part["shift"], out_dir / f"shift_{variant}.png", variant))
    if "ood" in part:
        files.append(plots.ood_histograms(part["ood"].pop("_scores"), out_dir / f"ood_{variant}.png",
                                          part["ood"]["set"]))
    importances = model.layer_importances()
    if importances is not None:
        files.append(plots.sharing_heatmap(*importances, out_dir / f"sharing_{variant}.png"))
    return files


def _write(out_dir: Path, report: dict[str, Any]) -> list[Path]:
    json_path, md_path = out_dir / "eval.json", out_dir / "eval.md"
    for part in report["weights"].values():
        part.get("ood", {}).pop("_scores", None)
    write_text(json_path, json.dumps(report, indent=2))
    write_text(md_path, markdown(report))
    return [json_path, md_path]


def _fmt(value: float | None) -> str:
    if value is None:  # undefined (a member-based diagnosis of one member)
        return "—"
    return "nan" if isinstance(value, float) and math.isnan(value) else f"{value:.4f}"


DIAGNOSIS_COLUMNS = {"acc": "acc", "nll": "NLL", "member_mean/nll": "NLL members", "ece": "ECE",
                     "member_mean/ece": "ECE members", "disagreement": "disagreement", "mutual_information": "MI",
                     "mi_auroc": "MI AUROC"}


def diversity_text(metrics: dict[str, float], members: int) -> str:
    """Disagreement and mutual information of the clean pass, or that they are undefined for one member (the 0 in
    ``metrics`` is kept for older readers of eval.json, not a measurement)."""
    if members == 1:
        return "disagreement and mutual information undefined (one member)"
    return (f"disagreement {_fmt(metrics['disagreement'])}, mutual information "
            f"{_fmt(metrics['mutual_information'])}")


def diagnosis_rows(part: dict[str, Any], members: int, every: bool = True) -> list[tuple[str, list[str]]]:
    """The diagnosis table of one weights' part: clean (the test metrics; member-based columns undefined with one
    member, the MI AUROC undefined for clean against clean), the mean over corruptions per severity and, with
    ``every``, each corruption at each severity. Cells formatted, "—" where undefined."""
    # the negatives of the MI AUROC: the clean pass, or the mixed stream's clean images
    label, clean = ("clean (stream)", dict(part["shift_stream"]["clean"])) if "shift_stream" in part else (
        "clean", dict(part["metrics"]))
    if members == 1:
        clean["disagreement"] = clean["mutual_information"] = None
    rows = [(label, [_fmt(clean.get(k)) for k in DIAGNOSIS_COLUMNS])]
    tables = [("mean", part["shift"]["mean"])]
    tables += [(name, by_sev) for name, by_sev in part["shift"].items() if name != "mean"] if every else []
    for name, by_sev in tables:
        rows += [(f"{name} s{severity}", [_fmt(v.get(k)) for k in DIAGNOSIS_COLUMNS]) for severity, v in by_sev.items()]
    return rows


def _diagnosis_md(part: dict[str, Any], members: int, shift_split: str) -> list[str]:
    if "shift" not in part:
        return []
    which = "validation corruptions on the validation split" if shift_split == "val" else "test corruptions"
    lines = ["", f"### Diagnosis under shift ({which})", "",
             "Ensemble and mean member NLL / ECE, member disagreement (fraction of member pairs that predict "
             "differently), mutual information (entropy of the mean − mean member entropy), and the AUROC of telling "
             "corrupted from clean inputs by mutual information (clean negative)"
             + (". One member: the member-based columns are undefined (—)." if members == 1 else "."), "",
             "| | " + " | ".join(DIAGNOSIS_COLUMNS.values()) + " |", "|---|" + "---:|" * len(DIAGNOSIS_COLUMNS)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in diagnosis_rows(part, members)]
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown tables (what ``eval.md`` holds)."""
    lines = [f"# Evaluation: {report['checkpoint'] or 'end of training'} (step {report['step']})", "",
             f"method {report['method']}, {report['dataset']} {report['split']} split, "
             f"{report['members']} of {report['num_members']} members"
             + (f", shift split {report['shift_split']}" if report.get("shift_split") else ""), ""]
    lines += [f"> {note}" for note in report["notes"]] + ([""] if report["notes"] else [])
    keys = ("acc", "nll", "ece", "aece", "brier", "aurc")
    for variant, part in report["weights"].items():
        m = part["metrics"]
        lines += [f"## {variant} weights ({int(m['num_samples'])} samples)", "",
                  "| | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        rows = [("ensemble", "")] + [(f"member {i}", f"member{i}/") for i in range(report["members"])]
        rows += [("mean of members", "member_mean/")] if report["members"] > 1 else []
        for label, prefix in rows:
            lines.append(f"| {label} | " + " | ".join(_fmt(m[prefix + k]) for k in keys) + " |")
        lines += ["", f"{diversity_text(m, report['members'])}, predictive entropy {_fmt(m['entropy'])}"
                  + (f", members on per feature {_fmt(part['sharing']['all'])}" if "sharing" in part else ""), ""]
        lines += ["### Sub-ensembles", "", "| k | " + " | ".join(SUB_KEYS) + " | ms/image |",
                  "|---:|" + "---:|" * (len(SUB_KEYS) + 1)]
        for row in part["sub_ensembles"]:
            lines.append(f"| {row['k']} | " + " | ".join(_fmt(row[k]) for k in SUB_KEYS)
                         + f" | {row['ms_per_image']:.3f} |")
        if "shift" in part:
            lines += ["", "### Shift (acc / NLL / ECE)", "", "| corruption | " + " | ".join(
                f"s{s}" for s in part["shift"]["mean"]) + " |", "|---|" + "---|" * len(part["shift"]["mean"])]
            for name, by_sev in part["shift"].items():
                lines.append(f"| {name} | " + " | ".join(
                    " / ".join(_fmt(v[k]) for k in SHIFT_KEYS) for v in by_sev.values()) + " |")
            lines += _stream_md(report, part)
            lines += _diagnosis_md(part, report["members"], report.get("shift_split", "test"))
        lines += _calibration_md(part.get("calibration"), part, report["split"])
        lines += _calibration_md(part.get("member_calibration"), part, report["split"])
        for conf in part.get("conformal", []):
            lines += _conformal_md(conf)
        if "ood" in part:
            ood = part["ood"]
            lines += ["", f"### OOD: {ood['set']} ({ood['num_out']} OOD vs {ood['num_in']} in-distribution, OOD "
                          "positive)", "", "| score | AUROC | AUPR-in | AUPR-out | FPR@95TPR |",
                      "|---|---:|---:|---:|---:|"]
            for score in OOD_SCORES:
                r = ood[score]
                lines.append(f"| {score} | {_fmt(r['auroc'])} | {_fmt(r['aupr_in'])} | {_fmt(r['aupr_out'])} | "
                             f"{_fmt(r['fpr95'])} |")
        lines.append("")
    return "\n".join(lines)


def _stream_md(report: dict[str, Any], part: dict[str, Any]) -> list[str]:
    """The mixed stream's clean images and all its images, plain and calibrated (acc / NLL / ECE)."""
    if "shift_stream" not in part:
        return []
    protocol = report["shift_batches"]
    lines = ["", f"Mixed stream ({protocol['images']} images, every corruption × severity and the clean ones shuffled "
                 f"together, batches of {protocol['batch_size']}): the rows above are its predictions regrouped.", "",
             "| stream | acc / NLL / ECE |" + (" calibrated |" if "calibration" in part else ""),
             "|---|---|" + ("---|" if "calibration" in part else "")]
    for which, v in part["shift_stream"].items():
        calibrated = part.get("calibration", {}).get("stream", {}).get(which)
        lines.append(f"| {which} | " + " / ".join(_fmt(v[k]) for k in SHIFT_KEYS) + " |"
                     + (" " + " / ".join(_fmt(calibrated[k]) for k in SHIFT_KEYS) + " |" if calibrated else ""))
    return lines


def temperature_label(cal: dict[str, Any]) -> str:
    """``Temperature scaling: T = …`` for the ensemble's one T, ``Member temperatures: T_m = …, …`` for one per
    member (``--calibration member-temperature``)."""
    if "temperatures" in cal:
        return "Member temperatures: T_m = " + ", ".join(f"{t:.4f}" for t in cal["temperatures"])
    return f"Temperature scaling: T = {cal['temperature']:.4f}"


def _calibration_md(cal: dict[str, Any] | None, part: dict[str, Any], scored: str) -> list[str]:
    """Before and after temperature scaling (one T, or one per member): the ensemble and the mean member on the
    ``scored`` split, clean and mean under shift."""
    if cal is None:
        return []
    lines = ["", f"### {temperature_label(cal)}, fitted on {cal['num_fit']} {FIT_SPLITS[cal['fitted_on']]} "
                 f"samples (NLL {_fmt(cal['val_nll_before'])} → {_fmt(cal['val_nll_after'])} there)", "",
             f"| {scored} | " + " | ".join(SUB_KEYS) + " |", "|---|" + "---:|" * len(SUB_KEYS)]
    for label, prefix in (("ensemble", ""), ("mean of members", "member_mean/")):
        for when, values in (("before", part["metrics"]), ("after", cal["metrics"])):
            lines.append(f"| {label}, {when} | " + " | ".join(_fmt(values[prefix + k]) for k in SUB_KEYS) + " |")
    if "mean" in cal["shift"]:
        lines += ["", "Under shift, mean over corruptions (acc / NLL / ECE):", "", "| severity | before | after |",
                  "|---|---|---|"]
        for severity, after in cal["shift"]["mean"].items():
            before = part["shift"]["mean"][severity]
            lines.append(f"| s{severity} | " + " | ".join(" / ".join(_fmt(v[k]) for k in SHIFT_KEYS)
                                                        for v in (before, after)) + " |")
    return lines


def _conformal_md(conf: dict[str, Any], worst: int = 10) -> list[str]:
    """Coverage and mean set size per method at one α: clean, mean under shift, and the classes of lowest coverage."""
    methods = conf["methods"]
    shift = "mean" in next(iter(methods.values()))["shift"]
    lines = ["", f"### Conformal sets: α = {conf['alpha']}, calibrated on {conf['num_calibration']} "
                 f"{FIT_SPLITS[conf['calibrated_on']]} "
                 f"samples (target coverage {1 - conf['alpha']:.4f})", "",
             "| method | q̂ | coverage | mean set size |" + (" under shift: coverage / size |" if shift else ""),
             "|---|---:|---:|---:|" + ("---|" if shift else "")]
    for method, r in methods.items():
        row = f"| {method} | {_fmt(r['qhat'])} | {_fmt(r['coverage'])} | {_fmt(r['set_size'])} |"
        if shift:
            row += " " + ", ".join(f"s{s} {_fmt(v['coverage'])} / {_fmt(v['set_size'])}"
                                   for s, v in r["shift"]["mean"].items()) + " |"
        lines.append(row)
    lines += ["", f"Per class, the {worst} of lowest coverage (all in eval.json):", "",
              "| method | class (n): coverage / set size |", "|---|---|"]
    for method, r in methods.items():
        ranked = sorted((c for c in r["per_class"] if c["n"]), key=lambda c: c["coverage"])[:worst]
        lines.append(f"| {method} | " + ", ".join(f"{c['class']} ({c['n']}): {_fmt(c['coverage'])} / "
                                                  f"{_fmt(c['set_size'])}" for c in ranked) + " |")
    return lines


def flat_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The report's numbers under MLflow-safe keys, ``eval/<split>/<variant>/…``."""
    out: dict[str, float] = {}
    for variant, part in report["weights"].items():
        base = f"eval/{report['split']}/{variant}"
        out |= {f"{base}/{k}": v for k, v in part["metrics"].items()}
        for row in part["sub_ensembles"]:
            out |= {f"{base}/k{row['k']}/{k}": row[k] for k in (*SUB_KEYS, "ms_per_image")}
        for name, by_sev in part.get("shift", {}).items():
            for severity, values in by_sev.items():
                out |= {f"{base}/shift/{name}/s{severity}/{k}": v for k, v in values.items() if v is not None}
        for which, values in part.get("shift_stream", {}).items():
            out |= {f"{base}/shift_stream/{which}/{k}": v for k, v in values.items() if v is not None}
        if "ood" in part:
            for score in OOD_SCORES:
                out |= {f"{base}/ood_{part['ood']['set']}/{score}/{k}": v for k, v in part["ood"][score].items()}
        if "sharing" in part:
            out[f"{base}/sharing/members_on"] = part["sharing"]["all"]
        if "calibration" in part:
            cal = part["calibration"]
            out[f"{base}/calibrated/temperature"] = cal["temperature"]
            out |= {f"{base}/calibrated/{k}": v for k, v in cal["metrics"].items()}
            for severity, values in cal["shift"].get("mean", {}).items():
                out |= {f"{base}/calibrated/shift/mean/s{severity}/{k}": v for k, v in values.items()}
            for which, values in cal.get("stream", {}).items():
                out |= {f"{base}/calibrated/shift_stream/{which}/{k}": v for k, v in values.items()}
        if "member_calibration" in part:
            cal = part["member_calibration"]
            out |= {f"{base}/member_calibrated/temperature/{m}": t for m, t in enumerate(cal["temperatures"])}
            out |= {f"{base}/member_calibrated/{k}": v for k, v in cal["metrics"].items()}
            for severity, values in cal["shift"].get("mean", {}).items():
                out |= {f"{base}/member_calibrated/shift/mean/s{severity}/{k}": v for k, v in values.items()}
        for conf in part.get("conformal", []):
            for method, r in conf["methods"].items():
                key = f"{base}/conformal/a{conf['alpha']:g}/{method}"
                out |= {f"{key}/{k}": r[k] for k in ("qhat", "coverage", "set_size")}
                for severity, values in r["shift"].get("mean", {}).items():
                    out |= {f"{key}/shift/mean/s{severity}/{k}": v for k, v in values.items()}
                for which, values in r.get("stream", {}).items():
                    out |= {f"{key}/shift_stream/{which}/{k}": v for k, v in values.items()}
    return {k: float(v) for k, v in out.items()}


def _log_mlflow(cfg: Config, run_id: str, report: dict[str, Any], files: list[Path], step: int,
                checkpoint: Path | None) -> None:
    """Metrics and files into the training run's MLflow run; a failure is a warning (the files are on disk)."""
    run_dir = checkpoint.parent.parent if checkpoint is not None else Path(cfg.run_dir)
    uri = default_tracking_uri(run_dir, cfg.tracking.uri)
    try:
        from mlflow.entities import Metric  # optional extra: mlflow
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in flat_metrics(report).items()]
        for i in range(0, len(metrics), 500):
            client.log_batch(run_id, metrics=metrics[i: i + 500])
        folder = "eval" if checkpoint is None else f"eval/{checkpoint.stem}"
        for path in files:
            client.log_artifact(run_id, str(path), artifact_path=folder)
    except Exception as err:  # the evaluation is done and written; tracking must not undo that
        log.warning("could not log the evaluation to MLflow run %s at %s (%s: %s); the files are in %s", run_id, uri,
                    type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "", files[0].parent)
