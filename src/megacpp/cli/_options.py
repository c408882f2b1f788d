"""Options shared by several commands, with one meaning everywhere."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from megacpp.errors import MegaCppError

DATA_BUILD_CONFIG_HELP = ("A data-build config: the path of a TOML with [corpus], [tokenizer], "
                          "[structure] and [packing] tables (as in configs/data/tiny.toml).")
CONTRACT_CONFIG_HELP = ("The path of a TOML with a [contract] table (packages, skip, kernels) "
                        "and optionally [preflight]; a run config has them.")
DEVICE_HELP = "auto (cuda when a GPU is present, else cpu), cpu, cuda or cuda:N."
DeviceOpt = Annotated[str, typer.Option("--device", help=DEVICE_HELP)]
_CUDA_INDEX = re.compile(r"^cuda:(\d{1,4})$")


def resolve_device(value: str, option: str = "--device") -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as the device to use; ``cuda`` where no GPU
    is present, or an unknown name, is a one-line error."""
    import torch

    if value == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cpu":
        return value
    match = _CUDA_INDEX.match(value)
    if value != "cuda" and match is None:
        raise MegaCppError(f"{option} {value!r}: choose auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise MegaCppError(f"{option} {value}: no CUDA device here (use auto or cpu)")
    if match is not None and int(match.group(1)) >= torch.cuda.device_count():
        raise MegaCppError(f"{option} {value}: this machine has {torch.cuda.device_count()} "
                           "CUDA device(s)")
    return value


def utf8_text(value: str, option: str) -> str:
    """``value`` of a command-line ``option`` if it is valid UTF-8: the shell hands Python
    arbitrary bytes, and a non-UTF-8 byte arrives as a lone surrogate (``\\udcff``)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = ord(value[exc.start]) - 0xDC00 if 0xDC80 <= ord(value[exc.start]) <= 0xDCFF else None
        what = f"byte 0x{byte:02x}" if byte is not None else "a lone surrogate"
        raise MegaCppError(f"{option} is not valid UTF-8 text ({what} at character "
                           f"{exc.start})") from None
    return value


FallbackOpt = Annotated[bool, typer.Option(
    "--fallback-to-previous", help="If the newest checkpoint of the run is incomplete or "
    "corrupt, use the newest intact one before it (otherwise that is an error).")]
TokenizerOpt = Annotated[Path | None, typer.Option(
    "--tokenizer", help="tokenizer.json (default: the checkpoint's own).")]
