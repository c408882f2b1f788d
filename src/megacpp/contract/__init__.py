"""megacpp.contract: the environment contract under every result.

- :func:`capture_fingerprint` -- what this machine and stack are (JSON-able dict);
- :func:`diff_fingerprints` -- which differences break comparability;
- :func:`device_profile` / :func:`mfu` -- known devices and MFU against the right peak;
- :func:`run_preflight` / :func:`require_preflight` -- known traps, checked before work;
- :func:`verify_site` -- installed packages against their RECORD hashes;
- :mod:`megacpp.contract.patches` -- explicit, revertible, in-memory patches.
"""

from megacpp.contract.config import ContractConfig, KernelSmem, load_contract_config
from megacpp.contract.devices import DeviceProfile, MfuResult, device_profile, mfu
from megacpp.contract.diff import Difference, contract_differences, diff_fingerprints
from megacpp.contract.fingerprint import (
    DEFAULT_CONTRACT_PACKAGES,
    capture_fingerprint,
    load_fingerprint,
    with_numerics,
)
from megacpp.contract.integrity import IntegrityReport, verify_site
from megacpp.contract.patches import applied_patches, apply_applicable, apply_patch, patched
from megacpp.contract.preflight import (
    PreflightError,
    PreflightInputs,
    PreflightReport,
    require_preflight,
    run_preflight,
    run_rules,
)

__all__ = [
    "DEFAULT_CONTRACT_PACKAGES",
    "ContractConfig",
    "DeviceProfile",
    "Difference",
    "IntegrityReport",
    "KernelSmem",
    "MfuResult",
    "PreflightError",
    "PreflightInputs",
    "PreflightReport",
    "applied_patches",
    "apply_applicable",
    "apply_patch",
    "capture_fingerprint",
    "contract_differences",
    "device_profile",
    "diff_fingerprints",
    "load_contract_config",
    "load_fingerprint",
    "mfu",
    "patched",
    "require_preflight",
    "run_preflight",
    "run_rules",
    "verify_site",
    "with_numerics",
]
