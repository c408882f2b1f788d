"""The one exception family the CLI turns into a clean one-line error.

Library code raises a subclass of :class:`MegaCppError` for anything a user can cause
(bad pattern, bad config, corrupt shard, drifted environment...). The CLI catches it,
prints ``error: <message>`` and exits with ``exit_code`` -- never a traceback.
Programming errors (bugs) stay ordinary exceptions and do show a traceback.
"""

from __future__ import annotations


class MegaCppError(Exception):
    """A user-facing error: the message names the thing and what would be accepted."""

    exit_code: int = 2

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(MegaCppError):
    """An invalid configuration value: names the field and the allowed values."""


def describe_error(exc: BaseException) -> str:
    """The exception's type and the first line of its message: how a caught failure is named
    in one line (a graph capture's, a kernel check's)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
