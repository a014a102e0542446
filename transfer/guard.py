"""The divergence guard: in-memory snapshots within an epoch, and the rewind at half the lr when a loss spikes.

Its own module because it is a self-contained policy the loop (transfer/train.py) consults once a step;
`_hidden_state` is here too because a snapshot keeps the LSTM state just as a checkpoint does.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from transfer.errors import TransferError

if TYPE_CHECKING:  # annotations only: the loop imports this module
    from transfer.train import TrainHP

__all__ = ["Diverged"]


class Diverged(TransferError):
    """Training diverged more often than `max_recoveries` allows."""


def _hidden_state(model: nn.Module) -> list[list[torch.Tensor]] | None:
    hidden = getattr(model.encoder, "hidden", None)
    return None if hidden is None else [[h.cpu(), c.cpu()] for h, c in hidden]


class _DivergenceGuard:
    """Catches a diverging run within an epoch and rewinds it to an earlier state at half the lr.

    A step loss that is not finite, or above `hp.spike_factor` times the running mean of the loss (after 20
    steps), is a divergence. The guard keeps two in-memory snapshots, taken every 20 steps; a rewind restores
    the older one (20-40 steps back, before the weights went bad), halves the lr for the rest of the run and
    counts a recovery; past `hp.max_recoveries` it raises `Diverged`. The snapshots cost two copies of the
    weights and optimizer state; an LM's loss moves by a few % a step, so a doubling is not noise.
    """

    every, burn_in, beta = 20, 20, 0.9

    def __init__(self, hp: TrainHP):
        self.factor, self.max_recoveries = hp.spike_factor, hp.max_recoveries
        self.mean, self.n = 0.0, 0
        self.snaps: list[dict] = []

    def diverged(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        if self.factor is not None and self.n >= self.burn_in and loss > self.factor * self.mean_value():
            return True
        self.mean, self.n = self.beta * self.mean + (1 - self.beta) * loss, self.n + 1
        return False

    def snapshot(self, model: nn.Module, opt: torch.optim.Optimizer, pos: dict, acc: dict, n_steps: int) -> None:
        self.snaps = self.snaps[-1:] + [dict(
            model=copy.deepcopy(model.state_dict()), opt=copy.deepcopy(opt.state_dict()), pos=dict(pos),
            acc=dict(acc), n_steps=n_steps, rng=torch.get_rng_state(), hidden=_hidden_state(model))]

    def every_step(self, model: nn.Module, opt: torch.optim.Optimizer, pos: dict, acc: dict, n_steps: int) -> None:
        if pos["step_in_epoch"] % self.every == 0:
            self.snapshot(model, opt, pos, acc, n_steps)

    def rewind(self, model: nn.Module, opt: torch.optim.Optimizer, pos: dict, steps: list, desc: str,
               loss: float) -> dict:
        """Restore the oldest snapshot, halve the lr; returns the epoch's running totals as they were then."""
        where = f"{desc}: loss {loss:.4g} at step {pos['global_step']} (running mean {self.mean_value():.4g})"
        if pos["recoveries"] >= self.max_recoveries:
            raise Diverged(f"{where}: training diverged again after {pos['recoveries']} recoveries at a lower "
                           f"lr; lower the stage's lr or raise its warmup_min_steps")
        snap = self.snaps[0]
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["opt"])
        torch.set_rng_state(snap["rng"])
        if snap["hidden"] is not None:
            device = next(model.parameters()).device
            model.encoder.hidden = [(h.to(device), c.to(device)) for h, c in snap["hidden"]]
        elif hasattr(model, "reset"):
            model.reset()
        recoveries, lr_scale = pos["recoveries"] + 1, pos["lr_scale"] / 2
        pos.update(snap["pos"], recoveries=recoveries, lr_scale=lr_scale)
        del steps[snap["n_steps"]:]
        self.snaps = [snap]  # the running mean stays the healthy one from before the spike
        warnings.warn(f"{where}: diverged; rewound to step {pos['global_step']} and halved the lr "
                      f"(x{lr_scale:g} of the configured peak; recovery {recoveries} of {self.max_recoveries})",
                      stacklevel=2)
        return dict(snap["acc"])

    def mean_value(self) -> float:
        """The running mean of the healthy step losses, bias-corrected (an EMA that starts at 0)."""
        return self.mean / (1 - self.beta ** self.n) if self.n else float("nan")
