"""Checkpoints: torch.distributed.checkpoint (sharded) + trainer state, published atomically.

Layout of ``RUN_DIR/checkpoints/step_000100/``::

    .metadata, __0_0.distcp, ...   DCP files: {"model": ..., "optim": ...} (every rank writes
                                   its own shards; replicated tensors are written once)
    trainer_state.json             step, tokens, loss-spike detector, model config, world size,
                                   global batch
    rank_00000.json, ...           per rank: the data position (global: the same on every
                                   rank) and RNG states
    model.toml                     the resolved model config (a model preset file)
    tokenizer.json                 the tokenizer the model was trained with
    COMPLETE                       written last: the sha256 and size of every file above

With ``model.toml`` and ``tokenizer.json`` inside, a checkpoint (or its run directory) works
for inference wherever it is moved: :func:`resolve_checkpoint` takes a run directory or a
checkpoint directory, :func:`load_trained_model` and :func:`load_checkpoint_tokenizer` read
it. A checkpoint without its own tokenizer.json falls back to the tokenizer of the dataset
named in ``RUN_DIR/config.toml``.

A checkpoint is written into ``.tmp-step_000100/``; the marker is written (and fsynced)
after every file, then the directory is renamed to ``step_000100``. A crash at any point
leaves either no new checkpoint or a complete one. Reading verifies the marker and every
hash: a checkpoint without its marker, or with a truncated or corrupt file, is refused with
an error naming it -- and an older one is used instead only when asked
(``fallback_to_previous``).
"""

from __future__ import annotations

import base64
import contextlib
import random
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from megacpp._io import (
    CONFIG_LIMIT,
    JSON_LIMIT,
    atomic_write_json,
    fsync_path,
    parse_json,
    read_bounded,
    read_json_bounded,
    read_toml_bounded,
    sha256_file,
)
from megacpp.data.tokenizer import CppTokenizer
from megacpp.errors import MegaCppError
from megacpp.model.config import ModelConfig
from megacpp.model.model import HybridLM
from megacpp.train.config import to_toml
from megacpp.train.parallelize import DistEnv, barrier, broadcast_object

CHECKPOINTS_DIR = "checkpoints"
MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
MODEL_CONFIG_FILE = "model.toml"
TOKENIZER_FILE = "tokenizer.json"
RUN_CONFIG_FILE = "config.toml"
FORMAT = "megacpp-checkpoint"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_TMP_PREFIX = ".tmp-"
_STALE_PREFIX = ".stale-"
STALL_S = 600.0


class CheckpointError(MegaCppError):
    """A checkpoint that cannot be used (missing marker, truncated or corrupt file...)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


# -- verification -----------------------------------------------------------------------------------
def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The marker of a complete, intact checkpoint; :class:`CheckpointError` otherwise."""
    marker_path = path / MARKER
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a directory)")
    if not marker_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MARKER} marker: it was not completely "
                              "written (or was copied without it)")
    marker = parse_json(read_bounded(marker_path, CONFIG_LIMIT, what=f"checkpoint {MARKER} marker",
                                     error=CheckpointError),
                        f"checkpoint {path}: corrupt {MARKER} marker", error=CheckpointError)
    problem = _marker_problem(marker)
    if problem:
        raise CheckpointError(f"checkpoint {path}: corrupt {MARKER} marker ({problem})")
    files = marker["files"]
    required = [".metadata", TRAINER_STATE,
                *(rank_file(r) for r in range(marker["world_size"]))]
    missing = [name for name in required if name not in files]
    if missing:
        raise CheckpointError(f"checkpoint {path}: its marker does not list {missing}")
    for name, expected in files.items():
        _verify_file(path, name, expected)
    return marker


_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_WORLD_SIZE = 1 << 20


def _marker_problem(marker: Any) -> str | None:
    """What is wrong with a parsed marker (its fields' types and ranges), or None."""
    def is_int(value: Any, low: int, high: int = 2**63 - 1) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        return "not a megacpp checkpoint marker"
    if not is_int(marker.get("world_size"), 1, MAX_WORLD_SIZE):
        return f"world_size {marker.get('world_size')!r:.40} is not an integer >= 1"
    if not is_int(marker.get("step"), 0):
        return f"step {marker.get('step')!r:.40} is not an integer >= 0"
    files = marker.get("files")
    if not isinstance(files, dict):
        return "files is not a table"
    for name, entry in files.items():
        if not name or name in (".", "..", MARKER) or "/" in name or "\0" in name:
            return f"file name {name!r:.80} is not a plain file name"
        if not (isinstance(entry, dict) and is_int(entry.get("bytes"), 0)
                and isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])):
            return f"files[{name!r:.80}] is not {{sha256: 64 hex digits, bytes: an integer}}"
    return None


