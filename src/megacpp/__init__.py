"""MegaCpp: train, measure and serve small hybrid language models for C++ code.

The Python API (imported on first use, so ``import megacpp`` stays cheap)::

    from megacpp import HybridLM, config_from_pattern, load_pretrained, generate

    model = HybridLM(config_from_pattern("AEMR", vocab_size=4096))   # a new, untrained model
    lm = load_pretrained("runs/tiny-cpu")      # a run, checkpoint or Hugging Face export dir
    print(lm.generate("int gcd(int a, int b) {", max_new_tokens=64, seed=0))
    print(generate(lm.model, lm.tokenizer, "struct Point {", temperature=0.0))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_API = {
    "HybridLM": "megacpp.model.model",
    "ModelConfig": "megacpp.model.config",
    "config_from_pattern": "megacpp.model.config",
    "load_config": "megacpp.model.config",
    "list_presets": "megacpp.model.config",
    "CppTokenizer": "megacpp.data.tokenizer",
    "Pretrained": "megacpp.pretrained",
    "load_pretrained": "megacpp.pretrained",
    "generate": "megacpp.infer.generate",
    "SamplingParams": "megacpp.infer.sampling",
    "MegaCppError": "megacpp.errors",
    "ConfigError": "megacpp.errors",
}

__all__ = [
    "ConfigError",
    "CppTokenizer",
    "HybridLM",
    "MegaCppError",
    "ModelConfig",
    "Pretrained",
    "SamplingParams",
    "__version__",
    "config_from_pattern",
    "generate",
    "list_presets",
    "load_config",
    "load_pretrained",
]  # fmt: skip

if TYPE_CHECKING:
    from megacpp.data.tokenizer import CppTokenizer
    from megacpp.errors import ConfigError, MegaCppError
    from megacpp.infer.generate import generate
    from megacpp.infer.sampling import SamplingParams
    from megacpp.model.config import ModelConfig, config_from_pattern, list_presets, load_config
    from megacpp.model.model import HybridLM
    from megacpp.pretrained import Pretrained, load_pretrained


def __getattr__(name: str) -> Any:
    """PEP 562: import an API name's module the first time the name is used."""
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'megacpp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
