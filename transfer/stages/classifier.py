"""One ULMFiT classifier: an encoder from a domain LM, length-aware batches, gradual unfreezing; and its LR finder."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from transfer import rules
from transfer.config import Params
from transfer.data import ClassificationLoader, Docs
from transfer.errors import TransferError
from transfer.io_utils import file_digest, write_csv
from transfer.model import TextClassifier, classifier_config
from transfer.plots import plot_lr_find
from transfer.stages.lm import architecture
from transfer.stages.record import fingerprint
from transfer.stages.workspace import Workspace, seed_everything
from transfer.tokenizer import PAD_ID, Tokenizer
from transfer.train import load_checkpoint
from transfer.train_clas import classifier_lr_find, train_classifier

Pseudo = tuple[list[str], np.ndarray]  # pseudo-labelled rows: texts, class indices


def labelled(ws: Workspace, split: str, tok: Tokenizer, classes: list[str], extra: Pseudo | None = None,
             ) -> tuple[Docs, np.ndarray]:
    """A prepared split as token ids and class indices; `extra` pseudo-labelled rows join the labelled ones."""
    df = ws.table(split)
    index = {c: i for i, c in enumerate(classes)}
    texts, y = list(df["text"]), df["label"].map(index).to_numpy()
    if extra is not None:
        texts, y = texts + list(extra[0]), np.concatenate([y, np.asarray(extra[1], dtype=y.dtype)])
    return Docs.from_lists(tok.encode(texts)), y


def new_classifier(p: Params, vocab_size: int, n_classes: int, encoder_from: Path | None) -> TextClassifier:
    """A classifier of the params' sizes, its encoder from an LM state_dict (None: random init)."""
    hp = p.classifier
    cfg = classifier_config(vocab_size, hp.drop_mult, emb_size=p.model.emb_size,
                            hidden_size=p.model.hidden_size, n_layers=p.model.n_layers)
    model = TextClassifier(cfg, n_classes, bptt=hp.bptt, max_len=hp.max_len)
    if encoder_from is not None:
        lm_state = load_checkpoint(encoder_from)
        enc = {k[len("encoder."):]: v for k, v in lm_state.items() if k.startswith("encoder.")}
        try:
            model.encoder.load_state_dict(enc)
        except RuntimeError as e:
            raise TransferError(f"{encoder_from}: encoder does not fit model params ({str(e).splitlines()[0]})") from None
    return model


def batch_size(p: Params, n_rows: int) -> int:
    """Few labels get smaller batches, so that an epoch still has `classifier.min_steps_per_epoch` steps."""
    hp = p.classifier
    return min(hp.bs, max(hp.min_bs, n_rows // hp.min_steps_per_epoch))


def setup(p: Params, ws: Workspace, direction: str, encoder_from: Path | None, pseudo: Pseudo | None = None,
          ) -> tuple[TextClassifier, ClassificationLoader, ClassificationLoader, str]:
    """A classifier with its encoder from an LM state_dict (None: random init) and its loaders -> (+ data id)."""
    hp = p.classifier
    tok = ws.tokenizer()
    classes = ws.prepared()["classes"]
    dtr, ytr = labelled(ws, "train", tok, classes, pseudo)
    dva, yva = labelled(ws, "valid", tok, classes)
    seed_everything(hp.seed)
    model = new_classifier(p, tok.vocab_size, len(classes), encoder_from)
    data_id = file_digest(ws.art("prepare", "train.csv"))
    if pseudo is not None:
        data_id += fingerprint(list(pseudo[0]), [int(c) for c in pseudo[1]])
    if encoder_from is not None:
        data_id += file_digest(encoder_from)
    backwards = direction == "bwd"
    train = ClassificationLoader(dtr, ytr, batch_size(p, len(dtr)), train=True, pad_id=PAD_ID, backwards=backwards,
                                 seed=hp.seed)
    valid = ClassificationLoader(dva, yva, p.evaluate.batch_size, train=False, pad_id=PAD_ID, backwards=backwards)
    return model, train, valid, data_id


def fit(p: Params, ws: Workspace, direction: str, encoder_from: Path | None, ckpt_path: Path, code: str,
        step_log: list | None = None, pseudo: Pseudo | None = None) -> tuple[TextClassifier, list[dict]]:
    """One classifier: encoder weights from an LM state_dict (None: random init), then gradual unfreezing.
    `code` (the calling stage's code digest) is part of the checkpoint's fingerprint."""
    model, train, valid, data_id = setup(p, ws, direction, encoder_from, pseudo)
    history = train_classifier(model, train, valid, p.classifier, ckpt_path=ckpt_path,
                               desc=f"classifier {Path(ckpt_path).stem.removeprefix('checkpoint-')}",
                               fingerprint=fingerprint("clas", asdict(p.classifier), architecture(p), data_id,
                                                       direction, code),
                               step_log=step_log)
    return model, history


def lr_find(p: Params, ws: Workspace, direction: str = "fwd", num_it: int = 100) -> list[dict]:
    """The LR finder before every unfreezing phase, from the domain LM, on the labelled training rows.

    Advisory: writes `plots/lr_find_<direction>.csv` (phase, lr, smoothed loss) and `.png`, and returns one
    row per phase (configured and suggested peak lr); no artifact or metric of any stage changes.
    """
    if direction not in p.model.directions:
        raise TransferError(f"direction {direction!r} is not in model.directions {p.model.directions}")
    lm = ws.art("finetune_lm", f"lm-{direction}.pt")
    for need in (ws.metrics("prepare"), ws.art("tokenize", "spm.model"), lm):
        if not need.exists():
            raise TransferError(f"{need}: missing; run the stages up to finetune_lm first (`transfer run`, or "
                                f"`transfer stage prepare|tokenize|pretrain|finetune_lm`)")
    p = rules.apply(p, ws.prepared())
    model, train, _, _ = setup(p, ws, direction, lm)
    results = classifier_lr_find(model, train, p.classifier, num_it=num_it)
    write_csv(ws.plot(f"lr_find_{direction}.csv"),
              [dict(phase=r["phase"], lr=lr, loss=loss) for r in results for lr, loss in zip(r["lrs"], r["losses"])])
    plot_lr_find(results, ws.plot(f"lr_find_{direction}.png"),
                 f"classifier LR finder ({direction}), before each unfreezing phase")
    return [{k: v for k, v in r.items() if k not in ("lrs", "losses")} for r in results]
