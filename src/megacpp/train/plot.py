"""PNG plots of a run: loss (train and validation) and throughput, from ``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megacpp.errors import MegaCppError
from megacpp.train.metrics import METRICS_FILE, read_metrics

PLOTS_DIR = "plots"


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``loss.png`` and ``throughput.png`` for ``run_dir``; returns their paths."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise MegaCppError(f"{run_dir} is not a training run directory: {METRICS_FILE} not found")
    records = read_metrics(metrics_path, tolerate_partial=True)
    train = [r for r in records if r.get("type") == "train"]
    if not train:
        raise MegaCppError(f"{metrics_path} has no training steps to plot")
    val = [r for r in records if r.get("type") == "val" and r.get("val_loss") is not None]
    _check_numbers(metrics_path, train, ("loss", "tokens_per_s"), ("mfu",))
    _check_numbers(metrics_path, val, ("val_loss",), ())
    out = Path(out_dir) if out_dir is not None else run_dir / PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    return [_plot_loss(train, val, out / "loss.png", run_dir.name),
            _plot_throughput(train, out / "throughput.png", run_dir.name)]


def _check_numbers(path: Path, records: list[dict[str, Any]], required: tuple[str, ...],
                   optional: tuple[str, ...]) -> None:
    """Each record's plotted fields are numbers (``optional`` ones may be null)."""
    for r in records:
        for key in (*required, *optional):
            value = r.get(key)
            if value is None and key in optional:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise MegaCppError(f"{path}: step {r['step']} has {key} = {value!r:.40}, not a "
                                   "number")


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_loss(train: list[dict[str, Any]], val: list[dict[str, Any]], path: Path,
               title: str) -> Path:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-",
                label="validation loss")
    spikes = [r for r in train if r.get("spike")]
    if spikes:
        ax.scatter([r["step"] for r in spikes], [r["loss"] for r in spikes], color="red",
                   zorder=3, label="loss spike")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"{title}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, plt, path)


def _plot_throughput(train: list[dict[str, Any]], path: Path, title: str) -> Path:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [r["step"] for r in train]
    ax.plot(steps, [r["tokens_per_s"] for r in train], lw=1, label="tokens/s")
    ax.set(xlabel="step", ylabel="tokens/s", title=f"{title}: throughput")
    ax.grid(alpha=0.3)
    mfu = [(r["step"], r["mfu"]) for r in train if r.get("mfu") is not None]
    if mfu:
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in mfu], [100 * m for _, m in mfu], color="tab:orange", lw=1,
                 label="MFU %")
        ax2.set_ylabel("MFU (%)")
        ax2.legend(loc="lower right")
    else:
        ax.text(0.01, 0.02, "MFU n/a (no known peak for this device/dtype)",
                transform=ax.transAxes, fontsize=8, color="gray")
    ax.legend(loc="upper left")
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:  # matplotlib Figure and pyplot
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
