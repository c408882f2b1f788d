from __future__ import annotations

import subprocess
import sys


def test_console_script_help_and_version():
    out = subprocess.run(
        [sys.executable, "-m", "megacpp", "version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("megacpp ")
    helptext = subprocess.run(
        [sys.executable, "-m", "megacpp", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "version" in helptext