def _verify_file(root: Path, name: str, expected: dict[str, Any]) -> None:
    file = root / name
    if not file.is_file():
        raise CheckpointError(f"checkpoint {root}: file {name} is missing")
    size = file.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"checkpoint {root}: file {name} is truncated or changed "
                              f"({size} bytes, expected {expected['bytes']})")
    if sha256_file(file) != expected["sha256"]:
        raise CheckpointError(f"checkpoint {root}: file {name} is corrupt (sha256 mismatch)")


def _write_marker(path: Path, step: int, world_size: int) -> None:
    files = {}
    for file in sorted(path.iterdir()):
        if file.is_file() and file.name != MARKER:
            fsync_path(file)
            files[file.name] = {"sha256": sha256_file(file), "bytes": file.stat().st_size}
    fsync_path(path)
    atomic_write_json(path / MARKER, {"format": FORMAT, "version": FORMAT_VERSION, "step": step,
                                      "world_size": world_size, "files": files})


# -- RNG state ----------------------------------------------------------------------------------------
def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) RNG states as JSON data."""
    np_state = np.random.get_state()
    state = {
        "python": _jsonable(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if device.type == "cuda":
        cuda = torch.cuda.get_rng_state(device).numpy().tobytes()
        state["cuda"] = base64.b64encode(cuda).decode()
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]), device)


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


# -- the manager ----------------------------------------------------------------------------------------
class CheckpointManager:
    """Save, find, verify and load the checkpoints of one run directory."""

    def __init__(self, run_dir: Path, keep_last: int, env: DistEnv, stall_step: int = 0,
                 warn: Callable[[str], None] = print) -> None:
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.keep_last = keep_last
        self.env = env
        self.stall_step = stall_step  # debug: hang between this step's files and its marker
        self.warn = warn

    # -- listing ---------------------------------------------------------------------------------
    def published(self) -> list[tuple[int, Path]]:
        """Published checkpoint directories (complete or not), oldest first."""
        return _published_in(self.root)

    def remove_partial(self) -> list[Path]:
        """Delete unpublished ``.tmp-*`` directories left by a crash mid-write (rank 0)."""
        if not self.env.is_main or not self.root.is_dir():
            return []
        partial = [p for p in self.root.iterdir() if p.name.startswith(_TMP_PREFIX)]
        for path in partial:
            shutil.rmtree(path)
        return partial

    # -- choosing what to resume -------------------------------------------------------------------
    def resolve(self, resume: str, fallback_to_previous: bool = False) -> Path | None:
        """The checkpoint to resume: ``"auto"`` (newest, or None when there is none) or a path.

        Runs on rank 0 and is broadcast, so every rank loads the same one.
        """
        result: Path | None | CheckpointError = None
        if self.env.is_main:
            try:
                result = self._resolve(resume, fallback_to_previous)
            except CheckpointError as exc:
                result = exc
        result = broadcast_object(result)
        if isinstance(result, CheckpointError):
            raise result
        return result

    def _resolve(self, resume: str, fallback: bool) -> Path | None:
        if resume == "auto":
            candidates = [p for _, p in reversed(self.published())]
            if not candidates:
                return None
        else:
            wanted = Path(resume)
            candidates = [wanted] + [p for _, p in reversed(_published_in(wanted.parent))
                                     if _step_of(p) < _step_of(wanted)]
        problems = []
        for path in candidates:
            try:
                verify_checkpoint(path)
            except CheckpointError as exc:
                if not fallback:
                    older = [str(p) for p in candidates if p != path][:1]
                    hint = ("; pass --fallback-to-previous to resume from the newest complete "
                            "one before it" if older else "; no older checkpoint exists")
                    raise CheckpointError(f"{exc}{hint}") from None
                problems.append(str(exc))
                continue
            for problem in problems:
                self.warn(f"skipped: {problem}")
            return path
        raise CheckpointError("no usable checkpoint: " + "; ".join(problems))

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizers: list[torch.optim.Optimizer],
             trainer_state: dict[str, Any], rank_state: dict[str, Any],
             files: dict[str, bytes] | None = None) -> Path:
        """Write a checkpoint of ``step`` (collective: every rank calls it). ``files`` (name ->
        content, from :func:`inference_files`) are written beside the state by rank 0."""
        name = step_dir_name(step)
        tmp, final = self.root / f"{_TMP_PREFIX}{name}", self.root / name
        if self.env.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        barrier()
        model_sd, optim_sd = get_state_dict(model, optimizers)
        with _single_process_note_silenced():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, no_dist=_no_dist())
        atomic_write_json(tmp / rank_file(self.env.rank), rank_state)
        barrier()
        if self.env.is_main:
            for file_name, content in (files or {}).items():
                (tmp / file_name).write_bytes(content)
            atomic_write_json(tmp / TRAINER_STATE, trainer_state)
            if step == self.stall_step:
                time.sleep(STALL_S)
            _write_marker(tmp, step, self.env.world_size)
            if final.exists():  # an unusable checkpoint of this step (we fell back past it)
                stale = self.root / f"{_STALE_PREFIX}{name}"
                shutil.rmtree(stale, ignore_errors=True)
                final.rename(stale)
                self.warn(f"moved the unusable {final} aside to {stale}")
            tmp.rename(final)
            fsync_path(self.root)
            self._prune()
        barrier()
        return final

    def _prune(self) -> None:
        complete = [p for _, p in self.published() if (p / MARKER).is_file()]
        for path in complete[: -self.keep_last]:
            shutil.rmtree(path)

    # -- loading --------------------------------------------------------------------------------------
    def load(self, path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer],
             model_config: ModelConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore model and optimizer state in place; returns (trainer state, this rank's state).

        Refuses a checkpoint of another model. One written by another number of ranks loads
        through DCP's resharding (every tensor is stored by its global shape); the data
        position in each rank file is global (the same in all), and a rank the writer did not
        have takes the RNG state of rank ``rank % writer's ranks``.
        """
        trainer_state = read_trainer_state(path)
        saved = ModelConfig.from_saved(trainer_state["model_config"]).to_dict()
        differ = _differences(saved, model_config.to_dict())
        if differ:
            raise CheckpointError(f"checkpoint {path} is of another model ({', '.join(differ)}); "
                                  "resume with the run's own config.toml")
        saved_world = int(trainer_state["world_size"])
        model_sd, optim_sd = get_state_dict(model, optimizers)  # also initialises optim state
        state = {"model": model_sd, "optim": optim_sd}
        with _single_process_note_silenced():
            dcp.load(state, checkpoint_id=path, no_dist=_no_dist())
        set_state_dict(model, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return trainer_state, _read_json(path / rank_file(self.env.rank % saved_world), path)


def _differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``table.key: saved -> wanted`` for every model-config value that differs."""
    return [f"{table}.{key}: {value!r} -> {wanted[table][key]!r}"
            for table, values in saved.items() for key, value in values.items()
            if wanted[table][key] != value]


def _no_dist() -> bool:
    """DCP without collectives when no process group runs (one process)."""
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_note_silenced() -> Iterator[None]:
    """DCP warns "assuming the intent is to save/load in a single process" even when
    ``no_dist=True`` says so explicitly; that is the intent here, so hide the note."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")
        yield


