"""What the trainer (``sigmanens_dist.train``) is built from: the objective, checkpoints and resume, preemption,
the weight average (EMA) and MLflow tracking."""
