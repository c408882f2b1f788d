"""The C++ tokenizer: byte-level BPE (HF ``tokenizers``) with code-aware pre-tokenization,
a reserved C++ vocabulary and special tokens.

Pre-tokenization (:data:`PRETOKENIZE_PATTERN`, ASCII classes only) splits text into

* a newline run plus the following indentation (``"\\n        "`` is one piece, so common
  indentation levels become single tokens),
* identifiers/keywords with at most one leading space (``" int"``),
* single digits (numbers are split digit by digit),
* ASCII punctuation runs with at most one leading space (``"::"``, ``" ->"``, ``"();"``),
* runs of non-ASCII characters (UTF-8 in comments and strings),
* remaining spaces/tabs (the last space before a word is left to that word).

Every character lands in exactly one piece, and the byte-level model covers all 256 bytes, so
``decode(encode(text)) == text`` byte for byte; there is no normalizer.

Reserved vocabulary: C++ keywords, multi-character operators/punctuators, preprocessor
directive names and common ``std::`` names (bare and with one leading space) are guaranteed to
be single tokens. After BPE training, every reserved string the trainer did not learn is added
by appending merges (lowest priority) that join its current pieces; the lowest-priority learned
merges are dropped to make room, so the vocabulary size stays exactly as requested. The list is
taken in priority order and cut to a quarter of the learnable vocabulary, so small vocabularies
(512 for tests, 4096 for the tiny CPU model) stay mostly learned merges.

Encoding: :meth:`CppTokenizer.encode_batch` produces exactly the ids of HF
``Tokenizer.encode(text, add_special_tokens=False)`` with ``encode_special_tokens=True`` (a
literal ``<|eos|>`` in source code is ordinary text), but runs several times faster: it splits
with Python's ``re`` (same pattern, same leftmost-first semantics) and caches the BPE result of
every distinct piece; only unseen pieces go to the HF model. Above the pieces, it cuts each
text at its newline runs (a fast literal search) into lines and runs, which pre-tokenize
independently (:func:`split_units`) and repeat a lot in code, and caches their tokens too:
only unseen lines are split into pieces. Where ``g++`` is available, the split and the piece
index run in C++ instead (:mod:`megacpp.data.native`, about 2.5x faster on text it has not
seen); this Python path is its reference and fallback. Tests check the equality of all three
(native, Python, HF).
"""

from __future__ import annotations

import itertools
import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from megacpp._io import TOKENIZER_LIMIT, atomic_write_text, decode_utf8, read_bounded, sha256_bytes
from megacpp.data.native import PieceIndex, native_library
from megacpp.errors import MegaCppError

PAD, BOS, EOS, DOC_SEP = "<|pad|>", "<|bos|>", "<|eos|>", "<|docsep|>"
FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"
# Fixed ids 0..6 in this order, in every megacpp tokenizer.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, DOC_SEP, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX)

_PUNCT = r"!-/:-@\[-\^`{-~"  # ASCII punctuation except '_' (which belongs to identifiers)
PRETOKENIZE_PATTERN = (
    r" ?(?:"  # at most one leading space, then
    r"[A-Za-z_][A-Za-z0-9_]*"  # an identifier / keyword
    r"|[0-9]"  # or one digit
    rf"|[{_PUNCT}]+"  # or a punctuation run
    r"|[^\x00-\x7F]+"  # or a non-ASCII run
    r")"
    r"|(?:\r?\n)+[ \t]*"  # newline run + indentation
    r"|[ \t]+(?= [^ \t\r\n\x00-\x1f\x7f])"  # spaces, leaving one for the next piece
    r"|[ \t]+"  # other spaces / tabs
    r"|[\s\S]"  # anything else (control characters, a lone CR), one at a time
)
_PIECE_RE = re.compile(PRETOKENIZE_PATTERN)
_PIECE_CACHE_LIMIT = 4_000_000  # distinct pieces remembered by one CppTokenizer
# A newline run + indentation: exactly the pattern's ``(?:\r?\n)+[ \t]*`` piece, less the
# ``\r`` before its first ``\n`` (see :func:`split_units`). Its literal first character lets
# ``re`` find it at memchr speed.
_RUN_RE = re.compile(r"(\n(?:\r?\n)*[ \t]*)")
_UNIT_CACHE_LIMIT = 1_000_000  # distinct lines (units) remembered by one CppTokenizer

