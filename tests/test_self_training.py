"""Self-training on a label budget: pseudo-label selection, and the real stages on a tiny workspace."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.config import load_params
from transfer.errors import TransferError
from transfer.evaluate import Predictor, save_classifier
from transfer.model import AWDLSTMConfig
from transfer.pseudo import probe_teacher, select_pseudo_labels
from transfer.stages import Workspace, run_stage
from transfer.train import load_checkpoint


def test_keeps_the_most_confident_rows_of_each_predicted_class():
    probs = np.array([[0.9, 0.1], [0.6, 0.4], [0.8, 0.2], [0.3, 0.7], [0.45, 0.55], [0.1, 0.9]])
    idx, labels = select_pseudo_labels(probs, frac=2 / 3)  # quota: 2 rows per class
    assert idx.tolist() == [0, 2, 3, 5]
    assert labels.tolist() == [0, 0, 1, 1]


def test_an_over_predicted_class_is_capped_at_its_quota():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet([1, 1, 1], size=300)
    probs[:250] = [0.8, 0.1, 0.1]  # class 0 predicted for most rows, and confidently
    _, labels = select_pseudo_labels(probs, frac=0.5)
    assert np.bincount(labels, minlength=3)[0] == 50


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(2, 5), frac=st.floats(0.05, 1.0), seed=st.integers(0, 10_000))
def test_selection_invariants(n, k, frac, seed):
    probs = np.random.default_rng(seed).dirichlet(np.ones(k), size=n)
    idx, labels = select_pseudo_labels(probs, frac)
    assert len(set(idx.tolist())) == len(idx) <= n
    assert (labels == probs[idx].argmax(1)).all()
    counts = np.bincount(labels, minlength=k)
    assert counts.max(initial=0) <= int(frac * n / k)
    for c in range(k):  # nothing left out of a class is more confident than what was kept
        kept = probs[idx[labels == c]].max(1)
        dropped = np.setdiff1d(np.flatnonzero(probs.argmax(1) == c), idx)
        if len(kept) and len(dropped):
            assert probs[dropped].max(1).max() <= kept.min()


def test_rejects_a_bad_fraction():
    with pytest.raises(ValueError, match="0 < frac <= 1"):
        select_pseudo_labels(np.full((4, 2), 0.5), 0.0)


def _clusters(n_per_class: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """k Gaussian blobs in 20 dimensions, close enough together that a few labels mislead a linear model."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 0.9, size=(k, 20))
    y = np.repeat(np.arange(k), n_per_class)
    return centres[y] + rng.normal(size=(len(y), 20)), y


def test_the_probe_labels_unlabelled_rows_and_self_training_does_not_hurt_it():
    x, y = _clusters(300, 3, seed=0)
    lab = np.concatenate([np.flatnonzero(y == c)[:4] for c in range(3)])  # 12 labelled rows
    unl = np.setdiff1d(np.arange(len(y)), lab)
    accs = []
    for rounds in (0, 3):
        _, probs = probe_teacher(x[lab], y[lab], x[unl], 3, rounds=rounds, frac=0.8, c=1.0)
        assert probs.shape == (len(unl), 3) and np.allclose(probs.sum(1), 1)
        accs.append((probs.argmax(1) == y[unl]).mean())
    assert accs[0] > 0.6  # far above chance (1/3) from 12 labels
    assert accs[1] >= accs[0] - 0.01


def test_a_class_without_labels_gets_a_zero_column_not_a_shifted_one():
    x, y = _clusters(50, 3, seed=1)
    lab = np.flatnonzero(y != 1)[::5]  # class 1 never labelled
    proba, probs = probe_teacher(x[lab], y[lab], x, 3, rounds=1, frac=0.5, c=1.0)
    assert (probs[:, 1] == 0).all() and np.allclose(probs.sum(1), 1)
    assert ((probs.argmax(1) == y) | (y == 1)).mean() > 0.6  # columns 0 and 2 still mean classes 0 and 2
    assert np.allclose(proba(x[:5]), probs[:5])


