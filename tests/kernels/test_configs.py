"""The catalog's layout and the kernels' launch settings as data: every ``ops/<surface>/``
declares its own entry, named as its folder; every ``configs.py`` is a read-only table of
frozen settings by device with a default; the JSON tables the tuners write parse, refuse what
the kernels cannot run, and round-trip; no mutable dict or list steers a kernel."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
from pathlib import Path
from types import MappingProxyType

import pytest

from megacpp.errors import ConfigError
from megacpp.kernels import ops
from megacpp.kernels.launch import DEFAULT, device_key, for_key, read_table, write_entry
from megacpp.kernels.registry import SURFACES, default_catalog

OPS = Path(ops.__file__).parent
NOT_SURFACES: set[str] = set()  # op folders without a catalog surface


def _op_packages() -> list[str]:
    return sorted(info.name for info in pkgutil.iter_modules(ops.__path__) if info.ispkg)


def test_each_op_folder_declares_the_surface_it_is_named_after():
    assert sorted(SURFACES) == sorted(set(_op_packages()) - NOT_SURFACES)
    catalog = default_catalog()
    assert list(catalog.surfaces) == list(SURFACES)  # the registry's order
    for name in SURFACES:
        spec = importlib.import_module(f"megacpp.kernels.ops.{name}.spec")
        assert spec.SURFACE.name == name
        assert spec.BACKENDS and {b.surface for b in spec.BACKENDS} == {name}
        assert catalog.of(name) == list(spec.BACKENDS)
    for name in NOT_SURFACES:
        assert not (OPS / name / "spec.py").exists()


def _config_modules():
    return [importlib.import_module(f"megacpp.kernels.ops.{p.parent.name}.configs")
            for p in sorted(OPS.glob("*/configs.py"))]


def test_every_configs_table_is_read_only_frozen_and_has_a_default():
    modules = _config_modules()
    assert {m.__name__.split(".")[3] for m in modules} >= {
        "rmsnorm", "linear_cross_entropy", "moe_experts", "document_attention", "mamba3_scan",
        "short_conv", "gated_delta", "muon_momentum", "muon_apply", "muon_polynomial",
        "sparse_attention"}
    for module in modules:
        tables = [v for k, v in vars(module).items() if k.endswith("CONFIGS")]
        assert tables, module.__name__
        for table in tables:
            assert isinstance(table, MappingProxyType) and DEFAULT in table, module.__name__
            with pytest.raises(TypeError):
                table["9.0"] = table[DEFAULT]  # type: ignore[index]
            for entry in table.values():
                field = dataclasses.fields(entry)[0].name
                with pytest.raises(dataclasses.FrozenInstanceError):
                    setattr(entry, field, getattr(entry, field))


def test_no_module_of_the_kernels_holds_a_mutable_dict_or_list():
    """Launch settings are read-only data: a module-level dict or list under
    megacpp.kernels.ops would be a table some code could change at run time."""
    found, checked = [], 0
    for info in pkgutil.walk_packages(ops.__path__, prefix=f"{ops.__name__}."):
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # the kernel modules, where triton is absent (CI)
            if exc.name != "triton":
                raise
            continue
        checked += 1
        found += [f"{info.name}.{name}" for name, value in vars(module).items()
                  if type(value) in (dict, list) and not name.startswith("__")]
    assert checked >= 30 and not found


def test_device_keys_fall_back_to_the_default_entry():
    import torch

    table = MappingProxyType({DEFAULT: "any", "9.0": "hopper"})
    assert for_key(table, "9.0") == "hopper" and for_key(table, "8.0") == "any"
    assert device_key(torch.device("cpu")) == DEFAULT  # the interpreter takes the default


def _copy(tmp_path: Path, op: str) -> Path:
    path = tmp_path / f"{op}.json"
    path.write_text((OPS / op / "configs.json").read_text())
    return path


def test_gated_delta_table_round_trips_and_refuses_what_miscompiles(tmp_path):
    from megacpp.kernels.ops.gated_delta import configs

    path = _copy(tmp_path, "gated_delta")
    shipped = configs.CONFIGS[DEFAULT]
    write_entry(path, "9.0", configs.to_json(shipped))
    table = read_table(path, configs._parse)
    assert table["9.0"] == shipped and table[DEFAULT] == shipped
    data = json.loads(path.read_text())
    bad = [("fwd_state", {"num_stages": 1}, "num_stages 1 < 2"),
           ("bwd_key", {"num_stages": 2}, "its pipelined loads race"),
           ("fwd_out", {"bks": 64}, "bks is set exactly for"),
           ("fwd_out", {"prefetch": True}, "only bwd_state takes prefetch"),
           ("fwd_out", {"num_warps": 0}, "positive integer"),
           ("fwd_out", {"num_warp": 4}, r"unknown key\(s\) \['num_warp'\]")]
    for kernel, change, message in bad:
        entry = json.loads(json.dumps(data[DEFAULT]))
        entry["kernels"][kernel].update(change)
        with pytest.raises(ConfigError, match=message):
            configs._parse(entry, "test")
    entry = json.loads(json.dumps(data[DEFAULT]))
    del entry["kernels"]["bwd_fin"]
    with pytest.raises(ConfigError, match="need exactly the kernels"):
        configs._parse(entry, "test")


def test_rmsnorm_table_round_trips_and_refuses_bad_entries(tmp_path):
    from megacpp.kernels.ops.rmsnorm import configs

    path = _copy(tmp_path, "rmsnorm")
    shipped = configs.CONFIGS[DEFAULT]
    faster = dataclasses.replace(shipped, fwd_rows=4)
    write_entry(path, "9.0", dataclasses.asdict(faster))
    table = read_table(path, configs._parse)
    assert table["9.0"] == faster and table[DEFAULT] == shipped
    for change in ({"fwd_rows": 0}, {"fwd_rows": 2.0}, {"bwd_rows": 4}):
        entry = {**dataclasses.asdict(shipped), **change}
        with pytest.raises(ConfigError):
            configs._parse(entry, "test")
    path.write_text(json.dumps({"9.0": dataclasses.asdict(shipped)}))
    with pytest.raises(ConfigError, match="'default' entry"):
        read_table(path, configs._parse)