def _published_in(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_NNNNNN`` directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir()
                  if p.is_dir() and (m := _STEP_DIR.match(p.name)))


def _step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else -1


def _read_json(file: Path, checkpoint: Path) -> dict[str, Any]:
    data = read_json_bounded(file, JSON_LIMIT, what=f"checkpoint {checkpoint}: file",
                             error=CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {checkpoint}: {file.name} is not a JSON object")
    return data


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's trainer_state.json, with its model_config table and world_size."""
    state = _read_json(checkpoint / TRAINER_STATE, checkpoint)
    world = state.get("world_size")
    if not isinstance(state.get("model_config"), dict) or not (
            isinstance(world, int) and not isinstance(world, bool) and world >= 1):
        raise CheckpointError(f"checkpoint {checkpoint}: {TRAINER_STATE} lacks its model_config "
                              "table or world_size")
    return state


# -- inference ------------------------------------------------------------------------------------------
def inference_files(model_config: ModelConfig, tokenizer_json: Path) -> dict[str, bytes]:
    """What makes a checkpoint self-contained: the model config and the tokenizer."""
    header = "The model config of this checkpoint (a model preset: megacpp model describe -c FILE)."
    return {MODEL_CONFIG_FILE: to_toml(model_config.to_dict(), header=header).encode(),
            TOKENIZER_FILE: Path(tokenizer_json).read_bytes()}


def resolve_checkpoint(path: str | Path, fallback_to_previous: bool = False) -> Path:
    """The checkpoint directory ``path`` names: ``path`` itself when it is a checkpoint, or a
    run directory's newest checkpoint (``RUN_DIR/checkpoints/step_NNNNNN``).

    A newest checkpoint that is incomplete or corrupt is an error, as for ``megacpp train
    --resume``; with ``fallback_to_previous`` the newest intact one before it is used and the
    skipped ones are named on stderr. Raises :class:`CheckpointError` naming what was looked
    for and what was found.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint or run directory not found: {path} does not exist")
    if _looks_like_checkpoint(path):
        verify_checkpoint(path)
        return path
    if not (path / CHECKPOINTS_DIR).is_dir():
        raise CheckpointError(
            f"{path} is neither a run directory (no {CHECKPOINTS_DIR}/ folder) nor a checkpoint "
            f"(no {MARKER} marker or {TRAINER_STATE}); found: {_listing(path)}")
    candidates = [p for _, p in reversed(_published_in(path / CHECKPOINTS_DIR))]
    if not candidates:
        raise CheckpointError(f"run directory {path} has no checkpoint: looked for "
                              f"{path / CHECKPOINTS_DIR}/step_NNNNNN, found: "
                              f"{_listing(path / CHECKPOINTS_DIR)}")
    problems = []
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
        except CheckpointError as exc:
            if not fallback_to_previous:
                hint = ("; pass --fallback-to-previous to use the newest intact one before it"
                        if len(candidates) > 1 else "")
                raise CheckpointError(f"{exc}{hint}") from None
            problems.append(str(exc))
            continue
        for problem in problems:  # said, never silent
            print(f"skipped: {problem}", file=sys.stderr)
        return candidate
    raise CheckpointError(f"run directory {path} has no complete checkpoint: "
                          + "; ".join(problems))


def _looks_like_checkpoint(path: Path) -> bool:
    return path.is_dir() and (bool(_STEP_DIR.match(path.name)) or (path / MARKER).exists()
                              or (path / TRAINER_STATE).exists())


def _listing(path: Path, limit: int = 8) -> str:
    if not path.is_dir():
        return "not a directory"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return (", ".join(names[:limit]) + more) if names else "nothing (empty)"


def load_trained_model(path: str | Path, device: str | torch.device = "cpu",
                       merge_adapters: bool = True) -> HybridLM:
    """A HybridLM with the weights of a checkpoint (verified first), in eval mode. ``path`` is
    a checkpoint directory or a run directory (its newest complete checkpoint). A LoRA run's
    adapters are merged into the weights (``merge_adapters=False``: kept as peft layers)."""
    return read_trained_model(resolve_checkpoint(path), device, merge_adapters)


def read_trained_model(checkpoint: Path, device: str | torch.device = "cpu",
                       merge_adapters: bool = True) -> HybridLM:
    """:func:`load_trained_model` of a checkpoint directory that :func:`resolve_checkpoint`
    returned (so verified already: its files are not hashed again)."""
    from megacpp.train.finetune import add_lora, merge_lora, read_lora_state

    state = read_trainer_state(checkpoint)
    model = HybridLM(ModelConfig.from_saved(state["model_config"]))
    lora = read_lora_state(state)
    if lora is not None:
        add_lora(model, lora)
    weights = {"model": model.state_dict()}
    with _single_process_note_silenced():
        dcp.load(weights, checkpoint_id=checkpoint, no_dist=_no_dist())
    model.load_state_dict(weights["model"])
    if lora is not None and merge_adapters:
        merge_lora(model)
    return model.to(device).eval()


def load_checkpoint_tokenizer(path: str | Path) -> CppTokenizer:
    """The tokenizer of a checkpoint (or a run directory's newest): its own tokenizer.json,
    else the tokenizer of the dataset named in the run's config.toml."""
    return read_checkpoint_tokenizer(resolve_checkpoint(path))


def read_checkpoint_tokenizer(checkpoint: Path) -> CppTokenizer:
    """:func:`load_checkpoint_tokenizer` of a checkpoint directory that
    :func:`resolve_checkpoint` returned (not verified again)."""
    own = checkpoint / TOKENIZER_FILE
    if own.is_file():
        return CppTokenizer.load(own)
    config = checkpoint.parent.parent / RUN_CONFIG_FILE
    try:
        table = read_toml_bounded(config, CONFIG_LIMIT, what="run config").get("data")
        data_dir = table["dir"] if isinstance(table, dict) else None
        if not isinstance(data_dir, str) or not data_dir:
            raise KeyError("[data] dir")
    except (MegaCppError, KeyError) as exc:
        raise CheckpointError(
            f"no tokenizer for checkpoint {checkpoint}: it has no {TOKENIZER_FILE}, and its "
            f"run's dataset cannot be read from {config} ({exc}); pass a tokenizer.json "
            "(--tokenizer)") from None
    dataset_tokenizer = Path(data_dir) / TOKENIZER_FILE
    if not dataset_tokenizer.is_file():
        raise CheckpointError(
            f"no tokenizer for checkpoint {checkpoint}: looked for {own} and for the run's "
            f"dataset tokenizer {dataset_tokenizer} (data.dir in {config}); neither exists. "
            "Pass a tokenizer.json (--tokenizer)")
    return CppTokenizer.load(dataset_tokenizer)
