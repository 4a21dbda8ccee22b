"""Two torchrun agents (two "nodes" on one host) rendezvous over c10d, train and checkpoint together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, SYNTHETIC, TINY_VIT, env, free_port


@pytest.mark.slow
def test_two_node_c10d_rendezvous_trains_and_checkpoints(tmp_path: Path) -> None:
    run, port = tmp_path / "run", free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-node-test", "--max-restarts=0",
         "-m", "sigmanens_dist.train", f"run_dir={run}", "tracking.enabled=false", *TINY_VIT, *SYNTHETIC,
         "train.batch_size=8", "train.max_steps=4", "checkpoint.every_steps=2", "train.log_every_steps=1"],
        cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ckpt = sorted((run / "checkpoints").glob("step_*.pt"))
    assert [p.name for p in ckpt] == ["step_00000002.pt", "step_00000004.pt"]
    state = torch.load(ckpt[-1], weights_only=False)
    assert len(state["rng"]) == 2 and state["batch"] == {"per_rank": 8, "world_size": 2, "grad_accum": 1}
    assert json.loads((run / "final_metrics.json").read_text())["acc"] >= 0
