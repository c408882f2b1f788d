"""Fixtures of the trainer tests: one real dataset per session, single-threaded torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.train.helpers import LIBSTDCXX, build_dataset


@pytest.fixture(scope="session")
def cpp_dataset(tmp_path_factory) -> Path:
    if not (LIBSTDCXX / "utility").is_file():
        pytest.skip(f"needs the libstdc++ headers in {LIBSTDCXX} (apt-get install g++)")
    return build_dataset(tmp_path_factory.mktemp("train-data"))


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, like the subprocess runs (bitwise-comparable, and the CPU is
    shared); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
