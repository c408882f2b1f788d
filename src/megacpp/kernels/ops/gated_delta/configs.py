"""Launch settings of the gated delta rule's kernels, by device: ``configs.json`` beside this
file, which ``benchmarks/gated_delta_tune.py --write`` rewrites for the device it ran on
(read-only at run time).

Per kernel: ``bv`` value columns per tile (64 when unset; clamped to [32, V rounded up to a
power of two]), ``bks`` key columns per slice of ``_bwd_key`` / ``_bwd_fin`` (clamped to
[32, K rounded up]), the Triton launch options, and ``_bwd_state``'s ``prefetch`` (issue the
loads that feed no product a chunk ahead; the kernel's default, on, when unset).
``small_grid`` replaces the state passes' settings when their [V / BV, B * H] grid has fewer
programs than the device has SMs (nam56r: 64 programs of BV 64 on 132 SMs): narrower tiles,
more programs, and for ``_fwd_state`` two warps (likely because two warps take mma.sync, not
the four-warp wgmma, for its chain of dependent products; not profiled). On the H100,
CUDA-graph replays: about -20 us (``_fwd_state``) and -5 us (``_bwd_state``) of 0.72 ms at
nam56r 4k; at H16 (256 programs) BV 32 costs +50..80 us.

The shipped settings come from ``gated_delta_tune.py --quick --graph`` sweeps on an H100
(nam56r 4k and H16 K = V = 128 4k, CUDA-graph replays), with two rules every setting must
keep (checked here, on Triton 3.6):

* ``fwd_state`` at ``num_stages`` >= 2: at 1, with bf16 products at K = V = 128, it hit an
  illegal memory access, and in another build gave a wrong state and output (35% off,
  compute-sanitizer memcheck and racecheck clean): a miscompile.
* ``bwd_key`` at ``num_stages`` 1: at 2 (the sweeps' pick), two bf16 fwd+bwd at H16
  K = V = 128 (two key slices) gave dk, dg, d_beta differing by up to 0.05, 0.03, 0.01; of
  nine single-kernel launch edits only this one made four runs bit-identical (a race in the
  pipelined loads, not root-caused; no measurable cost).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType

from megacpp._config import check_keys
from megacpp.errors import ConfigError
from megacpp.kernels.launch import Launch, read_table, write_entry

TABLE = Path(__file__).with_name("configs.json")
KERNELS = ("fwd_intra", "fwd_state", "fwd_out", "bwd_dv_local", "bwd_state", "bwd_val",
           "bwd_key", "bwd_fin")
STATE_PASSES = ("fwd_state", "bwd_state")  # the [V / BV, B * H] grids
SLICED = ("bwd_key", "bwd_fin")  # the kernels that take a key slice (bks)


@dataclass(frozen=True)
class KernelLaunch:
    num_warps: int
    num_stages: int
    bv: int | None = None
    bks: int | None = None
    prefetch: bool | None = None

    def launch(self) -> Launch:
        return Launch(num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class GatedDeltaConfig:
    """Every kernel's setting (``kernels``) and the state passes' small-grid ones."""

    kernels: Mapping[str, KernelLaunch]
    small_grid: Mapping[str, KernelLaunch]

    def __post_init__(self) -> None:
        _check(self)


def _check(config: GatedDeltaConfig) -> None:
    def fail(why: str) -> None:
        raise ConfigError(f"gated_delta launch settings: {why}")

    if set(config.kernels) != set(KERNELS):
        fail(f"need exactly the kernels {list(KERNELS)}, got {sorted(config.kernels)}")
    if not set(config.small_grid) <= set(STATE_PASSES):
        fail(f"small_grid takes only {list(STATE_PASSES)}, got {sorted(config.small_grid)}")
    for where, table in (("kernels", config.kernels), ("small_grid", config.small_grid)):
        for name, launch in table.items():
            if (launch.bks is not None) != (name in SLICED):
                fail(f"{where}.{name}: bks is set exactly for {list(SLICED)}")
            if launch.prefetch is not None and name != "bwd_state":
                fail(f"{where}.{name}: only bwd_state takes prefetch")
            if name == "fwd_state" and launch.num_stages < 2:
                fail(f"{where}.fwd_state: num_stages {launch.num_stages} < 2 (miscompiled)")
            if name == "bwd_key" and launch.num_stages != 1:
                fail(f"{where}.bwd_key: num_stages {launch.num_stages} != 1 (its pipelined "
                     "loads race)")


def _launch(entry: object, where: str) -> KernelLaunch:
    names = [f.name for f in fields(KernelLaunch)]
    table = check_keys(entry, names, where)
    ints = {k: v for k, v in table.items() if k != "prefetch"}
    if any(type(v) is not int or v < 1 for v in ints.values()) or not {
            "num_warps", "num_stages"} <= set(table):
        raise ConfigError(f"{where}: needs num_warps and num_stages, every value a positive "
                          f"integer (prefetch: true or false), got {table}")
    if "prefetch" in table and type(table["prefetch"]) is not bool:
        raise ConfigError(f"{where}.prefetch: true or false, got {table['prefetch']!r}")
    return KernelLaunch(**table)


def _parse(entry: object, where: str) -> GatedDeltaConfig:
    table = check_keys(entry, ("kernels", "small_grid"), where)
    parts = {}
    for part in ("kernels", "small_grid"):
        launches = check_keys(table.get(part, {}), KERNELS, f"{where}.{part}")
        parts[part] = MappingProxyType({name: _launch(launch, f"{where}.{part}.{name}")
                                        for name, launch in launches.items()})
    return GatedDeltaConfig(**parts)


CONFIGS = read_table(TABLE, _parse)


def to_json(config: GatedDeltaConfig) -> dict:
    """``config`` as its ``configs.json`` entry (unset fields left out)."""
    def launch(entry: KernelLaunch) -> dict:
        return {f.name: getattr(entry, f.name) for f in fields(KernelLaunch)
                if getattr(entry, f.name) is not None}
    return {part: {name: launch(entry) for name, entry in getattr(config, part).items()}
            for part in ("kernels", "small_grid")}


def write_config(device_key: str, config: GatedDeltaConfig) -> None:
    """Record ``config`` as the setting of devices ``device_key`` in ``configs.json``."""
    write_entry(TABLE, device_key, to_json(config))
