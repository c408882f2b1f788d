"""The shingling lexer: token kinds on crafted C++, and the vectorized lexer against a plain
sequential implementation of the same grammar (real headers + random byte soups)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megacpp.data import cpp_lex
from megacpp.data.cpp_lex import TokenKind

K = TokenKind


def lex(text: str) -> list[tuple[str, TokenKind]]:
    data = text.encode()
    spans = cpp_lex.token_spans(data)
    return [
        (data[s:e].decode(), TokenKind(k))
        for s, e, k in zip(spans.starts.tolist(), spans.ends.tolist(), spans.kinds.tolist())
    ]


# ------------------------------------------------------------------ the reference lexer

# The pp-number grammar, as the regex the vectorized phase 2 must agree with.
_NUMBER_RE = re.compile(rb"\.?[0-9](?:[eEpP][+-]|'[A-Za-z0-9_$\x80-\xff]|[A-Za-z0-9_$\x80-\xff.])*")
_OPS = sorted((op.encode() for op in cpp_lex.OPERATORS), key=len, reverse=True)
_WORD = set(cpp_lex._WORD_CHARS)
_OP_CHARS = set(cpp_lex._OP_CHARS)
_SPACE = set(cpp_lex._SPACE_CHARS)


def reference_lex(data: bytes) -> list[tuple[int, int, int]]:
    """The module docstring's grammar, one byte at a time. Phase 1 (the literal/comment
    regex scan) is shared: it is not what the vectorization changes."""
    literals, comments = cpp_lex._literal_spans(data)
    literal_at = {s: (e, k) for s, e, k in literals}
    comment_at = dict(comments)
    blocked = set(literal_at) | set(comment_at)  # plain runs stop where a span starts
    blanked = bytearray(data)  # numbers are matched with literals and comments blanked out
    for start, end in [(s, e) for s, e, _ in literals] + comments:
        blanked[start:end] = b" " * (end - start)
    out: list[tuple[int, int, int]] = []
    i, prev_word, prev_plain_dot = 0, False, False
    while i < len(data):
        if i in comment_at:
            i, prev_word, prev_plain_dot = comment_at[i], False, False
            continue
        if i in literal_at:
            end, kind = literal_at[i]
            out.append((i, end, int(kind)))
            i, prev_word, prev_plain_dot = end, False, False
            continue
        c = data[i]
        if c in _SPACE:
            i, prev_word, prev_plain_dot = i + 1, False, False
            continue
        next_is_digit = i + 1 < len(data) and 48 <= data[i + 1] <= 57 and i + 1 not in blocked
        if (48 <= c <= 57 and not prev_word) or (
            c == 0x2E and next_is_digit and not prev_word and not prev_plain_dot
        ):
            end = _NUMBER_RE.match(blanked, i).end()
            out.append((i, end, int(K.NUMBER)))
            i, prev_word, prev_plain_dot = end, False, False
            continue
        if c in _WORD:
            j = i
            while j < len(data) and data[j] in _WORD and j not in blocked:
                j += 1
            out.append((i, j, int(K.IDENTIFIER)))
            i, prev_word, prev_plain_dot = j, True, False
            continue
        if c in _OP_CHARS:
            run_end = i
            while run_end < len(data) and data[run_end] in _OP_CHARS and run_end not in blocked:
                run_end += 1
            op = next(op for op in _OPS if data.startswith(op, i) and i + len(op) <= run_end)
            out.append((i, i + len(op), int(K.OPERATOR)))
            i, prev_word, prev_plain_dot = i + len(op), False, op == b"."
            continue
        out.append((i, i + 1, int(K.OTHER)))
        i, prev_word, prev_plain_dot = i + 1, False, False
    return out


def fast_lex(data: bytes) -> list[tuple[int, int, int]]:
    spans = cpp_lex.token_spans(data)
    return list(zip(spans.starts.tolist(), spans.ends.tolist(), spans.kinds.tolist()))


# ------------------------------------------------------------------ token kinds


def test_identifiers_keywords_numbers_operators():
    assert lex("int x1 = a->b + .5e-3f * 0x1'FFu;") == [
        ("int", K.IDENTIFIER), ("x1", K.IDENTIFIER), ("=", K.OPERATOR), ("a", K.IDENTIFIER),
        ("->", K.OPERATOR), ("b", K.IDENTIFIER), ("+", K.OPERATOR), (".5e-3f", K.NUMBER),
        ("*", K.OPERATOR), ("0x1'FFu", K.NUMBER), (";", K.OPERATOR),
    ]  # fmt: skip


def test_maximal_munch_operators():
    assert [t for t, _ in lex("a<<=b>>=c<=>d->*e...f::g&&h")] == [
        "a", "<<=", "b", ">>=", "c", "<=>", "d", "->*", "e", "...", "f", "::", "g", "&&", "h",
    ]  # fmt: skip
    assert [t for t, _ in lex("x<<<=y")] == ["x", "<<", "<=", "y"]
    assert [t for t, _ in lex("v<vector<int>>")] == ["v", "<", "vector", "<", "int", ">>"]


def test_comments_and_whitespace_are_skipped():
    text = "a /* b \n c */ d // e \\\n continued\n f /* unterminated"
    assert [t for t, _ in lex(text)] == ["a", "d", "f"]


def test_string_and_char_literals_with_prefixes_and_suffixes():
    text = r"""s = u8"a\"b//c" L'x' "t"sv R"d(raw "quoted" )" )d" '\'' uR"(z)";"""
    assert lex(text) == [
        ("s", K.IDENTIFIER), ("=", K.OPERATOR), (r'u8"a\"b//c"', K.STRING), ("L'x'", K.CHAR),
        ('"t"sv', K.STRING), ('R"d(raw "quoted" )" )d"', K.STRING), (r"'\''", K.CHAR),
        ('uR"(z)"', K.STRING), (";", K.OPERATOR),
    ]  # fmt: skip


