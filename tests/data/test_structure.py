"""Structure ids from tree-sitter: region labels, innermost wins, token mapping by byte
offsets, parse errors and timeouts fall back without dropping anything."""

from __future__ import annotations

import numpy as np
import pytest

from megacpp.data.structure import (
    PARSE_ERRORS,
    PARSE_OK,
    PARSE_TIMEOUT,
    Structure,
    StructureLabeler,
    token_ends,
)
from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from tests.data.packed_fixtures import LIBSTDCXX, SYNTHETIC, real_texts

S = Structure
WIDGET = SYNTHETIC["src/widget.cpp"].encode("utf-8")


@pytest.fixture(scope="module")
def labeler() -> StructureLabeler:
    return StructureLabeler()


@pytest.fixture(scope="module")
def widget_labels(labeler) -> np.ndarray:
    labels, outcome = labeler.byte_labels(WIDGET)
    assert outcome == PARSE_OK
    return labels


def label_set(labels: np.ndarray, source: bytes, snippet: str) -> set[Structure]:
    """Labels of the non-space bytes of the first occurrence of ``snippet``."""
    raw = snippet.encode("utf-8")
    start = source.index(raw)
    return {S(int(labels[start + i])) for i, b in enumerate(raw) if not chr(b).isspace()}


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("// Widget implementation.", S.COMMENT),
        ("/* Render a widget. */", S.COMMENT),
        ("#include", S.PREPROCESSOR),
        ("<string>", S.STRING),
        ('"widget.h"', S.STRING),
        ("namespace ui {", S.NAMESPACE),
        ("<typename T, int N = 3>", S.TEMPLATE_PARAMS),
        ("T items[N];", S.CLASS_BODY),
        ("int size() const", S.FUNCTION_SIGNATURE),
        ("return N;", S.FUNCTION_BODY),
        ("std::string render(const Widget& w, int depth)", S.FUNCTION_SIGNATURE),
        ("auto label =", S.FUNCTION_BODY),
        ("return std::string(d,", S.FUNCTION_BODY),
        ("std::string(d, ' ')", {S.FUNCTION_BODY, S.STRING}),
        ('R"(raw "string" \\n)"', S.STRING),
        ("'\\''", S.STRING),
        ('"é ✓"', S.STRING),
        ("}  // namespace ui", {S.NAMESPACE, S.COMMENT}),
    ],
)
def test_regions_innermost_wins(widget_labels, snippet, expected):
    expected = expected if isinstance(expected, set) else {expected}
    assert label_set(widget_labels, WIDGET, snippet) == expected


def test_conditional_directives_label_only_their_lines(labeler):
    src = SYNTHETIC["include/widget.h"].encode()
    labels, outcome = labeler.byte_labels(src)
    assert outcome == PARSE_OK
    assert label_set(labels, src, "#ifndef WIDGET_H") == {S.PREPROCESSOR}
    assert label_set(labels, src, "#endif") == {S.PREPROCESSOR}
    assert label_set(labels, src, "std::string name;") == {S.CLASS_BODY}  # inside the #ifndef
    assert label_set(labels, src, "virtual int area() const;") == {S.FUNCTION_SIGNATURE}


def test_token_labels_use_each_tokens_last_byte(labeler):
    tok = CppTokenizer.from_hf(train_tokenizer(list(SYNTHETIC.values()), 400))
    ids = tok.encode(WIDGET.decode())
    ends = token_ends(ids, tok.token_nbytes)
    assert ends[-1] == len(WIDGET)
    by_token, outcome = labeler.token_labels(WIDGET, ends)
    byte_labels, _ = labeler.byte_labels(WIDGET)
    assert outcome == PARSE_OK
    assert by_token.dtype == np.uint8 and len(by_token) == len(ids)
    assert np.array_equal(by_token, byte_labels[ends - 1])
    pieces = [tok.decode([i]) for i in ids]
    assert by_token[pieces.index("//")] == S.COMMENT


def test_syntax_errors_still_label(labeler):
    src = b"namespace a { int f( { ))) ; } // broken\n"
    labels, outcome = labeler.byte_labels(src)
    assert outcome == PARSE_ERRORS
    assert len(labels) == len(src)
    assert label_set(labels, src, "// broken") == {S.COMMENT}


def test_timeout_falls_back_to_other():
    src = (LIBSTDCXX / "bits/stl_pair.h").read_bytes() if LIBSTDCXX.is_dir() else WIDGET * 50
    labels, outcome = StructureLabeler(timeout_s=1e-6).byte_labels(src)
    assert outcome == PARSE_TIMEOUT
    assert len(labels) == len(src) and not labels.any()


def test_empty_document(labeler):
    labels, outcome = labeler.token_labels(b"", np.zeros(0, dtype=np.int64))
    assert len(labels) == 0 and outcome == PARSE_OK


def test_real_headers_get_comment_and_code_regions(labeler):
    for text in real_texts()[:4]:
        labels, outcome = labeler.byte_labels(text.encode())
        assert outcome in (PARSE_OK, PARSE_ERRORS)
        assert labels[0] == S.COMMENT  # the GPL header comment
        present = set(np.unique(labels).tolist())
        assert {S.COMMENT, S.PREPROCESSOR} <= present