# C++ keywords, most frequent in real code first (the order is the reservation priority).
CPP_KEYWORDS = (  # noqa: SIM905 -- a word list reads best as text
    "const int return if void auto static struct class template typename else for bool char "
    "unsigned namespace public private inline using this true false nullptr sizeof case "
    "break while virtual override explicit operator typedef enum double float long short "
    "signed switch default delete new constexpr noexcept decltype static_cast protected "
    "friend mutable volatile extern try catch throw continue do goto union reinterpret_cast "
    "const_cast dynamic_cast static_assert thread_local alignas alignof char8_t char16_t "
    "char32_t wchar_t concept requires consteval constinit co_await co_return co_yield "
    "export import module final register typeid asm and and_eq bitand bitor compl not "
    "not_eq or or_eq xor xor_eq"
).split()
CPP_DIRECTIVES = (  # noqa: SIM905 -- a word list reads best as text
    "include define ifdef ifndef endif pragma undef elif once error line"
).split()
CPP_OPERATORS = (  # noqa: SIM905 -- multi-character only (single ones are base bytes)
    ":: -> == != <= >= && || << >> ++ -- += -= *= /= %= &= |= ^= <<= >>= <=> ... ->* .* ## "
).split()
STD_NAMES = (  # noqa: SIM905 -- a word list reads best as text
    "std size_t string vector move forward unique_ptr shared_ptr make_unique make_shared "
    "pair tuple array map set unordered_map unordered_set optional variant function "
    "string_view ptrdiff_t int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t "
    "uint64_t begin end size empty data front back push_back emplace_back pop_back insert "
    "erase clear find count reserve resize at swap iterator const_iterator value_type "
    "size_type difference_type reference const_reference pointer const_pointer allocator "
    "allocator_type traits_type char_type basic_string initializer_list enable_if "
    "enable_if_t conditional conditional_t is_same is_same_v decay decay_t remove_reference "
    "remove_reference_t remove_cv_t declval integral_constant true_type false_type "
    "numeric_limits invoke_result_t hash less greater equal_to min max sort lower_bound "
    "upper_bound accumulate transform copy fill deque list forward_list multimap multiset "
    "weak_ptr make_pair make_tuple exchange cbegin cend rbegin rend any span wstring "
    "nullptr_t reverse_iterator thread mutex lock_guard unique_lock condition_variable "
    "atomic future promise chrono cout cin cerr endl ostream istream stringstream "
    "ostringstream runtime_error logic_error out_of_range invalid_argument exception assert "
    "main printf memcpy memset"
).split()
_TOP_KEYWORDS = 12  # keywords that outrank the operators


def reserved_strings() -> list[str]:
    """The reserved vocabulary in priority order: the most common keywords (bare and with one
    leading space), the multi-character operators, the other keywords, preprocessor
    directives, operators with a leading space, then ``std::`` names (both forms)."""

    def both(words: list[str]) -> list[str]:
        return [form for w in words for form in (w, " " + w)]

    ordered = (
        both(CPP_KEYWORDS[:_TOP_KEYWORDS])
        + CPP_OPERATORS
        + both(CPP_KEYWORDS[_TOP_KEYWORDS:])
        + CPP_DIRECTIVES
        + [" " + op for op in CPP_OPERATORS]
        + both(STD_NAMES)
    )
    return list(dict.fromkeys(ordered))


def reserved_budget(vocab_size: int) -> int:
    """How many reserved strings a vocabulary of ``vocab_size`` takes (a quarter of the
    learnable part, so tiny vocabularies stay mostly data-driven)."""
    return max(0, (vocab_size - 256 - len(SPECIAL_TOKENS)) // 4)


# ---- byte-level alphabet (GPT-2's printable mapping of the 256 bytes) ----------------------


def _bytes_to_unicode() -> dict[int, str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_LATIN1_TO_BYTELEVEL = str.maketrans({chr(b): c for b, c in _BYTE_TO_CHAR.items()})


def to_byte_level(piece: str) -> str:
    """The byte-level form of ``piece`` (what the BPE model sees)."""
    return piece.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTELEVEL)


_BYTE_LEVEL_CHARS = "".join(_CHAR_TO_BYTE)


def _byte_level_len(token: str) -> int:
    """Bytes of a byte-level ``token``; 0 when it is not one (an added special token)."""
    return 0 if token.strip(_BYTE_LEVEL_CHARS) else len(token)


# ---- training ------------------------------------------------------------------------------


def _new_code_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _bpe_trainer(vocab_size: int, min_frequency: int) -> trainers.BpeTrainer:
    return trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )


