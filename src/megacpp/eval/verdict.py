"""Turn a sandboxed compile and run into one verdict: the only thing pass@k counts."""

from __future__ import annotations

import re
import signal
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from megacpp.eval.sandbox import Execution, Limits

STDERR_EXCERPT_CHARS = 2000

# A refused allocation is memory_limit only with at least this share of the limit in use at peak:
# growth by doubling (std::vector, std::string) is refused holding a third of it or more.
NEAR_LIMIT_SHARE = 0.25

# Messages a program (or its sanitizer runtime) prints when an allocation is refused.
_OUT_OF_MEMORY_MARKERS = (
    b"std::bad_alloc",
    b"Cannot allocate memory",
    b"AddressSanitizer: out of memory",
    b"AddressSanitizer: allocation-size-too-big",
    b"AddressSanitizer: requested allocation size",
    b"hard rss limit exhausted",
    b"memory exhausted",
)
# The sanitizer's own RSS check: by construction the run reached its limit.
_RSS_LIMIT_MARKER = b"hard rss limit exhausted"

# How the C++ runtimes report an exception nothing caught (then std::terminate aborts).
_LIBSTDCXX_UNCAUGHT = re.compile(
    r"terminate called after throwing an instance of '(?P<type>[^\n]*)'"
    r"(?:\n[ \t]*what\(\):[ \t]*(?P<what>[^\n]*))?")
_LIBCXX_UNCAUGHT = re.compile(
    r"libc\+\+abi: terminating (?:due to|with) uncaught exception of type "
    r"(?P<type>[^\n]+?)(?:: (?P<what>[^\n]*))?(?:\n|$)")
_MESSAGE_CHARS = 300


class Status(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    COMPILE_ERROR = "compile_error"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"


@dataclass(frozen=True)
class Verdict:
    """The outcome of compiling and running one program."""

    status: Status
    detail: str  # one line: why this status
    stderr: str  # excerpt: the compiler's for compile_error, the program's otherwise
    stdout: str = ""  # excerpt of the program's stdout (empty when it never ran)
    exit_code: int | None = None
    signal: str | None = None  # e.g. "SIGSEGV"
    compile_s: float = 0.0
    run_s: float | None = None  # None when it never ran
    max_rss_kb: int | None = None
    memory_bound: str = ""  # the memory guarantee in force (a cgroup per run, or rlimits only)

    @property
    def passed(self) -> bool:
        return self.status is Status.PASSED

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["status"] = self.status.value
        return record


def compile_verdict(execution: Execution, limits: Limits) -> Verdict | None:
    """A compile_error verdict, or None when the compiler succeeded."""
    if execution.exit_code == 0 and not (execution.timed_out or execution.output_exceeded):
        return None
    if execution.timed_out:
        detail = f"the compiler exceeded the {limits.wall_s:g} s wall-clock limit"
    elif execution.output_exceeded:
        detail = f"the compiler wrote more than {limits.output_bytes} bytes of diagnostics"
    elif execution.oom_killed:
        detail = f"the compiler was OOM-killed at the run's memory limit ({execution.memory_bound})"
    elif execution.signal is not None:
        detail = f"the compiler was killed by {_signal_name(execution.signal)}"
    else:
        detail = f"the compiler exited with code {execution.exit_code}"
    return Verdict(
        status=Status.COMPILE_ERROR,
        detail=detail,
        stderr=excerpt(execution.stderr),
        exit_code=execution.exit_code,
        signal=_signal_name(execution.signal),
        compile_s=execution.wall_s,
        memory_bound=execution.memory_bound,
    )


def run_verdict(execution: Execution, limits: Limits, compile_s: float) -> Verdict:
    """Classify a finished (or killed) program run."""
    status, detail = _classify(execution, limits)
    return Verdict(
        status=status,
        detail=detail,
        stderr=excerpt(execution.stderr),
        stdout=excerpt(execution.stdout),
        exit_code=execution.exit_code,
        signal=_signal_name(execution.signal),
        compile_s=compile_s,
        run_s=execution.wall_s,
        max_rss_kb=execution.max_rss_kb,
        memory_bound=execution.memory_bound,
    )


def _classify(execution: Execution, limits: Limits) -> tuple[Status, str]:
    sig = execution.signal
    if execution.output_exceeded:
        return Status.OUTPUT_LIMIT, f"wrote more than {limits.output_bytes} bytes to stdout/stderr"
    if execution.oom_killed:  # whatever the exit status: the run hit its memory cgroup's limit
        return Status.MEMORY_LIMIT, f"OOM-killed at the run's memory limit ({execution.memory_bound})"
    if execution.timed_out:
        return Status.TIMEOUT, f"still running at the {limits.wall_s:g} s wall-clock limit"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and (execution.cpu_s or 0) >= limits.cpu_s):
        return Status.TIMEOUT, f"used its {limits.cpu_s} s of CPU time"
    if sig == signal.SIGXFSZ:
        return Status.OUTPUT_LIMIT, f"tried to write a file larger than {limits.file_bytes} bytes"
    if sig is None and execution.exit_code == 0:
        return Status.PASSED, "exit code 0"
    if _reached_the_memory_limit(execution, limits):
        return Status.MEMORY_LIMIT, _memory_detail(execution, limits)
    exception = _uncaught_exception(execution)
    if exception is not None:
        return Status.FAILED, exception + _far_below_the_limit(execution, limits)
    assertion = _failed_assertion(execution)
    if assertion is not None:
        return Status.FAILED, assertion
    if sig is not None:
        return Status.CRASHED, f"killed by {_signal_name(sig)}{_crash_summary(execution)}"
    return Status.FAILED, f"exit code {execution.exit_code}"


