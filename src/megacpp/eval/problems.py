"""HumanEval-X C++: load the problems and assemble a program from prompt + completion + tests.

The data file is found, in order: an explicit path (``--problems``), ``$MEGACPP_EVAL_DATA``,
then the copy shipped in the package (``megacpp/eval/data/humaneval-x-cpp.jsonl.gz``, with its
licence and provenance in the same folder). A program passes when
``prompt + completion + "\\n" + test`` compiles and exits with status 0.
"""

from __future__ import annotations

import os
import shutil
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from megacpp._io import JSON_LIMIT, MiB, decode_utf8, describe_size, parse_json, read_bounded
from megacpp.errors import MegaCppError
from megacpp.eval.cpp import BuildOptions, CppVerifier

DATA_ENV = "MEGACPP_EVAL_DATA"
DATA_NAME = "humaneval-x-cpp.jsonl.gz"
_REQUIRED_FIELDS = ("task_id", "prompt", "canonical_solution", "test")
_OPTIONAL_FIELDS = ("declaration", "example_test")
DECOMPRESSED_LIMIT = 256 * MiB


class ProblemSetError(MegaCppError):
    """The problem file is missing, unreadable or malformed."""


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    declaration: str = ""
    example_test: str = ""

    def program(self, completion: str) -> str:
        """The full program: prompt, the completion of the function, then the hidden tests."""
        return f"{self.prompt}{completion}\n{self.test}"

    @property
    def reference_program(self) -> str:
        return self.program(self.canonical_solution)


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
            f"HumanEval-X C++ data not found at {candidate} (from {source}); pass --problems "
            f"PATH or set {DATA_ENV} to the {DATA_NAME} file (see megacpp/eval/data/README.md)"
        )
    return candidate


def load_problems(path: str | os.PathLike[str] | None = None) -> list[Problem]:
    """All problems of the file, in file order; malformed input raises :class:`ProblemSetError`."""
    located = locate_problems(path)
    problems = [_parse(record, located, line_no) for line_no, record in _records(located)]
    if not problems:
        raise ProblemSetError(f"{located} holds no problems")
    seen: set[str] = set()
    for problem in problems:
        if problem.task_id in seen:
            raise ProblemSetError(f"{located}: task_id {problem.task_id} appears twice")
        seen.add(problem.task_id)
    return problems


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
    if linker == "auto":
        linker = "gold" if shutil.which("ld.gold") else None
    return BuildOptions(std=std, libs=("crypto",), sanitize=sanitize, pch=pch, linker=linker)


TOOLCHAIN_PROBE = """#include <boost/any.hpp>
#include <openssl/md5.h>
int main() {
    boost::any value = 1;
    unsigned char digest[MD5_DIGEST_LENGTH];
    MD5(reinterpret_cast<const unsigned char*>("a"), 1, digest);
    return boost::any_cast<int>(value) == 1 ? 0 : 1;
}
"""


def check_humaneval_toolchain(verifier: CppVerifier) -> None:
    """Fail early and clearly when Boost or OpenSSL (needed by 3 problems) cannot be used."""
    verdict = verifier.verify(TOOLCHAIN_PROBE)
    if not verdict.passed:
        first_line = (verdict.stderr.strip().splitlines() or [verdict.detail])[0]
        raise MegaCppError(
            f"the HumanEval-X toolchain check failed ({verdict.status.value}: {first_line}); "
            f"CPP/22 and CPP/137 need Boost headers and CPP/162 links OpenSSL's -lcrypto: "
            f"install libboost-dev and libssl-dev (scripts/setup.sh does)"
        )


def _records(path: Path):
    """``(line number, record)`` of a gzip-compressed JSON Lines file, read bounded: at most
    JSON_LIMIT compressed and DECOMPRESSED_LIMIT decompressed bytes."""
    compressed = read_bounded(path, JSON_LIMIT, what="problem file", error=ProblemSetError)
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
    text = decode_utf8(data, f"problem file {path}", error=ProblemSetError)
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield line_no, _decode(line, path, line_no)


def _decode(line: str, path: Path, line_no: int) -> dict:
    record = parse_json(line, f"{path}:{line_no}", error=ProblemSetError)
    if not isinstance(record, dict):
        raise ProblemSetError(f"{path}:{line_no}: expected a JSON object per line")
    return record


def _parse(record: dict, path: Path, line_no: int) -> Problem:
    missing = [name for name in _REQUIRED_FIELDS if not isinstance(record.get(name), str)]
    if missing:
        raise ProblemSetError(f"{path}:{line_no}: missing or non-string field(s) "
                              f"{', '.join(missing)}; each line needs {', '.join(_REQUIRED_FIELDS)}")
    fields = {name: record[name] for name in _REQUIRED_FIELDS}
    for name in _OPTIONAL_FIELDS:
        value = record.get(name, "")
        if not isinstance(value, str):
            raise ProblemSetError(f"{path}:{line_no}: field {name} must be a string")
        fields[name] = value
    return Problem(**fields)
