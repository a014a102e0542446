"""The classifier LR finder: one sweep per unfreezing phase, from the real domain LM of a tiny workspace."""

from __future__ import annotations

import csv

import pytest
from typer.testing import CliRunner

from flows.cli import app
from transfer.config import load_params
from transfer.io_utils import file_digest
from transfer.stages import Workspace, run_stage


def _artifacts(ws) -> dict[str, str]:
    return {str(f.relative_to(ws)): file_digest(f) for d in ("artifacts", "metrics") for f in (ws / d).rglob("*")
            if f.is_file()}


def test_sweeps_before_every_phase_and_changes_no_stage_output(workspace):
    overrides = ["classifier.unfreeze_epochs=[1, 0, 2]", "model.directions=[fwd]",  # 3 phases, one of them empty
                 "evaluate.variants=[tfidf,ulmfit_fwd]"]
    p = load_params(workspace / "params.yaml", overrides)
    for stage in ("prepare", "tokenize", "pretrain", "finetune_lm"):
        run_stage(stage, p, Workspace(workspace))
    before = _artifacts(workspace)

    args = ["lr-find", "--num-it", "40", *[a for o in overrides for a in ("-S", o)]]
    result = CliRunner().invoke(app, args)

    assert result.exit_code == 0, result.output
    n_phases = len(p.classifier.unfreeze_epochs)
    with open(workspace / "plots" / "lr_find_fwd.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    curves = {k: [(float(r["lr"]), float(r["loss"])) for r in rows if int(r["phase"]) == k] for k in range(n_phases)}
    for k, curve in curves.items():
        lrs = [lr for lr, _ in curve]
        assert len(curve) >= 3, f"phase {k}: curve too short"
        assert lrs[0] == pytest.approx(1e-7) and all(b > a for a, b in zip(lrs, lrs[1:])), f"phase {k}"
    assert len({tuple(c) for c in curves.values()}) == n_phases, "each phase gets its own curve"
    assert (workspace / "plots" / "lr_find_fwd.png").stat().st_size > 0
    assert "suggested lr" in result.output and f"{p.classifier.lr:.2g}" in result.output
    assert _artifacts(workspace) == before, "the finder is advisory: no stage output may change"
    assert not (workspace / "artifacts" / "train_classifier").exists()
