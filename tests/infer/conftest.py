"""Fixtures shared by the serving tests."""

from __future__ import annotations

import pytest
import torch

from megacpp.data.tokenizer import CppTokenizer


@pytest.fixture
def one_thread():
    """One intra-op thread (the 2-core CPU is shared with the server thread); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer() -> CppTokenizer:
    """The 600-token tokenizer over six libstdc++ headers (``server_helpers.tiny_tokenizer``);
    a module with another corpus defines its own."""
    from tests.infer.server_helpers import tiny_tokenizer  # httpx and the server: only here

    return tiny_tokenizer()
