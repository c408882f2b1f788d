"""Compile + run verdicts, build options, the exact-prefix precompiled header, sanitizers."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megacpp.errors import ConfigError
from megacpp.eval import BuildOptions, CppVerifier, Sandbox, Status, leading_system_includes
from megacpp.eval.cpp import PCH_MANIFEST, _pch_is_fresh
from tests.eval.conftest import TEST_COMPILE_LIMITS, TEST_RUN_LIMITS, make_verifier
from tests.eval.hostile_programs import GROW_UNTIL_REFUSED

OK = "#include <cstdio>\nint main() { std::puts(\"hi\"); return 0; }\n"
EXIT_1 = "int main() { return 1; }\n"
ASSERTION = "#include <cassert>\nint main() { int x = 2; assert(x == 3); return 0; }\n"
SEGFAULT = "int main() { volatile int *p = nullptr; return *p; }\n"
SYNTAX_ERROR = "int main() { return undefined_name; }\n"
# Reads one element past the end: a plain -O0 build happens to pass, ASan must not.
OUT_OF_BOUNDS = """#include <vector>
int main() {
    std::vector<int> v(3, 7);
    volatile int past = v.data()[3];
    (void)past;
    return 0;
}
"""
# std::sort needs <algorithm>; a lenient shared prelude would make this compile.
MISSING_INCLUDE = """#include <vector>
int main() { std::vector<int> v{3, 1}; std::sort(v.begin(), v.end()); return v[0] == 1 ? 0 : 1; }
"""


@pytest.mark.parametrize(("source", "status", "detail"), [
    (OK, Status.PASSED, "exit code 0"),
    (EXIT_1, Status.FAILED, "exit code 1"),
    (ASSERTION, Status.FAILED, "assertion failed"),
    (SEGFAULT, Status.CRASHED, "SIGSEGV"),
    (SYNTAX_ERROR, Status.COMPILE_ERROR, "exited with code 1"),
])
def test_programs_are_classified(verifier, source, status, detail):
    verdict = verifier.verify(source)
    assert verdict.status is status, verdict
    assert detail in verdict.detail


def test_verdicts_carry_output_and_timings(verifier):
    verdict = verifier.verify(OK)
    assert verdict.stdout == "hi\n"
    assert verdict.compile_s > 0 and verdict.run_s > 0
    broken = verifier.verify(SYNTAX_ERROR)
    assert "undefined_name" in broken.stderr and broken.run_s is None
    assert set(broken.to_json()) >= {"status", "detail", "stderr", "compile_s", "run_s"}
    assert broken.to_json()["status"] == "compile_error"


def test_the_sanitizer_build_catches_what_a_plain_build_passes(verifier):
    assert verifier.verify(OUT_OF_BOUNDS).status is Status.PASSED
    verdict = make_verifier(sanitize=True).verify(OUT_OF_BOUNDS)
    assert verdict.status is Status.CRASHED, verdict
    assert "AddressSanitizer" in verdict.detail and "heap-buffer-overflow" in verdict.detail


def test_a_sanitized_build_still_enforces_the_memory_limit():
    """RLIMIT_AS is lifted for ASan: the run's cgroup, or ASan's RSS limit, stops growth."""
    sanitized = CppVerifier(BuildOptions(sanitize=True), Sandbox("namespaces"),
                            compile_limits=TEST_COMPILE_LIMITS,
                            run_limits=TEST_RUN_LIMITS.replace(memory_bytes=128 << 20))
    verdict = sanitized.verify(GROW_UNTIL_REFUSED)
    assert verdict.status is Status.MEMORY_LIMIT, verdict
    # One request larger than the whole limit is ASan's report, with the limit never reached.
    verdict = sanitized.verify("int main() { char *p = new char[64ULL << 30]; return p[0]; }\n")
    assert verdict.status is Status.CRASHED, verdict
    assert "AddressSanitizer: allocation-size-too-big" in verdict.detail


@pytest.mark.parametrize(("source", "headers"), [
    ("/* doc */\n#include<stdio.h>\n#include <vector>\nusing namespace std;\n#include <map>\n",
     ("stdio.h", "vector")),
    ("// c\n\n#include <string> // trailing\n/* multi\nline */ #include <boost/any.hpp>\nint x;",
     ("string", "boost/any.hpp")),
    ('#include "local.h"\n#include <vector>\n', ()),
    ("#define X 1\n#include <vector>\n", ()),
    ("int main() {}\n", ()),
])
def test_leading_system_includes(source, headers):
    assert leading_system_includes(source) == headers


def test_the_pch_is_used_and_changes_no_verdict(monkeypatch, tmp_path, verifier):
    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(tmp_path))
    fast = make_verifier(pch=True)
    programs = [OK, EXIT_1, ASSERTION, MISSING_INCLUDE, "#include <vector>\n" + SYNTAX_ERROR]
    assert [fast.verify(p).status for p in programs] == [verifier.verify(p).status for p in programs]
    assert fast.verify(MISSING_INCLUDE).status is Status.COMPILE_ERROR  # not lenient
    assert len(list((tmp_path / "pch").glob("*/leading_includes.hpp.gch"))) == 3  # cstdio, cassert, vector
    # -H lists the headers g++ reads; "!" marks a precompiled header it could use.
    shown = make_verifier(pch=True, flags=("-O0", "-H")).verify("#include <vector>\n" + SYNTAX_ERROR)
    assert "! /pch/leading_includes.hpp.gch" in shown.stderr


def test_a_pch_is_rebuilt_when_a_header_it_was_built_from_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGACPP_CACHE_DIR", str(tmp_path))
    make_verifier(pch=True).verify(OK)
    [entry] = (tmp_path / "pch").iterdir()
    manifest = json.loads((entry / PCH_MANIFEST).read_text())
    assert any(path.endswith("/cstdio") for path in manifest)  # real system headers listed
    assert _pch_is_fresh(entry)
    header = tmp_path / "fake_header.h"  # stand in for a system header that gets upgraded
    header.write_text("// v1\n")
    stat = header.stat()
    (entry / PCH_MANIFEST).write_text(json.dumps({str(header): [stat.st_size, stat.st_mtime_ns]}))
    assert _pch_is_fresh(entry)
    header.write_text("// version 2\n")
    assert not _pch_is_fresh(entry)
    assert make_verifier(pch=True).verify(OK).passed  # rebuilt in place
    assert _pch_is_fresh(entry) and str(header) not in (entry / PCH_MANIFEST).read_text()


def test_the_gold_linker_option_links(verifier):
    assert make_verifier(linker="gold").verify(OK).status is Status.PASSED


@pytest.mark.parametrize(("field", "value", "message"), [
    ("std", "c++98", "not supported"),
    ("flags", ("-O2", "main.cpp"), "not accepted"),
    ("flags", ("-o",), "not accepted"),
    ("libs", ("-lcrypto",), "without -l"),
    ("linker", "ld", "not supported"),
])
def test_bad_build_options_are_refused(field, value, message):
    with pytest.raises(ConfigError, match=message):
        BuildOptions(**{field: value})


def test_unusable_compilers_are_refused():
    with pytest.raises(ConfigError, match="not found"):
        CppVerifier(BuildOptions(compiler="no-such-compiler++"), Sandbox("namespaces"))
    with pytest.raises(ConfigError, match="namespace isolation"):
        CppVerifier(BuildOptions(pch=True), Sandbox("rlimits"))


def test_verifiers_are_plain_dataclasses(verifier):
    stricter = dataclasses.replace(verifier, build=BuildOptions(std="c++20"))
    assert stricter.verify("#include <span>\nint main() { return 0; }\n").passed
    assert not verifier.verify("#include <span>\nint x = std::dynamic_extent; int main() {}\n").passed
