"""License detection (SPDX ids) and the license policy step.

:func:`detect_license` looks at the first :data:`SCAN_CHARS` characters of a file:

1. ``SPDX-License-Identifier:`` tags: their expressions are parsed (``AND``/``OR``/
   ``WITH``, parentheses), deprecated ids are canonicalized (``GPL-2.0+`` ->
   ``GPL-2.0-or-later``) and several distinct tags are joined with ``AND``.
2. License header texts are recognized (and added unless a tag already names the
   license) on a normalized copy (lower case, every
   run of non-alphanumerics one space, so comment decoration and line breaks do not
   matter): GPL/LGPL/AGPL with version and "-only"/"-or-later", the GCC Runtime Library
   Exception, Apache-2.0 (+ LLVM exception), MIT, BSD-2/3/4-Clause, BSL-1.0, MPL-2.0, ISC,
   HPND(-sell-variant), Zlib, Unlicense, CC0-1.0, EPL, public-domain dedications and
   proprietary notices. A file carrying several notices (libstdc++'s ``vector``: GPL with
   the runtime exception, plus HP's and SGI's permission notices) gets all of them, in
   order of appearance, joined with ``AND`` (each part's terms apply), or with ``OR`` when
   the header offers a choice ("either of the following licenses", "dual licensed").
3. Nothing recognized: ``"unknown"``. A malformed tag is ignored (the prose still counts).

Policy (:func:`license_verdict`): an id matches a list entry case-insensitively, and entries
may be globs (``GPL-*``). A ``X WITH E`` unit matches an entry naming ``X WITH E`` or ``X``.
A unit is denied when it matches the deny list and allowed when it is not denied and the
allow list is empty or matches it. ``A AND B`` needs every part allowed (all terms apply);
``A OR B`` needs one allowed alternative (the licensee picks).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass

from megacpp.data.document import Document
from megacpp.data.pipeline import Drop, StageStats, Step, require_text

UNKNOWN = "unknown"
SCAN_CHARS = 4096  # headers sit at the top; 8 KiB finds 4 more of 14.7k real headers

# SPDX ids we canonicalize by case (matching is case-insensitive per the SPDX spec).
KNOWN_IDS = (
    "0BSD", "AGPL-3.0-only", "AGPL-3.0-or-later", "Apache-1.1", "Apache-2.0", "Artistic-2.0",
    "BSD-1-Clause", "BSD-2-Clause", "BSD-3-Clause", "BSD-4-Clause", "BSL-1.0", "CC0-1.0",
    "CC-BY-4.0", "curl", "EPL-1.0", "EPL-2.0", "GPL-1.0-only", "GPL-1.0-or-later",
    "GPL-2.0-only", "GPL-2.0-or-later", "GPL-3.0-only", "GPL-3.0-or-later", "HPND",
    "HPND-sell-variant", "ISC", "LGPL-2.0-only", "LGPL-2.0-or-later", "LGPL-2.1-only",
    "LGPL-2.1-or-later", "LGPL-3.0-only", "LGPL-3.0-or-later", "MIT", "MIT-0", "MPL-1.1",
    "MPL-2.0", "NCSA", "OpenSSL", "Python-2.0", "Unicode-DFS-2016", "Unlicense", "WTFPL",
    "X11", "Zlib", "LicenseRef-Proprietary", "LicenseRef-Public-Domain",
    # exceptions (right-hand side of WITH)
    "GCC-exception-2.0", "GCC-exception-3.1", "LLVM-exception", "Linux-syscall-note",
    "Classpath-exception-2.0", "Autoconf-exception-3.0", "Bison-exception-2.2",
    "Qt-LGPL-exception-1.1", "OpenJDK-assembly-exception-1.0",
)  # fmt: skip
_CANONICAL = {i.lower(): i for i in KNOWN_IDS}
# Deprecated GNU ids (bare and "+") -> current ones.
for _family in ("GPL-1.0", "GPL-2.0", "GPL-3.0", "LGPL-2.0", "LGPL-2.1", "LGPL-3.0", "AGPL-3.0"):
    _CANONICAL[_family.lower()] = f"{_family}-only"
    _CANONICAL[f"{_family.lower()}+"] = f"{_family}-or-later"


class LicenseExpressionError(ValueError):
    """A malformed SPDX license expression."""


# --- SPDX expressions ----------------------------------------------------------------------


@dataclass(frozen=True)
class LicenseUnit:
    """One license, optionally ``WITH`` an exception."""

    license: str
    exception: str | None = None

    def __str__(self) -> str:
        return f"{self.license} WITH {self.exception}" if self.exception else self.license


@dataclass(frozen=True)
class Compound:
    """``AND`` (all parts apply) or ``OR`` (choose one part) of sub-expressions."""

    op: str  # "AND" | "OR"
    parts: tuple[LicenseExpr, ...]

    def __str__(self) -> str:
        return f" {self.op} ".join(
            f"({part})" if isinstance(part, Compound) and part.op != self.op else str(part)
            for part in self.parts
        )


LicenseExpr = LicenseUnit | Compound

_EXPR_TOKEN = re.compile(r"\s*(\(|\)|[A-Za-z0-9][A-Za-z0-9.\-:]*\+?)")
_OPERATORS = ("AND", "OR", "WITH")


def canonical_id(spdx_id: str) -> str:
    """Canonical spelling of an SPDX id (known ids by case, deprecated GNU ids mapped)."""
    return _CANONICAL.get(spdx_id.lower(), spdx_id)


def _lex_expression(text: str) -> list[str]:
    tokens, pos, text = [], 0, text.strip()
    while pos < len(text):
        m = _EXPR_TOKEN.match(text, pos)
        if m is None:
            raise LicenseExpressionError(f"unexpected {text[pos:].strip()[:20]!r} in {text!r}")
        token = m.group(1)
        tokens.append(token.upper() if token.upper() in _OPERATORS else token)
        pos = m.end()
    return tokens


class _Parser:
    """Recursive descent, SPDX precedence: WITH > AND > OR."""

    def __init__(self, tokens: list[str], text: str) -> None:
        self.tokens, self.pos, self.text = tokens, 0, text

    def parse(self) -> LicenseExpr:
        expr = self._binary("OR")
        if self.pos != len(self.tokens):
            raise self._error(f"unexpected {self.tokens[self.pos]!r}")
        return expr

    def _error(self, what: str) -> LicenseExpressionError:
        return LicenseExpressionError(f"{what} in SPDX expression {self.text!r}")

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise self._error("unexpected end")
        self.pos += 1
        return token

    def _binary(self, op: str) -> LicenseExpr:
        sub = (lambda: self._binary("AND")) if op == "OR" else self._primary
        parts = [sub()]
        while self._peek() == op:
            self.pos += 1
            parts.append(sub())
        return parts[0] if len(parts) == 1 else Compound(op, tuple(parts))

    def _primary(self) -> LicenseExpr:
        token = self._take()
        if token == "(":
            expr = self._binary("OR")
            if self._take() != ")":
                raise self._error("missing ')'")
            return expr
        if token in _OPERATORS or token == ")":
            raise self._error(f"expected a license id, got {token!r}")
        unit = LicenseUnit(canonical_id(token))
        if self._peek() == "WITH":
            self.pos += 1
            exception = self._take()
            if exception in _OPERATORS or exception in "()":
                raise self._error(f"expected an exception id after WITH, got {exception!r}")
            unit = LicenseUnit(unit.license, canonical_id(exception))
        return unit


def parse_spdx(text: str) -> LicenseExpr:
    """Parse an SPDX license expression; raises :class:`LicenseExpressionError`."""
    tokens = _lex_expression(text)
    if not tokens:
        raise LicenseExpressionError("empty SPDX expression")
    return _Parser(tokens, text).parse()


# --- detection -----------------------------------------------------------------------------

_SPDX_TAG = re.compile(r"SPDX-License-Identifier:[ \t]*([^\n\r]*)")
_TAG_TAIL = re.compile(r"\s*(?:\*/|-->|\*|#|;|\"|')*\s*$")


# Lower-case ASCII letters and digits survive normalization; every other byte is a space.
_NORMALIZE = bytes(
    c + 32 if 65 <= c <= 90 else c if 97 <= c <= 122 or 48 <= c <= 57 else 32 for c in range(256)
)


def _normalize(text: str) -> bytes:
    """Lower case, every run of non-alphanumerics one space, padded with spaces (so phrases
    match at word boundaries). Works on bytes: translate/split/join run at C speed."""
    words = text.encode("utf-8", "surrogatepass").translate(_NORMALIZE).split()
    return b" " + b" ".join(words) + b" "


def _spdx_tags(head: str) -> list[LicenseExpr]:
    exprs = []
    for m in _SPDX_TAG.finditer(head):
        try:
            exprs.append(parse_spdx(_TAG_TAIL.sub("", m.group(1))))
        except LicenseExpressionError:
            continue  # a malformed tag says nothing we can trust; fall back to the text
    return exprs


@dataclass(frozen=True)
class _Phrases:
    """Alternative literal phrases, matched on normalized text with ``bytes.find``."""

    phrases: tuple[bytes, ...]

    def find(self, text: bytes) -> int:
        """Position of the earliest phrase, or -1."""
        hits = [pos for pos in map(text.find, self.phrases) if pos >= 0]
        return min(hits) if hits else -1


def _phrase(*phrases: str) -> _Phrases:
    return _Phrases(tuple(_normalize(p) for p in phrases))


_GNU = re.compile(rb" gnu (lesser |library |affero )?general public licen[cs]e ")
_GNU_VERSION = re.compile(rb" version (\d)(?: (\d))? ")
_LATER = _phrase("any later version", "or later", "or any later")
_GCC_RUNTIME = _phrase("gcc runtime library exception")
_SIMPLE_RULES: tuple[tuple[str, _Phrases], ...] = (
    ("Apache-2.0", _phrase("apache license version 2.0", "apache license, v2.0",
                           "apache license 2.0", "www.apache.org/licenses/license-2.0")),
    ("MIT", _phrase("permission is hereby granted, free of charge, to any person obtaining",
                    "licensed under the mit license", "released under the mit license")),
    ("BSL-1.0", _phrase("boost software license", "boost.org/license_1_0.txt")),
    ("MPL-2.0", _phrase("mozilla public license, v. 2.0", "mozilla public license version 2.0",
                        "mozilla.org/mpl/2.0")),
    ("ISC", _phrase("permission to use, copy, modify, and/or distribute this software for any "
                    "purpose with or without fee is hereby granted")),
    ("HPND-sell-variant", _phrase("permission to use, copy, modify, distribute and sell this "
                                  "software", "permission to use, copy, modify, distribute, "
                                  "and sell this software")),
    ("HPND", _phrase("permission to use, copy, modify, and distribute this software and its "
                     "documentation for any purpose and without fee is hereby granted")),
    ("Zlib", _phrase("permission is granted to anyone to use this software for any purpose, "
                     "including commercial applications, and to alter it and redistribute it "
                     "freely")),
    ("Unlicense", _phrase("this is free and unencumbered software released into the public "
                          "domain")),
    ("CC0-1.0", _phrase("cc0 1.0", "creativecommons.org/publicdomain/zero/1.0")),
    ("EPL-2.0", _phrase("eclipse public license v. 2.0", "eclipse public license version 2.0",
                        "eclipse public license - v 2.0")),
    ("EPL-1.0", _phrase("eclipse public license v1.0", "eclipse public license version 1.0",
                        "eclipse public license - v 1.0")),
)  # fmt: skip
_BSD = _phrase("redistribution and use in source and binary forms, with or without "
               "modification, are permitted")  # fmt: skip
_BSD_ADVERTISING = _phrase("all advertising materials mentioning features")
_BSD_ENDORSE = _phrase("neither the name", "endorse or promote products derived")
_LLVM_EXCEPTION = _phrase("with llvm exceptions", "llvm exception")
_DUAL = _phrase("either of the following", "dual licensed", "dual-licensed",
                "licensed under either", "at your choice")  # fmt: skip
_PUBLIC_DOMAIN = _phrase("placed in the public domain", "released into the public domain",
                         "dedicated to the public domain", "is in the public domain",
                         "placed into the public domain")  # fmt: skip
_PROPRIETARY = _phrase("proprietary and confidential", "confidential and proprietary",
                       "unauthorized copying of this file", "strictly confidential",
                       "this file is proprietary")  # fmt: skip


_GNU_FAMILY = {b"lesser ": "LGPL", b"library ": "LGPL", b"affero ": "AGPL", b"": "GPL"}
# The version a GNU header implies when it names none ("any version" of the license).
_GNU_DEFAULT_VERSION = {b"lesser ": "2.1", b"library ": "2.0", b"affero ": "3.0", b"": "1.0"}


def _gnu_licenses(text: bytes) -> list[tuple[int, LicenseExpr]]:
    """GPL/LGPL/AGPL mentions with version and -only/-or-later, one per family."""
    found: dict[str, tuple[int, LicenseExpr]] = {}
    for m in _GNU.finditer(text):
        variant = m.group(1) or b""
        family = _GNU_FAMILY[variant]
        if family in found:
            continue
        window = text[m.end() - 1 : m.end() + 300]
        version = _GNU_VERSION.search(window)
        if version is None:
            number, later = _GNU_DEFAULT_VERSION[variant], True
        else:
            number = f"{version.group(1).decode()}.{(version.group(2) or b'0').decode()}"
            later = _LATER.find(window) >= 0
        unit = LicenseUnit(canonical_id(f"{family}-{number}{'+' if later else ''}"))
        if family == "GPL" and _GCC_RUNTIME.find(text) >= 0:
            unit = LicenseUnit(unit.license, "GCC-exception-3.1")
        found[family] = (m.start(), unit)
    return list(found.values())


def _text_licenses(text: bytes) -> list[LicenseExpr]:
    """Licenses recognized from normalized header prose, in order of first appearance."""
    hits: list[tuple[int, LicenseExpr]] = _gnu_licenses(text)
    for spdx_id, phrases in _SIMPLE_RULES:
        pos = phrases.find(text)
        if pos < 0:
            continue
        unit = LicenseUnit(spdx_id)
        if spdx_id == "Apache-2.0" and _LLVM_EXCEPTION.find(text) >= 0:
            unit = LicenseUnit(spdx_id, "LLVM-exception")
        hits.append((pos, unit))
    bsd = _BSD.find(text)
    if bsd >= 0:
        clauses = (
            "4"
            if _BSD_ADVERTISING.find(text) >= 0
            else "3"
            if _BSD_ENDORSE.find(text) >= 0
            else "2"
        )
        hits.append((bsd, LicenseUnit(f"BSD-{clauses}-Clause")))
    if not hits:  # weaker signals, only when no license text was found
        for spdx_id, phrases in (("LicenseRef-Public-Domain", _PUBLIC_DOMAIN),
                                 ("LicenseRef-Proprietary", _PROPRIETARY)):  # fmt: skip
            pos = phrases.find(text)
            if pos >= 0:
                hits.append((pos, LicenseUnit(spdx_id)))
    return [expr for _, expr in sorted(hits, key=lambda hit: hit[0])]


def _license_ids(expr: LicenseExpr) -> set[str]:
    if isinstance(expr, LicenseUnit):
        return {expr.license}
    return set().union(*(_license_ids(part) for part in expr.parts))


def detect_license(text: str) -> str:
    """SPDX expression for the license of a source file, or ``"unknown"``.

    SPDX tags come first; licenses recognized from header prose are added (``AND``) unless a
    tag already names them, so a quoted third-party notice (libstdc++'s ``barrier`` carries
    LLVM's tag under its own GPL header) is not lost. Several prose notices are joined with
    ``AND``, or with ``OR`` when the header offers a choice ("either of the following").
    """
    head = text[:SCAN_CHARS]
    tagged = _spdx_tags(head)
    normalized = _normalize(head)
    named = set().union(*(_license_ids(expr) for expr in tagged)) if tagged else set()
    prose = [unit for unit in _text_licenses(normalized) if _license_ids(unit).isdisjoint(named)]
    if len(prose) > 1 and _DUAL.find(normalized) >= 0:
        prose = [Compound("OR", tuple(dict.fromkeys(prose)))]
    found = list(dict.fromkeys([*tagged, *prose]))
    if not found:
        return UNKNOWN
    return str(found[0] if len(found) == 1 else Compound("AND", tuple(found)))


# --- policy --------------------------------------------------------------------------------


def _matches(unit: LicenseUnit, patterns: Sequence[str]) -> bool:
    names = (str(unit).lower(), unit.license.lower())
    return any(fnmatch.fnmatchcase(name, pattern.lower()) for pattern in patterns for name in names)


def _allowed(expr: LicenseExpr, allow: Sequence[str], deny: Sequence[str]) -> bool:
    if isinstance(expr, LicenseUnit):
        return not _matches(expr, deny) and (not allow or _matches(expr, allow))
    results = (_allowed(part, allow, deny) for part in expr.parts)
    return all(results) if expr.op == "AND" else any(results)


def license_verdict(expression: str, allow: Sequence[str], deny: Sequence[str]) -> str | None:
    """``None`` if the SPDX ``expression`` passes the policy, else the drop reason:
    ``license_denied`` (a required part is on the deny list) or ``license_not_allowed``
    (the allow list does not cover it). ``"unknown"`` is not an expression: callers decide.
    """
    expr = parse_spdx(expression)
    if not _allowed(expr, (), deny):
        return "license_denied"
    if not _allowed(expr, allow, deny):
        return "license_not_allowed"
    return None


class LicenseStep(Step):
    """Records ``doc.license`` and applies the policy. Drop reasons: ``license_denied``,
    ``license_not_allowed``, ``unknown_license`` (when ``keep_unknown`` is false). Notes
    count every license expression seen (``license=<expr>``) for the manifest's mix.

    The license is the one the source declares (``meta["declared_license"]``: a table
    row's license column, :mod:`megacpp.data.tables`), else the one detected in the text."""

    name = "license"

    def __init__(
        self, allow: Sequence[str] = (), deny: Sequence[str] = (), keep_unknown: bool = True
    ) -> None:
        self.allow, self.deny, self.keep_unknown = tuple(allow), tuple(deny), keep_unknown
        self._verdicts: dict[str, str | None] = {}  # expression -> license_verdict (a corpus
        # has a handful of distinct expressions; parsing and matching each once is enough)

    def process(self, doc: Document, stats: StageStats) -> Document | Drop:
        text = require_text(doc, self.name)
        doc.license = doc.meta.get("declared_license") or detect_license(text)
        stats.notes[f"license={doc.license}"] += 1
        if doc.license == UNKNOWN:
            return doc if self.keep_unknown else Drop("unknown_license")
        if doc.license not in self._verdicts:
            self._verdicts[doc.license] = license_verdict(doc.license, self.allow, self.deny)
        reason = self._verdicts[doc.license]
        return doc if reason is None else Drop(reason)
