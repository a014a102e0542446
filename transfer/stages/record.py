"""A stage as a record: the params it reads, the files it reads and writes, and the code it runs.

DVC (`transfer dvc-yaml` writes dvc.yaml from the records), Prefect's cache key (tasks/pipeline.py), a stage's
MLflow run and a training checkpoint's fingerprint all read the same record, so the contract is written once,
beside the stage's body, in the spirit of DVC's example-get-started (the script is the stage, dvc.yaml its
contract).
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from transfer.config import Params

if TYPE_CHECKING:
    from transfer.stages.workspace import Workspace

__all__ = ["Stage", "module_closure", "fingerprint", "searched_folder", "REGISTRY_MODULE", "NOT_CODE"]

LIBRARY = Path(__file__).resolve().parents[1]  # transfer/
REGISTRY_MODULE = "transfer.stages"  # its __init__ only collects the records: a stage does not run the others
# Modules a stage imports that cannot change what it computes: figures and progress lines are drawn from the
# numbers, params are hashed as values (the stage's `params`), and errors only word a failure. Editing them
# reruns no stage under either engine.
NOT_CODE = {"transfer.plots": "draws figures", "transfer.progress": "reports progress",
            "transfer.config": "hashed as the stage's params", "transfer.errors": "words failures",
            # the params sections, split out of transfer.config: hashed as values like the rest of it
            "transfer.config_sections": "hashed as the stage's params",
            "transfer.config_train": "hashed as the stage's params"}


@dataclass(frozen=True)
class Stage:
    """What `transfer stage NAME`, `dvc repro` and the Prefect flow agree a stage is."""

    name: str
    run: Callable[[Params, "Workspace"], dict]  # the body: reads deps, writes outs, returns its metrics
    summary: str  # one line: what it makes (dvc.yaml's comment, `transfer status`)
    params: Callable[[Params], dict[str, Any]]  # {section: {key: value}}: the params its outputs depend on
    deps: Callable[[Params, "Workspace"], list[Path]]  # files and folders it reads, besides params and code
    outs: Callable[[Params, "Workspace"], list[Path]]  # what it leaves, its metrics file last
    plots: tuple[str, ...] = ()  # plots/*.png it draws (logged to MLflow, uncached DVC outs)
    curves: tuple[str, ...] = ()  # plots/*.csv it writes (uncached DVC outs)
    history: str | None = None  # the curve with one row per epoch: MLflow step metrics
    record: Callable[["Workspace"], Path] | None = None  # the file holding what `run` returned; None: its metrics
    # trains one direction's model to a finished checkpoint and writes nothing the directions share, so two
    # workers can train the two directions at once; `run` then finds both done and only finishes the stage
    direction: Callable[[Params, "Workspace", str], list[Path]] | None = None

    def result(self, ws: "Workspace") -> Path:
        return self.record(ws) if self.record else ws.metrics(self.name)

    @property
    def module(self) -> str:
        return self.run.__module__

    def code(self) -> dict[str, Path]:
        """Module -> source file of every module of `transfer` the body can run (its import closure)."""
        found = module_closure(LIBRARY, self.module, skip={REGISTRY_MODULE})
        return {m: p for m, p in found.items() if m not in NOT_CODE}

    def code_digest(self) -> str:
        h = hashlib.sha256()
        for module, path in self.code().items():
            h.update(f"{module}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
        return h.hexdigest()


def searched_folder(path: Path) -> Path:
    """A dependency as a path that exists: a glob pattern becomes the folder before its first wildcard (DVC has
    no glob deps, and a cache key must see the files the pattern finds)."""
    parts = path.parts
    wild = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), None)
    return path if wild is None else Path(*parts[:wild])


def fingerprint(*parts: object) -> str:
    """Identity of a training run's inputs: a checkpoint from other inputs (or other code) is never resumed."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def module_closure(package_dir: str | Path, entry: str, skip: set[str] = frozenset()) -> dict[str, Path]:
    """Module name -> source file of `entry` and of every module of its package that it imports, transitively.

    Read from the source (import statements anywhere, functions included), not from what happens to be
    imported, so a stage's code covers what the stage can run and no more: editing a module only the CLI or
    `transfer status` imports reruns nothing. Packages' `__init__.py` files count, as Python runs them, except
    those in `skip` (a registry that only collects modules).
    """
    root = Path(package_dir)
    package = root.name

    def source(name: str) -> Path | None:
        base = root.joinpath(*name.split(".")[1:])
        return next((c for c in (base / "__init__.py", base.with_suffix(".py")) if c.is_file()), None)

    found: dict[str, Path] = {}
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in found or name in skip or name.split(".")[0] != package or (path := source(name)) is None:
            continue  # seen, skipped, another package's, or an attribute (`from transfer.x import function`)
        found[name] = path
        todo += [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]  # parent packages
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]  # the package of `name`
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                todo += [base] + [f"{base}.{a.name}" for a in node.names]
    return dict(sorted(found.items()))
