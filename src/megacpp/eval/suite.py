"""A problem set's build: the C++ standard, compiler flags and link libraries its programs
need, and the headers and libraries checked before a run.

The suite config is found, first match: ``--suite-config PATH``; the sidecar
``<name>.suite.toml`` beside the problem file (``humaneval-cpp.jsonl`` or
``humaneval-cpp.jsonl.gz`` -> ``humaneval-cpp.suite.toml``); the defaults of the file's
layout (:data:`LAYOUT_SUITES`). A config file is TOML with these keys, all optional::

    name = "MultiPL-E HumanEval C++"
    format = "multipl-e"          # the layout, as --format (the command line wins)
    std = "c++17"                 # -std= (the command line's --std wins)
    flags = ["-O0"]               # replaces the default ["-O0"]
    libs = ["crypto"]             # linked as -lcrypto
    headers = ["openssl/md5.h"]   # must compile before the run starts
    hint = "install libssl-dev"   # said when that check fails
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from megacpp._io import CONFIG_LIMIT, read_toml_bounded
from megacpp.errors import ConfigError, MegaCppError
from megacpp.eval.cpp import BuildOptions, CppVerifier

FORMATS = ("humanevalx", "multipl-e", "mbxp")
SUITE_SUFFIX = ".suite.toml"
_HEADER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./+-]*$")
_LIST_KEYS = ("flags", "libs", "headers")
_TEXT_KEYS = ("name", "format", "std", "hint")


class SuiteConfigError(MegaCppError):
    """A suite config file is missing, unreadable or malformed."""


@dataclass(frozen=True)
class SuiteConfig:
    """How the programs of one problem set are built, and what must be installed for it."""

    name: str
    std: str = "c++17"
    flags: tuple[str, ...] = ("-O0",)
    libs: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()
    hint: str = ""
    format: str | None = None
    source: str = "built-in defaults"  # the TOML file's path, or where the defaults came from

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise SuiteConfigError(f"suite config {self.source}: format {self.format!r} is not "
                                   f"one of {', '.join(FORMATS)}")
        for header in self.headers:
            if not _HEADER.match(header) or ".." in header:
                raise SuiteConfigError(f"suite config {self.source}: header {header!r} is not a "
                                       f"plain include path like 'boost/any.hpp'")
        self.build_options(pch=False, linker=None)  # flags, libs and std are checked there

    def build_options(self, *, std: str | None = None, sanitize: bool = False, pch: bool = True,
                      linker: str | None = "auto") -> BuildOptions:
        """The compiler options for this suite; ``std`` overrides the suite's standard.

        ``linker="auto"`` picks gold when ``ld.gold`` is installed, else the default linker.
        """
        if linker == "auto":
            linker = "gold" if shutil.which("ld.gold") else None
        try:
            return BuildOptions(std=std or self.std, flags=self.flags, libs=self.libs,
                                sanitize=sanitize, pch=pch, linker=linker)
        except ConfigError as exc:
            if std is None:
                raise SuiteConfigError(f"suite config {self.source}: {exc}") from None
            raise

    def probe_source(self) -> str | None:
        """A program that includes every required header (linked with the suite's
        libraries), or None when the suite needs neither."""
        if not self.headers and not self.libs:
            return None
        includes = "".join(f"#include <{header}>\n" for header in self.headers)
        return f"{includes}int main() {{ return 0; }}\n"

    def check_toolchain(self, verifier: CppVerifier) -> None:
        """Fail early and clearly when a header or library the suite needs is missing."""
        source = self.probe_source()
        if source is None:
            return
        verdict = verifier.verify(source)
        if verdict.passed:
            return
        first_line = (verdict.stderr.strip().splitlines() or [verdict.detail])[0]
        needs = [*(f"<{h}>" for h in self.headers), *(f"-l{lib}" for lib in self.libs)]
        hint = f"; {self.hint}" if self.hint else ""
        raise MegaCppError(f"the toolchain check of {self.name} failed ({verdict.status.value}: "
                           f"{first_line}); it needs {', '.join(needs)}{hint}")


HUMANEVALX_SUITE = SuiteConfig(
    name="HumanEval-X C++", libs=("crypto",), headers=("boost/any.hpp", "openssl/md5.h"),
    hint="CPP/22 and CPP/137 need Boost headers and CPP/162 links OpenSSL's -lcrypto: install "
         "libboost-dev and libssl-dev (scripts/setup.sh does)",
    format="humanevalx", source="defaults of the humanevalx layout")

# MultiPL-E's C++ evaluator compiles with `g++ -std=c++17` and links nothing else; mxeval
# (MBXP) with a bare `g++`, whose default standard is gnu++17 from GCC 11 on.
LAYOUT_SUITES = {
    "humanevalx": HUMANEVALX_SUITE,
    "multipl-e": SuiteConfig(name="MultiPL-E C++", format="multipl-e",
                             source="defaults of the multipl-e layout"),
    "mbxp": SuiteConfig(name="MBXP C++", std="gnu++17", format="mbxp",
                        source="defaults of the mbxp layout"),
}


def sidecar_path(problem_file: str | os.PathLike[str]) -> Path:
    """``<dir>/<name>.suite.toml`` for ``<dir>/<name>.jsonl`` or ``<dir>/<name>.jsonl.gz``."""
    path = Path(problem_file)
    name = path.name
    for suffix in (".jsonl.gz", ".jsonl"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return path.with_name(name + SUITE_SUFFIX)


def find_suite_config(problem_file: str | os.PathLike[str],
                      explicit: str | os.PathLike[str] | None = None) -> SuiteConfig | None:
    """The suite config named by ``explicit``, else the sidecar of ``problem_file`` when it
    exists, else None (the layout's defaults apply)."""
    if explicit is not None:
        return read_suite_config(explicit)
    sidecar = sidecar_path(problem_file)
    if sidecar.exists():
        return read_suite_config(sidecar)
    return None


def read_suite_config(path: str | os.PathLike[str]) -> SuiteConfig:
    """A suite config TOML file; unknown keys and wrong types are errors naming the file."""
    data = read_toml_bounded(path, CONFIG_LIMIT, what="suite config", error=SuiteConfigError)
    source = os.fspath(path)
    unknown = sorted(set(data) - {*_LIST_KEYS, *_TEXT_KEYS})
    if unknown:
        raise SuiteConfigError(f"suite config {source}: unknown key(s) {', '.join(unknown)}; "
                               f"accepted: {', '.join((*_TEXT_KEYS, *_LIST_KEYS))}")
    values: dict[str, object] = {}
    for key in _TEXT_KEYS:
        if key in data:
            if not isinstance(data[key], str) or not data[key].strip():
                raise SuiteConfigError(f"suite config {source}: {key} must be a non-empty string")
            values[key] = data[key]
    for key in _LIST_KEYS:
        if key in data:
            items = data[key]
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise SuiteConfigError(f"suite config {source}: {key} must be a list of strings")
            values[key] = tuple(items)
    values.setdefault("name", Path(source).name.removesuffix(SUITE_SUFFIX))
    return SuiteConfig(source=source, **values)  # type: ignore[arg-type]
