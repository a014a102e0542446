"""Typed pipeline params: frozen dataclasses filled from params.yaml by a strict loader.

params.yaml is the single source of truth; the dataclass defaults are the real-data (WikiText-103 + IMDb)
values and params.yaml sets the tiny demo ones. Unknown keys, wrong types and out-of-range values all
fail with a TransferError that names the file (or override) and the key.

This module is the file (`Params`) and its loader; the sections live in transfer/config_sections.py and
transfer/config_train.py and are re-exported here, so `from transfer.config import ...` reaches every one.
"""

from __future__ import annotations

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

from transfer.config_sections import (
    VARIANTS, DataParams, EvaluateParams, MLflowParams, ModelParams, RegistryParams, ScheduleParams, TokenizerParams,
    _Invalid, _require,
)
from transfer.config_train import ClassifierParams, FinetuneLMParams, LMTrainParams, PretrainParams, TrainParams
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
