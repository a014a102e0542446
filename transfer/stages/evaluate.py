"""evaluate: every variant in `evaluate.variants` on the same test split, and the champion candidate."""

from __future__ import annotations

import time

import numpy as np

from transfer import rules
from transfer.config import Params
from transfer.evaluate import Predictor, calibrated_average, classification_metrics, fit_temperature
from transfer.io_utils import atomic_path, write_csv, write_json
from transfer.plots import plot_confusion
from transfer.stages.baselines import tfidf_proba
from transfer.stages.classifier import fit
from transfer.stages.record import Stage
from transfer.stages.workspace import Workspace


def evaluate(p: Params, ws: Workspace) -> dict:
    """Every requested variant on the same test split; the best ULMFiT variant is the champion candidate.

    `ulmfit+tfidf` averages the ULMFiT ensemble's and TF-IDF's probabilities after temperature-scaling each
    on the validation rows (labelled training rows held out from tuning), so neither member dominates by
    being more confident.
    """
    prep = ws.prepared()
    p = rules.apply(p, prep)  # the scratch and no_lm_tuning classifiers train as the ULMFiT ones do
    classes = prep["classes"]
    index = {c: i for i, c in enumerate(classes)}
    frames = {s: ws.table(s) for s in ("train", "valid", "test")}
    y, y_valid = (frames[s]["label"].map(index).to_numpy() for s in ("test", "valid"))
    texts, valid_texts = list(frames["test"]["text"]), list(frames["valid"]["text"])
    bundle = ws.art("train_classifier", "model")
    split_texts = {"test": texts, "valid": valid_texts}
    direction_probs: dict[tuple[str, str], np.ndarray] = {}  # (direction, split): each inferred once
    tfidf: dict[str, np.ndarray] = {}  # split -> probabilities of one TF-IDF fit

    def ulmfit(directions: list[str] | None, split: str) -> np.ndarray:
        """One direction's members, or (None) the bundle's ensemble as chosen on validation rows."""
        key = "+".join(directions) if directions else "ensemble"
        if (key, split) not in direction_probs:
            predictor = Predictor.from_dir(bundle, directions, p.evaluate.batch_size)
            direction_probs[key, split] = predictor.predict_proba(split_texts[split])
        return direction_probs[key, split]

    def tfidf_probs(split: str) -> np.ndarray:
        if not tfidf:
            tfidf["test"], tfidf["valid"] = tfidf_proba(frames["train"], [texts, valid_texts], classes, p.data.seed,
                                                          p.evaluate.tfidf_c)
        return tfidf[split]

    probs: dict[str, np.ndarray] = {}
    timings: dict[str, float] = {}
    chosen: dict[str, str] = {}
    mix_scores: dict[str, dict] = {}  # ulmfit+tfidf's options on the validation rows
    for variant in p.evaluate.variants:
        t0 = time.perf_counter()
        if variant == "tfidf":
            probs[variant] = tfidf_probs("test")
        elif variant in ("ulmfit_fwd", "ulmfit_bwd"):
            probs[variant] = ulmfit([variant.split("_")[1]], "test")
        elif variant == "ulmfit_ensemble":
            probs[variant] = ulmfit(None, "test")
        elif variant == "ulmfit+tfidf":  # the average, or its better member where the validation rows say so
            temps = [fit_temperature(ulmfit(None, "valid"), y_valid), fit_temperature(tfidf_probs("valid"), y_valid)]
            options = {"average": lambda split: calibrated_average([ulmfit(None, split), tfidf_probs(split)], temps),
                       "ulmfit": lambda split: ulmfit(None, split), "tfidf": tfidf_probs}
            chosen[variant], mix_scores = choose_on_validation({k: f("valid") for k, f in options.items()}, y_valid)
            probs[variant] = options[chosen[variant]]("test")
        else:  # scratch, no_lm_tuning: the same classifier recipe from a random or an untuned-LM encoder
            source = None if variant == "scratch" else ws.art("pretrain", "lm-fwd.pt")
            # checkpoints in evaluate's own folder: train_classifier's outputs stay untouched
            model, _ = fit(p, ws, "fwd", source, ws.art("evaluate", f"checkpoint-{variant}.pt"), STAGE.code_digest())
            probs[variant] = Predictor(ws.tokenizer(), {"fwd": model}, classes,
                                       p.evaluate.batch_size).predict_proba(texts)
        timings[variant] = time.perf_counter() - t0
    with atomic_path(ws.art("evaluate", "probabilities.npz")) as tmp, open(tmp, "wb") as f:
        np.savez(f, y=y, **probs)  # per-variant test probabilities, for later ensembles and error analysis
    results = {}
    for variant, pr in probs.items():
        m = classification_metrics(y, pr.argmax(1), classes)
        results[variant] = dict(accuracy=m["accuracy"], error_rate=m["error_rate"], macro_f1=m["macro_f1"],
                                seconds=timings[variant], full=m)
    # the registered bundle predicts with its validation-chosen ensemble: that is the candidate, never a test pick
    ulmfit_variants = [v for v in ("ulmfit_ensemble", "ulmfit_fwd", "ulmfit_bwd") if v in results]
    champion = ulmfit_variants[0] if ulmfit_variants else None
    if champion:
        best = results[champion]["full"]
        write_csv(ws.plot("confusion.csv"), [dict(actual=classes[a], predicted=classes[b])
                                                  for a, b in zip(y, probs[champion].argmax(1))])
        plot_confusion(best["confusion_matrix"], classes, ws.plot("confusion.png"), f"{champion} on test")
    # chance: always the training rows' most frequent class (picked without looking at test labels)
    most_frequent = index[frames["train"]["label"].value_counts().idxmax()]
    majority = classification_metrics(y, np.full_like(y, most_frequent), classes)
    metrics = dict(variants={v: {k: r[k] for k in ("accuracy", "error_rate", "macro_f1")} for v, r in results.items()},
                   chance={k: majority[k] for k in ("accuracy", "error_rate", "macro_f1")},
                   details={v: r["full"] for v, r in results.items()}, champion_candidate=champion,
                   chosen_on_validation=chosen, mix_on_validation=mix_scores,
                   seconds={v: r["seconds"] for v, r in results.items()},
                   test_digest=prep["test_digest"], n_test=len(y))
    # the whole record beside the outputs; metrics/evaluate.json keeps the headline (test accuracy per variant)
    # flat, so `dvc metrics show` stays one readable row
    write_json(ws.art("evaluate", "report.json"), metrics)
    write_json(ws.metrics("evaluate"), {v: r["accuracy"] for v, r in metrics["variants"].items()})
    return metrics


