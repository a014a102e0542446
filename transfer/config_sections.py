"""The params.yaml sections outside training (data, tokenizer, model, evaluate, registry, schedule, mlflow), and
the range checks every section runs in `__post_init__`.

Split from transfer/config.py (the file-level `Params` and its loader) so that each module stays readable;
the training sections are in transfer/config_train.py. Import them from transfer.config, which re-exports all.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from transfer.errors import TransferError

__all__ = [
    "VARIANTS",
    "DataParams",
    "TokenizerParams",
    "ModelParams",
    "EvaluateParams",
    "RegistryParams",
    "ScheduleParams",
    "MLflowParams",
]

VARIANTS = ("tfidf", "scratch", "no_lm_tuning", "ulmfit_fwd", "ulmfit_bwd", "ulmfit_ensemble", "ulmfit+tfidf")


class _Invalid(TransferError):
    """A value out of range; the loader prefixes the file and section."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key} {problem}")
        self.key, self.problem = key, problem


def _require(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise _Invalid(key, problem)


def _one_of(value: Any, key: str, allowed: Iterable[str]) -> None:
    allowed = list(allowed)
    _require(value in allowed, key, f"must be one of {allowed}, got {value!r}")


def _fraction(value: float, key: str) -> None:
    _require(0 < value < 1, key, f"must be in (0, 1), got {value!r}")


def _at_least(value: int | float | None, key: str, low: int | float) -> None:
    _require(value is None or value >= low, key, f"must be >= {low}, got {value!r}")


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class DataParams:
    general: list[str] = field(default_factory=lambda: ["data/demo/general.txt"])  # files, folders or globs
    general_doc_per: str = "line"  # "line": each non-empty line is a document; "file": each file is one
    train: str = "data/demo/train.csv"  # labelled table: CSV/TSV/Parquet/JSONL by suffix
    valid: str | None = None  # None: hold out valid_frac of train
    test: str | None = None  # None: hold out test_frac of train
    text_cols: list[str] = field(default_factory=lambda: ["text"])  # joined with " " when several
    label_col: str = "label"
    header: bool = True  # False: columns are named "0", "1", ...
    encoding: str = "utf-8"
    domain: list[str] = field(default_factory=list)  # extra unlabelled in-domain text for LM fine-tuning
    lm_eval: list[str] = field(default_factory=list)  # held-out text to report the general LM's perplexity on
    domain_include_test: bool = False  # also tune the LM on validation + test texts (no labels; transductive)
    max_train_labels: int | None = None  # keep only this many labelled train rows (learning-curve runs)
    valid_frac: float = 0.1
    test_frac: float = 0.2
    seed: int = 0  # split seed
    label_seed: int = 0  # which rows a max_train_labels subsample keeps (varied by the sample-efficiency runs)
    rules: bool = False  # resolve the classifier settings that depend on the data at `prepare` (transfer/rules.py)
    on_conflict: str = "error"  # one text, several labels: "error", "drop" its rows, or keep the "majority" label

    def __post_init__(self) -> None:
        _require(len(self.general) > 0, "general", "must name at least one file, folder or glob")
        _one_of(self.general_doc_per, "general_doc_per", ["line", "file"])
        _one_of(self.on_conflict, "on_conflict", ["error", "drop", "majority"])
        _require(self.train != "", "train", "must name the labelled table")
        _require(len(self.text_cols) > 0, "text_cols", "must name at least one column")
        try:
            codecs.lookup(self.encoding)
        except LookupError:
            raise _Invalid("encoding", f"is not a known text encoding: {self.encoding!r}") from None
        _at_least(self.max_train_labels, "max_train_labels", 1)
        _fraction(self.valid_frac, "valid_frac")
        _fraction(self.test_frac, "test_frac")
        _require(self.valid_frac + self.test_frac < 1, "valid_frac", "plus test_frac must be < 1")


@dataclass(frozen=True)
class TokenizerParams:
    vocab_size: int = 15000  # SentencePiece pieces, including the 4 special ids
    model_type: str = "unigram"
    character_coverage: float = 0.9999  # share of characters covered; the rest map to UNK (or bytes, below)
    byte_fallback: bool = False  # characters outside the vocab as UTF-8 byte pieces, not one shared UNK
    max_sentences: int = 1_000_000  # documents sampled to train SentencePiece (memory bound)
    seed: int = 0

    def __post_init__(self) -> None:
        _at_least(self.vocab_size, "vocab_size", 8)
        _one_of(self.model_type, "model_type", ["unigram", "bpe"])
        _require(0 < self.character_coverage <= 1, "character_coverage",
                 f"must be in (0, 1], got {self.character_coverage!r}")
        _at_least(self.max_sentences, "max_sentences", 1)


@dataclass(frozen=True)
class ModelParams:
    emb_size: int = 400
    hidden_size: int = 1152
    n_layers: int = 3
    directions: list[str] = field(default_factory=lambda: ["fwd", "bwd"])  # one LM + classifier per direction

    def __post_init__(self) -> None:
        _at_least(self.emb_size, "emb_size", 1)
        _at_least(self.hidden_size, "hidden_size", 1)
        _at_least(self.n_layers, "n_layers", 1)
        _require(len(self.directions) > 0 and set(self.directions) <= {"fwd", "bwd"}, "directions",
                 f"must be a non-empty subset of ['fwd', 'bwd'], got {self.directions!r}")
        _require(len(set(self.directions)) == len(self.directions), "directions",
                 f"has a repeated entry: {self.directions!r}")


@dataclass(frozen=True)
class EvaluateParams:
    variants: list[str] = field(default_factory=lambda: ["tfidf", "ulmfit_fwd", "ulmfit_bwd", "ulmfit_ensemble",
                                                          "ulmfit+tfidf"])
    batch_size: int = 64  # documents per inference batch
    tfidf_c: float = 10.0  # the TF-IDF baseline's inverse L2 strength (logistic regression C)

    def __post_init__(self) -> None:
        _require(len(self.variants) > 0, "variants", "must name at least one variant")
        for v in self.variants:
            _one_of(v, "variants", VARIANTS)
        _require(len(set(self.variants)) == len(self.variants), "variants", f"has a repeated entry: {self.variants!r}")
        _at_least(self.batch_size, "batch_size", 1)
        _require(self.tfidf_c > 0, "tfidf_c", f"must be > 0, got {self.tfidf_c!r}")


@dataclass(frozen=True)
class RegistryParams:
    model_name: str = "transfer-classifier"  # MLflow registered-model name
    metric: str = "accuracy"  # test metric that decides promotion
    min_delta: float = 0.0  # a candidate must reach the current champion + this (ties promote at 0)
    min_accuracy: float = 0.0  # and reach at least this test accuracy
    min_delta_over_baseline: float = 0.0  # and beat the same run's tfidf baseline by this much
    require_above_chance: bool = True  # and beat always predicting the most frequent class

    def __post_init__(self) -> None:
        _require(self.model_name.strip() != "", "model_name", "must not be empty")
        _require(self.metric.strip() != "", "metric", "must not be empty")
        _at_least(self.min_delta, "min_delta", 0)
        _require(0 <= self.min_accuracy <= 1, "min_accuracy", f"must be in [0, 1], got {self.min_accuracy!r}")
        _require(-1 <= self.min_delta_over_baseline <= 1, "min_delta_over_baseline",
                 f"must be in [-1, 1], got {self.min_delta_over_baseline!r}")
        _require(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.model_name) is not None, "model_name",
                 f"must be letters, digits, '_', '.' or '-' (no path separators), got {self.model_name!r}")


@dataclass(frozen=True)
class ScheduleParams:
    cron: str = "0 3 * * *"  # five-field cron, server time zone
    deployment_name: str = "nightly"

    def __post_init__(self) -> None:
        _require(len(self.cron.split()) == 5, "cron", f"must have five fields, got {self.cron!r}")
        _require(self.deployment_name.strip() != "", "deployment_name", "must not be empty")


@dataclass(frozen=True)
class MLflowParams:
    experiment: str = "transfer"
    artifact_location: str = "mlartifacts"  # folder for run artifacts, relative to the repo root

    def __post_init__(self) -> None:
        _require(self.experiment.strip() != "", "experiment", "must not be empty")
        uri = re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", self.artifact_location)  # s3://, gs://, file:// ...
        inside = not Path(self.artifact_location).is_absolute() and ".." not in Path(self.artifact_location).parts
        _require(bool(uri) or inside, "artifact_location",
                 f"must be a folder inside the workspace or a URI (s3://...), got {self.artifact_location!r}")
