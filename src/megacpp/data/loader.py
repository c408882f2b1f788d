"""Streaming packed rows into training: a ``torch`` IterableDataset and a resumable loader.

The contract the model and trainer rely on (also in docs/data.md). Each sample is a dict:

* ``input_ids``     LongTensor[seq_len]   ``row[:-1]``
* ``labels``        LongTensor[seq_len]   ``row[1:]``, but -100 wherever the next token belongs to
  another document (or is padding): the model is never trained to predict across a boundary
* ``doc_ids``       LongTensor[seq_len]   document index within the row: 0, non-decreasing,
  +1 at every document start; padding gets one more id after the last document
* ``structure_ids`` LongTensor[seq_len]   :class:`megacpp.data.structure.Structure` of each input
* ``row``           LongTensor[]          the row's index within its split (for debugging)

Order: an epoch permutes the row groups of the split and the rows inside each group, both from
``(seed, epoch)``. Rank ``r`` of ``world_size`` takes every ``world_size``-th row of that
order; inside a rank, batch ``b`` is produced by DataLoader worker ``b % num_workers`` -- so
ranks (and workers) are disjoint and together cover the split, and the batches come out in
the same order for any number of workers. :class:`PackedLoader` counts the batches it has
handed out; ``state_dict()`` / ``load_state_dict()`` resume exactly there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from megacpp.data.packing import TRAIN
from megacpp.data.shards import RowBlock, ShardedDataset
from megacpp.errors import MegaCppError

IGNORE_INDEX = -100


def sample_from_row(
    tokens: np.ndarray, structure_ids: np.ndarray, doc_starts: np.ndarray, num_tokens: int
) -> dict[str, np.ndarray]:
    """Inputs, labels and document ids of one packed row (numpy, int64).

    ``tokens``/``structure_ids`` have ``seq_len + 1`` entries; ``doc_starts`` are the starts of
    the document segments; positions ``>= num_tokens`` are padding.
    """
    row_len = len(tokens)
    boundary = np.zeros(row_len, dtype=np.int64)
    boundary[doc_starts[1:]] = 1
    if num_tokens < row_len:
        boundary[num_tokens] += 1  # padding is its own segment
    doc = np.cumsum(boundary)  # [row_len] segment id, 0 at position 0
    labels = tokens[1:].astype(np.int64)
    labels[doc[1:] != doc[:-1]] = IGNORE_INDEX
    labels[max(num_tokens - 1, 0) :] = IGNORE_INDEX  # targets that are padding
    return {
        "input_ids": tokens[:-1].astype(np.int64),
        "labels": labels,
        "doc_ids": doc[:-1],
        "structure_ids": structure_ids[:-1].astype(np.int64),
    }


def _default_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class PackedRowsDataset(IterableDataset):
    """Rows of one split of a packed dataset, for one rank, from a position in an epoch."""

    def __init__(
        self,
        dataset: ShardedDataset | str | Path,
        split: str = TRAIN,
        *,
        seed: int = 0,
        shuffle: bool = True,
        batch_size: int = 1,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        self.dataset = (
            dataset if isinstance(dataset, ShardedDataset) else ShardedDataset.open(dataset)
        )
        default_rank, default_world = _default_rank_world()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise MegaCppError(f"rank {self.rank} is outside world_size {self.world_size}")
        if batch_size < 1:
            raise MegaCppError(f"batch_size must be >= 1, got {batch_size}")
        self.split = split
        self.seed = seed
        self.shuffle = shuffle
        self.batch_size = batch_size
        self.groups = self.dataset.row_groups(split)  # [(file, group, rows)]
        self.group_offsets = np.cumsum([0] + [g[2] for g in self.groups])  # [n_groups + 1]
        self.epoch = 0
        self.start_batch = 0

    def set_position(self, epoch: int, start_batch: int = 0) -> None:
        """Where the next iteration starts: batch ``start_batch`` of ``epoch``."""
        self.epoch, self.start_batch = epoch, start_batch

    def rank_rows(self, epoch: int) -> np.ndarray:
        """int64[n] the rows (indices within the split) this rank sees in ``epoch``, in order."""
        return self._epoch_order(epoch)[self.rank :: self.world_size]

    def num_batches(self) -> int:
        """Batches per epoch for this rank (the last one may be partial)."""
        n = len(self.rank_rows(0))
        return -(-n // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        rows = self.rank_rows(self.epoch)
        blocks: dict[int, RowBlock] = {}
        n_batches = -(-len(rows) // self.batch_size)
        for batch in range(self.start_batch + worker, n_batches, workers):
            for row in rows[batch * self.batch_size : (batch + 1) * self.batch_size]:
                yield self._sample(int(row), blocks)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n_groups = len(self.groups)
        if not self.shuffle:
            return np.arange(self.group_offsets[-1], dtype=np.int64)
        rng = np.random.default_rng([self.seed, epoch])
        parts = []
        for g in rng.permutation(n_groups):
            start, end = self.group_offsets[g], self.group_offsets[g + 1]
            parts.append(start + rng.permutation(end - start))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _sample(self, row: int, blocks: dict[int, RowBlock]) -> dict[str, torch.Tensor]:
        g = int(np.searchsorted(self.group_offsets, row, side="right")) - 1
        if g not in blocks:
            blocks.clear()  # rows of a rank arrive group by group: keep one group
            shard_file, group, _ = self.groups[g]
            blocks[g] = self.dataset.read_group(shard_file, group)
        block, i = blocks[g], row - int(self.group_offsets[g])
        arrays = sample_from_row(
            block.tokens[i], block.structure_ids[i], block.doc_starts[i], int(block.num_tokens[i])
        )
        sample = {k: torch.from_numpy(v) for k, v in arrays.items()}
        sample["row"] = torch.tensor(int(block.rows[i]), dtype=torch.int64)
        return sample


class PackedLoader:
    """Batches of :class:`PackedRowsDataset` through a ``DataLoader``, resumable.

    ``for batch in loader`` runs from the current position to the end of the current epoch,
    then moves the position to the start of the next epoch.
    """

    def __init__(
        self,
        dataset: ShardedDataset | str | Path,
        split: str = TRAIN,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self.rows = PackedRowsDataset(
            dataset,
            split,
            seed=seed,
            shuffle=shuffle,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
        )
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.epoch = 0
        self.batch_in_epoch = 0

    def __len__(self) -> int:
        return self.rows.num_batches()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.rows.set_position(self.epoch, self.batch_in_epoch)
        loader = DataLoader(
            self.rows,
            batch_size=self.rows.batch_size,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=False,
        )
        for batch in loader:
            self.batch_in_epoch += 1
            yield batch
        self.epoch += 1
        self.batch_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        """The data position (plus what must match to resume it)."""
        r = self.rows
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "split": r.split,
            "seed": r.seed,
            "shuffle": r.shuffle,
            "batch_size": r.batch_size,
            "rank": r.rank,
            "world_size": r.world_size,
            "manifest_sha256": r.dataset.manifest_sha256,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position; refuses a state from a different data layout."""
        mine = self.state_dict()
        for key in (
            "split",
            "seed",
            "shuffle",
            "batch_size",
            "rank",
            "world_size",
            "manifest_sha256",
        ):
            if state.get(key) != mine[key]:
                raise MegaCppError(
                    f"cannot resume the data position: {key} was {state.get(key)!r}, "
                    f"this loader has {mine[key]!r}"
                )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
