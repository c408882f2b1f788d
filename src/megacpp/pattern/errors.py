"""Errors of the pattern language: every one is a :class:`PatternError` (a ``MegaCppError``).

* :class:`PatternSyntaxError` -- the text does not parse; names the 0-based character offset
  into the original string, the offending text and what would be accepted there.
* :class:`UnbuildableLayerError` -- the plan parses but names a variant the model builder
  cannot build yet (``require_buildable``).
* :class:`TranslationError` -- a layer has no verified mapping in a translation target.

Messages are one line (the CLI prints them as ``error: <message>``).
"""

from __future__ import annotations

from megacpp.errors import MegaCppError


class PatternError(MegaCppError):
    """Any user-caused problem with a hybrid pattern or a plan built from one."""


class PatternSyntaxError(PatternError):
    """The pattern text is malformed at ``position`` (0-based offset into ``pattern``).

    ``text`` is the offending snippet (may be empty at end of input) and ``allowed`` says
    what the grammar would accept there.
    """

    def __init__(
        self, problem: str, *, pattern: str, position: int, text: str, allowed: str
    ) -> None:
        self.problem = problem
        self.pattern = pattern
        self.position = position
        self.text = text
        self.allowed = allowed
        super().__init__(f"{problem} at {position} in {pattern!r}; {allowed}")


class UnbuildableLayerError(PatternError):
    """A layer's family/variant parses but has no implementation yet."""

    def __init__(self, message: str, *, index: int, label: str) -> None:
        self.index = index
        self.label = label
        super().__init__(message)


class TranslationError(PatternError):
    """A layer (or the stage split) has no verified mapping in the requested target."""

    def __init__(self, message: str, *, index: int | None = None, label: str | None = None):
        self.index = index
        self.label = label
        super().__init__(message)
