"""A general LM built once: publish it to a real SQLite-backed MLflow registry, then start another workspace from it."""

from __future__ import annotations

import json
import os

import mlflow
import pytest

from tests.conftest import make_workspace
from transfer.config import load_params
from transfer.errors import TransferError
from transfer.stages import Workspace, run_stage

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")
FWD = ["model.directions=[fwd]", "evaluate.variants=[tfidf,ulmfit_fwd]"]


def _stages(ws, overrides, *names):
    from tasks.lm_registry import resolve

    os.chdir(ws)  # params name data files relative to the workspace
    p, version = resolve(load_params(ws / "params.yaml", overrides), ws)
    for name in names:
        run_stage(name, p, Workspace(ws))
    return version


def test_a_published_lm_starts_another_workspace_without_pretraining(tmp_path, monkeypatch):
    from tasks.lm_registry import publish

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    a = make_workspace(tmp_path / "a", FWD)
    _stages(a, [], "prepare", "tokenize", "pretrain", "finetune_lm")
    version, champion, score = publish(a, load_params(a / "params.yaml"), "general-lm")
    assert (version, champion) == ("1", True) and score > 1

    b = make_workspace(tmp_path / "b", FWD)
    used = _stages(b, ["pretrain.from_lm=models:/general-lm/latest"], "prepare", "tokenize", "pretrain", "finetune_lm")
    assert used == "1"
    assert not list((b / "artifacts" / "pretrain").glob("checkpoint-*"))  # nothing was pretrained here
    for f in ("tokenize/spm.model", "pretrain/lm-fwd.pt"):
        assert (b / "artifacts" / f).read_bytes() == (a / "artifacts" / f).read_bytes()
    tuned = [json.loads((w / "metrics" / "finetune_lm.json").read_text())["fwd"]["valid_ppl"] for w in (a, b)]
    assert tuned[0] == tuned[1]  # the same domain LM as the workspace that built the general LM

    # a second publish of the same LM is the newest version, but not better: the champion stays version 1
    assert publish(a, load_params(a / "params.yaml"), "general-lm")[:2] == ("2", False)
    assert _stages(b, ["pretrain.from_lm=models:/general-lm@champion"], "tokenize") == "1"
    assert (b / "artifacts" / "published" / "general-lm-1" / "MLmodel").is_file()

    scores = mlflow.pyfunc.load_model("models:/general-lm@champion").predict(["the ships of the harbour sailed"])
    assert 1 < scores["perplexity"][0] < 10_000

    c = make_workspace(tmp_path / "c", FWD)
    with pytest.raises(TransferError, match="tokenizer.vocab_size is 300 but the published LM"):
        _stages(c, ["pretrain.from_lm=models:/general-lm/latest", "tokenizer.vocab_size=300"], "tokenize")
    # the same size but another tokenizer: the model file says how it was trained
    with pytest.raises(TransferError, match="tokenizer.byte_fallback is true but the tokenizer of the published "
                                            "LM .* was trained with false: set tokenizer.byte_fallback: false, "
                                            "or publish"):
        _stages(c, ["pretrain.from_lm=models:/general-lm/latest", "tokenizer.byte_fallback=true"], "tokenize")
    assert not (c / "artifacts" / "tokenize").exists()  # refused before anything was written
