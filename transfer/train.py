"""Training loops: LM pretraining, LM fine-tuning and gradual-unfreezing classifier training.

One loop (`fit`) runs a list of phases; each phase freezes some layer groups and runs its own LR schedule
with discriminative LRs. Checkpoints hold everything needed to resume to the bit-identical result on CPU.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import itertools
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from transfer.data import ClassificationLoader, LMLoader
from transfer.errors import TransferError
from transfer.io_utils import atomic_path
from transfer.model import LanguageModel, TextClassifier, freeze_to, layer_groups
from transfer.progress import EpochProgress
from transfer.schedules import discriminative_lrs, lr_at

__all__ = [
    "Phase", "pick_device", "autocast", "keep_freed_memory", "fit", "pretrain_lm", "finetune_lm", "train_classifier",
    "lm_perplexity", "classifier_logits", "lr_find", "valley_lr", "classifier_lr_find", "save_checkpoint",
    "load_checkpoint",
]


class TrainHP(Protocol):
    """The training hyperparameters the loops read (transfer.config.TrainParams satisfies it)."""

    epochs: int
    lr: float
    lr_decay: float  # each lower layer group gets lr / lr_decay of the group above
    wd: float
    clip: float | None
    betas: list[float]
    alpha: float  # AR: activation regularisation on the dropped last-layer output (LM only)
    beta: float  # TAR: temporal activation regularisation on the raw last-layer output (LM only)
    schedule: str
    cut_frac: float
    warmup_min_steps: int  # floor on the warm-up in steps per phase
    ratio: float
    checkpoint_every: int  # optimizer steps between checkpoints; 0 = only at epoch ends
    early_stop_patience: int | None
    seed: int
    precision: str
    spike_factor: float | None  # a step loss above this times its running mean is a divergence
    max_recoveries: int


class Diverged(TransferError):
    """Training diverged more often than `max_recoveries` allows."""


@dataclass(frozen=True)
class Phase:
    """Train the layer groups from `freeze_to` on (0 = all) for `epochs` epochs at `lr_mult` times the peak lr."""

    freeze_to: int
    epochs: int
    lr_mult: float = 1.0


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process instead of handing it back to the kernel.

    By default every allocation over 32 MB (an LM's logits and their gradients: 64 x 70 x 16k floats) is a fresh
    mmap, unmapped again when freed, so every training step page-faults all of it back in. Measured on a 2-core VM
    (`python bench/allocator.py`): 400k page faults a step, 44% of the CPU time in the kernel, 3,252 -> 6,559 tok/s
    with the heap kept (16k vocab, 256/512, bs 64 x bptt 70, bf16). Process-wide and idempotent; returns False
    where the C library is not glibc (nothing changed).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's malloc.h
    # no mmap'd chunks; trim the heap top only past 2 GB free (2**31 - 1 is the largest an int argument can say)
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


@functools.cache
def cpu_supports_bf16() -> bool:
    """True where the CPU computes bf16 natively (AVX-512 BF16 or AMX); elsewhere it is emulated or missing."""
    if "AMX" in torch.backends.cpu.get_cpu_capability():
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: no cheap, reliable way to tell
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast when asked ('bf16'), or for 'auto' on CUDA and on bf16-capable CPUs; fp32 otherwise.

    Measured on AVX-512 BF16 (2 cores, 256/512 LM, 300k tokens): 1.55x tokens/s, WikiText-2 ppl within 0.1%.
    Autocast keeps weights and optimizer state in fp32; losses are computed on `.float()` logits.
    """
    if precision == "bf16" and device.type == "cpu" and not cpu_supports_bf16():
        # emulated bf16 would only be slower, and torch's oneDNN LSTM has no bf16 kernel there: it fails mid-step
        raise TransferError(f"precision 'bf16' needs a CPU with native bf16 (AVX-512 BF16 or AMX); this one has "
                            f"{torch.backends.cpu.get_cpu_capability()}: set precision to 'auto' or 'fp32'")
    use_bf16 = precision == "bf16" or (precision == "auto" and (device.type == "cuda" or cpu_supports_bf16()))
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


# --- checkpoints ------------------------------------------------------------------------------------

def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomic torch.save: a crash mid-write leaves the previous checkpoint intact."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Load tensors and plain containers only (weights_only=True), mapped to CPU.

    `mmap`: tensors stay on disk until touched, for reading a checkpoint's small fields cheaply.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise TransferError(f"{path}: checkpoint not found") from None
    except Exception as e:  # torch raises several types for truncated or foreign files
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        reason = "not a PyTorch checkpoint, or truncated" if "weights only load failed" in first.lower() \
            or isinstance(e, (EOFError, RuntimeError)) else f"{type(e).__name__}: {first[:200]}"
        raise TransferError(f"{path}: not a readable checkpoint ({reason})") from None


