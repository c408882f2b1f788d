"""The presets that ship inside the package, read through :mod:`importlib.resources` so an
installed wheel finds them wherever it runs.

Three kinds, one folder each::

    models/*.toml   model presets     (megacpp model describe NAM56R --config tiny)
    runs/*.toml     run configs       (megacpp train --config tiny-cpu)
    data/*.toml     data build configs (megacpp data build SRC --out DIR --config tiny)

Everywhere a config is taken, a name picks the shipped preset and a path (an existing file,
or anything ending in ``.toml``) picks that file.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from megacpp.errors import ConfigError

KINDS = {"model": "models", "run": "runs", "data": "data"}
_WHAT = {"model": "model preset", "run": "run config", "data": "data build config"}


def folder(kind: str) -> Traversable:
    """The shipped folder of ``kind`` (``model``, ``run`` or ``data``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown config kind {kind!r}; kinds: {sorted(KINDS)}")
    return resources.files(__name__) / KINDS[kind]


def names(kind: str) -> list[str]:
    """The shipped presets of ``kind``, sorted."""
    return sorted(entry.name.removesuffix(".toml") for entry in folder(kind).iterdir()
                  if entry.name.endswith(".toml"))


def is_path(name_or_path: str | Path) -> bool:
    """True when ``name_or_path`` names a file rather than a shipped preset."""
    path = Path(name_or_path)
    return path.suffix == ".toml" or path.exists()


def shipped(kind: str, name: str | Path) -> str | None:
    """The TOML text of the shipped preset ``name`` of ``kind``; None when there is none."""
    entry = folder(kind) / f"{name}.toml"
    return entry.read_text(encoding="utf-8") if entry.is_file() else None


def unknown(kind: str, name: str | Path) -> ConfigError:
    """The error for a name that is neither a file nor a shipped preset of ``kind``."""
    return ConfigError(f"unknown {_WHAT[kind]} {str(name)!r}; shipped: {', '.join(names(kind))} "
                       "(or pass a path to a .toml file)")
