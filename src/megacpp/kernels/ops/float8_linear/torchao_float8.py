"""torchao's float8 training (``torchao.float8``) as the FP8 GEMM backends: the recipe
configs, the module swap the training lane applies, and a functional form for tests.

torchao is imported on first use (an optional dependency: the ``fp8`` extra). Importing it
tries to load its CUDA extension libraries, which this project does not use (float8 training
is torch ops plus ``torch._scaled_mm``); where they cannot load (a CPU build of torch) it
logs a warning per library, which :func:`import_torchao` keeps out of the run's log."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.errors import ConfigError, describe_error
from megacpp.kernels.ops.float8_linear.reference import RECIPES

ALIGN = 16  # the float8 GEMM's dims must be multiples of this
_QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def import_torchao() -> Any:
    """``torchao.float8``, or a ConfigError naming the extra that installs it."""
    try:
        with _quiet():
            return importlib.import_module("torchao.float8")
    except ImportError as exc:
        raise ConfigError(f"parallel.float8 needs torchao ({exc}); install the fp8 extra: "
                          "pip install 'megacpp[fp8]'") from None
    except Exception as exc:  # noqa: BLE001 -- a torchao built for another torch fails its own ways
        raise ConfigError(f"parallel.float8: torchao does not import on torch "
                          f"{torch.__version__} ({describe_error(exc)}); the fp8 extra pins a "
                          "torchao for torch >= 2.11") from None


def float8_config(recipe: str, *, emulate: bool = False,
                  fsdp_float8_all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` of ``recipe`` (tensorwise | rowwise).

    ``emulate``: the casts and scales as on the GPU, the matmuls in high precision (any
    device; tests). ``fsdp_float8_all_gather``: FSDP2 all-gathers the weights in float8
    (tensorwise only: the row-wise weight scale spans the sharded dim)."""
    if recipe not in RECIPES:
        raise ConfigError(f"FP8 recipe {recipe!r} not one of {', '.join(RECIPES)}")
    float8 = import_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ConfigError("FSDP2 float8 all-gather needs the tensorwise recipe, not "
                          f"{recipe!r}")
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def convert_linears(model: nn.Module, config: Any,
                    keep: Callable[[nn.Module, str], bool]) -> None:
    """Swap every ``nn.Linear`` of ``model`` for which ``keep(module, name)`` is true for
    torchao's ``Float8Linear`` (in place; parameter names and values unchanged)."""
    float8 = import_torchao()
    float8.convert_to_float8_training(model, config=config, module_filter_fn=keep)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's Float8Linear (False when torchao is absent)."""
    cls = type(module)
    return cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.")


def linear_rows(layer: nn.Linear, x: Tensor, start: int, stop: int | None = None) -> Tensor:
    """x [..., K] @ layer.weight[start:stop]^T -> [..., rows]: one row slice of a linear
    layer's product, for mixers that split one projection into several GEMMs. Through the
    layer's float8 GEMM when the layer is torchao's Float8Linear and the slice's row count is
    a multiple of 16 (as the float8 GEMM needs; each slice gets its own weight scale), else
    ``F.linear`` (autocast's bf16)."""
    weight = layer.weight[start:stop]
    if not is_float8_linear(layer) or weight.shape[0] % ALIGN:
        return F.linear(x, weight)
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    if torch.is_autocast_enabled(x.device.type):  # as Float8Linear.forward casts its input
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return matmul_with_hp_or_float8_args.apply(x, weight.t(), layer.linear_mm_config,
                                               layer.config)


def float8_linear_torchao(x: Tensor, weight: Tensor, recipe: str = "tensorwise",
                          emulate: bool = False) -> Tensor:
    """x [..., K] @ weight [N, K]^T through a Float8Linear of ``recipe`` (differentiable in
    both; K and N multiples of 16). On the GPU the GEMMs are ``torch._scaled_mm``."""
    float8 = import_torchao()
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer = float8.float8_linear.Float8Linear.from_float(
        layer, config=float8_config(recipe, emulate=emulate))
    return torch.func.functional_call(layer, {"weight": weight}, (x,))


def float8_linear_tensorwise(x: Tensor, weight: Tensor) -> Tensor:
    return float8_linear_torchao(x, weight, "tensorwise")


def float8_linear_rowwise(x: Tensor, weight: Tensor) -> Tensor:
    return float8_linear_torchao(x, weight, "rowwise")
