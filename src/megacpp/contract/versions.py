"""Version strings as tuples of ints, so that "12.10" sorts after "12.9".

Only the leading dotted numbers count: ``"2.13.0+cu130"`` -> ``(2, 13, 0)``,
``"V13.0.88"`` -> ``(13, 0, 88)``. Anything without a leading number is ``None``.
"""

from __future__ import annotations

import re

_LEADING_VERSION = re.compile(r"\s*[vV]?(\d+(?:\.\d+)*)")


def version_tuple(text: str | None, parts: int | None = None) -> tuple[int, ...] | None:
    """Parse the leading ``N.N.N`` of ``text``; ``parts`` keeps only the first few numbers."""
    if not text:
        return None
    match = _LEADING_VERSION.match(str(text))
    if match is None:
        return None
    numbers = tuple(int(p) for p in match.group(1).split("."))
    return numbers[:parts] if parts is not None else numbers


def version_at_least(text: str | None, minimum: str) -> bool | None:
    """``text >= minimum`` on their numeric parts; ``None`` when ``text`` is not a version."""
    have = version_tuple(text)
    need = version_tuple(minimum)
    if have is None or need is None:
        return None
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))


def short_version(text: str | None, parts: int) -> str | None:
    """``short_version("12.8.93", 2) == "12.8"``; ``None`` when ``text`` is not a version."""
    numbers = version_tuple(text, parts)
    return ".".join(str(n) for n in numbers) if numbers else None