def _check_vocab_size(vocab_size: int) -> None:
    smallest = 256 + len(SPECIAL_TOKENS) + 1
    if not smallest <= vocab_size <= 1 << 24:
        raise MegaCppError(
            f"tokenizer vocab_size {vocab_size} is out of range: use {smallest}..{1 << 24}"
        )


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 32768, *, min_frequency: int = 2, reserve: bool = True
) -> Tokenizer:
    """Train the megacpp C++ tokenizer on ``texts`` (documents)."""
    _check_vocab_size(vocab_size)
    tok = _new_code_tokenizer()
    parts = (part for text in texts for part in split_at_piece_ends(text, PART_CHARS))
    tok.train_from_iterator(parts, _bpe_trainer(vocab_size, min_frequency))
    spec = json.loads(tok.to_str())
    if reserve:
        wanted = reserved_strings()[: reserved_budget(vocab_size)]
        vocab, merges = _reserve(spec["model"], [to_byte_level(w) for w in wanted], vocab_size)
        spec["model"]["vocab"], spec["model"]["merges"] = vocab, [list(m) for m in merges]
    return Tokenizer.from_str(json.dumps(spec))


def train_plain_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """The baseline: HF's stock byte-level BPE (GPT-2 pre-tokenization), same specials."""
    _check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, _bpe_trainer(vocab_size, min_frequency))
    return tok


# A place where a piece of PRETOKENIZE_PATTERN always ends: a character that is not a space,
# tab, CR or LF (no piece runs from it into what follows: identifiers, digits, punctuation and
# non-ASCII runs take no space after them), followed by a space or a newline. The regex then
# starts afresh after it, so the pieces of the text are those of its two sides.
_PIECE_END = re.compile(r"[^ \t\r\n](?=[ \n])")
PART_CHARS = 1 << 20  # the parts a long document is encoded or trained on, in characters
_BATCH_CHARS = 4 << 20  # a batch larger than this is encoded a part at a time


def split_at_piece_ends(text: str, size: int = PART_CHARS) -> list[str]:
    """``text`` as consecutive parts of about ``size`` characters, each cut where a
    pre-tokenizer piece ends, so that the pieces (and token ids) of the parts are those of the
    whole: the memory of encoding or training on a huge one-line document stays bounded. A
    part with no such place within 4 x ``size`` characters (one 4 MiB identifier) is cut
    there anyway; ``decode`` of the ids still gives the text back."""
    parts, start = [], 0
    while len(text) - start > size:
        found = _PIECE_END.search(text, start + size - 1, start + 4 * size)
        cut = found.end() if found else start + 4 * size
        parts.append(text[start:cut])
        start = cut
    parts.append(text[start:])
    return parts


def split_units(text: str) -> list[str]:
    """``text`` cut at piece boundaries into units that pre-tokenize independently:
    ``[line, run, line, run, ..., line]``, where a run is one whole newline-run piece
    (``(?:\r?\n)+[ \t]*``) and a line is what lies between two runs. The pattern's pieces of
    ``text`` are the concatenation of each unit's pieces (tested), so units can be cached:
    a run ends at a character that is not a space, tab or newline, where every piece
    alternative starts afresh, and no piece of a line can reach into the next run.

    The split regex cannot look behind, so a ``\r`` that ends a line and precedes its run's
    ``\n`` (a CRLF) is moved into the run afterwards."""
    units = _RUN_RE.split(text)
    if "\r" in text:
        for i in range(0, len(units) - 1, 2):  # lines at even indices, runs after them
            if units[i].endswith("\r"):
                units[i], units[i + 1] = units[i][:-1], "\r" + units[i + 1]
    return units


