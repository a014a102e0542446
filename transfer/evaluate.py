"""Classification metrics, the saved-classifier bundle, and raw-text prediction with fwd+bwd ensembling."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from transfer.data import ClassificationLoader, Docs
from transfer.device import pick_device
from transfer.distributed import is_main
from transfer.errors import TransferError
from transfer.io_utils import atomic_path, write_json
from transfer.model import AWDLSTMConfig, TextClassifier
from transfer.tokenizer import PAD_ID, Tokenizer
from transfer.train import load_checkpoint
from transfer.train_clas import classifier_logits

__all__ = ["classification_metrics", "softmax", "fit_temperature", "calibrated_average", "member_name",
           "member_direction", "save_classifier", "Predictor"]


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def fit_temperature(proba: np.ndarray, y: np.ndarray) -> float:
    """The temperature T minimising the NLL of `proba ** (1/T)` (renormalised) on held-out labels `y`."""
    logp = np.log(np.clip(proba, 1e-12, 1.0))
    grid = np.exp(np.linspace(np.log(0.05), np.log(20.0), 121))

    def nll(t: float) -> float:
        z = logp / t
        z = z - z.max(axis=1, keepdims=True)
        return float(-(z[np.arange(len(y)), y] - np.log(np.exp(z).sum(axis=1))).mean())

    return float(min(grid, key=nll))


def calibrated_average(probas: list[np.ndarray], temperatures: list[float]) -> np.ndarray:
    """Average of temperature-scaled probabilities: members with different confidence scales count equally."""
    scaled = [softmax(np.log(np.clip(p, 1e-12, 1.0)) / t) for p, t in zip(probas, temperatures)]
    return np.mean(scaled, axis=0)


def classification_metrics(y_true: np.ndarray, y_pred: np.ndarray, classes: list[str]) -> dict:
    """Accuracy, error rate, macro-F1, confusion matrix (rows = true class) and per-class P/R/F1."""
    k = len(classes)
    cm = np.zeros((k, k), dtype=np.int64)
    np.add.at(cm, (np.asarray(y_true), np.asarray(y_pred)), 1)
    tp = np.diag(cm).astype(float)
    precision = np.divide(tp, cm.sum(0), out=np.zeros(k), where=cm.sum(0) > 0)
    recall = np.divide(tp, cm.sum(1), out=np.zeros(k), where=cm.sum(1) > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros(k), where=(precision + recall) > 0)
    accuracy = float(tp.sum() / max(cm.sum(), 1))
    return dict(
        accuracy=accuracy, error_rate=1 - accuracy, macro_f1=float(f1.mean()), n=int(cm.sum()),
        confusion_matrix=cm.tolist(), classes=list(classes),
        per_class={c: dict(precision=float(precision[i]), recall=float(recall[i]), f1=float(f1[i]),
                           support=int(cm[i].sum())) for i, c in enumerate(classes)},
    )


MEMBER = re.compile(r"(fwd|bwd)(-[1-9][0-9]{0,3})?")  # member names double as file names: nothing else passes


def member_name(direction: str, index: int) -> str:
    """Bundle name of a direction's `index`-th classifier: fwd, fwd-1, fwd-2, ... (member 0 keeps the bare name)."""
    return direction if index == 0 else f"{direction}-{index}"


def member_direction(name: str) -> str:
    return name.split("-", 1)[0]


