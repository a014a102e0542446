"""`transfer status` on a terminal: the stages' table and the sweep's line (transfer/status.py gathers the facts)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from transfer.status import describe_sweep, format_duration

__all__ = ["print_status"]

COLOUR = {"done": "green", "training": "yellow", "waiting": "dim", "not started": "dim"}


def print_status(stages: list[dict], sweep: dict | None, held: bool) -> None:
    """One row per stage (done with its headline, training with step, epoch and ETA, waiting, not started),
    then the sweep's progress; `held`: a transfer process holds the workspace lock."""
    t = Table(title=f"workspace {Path.cwd()}")
    for col in ("stage", "state", "details"):
        t.add_column(col)
    for s in stages:
        lines = [s["summary"]] if s["summary"] and s["state"] == "done" else []
        if s["summary"] and s["state"] == "waiting":
            lines = [f"[dim]earlier run: {s['summary']}[/]"]
        finished = [c["name"] for c in s["checkpoints"] if c["finished"] and not c["earlier_run"]]
        earlier = [c["name"] for c in s["checkpoints"] if c["earlier_run"]]
        if s["state"] == "training" and finished:
            lines.append(f"finished: {', '.join(finished)}")
        if earlier:
            lines.append(f"[dim]from the earlier run, replaced as this one reaches them: {', '.join(earlier)}[/]")
        for c in s["checkpoints"]:
            if c.get("unreadable"):
                lines.append(f"[red]unreadable checkpoint[/] {escape(c['unreadable'])}")
                continue
            if c["finished"] or c["earlier_run"]:
                continue
            total, epochs_in_all = c["total_steps"], c["total_epochs"]
            of = f"/{total:,} ({100 * c['step'] / max(total, 1):.0f}%)" if total else ""
            # the epoch in progress; a checkpoint written after the last epoch, before the finished one, has none
            epoch = c["epochs_done"] + 1 if not epochs_in_all else min(c["epochs_done"] + 1, epochs_in_all)
            epochs = f", epoch {epoch}" + (f"/{epochs_in_all}" if epochs_in_all else "")
            eta = f", ~{format_duration(c['eta_s'])} to go" if c["eta_s"] is not None else ""
            lines.append(f"{c['name']}: step {c['step']:,}{of}{epochs}, {format_duration(c['train_s'])} trained{eta}")
        t.add_row(s["stage"], f"[{COLOUR[s['state']]}]{s['state']}[/]", "\n".join(lines))
    out = Console()
    out.print(t)
    if sweep is not None:
        out.print(describe_sweep(sweep, running=held))
