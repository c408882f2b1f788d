"""Verdicts that mean what they say: a test that throws or asserts is `failed` (with its
message), `memory_limit` only where the limit was reached, any other signal is `crashed`.
Real g++ and the real sandbox for every program; the threshold edges on recorded runs."""

from __future__ import annotations

import dataclasses
import signal

import pytest

from megacpp.eval import Limits, Status
from megacpp.eval.sandbox import Execution
from megacpp.eval.verdict import NEAR_LIMIT_SHARE, run_verdict
from tests.eval.conftest import with_run_limits

# Each program is a solution followed by its tests, as the benchmarks put them together.
TEST_THROWS = r"""
#include <stdexcept>
int add(int a, int b) { return a - b; }
int main() {
    if (add(1, 1) != 2) throw std::runtime_error("test 1 did not pass");
    return 0;
}
"""

TEST_ASSERTS = r"""
#include <cassert>
int add(int a, int b) { return a - b; }
int main() { assert(add(1, 1) == 2); return 0; }
"""

# Counts up forever, keeping every number: refused when a doubling no longer fits.
REAL_OUT_OF_MEMORY = r"""
#include <vector>
long last_kept() {
    std::vector<long> kept;
    for (long i = 0; i >= 0; i++) kept.push_back(i);
    return kept.back();
}
int main() { return last_kept() == 3 ? 0 : 1; }
"""

# A length field read as 1 TiB: refused at once, with almost nothing in use (no limit helps).
SMALL_BAD_ALLOC = r"""
#include <vector>
long body_length(const std::vector<long> &header) { return header[0]; }
int main() {
    std::vector<long> header{1L << 40, 5};
    std::vector<char> body(body_length(header));
    return body.size() == 5 ? 0 : 1;
}
"""

SOLUTION_SEGFAULTS = r"""
int first(const int *values) { return values[0]; }
int main() { return first(nullptr) == 1 ? 0 : 1; }
"""

SOLUTION_ABORTS = r"""
#include <cstdlib>
int add(int a, int b) { if (a == b) std::abort(); return a + b; }
int main() { return add(1, 1) == 2 ? 0 : 1; }
"""

OOM_LIMIT_BYTES = 64 << 20  # small, so the real out-of-memory is reached in a moment


def test_a_test_that_throws_is_failed_with_the_exceptions_message(verifier):
    verdict = verifier.verify(TEST_THROWS)
    assert verdict.status is Status.FAILED, verdict
    assert verdict.signal == "SIGABRT"
    assert verdict.detail == ("uncaught exception of type std::runtime_error: "
                              "test 1 did not pass"), verdict.detail


def test_a_test_that_asserts_is_failed_with_the_assertion(verifier):
    verdict = verifier.verify(TEST_ASSERTS)
    assert verdict.status is Status.FAILED, verdict
    assert verdict.detail.startswith("assertion failed: Assertion `add(1, 1) == 2' failed.")


def test_a_real_out_of_memory_is_a_memory_limit(any_verifier):
    verdict = with_run_limits(any_verifier, memory_bytes=OOM_LIMIT_BYTES).verify(
        REAL_OUT_OF_MEMORY)
    assert verdict.status is Status.MEMORY_LIMIT, verdict
    assert "bad_alloc" in verdict.stderr
    peak = verdict.max_rss_kb * 1024
    assert NEAR_LIMIT_SHARE * OOM_LIMIT_BYTES <= peak <= OOM_LIMIT_BYTES, verdict.max_rss_kb
    assert verdict.detail.startswith("an allocation was refused with ")
    assert "in use at peak (address-space limit 64.0 MiB)" in verdict.detail


def test_a_small_bad_alloc_is_failed_not_memory_limit(verifier):
    verdict = verifier.verify(SMALL_BAD_ALLOC)
    assert verdict.status is Status.FAILED, verdict
    assert verdict.max_rss_kb * 1024 < NEAR_LIMIT_SHARE * verifier.run_limits.memory_bytes
    assert verdict.detail.startswith("uncaught exception of type std::bad_alloc: std::bad_alloc "
                                     "(refused with "), verdict.detail
    assert "below 25% of the 512.0 MiB limit)" in verdict.detail


