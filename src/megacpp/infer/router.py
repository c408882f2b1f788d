"""Route a request to one of several specialist models: by name, or ``auto`` by a classifier.

A *specialist* is one loaded checkpoint with its own engine. A request names it in its
``model`` field; ``"auto"`` asks the router to choose from the prompt.

The ``auto`` classifier (:class:`SnippetClassifier`) is a multinomial naive Bayes over C++
lexical features, trained on *which corpus source a snippet came from*: each specialist was
trained on (or is good at) one source -- say libstdc++, Boost, LLVM -- and a prompt is sent
to the specialist whose source it most resembles.

Features of a text: its C++ tokens from :mod:`megacpp.data.cpp_lex` (comments dropped;
identifiers, keywords and operators as themselves; every number ``<num>``, string literal
``<str>`` and character literal ``<chr>``) and the bigrams of adjacent features. Training
cuts every source file into snippets of ``snippet_lines`` lines (prompts are snippets, not
whole files), counts features per label, keeps the ``max_features`` most frequent, and uses
add-``alpha`` (Laplace) smoothing. Class priors are uniform: a specialist is not favoured
because its corpus was larger. A prompt with no known feature goes to the default
specialist. The model is a small JSON file (counts, not probabilities).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megacpp._io import JSON_LIMIT, atomic_write_json, read_json_bounded
from megacpp.data.cpp_lex import TokenKind, token_spans
from megacpp.errors import MegaCppError

AUTO = "auto"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # a specialist's name
ROUTER_FORMAT = "megacpp-router-nb"
ROUTER_VERSION = 1
_PLACEHOLDER = {TokenKind.NUMBER: "<num>", TokenKind.STRING: "<str>", TokenKind.CHAR: "<chr>"}


class UnknownModel(MegaCppError):
    """A request named a model that is not loaded (HTTP 404)."""


# ---- features -------------------------------------------------------------------------------


def lexical_tokens(text: str) -> list[str]:
    """The C++ tokens of ``text`` with literals replaced by their placeholder."""
    data = text.encode("utf-8", "surrogatepass")
    spans = token_spans(data)
    out = []
    for start, end, kind in zip(spans.starts.tolist(), spans.ends.tolist(), spans.kinds.tolist()):
        out.append(_PLACEHOLDER.get(kind) or data[start:end].decode("utf-8", "replace"))
    return out


def features(text: str) -> Counter[str]:
    """Unigram and bigram counts of ``text``'s lexical tokens."""
    toks = lexical_tokens(text)
    counts = Counter(toks)
    counts.update(f"{a} {b}" for a, b in itertools.pairwise(toks))
    return counts


def snippets(text: str, snippet_lines: int) -> Iterator[str]:
    """``text`` cut into consecutive pieces of ``snippet_lines`` lines (blank pieces dropped)."""
    lines = text.splitlines(keepends=True)
    for i in range(0, len(lines), snippet_lines):
        piece = "".join(lines[i : i + snippet_lines])
        if piece.strip():
            yield piece


# ---- the classifier -------------------------------------------------------------------------