def save_classifier(out_dir: Path, tokenizer_path: Path, classes: list[str], cfg: AWDLSTMConfig,
                    states: dict[str, dict[str, torch.Tensor]], bptt: int, max_len: int,
                    ensemble: list[str] | None = None) -> Path:
    """Write a self-contained bundle: spm.model, meta.json and one state_dict per member (fwd.pt, bwd.pt, fwd-1.pt).

    `ensemble`: the members a prediction averages by default (all of them if None); every member stays loadable.
    """
    out_dir = Path(out_dir)
    with atomic_path(out_dir / "spm.model") as tmp:
        shutil.copyfile(tokenizer_path, tmp)
    for name, state in states.items():
        with atomic_path(out_dir / f"{name}.pt") as tmp:
            torch.save({k: v.detach().cpu() for k, v in state.items()}, tmp)
    # meta.json last: a bundle without it is incomplete and refuses to load
    write_json(out_dir / "meta.json", dict(classes=list(classes), config=cfg.to_dict(), bptt=bptt,
                                           max_len=max_len, members=sorted(states),
                                           ensemble=sorted(ensemble if ensemble is not None else states)))
    for stale in out_dir.glob("*.pt"):  # members of an earlier, larger bundle
        if stale.stem not in states and is_main():
            stale.unlink()
    return out_dir


class Predictor:
    """Raw text in, class probabilities out; averages its members (forward and backward models, and their seeds).

    `models` maps member names (`member_name`) to classifiers; a name's direction says how to read the text.
    """

    def __init__(self, tokenizer: Tokenizer, models: dict[str, TextClassifier], classes: list[str],
                 batch_size: int = 64):
        self.tokenizer, self.models, self.classes, self.batch_size = tokenizer, models, classes, batch_size

    @classmethod
    def from_dir(cls, path: Path, directions: list[str] | None = None, batch_size: int = 64) -> "Predictor":
        path = Path(path)
        meta_path = path / "meta.json"
        if not meta_path.is_file():
            raise TransferError(f"{path}: not a classifier bundle (meta.json missing)")
        meta = json.loads(meta_path.read_text())
        cfg = AWDLSTMConfig(**meta["config"])
        tokenizer = Tokenizer.load(path / "spm.model")
        if tokenizer.vocab_size != cfg.vocab_size:
            raise TransferError(f"{path}: spm.model has {tokenizer.vocab_size} pieces but the weights expect "
                                f"{cfg.vocab_size}")
        device = pick_device()
        names = meta.get("members", meta.get("directions"))  # "directions": bundles written before members
        bad = [n for n in names + meta.get("ensemble", []) if not isinstance(n, str) or not MEMBER.fullmatch(n)]
        if bad or not set(meta.get("ensemble", names)) <= set(names):
            raise TransferError(f"{meta_path}: member names must be fwd, bwd, fwd-1, ... of its members; got "
                                f"{(bad or meta.get('ensemble'))!r}")
        if directions is None:  # the ensemble chosen on validation rows (bundles before it: every member)
            names = meta.get("ensemble", names)
        else:
            missing = [d for d in directions if not any(member_direction(n) == d for n in names)]
            if missing:
                raise TransferError(f"{path}: no {'/'.join(missing)} classifier in this bundle (it has {names})")
            names = [n for n in names if member_direction(n) in directions]
        models = {}
        for name in names:
            model = TextClassifier(cfg, len(meta["classes"]), bptt=meta["bptt"], max_len=meta["max_len"])
            state = load_checkpoint(path / f"{name}.pt")
            try:
                model.load_state_dict(state)
            except RuntimeError as e:
                raise TransferError(f"{path / f'{name}.pt'}: weights do not fit the architecture in meta.json "
                                    f"({str(e).splitlines()[0]})") from None
            models[name] = model.to(device).eval()
        return cls(tokenizer, models, meta["classes"], batch_size)

    def predict_proba(self, texts: list[str]) -> np.ndarray:
        """(n, n_classes) probabilities; rows sum to 1."""
        if len(texts) == 0:
            return np.zeros((0, len(self.classes)), dtype=np.float32)
        docs = Docs.from_lists(self.tokenizer.encode(list(texts)))
        probs = []
        for name, m in self.models.items():
            loader = ClassificationLoader(docs, None, self.batch_size, train=False, pad_id=PAD_ID,
                                          backwards=member_direction(name) == "bwd")
            probs.append(softmax(classifier_logits(m, loader)))
        return np.mean(probs, axis=0)

    def predict(self, texts: list[str]) -> list[str]:
        return [self.classes[i] for i in self.predict_proba(texts).argmax(1)]
