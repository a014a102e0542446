"""Language-model training on the loop: pretraining, fine-tuning (frozen first, then all), and perplexity.

The step loss adds AR and TAR to the cross-entropy; validation reads a whole stream at a fixed bptt.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from transfer.data import LMLoader
from transfer.device import autocast
from transfer.model import LanguageModel
from transfer.train import FinetuneHP, Phase, StepLoss, TrainHP, fit

__all__ = ["lm_perplexity", "pretrain_lm", "finetune_lm"]


def _lm_step(alpha: float, beta: float) -> StepLoss:
    def step(model: LanguageModel, batch: tuple) -> tuple[torch.Tensor, int, float]:
        x, y, lr_scale = batch
        device = next(model.parameters()).device
        x, y = x.to(device), y.to(device)
        logits, raw, dropped = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        if alpha:
            loss = loss + alpha * dropped.float().pow(2).mean()
        if beta and raw.size(1) > 1:
            loss = loss + beta * (raw[:, 1:] - raw[:, :-1]).float().pow(2).mean()
        return loss, y.numel(), lr_scale
    return step


@torch.no_grad()
def lm_perplexity(model: LanguageModel, loader: LMLoader, precision: str = "auto") -> dict[str, float]:
    """Validation loss and perplexity over a whole stream (fixed bptt, eval mode, fresh state)."""
    model.eval()
    model.reset()
    device = next(model.parameters()).device
    total, n = 0.0, 0
    for x, y, _ in loader.batches(0):
        with autocast(device, precision):
            logits, _, _ = model(x.to(device))
        total += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1),
                                 reduction="sum").item()
        n += y.numel()
    model.reset()
    loss = total / max(n, 1)
    return dict(valid_loss=loss, valid_ppl=math.exp(min(loss, 50)))


def _fit_lm(model: LanguageModel, phases: list[Phase], train: LMLoader, valid: LMLoader | None, hp: TrainHP,
            **kw) -> list[dict[str, float]]:
    validate = (lambda m: lm_perplexity(m, valid, hp.precision)) if valid is not None else None
    return fit(model, phases, train.batches, lambda e: len(train.seq_lens(e)), _lm_step(hp.alpha, hp.beta),
               validate, hp, unit="tok", **kw)


def pretrain_lm(model: LanguageModel, train: LMLoader, valid: LMLoader | None, hp: TrainHP, desc: str = "pretrain",
                **kw) -> list[dict[str, float]]:
    """Train every layer for `hp.epochs` epochs; history rows hold valid_ppl when `valid` is given."""
    return _fit_lm(model, [Phase(0, hp.epochs)], train, valid, hp, desc=desc, **kw)


def finetune_lm(model: LanguageModel, train: LMLoader, valid: LMLoader | None, hp: FinetuneHP,
                desc: str = "finetune_lm", **kw) -> list[dict[str, float]]:
    """`hp.freeze_epochs` with only embedding + decoder trainable, then `hp.epochs` with everything."""
    phases = [Phase(-1, hp.freeze_epochs)] if hp.freeze_epochs else []
    return _fit_lm(model, phases + [Phase(0, hp.epochs)], train, valid, hp, desc=desc, **kw)
