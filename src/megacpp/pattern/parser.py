"""Recursive-descent parser for the hybrid pattern language (grammar in docs/pattern.md).

::

    pattern = item { item }                      (* at least one layer overall *)
    item    = layer | group | "|"
    layer   = LETTER [ ":" VARIANT ]             (* LETTER in A E M R D *)
    group   = "(" item { item } ")" ("x" | "X") COUNT
    COUNT   = digit { digit }                    (* 1 .. 4096 *)

Whitespace between tokens is ignored; it cannot split a token. Every error is a
:class:`~megacpp.pattern.errors.PatternSyntaxError` naming the 0-based character offset in
the original string.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from megacpp.pattern.errors import PatternSyntaxError
from megacpp.pattern.plan import MAX_LAYERS, LayerPlan, LayerSpec
from megacpp.pattern.registry import FAMILIES, LETTERS

MAX_DEPTH = 16  # deepest nesting of ( ) groups

_DIGITS = "0123456789"
_LETTER_LIST = ", ".join(LETTERS)
_EXPECTED_ITEM = f"expected a layer letter ({_LETTER_LIST}), '(', ')' or '|'"
_LETTER_HINTS = {
    "X": " ('X' only repeats a group: (AE)X3)",
    **{letter.lower(): " (letters are upper-case)" for letter in LETTERS},
}


@dataclass(frozen=True, slots=True)
class _Layer:
    pos: int
    family: str
    variant: str | None

    num_layers = 1
    num_breaks = 0


@dataclass(frozen=True, slots=True)
class _Break:
    pos: int

    num_layers = 0
    num_breaks = 1


@dataclass(frozen=True, slots=True)
class _Group:
    pos: int
    items: tuple[_Layer | _Break | _Group, ...]
    count: int
    num_layers: int
    num_breaks: int


_Node = _Layer | _Break | _Group


def parse(text: str) -> LayerPlan:
    """Parse pattern ``text`` into a validated, immutable :class:`LayerPlan`.

    Raises :class:`PatternSyntaxError` (a ``PatternError``) for any malformed input.
    """
    if not isinstance(text, str):
        raise TypeError(f"pattern must be a str, got {type(text).__name__}")
    parser = _Parser(text)
    return _build_plan(text, parser.parse())


class _Parser:
    """Character-level recursive descent; ``pos`` is an offset into the original text."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.depth = 0

    def error(self, problem: str, position: int, text: str, allowed: str) -> PatternSyntaxError:
        return PatternSyntaxError(
            problem, pattern=self.text, position=position, text=text, allowed=allowed
        )

    def peek(self) -> str:
        """The next non-whitespace character ('' at the end); leaves ``pos`` on it."""
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def parse(self) -> tuple[_Node, ...]:
        if not self.text.strip():
            raise self.error(
                "empty pattern", 0, "", f"expected at least one layer letter: {_LETTER_LIST}"
            )
        return self.sequence(open_pos=None)

    def sequence(self, open_pos: int | None) -> tuple[_Node, ...]:
        """Items up to the end of input (top level) or up to the ``)`` of an open group."""
        items: list[_Node] = []
        num_layers = num_breaks = 0
        while True:
            ch = self.peek()
            if ch == "" and open_pos is not None:
                raise self.error(
                    "unclosed '('", open_pos, "(", "expected ')' and a count, e.g. (AEME)x3"
                )
            if ch == ")" and open_pos is None:
                raise self.error("unmatched ')'", self.pos, ")", "no '(' is open here")
            if ch in ("", ")"):
                return tuple(items)
            item = self.item()
            num_layers += item.num_layers
            num_breaks += item.num_breaks
            self.check_size(num_layers, num_breaks, item.pos)
            items.append(item)

    def item(self) -> _Node:
        ch = self.peek()
        if ch == "|":
            self.pos += 1
            return _Break(self.pos - 1)
        if ch == "(":
            return self.group()
        if ch in FAMILIES:
            return self.layer()
        if ch == "x":
            raise self.error(
                "repetition 'x' must follow a ')' group",
                self.pos,
                ch,
                "to repeat layers write a group, e.g. (AE)x3",
            )
        if ch.isalpha():
            hint = _LETTER_HINTS.get(ch, "")
            raise self.error(
                f"unknown layer letter {ch!r}", self.pos, ch, f"allowed: {_LETTER_LIST}{hint}"
            )
        raise self.error(f"unexpected character {ch!r}", self.pos, ch, _EXPECTED_ITEM)

    def layer(self) -> _Layer:
        start = self.pos
        family = FAMILIES[self.text[start]]
        self.pos += 1
        if self.peek() != ":":
            return _Layer(start, family.letter, family.default_variant)
        self.pos += 1
        self.peek()
        name_start = self.pos
        while self.pos < len(self.text) and _is_variant_char(self.text[self.pos]):
            self.pos += 1
        name = self.text[name_start : self.pos]
        written = self.text[start : self.pos]
        if not family.variants:
            raise self.error(
                f"layer {family.letter!r} takes no variant, got {written!r}",
                start,
                written,
                f"write plain {family.letter!r}; only A and M have variants",
            )
        allowed = f"allowed variants for {family.letter}: " + ", ".join(
            v.name for v in family.variants
        )
        if not name:
            raise self.error(
                f"missing variant after '{family.letter}:'",
                name_start,
                self.text[name_start : name_start + 1],
                allowed + " (lower-case)",
            )
        if family.variant(name) is None:
            raise self.error(f"unknown variant '{family.letter}:{name}'", start, written, allowed)
        return _Layer(start, family.letter, name)

    def group(self) -> _Group:
        open_pos = self.pos
        if self.depth >= MAX_DEPTH:
            raise self.error(
                f"groups nested deeper than {MAX_DEPTH}", open_pos, "(", "flatten the nesting"
            )
        self.pos += 1
        self.depth += 1
        items = self.sequence(open_pos)
        self.depth -= 1
        self.pos += 1  # the ')'
        inner_layers = sum(item.num_layers for item in items)
        if inner_layers == 0:
            written = self.text[open_pos : self.pos]
            raise self.error(f"group {written!r} has no layers", open_pos, written, "e.g. (AE)x2")
        count = self.count(close_pos=self.pos - 1)
        inner_breaks = sum(item.num_breaks for item in items)
        self.check_size(inner_layers * count, inner_breaks * count, open_pos)
        return _Group(open_pos, items, count, inner_layers * count, inner_breaks * count)

    def count(self, close_pos: int) -> int:
        """The ``xN`` after a group's ``)``: N must be an integer in 1..MAX_LAYERS."""
        ch = self.peek()
        if ch not in ("x", "X"):
            raise self.error(
                "missing repetition after ')'",
                close_pos,
                ")",
                "write ')x<count>' with a positive integer count, e.g. (AEME)x3",
            )
        x_pos = self.pos
        self.pos += 1
        self.peek()
        digits_start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _DIGITS:
            self.pos += 1
        digits = self.text[digits_start : self.pos]
        written = self.text[x_pos : self.pos]
        if not digits:
            raise self.error(
                f"missing count after {ch!r}",
                digits_start,
                self.text[digits_start : digits_start + 1],
                "expected a positive integer, e.g. x3",
            )
        significant = digits.lstrip("0")
        if len(significant) > len(str(MAX_LAYERS)) or int(significant or "0") > MAX_LAYERS:
            raise self.error(
                f"repetition count {written!r} is too large",
                x_pos,
                written,
                f"counts go from 1 to {MAX_LAYERS}",
            )
        if not significant:
            raise self.error(
                f"repetition count {written!r} is not a positive integer",
                x_pos,
                written,
                f"counts go from 1 to {MAX_LAYERS}",
            )
        return int(significant)

    def check_size(self, num_layers: int, num_breaks: int, position: int) -> None:
        if num_layers > MAX_LAYERS:
            raise self.error(
                f"pattern expands to more than {MAX_LAYERS} layers",
                position,
                self.text[position : position + 1],
                f"at most {MAX_LAYERS} layers are allowed",
            )
        if num_breaks >= MAX_LAYERS:
            raise self.error(
                f"pattern expands to more than {MAX_LAYERS} pipeline stages",
                position,
                self.text[position : position + 1],
                "each stage needs at least one layer",
            )


