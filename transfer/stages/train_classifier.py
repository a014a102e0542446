"""train_classifier: ULMFiT classifiers from the domain LMs, self-training guarded by validation, one bundle."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from transfer import rules
from transfer.config import Params
from transfer.evaluate import Predictor, member_name, save_classifier
from transfer.io_utils import write_csv, write_json
from transfer.plots import plot_history, plot_lr_schedule
from transfer.pseudo import select_pseudo_labels
from transfer.stages.classifier import Pseudo, fit
from transfer.stages.record import Stage
from transfer.stages.self_training import probe_pseudo_labels, select_members
from transfer.stages.workspace import Workspace
from transfer.train import training_threads


def classify(p: Params, ws: Workspace, only: str | None = None) -> dict:
    """ULMFiT classifiers (`classifier.members` per direction) from the domain-tuned LMs, in one servable bundle.

    Members of a direction differ only in their seed (init, dropout masks, batch order); averaging them cuts
    the variance of one fine-tuning run. Self-training (`classifier.self_train_rounds`): after each round the
    members' ensemble labels the budget's unlabelled training texts; the confident share joins the labelled
    rows and every member is retrained from its domain LM. With `self_train_teacher: probe`, a linear probe on
    the frozen domain LMs labels round 1 instead of round 0's ensemble. Validation rows guard both choices:
    rounds go on only while the round's validation accuracy improves (the best round is kept, round 0 included),
    and the bundle's ensemble holds only the members that do not lower its validation accuracy
    (`select_members`).

    only=DIRECTION: train that direction's round-0 members to finished checkpoints and return (`Stage.direction`);
    later rounds need both directions' ensemble, so they stay with the stage.
    """
    prepared = ws.prepared()
    p = rules.apply(p, prepared)
    hp, classes, tok, code = p.classifier, prepared["classes"], ws.tokenizer(), STAGE.code_digest()
    unlabelled = list(ws.table("unlabelled")["text"])
    valid = ws.table("valid")
    y_valid = valid["label"].map({c: i for i, c in enumerate(classes)}).to_numpy()
    rounds = hp.self_train_rounds if unlabelled else 0
    pseudo: Pseudo | None = None
    self_training: dict[str, float] = {}
    if only:
        for i in range(hp.members):
            _fit_member(p, ws, only, i, 0, code, None)
        return {}
    best: dict | None = None
    for r in range(rounds + 1):
        states, metrics, rows, steps, models = {}, {}, [], [], {}
        for direction, i in itertools.product(p.model.directions, range(hp.members)):
            t0 = time.perf_counter()
            name = member_name(direction, i)
            model, history, log = _fit_member(p, ws, direction, i, r, code, pseudo)
            states[name] = model.state_dict()
            models[name] = model
            rows += [dict(direction=name, **row) for row in history]
            steps = steps or log
            metrics[name] = dict(valid_accuracy=history[-1]["valid_accuracy"],
                                 valid_loss=history[-1]["valid_loss"], train_s=time.perf_counter() - t0,
                                 torch_threads=training_threads(model))
        member_probs = {n: Predictor(tok, {n: m}, classes, p.evaluate.batch_size).predict_proba(list(valid["text"]))
                        for n, m in models.items()}
        ensemble, ensemble_acc = select_members(member_probs, y_valid)
        this = dict(round=r, states=states, metrics=metrics, rows=rows, steps=steps, ensemble=ensemble,
                    valid_accuracy=ensemble_acc, cfg=next(iter(models.values())).cfg)
        if rounds:
            self_training[f"round{r}_valid_accuracy"] = ensemble_acc
        if best is not None and ensemble_acc <= best["valid_accuracy"]:
            break  # self-training stopped helping on the validation rows: keep the best round so far
        best = this
        if r == 0 and rounds and hp.self_train_teacher == "probe":
            pseudo, probe_stats = probe_pseudo_labels(p, ws, classes, unlabelled)
            self_training.update(probe_stats)
        elif r < rounds:
            probs = Predictor(tok, {n: models[n] for n in ensemble}, classes,
                              p.evaluate.batch_size).predict_proba(unlabelled)
            idx, labels = select_pseudo_labels(probs, hp.pseudo_label_frac)
            pseudo = ([unlabelled[i] for i in idx], labels)
            self_training[f"round{r + 1}_pseudo_labelled"] = len(idx)
    assert best is not None
    save_classifier(ws.art("train_classifier", "model"), ws.art("tokenize", "spm.model"), classes, best["cfg"],
                    best["states"], hp.bptt, hp.max_len, ensemble=best["ensemble"])
    write_csv(ws.plot("classifier_history.csv"), best["rows"])
    write_csv(ws.plot("lr_schedule.csv"), [dict(step=s["step"], lr=s["lr"]) for s in best["steps"]])
    plot_history(best["rows"], ws.plot("classifier_loss.png"), "classifier: loss per epoch")
    plot_lr_schedule(best["steps"], ws.plot("lr_schedule.png"), "classifier LR: gradual unfreezing + STLR")
    metrics = dict(best["metrics"], ensemble=dict(members="+".join(best["ensemble"]),
                                                  valid_accuracy=best["valid_accuracy"]))
    if self_training:
        metrics["self_training"] = dict(self_training, kept_round=best["round"])
    write_json(ws.metrics("train_classifier"), metrics)
    return metrics


def _fit_member(p: Params, ws: Workspace, direction: str, i: int, r: int, code: str, pseudo: Pseudo | None):
    """A direction's i-th member in self-training round r, from its domain LM -> (model, history, lr steps)."""
    name, log = member_name(direction, i), []
    ckpt = ws.art("train_classifier", f"checkpoint-{name}" + (f"-round{r}" if r else "") + ".pt")
    member = replace(p, classifier=replace(p.classifier, seed=p.classifier.seed + 1000 * i))
    model, history = fit(member, ws, direction, ws.art("finetune_lm", f"lm-{direction}.pt"), ckpt, code, log, pseudo)
    return model, history, log


def _classify_direction(p: Params, ws: Workspace, direction: str) -> list[Path]:
    classify(p, ws, only=direction)
    return sorted(ws.art("train_classifier").glob(f"checkpoint-{direction}*.pt"))


STAGE = Stage(
    name="train_classifier", run=classify,
    summary="gradual unfreezing + STLR from the domain LMs; writes the servable bundle artifacts/train_classifier/model",
    params=lambda p: {"model": p.section("model"), "classifier": p.section("classifier"),
                      "evaluate": {"batch_size": p.section("evaluate")["batch_size"]},
                      "data": {"rules": p.section("data")["rules"]}},
    deps=lambda p, ws: [ws.art("prepare", f) for f in ("train.csv", "valid.csv", "unlabelled.csv")]
    + [ws.metrics("prepare"), ws.art("tokenize", "spm.model"), ws.art("finetune_lm")],
    outs=lambda p, ws: [ws.art("train_classifier"), *map(ws.plot, STAGE.curves + STAGE.plots),
                        ws.metrics("train_classifier")],
    plots=("classifier_loss.png", "lr_schedule.png"), curves=("classifier_history.csv", "lr_schedule.csv"),
    history="classifier_history.csv",
    direction=_classify_direction,
)
