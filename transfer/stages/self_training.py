"""Self-training's teacher and the validation guards: a linear probe's pseudo-labels, and which members to average."""

from __future__ import annotations

import time

import numpy as np

from transfer.config import Params
from transfer.data import ClassificationLoader, Docs
from transfer.device import pick_device
from transfer.pseudo import probe_teacher, select_pseudo_labels
from transfer.stages.classifier import Pseudo, labelled, new_classifier
from transfer.stages.workspace import Workspace
from transfer.tokenizer import PAD_ID
from transfer.train_clas import pooled_features


def lm_features(p: Params, ws: Workspace, vocab_size: int, doc_sets: list[Docs]) -> list[np.ndarray]:
    """Frozen domain LMs' concat-pooled features of each doc set, one block of 3 * emb_size per direction."""
    blocks: list[list[np.ndarray]] = [[] for _ in doc_sets]
    for direction in p.model.directions:
        model = new_classifier(p, vocab_size, 2, ws.art("finetune_lm", f"lm-{direction}.pt")).to(pick_device())
        for out, docs in zip(blocks, doc_sets):
            loader = ClassificationLoader(docs, None, p.evaluate.batch_size, train=False, pad_id=PAD_ID,
                                          backwards=direction == "bwd")
            out.append(pooled_features(model, loader, p.classifier.precision))
    return [np.concatenate(b, axis=1) for b in blocks]


def probe_pseudo_labels(p: Params, ws: Workspace, classes: list[str], unlabelled: list[str],
                        ) -> tuple[Pseudo, dict[str, float]]:
    """Round 1's pseudo-labels from a self-trained linear probe on the frozen domain LMs (`pseudo.probe_teacher`)."""
    hp, tok = p.classifier, ws.tokenizer()
    t0 = time.perf_counter()
    dtr, ytr = labelled(ws, "train", tok, classes)
    dva, yva = labelled(ws, "valid", tok, classes)
    x_train, x_valid, x_unlabelled = lm_features(p, ws, tok.vocab_size,
                                                 [dtr, dva, Docs.from_lists(tok.encode(unlabelled))])
    proba, probs = probe_teacher(x_train, ytr, x_unlabelled, len(classes), hp.self_train_rounds,
                                 hp.pseudo_label_frac, hp.probe_c)
    idx, labels = select_pseudo_labels(probs, hp.pseudo_label_frac)
    valid_acc = float((proba(x_valid).argmax(1) == yva).mean())
    stats = dict(probe_valid_accuracy=valid_acc, probe_s=time.perf_counter() - t0, round1_pseudo_labelled=len(idx))
    return ([unlabelled[i] for i in idx], labels), stats


def select_members(member_probs: dict[str, np.ndarray], y: np.ndarray) -> tuple[list[str], float]:
    """The ensemble by validation: the best member, then each next-best one whose averaged-in probabilities
    do not lower validation accuracy. A member at chance (a diverged LM's classifier) is never averaged in.

    Returns (member names, the ensemble's validation accuracy).
    """
    acc = {n: float((pr.argmax(1) == y).mean()) for n, pr in member_probs.items()}
    order = sorted(acc, key=lambda n: (-acc[n], n))
    chosen, best = [order[0]], acc[order[0]]
    for n in order[1:]:
        trial = float((np.mean([member_probs[m] for m in chosen + [n]], axis=0).argmax(1) == y).mean())
        if trial >= best:
            chosen, best = chosen + [n], trial
    return chosen, best
