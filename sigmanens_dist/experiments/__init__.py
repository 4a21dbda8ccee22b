"""Runs of many runs: ``sigmanens study`` (grids of child runs), ``sigmanens compare`` (tables and plots from
MLflow) and the embedded demo."""
