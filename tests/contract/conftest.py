"""Fixtures for the evidence layer: the real CPU fingerprint of this machine."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megacpp.contract import capture_fingerprint
from tests.contract.evidence_facts import without_gpu


@pytest.fixture(scope="session")
def cpu_fingerprint() -> dict[str, Any]:
    return capture_fingerprint()


@pytest.fixture()
def cpu_facts(cpu_fingerprint) -> dict[str, Any]:
    """This machine's real fingerprint, as a CPU-only machine (GPU fields cleared)."""
    return without_gpu(cpu_fingerprint)


@pytest.fixture(scope="session")
def pip_prefix(tmp_path_factory) -> Path:
    """A real wheel install by pip: tabulate (a package dir + a script in ../../../bin)."""
    prefix = tmp_path_factory.mktemp("pip-prefix")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--ignore-installed",
            "--prefix",
            str(prefix),
            "tabulate==0.10.0",
        ],
        capture_output=True, check=False,
        text=True,
        timeout=240,
    )
    if done.returncode != 0:
        pytest.skip(f"pip could not install tabulate from the package index: {done.stderr[-500:]}")
    return prefix


@pytest.fixture()
def installed_site(pip_prefix: Path, tmp_path: Path) -> Path:
    """A private copy of the pip install (tests mutate it); returns its site-packages."""
    copy_root = tmp_path / "prefix"
    shutil.copytree(pip_prefix, copy_root, symlinks=True)
    (dist_info,) = copy_root.rglob("tabulate-0.10.0.dist-info")  # the layout is pip's scheme
    return dist_info.parent
