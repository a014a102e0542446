"""Typed pipeline params: frozen dataclasses filled from params.yaml by a strict loader.

params.yaml is the single source of truth; the dataclass defaults are the real-data (WikiText-103 + IMDb)
values and params.yaml sets the tiny demo ones. Unknown keys, wrong types and out-of-range values all
fail with a TransferError that names the file (or override) and the key.
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from transfer.errors import TransferError
from transfer.io_utils import atomic_path

__all__ = [
    "DataParams",
    "TokenizerParams",
    "ModelParams",
    "TrainParams",
    "LMTrainParams",
    "PretrainParams",
    "FinetuneLMParams",
    "ClassifierParams",
    "EvaluateParams",
    "RegistryParams",
    "ScheduleParams",
    "MLflowParams",
    "Params",
    "VARIANTS",
    "load_params",
    "dump_params",
    "flatten",
    "read_yaml",
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
    character_coverage: float = 0.9999  # share of characters covered; the rest map to UNK
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
class TrainParams:
    """Optimiser, regularisation and schedule knobs shared by all three training stages."""

    bs: int = 32  # sequences per batch
    bptt: int = 70  # tokens per truncated-backprop window (LM); chunk length when encoding documents (classifier)
    lr: float = 2e-3  # peak learning rate of the last layer group
    lr_decay: float = 2.6  # discriminative lrs: group k from the top trains at lr / lr_decay**k
    wd: float = 0.01  # AdamW weight decay
    clip: float | None = 0.25  # max gradient norm; None: no clipping
    betas: list[float] = field(default_factory=lambda: [0.7, 0.99])  # Adam betas (ULMFiT uses 0.7, not 0.9)
    drop_mult: float = 1.0  # scales every AWD-LSTM dropout together
    alpha: float = 2.0  # activation regularisation (AR) weight
    beta: float = 1.0  # temporal activation regularisation (TAR) weight
    schedule: str = "stlr"  # "stlr": slanted triangular; "one_cycle": cosine one-cycle
    cut_frac: float = 0.1  # share of steps spent warming up
    warmup_min_steps: int = 0  # floor on the warm-up, in optimizer steps per phase (at most half the phase), so a
    # short budget does not reach the peak lr within a few dozen steps
    ratio: float = 32  # peak lr / lowest lr of the schedule
    checkpoint_every: int = 200  # optimiser steps between resumable checkpoints
    early_stop_patience: int | None = None  # evaluations without improvement before stopping; None: never
    seed: int = 0
    precision: str = "auto"  # "auto": bf16 autocast on a GPU or a bf16-capable CPU, else fp32
    spike_factor: float | None = None  # divergence: a step loss above this times the running mean of the loss
    # (or any non-finite loss) rewinds to a state 20-40 steps back and halves the lr; None: non-finite losses only
    max_recoveries: int = 3  # rewinds allowed before training stops with an error; 0: stop at the first divergence

    def __post_init__(self) -> None:
        _at_least(self.bs, "bs", 1)
        _at_least(self.bptt, "bptt", 2)
        _require(self.lr > 0, "lr", f"must be > 0, got {self.lr!r}")
        _at_least(self.lr_decay, "lr_decay", 1)
        _at_least(self.wd, "wd", 0)
        _require(self.clip is None or self.clip > 0, "clip", f"must be > 0 or null, got {self.clip!r}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
                 f"must be two numbers in [0, 1), got {self.betas!r}")
        _require(0 <= self.drop_mult <= 1, "drop_mult", f"must be in [0, 1], got {self.drop_mult!r}")
        _at_least(self.alpha, "alpha", 0)
        _at_least(self.beta, "beta", 0)
        _one_of(self.schedule, "schedule", ["stlr", "one_cycle"])
        _fraction(self.cut_frac, "cut_frac")
        _at_least(self.ratio, "ratio", 1)
        _at_least(self.checkpoint_every, "checkpoint_every", 1)
        _at_least(self.early_stop_patience, "early_stop_patience", 1)
        _one_of(self.precision, "precision", ["auto", "fp32", "bf16"])
        _at_least(self.warmup_min_steps, "warmup_min_steps", 0)
        _require(self.spike_factor is None or self.spike_factor > 1, "spike_factor",
                 f"must be > 1 or null, got {self.spike_factor!r}")
        _at_least(self.max_recoveries, "max_recoveries", 0)


@dataclass(frozen=True)
class LMTrainParams(TrainParams):
    """Language-model training: epochs over a token stream, optionally capped."""

    epochs: int = 1
    max_tokens: int | None = None  # cap on tokens per epoch (a prefix of every batch row); None: all
    spike_factor: float | None = 2.0  # an LM's step loss moves by a few % between steps; a doubling is divergence
    fail_at_unigram: float | None = 0.8  # the stage fails if held-out perplexity ends at or above this share of the
    # unigram model's (healthy 1-epoch Wikipedia LMs: ~0.3; the diverged backward LM: 0.92); None: report only

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.epochs, "epochs", 1)
        _at_least(self.max_tokens, "max_tokens", 1)
        _require(self.fail_at_unigram is None or 0 < self.fail_at_unigram, "fail_at_unigram",
                 f"must be > 0 or null, got {self.fail_at_unigram!r}")


@dataclass(frozen=True)
class PretrainParams(LMTrainParams):
    valid_frac: float = 0.02  # share of the general stream held out to report perplexity

    def __post_init__(self) -> None:
        super().__post_init__()
        _fraction(self.valid_frac, "valid_frac")


@dataclass(frozen=True)
class FinetuneLMParams(LMTrainParams):
    epochs: int = 2  # all layer groups trainable
    freeze_epochs: int = 1  # run first, before `epochs`: only the last layer group trains
    valid_frac: float = 0.1  # share of the domain stream (its end) held out to report perplexity

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.freeze_epochs, "freeze_epochs", 0)
        _fraction(self.valid_frac, "valid_frac")


@dataclass(frozen=True)
class ClassifierParams(TrainParams):
    lr: float = 1e-2
    drop_mult: float = 0.5
    max_len: int = 1440  # tokens of each document's end that get gradients (BPT3C); earlier chunks run no-grad
    unfreeze_epochs: list[int] = field(default_factory=lambda: [1, 1, 1, 2])  # gradual unfreezing: phase k
    # trains the last k layer groups, the final phase trains all of them
    unfreeze_lr_mult: list[float] | None = None  # phase k's peak lr is lr * unfreeze_lr_mult[k]; None: lr in every
    # phase. fastai's tutorial lowers it as more layers thaw (2e-2, 1e-2, 5e-3, 1e-3 = 2, 1, 0.5, 0.1 of 1e-2)
    min_steps_per_phase: int = 0  # lengthen a phase to at least this many steps (tiny data sets)
    self_train_rounds: int = 0  # label budgets: rounds of retraining on pseudo-labelled unlabelled training texts
    pseudo_label_frac: float = 0.5  # share of the unlabelled texts pseudo-labelled per round, most confident first
    self_train_teacher: str = "classifier"  # who labels round 1: "classifier" (round 0 fine-tunes on the labelled
    # rows) or "probe" (logistic regression on the frozen domain LMs' features, self-trained; no round-0 fine-tune)
    probe_c: float = 0.003  # the probe's inverse L2 strength, on standardised features
    members: int = 1  # classifiers per direction, member i seeded seed + 1000 * i; the ulmfit variants average them
    class_weights: bool = False  # weight the loss by inverse class frequency (imbalanced classes)
    min_steps_per_epoch: int = 10  # few labels: the batch shrinks (to no less than min_bs) so an epoch has this many
    min_bs: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self.max_len, "max_len", 1)
        _at_least(self.self_train_rounds, "self_train_rounds", 0)
        _at_least(self.members, "members", 1)
        _require(0 < self.pseudo_label_frac <= 1, "pseudo_label_frac",
                 f"must be in (0, 1], got {self.pseudo_label_frac!r}")
        _require(self.self_train_teacher in ("classifier", "probe"), "self_train_teacher",
                 f"must be 'classifier' or 'probe', got {self.self_train_teacher!r}")
        _require(self.probe_c > 0, "probe_c", f"must be > 0, got {self.probe_c!r}")
        _require(len(self.unfreeze_epochs) > 0 and all(e >= 0 for e in self.unfreeze_epochs), "unfreeze_epochs",
                 f"must be a non-empty list of epoch counts >= 0, got {self.unfreeze_epochs!r}")
        _require(self.epochs > 0, "unfreeze_epochs", "must train for at least one epoch in total")
        if self.unfreeze_lr_mult is not None:
            _require(len(self.unfreeze_lr_mult) == len(self.unfreeze_epochs), "unfreeze_lr_mult",
                     f"must have one multiplier per unfreeze_epochs entry ({len(self.unfreeze_epochs)}), "
                     f"got {self.unfreeze_lr_mult!r}")
            _require(all(m > 0 for m in self.unfreeze_lr_mult), "unfreeze_lr_mult",
                     f"must be positive, got {self.unfreeze_lr_mult!r}")
        _at_least(self.min_steps_per_phase, "min_steps_per_phase", 0)
        _at_least(self.min_steps_per_epoch, "min_steps_per_epoch", 1)
        _at_least(self.min_bs, "min_bs", 1)

    @property
    def epochs(self) -> int:
        """Total classifier epochs over all unfreezing phases."""
        return sum(self.unfreeze_epochs)


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


@dataclass(frozen=True)
class Params:
    data: DataParams = field(default_factory=DataParams)
    tokenizer: TokenizerParams = field(default_factory=TokenizerParams)
    model: ModelParams = field(default_factory=ModelParams)
    pretrain: PretrainParams = field(default_factory=PretrainParams)
    finetune_lm: FinetuneLMParams = field(default_factory=FinetuneLMParams)
    classifier: ClassifierParams = field(default_factory=ClassifierParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)
    registry: RegistryParams = field(default_factory=RegistryParams)
    schedule: ScheduleParams = field(default_factory=ScheduleParams)
    mlflow: MLflowParams = field(default_factory=MLflowParams)

    def __post_init__(self) -> None:
        needs = {"ulmfit_fwd": {"fwd"}, "ulmfit_bwd": {"bwd"}, "ulmfit_ensemble": {"fwd", "bwd"}}
        for variant in self.evaluate.variants:
            missing = needs.get(variant, set()) - set(self.model.directions)
            _require(not missing, "evaluate.variants",
                     f"includes {variant!r} but model.directions is {self.model.directions!r}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (lists, not tuples) in params.yaml order."""
        return dataclasses.asdict(self)

    def section(self, name: str) -> dict[str, Any]:
        """One section as a plain dict, e.g. what a stage logs or hashes."""
        sections = [f.name for f in dataclasses.fields(self)]
        if name not in sections:
            raise TransferError(f"unknown params section {name!r}{_did_you_mean(name, sections)}")
        return dataclasses.asdict(getattr(self, name))


