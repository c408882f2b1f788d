"""A small, fast C++ lexer for shingling (near-duplicate detection).

It returns token *spans* (byte offsets into the UTF-8 source) with a kind per token; comments
and whitespace are skipped. Speed comes from splitting the work by how irregular it is:

1. **Literals and comments** (regex scan, left to right): ``//`` and ``/* */`` comments
   (skipped; an unterminated block comment runs to the end), string literals including raw
   strings ``R"d(...)d"``, and character literals, each with its encoding prefix (``u8 u U L``,
   ``R``) and user-defined-literal suffix attached. A ``'`` right after an identifier character
   is a digit separator, never the start of a character literal. These tokens are rare, so
   a regex with a cheap first-character scan handles them in C.
2. **Numbers** (pp-numbers, ``[lex.ppnumber]``): a digit not preceded by an identifier
   character, or a ``.`` followed by a digit and preceded by neither an identifier character
   nor another ``.``; it extends over identifier characters, ``.``, ``'x`` and exponent signs
   (``1e+5``, ``0x1p-3``, ``1'000``, ``.5f``), never into a literal or comment. Candidates
   and extents are both computed with numpy (the extension rules only look at neighbours).
3. **Everything else** (numpy over byte classes, no per-token Python): identifiers and
   keywords are maximal runs of identifier characters (``[A-Za-z0-9_$]`` and every non-ASCII
   byte, so UTF-8 identifiers stay whole); operators/punctuators are taken by maximal munch
   within each run of operator characters (digraphs such as ``<:`` are not recognised: real
   code does not use them and ``<::`` would need special casing); any other non-space byte
   (``\\``, ``@``, a stray quote...) is a one-byte token of kind ``OTHER``.

The grammar matches a C++ translation-phase-3 lexer on valid code; on invalid code (``x.5``)
it stays deterministic and total: every input lexes, nothing raises.

:func:`token_spans_batch` lexes many sources in one pass of numpy calls (phase 1 still runs
per source, so an unterminated comment stops at its source's end): per-file overhead is what
limits speed on corpora of small files.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple

import numpy as np


class TokenKind(IntEnum):
    """What a token is. Keywords are identifiers; raw strings are strings."""

    IDENTIFIER = 1
    NUMBER = 2
    STRING = 3
    CHAR = 4
    OPERATOR = 5
    OTHER = 6


class TokenSpans(NamedTuple):
    """Tokens of one source as parallel arrays (each of shape ``[num_tokens]``).

    ``starts``/``ends`` are byte offsets into the UTF-8 encoding (end exclusive).
    """

    starts: np.ndarray  # int64
    ends: np.ndarray  # int64
    kinds: np.ndarray  # uint8, TokenKind values

    def __len__(self) -> int:
        return int(self.starts.shape[0])


OPERATORS: tuple[str, ...] = (
    "...", "<=>", "<<=", ">>=", "->*",
    "::", "++", "--", "->", ".*", "<<", ">>", "<=", ">=", "==", "!=", "&&", "||",
    "+=", "-=", "*=", "/=", "%=", "^=", "&=", "|=", "##",
    "{", "}", "[", "]", "(", ")", ";", ":", "?", ".", ",", "~", "!", "+", "-", "*", "/",
    "%", "^", "&", "|", "=", "<", ">", "#",
)  # fmt: skip
_OP_CHARS = b"{}[]();:?.,~!+-*/%^&|=<>#"
_SPACE_CHARS = b" \t\n\r\f\v"
_WORD_CHARS = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_$" + bytes(
    range(0x80, 0x100)
)

# Byte classes for phase 3; literal/number spans are painted _SPAN, comments _SPACE.
_SPACE, _WORD, _OP, _OTHER, _SPAN = 0, 1, 2, 3, 4
_CLASS = np.full(256, _OTHER, dtype=np.uint8)
_CLASS[list(_SPACE_CHARS)] = _SPACE
_CLASS[list(_WORD_CHARS)] = _WORD
_CLASS[list(_OP_CHARS)] = _OP
_CLASS_TABLE = _CLASS.tobytes()

_W = rb"A-Za-z0-9_$\x80-\xff"  # identifier characters, for regex classes
_UDL_SUFFIX = rb"(?:[A-Za-z_$\x80-\xff][" + _W + rb"]*)?"
_LINE_COMMENT = rb"//[^\n\\]*(?:\\(?s:.)[^\n\\]*)*"  # a backslash-newline continues it
_LINE_COMMENTS = _LINE_COMMENT + rb"(?:\n[ \t]*" + _LINE_COMMENT + rb")*"  # a block: one match
_BLOCK_COMMENT = rb"/\*[^*]*(?:\*+[^*/][^*]*)*(?:\*+/|\**\Z)"  # unterminated: to the end
_STRING = rb'"[^"\\\n]*(?:\\(?s:.)[^"\\\n]*)*"' + _UDL_SUFFIX
# A quote opens a character literal unless an identifier character precedes it (then it is
# a digit separator or stray), except a whole u/U/L/u8 prefix.
_CHAR_OPENS = (
    rb"(?:(?<![" + _W + rb"]')|(?<=(?<![" + _W + rb"])[uUL]')|(?<=(?<![" + _W + rb"])u8'))"
)
_CHAR = rb"'" + _CHAR_OPENS + rb"[^'\\\n]*(?:\\(?s:.)[^'\\\n]*)*'" + _UDL_SUFFIX
# One pattern without capturing groups (a capturing group switches off sre's fast scan for
# the first byte); the first byte of a match says what it is. Raw strings start as an
# ordinary string match and are re-matched with _RAW_RE when an R prefix precedes them.
_LITERAL_RE = re.compile(b"|".join((_LINE_COMMENTS, _BLOCK_COMMENT, _STRING, _CHAR)))
_RAW_RE = re.compile(rb"\"([^()\\ \t\n\r\f\v\"]{0,16})\((?s:.)*?\)\1\"" + _UDL_SUFFIX)
_RAW_PREFIXES = (b"u8R", b"uR", b"UR", b"LR", b"R")
_ENCODING_PREFIXES = (b"u8", b"u", b"U", b"L")

_IS_EXPONENT = np.zeros(256, dtype=bool)
_IS_EXPONENT[list(b"eEpP")] = True
# Operator lookup by (first byte, second byte) and the 3-byte operators.
_OP2 = np.zeros(1 << 16, dtype=bool)
for _op in OPERATORS:
    if len(_op) == 2:
        _OP2[(ord(_op[0]) << 8) | ord(_op[1])] = True
# Each 3-byte operator has a distinct 2-byte prefix; map the prefix to the third byte.
_OP3_THIRD = np.zeros(1 << 16, dtype=np.uint8)
for _op in OPERATORS:
    if len(_op) == 3:
        _OP3_THIRD[(ord(_op[0]) << 8) | ord(_op[1])] = ord(_op[2])


def _prefix_start(data: bytes, start: int, prefixes: tuple[bytes, ...], floor: int) -> int:
    """Where a literal starting at ``start`` really begins once its encoding prefix is
    attached: the prefix must be a whole identifier at or after ``floor`` (the end of the
    previous literal or comment)."""
    for prefix in prefixes:
        begin = start - len(prefix)
        if begin < floor or not data.startswith(prefix, begin):
            continue
        if begin == 0 or _CLASS[data[begin - 1]] != _WORD:  # a whole identifier
            return begin
    return start


def _literal_spans(data: bytes) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Phase 1: ``([(start, end, kind)] for literals, [(start, end)] for comments)``."""
    literals: list[tuple[int, int, int]] = []
    comments: list[tuple[int, int]] = []
    floor = 0  # end of the previous literal or comment
    search = _LITERAL_RE.search
    m = search(data)
    while m is not None:
        start, end = m.span()
        first = data[start]
        if first == 0x2F:  # "/"
            comments.append((start, end))
        else:
            kind = TokenKind.STRING if first == 0x22 else TokenKind.CHAR
            prefixes = _ENCODING_PREFIXES
            if (
                kind == TokenKind.STRING
                and _prefix_start(data, start, _RAW_PREFIXES, floor) < start
            ):
                raw = _RAW_RE.match(data, start)
                if raw is not None:
                    end, prefixes = raw.end(), _RAW_PREFIXES
            literals.append((_prefix_start(data, start, prefixes, floor), end, kind))
        floor = end
        m = search(data, end)
    return literals, comments