def test_apostrophe_after_identifier_is_not_a_char_literal():
    # "#error don't" in real headers must not swallow the rest of the line as a literal
    assert [t for t, _ in lex("#error don't do it\nint x;")] == [
        "#", "error", "don", "'", "t", "do", "it", "int", "x", ";",
    ]  # fmt: skip


def test_non_ascii_identifiers_and_other_bytes():
    assert lex("größe @ \\") == [("größe", K.IDENTIFIER), ("@", K.OTHER), ("\\", K.OTHER)]


def test_empty_and_comment_only_sources_have_no_tokens():
    assert len(cpp_lex.token_spans(b"")) == 0
    assert len(cpp_lex.token_spans(b"// only\n/* comments */ \n")) == 0


def test_tokens_convenience_round_trips_text():
    assert cpp_lex.tokens("std::vector<int> v{1, 2};") == [
        "std", "::", "vector", "<", "int", ">", "v", "{", "1", ",", "2", "}", ";",
    ]  # fmt: skip


def test_batch_lexing_equals_lexing_each_source(real_headers):
    hostile = [b"", b"int a = 1; /* unterminated", b'"open string\nx', b"'", b'R"(raw', b"y.5"]
    sources = hostile[:4] + [p.read_bytes() for p in real_headers[:3]] + hostile[4:]
    batch = cpp_lex.token_spans_batch(sources)
    for i, source in enumerate(sources):
        first, last = batch.token_offsets[i], batch.token_offsets[i + 1]
        base = batch.source_starts[i]
        got = [
            (s - base, e - base, k)
            for s, e, k in zip(
                batch.spans.starts[first:last].tolist(),
                batch.spans.ends[first:last].tolist(),
                batch.spans.kinds[first:last].tolist(),
            )
        ]
        assert got == fast_lex(source), i


# ------------------------------------------------------------------ vs the reference


def test_matches_reference_on_real_headers(real_headers: list[Path]):
    for path in real_headers:
        data = path.read_bytes()
        assert fast_lex(data) == reference_lex(data), path


_ALPHABET = list(b"ab1_$ \n.'\"/*\\+-<=>:uUL8Rxe()#&|%!?") + [0xC3, 0xA9, 0]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_ALPHABET), max_size=60).map(bytes))
def test_matches_reference_on_byte_soup(data: bytes):
    assert fast_lex(data) == reference_lex(data)


CORNER_CASES = [
    b"...5", b"..5", b"x.5", b"1...", b"1.'a'", b'1e+u8"x"', b'")+.+1_\\\').R"u"e"',
    b"a/**/=", b"'", b"''", b"u8'a'", b'R"(x',
]  # fmt: skip


@pytest.mark.parametrize("snippet", CORNER_CASES)
def test_matches_reference_on_corner_cases(snippet: bytes):
    assert fast_lex(snippet) == reference_lex(snippet)
