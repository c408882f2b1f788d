"""The Hugging Face directory of a megacpp model: what ``AutoModelForCausalLM`` and
``AutoTokenizer`` read.

```
config.json                      model_type "megacpp", auto_map, the whole megacpp model config
                                 under "megacpp", the special token ids
configuration_megacpp.py         MegaCppConfig (PretrainedConfig)       } trust_remote_code;
modeling_megacpp.py              MegaCppForCausalLM (PreTrainedModel)   } import megacpp
model.safetensors                the weights, by MegaCppForCausalLM's names ("model." + the
  or model-0000i-of-0000n.safetensors + model.safetensors.index.json   HybridLM's)
tokenizer.json                   megacpp's tokenizer, plus a post-processor that puts BOS first
tokenizer_config.json            PreTrainedTokenizerFast with bos/eos/pad; a literal special
special_tokens_map.json          token in source text stays text (split_special_tokens)
generation_config.json           bos/eos/pad ids (greedy decoding by default)
README.md                        the model card (megacpp.export.card)
```

This module reads and writes the weights, config and tokenizer; it imports neither train nor
transformers (the format is plain JSON + safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megacpp import __version__
from megacpp._io import atomic_write_json, atomic_write_text
from megacpp.data.tokenizer import BOS, EOS, PAD, CppTokenizer
from megacpp.errors import ConfigError, MegaCppError
from megacpp.model.config import ModelConfig
from megacpp.pattern import load

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_PATTERN = "model{suffix}.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_TYPE = "megacpp"
PREFIX = "model."  # the HybridLM inside MegaCppForCausalLM
AUTO_MAP = {
    "AutoConfig": "configuration_megacpp.MegaCppConfig",
    "AutoModelForCausalLM": "modeling_megacpp.MegaCppForCausalLM",
}
DEFAULT_MAX_SHARD_SIZE = "2GB"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        raise MegaCppError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise MegaCppError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise MegaCppError(f"{path} is not a JSON object")
    return data


def is_hf_export(path: Path) -> bool:
    """True for a directory whose config.json says ``"model_type": "megacpp"``, False for one
    without a config.json; an unreadable config.json, or one of another model type, is an
    error naming it."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        model_type = json.loads(config.read_text("utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise MegaCppError(f"{config} is not a readable Hugging Face config ({exc})") from None
    if model_type != MODEL_TYPE:
        raise MegaCppError(f"{config} is a Hugging Face config of model_type {model_type!r}; "
                           f"only megacpp exports (model_type {MODEL_TYPE!r}) load here")
    return True


# -- weights ----------------------------------------------------------------------------------
def write_weights(state: dict[str, torch.Tensor], out: Path,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write HybridLM ``state`` as safetensors under ``out``, sharded above ``max_shard_size``
    (bytes, or "2GB", "500MB"), with the index transformers reads; returns the file names."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors = {PREFIX + name: t.detach().cpu().contiguous() for name, t in state.items()}
    try:
        split = split_torch_state_dict_into_shards(tensors, filename_pattern=WEIGHTS_PATTERN,
                                                   max_shard_size=max_shard_size)
    except ValueError as exc:
        raise ConfigError(f"--max-shard-size {max_shard_size!r}: {exc}") from None
    for filename, names in split.filename_to_tensors.items():
        save_file({name: tensors[name] for name in names}, str(out / filename),
                  metadata={"format": "pt"})
    if split.is_sharded:
        atomic_write_json(out / INDEX_FILE, {"metadata": split.metadata,
                                      "weight_map": split.tensor_to_filename})
    return sorted(split.filename_to_tensors)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The HybridLM state of an export directory (its weights by HybridLM names)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if (path / INDEX_FILE).is_file():
        weight_map = _read_json(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise MegaCppError(f"{path / INDEX_FILE} has no weight_map")
        files = sorted(set(weight_map.values()))
    else:
        files = [WEIGHTS_FILE]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise MegaCppError(f"{path}: weight file {name} is missing")
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise MegaCppError(f"{file} is not a readable safetensors file ({exc})") from None
    foreign = [name for name in state if not name.startswith(PREFIX)]
    if foreign:
        raise MegaCppError(f"{path}: tensor {foreign[0]} is not a megacpp weight "
                           f"(names start with {PREFIX!r})")
    return {name.removeprefix(PREFIX): t for name, t in state.items()}


# -- config -----------------------------------------------------------------------------------
def config_json(model_cfg: ModelConfig, tokenizer: CppTokenizer, dtype: str = "float32",
                seq_len: int | None = None) -> dict[str, Any]:
    """config.json of a model: what transformers needs, and megacpp's whole model config."""
    return {
        "architectures": ["MegaCppForCausalLM"],
        "model_type": MODEL_TYPE,
        "auto_map": AUTO_MAP,
        "megacpp": model_cfg.to_dict(),
        "pattern": model_cfg.pattern,
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": model_cfg.d_model,
        "num_hidden_layers": len(load(model_cfg.pattern).layers),
        "train_seq_len": seq_len,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        # the head shares the embedding inside HybridLM: no separate weight to tie
        "tie_word_embeddings": False,
        "dtype": dtype,
        "megacpp_version": __version__,
    }


def read_model_config(path: Path) -> ModelConfig:
    """The megacpp model config of an export directory."""
    config = _read_json(Path(path) / CONFIG_FILE)
    if config.get("model_type") != MODEL_TYPE:
        raise MegaCppError(f"{Path(path) / CONFIG_FILE}: model_type is "
                           f"{config.get('model_type')!r}, not {MODEL_TYPE!r} (not a megacpp "
                           "export)")
    try:
        return ModelConfig.from_saved(config.get("megacpp"))
    except ConfigError as exc:
        raise MegaCppError(f"{Path(path) / CONFIG_FILE}: its megacpp model config is invalid: "
                           f"{exc}") from None


def generation_config_json(tokenizer: CppTokenizer) -> dict[str, Any]:
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.pad_id, "do_sample": False}


# -- tokenizer --------------------------------------------------------------------------------
def write_tokenizer(tokenizer: CppTokenizer, out: Path) -> None:
    """tokenizer.json (BOS put first, as megacpp's prompts start), tokenizer_config.json and
    special_tokens_map.json: ``AutoTokenizer`` gives a PreTrainedTokenizerFast whose
    ``encode`` equals megacpp's BOS + ``encode`` and whose ``decode`` returns the text."""
    from tokenizers import Tokenizer, processors

    hf = Tokenizer.from_str(tokenizer.hf.to_str())
    hf.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, tokenizer.bos_id)])
    atomic_write_text(out / TOKENIZER_FILE, hf.to_str(pretty=True))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # code: decode gives the text back exactly
        "split_special_tokens": True,  # "<|eos|>" inside source code is text, as in megacpp
    }
    atomic_write_json(out / TOKENIZER_CONFIG, config)
    atomic_write_json(out / SPECIAL_TOKENS_MAP, special)


def read_tokenizer(path: Path) -> CppTokenizer:
    """The megacpp tokenizer of an export directory."""
    return CppTokenizer.load(Path(path) / TOKENIZER_FILE)
