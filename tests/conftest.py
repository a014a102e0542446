"""Shared fixtures: a tiny, fast workspace that the real pipeline runs in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from transfer.config import dump_params, load_params
from transfer.demo import make_demo

# tiny test models are dominated by per-op overhead; one thread avoids spin-waiting between the two cores
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]

# The repo's params.yaml shrunk so that the whole pipeline runs in well under a minute on 2 cores.
TINY = [
    "tokenizer.vocab_size=200", "model.emb_size=16", "model.hidden_size=32",
    "pretrain.max_tokens=12000", "pretrain.bs=16", "pretrain.bptt=20", "pretrain.checkpoint_every=10",
    "finetune_lm.bs=16", "finetune_lm.bptt=20", "finetune_lm.epochs=1", "finetune_lm.max_tokens=8000",
    "finetune_lm.checkpoint_every=10", "classifier.unfreeze_epochs=[1, 1]", "classifier.bptt=20",
    "classifier.checkpoint_every=10",
    # a few thousand tokens teach a 16-wide LM little beyond word frequencies: the guard is tested on its own
    "pretrain.fail_at_unigram=null", "finetune_lm.fail_at_unigram=null",
    # nor does a 16-wide classifier beat TF-IDF or chance: the gate's refusals are tested on their own
    "registry.min_delta_over_baseline=-1", "registry.require_above_chance=false",
]


def make_workspace(root: Path, overrides: list[str] = ()) -> Path:
    """params.yaml (tiny) + small synthetic data in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    dump_params(load_params(REPO / "params.yaml", [*TINY, *overrides]), root / "params.yaml")
    make_demo(root / "data" / "demo", n_general_docs=600, n_labelled=320)
    return root


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    """A tiny workspace as the current directory."""
    make_workspace(tmp_path / "ws")
    monkeypatch.chdir(tmp_path / "ws")
    return tmp_path / "ws"


CLASSES = ["business", "science", "sports", "world"]


def make_bundle(dest: Path, corpus: Path, vocab: int = 200, weights_vocab: int | None = None) -> Path:
    """A classifier bundle (random weights, a SentencePiece model trained on `corpus`) without running the
    pipeline; `weights_vocab` other than `vocab` makes a bundle whose weights disagree with its tokenizer."""
    from transfer.evaluate import save_classifier
    from transfer.model import TextClassifier, classifier_config
    from transfer.readers import iter_text_documents
    from transfer.tokenizer import train_tokenizer

    spm = dest.parent / f".{dest.name}-spm.model"  # beside the bundle: only the bundle's own copy is inside it
    train_tokenizer(iter_text_documents([corpus]), spm, vocab_size=vocab, character_coverage=1.0)
    torch.manual_seed(0)
    cfg = classifier_config(weights_vocab or vocab, 0.5, emb_size=16, hidden_size=32, n_layers=2)
    model = TextClassifier(cfg, len(CLASSES), bptt=20, max_len=100)
    save_classifier(dest, spm, CLASSES, cfg, {"fwd": model.state_dict()}, 20, 100)
    return dest


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> str:
    """One real Prefect server for the session's CLI calls (PREFECT_API_URL): each skips starting a temporary one
    (~13 s here). Workspaces keep their own cache (`.prefect-results`) and MLflow store, so they stay apart."""
    from tests.processes import clean_env, free_port, start_server, stop

    procs: dict = {}
    home = tmp_path_factory.mktemp("prefect-server")
    try:
        yield start_server(home, clean_env(home / "home"), free_port(), procs)
    finally:
        for proc, _ in procs.values():
            stop(proc)
