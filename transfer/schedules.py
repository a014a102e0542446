"""Learning-rate schedules: slanted triangular (ULMFiT eq. 3), one-cycle, discriminative LRs."""

from __future__ import annotations

import math

__all__ = ["slanted_triangular_lr", "one_cycle_lr", "discriminative_lrs", "lr_at"]


def slanted_triangular_lr(step: int, total_steps: int, lr_max: float, cut_frac: float = 0.1,
                          ratio: float = 32) -> float:
    """ULMFiT's STLR: a short linear warm-up over `cut_frac` of the steps, then a long linear decay.

    cut = floor(T * cut_frac); p = t/cut if t < cut else 1 - (t - cut)/(cut * (1/cut_frac - 1));
    lr = lr_max * (1 + p * (ratio - 1)) / ratio, so the lowest LR is lr_max/ratio.
    """
    cut = max(1, math.floor(total_steps * cut_frac))
    if step < cut:
        p = step / cut
    else:
        p = 1 - (step - cut) / (cut * (1 / cut_frac - 1))
    p = max(p, 0.0)
    return lr_max * (1 + p * (ratio - 1)) / ratio


def one_cycle_lr(step: int, total_steps: int, lr_max: float, pct_start: float = 0.25,
                 div: float = 25.0, div_final: float = 1e5) -> float:
    """fastai's one-cycle: cosine from lr_max/div up to lr_max, then cosine down to lr_max/div_final."""
    warm = max(1, round(total_steps * pct_start))

    def cos(start: float, end: float, pct: float) -> float:
        return end + (start - end) / 2 * (1 + math.cos(math.pi * min(max(pct, 0.0), 1.0)))

    if step < warm:
        return cos(lr_max / div, lr_max, step / warm)
    return cos(lr_max, lr_max / div_final, (step - warm) / max(1, total_steps - warm))


def lr_at(schedule: str, step: int, total_steps: int, lr_max: float, cut_frac: float = 0.1,
          ratio: float = 32) -> float:
    """The LR multiplier-free value of the named schedule ("stlr" or "one_cycle") at `step`."""
    if schedule == "stlr":
        return slanted_triangular_lr(step, total_steps, lr_max, cut_frac, ratio)
    if schedule == "one_cycle":
        return one_cycle_lr(step, total_steps, lr_max)
    raise ValueError(f"unknown schedule {schedule!r}")


def discriminative_lrs(lr: float, n_groups: int, decay: float = 2.6) -> list[float]:
    """Per-group LRs, lowest group first: the top group gets `lr`, each group below it `/decay` more."""
    return [lr / decay ** (n_groups - 1 - i) for i in range(n_groups)]
