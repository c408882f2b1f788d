"""megacpp._compile's markers do what torch.compiler's do, without importing torch._dynamo
when they decorate (a fresh interpreter checks that; this one has imported it already).
``disable`` imports it at the decorated function's first call, as PyTorch's lazy form does."""

from __future__ import annotations

import subprocess
import sys

import torch

from megacpp import _compile


def test_assume_constant_result_sets_torchs_mark():
    def ours():
        return 1

    def theirs():
        return 1

    _compile.assume_constant_result(ours)
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and vars(ours)


def test_disable_runs_the_function_uncompiled_inside_a_compiled_caller():
    seen: dict[str, bool] = {}

    def ours(x):
        seen["ours"] = torch.compiler.is_compiling()
        return x + 1

    def theirs(x):
        seen["theirs"] = torch.compiler.is_compiling()
        return x + 1

    lazy, disabled = _compile.disable(ours), torch.compiler.disable(theirs)

    @torch.compile(backend="eager", fullgraph=False)
    def caller(x):
        seen["caller"] = torch.compiler.is_compiling()
        return lazy(x) * disabled(x)

    x = torch.ones(3)
    assert torch.equal(caller(x), (x + 1) * (x + 1))
    assert seen == {"caller": True, "ours": False, "theirs": False}


def test_decorating_does_not_import_dynamo():
    code = ("import sys\nfrom megacpp import _compile\n"
            "f = _compile.disable(lambda: 1)\ng = _compile.assume_constant_result(lambda: 2)\n"
            "assert g() == 2 and callable(f)\nprint('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr
