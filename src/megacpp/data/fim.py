"""Fill-in-the-middle (FIM): training documents rearranged so a left-to-right model learns to
write a middle span from the text before and after it (Bavarian et al. 2022, "Efficient
Training of Language Models to Fill in the Middle").

A document chosen for FIM is cut at two character offsets drawn uniformly (the cuts may
fall inside a token, as a cursor does), into ``prefix``, ``middle`` and ``suffix``; each
piece is tokenized on its own and the pieces are joined with the tokenizer's reserved FIM
tokens, in one of two orders:

* PSM: ``<|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> middle``
* SPM: ``<|fim_prefix|> <|fim_suffix|> suffix <|fim_middle|> prefix middle`` (the variant
  in which the prefix runs straight into the middle)

The build then wraps it in ``BOS .. EOS`` like any document, so the model learns to end a
middle with EOS. The choice (FIM or not, PSM or SPM, the two cuts) comes from a generator
seeded by ``[fim] seed`` and the document's content hash: a build is reproducible and does
not depend on the number of workers or on the document order. Only the train split is
transformed; the validation split stays left to right, so validation loss measures
ordinary completion.

At inference a FIM prompt is the PSM form up to ``<|fim_middle|>`` (:func:`psm_prompt`);
generation stops at EOS and what it wrote is the middle.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from megacpp.errors import ConfigError, MegaCppError

PSM, SPM = "psm", "spm"


@dataclass
class FimConfig:
    """``[fim]``: the share of train documents rearranged for fill-in-the-middle."""

    rate: float = 0.0  # share of train documents transformed (0: none, the default)
    spm_rate: float = 0.5  # share of the transformed ones in SPM order (the rest PSM)
    seed: int = 0  # with each document's sha256, seeds its choice and cuts

    def validate(self) -> None:
        for name in ("rate", "spm_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"fim.{name} = {value!r}: expected a number in [0, 1]")
        if not 0 <= self.seed < 1 << 63:
            raise ConfigError(f"fim.seed = {self.seed!r}: expected an integer in 0..2^63-1")


@dataclass(frozen=True, slots=True)
class FimPlan:
    """How one document is rearranged: ``text[:start]`` is the prefix, ``text[start:end]``
    the middle and ``text[end:]`` the suffix (character offsets)."""

    order: str  # PSM | SPM
    start: int
    end: int

    def pieces(self, text: str) -> tuple[str, str, str]:
        """(prefix, middle, suffix) of ``text``."""
        return text[: self.start], text[self.start : self.end], text[self.end :]


def plan_fim(text: str, sha256: str, cfg: FimConfig) -> FimPlan | None:
    """The plan of the document with ``text`` and content hash ``sha256``, or None when it
    stays left to right (it is not drawn at ``cfg.rate``, or it is empty)."""
    if cfg.rate <= 0 or not text:
        return None
    rng = np.random.default_rng(_seed_words(cfg.seed, sha256))
    if rng.random() >= cfg.rate:
        return None
    order = SPM if rng.random() < cfg.spm_rate else PSM
    start, end = sorted(int(c) for c in rng.integers(0, len(text) + 1, size=2))
    return FimPlan(order, start, end)


def _seed_words(seed: int, sha256: str) -> list[int]:
    """Seed material from the config seed and the document hash (any hex string works)."""
    return seed_words(f"fim:{seed}:{sha256}".encode())


def seed_words(material: bytes) -> list[int]:
    """Four 32-bit words of ``sha256(material)``: a ``numpy.random.default_rng`` seed that
    depends only on ``material``."""
    digest = hashlib.sha256(material).digest()
    return [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]


@dataclass(frozen=True, slots=True)
class FimIds:
    """The reserved FIM token ids of a tokenizer."""

    prefix: int
    middle: int
    suffix: int

    @classmethod
    def of(cls, tokenizer: Any) -> FimIds:
        """The ids of ``tokenizer`` (a :class:`~megacpp.data.tokenizer.CppTokenizer`), or a
        :class:`MegaCppError` when it has no FIM tokens."""
        ids = [getattr(tokenizer, f"fim_{name}_id", None) for name in ("prefix", "middle",
                                                                       "suffix")]
        if any(not isinstance(i, int) for i in ids):
            raise MegaCppError("this model's tokenizer has no fill-in-the-middle tokens "
                               "(<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>)")
        return cls(*ids)


def arrange(
    plan: FimPlan,
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray],
    piece_structure: tuple[np.ndarray, np.ndarray, np.ndarray],
    fim: FimIds,
) -> tuple[np.ndarray, np.ndarray]:
    """The document's token ids and structure ids in ``plan.order``, from the ids of its
    prefix, middle and suffix (``pieces``) and their structure ids; FIM tokens get
    structure id 0 (OTHER)."""
    prefix, middle, suffix = pieces
    s_prefix, s_middle, s_suffix = piece_structure

    def special(token: int) -> tuple[np.ndarray, np.ndarray]:
        return np.array([token], np.int32), np.zeros(1, np.uint8)

    if plan.order == PSM:
        parts = [special(fim.prefix), (prefix, s_prefix), special(fim.suffix),
                 (suffix, s_suffix), special(fim.middle), (middle, s_middle)]
    else:
        parts = [special(fim.prefix), special(fim.suffix), (suffix, s_suffix),
                 special(fim.middle), (prefix, s_prefix), (middle, s_middle)]
    ids = np.concatenate([np.asarray(p[0], np.int32) for p in parts])
    structure = np.concatenate([np.asarray(p[1], np.uint8) for p in parts])
    return ids, structure


def piece_structure(
    doc_ids: np.ndarray,
    doc_structure: np.ndarray,
    token_nbytes: np.ndarray,
    plan: FimPlan,
    text: str,
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Structure ids of each piece's tokens: the id of the whole-document token that holds
    the piece token's last byte (the build labels a token by its last byte, so a piece token
    that ends where a document token ends gets exactly that token's label)."""
    byte_labels = np.repeat(doc_structure, token_nbytes[doc_ids])  # [document bytes]
    out, offset = [], 0
    for piece_text, ids in zip(plan.pieces(text), pieces):
        ends = offset + np.cumsum(token_nbytes[ids])  # [piece tokens] byte end in the document
        if len(byte_labels) == 0:
            out.append(np.zeros(len(ids), np.uint8))
        else:
            out.append(byte_labels[np.clip(ends - 1, 0, len(byte_labels) - 1)].astype(np.uint8))
        offset += len(piece_text.encode("utf-8"))
    return out[0], out[1], out[2]


def psm_prompt(prefix_ids: list[int], suffix_ids: list[int], fim: FimIds) -> list[int]:
    """The FIM prompt after BOS: ``<|fim_prefix|> prefix <|fim_suffix|> suffix
    <|fim_middle|>``; the model continues with the middle and EOS."""
    return [fim.prefix, *prefix_ids, fim.suffix, *suffix_ids, fim.middle]