def _hidden_state(model: nn.Module) -> list[list[torch.Tensor]] | None:
    hidden = getattr(model.encoder, "hidden", None)
    return None if hidden is None else [[h.cpu(), c.cpu()] for h, c in hidden]


# --- the loop ---------------------------------------------------------------------------------------

Batches = Callable[[int, int], Iterator[tuple]]  # (epoch, start_step) -> batches
StepLoss = Callable[[nn.Module, tuple], tuple[torch.Tensor, int, float]]  # -> (loss, n_items, lr_scale)


def fit(model: nn.Module, phases: list[Phase], batches: Batches, steps_in_epoch: Callable[[int], int],
        step_loss: StepLoss, validate: Callable[[nn.Module], dict[str, float]] | None, hp: TrainHP, *,
        monitor: tuple[str, str] = ("valid_loss", "min"), ckpt_path: Path | None = None,
        fingerprint: str = "", progress: bool = True, desc: str = "train", unit: str = "tok",
        stop_after_steps: int | None = None, step_log: list[dict] | None = None) -> list[dict[str, float]]:
    """Run the phases; return the per-epoch history. Resumes from `ckpt_path` if its fingerprint matches.

    `step_log`, if given, receives {step, lr, loss} for every optimizer step (for the LR-schedule plot).
    `stop_after_steps` ends the run early after that many steps (it simulates a crash in tests).
    """
    with _threads_for(model):
        return _fit(model, phases, batches, steps_in_epoch, step_loss, validate, hp, monitor=monitor,
                    ckpt_path=ckpt_path, fingerprint=fingerprint, progress=progress, desc=desc, unit=unit,
                    stop_after_steps=stop_after_steps, step_log=step_log)


SMALL_MODEL = 2_000_000  # parameters; below it one CPU thread trains faster than two


