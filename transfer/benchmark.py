"""A benchmark suite: datasets x label budgets x seeds, each cell scored for every `evaluate.variants` entry.

The suite file (YAML) names the base params (the real-data default), the datasets and the budgets and seeds;
one general LM serves every dataset. This module reads the suite, says what a cell overrides, and turns rows
into the results table; `flows/benchmark.py` runs the cells.
"""

from __future__ import annotations

import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transfer.config import Params, _build_section, _check_key, _coerce, load_params, read_yaml
from transfer.errors import TransferError

__all__ = ["Dataset", "Suite", "load_suite", "cell_overrides", "cell_key", "markdown_table", "COLUMNS"]

COLUMNS = ["dataset", "budget", "seed", "variant", "error", "accuracy", "macro_f1", "seconds", "n_labels", "n_test",
           "threads", "chosen", "cell_digest", "commit"]  # threads: torch threads the classifiers trained on;
# commit: the code that made the row ("" in rows from before the column)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a dataset's name is a folder name


@dataclass(frozen=True)
class Dataset:
    name: str
    train: str
    test: str | None = None  # None: held out of train (data.test_frac)
    valid: str | None = None  # None: held out of train (data.valid_frac)
    text_cols: list[str] = field(default_factory=lambda: ["text"])
    label_col: str = "label"
    header: bool = True
    encoding: str = "utf-8"

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise TransferError(f"dataset name {self.name!r} must be letters, digits, '_', '.' or '-' (a folder name)")

    def overrides(self) -> list[str]:
        """The `data.*` overrides that point the base params at this dataset."""
        value = lambda v: "null" if v is None else json.dumps(v)  # noqa: E731  (YAML reads JSON scalars and lists)
        return [f"data.{k}={value(getattr(self, k))}"
                for k in ("train", "test", "valid", "text_cols", "label_col", "header", "encoding")]


@dataclass(frozen=True)
class Suite:
    params: str  # the base params file every dataset starts from
    datasets: list[Dataset]
    budgets: list[str] = field(default_factory=lambda: ["100", "all"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    general_lm: str | None = None  # a workspace folder with artifacts/{tokenize,pretrain}; None: built in OUT/general
    overrides: list[str] = field(default_factory=list)  # `section.key=value` applied to every dataset

    def __post_init__(self) -> None:
        names = [d.name for d in self.datasets]
        if not names:
            raise TransferError("a suite needs at least one dataset")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise TransferError(f"dataset {dup[0]!r} is listed twice")
        for b in self.budgets:
            check_budget(b)

    def params_for(self, dataset: Dataset, extra: list[str] = ()) -> Params:
        return load_params(self.params, [*self.overrides, *dataset.overrides(), *extra])


def check_budget(budget: str) -> str:
    if budget != "all" and not (budget.isdigit() and int(budget) > 0):
        raise TransferError(f"label budget {budget!r} must be a positive number of labels or 'all'")
    return budget


def load_suite(path: str | Path) -> Suite:
    """Read and validate a suite file; unknown keys fail naming the file and the key."""
    path = Path(path)
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise TransferError(f"{path}: a suite is a mapping with params, datasets, budgets and seeds")
    raw = dict(raw)
    datasets = raw.pop("datasets", None)
    if not isinstance(datasets, list) or not all(isinstance(d, dict) for d in datasets):
        raise TransferError(f"{path}: 'datasets' must be a list of mappings (name, train, test, ...)")
    if "params" not in raw:
        raise TransferError(f"{path}: 'params' (the base params file) is missing")
    raw["budgets"] = [str(b) for b in raw.get("budgets", ["100", "all"])]
    built = [_build_section(Dataset, f"datasets[{i}]", d, str(path), {}) for i, d in enumerate(datasets)]
    hints = typing.get_type_hints(Suite)
    kwargs = {}
    for key, value in raw.items():
        _check_key(str(path), "suite", str(key), Suite)
        kwargs[key] = _coerce(value, hints[key], f"suite.{key}", str(path))
    try:
        return Suite(datasets=built, **kwargs)
    except TransferError as e:
        raise TransferError(f"{path}: {e}") from None


def cell_overrides(budget: str, seed: int) -> list[str]:
    """A cell's label draw and training seed; the split seed stays fixed, so every cell sees the same test rows."""
    labels = "null" if budget == "all" else str(int(budget))
    return [f"data.max_train_labels={labels}", f"data.label_seed={seed}", f"classifier.seed={seed}"]


def cell_key(p: Params, data_digests: dict[str, str], general_lm: str) -> str:
    """What a cell's rows depend on besides code: its params, its data files' bytes and the general LM used."""
    blob = json.dumps([p.to_dict(), data_digests, general_lm], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _budget_order(b: str) -> tuple[bool, int]:
    return (b == "all", int(b) if b != "all" else 0)


def summarise(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], tuple[float, float, float, int]]:
    """(dataset, budget, variant) -> (mean, min, max, n seeds) of the error."""
    groups: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], str(r["budget"]), r["variant"]), []).append(float(r["error"]))
    return {k: (sum(v) / len(v), min(v), max(v), len(v)) for k, v in groups.items()}


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Mean test error % [min, max] per dataset and budget (rows) and variant (columns); the best ULMFiT mean in bold."""
    stats = summarise(rows)
    variants = sorted({k[2] for k in stats}, key=lambda v: (v.startswith("ulmfit"), v))
    cells = sorted({(k[0], k[1]) for k in stats}, key=lambda c: (c[0], _budget_order(c[1])))
    out = ["| dataset | labels | seeds | " + " | ".join(f"`{v}`" for v in variants) + " |",
           "|---|---|---|" + "---|" * len(variants)]
    for dataset, budget in cells:
        here = {v: stats[dataset, budget, v] for v in variants if (dataset, budget, v) in stats}
        ulmfit = [v for v in ("ulmfit_fwd", "ulmfit_bwd", "ulmfit_ensemble") if v in here]
        best = min(ulmfit, key=lambda v: here[v][0]) if ulmfit else None
        n = max(s[3] for s in here.values())
        row = []
        for v in variants:
            if v not in here:
                row.append("")
                continue
            mean, lo, hi, _ = here[v]
            text = f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]" if n > 1 else f"{100 * mean:.1f}"
            row.append(f"**{text}**" if v == best else text)
        out.append(f"| {dataset} | {budget} | {n} | " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"
