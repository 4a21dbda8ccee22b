"""What a program computes, below both the evaluator and the exporter (torch only: no torchmetrics, no report, no
MLflow): the ensemble's per-input scores, temperature scaling, conformal scores and their fit, prediction-time
BatchNorm statistics, and the post-hoc fit as one typed record. ``sigmanens eval`` scores with these pieces and
``sigmanens export --program`` compiles them, so a program predicts what eval scores (torch-uncertainty keeps the
same pieces in ``post_processing/``, below its routines)."""
