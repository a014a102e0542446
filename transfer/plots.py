"""PNG plots people look at instead of reading numbers: loss curves, LR schedule, confusion matrix."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from transfer.io_utils import atomic_path

__all__ = ["plot_history", "plot_lr_schedule", "plot_lr_find", "plot_confusion", "plot_sample_efficiency"]


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    _figure().close(fig)
    return Path(path)


def plot_history(rows: Sequence[dict], path: Path, title: str) -> Path:
    """Train/valid loss per epoch, one line per direction (rows carry a 'direction' key)."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    for direction in sorted({r.get("direction", "") for r in rows}):
        rs = [r for r in rows if r.get("direction", "") == direction]
        epochs = [r["epoch"] + 1 for r in rs]
        ax.plot(epochs, [r["train_loss"] for r in rs], "o-", label=f"{direction} train")
        if all("valid_loss" in r for r in rs):
            ax.plot(epochs, [r["valid_loss"] for r in rs], "s--", label=f"{direction} valid")
    ax.set(xlabel="epoch", ylabel="cross-entropy", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_lr_schedule(steps: Sequence[dict], path: Path, title: str) -> Path:
    """LR of the top layer group at every optimizer step."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s["step"] for s in steps], [s["lr"] for s in steps])
    ax.set(xlabel="optimizer step", ylabel="learning rate (top group)", title=title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_lr_find(results: Sequence[dict], path: Path, title: str) -> Path:
    """Smoothed loss against the top group's lr, one curve per phase; dot = suggested, cross = configured lr."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in results:
        (line,) = ax.plot(r["lrs"], r["losses"], label=f"phase {r['phase'] + 1}")
        for lr, marker in ((r["suggested_lr"], "o"), (r["lr"], "x")):
            if r["lrs"] and r["lrs"][0] <= lr <= r["lrs"][-1]:  # a curve cut short may not reach the lr
                i = min(range(len(r["lrs"])), key=lambda j: abs(r["lrs"][j] - lr))
                ax.plot(r["lrs"][i], r["losses"][i], marker, color=line.get_color(), markersize=8)
    ax.set_xscale("log")
    ax.set(xlabel="learning rate (top group)", ylabel="smoothed training loss", title=title)
    ax.legend(title="o suggested, x configured")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_confusion(matrix: Sequence[Sequence[int]], classes: Sequence[str], path: Path, title: str) -> Path:
    plt = _figure()
    k = len(classes)
    fig, ax = plt.subplots(figsize=(1.2 * k + 2.5, 1.2 * k + 2))
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(k), classes, rotation=45, ha="right")
    ax.set_yticks(range(k), classes)
    peak = max(max(r) for r in matrix) or 1
    for i in range(k):
        for j in range(k):
            ax.text(j, i, matrix[i][j], ha="center", va="center",
                    color="white" if matrix[i][j] > peak / 2 else "black")
    ax.set(xlabel="predicted", ylabel="true", title=title)
    return _save(fig, path)


def plot_sample_efficiency(rows: Sequence[dict], path: Path, title: str) -> Path:
    """Error against labelled examples (log x), mean and min-max band over seeds, one line per variant."""
    import numpy as np

    plt = _figure()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for variant in sorted({r["variant"] for r in rows}):
        budgets = sorted({r["n_labels"] for r in rows if r["variant"] == variant})
        errs = [[r["error"] for r in rows if r["variant"] == variant and r["n_labels"] == b] for b in budgets]
        mean = np.array([np.mean(e) for e in errs])
        ax.plot(budgets, 100 * mean, "o-", label=variant)
        ax.fill_between(budgets, [100 * min(e) for e in errs], [100 * max(e) for e in errs], alpha=0.15)
    ax.set_xscale("log")
    ax.set(xlabel="labelled training examples", ylabel="test error (%)", title=title)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)