def test_a_probe_teacher_labels_round_1_and_round_0_stays_a_fallback(workspace):
    budget = ["data.max_train_labels=40", "classifier.self_train_rounds=1", "classifier.pseudo_label_frac=0.5",
              "classifier.self_train_teacher=probe"]
    p = load_params(workspace / "params.yaml", budget)
    paths = Workspace(workspace)
    for stage in ("prepare", "tokenize", "pretrain", "finetune_lm", "train_classifier"):
        run_stage(stage, p, paths)
    unlabelled = pd.read_csv(paths.art("prepare", "unlabelled.csv"))
    st = json.loads(paths.metrics("train_classifier").read_text())["self_training"]
    assert 0 <= st["probe_valid_accuracy"] <= 1 and st["probe_s"] > 0
    assert 0 < st["round1_pseudo_labelled"] <= len(unlabelled) // 2
    # round 0 trained on the labelled rows alone, so the guard can keep it when round 1 does not beat it
    kept = 1 if st["round1_valid_accuracy"] > st["round0_valid_accuracy"] else 0
    assert st["kept_round"] == kept
    ck0 = load_checkpoint(paths.art("train_classifier", "checkpoint-fwd.pt"))
    ck1 = load_checkpoint(paths.art("train_classifier", "checkpoint-fwd-round1.pt"))
    assert ck1["position"]["global_step"] > ck0["position"]["global_step"]  # round 1 read the pseudo rows too
    bundle = load_checkpoint(paths.art("train_classifier", "model") / "fwd.pt")
    assert all(torch_equal(bundle[k], (ck0, ck1)[kept]["model"][k]) for k in bundle)


def test_label_budget_stages_self_train_on_the_unlabelled_rows(workspace):
    budget = ["data.max_train_labels=40", "classifier.self_train_rounds=1", "classifier.pseudo_label_frac=0.5"]
    p = load_params(workspace / "params.yaml", budget)
    paths = Workspace(workspace)
    prep = run_stage("prepare", p, paths)

    read = lambda name: pd.read_csv(paths.art("prepare", name), dtype=str, keep_default_na=False)  # noqa: E731
    train, unlabelled = read("train.csv"), read("unlabelled.csv")
    assert list(unlabelled.columns) == ["text"]  # no labels leak into the unlabelled rows
    assert len(train) == 40 and len(unlabelled) == prep["n_train_unlabelled"] > 0
    assert not set(train["text"]) & set(unlabelled["text"])
    assert not set(read("test.csv")["text"]) & set(unlabelled["text"])

    for stage in ("tokenize", "pretrain", "finetune_lm", "train_classifier"):
        run_stage(stage, p, paths)
    metrics = json.loads(paths.metrics("train_classifier").read_text())
    n_pseudo = metrics["self_training"]["round1_pseudo_labelled"]
    assert 0 < n_pseudo <= len(unlabelled) // 2
    ck0 = load_checkpoint(paths.art("train_classifier", "checkpoint-fwd.pt"))
    ck1 = load_checkpoint(paths.art("train_classifier", "checkpoint-fwd-round1.pt"))
    bundle = load_checkpoint(paths.art("train_classifier", "model") / "fwd.pt")
    head = next(k for k in bundle if k.startswith("head") and k.endswith("weight"))
    # the bundle holds the round the validation rows chose: round 1 only if it beat round 0
    st = metrics["self_training"]
    kept = 1 if st["round1_valid_accuracy"] > st["round0_valid_accuracy"] else 0
    assert st["kept_round"] == kept
    assert torch_equal(bundle[head], (ck0, ck1)[kept]["model"][head])
    assert not torch_equal(bundle[head], (ck0, ck1)[1 - kept]["model"][head])
    # round 1 trained on labelled + pseudo-labelled rows: more steps per epoch than round 0
    assert ck1["position"]["global_step"] > ck0["position"]["global_step"]


