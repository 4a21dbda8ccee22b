"""Every method under 2-process DDP, in ONE torchrun launch (tests/methods/test_methods_train.py checks what it writes).

    torchrun --nproc_per_node 2 methods_ddp.py OUT

Each method trains 3 steps on 2 ranks and evaluates at the end in the loop (``OUT/<method>/final_metrics.json``);
then ``sigmanens eval`` of its last checkpoint runs on the same 2 ranks (``OUT/<method>/eval2/eval.json``). The
validation split holds 37 samples, which 2 ranks at batch 4 cannot split evenly: every sample must still be scored
exactly once.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sigmanens_dist.cli.eval import main as eval_main
from sigmanens_dist.config import load_config
from sigmanens_dist.trainer import Trainer

TINY_VIT = ["model.name=vit_tiny_patch16_224", "model.kwargs.img_size=16", "model.kwargs.patch_size=4",
            "model.kwargs.depth=2", "model.kwargs.embed_dim=48", "model.kwargs.num_heads=2"]
COMMON = ["data.dataset=synthetic", "data.img_size=16", "data.train_subset=256", "data.val_split=37",
          "data.num_workers=0", "optim.name=sgd", "optim.lr=0.05", "train.max_steps=3", "train.batch_size=4",
          "train.log_every_steps=1", "checkpoint.every_steps=3", "tracking.enabled=false", "model.num_members=2"]
METHODS = {"single": TINY_VIT, "sigma": TINY_VIT, "batch": TINY_VIT, "film": TINY_VIT, "deep": TINY_VIT,
           "packed": ["model.name=resnet10t"]}  # Packed-Ensembles: the ResNet family


def main(out: Path) -> None:
    for method, model in METHODS.items():
        run = out / method
        cfg = load_config(None, [*COMMON, *model, f"model.method={method}", f"run_dir={run}"])
        assert Trainer(cfg).fit() == 0, method
        status = eval_main(["--checkpoint", str(run / "checkpoints" / "step_00000003.pt"), "--split", "val",
                            "--no-mlflow", "--out", str(run / "eval2")])
        assert status == 0, (method, status)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
