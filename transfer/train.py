"""The training loop: one `fit` runs a list of phases, resumably.

Each phase freezes some layer groups and runs its own LR schedule with discriminative LRs. Checkpoints hold
everything needed to resume to the bit-identical result on CPU. What a loop trains lives beside it: language
models in transfer/train_lm.py, the classifier and the LR finder in transfer/train_clas.py; the device and
precision it runs at in transfer/device.py, and the divergence guard in transfer/guard.py.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from transfer import distributed
from transfer.device import autocast, keep_freed_memory, pick_device
from transfer.errors import TransferError
from transfer.guard import _DivergenceGuard, _hidden_state
from transfer.io_utils import atomic_path
from transfer.model import freeze_to, layer_groups
from transfer.progress import EpochProgress
from transfer.schedules import discriminative_lrs, lr_at

__all__ = ["TrainHP", "Phase", "Batches", "StepLoss", "fit", "training_threads", "save_checkpoint", "load_checkpoint"]


class TrainHP(Protocol):
    """The training hyperparameters the loops read (transfer.config_train.TrainParams satisfies it)."""

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


class FinetuneHP(TrainHP, Protocol):
    """What LM fine-tuning reads besides (config_train.FinetuneLMParams)."""

    freeze_epochs: int  # epochs with only the last layer group trainable, before `epochs` with all


class ClassifierHP(TrainHP, Protocol):
    """What classifier training reads besides (config_train.ClassifierParams)."""

    unfreeze_epochs: list[int]  # gradual unfreezing: epochs of phase k, which trains the last k groups
    min_steps_per_phase: int
    min_steps_last_phase: int
    unfreeze_lr_mult: list[float] | None
    class_weights: bool


@dataclass(frozen=True)
class Phase:
    """Train the layer groups from `freeze_to` on (0 = all) for `epochs` epochs at `lr_mult` times the peak lr."""

    freeze_to: int
    epochs: int
    lr_mult: float = 1.0


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


def training_threads(model: nn.Module) -> int:
    """The torch threads `fit` trains `model` on, 0 on an accelerator. One for small models on CPU: their ops are
    too short to split, and two threads spin-wait on each other (demo 64/128 LM: 13,900 tok/s on one thread,
    3,000-3,200 on two, same machine under load). Recorded with results: CPU float sums differ by thread count,
    and so do the weights."""
    if pick_device().type != "cpu":
        return 0
    return 1 if sum(p.numel() for p in model.parameters()) < SMALL_MODEL else torch.get_num_threads()


@contextlib.contextmanager
def _threads_for(model: nn.Module) -> Iterator[None]:
    before = torch.get_num_threads()
    if training_threads(model) == 1:
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
    world, rank = distributed.world_size(), distributed.rank()
    progress = progress and rank == 0
    torch.manual_seed(hp.seed + rank)  # ranks see other data and draw other dropout masks
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
        ck = _try_resume(ckpt_path, fingerprint, world)
        if ck is not None:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            history, best = ck["history"], ck["best"]
            pos.update(ck["position"])
            acc = ck.get("epoch_acc", acc)
            steps[:] = ck.get("steps", [])
            mine = ck["ranks"][rank] if world > 1 else ck
            torch.set_rng_state(mine["rng_torch"])
            if mine.get("hidden") is not None:
                model.encoder.hidden = [(h.to(device), c.to(device)) for h, c in mine["hidden"]]
            if ck.get("finished"):
                return history

    def checkpoint(finished: bool = False) -> None:
        if ckpt_path is None:
            return
        # Each rank's RNG and LSTM state differ (its own rows, its own masks): rank 0 saves them all, so that every
        # rank resumes where it was. The weights and optimizer state are the same on every rank.
        ranks = distributed.gather(dict(rng_torch=torch.get_rng_state(), hidden=_hidden_state(model)))
        if rank != 0:
            return
        save_checkpoint(ckpt_path, dict(
            fingerprint=fingerprint, model=model.state_dict(), optimizer=opt.state_dict(), history=history,
            position=dict(pos), best=best, steps=steps, **ranks[0], ranks=ranks if world > 1 else None,
            world=world, epoch_acc=dict(acc, seconds=acc["seconds"] + time.perf_counter() - t0),
            finished=finished, total_steps=total_steps, total_epochs=total_epochs))

    mode_sign = 1 if monitor[1] == "min" else -1
    stopped = False
    while pos["phase"] < len(phases) and not stopped:
        phase = phases[pos["phase"]]
        freeze_to(model, phase.freeze_to)
        net = model  # drops the last phase's DDP (and its gradient hooks) before the next is built
        net = distributed.wrap(model)  # DDP over this phase's trainable groups (a no-op in one process)
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
                        loss, n_items, lr_scale = step_loss(net, batch)
                    loss_value = distributed.mean_over_ranks(loss.item())  # every rank judges the same loss
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
                    acc.update(items=acc["items"] + n_items * world, loss_sum=acc["loss_sum"] + loss_value,
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
        distributed.check_in_sync(model, f"{desc} phase {pos['phase'] + 1}")
        if not stopped:
            pos.update(phase=pos["phase"] + 1, epoch_in_phase=0)
    if stopped and best["state"] is not None:
        model.load_state_dict(best["state"])
    freeze_to(model, 0)
    checkpoint(finished=True)
    return history


def _try_resume(path: Path, fingerprint: str, world: int = 1) -> dict | None:
    try:
        ck = load_checkpoint(path)
    except TransferError as e:
        warnings.warn(f"ignoring unreadable checkpoint, starting fresh: {e}")
        return None
    if ck.get("fingerprint") != fingerprint:
        warnings.warn(f"{path}: checkpoint is from different params, data or code, starting fresh")
        return None
    if ck.get("world", 1) != world:  # each rank's share of the data would differ
        warnings.warn(f"{path}: checkpoint is from {ck.get('world', 1)} processes, not {world}, starting fresh")
        return None
    return ck
