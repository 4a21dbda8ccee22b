"""What the trainer (``sigmanens_dist.trainer``) is built from: the objective, checkpoints and resume, preemption,
the weight average (EMA) and MLflow tracking."""
