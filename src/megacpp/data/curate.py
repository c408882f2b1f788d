"""The curation half of the corpus pipeline, in its canonical order.

``sources -> binary -> decode -> size -> generated -> license -> exact dedup -> near dedup``

Cheap, certain filters run first so the expensive ones (license prose, lexing for MinHash)
only see documents that can survive; exact dedup runs before near dedup because it is far
cheaper and catches the most common duplicates (vendored copies) outright.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from megacpp.data.config import CorpusConfig
from megacpp.data.dedup import ExactDedup, NearDedup
from megacpp.data.document import Document
from megacpp.data.filters import BinaryFilter, DecodeStep, GeneratedFilter, SizeFilter
from megacpp.data.license import LicenseStep
from megacpp.data.pipeline import StageStats, Step, run_steps
from megacpp.data.sources import iter_sources


def curation_steps(cfg: CorpusConfig) -> list[Step]:
    """The curation steps for ``cfg``, in canonical order (dedup steps only if enabled)."""
    steps: list[Step] = [
        BinaryFilter(),
        DecodeStep(cfg.non_utf8),
        SizeFilter(cfg.min_bytes, cfg.max_bytes),
        GeneratedFilter(
            cfg.max_line_length,
            cfg.max_mean_line_length,
            cfg.min_alnum_ratio,
            cfg.generated_markers,
        ),
        LicenseStep(cfg.license_allow, cfg.license_deny, cfg.keep_unknown_license),
    ]
    if cfg.exact_dedup:
        steps.append(ExactDedup())
    if cfg.near_dedup:
        steps.append(
            NearDedup(
                num_perm=cfg.minhash_num_perm,
                bands=cfg.lsh_bands,
                rows=cfg.lsh_rows,
                threshold=cfg.near_dup_threshold,
                shingle_size=cfg.shingle_size,
                seed=cfg.minhash_seed,
            )
        )
    return steps


def curate_stream(
    roots: Sequence[str | os.PathLike[str]], cfg: CorpusConfig,
    steps: Sequence[Step] | None = None,
) -> tuple[Iterator[Document], list[StageStats]]:
    """Lazily curated documents and the per-stage stats (``sources`` first), which fill in
    as the stream is consumed. Bad roots raise :class:`MegaCppError` immediately. ``steps``:
    the caller's ``curation_steps(cfg)`` list, to read the dedup steps' records afterwards."""
    source_stats = StageStats("sources")
    docs = iter_sources(roots, cfg, source_stats)
    stream, step_stats = run_steps(docs, curation_steps(cfg) if steps is None else steps)
    return stream, [source_stats, *step_stats]


def curate(
    roots: Sequence[str | os.PathLike[str]], cfg: CorpusConfig
) -> tuple[list[Document], list[StageStats]]:
    """All curated documents (text decoded, license set) and the per-stage stats."""
    stream, stats = curate_stream(roots, cfg)
    return list(stream), stats
