"""``megacpp data stats``: what a built dataset holds and how it got there.

Everything comes from the dataset itself: stage counters and split totals from the manifest,
license mix and document lengths from ``documents.parquet``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megacpp.data.packing import SPLITS
from megacpp.data.shards import ShardedDataset

# dedup stage name (megacpp.data.dedup) -> the drop reason it counts
DEDUP_STAGES = {"exact_dedup": "exact_duplicate", "near_dedup": "near_duplicate"}


@dataclass
class DatasetStats:
    """Summary numbers of a dataset (see :func:`dataset_stats`)."""

    stages: list[dict[str, Any]]  # the manifest's per-stage counters
    splits: dict[str, dict[str, int]]  # documents / rows / tokens per split
    licenses: dict[str, int]  # SPDX expression -> documents
    dedup: dict[str, dict[str, float]]  # reason -> {"dropped", "seen", "rate"}
    doc_tokens: dict[str, np.ndarray]  # split -> tokens per document (without BOS/EOS)
    doc_bytes: np.ndarray  # bytes per document, all splits


def dataset_stats(dataset: ShardedDataset) -> DatasetStats:
    docs = dataset.documents(columns=["split", "license", "num_tokens", "size"])
    split_col = np.asarray(docs["split"].to_pylist(), dtype=object)
    num_tokens = docs["num_tokens"].to_numpy()
    splits = {
        s: {k: int(dataset.manifest["splits"][s][k]) for k in ("documents", "rows", "tokens")}
        for s in SPLITS
    }
    return DatasetStats(
        stages=dataset.manifest["stages"],
        splits=splits,
        licenses=dict(Counter(str(x) for x in docs["license"].to_pylist()).most_common()),
        dedup=_dedup_rates(dataset.manifest["stages"]),
        doc_tokens={s: num_tokens[split_col == s] for s in SPLITS},
        doc_bytes=docs["size"].to_numpy(),
    )


def _dedup_rates(stages: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """For each dedup stage: the share of the documents reaching it that it dropped."""
    rates = {}
    for stage in stages:
        reason = DEDUP_STAGES.get(stage["name"])
        if reason is not None:
            dropped, seen = stage["dropped"].get(reason, 0), stage["seen"]
            rates[reason] = {
                "dropped": dropped,
                "seen": seen,
                "rate": dropped / seen if seen else 0.0,
            }
    return rates


def plot_doc_lengths(stats: DatasetStats, path: str | Path) -> Path:
    """PNG histogram of tokens per document (log-spaced bins), one series per split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    all_tokens = np.maximum(np.concatenate([*stats.doc_tokens.values(), np.ones(1)]), 1)
    lower, upper = float(all_tokens.min()), max(float(all_tokens.max()), 2.0)
    bins = np.logspace(np.log10(lower) - 0.05, np.log10(upper) + 0.05, 40)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for split, tokens in stats.doc_tokens.items():
        if len(tokens):
            ax.hist(
                np.maximum(tokens, 1),
                bins=bins,
                alpha=0.6,
                label=f"{split} ({len(tokens)} docs, median {int(np.median(tokens))})",
            )
    ax.set_xscale("log")
    ax.set_xlabel("tokens per document (log scale)")
    ax.set_ylabel("documents")
    ax.set_title("Document lengths")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
