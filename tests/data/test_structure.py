"""Structure ids from tree-sitter: region labels, innermost wins, token mapping by byte
offsets, parse errors and timeouts fall back without dropping anything."""

from __future__ import annotations

import numpy as np
import pytest
import tree_sitter

from megacpp.data.structure import (
    _CAPTURES,
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


# ---- the painter against a brute-force reference ------------------------------------------

HOSTILE_CPP = [
    b"",
    b"   \n\t\r\n",
    b"namespace a { namespace b { struct S { void f() { auto l = [](int x) { return x; }; } }; } }",
    b"int f( { ))) ; } /* unterminated comment",
    b'const char* s = "unterminated string\n#define X 1\n',
    b"auto r = R\"delim(raw ) \" string)delim\"; char c = '\\'';",
    b"#if A\n#ifdef B\nint x;\n#elif C\n#else\n#endif\n#endif\n#if\n",
    b"template <typename T, template <class> class U, int N = sizeof(T)> struct X {};",
    b"class C : public B { public: C() : x(1) {} ~C(); int x; };;;}}}{{{",
    b"#define M(a, b) a ## b \\\n  continued\nM(int, x) = 0;",
    b"\x00\xff\xfe garbage \xc3\x28 bytes { [ ( \x80",
    b"void g() try { throw 1; } catch (...) { } // \xe2\x98\x83",
    b'extern "C" { int h(void); }\nint (*fp)(int) = nullptr;',
    b"struct { int a; } anon; union U { int i; float f; };" * 20,
    # nested regions that start at the same byte (#if condition 'a' == 'b' and its 'a'), and
    # equal spans with two ids (#elif condition 'c' is PREPROCESSOR and STRING: STRING wins)
    b"#if 'a' == 'b'\nint x;\n#elif 'c'\n#endif\n",
]


def reference_byte_labels(labeler: StructureLabeler, source: bytes) -> tuple[np.ndarray, str]:
    """The labelling rule by brute force: each byte takes the id of the shortest captured
    region containing it, ties (equal spans) going to the larger id."""
    labels = np.zeros(len(source), dtype=np.uint8)
    tree = labeler._parse(source)
    if tree is None:
        return labels, PARSE_TIMEOUT
    best = np.full(len(source), np.iinfo(np.int64).max, dtype=np.int64)
    captures = tree_sitter.QueryCursor(labeler._query).captures(tree.root_node)
    for name, nodes in captures.items():
        for node in nodes:
            start, end, sid = node.start_byte, node.end_byte, int(_CAPTURES[name])
            span_best, span_labels = best[start:end], labels[start:end]
            wins = (end - start < span_best) | ((end - start == span_best) & (sid > span_labels))
            span_best[wins], span_labels[wins] = end - start, sid
    return labels, PARSE_ERRORS if tree.root_node.has_error else PARSE_OK


@pytest.mark.parametrize("source", HOSTILE_CPP, ids=range(len(HOSTILE_CPP)))
def test_painter_equals_reference_on_hostile_cpp(labeler, source):
    labels, outcome = labeler.byte_labels(source)
    expected, expected_outcome = reference_byte_labels(labeler, source)
    assert outcome == expected_outcome
    assert labels.dtype == np.uint8 and np.array_equal(labels, expected)


def test_same_start_and_equal_span_regions(labeler):
    src = HOSTILE_CPP[-1]
    labels, _ = labeler.byte_labels(src)
    assert label_set(labels, src, "'a'") == {S.STRING}  # inside the condition: innermost
    assert label_set(labels, src, "== 'b'") == {S.PREPROCESSOR, S.STRING}
    assert label_set(labels, src, "'c'") == {S.STRING}  # tie: the larger id


def test_painter_equals_reference_on_real_headers(labeler):
    texts = real_texts() + list(SYNTHETIC.values())
    for text in texts:
        source = text.encode()
        labels, outcome = labeler.byte_labels(source)
        expected, expected_outcome = reference_byte_labels(labeler, source)
        assert outcome == expected_outcome
        assert np.array_equal(labels, expected)
    assert len(texts) > 5
