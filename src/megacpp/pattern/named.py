"""Named patterns: short names (matched case-insensitively) for well-known stacks."""

from __future__ import annotations

import re

from megacpp.pattern.errors import PatternSyntaxError
from megacpp.pattern.parser import parse
from megacpp.pattern.plan import LayerPlan

# name (upper-case) -> pattern text. A name must never itself parse as a pattern.
NAMED_PATTERNS: dict[str, str] = {
    # The flagship 56-sublayer hybrid: A14 E23 M14 R5 (see docs/pattern.md).
    "NAM56R": "(AEMEAEMEAEMR)x4 AEMEAEMR",
}

_NAME_LIKE = re.compile(r"[A-Za-z0-9_-]*[0-9][A-Za-z0-9_-]*")


def resolve(name_or_pattern: str) -> str:
    """The pattern text for a known name (case-insensitive, surrounding space ignored);
    any other input is returned unchanged."""
    return NAMED_PATTERNS.get(name_or_pattern.strip().upper(), name_or_pattern)


def load(name_or_pattern: str) -> LayerPlan:
    """Parse a pattern or a known pattern name.

    When the text fails to parse and looks like a name (letters, ``_``, ``-`` and at least
    one digit, like ``NAM56R``), the error also lists the known names.
    """
    text = resolve(name_or_pattern)
    try:
        return parse(text)
    except PatternSyntaxError as exc:
        if text is name_or_pattern and _NAME_LIKE.fullmatch(text.strip()):
            raise PatternSyntaxError(
                exc.problem,
                pattern=exc.pattern,
                position=exc.position,
                text=exc.text,
                allowed=f"{exc.allowed}; it is not a known pattern name either "
                f"(known: {', '.join(NAMED_PATTERNS)})",
            ) from None
        raise