def _bpe_pieces(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply BPE merges (lowest rank first) to one byte-level word."""
    pieces = list(word)
    while len(pieces) > 1:
        pairs = [(ranks.get(pair, -1), i) for i, pair in enumerate(itertools.pairwise(pieces))]
        known = [(r, i) for r, i in pairs if r >= 0]
        if not known:
            break
        _, i = min(known)
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def _reserve(
    model: dict, wanted: Sequence[str], vocab_size: int
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Make every byte-level string in ``wanted`` a single token of the BPE ``model``.

    Missing strings get a chain of merges appended (joining their current pieces left to
    right); learned merges are dropped from the end (lowest priority; a suffix of the merge
    list never feeds an earlier merge) until the vocabulary fits ``vocab_size``.
    """
    learned = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    merged = {a + b for a, b in learned}
    base = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t not in merged]
    n_keep = len(learned)
    while True:
        merges = list(learned[:n_keep])
        vocab = dict.fromkeys(base)
        vocab.update(dict.fromkeys(a + b for a, b in merges))
        added = _append_reserved_merges(merges, vocab, wanted)
        overflow = len(vocab) - vocab_size
        if overflow <= 0:
            return {tok: i for i, tok in enumerate(vocab)}, merges
        n_keep -= overflow
        if n_keep < 0:  # pragma: no cover - the budget rule keeps wanted small enough
            raise MegaCppError(f"reserved vocabulary ({added} tokens) does not fit {vocab_size}")


def _append_reserved_merges(
    merges: list[tuple[str, str]], vocab: dict[str, None], wanted: Sequence[str]
) -> int:
    """Append merge chains for the strings of ``wanted`` not yet single tokens; returns how
    many new tokens that added to ``vocab`` (updated in place, as is ``merges``)."""
    ranks = {pair: r for r, pair in enumerate(merges)}
    before = len(vocab)
    for word in wanted:
        pieces = _bpe_pieces(word, ranks)
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            pieces[0:2] = [pair[0] + pair[1]]
            vocab.setdefault(pieces[0])
    return len(vocab) - before


# ---- loading and fast encoding -------------------------------------------------------------