@pytest.mark.parametrize(("program", "signal_name", "detail"), [
    (SOLUTION_SEGFAULTS, "SIGSEGV", "killed by SIGSEGV"),
    (SOLUTION_ABORTS, "SIGABRT", "killed by SIGABRT"),
], ids=["segfault", "abort"])
def test_a_solution_killed_by_a_signal_is_crashed(verifier, program, signal_name, detail):
    verdict = verifier.verify(program)
    assert verdict.status is Status.CRASHED, verdict
    assert verdict.signal == signal_name and verdict.detail == detail


def _aborted(stderr: bytes, max_rss_kb: int | None = 3 << 10) -> Execution:
    """How a program that wrote ``stderr`` and then aborted is reported by the sandbox."""
    return Execution(exit_code=None, signal=signal.SIGABRT, stdout=b"", stderr=stderr,
                     wall_s=0.1, cpu_s=0.01, max_rss_kb=max_rss_kb, timed_out=False,
                     output_exceeded=False)


BAD_ALLOC_STDERR = (b"terminate called after throwing an instance of 'std::bad_alloc'\n"
                    b"  what():  std::bad_alloc\n")
LIMITS = Limits(memory_bytes=1 << 30)


@pytest.mark.parametrize(("peak_kb", "status"), [
    (3 << 10, Status.FAILED),  # 3 MiB: a bogus size, refused anywhere
    (int(NEAR_LIMIT_SHARE * (1 << 20)) - 1, Status.FAILED),
    (int(NEAR_LIMIT_SHARE * (1 << 20)), Status.MEMORY_LIMIT),  # a quarter of 1 GiB
    (900 << 10, Status.MEMORY_LIMIT),
    (None, Status.FAILED),  # unknown peak: no evidence the limit was reached
])
def test_a_refused_allocation_is_memory_limit_from_a_quarter_of_the_limit(peak_kb, status):
    verdict = run_verdict(_aborted(BAD_ALLOC_STDERR, peak_kb), LIMITS, compile_s=0.1)
    assert verdict.status is status, verdict.detail


@pytest.mark.parametrize(("stderr", "detail"), [
    (b"terminate called after throwing an instance of 'int'\n",
     "uncaught exception of type int"),
    ((b"checking 3\nterminate called after throwing an instance of 'std::out_of_range'\n"
     b"  what():  vector::_M_range_check: __n (which is 5) >= this->size() (which is 2)\n"),
     ("uncaught exception of type std::out_of_range: vector::_M_range_check: __n (which is 5) "
     ">= this->size() (which is 2)")),
    ((b"libc++abi: terminating due to uncaught exception of type std::runtime_error: "
     b"test 3 did not pass\n"),
     "uncaught exception of type std::runtime_error: test 3 did not pass"),
    (b"libc++abi: terminating with uncaught exception of type std::logic_error: bad: twice\n",
     "uncaught exception of type std::logic_error: bad: twice"),
    (b"libc++abi: terminating due to uncaught exception of type int\n",
     "uncaught exception of type int"),
])
def test_uncaught_exceptions_of_either_runtime_are_failed(stderr, detail):
    verdict = run_verdict(_aborted(stderr), LIMITS, compile_s=0.1)
    assert (verdict.status, verdict.detail) == (Status.FAILED, detail)


def test_aborts_without_an_exception_are_crashed_with_the_runtimes_reason():
    verdict = run_verdict(_aborted(b"terminate called without an active exception\n"), LIMITS,
                          compile_s=0.1)
    assert verdict.status is Status.CRASHED
    assert verdict.detail == "killed by SIGABRT (terminate called without an active exception)"
    faked = run_verdict(dataclasses.replace(_aborted(BAD_ALLOC_STDERR), signal=signal.SIGSEGV),
                        LIMITS, compile_s=0.1)
    assert faked.status is Status.CRASHED  # the text alone, without the abort, is no exception


def test_the_sanitizers_rss_limit_is_memory_limit_whatever_the_peak_seen():
    stderr = b"==12==ERROR: AddressSanitizer: hard rss limit exhausted (1024Mb vs 1030Mb)\n"
    verdict = run_verdict(_aborted(stderr, None), Limits(memory_bytes=None), compile_s=0.1)
    assert verdict.status is Status.MEMORY_LIMIT
    assert verdict.detail == "the sanitizer's resident-memory limit was exhausted"

