"""``megacpp model ...``: describe a hybrid model (params, FLOPs, cache) and translate patterns."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from megacpp.errors import MegaCppError
from megacpp.pattern import LayerPlan, format_plan, load
from megacpp.pattern.megatron import (
    MEGATRON_CORE_VERIFIED,
    MEGATRON_LM_ARGUMENTS_SOURCE,
    SYMBOL_KINDS,
    SYMBOLS,
    MegatronTranslation,
    to_megatron,
)

app = typer.Typer(add_completion=False, no_args_is_help=True)

_TARGETS = ("megatron",)
MAX_SEQ_LEN = 1 << 24  # tokens


@app.command()
def translate(
    pattern: Annotated[
        str, typer.Argument(help="A pattern such as '(AEME)x3 | AEMR', or a name (NAM56R).")
    ],
    to: Annotated[str, typer.Option("--to", help="Target framework: megatron.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
    num_experts: Annotated[
        int | None,
        typer.Option(help="Experts per MoE layer (E layers need it; the pattern does not fix it)."),
    ] = None,
    moe_router_topk: Annotated[
        int | None, typer.Option(help="Experts each token routes to (Megatron default: 2).")
    ] = None,
) -> None:
    """Translate a pattern into a framework's layer pattern and the flags it implies.

    Fails closed (exit 2) on layers without a verified mapping.
    """
    if to not in _TARGETS:
        raise MegaCppError(f"unknown translation target {to!r}; allowed: {', '.join(_TARGETS)}")
    plan = load(pattern)
    result = to_megatron(plan, num_experts=num_experts, moe_router_topk=moe_router_topk)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        _print_megatron(result, plan)


def _print_megatron(result: MegatronTranslation, plan: LayerPlan) -> None:
    console = Console(highlight=False)
    title = Text.assemble(
        ("Megatron-Core translation", "bold"), f" of {plan.format(compress=True)}"
    )
    console.print(title, soft_wrap=True)
    console.print(_mapping_table(plan.label_counts))
    console.print(
        f"[bold]hybrid_override_pattern[/] ({result.num_layers} layers, "
        f"stages {list(result.stage_sizes)}):"
    )
    console.print(result.hybrid_override_pattern, soft_wrap=True, markup=False)
    console.print("[bold]Megatron-LM flags:[/]")
    console.print(result.shell_command(), soft_wrap=True, markup=False)
    for note in result.notes:
        console.print(f"- {note}", markup=False)
    installed = result.installed_megatron_core or "not installed"
    console.print(
        f"[dim]verified against megatron-core {MEGATRON_CORE_VERIFIED} (installed: {installed}); "
        f"flag names from {MEGATRON_LM_ARGUMENTS_SOURCE}[/]"
    )


def _mapping_table(label_counts: dict[str, int]) -> Table:
    """One row per layer label present: our label, count, Megatron symbol and layer kind."""
    table = Table("ours", "layers", "megatron", "megatron layer kind")
    for label, symbol in SYMBOLS.items():
        if label in label_counts:
            table.add_row(label, str(label_counts[label]), repr(symbol), SYMBOL_KINDS[symbol])
    return table


@app.command()
def describe(
    pattern: Annotated[
        str | None,
        typer.Argument(help="Pattern string or name (NAM56R); defaults to the config's pattern."),
    ] = None,
    config: Annotated[
        str,
        typer.Option("--config", "-c", help="A model config: a preset name (tiny, "
                     "nam56r-small, ...) or the path of a model TOML ([model], [attention]... "
                     "tables, as in configs/tiny.toml)."),
    ] = "nam56r-small",
    seq_len: Annotated[
        int, typer.Option(help="Sequence length for attention/scan FLOP terms.")
    ] = 2048,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Per-layer table: params, active params, FLOPs/token, cache bytes/token, and totals."""
    import dataclasses

    from megacpp.model.config import load_config
    from megacpp.model.counting import count_model

    if not 0 < seq_len <= MAX_SEQ_LEN:
        raise MegaCppError(f"--seq-len must be positive and at most {MAX_SEQ_LEN}, got {seq_len}")
    cfg = load_config(config)
    if pattern is not None:
        cfg = dataclasses.replace(cfg, pattern=pattern)
    plan = load(cfg.pattern)
    cost = count_model(cfg, plan, seq_len=seq_len)
    if as_json:
        typer.echo(
            json.dumps({"pattern": format_plan(plan), "config": config, **cost.to_dict()}, indent=2)
        )
        return
    _print_cost_table(cost, title=f"{format_plan(plan)}  ({config}, seq_len={seq_len})")


def _print_cost_table(cost, title: str) -> None:
    table = Table(title=title, title_justify="left", show_footer=True)
    t = cost.to_dict()["totals"]
    cols = [
        ("#", "total", "right"),
        ("layer", "", "left"),
        ("stage", "", "right"),
        ("params", _si(t["params"]), "right"),
        ("active", _si(t["active_params"]), "right"),
        ("MFLOP/tok", f"{t['fwd_flops_per_token'] / 1e6:.2f}", "right"),
        ("KV/tok", _bytes(t["cache_bytes_per_token"]), "right"),
        ("state/seq", _bytes(t["state_bytes_per_sequence"]), "right"),
    ]
    for name, footer, justify in cols:
        table.add_column(name, footer=footer, justify=justify, no_wrap=True)
    table.add_row(
        "", "embedding", "", _si(cost.embedding_params), _si(cost.embedding_params), "0", "", ""
    )
    for name, params in (("structure embedding", cost.structure_params),
                         ("n-gram embedding", cost.ngram_params)):
        if params:  # gathers: no matmul FLOPs
            table.add_row("", name, "", _si(params), _si(params), "0", "", "")
    for layer in cost.layers:
        table.add_row(
            str(layer.index),
            layer.letter,
            str(layer.stage),
            _si(layer.params),
            _si(layer.active_params),
            f"{layer.fwd_flops_per_token / 1e6:.2f}",
            _bytes(layer.cache_bytes_per_token) if layer.cache_bytes_per_token else "",
            _bytes(layer.state_bytes) if layer.state_bytes else "",
        )
    head = "lm_head (tied)" if cost.head_params == 0 else "lm_head"
    table.add_row(
        "",
        head,
        "",
        _si(cost.head_params),
        _si(cost.head_params),
        f"{cost.head_flops_per_token / 1e6:.2f}",
        "",
        "",
    )
    console = Console(width=max(Console().width, 100))
    console.print(table)
    gqa = sum(layer.gqa_cache_bytes_per_token for layer in cost.layers if layer.family == "A")
    if gqa != t["cache_bytes_per_token"]:
        console.print(
            f"attention cache: {_bytes(t['cache_bytes_per_token'])}/token vs "
            f"{_bytes(gqa)}/token if every A layer were A:gqa (MLA/DSA cache a compressed latent)"
        )
    console.print(
        f"training FLOPs/token (3 x forward): {t['train_flops_per_token'] / 1e9:.3f} GFLOP; "
        f"parameters: {t['params']:,} total, {t['active_params']:,} active; "
        "KV = attention cache (bf16), state = M/R recurrent state (fp32)"
    )


def _si(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
