"""The project's catalog: every surface's entry, collected from ``ops/<surface>/spec.py``
(each declares its ``SURFACE`` and ``BACKENDS``). :func:`default_catalog` is the one instance
the CLI, the model and the benchmarks use."""

from __future__ import annotations

import functools
import importlib

from megacpp.kernels.catalog import Catalog

# The surfaces in catalog order: ``megacpp kernels list`` shows them in this order, and a
# surface's chosen rows are tried in the order its spec lists them.
SURFACES = (
    "rmsnorm",
    "linear_cross_entropy",
    "float8_linear",
    "moe_experts",
    "attention",
    "document_attention",
    "sparse_attention",
    "paged_attention_decode",
    "mamba3_scan",
    "mamba3_step",
    "mamba3_mimo_scan",
    "short_conv",
    "gated_delta",
    "gated_delta_step",
    "muon_momentum",
    "muon_apply",
    "muon_polynomial",
)


@functools.cache
def default_catalog() -> Catalog:
    """The catalog of this tree (built once)."""
    specs = [importlib.import_module(f"megacpp.kernels.ops.{name}.spec") for name in SURFACES]
    catalog = Catalog()
    for spec in specs:
        catalog.add_surface(spec.SURFACE)
    for spec in specs:
        for backend in spec.BACKENDS:
            catalog.add(backend)
    return catalog