@contextlib.contextmanager
def _threads_for(model: nn.Module) -> Iterator[None]:
    """One torch thread for small models on CPU: their ops are too short to split, and two threads spin-wait
    on each other (demo 64/128 LM: 13,900 tok/s on one thread, 3,000-3,200 on two, same machine under load)."""
    before = torch.get_num_threads()
    small = sum(p.numel() for p in model.parameters()) < SMALL_MODEL and pick_device().type == "cpu"
    if small:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fit(model, phases, batches, steps_in_epoch, step_loss, validate, hp, *, monitor, ckpt_path, fingerprint,
         progress, desc, unit, stop_after_steps, step_log) -> list[dict[str, float]]:
    steps = step_log if step_log is not None else []
    device = pick_device()
    keep_freed_memory()
    torch.manual_seed(hp.seed)
    model.to(device)
    groups = layer_groups(model)
    opt = torch.optim.AdamW([{"params": g} for g in groups], lr=hp.lr, betas=tuple(hp.betas), eps=1e-5,
                            weight_decay=hp.wd, fused=True)  # one kernel for all params: 146 -> 20 ms a step
    history: list[dict[str, float]] = []
    # lr_scale: halved at each recovery from a divergence, for the rest of the run
    pos = dict(phase=0, epoch_in_phase=0, step_in_epoch=0, global_epoch=0, global_step=0, lr_scale=1.0, recoveries=0)
    best = dict(value=None, state=None, bad_epochs=0)
    # The current epoch's running totals, checkpointed with it so that a resumed epoch reports the loss, time
    # (training seconds, summed over invocations) and throughput of the whole epoch, not of its last part.
    new_epoch = dict(items=0, loss_sum=0.0, loss_n=0, seconds=0.0)
    acc, t0 = dict(new_epoch), time.perf_counter()
    total_epochs = sum(ph.epochs for ph in phases)
    total_steps = sum(steps_in_epoch(e) for e in range(total_epochs))  # for `transfer status`: progress, ETA

    if ckpt_path is not None and Path(ckpt_path).exists():
        ck = _try_resume(ckpt_path, fingerprint)
        if ck is not None:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            history, best = ck["history"], ck["best"]
            pos.update(ck["position"])
            acc = ck.get("epoch_acc", acc)
            steps[:] = ck.get("steps", [])
            torch.set_rng_state(ck["rng_torch"])
            if ck.get("hidden") is not None:
                model.encoder.hidden = [(h.to(device), c.to(device)) for h, c in ck["hidden"]]
            if ck.get("finished"):
                return history

    def checkpoint(finished: bool = False) -> None:
        if ckpt_path is None:
            return
        save_checkpoint(ckpt_path, dict(
            fingerprint=fingerprint, model=model.state_dict(), optimizer=opt.state_dict(), history=history,
            position=dict(pos), best=best, steps=steps, rng_torch=torch.get_rng_state(), hidden=_hidden_state(model),
            epoch_acc=dict(acc, seconds=acc["seconds"] + time.perf_counter() - t0), finished=finished,
            total_steps=total_steps, total_epochs=total_epochs))

    mode_sign = 1 if monitor[1] == "min" else -1
    stopped = False
    while pos["phase"] < len(phases) and not stopped:
        phase = phases[pos["phase"]]
        freeze_to(model, phase.freeze_to)
        first_epoch = pos["global_epoch"] - pos["epoch_in_phase"]
        phase_steps = sum(steps_in_epoch(first_epoch + e) for e in range(phase.epochs))
        steps_before = sum(steps_in_epoch(first_epoch + e) for e in range(pos["epoch_in_phase"]))
        # the warm-up floor: at least warmup_min_steps (at most half the phase) before the peak lr
        cut_frac = max(hp.cut_frac, min(0.5, hp.warmup_min_steps / max(phase_steps, 1)))
        while pos["epoch_in_phase"] < phase.epochs:
            epoch = pos["global_epoch"]
            model.train()
            if pos["step_in_epoch"] == 0 and hasattr(model, "reset"):
                model.reset()  # LM state does not flow across epochs
            n_steps = steps_in_epoch(epoch)
            where = f"phase {pos['phase'] + 1}/{len(phases)} " if len(phases) > 1 else ""
            bar = EpochProgress(f"{desc} {where}epoch {epoch + 1}/{total_epochs}", n_steps, pos["step_in_epoch"],
                                unit, enabled=progress, name=desc)
            if pos["step_in_epoch"] == 0:
                acc = dict(new_epoch)
            t0 = time.perf_counter()
            guard = _DivergenceGuard(hp)
            guard.snapshot(model, opt, pos, acc, len(steps))
            rewound = True
            while rewound:  # a recovery restarts the batches at the restored step
                rewound = False
                lrs = discriminative_lrs(hp.lr * phase.lr_mult * pos["lr_scale"], len(groups), hp.lr_decay)
                for batch in batches(epoch, pos["step_in_epoch"]):
                    step = steps_before + pos["step_in_epoch"]
                    with autocast(device, hp.precision):
                        loss, n_items, lr_scale = step_loss(model, batch)
                    loss_value = loss.item()
                    if guard.diverged(loss_value):
                        acc = guard.rewind(model, opt, pos, steps, desc, loss_value)
                        rewound = True
                        break
                    for g, lr in zip(opt.param_groups, lrs):
                        g["lr"] = lr_at(hp.schedule, step, phase_steps, lr, cut_frac, hp.ratio) * lr_scale
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if hp.clip:
                        nn.utils.clip_grad_norm_([p for g in groups for p in g if p.requires_grad], hp.clip)
                    opt.step()
                    steps.append(dict(step=pos["global_step"], lr=opt.param_groups[-1]["lr"], loss=loss_value))
                    acc.update(items=acc["items"] + n_items, loss_sum=acc["loss_sum"] + loss_value,
                               loss_n=acc["loss_n"] + 1)
                    pos["step_in_epoch"] += 1
                    pos["global_step"] += 1
                    guard.every_step(model, opt, pos, acc, len(steps))
                    rate = acc["items"] / max(acc["seconds"] + time.perf_counter() - t0, 1e-9)
                    bar.update(pos["step_in_epoch"], pos["global_step"], acc["loss_sum"] / acc["loss_n"], rate)
                    if hp.checkpoint_every and pos["global_step"] % hp.checkpoint_every == 0:
                        checkpoint()
                    if stop_after_steps is not None and pos["global_step"] >= stop_after_steps:
                        bar.close()
                        return history
            bar.close()
            seconds = acc["seconds"] + time.perf_counter() - t0
            row = dict(phase=pos["phase"], epoch=epoch, step=pos["global_step"],
                       train_loss=acc["loss_sum"] / max(acc["loss_n"], 1), lr=opt.param_groups[-1]["lr"],
                       items_per_s=acc["items"] / max(seconds, 1e-9), time_s=seconds, recoveries=pos["recoveries"])
            if validate is not None:
                row.update(validate(model))
                model.train()
            history.append(row)
            if progress:
                tqdm.write(f"{desc} epoch {epoch + 1}/{total_epochs}: " + ", ".join(
                    f"{k}={v:.4g}" for k, v in row.items() if k not in ("phase", "epoch", "step")))
            steps_before += n_steps
            pos.update(epoch_in_phase=pos["epoch_in_phase"] + 1, step_in_epoch=0, global_epoch=epoch + 1)
            value = row.get(monitor[0])
            if value is not None:
                if best["value"] is None or mode_sign * value < mode_sign * best["value"]:
                    keep = hp.early_stop_patience is not None  # best weights only matter if we may stop early
                    best.update(value=value, state=copy.deepcopy(model.state_dict()) if keep else None,
                                bad_epochs=0)
                else:
                    best["bad_epochs"] += 1
                    if hp.early_stop_patience is not None and best["bad_epochs"] > hp.early_stop_patience:
                        stopped = True
                        break
            checkpoint()
        if not stopped:
            pos.update(phase=pos["phase"] + 1, epoch_in_phase=0)
    if stopped and best["state"] is not None:
        model.load_state_dict(best["state"])
    freeze_to(model, 0)
    checkpoint(finished=True)
    return history


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


