"""Progress of a training epoch: a bar in a terminal, a plain line every few seconds elsewhere (CI logs, nohup).

Listeners (`subscribe`) receive the same figures as the lines, so the orchestration layer can log them as
step metrics without the training loop knowing who listens.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Callable, Iterator

from tqdm.auto import tqdm

__all__ = ["EpochProgress", "subscribe", "every_seconds"]

_listeners: list[Callable[[dict], None]] = []


def every_seconds() -> float:
    """Seconds between plain progress lines (`TRANSFER_PROGRESS_SECONDS`, default 30)."""
    try:
        return max(float(os.environ.get("TRANSFER_PROGRESS_SECONDS", "30")), 0.0)
    except ValueError:
        return 30.0


@contextlib.contextmanager
def subscribe(listener: Callable[[dict], None]) -> Iterator[None]:
    """Call `listener(event)` at every progress report inside the block.

    event: name (the run, e.g. "pretrain fwd"), desc (with the epoch), step and total of the epoch, global_step,
    loss (the epoch's running mean), rate (items/s), unit, eta_s.
    """
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class EpochProgress:
    """One epoch's progress; `enabled=False` is silent (listeners still hear it)."""

    def __init__(self, desc: str, total: int, initial: int, unit: str, enabled: bool = True, name: str = ""):
        self.desc, self.total, self.unit, self.name = desc, total, unit, name or desc
        self.tty = enabled and sys.stderr.isatty()
        self.lines = enabled and not self.tty
        self.every = every_seconds()
        self.start, self.start_step = time.perf_counter(), initial
        self.last = self.start
        self.bar = tqdm(total=total, initial=initial, desc=desc, leave=False, file=sys.stderr) if self.tty else None

    def update(self, step: int, global_step: int, loss: float, rate: float) -> None:
        """After optimizer step `step` of the epoch (1-based); `loss` is the epoch's running mean."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", **{f"{self.unit}/s": f"{rate:,.0f}"})
        now = time.perf_counter()
        if now - self.last < self.every and step < self.total:
            return
        self.last = now
        done = step - self.start_step
        eta = (now - self.start) / done * (self.total - step) if done else float("nan")
        event = dict(name=self.name, desc=self.desc, step=step, total=self.total, global_step=global_step, loss=loss, rate=rate,
                     unit=self.unit, eta_s=eta)
        if self.lines:
            eta_text = _duration(eta) if eta == eta else "?"
            print(f"{self.desc}: step {step:,}/{self.total:,} ({100 * step / max(self.total, 1):.0f}%), loss "
                  f"{loss:.3f}, {rate:,.0f} {self.unit}/s, ETA {eta_text}", file=sys.stderr, flush=True)
        for listener in list(_listeners):
            listener(event)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