# --------------------------------------------------------------------------- loading


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content; a missing file or bad YAML is a TransferError naming the file (and line)."""
    where = str(path)
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TransferError(f"{where}: file not found") from None
    except yaml.MarkedYAMLError as e:
        line = f", line {e.problem_mark.line + 1}" if e.problem_mark else ""
        raise TransferError(f"{where}{line}: not valid YAML ({e.problem})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise TransferError(f"{where}: not valid YAML ({e})") from None


def load_params(path: str | Path = "params.yaml", overrides: Iterable[str] = ()) -> Params:
    """Read params.yaml, apply `section.key=value` overrides (as `dvc exp run -S`), validate everything."""
    path = Path(path)
    where = str(path)
    raw = read_yaml(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise TransferError(f"{where}: must be a mapping of sections, got {type(raw).__name__}")

    sources: dict[str, str] = {}  # key path -> where its value came from, for error messages
    for item in overrides:
        section, key, value = _parse_override(item)
        if raw.get(section) is None:  # absent, or a bare `section:` line
            raw[section] = {}
        raw_section = raw[section]
        if not isinstance(raw_section, dict):
            raise TransferError(f"{where}: section '{section}' must be a mapping, got {raw_section!r}")
        raw_section[key] = value
        sources[f"{section}.{key}"] = f"override '{item}'"
    return _build_params(raw, where, sources)


def dump_params(params: Params, path: str | Path) -> Path:
    """Write params as YAML atomically (loadable again by load_params)."""
    with atomic_path(path) as tmp:
        tmp.write_text(yaml.safe_dump(params.to_dict(), sort_keys=False), encoding="utf-8")
    return Path(path)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"classifier": {"lr": 0.01}} -> {"classifier.lr": 0.01}; lists become JSON strings (for MLflow params)."""
    flat: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(list(value))
        else:
            flat[name] = value
    return flat


