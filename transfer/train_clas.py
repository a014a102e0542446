"""Classifier training on the loop: gradual unfreezing, BatchNorm recalibration, inference, and the LR finder.

The LR finder is here because its one caller sweeps the classifier's unfreezing phases (`classifier_lr_find`);
`lr_find` itself takes any model and step loss.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from transfer import distributed
from transfer.data import ClassificationLoader
from transfer.device import autocast, pick_device
from transfer.model import TextClassifier, freeze_to, layer_groups
from transfer.schedules import discriminative_lrs
from transfer.train import ClassifierHP, Phase, StepLoss, fit

__all__ = [
    "class_weights", "classifier_logits", "pooled_features", "unfreezing_phases", "recalibrate_batchnorm",
    "train_classifier", "lr_find", "valley_lr", "classifier_lr_find",
]


def _clas_step(model: TextClassifier, batch: tuple, weight: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, int, float]:
    x, lengths, y, _ = batch
    device = next(model.parameters()).device
    logits = model(x.to(device), lengths.to(device))
    w = None if weight is None else weight.to(device)
    return F.cross_entropy(logits.float(), y.to(device), weight=w), len(y), 1.0


def class_weights(labels: np.ndarray, n_classes: int) -> torch.Tensor:
    """Inverse class frequency, normalised so a balanced set gets weight 1 for every class."""
    counts = np.bincount(labels.astype(np.int64), minlength=n_classes).astype(np.float64)
    return torch.tensor(len(labels) / (n_classes * np.maximum(counts, 1)), dtype=torch.float32)


@torch.no_grad()
def classifier_logits(model: TextClassifier, loader: ClassificationLoader, precision: str = "auto") -> np.ndarray:
    """Logits (n_docs, n_classes) in the loader's document order."""
    model.eval()
    device = next(model.parameters()).device
    out = np.zeros((len(loader.docs), model.n_classes), dtype=np.float32)
    for x, lengths, _, idx in loader.batches():
        with autocast(device, precision):
            out[idx] = model(x.to(device), lengths.to(device)).float().cpu().numpy()
    return out


@torch.no_grad()
def pooled_features(model: TextClassifier, loader: ClassificationLoader, precision: str = "auto") -> np.ndarray:
    """Concat-pooled encoder features (n_docs, 3 * emb_size) in the loader's document order; no dropout."""
    model.eval()
    device = next(model.parameters()).device
    out = np.zeros((len(loader.docs), 3 * model.cfg.emb_size), dtype=np.float32)
    for x, lengths, _, idx in loader.batches():
        with autocast(device, precision):
            out[idx] = model.encode(x.to(device), lengths.to(device)).float().cpu().numpy()
    return out


def _clas_validate(loader: ClassificationLoader, precision: str) -> Callable[[nn.Module], dict[str, float]]:
    def validate(model: TextClassifier) -> dict[str, float]:
        logits = classifier_logits(model, loader, precision)
        y = torch.from_numpy(loader.labels.astype(np.int64))
        loss = F.cross_entropy(torch.from_numpy(logits), y).item()
        return dict(valid_loss=loss, valid_accuracy=float((logits.argmax(1) == loader.labels).mean()))
    return validate


def unfreezing_phases(n_groups: int, unfreeze_epochs: list[int], steps_per_epoch: int,
                      min_steps_per_phase: int = 0, lr_mults: list[float] | None = None,
                      min_steps_last_phase: int = 0) -> list[Phase]:
    """Gradual unfreezing: phase k trains the last k+1 groups; the final phase trains all of them.

    A phase shorter than `min_steps_per_phase` optimizer steps gets more epochs (few-label data), and the last
    phase at least `min_steps_last_phase` (a few thousand rows: two epochs leave the whole network undertrained).
    Phase k's peak lr is scaled by `lr_mults[k]` (default 1).
    """
    phases = []
    lr_mults = lr_mults or [1.0] * len(unfreeze_epochs)
    for k, epochs in enumerate(unfreeze_epochs):
        last = k == len(unfreeze_epochs) - 1
        n = 0 if last or k + 1 >= n_groups else -(k + 1)
        floor = max(min_steps_per_phase, min_steps_last_phase if last else 0)
        if floor:
            epochs = max(epochs, math.ceil(floor / max(steps_per_epoch, 1)))
        phases.append(Phase(n, epochs, lr_mults[k]))
    return phases


