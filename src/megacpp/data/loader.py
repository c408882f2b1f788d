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
``(seed, epoch)``. The position in an epoch is a *global sample index*: the number of rows of
that order all ranks together have consumed. From position ``p``, rank ``r`` of
``world_size`` takes every ``world_size``-th row (positions ``p + r``, ``p + r + world_size``,
...); inside a rank, batch ``b`` is produced by DataLoader worker ``b % num_workers`` -- so
ranks (and workers) are disjoint and together cover the split, and the batches come out in
the same order for any number of workers. A batch of ``batch_size`` rows on each of
``world_size`` ranks consumes ``batch_size x world_size`` positions, whatever the split
between the two, so :class:`PackedLoader`'s ``state_dict()`` (epoch and global position)
resumes on another number of ranks or another micro-batch size at the same row of the order.
With ``step_samples`` (the rows of one optimizer step over all ranks) an epoch ends at the
last whole step: every rank gets only full batches and all ranks the same number.
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
        step_samples: int = 0,
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
        if step_samples % (batch_size * self.world_size):
            raise MegaCppError(f"step_samples = {step_samples} is not a multiple of batch_size "
                               f"{batch_size} x world_size {self.world_size}")
        self.step_samples = step_samples  # 0: keep the epoch's last partial batches
        self.split = split
        self.seed = seed
        self.shuffle = shuffle
        self.batch_size = batch_size
        self.groups = self.dataset.row_groups(split)  # [(file, group, rows)]
        self.group_offsets = np.cumsum([0] + [g[2] for g in self.groups])  # [n_groups + 1]
        self.epoch = 0
        self.start_sample = 0

    def set_position(self, epoch: int, start_sample: int = 0) -> None:
        """Where the next iteration starts: global position ``start_sample`` of ``epoch``."""
        self.epoch, self.start_sample = epoch, start_sample

    def epoch_length(self) -> int:
        """Positions of an epoch: the split's rows, cut to whole steps with ``step_samples``."""
        n = int(self.group_offsets[-1])
        return n - n % self.step_samples if self.step_samples else n

    def rank_rows(self, epoch: int, start_sample: int = 0) -> np.ndarray:
        """int64[n] the rows (indices within the split) this rank sees in ``epoch`` from global
        position ``start_sample``, in order."""
        order = self._epoch_order(epoch)[: self.epoch_length()]
        return order[start_sample + self.rank :: self.world_size]

    def num_batches(self) -> int:
        """Batches per epoch for this rank (the last one may be partial without
        ``step_samples``)."""
        n = len(self.rank_rows(0))
        return -(-n // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        rows = self.rank_rows(self.epoch, self.start_sample)
        blocks: dict[int, RowBlock] = {}
        n_batches = -(-len(rows) // self.batch_size)
        for batch in range(worker, n_batches, workers):
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
        step_samples: int = 0,
    ) -> None:
        self.rows = PackedRowsDataset(
            dataset,
            split,
            seed=seed,
            shuffle=shuffle,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            step_samples=step_samples,
        )
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.epoch = 0
        self.sample_in_epoch = 0  # global position: rows consumed by all ranks this epoch

    def __len__(self) -> int:
        return self.rows.num_batches()

    @property
    def samples_per_batch(self) -> int:
        """Global positions one batch consumes: ``batch_size`` rows on each rank."""
        return self.rows.batch_size * self.rows.world_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.rows.set_position(self.epoch, self.sample_in_epoch)
        loader = DataLoader(
            self.rows,
            batch_size=self.rows.batch_size,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=False,
        )
        for batch in loader:
            self.sample_in_epoch += self.samples_per_batch
            yield batch
        self.epoch += 1
        self.sample_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        """The data position -- the epoch and the global sample index in it, the same on
        every rank -- plus what must match to resume it (and, for the record, the layout that
        wrote it: batch size and world size, which may differ on resume)."""
        r = self.rows
        return {
            "epoch": self.epoch,
            "sample_in_epoch": self.sample_in_epoch,
            "split": r.split,
            "seed": r.seed,
            "shuffle": r.shuffle,
            "batch_size": r.batch_size,
            "rank": r.rank,
            "world_size": r.world_size,
            "manifest_sha256": r.dataset.manifest_sha256,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s global position (written with any batch size and number of
        ranks); refuses a state of another data order (split, seed, shuffle, dataset)."""
        mine = self.state_dict()
        for key in ("split", "seed", "shuffle", "manifest_sha256"):
            if state.get(key) != mine[key]:
                raise MegaCppError(
                    f"cannot resume the data position: {key} was {state.get(key)!r}, "
                    f"this loader has {mine[key]!r}"
                )
        if "sample_in_epoch" in state:
            sample = int(state["sample_in_epoch"])
        else:  # a per-rank batch count (an older checkpoint): batches x rows x ranks
            sample = int(state["batch_in_epoch"]) * int(state["batch_size"]) * int(
                state["world_size"])
        self.epoch, self.sample_in_epoch = int(state["epoch"]), sample