def _parse_override(item: str) -> tuple[str, str, Any]:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise TransferError(f"override '{item}': expected section.key=value, e.g. classifier.lr=0.01")
    section, name = parts
    sections = _section_types()
    if section not in sections:
        raise TransferError(f"override '{item}': unknown section '{section}'{_did_you_mean(section, sections)}")
    _check_key(f"override '{item}'", section, name, sections[section])
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TransferError(f"override '{item}': value is not valid YAML ({e})") from None
    return section, name, value


_HINTS = {"classifier.epochs": " (the classifier trains sum(unfreeze_epochs) epochs; set unfreeze_epochs)"}


def _check_key(where: str, section: str, key: str, cls: type) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    if key not in names:
        hint = _HINTS.get(f"{section}.{key}") or _did_you_mean(key, names)
        raise TransferError(f"{where}: unknown key '{section}.{key}'{hint}")


def _section_types() -> dict[str, type]:
    return typing.get_type_hints(Params)


def _build_params(raw: dict[str, Any], where: str, sources: dict[str, str]) -> Params:
    sections = _section_types()
    for name in raw:
        if name not in sections:
            raise TransferError(f"{where}: unknown section '{name}'{_did_you_mean(str(name), sections)}")
    built = {}
    for name, cls in sections.items():
        values = raw.get(name)
        values = {} if values is None else values
        if not isinstance(values, dict):
            raise TransferError(f"{where}: section '{name}' must be a mapping of keys, got {values!r}")
        built[name] = _build_section(cls, name, values, where, sources)
    try:
        return Params(**built)
    except _Invalid as e:
        source = sources.get(e.key) or (f"{where} with overrides" if sources else where)
        raise TransferError(f"{source}: {e.key} {e.problem}") from None


