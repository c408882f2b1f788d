"""The evidence layer's part of a TOML config: ``[contract]`` and ``[preflight]`` tables.

```toml
[contract]
packages = ["torch", "triton", "numpy"]   # replaces the default contract package list
extra_packages = ["my-kernels"]           # or: added to the default list

[preflight]
skip = ["inductor-big-gpu-gate"]           # rules to skip (recorded in receipts)

[[preflight.kernels]]                      # shared-memory needs of the chosen kernels
name = "mamba3_chunk_scan_fwd"
smem_bytes = 131072
```

Other tables in the same file (model, train...) are ignored here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from megacpp._config import read_toml
from megacpp.contract.fingerprint import DEFAULT_CONTRACT_PACKAGES, contract_packages
from megacpp.errors import ConfigError


@dataclass(frozen=True)
class KernelSmem:
    """A chosen kernel and the dynamic shared memory per block it declares it needs."""

    name: str
    smem_bytes: int


@dataclass(frozen=True)
class ContractConfig:
    """Contract package list, preflight rules to skip, kernel shared-memory needs."""

    packages: tuple[str, ...] = field(default_factory=lambda: tuple(contract_packages()))
    skip: tuple[str, ...] = ()
    kernels: tuple[KernelSmem, ...] = ()


def load_contract_config(path: str | os.PathLike[str] | None) -> ContractConfig:
    """Read ``[contract]``/``[preflight]`` from a TOML file; ``None`` -> defaults."""
    if path is None:
        return ContractConfig()
    data = read_toml(path, "config file")
    return config_from_dict(data, source=str(path))


def config_from_dict(data: dict[str, Any], *, source: str = "config") -> ContractConfig:
    """Validate the two tables of an already-parsed config."""
    contract = _table(data, "contract", source)
    preflight = _table(data, "preflight", source)
    if "packages" in contract and "extra_packages" in contract:
        raise ConfigError(f"{source}: [contract] takes 'packages' or 'extra_packages', not both")
    base = (
        _strings(contract, "packages", source, "contract")
        if "packages" in contract
        else list(DEFAULT_CONTRACT_PACKAGES)
    )
    extra = _strings(contract, "extra_packages", source, "contract")
    return ContractConfig(
        packages=tuple(contract_packages([*base, *extra])),
        skip=tuple(_strings(preflight, "skip", source, "preflight")),
        kernels=tuple(_kernels(preflight.get("kernels", []), source)),
    )


def _table(data: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{name}] must be a table")
    return table


def _strings(table: dict[str, Any], key: str, source: str, section: str) -> list[str]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{source}: [{section}] {key} must be a list of non-empty strings")
    return value


def _kernels(rows: Any, source: str) -> list[KernelSmem]:
    if not isinstance(rows, list):
        raise ConfigError(f"{source}: [[preflight.kernels]] must be an array of tables")
    kernels = []
    for index, row in enumerate(rows):
        name = row.get("name") if isinstance(row, dict) else None
        smem = row.get("smem_bytes") if isinstance(row, dict) else None
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{source}: preflight.kernels[{index}] needs a string 'name'")
        if not isinstance(smem, int) or isinstance(smem, bool) or smem < 0:
            raise ConfigError(
                f"{source}: preflight.kernels[{index}] ({name}) needs 'smem_bytes', "
                "a non-negative integer number of bytes"
            )
        kernels.append(KernelSmem(name, smem))
    return kernels


def parse_kernel_option(text: str) -> KernelSmem:
    """``"name=131072"`` (bytes) or ``"name=128KiB"`` from the command line."""
    name, sep, amount = text.partition("=")
    units = {"kib": 1024, "kb": 1024, "b": 1, "": 1}
    number = amount.strip().lower()
    unit = next((u for u in ("kib", "kb", "b") if number.endswith(u)), "")
    digits = number[: len(number) - len(unit)].strip()
    if not sep or not name.strip() or not digits.isdigit():
        raise ConfigError(
            f"--kernel {text!r}: expected NAME=BYTES or NAME=<n>KiB, e.g. attn_fwd=131072"
        )
    return KernelSmem(name.strip(), int(digits) * units[unit])