def test_all_labels_leave_nothing_to_self_train_on(workspace):
    p = load_params(workspace / "params.yaml", ["classifier.self_train_rounds=2"])
    paths = Workspace(workspace)
    run_stage("prepare", p, paths)
    assert pd.read_csv(paths.art("prepare", "unlabelled.csv")).empty
    for stage in ("tokenize", "pretrain", "finetune_lm", "train_classifier"):
        run_stage(stage, p, paths)
    assert "self_training" not in json.loads(paths.metrics("train_classifier").read_text())
    assert not list(paths.art("train_classifier").glob("*round*"))


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_adding_a_direction_keeps_the_finished_one(workspace):
    """A direction's checkpoints depend on its own inputs only: adding bwd resumes fwd's finished runs."""
    paths = Workspace(workspace)
    fwd = load_params(workspace / "params.yaml", ["model.directions=[fwd]", "evaluate.variants=[tfidf, ulmfit_fwd]"])
    for stage in ("prepare", "tokenize", "pretrain", "finetune_lm"):
        run_stage(stage, fwd, paths)
    cks = [paths.art(s, "checkpoint-fwd.pt") for s in ("pretrain", "finetune_lm")]
    before = [c.stat().st_mtime_ns for c in cks]
    both = load_params(workspace / "params.yaml", ["model.directions=[fwd, bwd]"])
    for stage in ("pretrain", "finetune_lm"):
        run_stage(stage, both, paths)
    assert [c.stat().st_mtime_ns for c in cks] == before  # fwd was not retrained (nor its checkpoint rewritten)
    assert all(paths.art(s, "lm-bwd.pt").exists() for s in ("pretrain", "finetune_lm"))


def test_members_are_seeded_apart_and_the_bundle_averages_them(workspace):
    one_direction = ["model.directions=[fwd]", "evaluate.variants=[tfidf,ulmfit_fwd]"]
    p = load_params(workspace / "params.yaml", ["classifier.members=2", *one_direction])
    paths = Workspace(workspace)
    for stage in ("prepare", "tokenize", "pretrain", "finetune_lm", "train_classifier"):
        run_stage(stage, p, paths)
    bundle = paths.art("train_classifier", "model")
    assert json.loads((bundle / "meta.json").read_text())["members"] == ["fwd", "fwd-1"]
    metrics = json.loads(paths.metrics("train_classifier").read_text())
    assert set(metrics) == {"fwd", "fwd-1", "ensemble"}
    ensemble = json.loads((bundle / "meta.json").read_text())["ensemble"]
    assert "+".join(sorted(metrics["ensemble"]["members"].split("+"))) == "+".join(ensemble)
    assert list(Predictor.from_dir(bundle).models) == ensemble  # the default prediction is the chosen ensemble
    w0, w1 = (load_checkpoint(bundle / f"{m}.pt") for m in ("fwd", "fwd-1"))
    head = next(k for k in w0 if k.startswith("head") and k.endswith("weight"))
    assert not torch_equal(w0[head], w1[head])  # member 1 trained from its own seed

    texts = list(pd.read_csv(paths.art("prepare", "test.csv"), dtype=str, keep_default_na=False)["text"])
    both = Predictor.from_dir(bundle, ["fwd"])
    single = {}
    for name in ("fwd", "fwd-1"):
        single[name] = Predictor(both.tokenizer, {name: both.models[name]}, both.classes).predict_proba(texts)
    np.testing.assert_allclose(both.predict_proba(texts), (single["fwd"] + single["fwd-1"]) / 2, atol=1e-6)
    assert Predictor.from_dir(bundle, ["fwd"]).models.keys() == {"fwd", "fwd-1"}
    with pytest.raises(TransferError, match="no bwd classifier in this bundle"):
        Predictor.from_dir(bundle, ["bwd"])

    # a smaller bundle written over it (members lowered to 1) keeps no stale member
    meta = json.loads((bundle / "meta.json").read_text())
    save_classifier(bundle, paths.art("tokenize", "spm.model"), meta["classes"],
                    AWDLSTMConfig(**meta["config"]), {"fwd": w0}, meta["bptt"], meta["max_len"])
    assert sorted(f.name for f in bundle.glob("*.pt")) == ["fwd.pt"]
    assert list(Predictor.from_dir(bundle).models) == ["fwd"]