def _build_section(cls: type, section: str, values: dict[str, Any], where: str, sources: dict[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        key = str(key)
        _check_key(where, section, key, cls)
        path = f"{section}.{key}"
        kwargs[key] = _coerce(value, hints[key], path, sources.get(path, where))
    try:
        return cls(**kwargs)
    except _Invalid as e:
        path = f"{section}.{e.key}"
        raise TransferError(f"{sources.get(path, where)}: {path} {e.problem}") from None


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")  # what float() accepts, minus nan/inf


def _coerce(value: Any, tp: Any, path: str, where: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where the meaning is unambiguous."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, path, where)
    if origin is list:
        if isinstance(value, str) and args[0] is str:
            value = [value]  # `general: data/x.txt` or `-S model.directions=fwd`
        if not isinstance(value, list):
            raise TransferError(f"{where}: {path} must be a list of {args[0].__name__}, got {value!r}")
        return [_coerce(v, args[0], f"{path}[{i}]", where) for i, v in enumerate(value)]
    if tp is bool and isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    if tp is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # a column named by index: `label_col: 0`, `text_cols: [1, 2]`
    if tp is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        number = _as_float(value)
        if number is not None and number.is_integer():  # 1e6 or "1e6" (PyYAML reads 1e6 as a string)
            return int(number)
    if tp is float and not isinstance(value, bool):
        number = _as_float(value)
        if number is not None:
            return number
    raise TransferError(f"{where}: {path} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _as_float(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):  # PyYAML 1.1 reads 1e-3 as a string
        return float(value)
    return None


def _type_name(tp: Any) -> str:
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
