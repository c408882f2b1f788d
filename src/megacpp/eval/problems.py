"""C++ problem sets: load them in the common layouts and assemble each program.

A problem file is JSON Lines, plain (``.jsonl``) or gzip-compressed (``.jsonl.gz``), one
problem per line, in one of three layouts (:data:`LAYOUTS`), detected from the fields or
named (``--format``):

* ``humanevalx`` -- HumanEval-X (``task_id``, ``prompt``, ``canonical_solution``, ``test``,
  with ``declaration`` / ``example_test``);
* ``multipl-e`` -- MultiPL-E (``name``, ``prompt``, ``tests``, ``stop_tokens``; no
  reference solution);
* ``mbxp`` -- MBXP / mxeval (``task_id``, ``prompt``, ``canonical_solution`` (may be null),
  ``test``, with ``entry_point``).

A program is ``prompt + completion + "\\n" + test``, the completion first cut at the
problem's first stop token (MultiPL-E: ``"\\n}"``; its tests start with the ``}`` that
closes the function). It passes when it compiles and exits with status 0. How it is
compiled comes from the suite config (:mod:`megacpp.eval.suite`).

The file is found, in order: an explicit path (``--problems``), ``$MEGACPP_EVAL_DATA``,
then the HumanEval-X C++ copy shipped in the package
(``megacpp/eval/data/humaneval-x-cpp.jsonl.gz``, licence and provenance beside it).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from megacpp._io import MiB, decode_utf8, describe_size, parse_json, read_bounded
from megacpp.errors import MegaCppError
from megacpp.eval.cpp import BuildOptions, CppVerifier
from megacpp.eval.suite import (
    HUMANEVALX_SUITE,
    LAYOUT_SUITES,
    SuiteConfig,
    find_suite_config,
)

DATA_ENV = "MEGACPP_EVAL_DATA"
DATA_NAME = "humaneval-x-cpp.jsonl.gz"
DECOMPRESSED_LIMIT = 256 * MiB
SUFFIXES = (".jsonl", ".jsonl.gz")
CPP_LANGUAGES = ("cpp", "c++")


class ProblemSetError(MegaCppError):
    """The problem file is missing, unreadable or malformed."""


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    canonical_solution: str | None  # None: the set gives no reference solution
    test: str
    declaration: str = ""
    example_test: str = ""
    stop_tokens: tuple[str, ...] = ()

    @property
    def has_reference(self) -> bool:
        return self.canonical_solution is not None

    def cut(self, completion: str) -> str:
        """The completion up to (not including) its first stop token."""
        ends = [i for i in (completion.find(stop) for stop in self.stop_tokens) if i >= 0]
        return completion[:min(ends)] if ends else completion

    def program(self, completion: str) -> str:
        """The full program: prompt, the completion (cut at a stop token), the hidden tests."""
        return f"{self.prompt}{self.cut(completion)}\n{self.test}"

    @property
    def reference_program(self) -> str:
        if self.canonical_solution is None:
            raise ProblemSetError(f"{self.task_id} has no reference solution")
        return self.program(self.canonical_solution)


@dataclass(frozen=True)
class Layout:
    """Where a layout keeps each part of a problem, and the fields that identify it."""

    name: str
    id_field: str
    test_field: str
    markers: tuple[str, ...]  # any one of them (with the required fields) identifies it
    reference: bool  # canonical_solution is read (a string, or null/absent for none)
    stop_tokens: bool = False  # a required stop_tokens list

    @property
    def required(self) -> tuple[str, ...]:
        extra = ("stop_tokens",) if self.stop_tokens else ()
        return (self.id_field, "prompt", self.test_field, *extra)

    def describe(self) -> str:
        optional = " (canonical_solution optional)" if self.reference else ""
        return f"{self.name} needs {', '.join(self.required)}{optional}"


LAYOUTS = {
    "humanevalx": Layout("humanevalx", "task_id", "test", ("declaration", "example_test"), True),
    "multipl-e": Layout("multipl-e", "name", "tests", ("stop_tokens",), False, stop_tokens=True),
    "mbxp": Layout("mbxp", "task_id", "test", ("entry_point", "description"), True),
}


@dataclass(frozen=True)
class ProblemSet:
    """The problems of one file, its layout and the suite config its programs build with."""

    path: Path
    layout: str
    problems: list[Problem]
    suite: SuiteConfig

    @property
    def without_reference(self) -> int:
        return sum(not problem.has_reference for problem in self.problems)


def default_problems_path() -> Path:
    """The shipped ``megacpp/eval/data/humaneval-x-cpp.jsonl.gz`` (package data)."""
    return Path(str(resources.files("megacpp.eval") / "data" / DATA_NAME))


def locate_problems(path: str | os.PathLike[str] | None = None) -> Path:
    """The problem file to use: ``path``, else ``$MEGACPP_EVAL_DATA``, else the default."""
    if path is not None:
        candidate, source = Path(path), "--problems"
    elif os.environ.get(DATA_ENV):
        candidate, source = Path(os.environ[DATA_ENV]), f"${DATA_ENV}"
    else:
        candidate, source = default_problems_path(), "the default location"
    if not candidate.is_file():
        raise ProblemSetError(
            f"problem file not found at {candidate} (from {source}); pass --problems PATH "
            f"(.jsonl or .jsonl.gz) or set {DATA_ENV}; the default is the shipped "
            f"{DATA_NAME} (see megacpp/eval/data/README.md)"
        )
    return candidate


def load_problem_set(path: str | os.PathLike[str] | None = None, *, layout: str | None = None,
                     suite_config: str | os.PathLike[str] | None = None) -> ProblemSet:
    """The problems of the file, its layout (``layout``, else the suite config's ``format``,
    else detected) and its suite config (``suite_config``, else the sidecar, else the
    layout's defaults)."""
    located = locate_problems(path)
    suite = find_suite_config(located, suite_config)
    if layout is not None and layout not in LAYOUTS:
        raise ProblemSetError(f"unknown problem format {layout!r}; accepted: "
                              f"{', '.join(LAYOUTS)}")
    chosen = layout or (suite.format if suite is not None else None)
    records = list(_records(located))
    if not records:
        raise ProblemSetError(f"{located} holds no problems")
    if chosen is None:
        chosen = detect_layout(records[0][1], f"{located}:{records[0][0]}")
    problems = [_parse(LAYOUTS[chosen], record, f"{located}:{line_no}")
                for line_no, record in records]
    seen: set[str] = set()
    for problem in problems:
        if problem.task_id in seen:
            raise ProblemSetError(f"{located}: task_id {problem.task_id} appears twice")
        seen.add(problem.task_id)
    return ProblemSet(located, chosen, problems, suite or LAYOUT_SUITES[chosen])


def load_problems(path: str | os.PathLike[str] | None = None, *,
                  layout: str | None = None) -> list[Problem]:
    """All problems of the file, in file order; malformed input raises :class:`ProblemSetError`."""
    return load_problem_set(path, layout=layout).problems


def detect_layout(record: dict, where: str) -> str:
    """The one layout whose required fields ``record`` has; with several, the one whose
    marker fields it has. Missing fields or a tie is an error naming the layouts."""
    fits = [layout for layout in LAYOUTS.values() if all(f in record for f in layout.required)]
    if len(fits) > 1:
        fits = [layout for layout in fits if any(f in record for f in layout.markers)] or fits
    if len(fits) == 1:
        return fits[0].name
    fields = ", ".join(sorted(record)) or "none"
    accepted = "; ".join(layout.describe() for layout in LAYOUTS.values())
    if fits:
        names = " and ".join(layout.name for layout in fits)
        raise ProblemSetError(f"{where}: the fields ({fields}) fit the {names} layouts; name "
                              f"one with --format {' or --format '.join(f.name for f in fits)}")
    raise ProblemSetError(f"{where}: cannot tell the problem format from the fields ({fields}); "
                          f"{accepted}; or name the format with --format "
                          f"{{{','.join(LAYOUTS)}}}")


def select_problems(problems: Sequence[Problem], task_ids: Sequence[str] = (),
                    limit: int | None = None) -> list[Problem]:
    """The named tasks (in the given order) or the first ``limit`` problems, else all."""
    if task_ids:
        by_id = {problem.task_id: problem for problem in problems}
        unknown = [task_id for task_id in task_ids if task_id not in by_id]
        if unknown:
            raise ProblemSetError(f"unknown task id(s) {', '.join(unknown)}; ids look like "
                                  f"{problems[0].task_id} .. {problems[-1].task_id}")
        return [by_id[task_id] for task_id in task_ids]
    if limit is not None:
        if limit < 1:
            raise ProblemSetError(f"--limit must be >= 1, got {limit}")
        return list(problems[:limit])
    return list(problems)


def humaneval_build_options(*, std: str = "c++17", sanitize: bool = False, pch: bool = True,
                            linker: str | None = "auto") -> BuildOptions:
    """Build options for HumanEval-X: ``-lcrypto`` for CPP/162's MD5 (Boost is header-only).

    ``linker="auto"`` picks gold when ``ld.gold`` is installed, else the default linker.
    """
    return HUMANEVALX_SUITE.build_options(std=std, sanitize=sanitize, pch=pch, linker=linker)


def check_humaneval_toolchain(verifier: CppVerifier) -> None:
    """Fail early and clearly when Boost or OpenSSL (needed by 3 problems) cannot be used."""
    HUMANEVALX_SUITE.check_toolchain(verifier)


def _records(path: Path):
    """``(line number, record)`` of a JSON Lines file, plain or (``.jsonl.gz``) gzip-compressed,
    read bounded: at most DECOMPRESSED_LIMIT bytes, compressed and decompressed."""
    if not path.name.endswith(SUFFIXES):
        raise ProblemSetError(f"problem file {path}: expected a .jsonl or .jsonl.gz file "
                              "(JSON Lines, plain or gzip-compressed)")
    data = read_bounded(path, DECOMPRESSED_LIMIT, what="problem file", error=ProblemSetError)
    if path.name.endswith(".gz"):
        data = _gunzip(data, path)
    text = decode_utf8(data, f"problem file {path}", error=ProblemSetError)
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield line_no, _decode(line, path, line_no)


def _gunzip(compressed: bytes, path: Path) -> bytes:
    inflate = zlib.decompressobj(wbits=31)  # gzip framing
    try:
        data = inflate.decompress(compressed, DECOMPRESSED_LIMIT + 1)
    except zlib.error as exc:
        raise ProblemSetError(f"cannot read {path} as gzip-compressed JSON Lines: {exc}") from None
    if len(data) > DECOMPRESSED_LIMIT or inflate.unconsumed_tail:
        raise ProblemSetError(f"{path} decompresses to more than "
                              f"{describe_size(DECOMPRESSED_LIMIT)}; refusing to read it")
    if not inflate.eof:
        raise ProblemSetError(f"cannot read {path} as gzip-compressed JSON Lines: it is "
                              "truncated")
    return data


def _decode(line: str, path: Path, line_no: int) -> dict:
    record = parse_json(line, f"{path}:{line_no}", error=ProblemSetError)
    if not isinstance(record, dict):
        raise ProblemSetError(f"{path}:{line_no}: expected a JSON object per line")
    return record


def _parse(layout: Layout, record: dict, where: str) -> Problem:
    """One record as a :class:`Problem` of ``layout``; wrong or missing fields are errors."""
    text_fields = [name for name in layout.required if name != "stop_tokens"]
    missing = [name for name in text_fields if not isinstance(record.get(name), str)]
    if missing:
        raise ProblemSetError(f"{where}: missing or non-string field(s) {', '.join(missing)}; "
                              f"{layout.describe()}")
    language = record.get("language")
    if language is not None and str(language).lower() not in CPP_LANGUAGES:
        raise ProblemSetError(f"{where}: language {language!r}: only C++ problem sets are "
                              f"accepted (language {' or '.join(CPP_LANGUAGES)})")
    fields: dict = {"task_id": record[layout.id_field], "prompt": record["prompt"],
                    "test": record[layout.test_field], "canonical_solution": None}
    if layout.reference:
        solution = record.get("canonical_solution")
        if solution is not None and not isinstance(solution, str):
            raise ProblemSetError(f"{where}: field canonical_solution must be a string or null")
        fields["canonical_solution"] = solution or None  # "" or null: no reference solution
    if layout.name == "humanevalx":
        for name in ("declaration", "example_test"):
            value = record.get(name, "")
            if not isinstance(value, str):
                raise ProblemSetError(f"{where}: field {name} must be a string")
            fields[name] = value
    if layout.stop_tokens:
        stops = record.get("stop_tokens")
        if (not isinstance(stops, list) or not stops
                or not all(isinstance(stop, str) and stop for stop in stops)):
            raise ProblemSetError(f"{where}: field stop_tokens must be a non-empty list of "
                                  "non-empty strings")
        fields["stop_tokens"] = tuple(stops)
    return Problem(**fields)
