"""The prepare stage's domain corpus: every training text, labelled or not, and no held-out text by default."""

from __future__ import annotations

import pandas as pd

from transfer.config import load_params
from transfer.stages import Paths, run_stage


def _texts(ws, name: str) -> set[str]:
    return set(pd.read_csv(ws / "artifacts/prepare" / name, dtype=str, keep_default_na=False)["text"])


def test_domain_corpus_holds_every_training_text_and_no_validation_or_test_text(workspace):
    run_stage("prepare", load_params(workspace / "params.yaml", ["data.max_train_labels=40"]), Paths(workspace))
    domain = set((workspace / "artifacts/prepare/domain.txt").read_text().splitlines())
    train, unlabelled = _texts(workspace, "train.csv"), _texts(workspace, "unlabelled.csv")
    valid, test = _texts(workspace, "valid.csv"), _texts(workspace, "test.csv")
    assert len(train) == 40 and unlabelled and valid and test
    assert domain == train | unlabelled
    assert not domain & (valid | test)


def test_transductive_flag_adds_the_validation_and_test_texts(workspace):
    p = load_params(workspace / "params.yaml", ["data.domain_include_test=true"])
    assert run_stage("prepare", p, Paths(workspace))["domain_include_test"] is True
    domain = set((workspace / "artifacts/prepare/domain.txt").read_text().splitlines())
    held_out = _texts(workspace, "valid.csv") | _texts(workspace, "test.csv")
    assert domain == _texts(workspace, "train.csv") | held_out