def _try_resume(path: Path, fingerprint: str) -> dict | None:
    try:
        ck = load_checkpoint(path)
    except TransferError as e:
        warnings.warn(f"ignoring unreadable checkpoint, starting fresh: {e}")
        return None
    if ck.get("fingerprint") != fingerprint:
        warnings.warn(f"{path}: checkpoint is from different params, data or code, starting fresh")
        return None
    return ck


# --- language models --------------------------------------------------------------------------------

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


def finetune_lm(model: LanguageModel, train: LMLoader, valid: LMLoader | None, hp: TrainHP,
                desc: str = "finetune_lm", **kw) -> list[dict[str, float]]:
    """`hp.freeze_epochs` with only embedding + decoder trainable, then `hp.epochs` with everything."""
    phases = [Phase(-1, hp.freeze_epochs)] if getattr(hp, "freeze_epochs", 0) else []
    return _fit_lm(model, phases + [Phase(0, hp.epochs)], train, valid, hp, desc=desc, **kw)


# --- classifier -------------------------------------------------------------------------------------

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
                      min_steps_per_phase: int = 0, lr_mults: list[float] | None = None) -> list[Phase]:
    """Gradual unfreezing: phase k trains the last k+1 groups; the final phase trains all of them.

    A phase shorter than `min_steps_per_phase` optimizer steps gets more epochs (few-label data).
    Phase k's peak lr is scaled by `lr_mults[k]` (default 1).
    """
    phases = []
    lr_mults = lr_mults or [1.0] * len(unfreeze_epochs)
    for k, epochs in enumerate(unfreeze_epochs):
        last = k == len(unfreeze_epochs) - 1
        n = 0 if last or k + 1 >= n_groups else -(k + 1)
        if min_steps_per_phase:
            epochs = max(epochs, math.ceil(min_steps_per_phase / max(steps_per_epoch, 1)))
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


def _classifier_phases(model: TextClassifier, train: ClassificationLoader, hp: TrainHP) -> list[Phase]:
    return unfreezing_phases(len(layer_groups(model)), list(hp.unfreeze_epochs), len(train),
                             getattr(hp, "min_steps_per_phase", 0), getattr(hp, "unfreeze_lr_mult", None))


def train_classifier(model: TextClassifier, train: ClassificationLoader, valid: ClassificationLoader | None,
                     hp: TrainHP, **kw) -> list[dict[str, float]]:
    """Gradual unfreezing (`hp.unfreeze_epochs` per phase) with STLR and discriminative LRs in each.

    After every epoch the head's BatchNorm statistics are recomputed in eval mode (see recalibrate_batchnorm).
    """
    phases = _classifier_phases(model, train, hp)
    stats_loader = ClassificationLoader(train.docs, train.labels, train.bs, train=False, pad_id=train.pad_id,
                                        backwards=train.backwards)
    validate_on = _clas_validate(valid, hp.precision) if valid is not None else None

    def validate(m: TextClassifier) -> dict[str, float]:
        recalibrate_batchnorm(m, stats_loader, hp.precision)
        return validate_on(m) if validate_on is not None else {}

    kw.setdefault("desc", "classifier")
    weight = class_weights(train.labels, model.n_classes) if getattr(hp, "class_weights", False) else None
    step = functools.partial(_clas_step, weight=weight)
    return fit(model, phases, train.batches, lambda e: len(train), step, validate, hp,
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


def classifier_lr_find(model: TextClassifier, train: ClassificationLoader, hp: TrainHP, num_it: int = 100,
                       progress: bool = True) -> list[dict[str, Any]]:
    """The LR finder before each phase of gradual unfreezing, with each phase trained as configured in between.

    What fastai users do by hand (unfreeze, `lr_find`, fit) for every phase of `train_classifier`'s schedule.
    Each phase is fitted with a fresh optimizer (training keeps one across phases), so the curves after
    phase 1 start from nearly, not exactly, the weights training would have. Returns one dict per phase:
    phase, freeze_to, configured peak lr, suggested lr, and the curve (lrs, losses).
    """
    phases = _classifier_phases(model, train, hp)
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
