"""How much memory a device has free, and the check every cache makes before it allocates."""

from __future__ import annotations

import torch

from megacpp._io import describe_size
from megacpp.errors import MegaCppError


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device, or the host's available memory (Linux); None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(need: int, device: torch.device, what: str, advice: str) -> None:
    """MegaCppError when ``need`` bytes (``what``) exceed what ``device`` has available: a
    one-line refusal instead of an allocation that fails, or that the kernel's OOM killer
    answers."""
    free = available_memory_bytes(device)
    if free is not None and need > free:
        raise MegaCppError(f"{what} needs {describe_size(need)}; {device} has "
                           f"{describe_size(free)} available: {advice}")