def choose_on_validation(options: dict[str, np.ndarray], y: np.ndarray) -> tuple[str, dict[str, dict]]:
    """The option with the best validation accuracy; ties go to the lower NLL, then to the first listed.

    A near-saturated validation set (e.g. 200 rows at 99.5%) ties on accuracy; the NLL still tells how sure
    each option is of the right class. Each option's NLL is taken after its own temperature fit on these rows,
    so an average of calibrated members is not judged less sharp than the members themselves.
    """
    def nll(pr: np.ndarray) -> float:
        scaled = calibrated_average([pr], [fit_temperature(pr, y)])
        return float(-np.log(np.clip(scaled[np.arange(len(y)), y], 1e-12, 1.0)).mean())

    scores = {k: dict(accuracy=float((pr.argmax(1) == y).mean()), nll=nll(pr)) for k, pr in options.items()}
    return max(scores, key=lambda k: (scores[k]["accuracy"], -scores[k]["nll"])), scores


STAGE = Stage(
    name="evaluate", run=evaluate, summary="every variant in evaluate.variants on the same test split",
    params=lambda p: {"model": p.section("model"), "classifier": p.section("classifier"),
                      "evaluate": p.section("evaluate"),
                      "data": {"seed": p.section("data")["seed"], "rules": p.section("data")["rules"]}},
    deps=lambda p, ws: [ws.art("prepare", f) for f in ("train.csv", "valid.csv", "test.csv")]
    + [ws.metrics("prepare"), ws.art("tokenize", "spm.model"), ws.art("train_classifier", "model")]
    + ([ws.art("pretrain")] if {"no_lm_tuning"} & set(p.evaluate.variants) else []),
    outs=lambda p, ws: [ws.art("evaluate"), ws.plot("confusion.csv"), ws.plot("confusion.png"), ws.metrics("evaluate")],
    plots=("confusion.png",), curves=("confusion.csv",), record=lambda ws: ws.art("evaluate", "report.json"),
)
