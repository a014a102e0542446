"""transfer.rules: the classifier settings that follow the data, resolved at prepare and applied after it."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import torch

from transfer.config import load_params
from transfer.rules import apply, data_stats, resolve, valid_rows
from transfer.stages import Workspace, run_stage
from transfer.train_clas import class_weights


def _stats(n: int, words: int, labels: list[str], unlabelled: int = 0) -> dict:
    texts = [" ".join(["w"] * words)] * n
    return data_stats(texts, (labels * n)[:n], unlabelled)


def test_rules_follow_length_size_balance_and_unlabelled_texts(workspace):
    p = load_params(workspace / "params.yaml", ["classifier.self_train_rounds=4", "classifier.bs=64", "classifier.bptt=70"])
    short = resolve(_stats(100, 20, ["a", "b"]), p)
    long = resolve(_stats(5000, 600, ["a", "b"], unlabelled=900), p)
    assert short["classifier.max_len"]["value"] == 70  # one chunk covers a 26-token text
    assert long["classifier.max_len"]["value"] == 840  # 780 tokens, in whole chunks of 70
    assert resolve(_stats(100, 5000, ["a"]), p)["classifier.max_len"]["value"] == 1440  # capped
    assert short["classifier.bs"]["value"] == 10 and long["classifier.bs"]["value"] == 32  # long texts halve it
    assert short["classifier.self_train_rounds"]["value"] == 0 and long["classifier.self_train_rounds"]["value"] == 4
    imbalanced = resolve(_stats(100, 20, ["a"] * 9 + ["b"]), p)
    assert imbalanced["classifier.class_weights"]["value"] and not short["classifier.class_weights"]["value"]
    assert "9.0" in imbalanced["classifier.class_weights"]["why"]
    # the gate judges imbalanced sets by macro-F1, balanced ones by the configured metric
    assert imbalanced["registry.metric"]["value"] == "macro_f1" and "registry.metric" not in short
    assert apply(p, {"rules": imbalanced}).registry.metric == "macro_f1"


def test_prepare_records_the_rules_and_the_classifier_stages_read_them(workspace):
    p = load_params(workspace / "params.yaml", ["data.rules=true"])
    paths = Workspace(workspace)
    run_stage("prepare", p, paths)
    prepared = json.loads(paths.metrics("prepare").read_text())
    train = pd.read_csv(paths.art("prepare", "train.csv"))
    assert prepared["data_stats"]["n_labelled"] == len(train)
    resolved = apply(p, prepared)
    assert resolved.classifier.max_len == prepared["rules"]["classifier.max_len"]["value"] != p.classifier.max_len
    assert resolved.classifier.min_steps_per_phase == 50
    assert resolved.classifier.min_steps_last_phase == prepared["rules"]["classifier.min_steps_last_phase"]["value"] > 0
    assert apply(p, {"classes": ["a"]}) == p  # data.rules off: nothing changes


def test_small_sets_hold_out_enough_validation_rows_to_compare_on(workspace):
    assert valid_rows(5000, 0.1) == dict(value=500, why="0.1 of 5,000 rows")
    assert valid_rows(1000, 0.1)["value"] == 200  # not 100
    assert valid_rows(400, 0.1)["value"] == 100  # never more than a quarter
    assert "would be 40" in valid_rows(400, 0.1)["why"]
    assert valid_rows(1_022_983, 0.0001)["value"] == 200  # a row count: no fraction to round
    # through prepare: the demo's 240 rows (after its test split) hold out 60 for validation, not 24; the count
    # is recorded beside the rules, so the classifier stages' params stay as loaded
    p = load_params(workspace / "params.yaml", ["data.rules=true"])
    paths = Workspace(workspace)
    run_stage("prepare", p, paths)
    prepared = json.loads(paths.metrics("prepare").read_text())
    assert prepared["n_valid"] == 60 == prepared["valid_rows"]["value"]
    assert len(pd.read_csv(paths.art("prepare", "valid.csv"))) == 60
    assert apply(p, prepared).data == p.data


def test_class_weights_make_a_balanced_set_uniform():
    assert torch.equal(class_weights(np.array([0, 1, 0, 1]), 2), torch.ones(2))
    w = class_weights(np.array([0] * 9 + [1]), 2)
    assert w[1] / w[0] == 9
