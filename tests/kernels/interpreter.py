"""Run a test module's check function under the Triton CPU interpreter, in a fresh process.

``TRITON_INTERPRET`` is read when triton is imported, so the check runs in a subprocess with
it set; the check function returns its measured errors, which are printed for the log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreter_check(test_file: str, check: str) -> None:
    """Import ``test_file``'s module (a path next to this file) and call ``check()`` under
    ``TRITON_INTERPRET=1``; fail with its output unless it exits cleanly."""
    pytest.importorskip("triton")
    here = Path(test_file).resolve()
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), str(here.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    code = ("from tests.kernels.interpreter import patch_scalar_index; patch_scalar_index(); "
            f"import {here.stem} as t; print(t.{check}())")
    run = subprocess.run([sys.executable, "-c", code], check=False, env=env,
                         capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]


def patch_scalar_index() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into an index with ``int(array)`` on a
    one-element 1-D array, which numpy 2.4 refuses ("only 0-dimensional arrays can be
    converted"): ``range(tl.program_id(0), n, tl.num_programs(0))`` (a persistent row loop)
    fails there. Re-set ``__index__`` after the interpreter patches ``tl.tensor`` (in this
    process only; no installed file is changed)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def patch_bf16_rounding() -> None:
    """Triton 3.6's interpreter truncates a float32 -> bfloat16 cast (``.to(tl.bfloat16)``)
    where the GPU rounds to nearest even, so a kernel that rounds intermediates to bf16 as
    its reference does would drift from it under the interpreter only. Make that cast round
    as the GPU does, with torch's conversion (in this process only)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_trunc

    def fp_trunc(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            import torch

            data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(data.view(torch.int16).numpy().view(np.uint16),
                                            tl.bfloat16)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.create_fp_trunc = fp_trunc


def patch_bf16_dot() -> None:
    """Triton 3.6's interpreter keeps bfloat16 as its raw uint16 bits and ``tl.dot`` multiplies
    those bits as integers. Widen bfloat16 operands to float32 first (exact: the top half of a
    float32's bits), as the GPU's bf16 MMA multiplies exactly and accumulates in float32 (in
    this process only; no installed file is changed)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
