"""Is Fashion-MNIST's test set another distribution than the training pool the validation split is carved from?
(docs/results.md "Under shift", issue 45 item 5: conformal thresholds fitted on validation cover ~0.01 short on test.)

    python research/pool_shift.py [--config fmnist_small] [--folds 5]

A classifier is trained to tell the validation images (the calibration data of `sigmanens eval --calibration`) from
the test images, on raw pixels, and its cross-validated AUROC is reported with a control: the same classifier telling
the validation images from as many other images of the same training pool. AUROC 0.5 means nothing tells the two
apart; the control shows how far from 0.5 chance alone goes at these sample sizes. Two classifiers (scikit-learn):
logistic regression on the pixels and gradient-boosted trees on the pixels.
"""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from sigmanens_dist.config import load_config
from sigmanens_dist.data.idx import FASHION_MNIST_ROOT, IdxImageDataset
from sigmanens_dist.data.raw import split_indices


def auroc(a: np.ndarray, b: np.ndarray, model, folds: int, seed: int) -> tuple[float, float]:
    """Cross-validated AUROC (mean, std over folds) of ``model`` telling ``a`` (label 0) from ``b`` (label 1)."""
    x = np.concatenate([a, b])
    y = np.concatenate([np.zeros(len(a)), np.ones(len(b))])
    scores = cross_val_score(model, x, y, cv=StratifiedKFold(folds, shuffle=True, random_state=seed),
                             scoring="roc_auc")
    return float(scores.mean()), float(scores.std(ddof=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="fmnist_small", help="a Fashion-MNIST recipe (its pool and validation split)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    data = load_config(args.config, check_data=False).data
    if data.dataset != "fashion_mnist":
        raise SystemExit(f"--config {args.config}: data.dataset={data.dataset!r}; this check reads Fashion-MNIST")
    root = data.root or FASHION_MNIST_ROOT
    pool = IdxImageDataset(root, "train", subset=data.train_subset).images.flatten(1).numpy().astype(np.float32)
    test = IdxImageDataset(root, "test").images.flatten(1).numpy().astype(np.float32)
    train_idx, val_idx, _ = split_indices(len(pool), data.val_split, data.split_seed)
    control_idx = np.random.default_rng(args.seed).choice(train_idx, size=len(val_idx), replace=False)
    val, control = pool[val_idx], pool[control_idx]
    models = {"logistic regression": make_pipeline(StandardScaler(), LogisticRegression(C=0.01, max_iter=2000)),
              "gradient-boosted trees": HistGradientBoostingClassifier(max_iter=200, random_state=args.seed)}
    print(f"validation: {len(val)} images of the training pool ({args.config}); test: {len(test)}; control: "
          f"{len(control)} other images of the pool; {args.folds}-fold AUROC, mean ± std over folds\n")
    print("| classifier on the pixels | validation vs test | validation vs control |\n|---|---:|---:|")
    for name, model in models.items():
        vt, vc = auroc(val, test, model, args.folds, args.seed), auroc(val, control, model, args.folds, args.seed)
        print(f"| {name} | {vt[0]:.3f} ± {vt[1]:.3f} | {vc[0]:.3f} ± {vc[1]:.3f} |")


if __name__ == "__main__":
    main()
