"""Evaluation: ``sigmanens eval`` and the end-of-training hook (see docs/eval.md)."""

from sigmanens_dist.evaluation.load import EvalCheckpoint, load_for_eval
from sigmanens_dist.evaluation.run import run_eval, sub_ensemble

__all__ = ["EvalCheckpoint", "load_for_eval", "run_eval", "sub_ensemble"]
