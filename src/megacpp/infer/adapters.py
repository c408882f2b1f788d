"""LoRA specialists: peft adapters over one base model, each served as its own specialist.

An adapter directory is peft's format (``adapter_config.json`` + ``adapter_model.safetensors``,
as ``megacpp train`` with ``[lora]``, ``megacpp posttrain`` and ``megacpp export hf
--adapter-only`` write it). Loading one copies the base model (its float32 weights), wraps
the adapter's target layers with peft (the same code that trained it,
:mod:`megacpp.train.finetune`), loads the adapter weights, folds them in and puts the plain
layers back -- exactly what a merged export holds -- and gives it its own engine. A
request picks it by ``"model": NAME``; the router (``auto``) can name it like any
specialist. Each adapter costs one model copy and one KV cache: this serves a handful of
small specialists, not hundreds of adapters batched through one engine.

Adapters load and unload while the server runs (``POST /v1/load_lora_adapter``,
``POST /v1/unload_lora_adapter``, vLLM's routes, when the server allows it): the base keeps
serving throughout, and an unloaded adapter's running requests end as when the server stops.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megacpp.errors import MegaCppError
from megacpp.infer.async_engine import AsyncEngine
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.jobs import Specialist
from megacpp.model.model import HybridLM

LORA_CONFIG_FIELDS = ("r", "lora_alpha", "target_modules")


class AdapterError(MegaCppError):
    """An adapter directory that cannot be served over this base."""


def read_adapter(path: str | Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """(:class:`~megacpp.train.finetune.LoraState`, adapter weights by peft's file names)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from megacpp.train.finetune import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraState

    path = Path(path)
    config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"{path} is not a LoRA adapter directory (it needs {ADAPTER_CONFIG} "
                           f"and {ADAPTER_WEIGHTS}, peft's format)")
    try:
        config = json.loads(config_file.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{config_file}: not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA" or not all(
            k in config for k in LORA_CONFIG_FIELDS):
        raise AdapterError(f"{config_file}: not a LoRA adapter config (it needs peft_type LORA "
                           f"and {', '.join(LORA_CONFIG_FIELDS)})")
    targets = config["target_modules"]
    if not isinstance(targets, list) or not targets:
        raise AdapterError(f"{config_file}: target_modules must be a list of module names")
    try:
        lora = LoraState(int(config["r"]), float(config["lora_alpha"]),
                         float(config.get("lora_dropout") or 0.0), tuple(targets))
        weights = load_file(str(weights_file))
    except (TypeError, ValueError, SafetensorError, OSError) as exc:
        raise AdapterError(f"{path}: cannot read the adapter ({exc})") from None
    return lora, weights


def merged_model(base: HybridLM, path: str | Path) -> HybridLM:
    """A copy of ``base`` (a float32 HybridLM that has never run a forward), on its device,
    with the adapter at ``path`` folded in."""
    from peft import set_peft_model_state_dict

    from megacpp.train.finetune import PEFT_PREFIX, add_lora, merge_lora

    lora, weights = read_adapter(path)
    model = copy.deepcopy(base)  # a memory copy: much faster than building and loading one
    try:
        add_lora(model, lora)
    except (MegaCppError, ValueError) as exc:
        raise AdapterError(f"{path}: its target modules do not fit the base model ({exc})") \
            from None
    device = next(base.parameters()).device
    state = {name.removeprefix(PEFT_PREFIX): tensor.float().to(device)
             for name, tensor in weights.items()}
    wanted = {name for name, _ in model.named_parameters() if ".lora_" in name}
    try:
        result = set_peft_model_state_dict(model, state)
    except RuntimeError as exc:  # a shape mismatch
        raise AdapterError(f"{path}: its weights do not fit the base model: "
                           f"{str(exc).splitlines()[-1].strip()}") from None
    missing = sorted(wanted & set(result.missing_keys))
    if result.unexpected_keys or missing:
        what = (f"tensor {result.unexpected_keys[0]} fits no layer" if result.unexpected_keys
                else f"it lacks {missing[0]}")
        raise AdapterError(f"{path}: its weights do not fit the base model: {what}")
    merge_lora(model)
    return model.eval()


@dataclass
class AdapterSet:
    """The base specialist, its float32 weights and what builds an adapter's specialist."""

    base: Specialist
    base_model: HybridLM  # float32 on the engine's device, never run: adapters merge into a copy
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    runtime: bool = False  # the HTTP load/unload routes are enabled

    @classmethod
    def of(cls, base: Specialist, state: dict[str, torch.Tensor],
           runtime: bool = False) -> AdapterSet:
        """Over ``base``, whose float32 weights (before its engine cast them) are ``state``.
        The float32 copy lives on the engine's device, so an adapter is copied and merged
        there (on a GPU: device memory copies and small matmuls)."""
        engine = base.engine.engine
        model = HybridLM(engine.model.cfg)
        model.load_state_dict({k: v.detach().float() for k, v in state.items()})
        return cls(base, model.to(engine.device).eval(), engine.config, engine.device,
                   engine.dtype, runtime)

    def __post_init__(self) -> None:
        self.loaded: dict[str, str] = {}  # adapter name -> its directory

    def build(self, name: str, path: str | Path) -> Specialist:
        """The specialist of the adapter at ``path`` (not started, not registered)."""
        model = merged_model(self.base_model, path)
        engine = Engine(model, self.base.tokenizer, self.config, self.device, self.dtype)
        return Specialist(name, AsyncEngine(engine, name), self.base.tokenizer,
                          self.config.max_model_len, str(path))

    def add(self, server: Any, spec: Specialist, path: str | Path) -> None:
        """Register ``spec`` with the server (its router and metrics see it at once)."""
        server.router.add(spec.name)
        server.specialists[spec.name] = spec
        self.loaded[spec.name] = str(path)

    async def load(self, server: Any, name: str, path: str) -> dict[str, Any]:
        """Build, start and register an adapter while the server runs."""
        if name in server.specialists:
            raise AdapterError(f"model {name!r} is already served; unload it first or pick "
                               "another name")
        server.router.check_name(name)
        started = time.perf_counter()
        spec = await asyncio.to_thread(self.build, name, path)
        if name in server.specialists:  # loaded meanwhile by another request
            raise AdapterError(f"model {name!r} is already served")
        spec.engine.start()
        self.add(server, spec, path)
        return {"lora_name": name, "lora_path": path, "parent": self.base.name,
                "load_s": round(time.perf_counter() - started, 4)}

    async def unload(self, server: Any, name: str) -> dict[str, Any]:
        """Stop serving an adapter loaded with ``--lora`` or at run time."""
        if name not in self.loaded:
            served = ", ".join(self.loaded) or "none"
            raise AdapterError(f"{name!r} is not a loaded LoRA adapter (adapters: {served})")
        started = time.perf_counter()
        server.router.remove(name)
        spec = server.specialists.pop(name)
        del self.loaded[name]
        await spec.engine.shutdown()
        return {"lora_name": name, "unload_s": round(time.perf_counter() - started, 4)}