def _is_variant_char(ch: str) -> bool:
    return ch.isascii() and (ch.islower() or ch.isdigit() or ch == "_")


def _expand(nodes: tuple[_Node, ...]) -> Iterator[_Layer | _Break]:
    for node in nodes:
        if isinstance(node, _Group):
            for _ in range(node.count):
                yield from _expand(node.items)
        else:
            yield node


def _build_plan(text: str, nodes: tuple[_Node, ...]) -> LayerPlan:
    """Expand groups, split at ``|`` into stages; every stage must hold a layer."""
    layers: list[LayerSpec] = []
    stage = stage_len = 0
    last_break = 0
    for node in _expand(nodes):
        if isinstance(node, _Break):
            if stage_len == 0:
                raise _empty_stage(text, node.pos)
            stage, stage_len, last_break = stage + 1, 0, node.pos
            continue
        layers.append(LayerSpec(len(layers), node.family, node.variant, stage))
        stage_len += 1
    if stage_len == 0:
        raise _empty_stage(text, last_break)
    return LayerPlan(tuple(layers))


def _empty_stage(text: str, position: int) -> PatternSyntaxError:
    return PatternSyntaxError(
        "empty pipeline stage",
        pattern=text,
        position=position,
        text="|",
        allowed="each '|' must separate two non-empty stages",
    )