@torch.no_grad()
def recalibrate_batchnorm(model: TextClassifier, loader: ClassificationLoader, precision: str = "auto") -> None:
    """Recompute the head's BatchNorm statistics over `loader` with the encoder in eval mode.

    During training BN sees features from a dropped-out, still-moving encoder and keeps an exponential
    average that lags it; at inference the encoder is deterministic. With small pretrained activations
    that mismatch alone can cost tens of accuracy points, and one no-grad pass removes it.
    """
    bns = [m for m in model.head if isinstance(m, nn.BatchNorm1d)]
    model.eval()
    device = next(model.parameters()).device
    momenta = [bn.momentum for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the pass
    for x, lengths, _, _ in loader.batches(0):
        with autocast(device, precision):
            h = model.encode(x.to(device), lengths.to(device)).float()
        for layer in model.head:  # BN layers update their stats in train mode; dropout stays off
            if isinstance(layer, nn.BatchNorm1d):
                layer.train()
                h = layer(h)
                layer.eval()
            else:
                h = layer(h)
    for bn, m in zip(bns, momenta):
        bn.momentum = m


def _classifier_phases(model: TextClassifier, steps_per_epoch: int, hp: ClassifierHP) -> list[Phase]:
    return unfreezing_phases(len(layer_groups(model)), list(hp.unfreeze_epochs), steps_per_epoch,
                             hp.min_steps_per_phase, hp.unfreeze_lr_mult, hp.min_steps_last_phase)


def train_classifier(model: TextClassifier, train: ClassificationLoader, valid: ClassificationLoader | None,
                     hp: ClassifierHP, **kw) -> list[dict[str, float]]:
    """Gradual unfreezing (`hp.unfreeze_epochs` per phase) with STLR and discriminative LRs in each.

    After every epoch the head's BatchNorm statistics are recomputed in eval mode (see recalibrate_batchnorm).
    Data-parallel, each rank trains on its share of the sortish batches; validation reads all of them.
    """
    batches, steps = distributed.shard_batches(train.batches, len(train))
    phases = _classifier_phases(model, steps, hp)
    stats_loader = ClassificationLoader(train.docs, train.labels, train.bs, train=False, pad_id=train.pad_id,
                                        backwards=train.backwards)
    validate_on = _clas_validate(valid, hp.precision) if valid is not None else None

    def validate(m: TextClassifier) -> dict[str, float]:
        recalibrate_batchnorm(m, stats_loader, hp.precision)
        return validate_on(m) if validate_on is not None else {}

    kw.setdefault("desc", "classifier")
    weight = class_weights(train.labels, model.n_classes) if hp.class_weights else None
    step = functools.partial(_clas_step, weight=weight)
    return fit(model, phases, batches, lambda e: steps, step, validate, hp,
               monitor=("valid_loss", "min"), unit="doc", **kw)


# --- LR finder --------------------------------------------------------------------------------------

def lr_find(model: nn.Module, batches: Iterator[tuple], step_loss: StepLoss, start_lr: float = 1e-7,
            end_lr: float = 10.0, num_it: int = 100, betas: tuple[float, float] = (0.7, 0.99),
            lr_decay: float = 1.0, precision: str = "fp32") -> tuple[list[float], list[float], float]:
    """Exponential LR sweep; stops when the smoothed loss passes 4x the best. Model weights are restored.

    Only trainable params move. With `lr_decay` > 1 each lower layer group gets lr / lr_decay of the group
    above, as in training, and the LRs reported are the top group's.
    Returns (lrs, smoothed losses, suggested LR: `valley_lr`).
    """
    saved = copy.deepcopy(model.state_dict())
    device = pick_device()
    model.to(device).train()
    try:
        groups = layer_groups(model)
    except TypeError:  # not an LM or classifier: one group
        groups = [list(model.parameters())]
    ratios = discriminative_lrs(1.0, len(groups), lr_decay)
    param_groups = [dict(params=[p for p in g if p.requires_grad], ratio=r) for g, r in zip(groups, ratios)]
    opt = torch.optim.AdamW([g for g in param_groups if g["params"]], lr=start_lr, betas=tuple(betas))
    lrs, losses, avg, best = [], [], 0.0, math.inf
    mult = (end_lr / start_lr) ** (1 / max(num_it - 1, 1))
    for i, batch in enumerate(batches):
        if i >= num_it:
            break
        lr = start_lr * mult ** i
        for g in opt.param_groups:
            g["lr"] = lr * g["ratio"]
        with autocast(device, precision):
            loss, _, _ = step_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        avg = 0.98 * avg + 0.02 * loss.item()
        smoothed = avg / (1 - 0.98 ** (i + 1))
        lrs.append(lr)
        losses.append(smoothed)
        best = min(best, smoothed)
        if not math.isfinite(smoothed) or smoothed > 4 * best:
            break
    model.load_state_dict(saved)
    if hasattr(model, "reset"):
        model.reset()
    return lrs, losses, valley_lr(lrs, losses) if lrs else start_lr


def valley_lr(lrs: list[float], losses: list[float]) -> float:
    """fastai's "valley" suggestion: 2/3 of the way down the longest decreasing run of the loss curve.

    The longest decreasing subsequence (not necessarily contiguous) spans the real descent; steepest-slope
    picks land on the noise of the first few smoothed points instead (on AG News: 1e-7 in every phase).
    """
    n = len(losses)
    run = [1] * n  # run[i]: length of the longest decreasing subsequence ending at i
    start = end = 0
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and run[i] < run[j] + 1:
                run[i] = run[j] + 1
            if run[end] < run[i]:
                end, start = i, i - run[i]
    third = (end - start) / 3
    # start is one before the run (fastai's arithmetic): -1 when the run begins at the first point
    return float(lrs[max(0, start + int(third) + int(third / 2))])


def classifier_lr_find(model: TextClassifier, train: ClassificationLoader, hp: ClassifierHP, num_it: int = 100,
                       progress: bool = True) -> list[dict[str, Any]]:
    """The LR finder before each phase of gradual unfreezing, with each phase trained as configured in between.

    What fastai users do by hand (unfreeze, `lr_find`, fit) for every phase of `train_classifier`'s schedule.
    Each phase is fitted with a fresh optimizer (training keeps one across phases), so the curves after
    phase 1 start from nearly, not exactly, the weights training would have. Returns one dict per phase:
    phase, freeze_to, configured peak lr, suggested lr, and the curve (lrs, losses).
    """
    phases = _classifier_phases(model, len(train), hp)
    # few labels give fewer than num_it batches an epoch: the sweep runs on across epochs
    forever = lambda: (b for e in itertools.count() for b in train.batches(e))  # noqa: E731
    out = []
    for k, phase in enumerate(phases):
        freeze_to(model, phase.freeze_to)
        lrs, losses, suggestion = lr_find(model, forever(), _clas_step, num_it=num_it, betas=tuple(hp.betas),
                                          lr_decay=hp.lr_decay, precision=hp.precision)
        out.append(dict(phase=k, freeze_to=phase.freeze_to, lr=hp.lr * phase.lr_mult, suggested_lr=suggestion,
                        lrs=lrs, losses=losses))
        if k < len(phases) - 1:
            fit(model, [phase], train.batches, lambda e: len(train), _clas_step, None, hp, progress=progress,
                desc=f"lr-find: train phase {k + 1}", unit="doc")
    freeze_to(model, 0)
    return out