class CppTokenizer:
    """A loaded megacpp tokenizer: ids of the special tokens, fast batch encoding, decoding,
    and per-token byte lengths (for mapping tokens to source byte offsets)."""

    def __init__(self, tokenizer: Tokenizer, *, sha256: str, path: str | None = None) -> None:
        _check_is_megacpp_tokenizer(tokenizer, path or "<memory>")
        self.hf = tokenizer
        self.sha256 = sha256
        self.path = path
        ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        self.pad_id, self.bos_id, self.eos_id, self.doc_sep_id = ids[:4]
        self.fim_prefix_id, self.fim_middle_id, self.fim_suffix_id = ids[4:]
        self._pieces = _TokenCache(self._encode_pieces, _PIECE_CACHE_LIMIT)
        self._units = _TokenCache(self._encode_units, _UNIT_CACHE_LIMIT)
        self._native: tuple[PieceIndex, _RowTokens] | None | bool = False  # False: not yet

    @classmethod
    def load(cls, path: str | Path) -> CppTokenizer:
        """Load ``tokenizer.json``; refuses files that are not megacpp tokenizers."""
        path = Path(path)
        data = read_bounded(path, TOKENIZER_LIMIT, what="tokenizer")
        text = decode_utf8(data, f"tokenizer {path}")
        try:
            tok = Tokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception
            raise MegaCppError(f"{path} is not a valid tokenizer.json: {exc}") from None
        return cls(tok, sha256=sha256_bytes(data), path=str(path))

    @classmethod
    def from_hf(cls, tokenizer: Tokenizer) -> CppTokenizer:
        """Wrap an in-memory HF tokenizer (hash of its canonical JSON)."""
        return cls(tokenizer, sha256=sha256_bytes(tokenizer.to_str().encode("utf-8")))

    def save(self, path: str | Path) -> Path:
        """Write ``tokenizer.json`` atomically (pretty JSON, as HF writes it)."""
        return atomic_write_text(path, self.hf.to_str(pretty=True))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    @cached_property
    def token_nbytes(self) -> np.ndarray:
        """int32[vocab_size]: how many source bytes each token id stands for (0 for specials)."""
        lengths = np.zeros(self.vocab_size, dtype=np.int32)
        for token, i in self.hf.get_vocab(with_added_tokens=False).items():
            lengths[i] = _byte_level_len(token)
        for token in SPECIAL_TOKENS:
            lengths[self.hf.token_to_id(token)] = 0
        return lengths

    def encode(self, text: str) -> np.ndarray:
        """int32[n] ids of ``text`` (no BOS/EOS)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode many documents; equal to HF ``encode`` of each, several times faster. A
        batch of more than a few MiB is encoded a part at a time (:func:`split_at_piece_ends`),
        so a huge document costs memory for its ids, not for a whole-text pass."""
        if not texts:
            return []
        if sum(map(len, texts)) > _BATCH_CHARS:
            return [self._encode_parts(split_at_piece_ends(t, PART_CHARS)) for t in texts]
        return self._encode_whole(texts)

    def _encode_parts(self, parts: list[str]) -> np.ndarray:
        ids = [self._encode_whole([part])[0] for part in parts]
        return ids[0] if len(ids) == 1 else np.concatenate(ids)

    def _encode_whole(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self._native is False:
            lib = native_library()
            self._native = None if lib is None else (PieceIndex(lib), _RowTokens())
        if self._native is not None:
            return self._encode_batch_native(list(texts), *self._native)
        unit_lists = [split_units(t) for t in texts]  # lines and newline runs repeat a lot
        n_units = [len(units) for units in unit_lists]
        units = itertools.chain.from_iterable(unit_lists)
        ids, count = self._units.lookup(units, sum(n_units))  # count: [units]
        doc_ends = np.concatenate(([0], np.cumsum(count)))[np.cumsum(n_units)]  # [texts]
        return np.split(ids, doc_ends[:-1])

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (specials dropped unless ``skip_special_tokens=False``)."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _encode_batch_native(
        self, texts: list[str], index: PieceIndex, table: _RowTokens
    ) -> list[np.ndarray]:
        """:meth:`encode_batch` with the native pre-tokenizer and piece index (same ids)."""
        if len(index) > _PIECE_CACHE_LIMIT:
            index.clear()
            table.clear()
        try:
            rows, per_text, new = index.rows(texts)  # rows: [pieces], per_text: [texts]
            if new:
                table.append(*self._encode_pieces(new))
        except BaseException:
            index.clear()  # rows may have been handed out without tokens: start over
            table.clear()
            raise
        ids, count = table.gather(rows)  # count: [pieces]
        doc_ends = np.concatenate(([0], np.cumsum(count)))[np.cumsum(per_text)]  # [texts]
        return np.split(ids, doc_ends[:-1])

    def _encode_units(self, units: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token counts ``[len(units)]`` and all tokens of ``units`` (new to the unit cache):
        their pieces, through the piece cache."""
        piece_lists = [_PIECE_RE.findall(u) for u in units]
        n_pieces = np.fromiter(map(len, piece_lists), np.int64, len(piece_lists))
        pieces = itertools.chain.from_iterable(piece_lists)
        ids, count = self._pieces.lookup(pieces, int(n_pieces.sum()))  # count: [pieces]
        ends = np.concatenate(([0], np.cumsum(count)))[np.cumsum(n_pieces)]  # [units]
        return np.diff(ends, prepend=0), ids

    def _encode_pieces(self, pieces: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token counts ``[len(pieces)]`` and all tokens of ``pieces``, by the BPE model."""
        tokenize = self.hf.model.tokenize
        token_lists = [[t.id for t in tokenize(to_byte_level(piece))] for piece in pieces]
        count = np.fromiter(map(len, token_lists), np.int64, len(token_lists))
        flat = itertools.chain.from_iterable(token_lists)
        return count, np.fromiter(flat, np.int32, int(count.sum()))


class _RowTokens:
    """The token ids of rows ``0..n-1`` in flat arrays: row ``r`` is
    ``tokens[start[r] : start[r] + count[r]]``."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._start = _GrowingArray(np.int64)  # [rows] first token of each row
        self._count = _GrowingArray(np.int64)  # [rows] tokens of each row
        self._tokens = _GrowingArray(np.int32)  # [sum(count)] token ids, row after row

    def append(self, count: np.ndarray, tokens: np.ndarray) -> None:
        """Add rows with ``count`` [new rows] tokens each, all of them in ``tokens``."""
        self._start.extend(len(self._tokens.view) + np.cumsum(count) - count)
        self._count.extend(count)
        self._tokens.extend(tokens)

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """All token ids of ``rows`` (one after the other) and the count of each [rows]."""
        count = self._count.view[rows]
        ends = np.cumsum(count)
        first = np.repeat(self._start.view[rows] - (ends - count), count)  # offset per token
        ids = self._tokens.view[first + np.arange(int(ends[-1]) if len(ends) else 0)]
        return ids, count


class _TokenCache:
    """The token ids of every distinct string seen so far (up to ``limit`` strings), as rows
    of a :class:`_RowTokens`; ``encode_new`` gives ``(count, tokens)`` for strings not seen
    yet.

    Lookups run at C speed: ``_row_of`` is a dict whose missing keys get the next row (its
    own length) on first access, so a batch maps to rows in one ``map`` call, and the strings
    new to the cache are the last keys inserted (encoded together afterwards).
    """

    def __init__(
        self, encode_new: Callable[[list[str]], tuple[np.ndarray, np.ndarray]], limit: int
    ) -> None:
        self._encode_new = encode_new
        self._limit = limit
        self._row_of: defaultdict[str, int] = defaultdict()
        self._row_of.default_factory = self._row_of.__len__  # a new string gets the next row
        self._table = _RowTokens()

    def lookup(self, strings: Iterable[str], n_strings: int) -> tuple[np.ndarray, np.ndarray]:
        """All token ids of ``strings`` (one after the other) and the count of each
        ``[n_strings]``."""
        return self._table.gather(self._rows(strings, n_strings))

    def _rows(self, strings: Iterable[str], n_strings: int) -> np.ndarray:
        if len(self._row_of) > self._limit:
            self._clear()
        known = len(self._row_of)
        try:
            rows = np.fromiter(map(self._row_of.__getitem__, strings), np.int64, n_strings)
            n_new = len(self._row_of) - known
            if n_new:
                new = list(itertools.islice(reversed(self._row_of), n_new))[::-1]  # row order
                self._table.append(*self._encode_new(new))
        except BaseException:
            self._clear()  # rows may have been handed out without tokens: start over
            raise
        return rows

    def _clear(self) -> None:
        self._row_of.clear()
        self._table.clear()


class _GrowingArray:
    """A 1-D numpy array appended to in amortized O(1) per element (capacity doubling)."""

    def __init__(self, dtype: type) -> None:
        self._data = np.zeros(1024, dtype=dtype)
        self.view = self._data[:0]

    def extend(self, values: np.ndarray) -> None:
        size = len(self.view) + len(values)
        if size > len(self._data):
            grown = np.zeros(max(size, 2 * len(self._data)), dtype=self._data.dtype)
            grown[: len(self.view)] = self.view
            self._data = grown
        self._data[len(self.view) : size] = values
        self.view = self._data[:size]


def _check_is_megacpp_tokenizer(tok: Tokenizer, where: str) -> None:
    spec = json.loads(tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    ok = (
        spec.get("normalizer") is None
        and spec.get("model", {}).get("type") == "BPE"
        and len(steps) == 2
        and steps[0].get("type") == "Split"
        and steps[0].get("pattern", {}).get("Regex") == PRETOKENIZE_PATTERN
        and steps[1].get("type") == "ByteLevel"
        and not steps[1].get("use_regex", True)
        and all(tok.token_to_id(t) == i for i, t in enumerate(SPECIAL_TOKENS))
    )
    if not ok:
        raise MegaCppError(
            f"{where} is not a megacpp tokenizer: expected byte-level BPE with megacpp's code "
            f"pre-tokenizer and special tokens {', '.join(SPECIAL_TOKENS)} at ids 0.."
            f"{len(SPECIAL_TOKENS) - 1} (train one with `megacpp tokenizer train`)"
        )


def bytes_per_token(tok: Tokenizer, texts: Sequence[str]) -> float:
    """Source bytes per token of HF tokenizer ``tok`` over ``texts`` (no specials added)."""
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(e.ids) for e in tok.encode_batch_fast(list(texts), add_special_tokens=False))
    return n_bytes / max(n_tokens, 1)


def iter_capped(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """The first documents of ``texts`` up to ``max_bytes`` of UTF-8 in total (at least one)."""
    total = 0
    for text in texts:
        yield text
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            return


def compare_with_plain_bpe(
    train_texts: Sequence[str],
    heldout_texts: Sequence[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
) -> dict[str, float]:
    """Bytes per token on ``heldout_texts`` of the megacpp tokenizer and of a stock byte-level
    BPE, both trained on ``train_texts`` with the same vocabulary size."""
    ours = train_tokenizer(train_texts, vocab_size, min_frequency=min_frequency)
    plain = train_plain_bpe(train_texts, vocab_size, min_frequency=min_frequency)
    return {
        "vocab_size": vocab_size,
        "train_documents": len(train_texts),
        "train_bytes": sum(len(t.encode("utf-8")) for t in train_texts),
        "heldout_documents": len(heldout_texts),
        "heldout_bytes": sum(len(t.encode("utf-8")) for t in heldout_texts),
        "megacpp_bytes_per_token": bytes_per_token(ours, heldout_texts),
        "plain_bpe_bytes_per_token": bytes_per_token(plain, heldout_texts),
    }
