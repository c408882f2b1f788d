"""Turn a :class:`~megacpp.pattern.plan.LayerPlan` back into pattern text.

The canonical form (``compress=False``) is the plan fully expanded: one token per layer,
no whitespace, no groups, default variants omitted (``A`` not ``A:gqa``), non-default
variants kept (``A:mla``), stages joined by ``|``. It is unique per plan, so
``parse(format_plan(p)) == p`` and ``format_plan(parse(format_plan(p))) == format_plan(p)``.

``compress=True`` gives a shorter *equivalent* text that uses ``(...)xN`` groups within each
stage (greedy, never longer than the canonical form); it parses back to the same plan but is
not canonical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megacpp.pattern.plan import LayerPlan

_MAX_PERIOD = 64  # longest repeated unit the compressor looks for (keeps it O(n * 64))


def format_plan(plan: LayerPlan, *, compress: bool = False) -> str:
    """Pattern text for ``plan``: canonical by default, or compressed with ``(...)xN``."""
    render = _compress if compress else "".join
    return "|".join(render([layer.token for layer in stage]) for stage in plan.stages)


def _compress(tokens: list[str]) -> str:
    """Greedy left-to-right: at each point take the repeated run that saves most text."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        best = _best_run(tokens, i)
        if best is None:
            out.append(tokens[i])
            i += 1
            continue
        unit_text, period, count = best
        out.append(f"({unit_text})x{count}")
        i += period * count
    return "".join(out)


def _best_run(tokens: list[str], start: int) -> tuple[str, int, int] | None:
    """The (unit text, period, count) starting at ``start`` that shortens the text most."""
    best: tuple[int, str, int, int] | None = None  # (saving, unit_text, period, count)
    max_period = min(_MAX_PERIOD, (len(tokens) - start) // 2)
    for period in range(1, max_period + 1):
        unit = tokens[start : start + period]
        count = _repeats(tokens, start, unit)
        if count < 2:
            continue
        unit_text = _compress(unit)
        plain_len = count * sum(len(t) for t in unit)
        saving = plain_len - len(f"({unit_text})x{count}")
        if saving > 0 and (best is None or saving > best[0]):
            best = (saving, unit_text, period, count)
    return None if best is None else best[1:]


def _repeats(tokens: list[str], start: int, unit: list[str]) -> int:
    """How many times ``unit`` occurs back to back from ``start``."""
    period = len(unit)
    count = 1
    while tokens[start + count * period : start + (count + 1) * period] == unit:
        count += 1
    return count