def _reached_the_memory_limit(execution: Execution, limits: Limits) -> bool:
    """An allocation was refused because the run used (nearly) all of its memory.

    A refusal with little in use is a request no limit could meet (a length read out of
    bounds, a negative size): the program's own error, classified like any other."""
    if _RSS_LIMIT_MARKER in execution.stderr:
        return True
    if not any(marker in execution.stderr for marker in _OUT_OF_MEMORY_MARKERS):
        return False
    share = _peak_share(execution, limits)
    return share is not None and share >= NEAR_LIMIT_SHARE


def _memory_limit_bytes(limits: Limits) -> int | None:
    """The limit a refused allocation runs into: RLIMIT_AS, else (sanitizer builds) the run's."""
    return limits.memory_bytes if limits.memory_bytes is not None else limits.run_memory_bytes()


def _peak_share(execution: Execution, limits: Limits) -> float | None:
    """Peak resident memory of the program as a share of its memory limit (None: unknown)."""
    limit = _memory_limit_bytes(limits)
    if limit is None or execution.max_rss_kb is None:
        return None
    return execution.max_rss_kb * 1024 / limit


def _uncaught_exception(execution: Execution) -> str | None:
    """'uncaught std::runtime_error: what() text' when an exception ended the program.

    Either side may have thrown it (a test that signals failure by throwing, a solution that
    throws): an exception escaping main is a defined outcome of the program, not a crash."""
    if execution.signal != signal.SIGABRT:
        return None
    text = execution.stderr.decode("utf-8", "replace")
    found = _LIBSTDCXX_UNCAUGHT.search(text) or _LIBCXX_UNCAUGHT.search(text)
    if found is None:
        return None
    detail = f"uncaught exception of type {found['type'].strip()}"
    what = (found["what"] or "").strip()
    if what:
        detail += f": {_shorten(what)}"
    return detail


def _failed_assertion(execution: Execution) -> str | None:
    """A test's failed ``assert`` (glibc prints the expression, then aborts): a wrong answer."""
    if execution.signal != signal.SIGABRT:
        return None
    for line in execution.stderr.decode("utf-8", "replace").splitlines():
        if "Assertion `" in line and line.rstrip().endswith("failed."):
            return f"assertion failed: {_shorten(line[line.index('Assertion `'):].strip())}"
    return None


def _far_below_the_limit(execution: Execution, limits: Limits) -> str:
    """For a refused allocation that is not memory_limit: how little the run had in use."""
    if not any(marker in execution.stderr for marker in _OUT_OF_MEMORY_MARKERS):
        return ""
    limit = _memory_limit_bytes(limits)
    if limit is None or execution.max_rss_kb is None:
        return ""
    return (f" (refused with {_mib_text(execution.max_rss_kb * 1024)} in use at peak, "
            f"below {NEAR_LIMIT_SHARE:.0%} of the {_mib_text(limit)} limit)")


def _memory_detail(execution: Execution, limits: Limits) -> str:
    if _RSS_LIMIT_MARKER in execution.stderr:
        return "the sanitizer's resident-memory limit was exhausted"
    limit = _memory_limit_bytes(limits) or 0  # known: the share was computed from it
    kind = "address-space" if limits.memory_bytes is not None else "memory"
    return (f"an allocation was refused with {_mib_text((execution.max_rss_kb or 0) * 1024)} "
            f"in use at peak ({kind} limit {_mib_text(limit)})")


def _crash_summary(execution: Execution) -> str:
    """' (AddressSanitizer: heap-buffer-overflow)' when the runtime said why it aborted."""
    for line in execution.stderr.decode("utf-8", "replace").splitlines():
        if line.startswith("SUMMARY: "):
            return f" ({_shorten(line.removeprefix('SUMMARY: ').strip())})"
        if line.startswith("terminate called"):  # without an active exception, recursively
            return f" ({_shorten(line.strip())})"
    return ""


def _shorten(text: str) -> str:
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + "..."


def _mib_text(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _signal_name(number: int | None) -> str | None:
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def excerpt(stream: bytes, limit: int = STDERR_EXCERPT_CHARS) -> str:
    """The start of a stream as text (compilers and asserts put the key line first)."""
    text = stream.decode("utf-8", "replace")
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} more chars]"
