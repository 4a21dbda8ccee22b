"""The σN-Ens core: per-member σ-norm layers over one flat store, the converter that puts them into any model, and
the diversity regularizer."""