@dataclass
class SnippetClassifier:
    """Multinomial naive Bayes over :func:`features`; see the module docstring."""

    labels: list[str]
    vocab: list[str]
    counts: np.ndarray  # [labels, vocab] feature counts
    alpha: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = np.asarray(self.counts, dtype=np.float64)
        if self.counts.shape != (len(self.labels), len(self.vocab)):
            raise MegaCppError(f"router model: counts have shape {self.counts.shape}, expected "
                               f"({len(self.labels)}, {len(self.vocab)})")
        if len(set(self.labels)) != len(self.labels) or len(self.labels) < 2:
            raise MegaCppError(f"router model needs >= 2 distinct labels, got {self.labels}")
        if not self.alpha > 0:
            raise MegaCppError(f"router model: alpha must be > 0, got {self.alpha}")
        self._index = {tok: i for i, tok in enumerate(self.vocab)}
        smoothed = self.counts + self.alpha  # [C, V]
        self._log_prob = np.log(smoothed) - np.log(smoothed.sum(1, keepdims=True))

    @classmethod
    def fit(cls, texts: Sequence[str], labels: Sequence[str], *, max_features: int = 50_000,
            alpha: float = 1.0) -> SnippetClassifier:
        """Train on snippets ``texts`` with their source ``labels``."""
        if len(texts) != len(labels):
            raise MegaCppError(f"{len(texts)} snippets but {len(labels)} labels")
        names = sorted(set(labels))
        if len(names) < 2:
            raise MegaCppError(f"the router needs snippets of >= 2 sources, got {names}")
        per_label = {name: Counter() for name in names}
        for text, label in zip(texts, labels):
            per_label[label].update(features(text))
        total = Counter()
        for c in per_label.values():
            total.update(c)
        vocab = [tok for tok, _ in sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))]
        vocab = vocab[:max_features]
        counts = np.array([[per_label[name][tok] for tok in vocab] for name in names])
        snippets_per_label = Counter(labels)
        meta = {"snippets": {name: snippets_per_label[name] for name in names}}
        return cls(names, vocab, counts, alpha, meta)

    def log_likelihoods(self, text: str) -> np.ndarray:
        """[labels] log p(text | label), over the known features (0 when none is known)."""
        idx, n = [], []
        for tok, count in features(text).items():
            if (i := self._index.get(tok)) is not None:
                idx.append(i)
                n.append(count)
        if not idx:
            return np.zeros(len(self.labels))
        return self._log_prob[:, idx] @ np.asarray(n, dtype=np.float64)

    def predict(self, text: str) -> tuple[str | None, float]:
        """(label, its posterior probability under uniform priors); (None, 0) when ``text``
        has no known feature."""
        scores = self.log_likelihoods(text)
        if not scores.any():
            return None, 0.0
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        best = int(probs.argmax())
        return self.labels[best], float(probs[best])

    def accuracy(self, texts: Sequence[str], labels: Sequence[str]) -> float:
        hits = sum(self.predict(t)[0] == y for t, y in zip(texts, labels))
        return hits / max(1, len(texts))

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": ROUTER_FORMAT, "version": ROUTER_VERSION, "labels": self.labels,
                "alpha": self.alpha, "vocab": self.vocab,
                "counts": [[int(x) for x in row] for row in self.counts], "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, self.to_dict(), indent=None)
        return path

    @classmethod
    def load(cls, path: str | Path) -> SnippetClassifier:
        path = Path(path)
        data = read_json_bounded(path, JSON_LIMIT, what="router model")
        if not isinstance(data, dict) or data.get("format") != ROUTER_FORMAT:
            raise MegaCppError(f"{path} is not a megacpp router model (format {ROUTER_FORMAT!r})")
        if data.get("version") != ROUTER_VERSION:
            raise MegaCppError(f"{path}: router model version {data.get('version')!r}, this "
                               f"megacpp reads version {ROUTER_VERSION}")
        try:
            labels, vocab = list(data["labels"]), list(data["vocab"])
            if not all(isinstance(x, str) for x in labels + vocab):
                raise TypeError("labels and vocab must be strings")
            alpha = float(data["alpha"])
            if not math.isfinite(alpha):
                raise ValueError(f"alpha {alpha} is not finite")
            return cls(labels, vocab, np.array(data["counts"]), alpha,
                       dict(data.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise MegaCppError(f"{path}: corrupt router model ({exc})") from None


# ---- training data --------------------------------------------------------------------------


def source_texts(path: str | Path) -> Iterator[str]:
    """The C/C++ texts of ``path``: a megacpp dataset (its ``documents.parquet``) or a source
    directory / file (walked like ``megacpp data build`` does)."""
    path = Path(path)
    if (path / "documents.parquet").is_file():
        import pyarrow.parquet as pq

        table = pq.read_table(path / "documents.parquet", columns=["text"])
        yield from (t for t in table.column("text").to_pylist() if t)
        return
    from megacpp.data.config import CorpusConfig
    from megacpp.data.pipeline import StageStats
    from megacpp.data.sources import iter_sources

    for doc in iter_sources([path], CorpusConfig(), StageStats("sources")):
        raw = doc.raw if doc.raw is not None else Path(doc.source_root, doc.rel_path).read_bytes()
        yield raw.decode("utf-8", "replace")


def labelled_snippets(sources: dict[str, Iterable[str]], snippet_lines: int,
                      heldout_permille: int = 100) -> tuple[list, list, list, list]:
    """(train texts, train labels, held-out texts, held-out labels): every text of each
    label cut into snippets; whole files are held out by a hash of their content."""
    if snippet_lines < 1:
        raise MegaCppError(f"snippet_lines must be >= 1, got {snippet_lines}")
    train_x, train_y, held_x, held_y = [], [], [], []
    for label, texts in sources.items():
        found = 0
        for text in texts:
            digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
            held = int.from_bytes(digest[:4], "little") % 1000 < heldout_permille
            for piece in snippets(text, snippet_lines):
                (held_x if held else train_x).append(piece)
                (held_y if held else train_y).append(label)
                found += 1
        if not found:
            raise MegaCppError(f"router source {label!r}: no C/C++ text found")
    return train_x, train_y, held_x, held_y


def train_router(sources: dict[str, str | Path], *, snippet_lines: int = 30,
                 max_features: int = 50_000, alpha: float = 1.0,
                 heldout_permille: int = 100) -> SnippetClassifier:
    """Train the ``auto`` classifier on ``{specialist name: dataset or source dir}``; its
    ``meta`` records the held-out snippet accuracy."""
    texts = {label: source_texts(path) for label, path in sources.items()}
    train_x, train_y, held_x, held_y = labelled_snippets(texts, snippet_lines, heldout_permille)
    clf = SnippetClassifier.fit(train_x, train_y, max_features=max_features, alpha=alpha)
    clf.meta.update(
        sources={label: str(path) for label, path in sources.items()},
        snippet_lines=snippet_lines,
        heldout_snippets=len(held_x),
        heldout_accuracy=clf.accuracy(held_x, held_y) if held_x else math.nan,
    )
    return clf


# ---- routing --------------------------------------------------------------------------------


@dataclass
class Route:
    """Where one request goes and why."""

    name: str  # the specialist
    how: str  # "model" (named in the request) | "auto" (classifier) | "default"
    confidence: float | None = None  # the classifier's posterior, for "auto"


class Router:
    """Chooses among ``names`` (the loaded specialists; the first is the default)."""

    def __init__(self, names: Sequence[str], classifier: SnippetClassifier | None = None) -> None:
        if not names:
            raise MegaCppError("the router needs at least one specialist")
        if len(set(names)) != len(names) or AUTO in names:
            raise MegaCppError(f"specialist names must be distinct and not {AUTO!r}: {list(names)}")
        if classifier is not None:
            missing = [label for label in classifier.labels if label not in names]
            if missing:
                raise MegaCppError(
                    f"the router model's labels {missing} are not loaded specialists "
                    f"({', '.join(names)}); name checkpoints after the labels (NAME=DIR)")
        self.names = list(names)
        self.default = self.names[0]
        self.classifier = classifier

    def check_name(self, name: str) -> None:
        """A name a new specialist may take: letters, digits, '_', '.', '-', not taken."""
        if not _NAME.match(name) or name == AUTO:
            raise MegaCppError(f"model name {name!r}: use letters, digits, '_', '.', '-' (not "
                               f"{AUTO!r})")
        if name in self.names:
            raise MegaCppError(f"model {name!r} is already served")

    def add(self, name: str) -> None:
        """Route to one more specialist (a LoRA adapter loaded at run time)."""
        self.check_name(name)
        self.names.append(name)

    def remove(self, name: str) -> None:
        """Stop routing to ``name``; the default and the router model's labels stay."""
        if name == self.default:
            raise MegaCppError(f"{name!r} is the default model; it cannot be removed")
        if self.classifier is not None and name in self.classifier.labels:
            raise MegaCppError(f"{name!r} is a label of the router model (model 'auto' may "
                               "choose it); it cannot be removed")
        self.names.remove(name)

    def route(self, model: str, prompt: str) -> Route:
        if model in self.names:
            return Route(model, "model")
        if model != AUTO:
            raise UnknownModel(f"model {model!r} is not served here; choose one of "
                               f"{', '.join([*self.names, AUTO])}")
        if len(self.names) == 1:
            return Route(self.default, "default")
        if self.classifier is None:
            raise MegaCppError(f"model {AUTO!r} needs a router model (megacpp serve --router "
                               f"FILE); name one of {', '.join(self.names)} instead")
        label, confidence = self.classifier.predict(prompt)
        if label is None:
            return Route(self.default, "default")
        return Route(label, AUTO, confidence)
