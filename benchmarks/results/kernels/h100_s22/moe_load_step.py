"""The training step (benchmarks/train_step.py, same arguments after the first) with the MoE's
per-expert load computed as moe_load_probe.py's VARIANT (onehot: the tree; chunked;
index_add) -- session 22.

    PYTHONPATH=$PWD/src python benchmarks/results/kernels/h100_s22/moe_load_step.py VARIANT \
        --preset nam56r-350m ... --out OUT.json
"""

import runpy
import sys
from pathlib import Path

import torch

from megacpp.model import moe

VARIANT = sys.argv.pop(1)


def chunked(self, expert_idx):
    experts = torch.arange(self.n_experts, device=expert_idx.device)
    hits = expert_idx.reshape(64, -1, 1) == experts
    return hits.sum(1, dtype=torch.float32).sum(0)


def index_add(self, expert_idx):
    ones = torch.ones(expert_idx.numel(), device=expert_idx.device)
    zeros = torch.zeros(self.n_experts, device=expert_idx.device)
    return zeros.index_add_(0, expert_idx.reshape(-1), ones)


if VARIANT != "onehot":
    moe.MoE._load = {"chunked": chunked, "index_add": index_add}[VARIANT]
sys.argv[0] = str(Path(__file__).resolve().parents[3] / "train_step.py")
runpy.run_path(sys.argv[0], run_name="__main__")