def _paint(
    cls: np.ndarray, spans: list[tuple[int, int]] | list[tuple[int, int, int]], value: int
) -> None:
    for span in spans:
        cls[span[0] : span[1]] = value


def _paint_sorted(cls: np.ndarray, spans: np.ndarray, value: int) -> None:
    """Paint disjoint sorted ``[k, 2]`` spans with numpy (many short spans)."""
    edges = np.zeros(cls.shape[0] + 1, dtype=np.int8)
    edges[spans[:, 0]] = 1
    edges[spans[:, 1]] -= 1
    cls[np.cumsum(edges[:-1], dtype=np.int8) > 0] = value


def _number_candidates(byte: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """Phase 2 candidates (sorted positions); numpy work only on the digit positions."""
    digit = np.flatnonzero((byte - np.uint8(0x30)) < 10)  # wraps: only "0".."9" are < 10
    digit = digit[cls[digit] == _WORD]
    prev = digit - 1
    prev_cls = np.where(prev >= 0, cls[prev], _SPACE)
    digit = digit[prev_cls != _WORD]  # a digit after an identifier char is inside a word
    dot = digit - 1
    is_dot = (dot >= 0) & (byte[dot] == 0x2E) & (cls[dot] == _OP)
    before = dot - 1
    before_ok = before < 0
    safe = np.maximum(before, 0)
    before_cls = cls[safe]
    before_dot = (byte[safe] == 0x2E) & (before_cls == _OP)
    before_ok |= (before_cls != _WORD) & ~before_dot
    return np.where(is_dot & before_ok, dot, digit)


def _number_spans(byte: np.ndarray, cls: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Phase 2 extents, ``[num_numbers, 2]`` (start, end): what the pp-number regex
    ``\\.?[0-9](?:[eEpP][+-]|'[W]|[W.])*`` (W: identifier bytes) matches from each
    candidate once literals and comments are blanked out, computed without a Python loop.

    A byte extends a number that reaches it when it is an identifier byte or ``.``, a ``'``
    followed by an identifier byte, or a sign after ``e E p P`` (unless that letter was
    taken by a ``'``: ``1'e+5`` is ``1'e``). Those rules only look at neighbours, so a number
    ends at the first non-extending byte after its start; candidates inside an earlier
    number end at the same byte and are dropped.
    """
    if candidates.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    n = byte.shape[0]
    plain = (cls == _WORD) | (cls == _OP) | (cls == _OTHER)  # not in a literal or comment
    word = np.append(cls == _WORD, False)  # [n + 1]
    padded = np.concatenate((np.zeros(2, dtype=np.uint8), byte))
    prev, prev2 = padded[1:-1], padded[:-2]  # [n] the byte before, and the one before that
    extends = word[:-1] | (byte == 0x2E)
    extends |= (byte == 0x27) & word[1:]
    extends |= ((byte == 0x2B) | (byte == 0x2D)) & _IS_EXPONENT[prev] & (prev2 != 0x27)
    extends &= plain
    stops = np.append(np.flatnonzero(~extends), n)  # sorted, n as a sentinel
    ends = stops[np.searchsorted(stops, candidates, side="right")]
    first = np.concatenate(([True], ends[1:] != ends[:-1]))
    return np.stack((candidates[first], ends[first]), axis=1)


def _operator_lengths(byte: np.ndarray, pos: np.ndarray, run_end: np.ndarray) -> np.ndarray:
    """The longest operator starting at each ``pos`` without leaving its run (1..3)."""
    room = run_end - pos  # >= 1
    pair = (byte[pos].astype(np.int64) << 8) | byte[np.minimum(pos + 1, run_end - 1)]
    third = byte[np.minimum(pos + 2, run_end - 1)]
    is3 = (room >= 3) & (_OP3_THIRD[pair] == third)
    is2 = (room >= 2) & _OP2[pair]
    return np.where(is3, 3, np.where(is2, 2, 1))


def _munch_operators(
    byte: np.ndarray, run_start: np.ndarray, run_end: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Maximal munch over runs of operator bytes: ``(starts, ends)`` of operator tokens.

    Single-byte runs (most of them) are tokens as they are. For longer runs the operator
    length at every byte is computed at once; then all runs are walked together, one numpy
    step per token of the longest run.
    """
    single = run_end - run_start == 1
    starts, ends = [run_start[single]], [run_end[single]]
    multi_start, multi_end = run_start[~single], run_end[~single]
    if multi_start.size:
        sizes = multi_end - multi_start
        first = np.cumsum(sizes) - sizes  # index of each run's first byte in ``pos``
        pos = np.arange(int(sizes.sum())) + np.repeat(multi_start - first, sizes)  # sorted
        op_len = _operator_lengths(byte, pos, np.repeat(multi_end, sizes))
        cursor, index, limit = multi_start, first, multi_end
        while cursor.size:
            nxt = cursor + op_len[index]
            starts.append(cursor)
            ends.append(nxt)
            more = nxt < limit
            index = (index + (nxt - cursor))[more]
            cursor, limit = nxt[more], limit[more]
    return np.concatenate(starts), np.concatenate(ends)


def _class_runs(cls: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of equal class: ``(starts, ends, classes)``, each ``[num_runs]``."""
    boundary = np.flatnonzero(cls[1:] != cls[:-1]) + 1
    starts = np.concatenate(([0], boundary))
    ends = np.concatenate((boundary, [cls.shape[0]]))
    return starts, ends, cls[starts]


class BatchSpans(NamedTuple):
    """Tokens of several sources lexed together (one pass of numpy calls for all of them).

    ``data`` is the sources joined with ``b"\\n"`` (a separator no token crosses); ``spans``
    are offsets into it; source ``i`` starts at byte ``source_starts[i]`` and owns tokens
    ``token_offsets[i]:token_offsets[i + 1]``.
    """

    data: bytes
    spans: TokenSpans
    source_starts: np.ndarray  # int64 [num_sources]
    token_offsets: np.ndarray  # int64 [num_sources + 1]


def _literal_spans_of_sources(
    sources: Sequence[bytes], source_starts: list[int]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Phase 1 source by source (an unterminated comment or literal must stop at its own
    source's end), shifted to offsets in the joined data."""
    literals: list[tuple[int, int, int]] = []
    comments: list[tuple[int, int]] = []
    for source, base in zip(sources, source_starts):
        source_literals, source_comments = _literal_spans(source)
        literals += [(s + base, e + base, k) for s, e, k in source_literals]
        comments += [(s + base, e + base) for s, e in source_comments]
    return literals, comments


def token_spans_batch(sources: Sequence[bytes]) -> BatchSpans:
    """Lex several UTF-8 C++ sources at once; see :class:`BatchSpans`."""
    data = b"\n".join(sources)
    lengths = np.array([len(s) + 1 for s in sources], dtype=np.int64)
    source_starts = np.cumsum(lengths) - lengths  # [num_sources]
    spans = _lex(data, *_literal_spans_of_sources(sources, source_starts.tolist()))
    token_offsets = np.searchsorted(spans.starts, np.append(source_starts, len(data) + 1))
    return BatchSpans(data, spans, source_starts, token_offsets.astype(np.int64))


def token_spans(data: bytes) -> TokenSpans:
    """Lex UTF-8 C++ source bytes into token spans (comments and whitespace skipped)."""
    return _lex(data, *_literal_spans(data))


def _lex(
    data: bytes, literals: list[tuple[int, int, int]], comments: list[tuple[int, int]]
) -> TokenSpans:
    """Phases 2 and 3 over ``data`` whose literals and comments are known."""
    if not data:
        empty = np.zeros(0, dtype=np.int64)
        return TokenSpans(empty, empty, np.zeros(0, dtype=np.uint8))
    byte = np.frombuffer(data, dtype=np.uint8)
    # bytes.translate is several times faster than a numpy gather with uint8 indices
    cls = np.frombuffer(bytearray(data.translate(_CLASS_TABLE)), dtype=np.uint8)  # [n], painted
    _paint(cls, comments, _SPACE)
    _paint(cls, literals, _SPAN)
    num = _number_spans(byte, cls, _number_candidates(byte, cls))  # [num_numbers, 2]
    _paint_sorted(cls, num, _SPAN)

    run_start, run_end, run_cls = _class_runs(cls)
    words = run_cls == _WORD
    op_start, op_end = _munch_operators(byte, run_start[run_cls == _OP], run_end[run_cls == _OP])
    other = np.flatnonzero(cls == _OTHER) if (run_cls == _OTHER).any() else run_start[:0]
    lit = np.array(literals, dtype=np.int64).reshape(-1, 3)
    parts = (  # (starts, ends, kind); each part is one or a few runs sorted by start
        (run_start[words], run_end[words], TokenKind.IDENTIFIER),
        (op_start, op_end, TokenKind.OPERATOR),
        (other, other + 1, TokenKind.OTHER),
        (num[:, 0], num[:, 1], TokenKind.NUMBER),
        (lit[:, 0], lit[:, 1], lit[:, 2]),
    )
    starts = np.concatenate([part[0] for part in parts])
    ends = np.concatenate([part[1] for part in parts])
    fixed_kinds = np.repeat(
        np.array([part[2] for part in parts[:-1]], dtype=np.uint8),
        [part[0].shape[0] for part in parts[:-1]],
    )
    kinds = np.concatenate((fixed_kinds, lit[:, 2].astype(np.uint8)))
    order = np.argsort(starts, kind="stable")  # timsort merges the sorted runs quickly
    return TokenSpans(starts[order], ends[order], kinds[order])


def tokens(text: str) -> list[str]:
    """The token strings of ``text`` (a convenience over :func:`token_spans`)."""
    data = text.encode("utf-8", "surrogatepass")
    spans = token_spans(data)
    return [
        data[s:e].decode("utf-8", "surrogatepass")
        for s, e in zip(spans.starts.tolist(), spans.ends.tolist())
    ]
