"""Every syntax error names the 0-based offset, the offending text and what is allowed."""

from __future__ import annotations

import pytest

from megacpp.errors import MegaCppError
from megacpp.pattern import MAX_DEPTH, MAX_LAYERS, PatternError, PatternSyntaxError, load, parse

# (pattern, position, offending text, problem, allowed-part)
CATALOG = [
    ("", 0, "", "empty pattern", "expected at least one layer letter: A, E, M, R, D"),
    ("  \t", 0, "", "empty pattern", "expected at least one layer letter"),
    ("AEMEX", 4, "X", "unknown layer letter 'X'", "allowed: A, E, M, R, D"),
    ("AQ", 1, "Q", "unknown layer letter 'Q'", "allowed: A, E, M, R, D"),
    ("aem", 0, "a", "unknown layer letter 'a'", "(letters are upper-case)"),
    ("A;E", 1, ";", "unexpected character ';'", "expected a layer letter (A, E, M, R, D)"),
    ("A:foo", 0, "A:foo", "unknown variant 'A:foo'", "allowed variants for A: gqa, mla, dsa"),
    ("EM:siso M:miso", 8, "M:miso", "unknown variant 'M:miso'", "for M: siso, mimo"),
    ("A:", 2, "", "missing variant after 'A:'", "allowed variants for A: gqa, mla, dsa"),
    ("A:GQA", 2, "G", "missing variant after 'A:'", "(lower-case)"),
    ("E:default", 0, "E:default", "layer 'E' takes no variant", "write plain 'E'"),
    ("AR:x", 1, "R:x", "layer 'R' takes no variant", "only A and M have variants"),
    ("D :", 0, "D :", "layer 'D' takes no variant", "write plain 'D'"),
    ("(AE", 0, "(", "unclosed '('", "expected ')' and a count"),
    ("((AE)x2", 0, "(", "unclosed '('", "e.g. (AEME)x3"),
    ("AE)", 2, ")", "unmatched ')'", "no '(' is open here"),
    ("(A)x2)", 5, ")", "unmatched ')'", "no '(' is open here"),
    ("(AE)", 3, ")", "missing repetition after ')'", "write ')x<count>'"),
    ("(AE)M", 3, ")", "missing repetition after ')'", "positive integer count"),
    ("(AE)x", 5, "", "missing count after 'x'", "expected a positive integer"),
    ("(AE)X-1", 5, "-", "missing count after 'X'", "expected a positive integer"),
    ("(AE)x0", 4, "x0", "repetition count 'x0' is not a positive integer", "from 1 to 4096"),
    ("(AE)x000", 4, "x000", "is not a positive integer", "from 1 to 4096"),
    ("(A)x4097", 3, "x4097", "repetition count 'x4097' is too large", "from 1 to 4096"),
    ("(A)x" + "9" * 5000, 3, "x" + "9" * 5000, "is too large", "from 1 to 4096"),
    ("Ax3", 1, "x", "repetition 'x' must follow a ')' group", "e.g. (AE)x3"),
    ("AX3", 1, "X", "unknown layer letter 'X'", "'X' only repeats a group"),
    ("()x3", 0, "()", "group '()' has no layers", "e.g. (AE)x2"),
    ("A(|)x2", 1, "(|)", "group '(|)' has no layers", "e.g. (AE)x2"),
    ("|A", 0, "|", "empty pipeline stage", "each '|' must separate two non-empty stages"),
    ("A|", 1, "|", "empty pipeline stage", "non-empty stages"),
    ("A| |E", 3, "|", "empty pipeline stage", "non-empty stages"),
    ("(A|)x2", 2, "|", "empty pipeline stage", "non-empty stages"),
    (f"(A)x{MAX_LAYERS} E", 9, "E", "expands to more than 4096 layers", "at most 4096"),
    ("((AE)x64)x33", 0, "(", "expands to more than 4096 layers", "at most 4096"),
    ("A" + "(A|)x4096", 1, "(", "more than 4096 pipeline stages", "needs at least one layer"),
    (
        "(" * (MAX_DEPTH + 1) + "A" + ")x1" * (MAX_DEPTH + 1),
        MAX_DEPTH,
        "(",
        f"groups nested deeper than {MAX_DEPTH}",
        "flatten the nesting",
    ),
]


@pytest.mark.parametrize("pattern,position,text,problem,allowed", CATALOG)
def test_error_catalog(pattern, position, text, problem, allowed):
    with pytest.raises(PatternSyntaxError) as info:
        parse(pattern)
    exc = info.value
    assert (exc.position, exc.text) == (position, text)
    assert problem in exc.problem
    assert allowed in exc.allowed
    message = str(exc)
    assert f" at {position} in " in message
    assert "\n" not in message
    assert isinstance(exc, PatternError) and isinstance(exc, MegaCppError)
    assert exc.exit_code == 2


def test_message_is_one_line_even_when_the_pattern_has_newlines():
    with pytest.raises(PatternError) as info:
        parse("AE\nMQ")
    assert info.value.position == 4
    assert "\n" not in str(info.value)
    assert "'AE\\nMQ'" in str(info.value)


def test_position_counts_characters_of_the_original_string_including_whitespace():
    with pytest.raises(PatternError) as info:
        parse("  A  E   Z")
    assert info.value.position == 9


def test_unknown_name_like_input_lists_known_names():
    with pytest.raises(
        PatternSyntaxError, match=r"not a known pattern name either \(known: NAM56R\)"
    ):
        load("NAM57R")
    with pytest.raises(PatternSyntaxError) as info:
        load("AEMQ")
    assert "known pattern name" not in str(info.value)


def test_non_string_is_a_programming_error():
    with pytest.raises(TypeError):
        parse(None)  # type: ignore[arg-type]
