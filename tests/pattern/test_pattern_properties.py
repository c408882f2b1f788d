"""Property tests: any text parses or raises PatternError; round-trips; an oracle agrees."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from megacpp.pattern import PatternError, format_plan, parse

GRAMMAR_ALPHABET = "AEMRDXNaemx()|: \t\n0123456789gqamlsdio_;*-"
LABELS = ["A", "A:gqa", "A:mla", "A:dsa", "E", "M", "M:siso", "M:mimo", "R", "D"]
FULL_LABEL = {"A": "A:gqa", "M": "M:siso"}

fast = settings(deadline=None, max_examples=150)


def assert_round_trips(text: str) -> None:
    """parse(format(parse(s))) == parse(s); canonical is idempotent; compressed parses back."""
    plan = parse(text)
    canonical = format_plan(plan)
    assert parse(canonical) == plan
    assert format_plan(parse(canonical)) == canonical
    assert not any(ch.isspace() for ch in canonical) and "(" not in canonical
    assert ":gqa" not in canonical and ":siso" not in canonical
    assert parse(format_plan(plan, compress=True)) == plan


@fast
@given(st.text(alphabet=GRAMMAR_ALPHABET, max_size=40) | st.text(max_size=40))
def test_any_text_parses_or_raises_pattern_error(text):
    try:
        parse(text)
    except PatternError as exc:
        assert "\n" not in str(exc)
        assert 0 <= exc.position <= len(text)
        return
    assert_round_trips(text)


# --- generated valid-looking patterns with an independent expansion oracle -----------------


@dataclass(frozen=True)
class Generated:
    text: str
    events: tuple[str, ...]  # expanded labels and "|" in order
    has_empty_group: bool = False  # some "( )" holds no layer (only "|")


def _leaf() -> st.SearchStrategy[Generated]:
    """A layer token, or (1 time in 11) a stage separator."""
    return st.sampled_from([*LABELS, "|"]).map(lambda t: Generated(t, (FULL_LABEL.get(t, t),)))


def _sequence(children: st.SearchStrategy[Generated]) -> st.SearchStrategy[Generated]:
    return st.lists(children, min_size=1, max_size=4).flatmap(
        lambda items: st.lists(
            st.sampled_from(["", " ", "\t", "\n "]), min_size=len(items), max_size=len(items)
        ).map(
            lambda spaces: Generated(
                "".join(s + item.text for s, item in zip(spaces, items)),
                tuple(e for item in items for e in item.events),
                any(item.has_empty_group for item in items),
            )
        )
    )


def _group(children: st.SearchStrategy[Generated]) -> st.SearchStrategy[Generated]:
    def build(body: Generated, count: int, times: str) -> Generated:
        no_layer = all(event == "|" for event in body.events)
        return Generated(
            f"({body.text}){times}{count}", body.events * count, body.has_empty_group or no_layer
        )

    return st.builds(
        build, _sequence(children), st.integers(1, 3), st.sampled_from(["x", "X", " x "])
    )


patterns = _sequence(st.recursive(_leaf(), lambda kids: _group(kids) | kids, max_leaves=12))


def oracle_stages(events: tuple[str, ...]) -> list[list[str]] | None:
    """Labels per stage, or None when a stage (or a group) would be empty."""
    stages: list[list[str]] = [[]]
    for event in events:
        if event == "|":
            stages.append([])
        else:
            stages[-1].append(event)
    return None if any(not stage for stage in stages) else stages


@fast
@given(patterns)
def test_generated_patterns_agree_with_the_oracle(generated):
    expected = None if generated.has_empty_group else oracle_stages(generated.events)
    try:
        plan = parse(generated.text)
    except PatternError:
        assert expected is None
        return
    assert expected is not None
    assert [[layer.label for layer in stage] for stage in plan.stages] == expected
    assert [layer.index for layer in plan.layers] == list(range(plan.num_layers))
    assert_round_trips(generated.text)
