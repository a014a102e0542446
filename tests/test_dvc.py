"""dvc.yaml against real DVC: a temp git repo with a tiny workspace, `dvc repro`, status, experiments,
metrics/plots, and push/pull through a local remote (an input corpus; the general LM).

One full `dvc repro` (module fixture) is shared by the pipeline tests; the others ask DVC what *would* run
(`dvc status`, `dvc repro --dry`) instead of retraining.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, make_workspace
from transfer.config import load_params
from transfer.stages import STAGES

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
DVC = [sys.executable, "-m", "dvc"]
PIPELINE = ["demo_data", *STAGES]  # dvc.yaml's stages, in order
# one direction and two variants: half the training of TINY, and the LM deps by folder get exercised
FAST = ["model.directions=[fwd]", 'evaluate.variants=["tfidf", "ulmfit_fwd"]']


def _env(tmp: Path) -> dict[str, str]:
    """The venv's bin first (so `transfer` resolves), no analytics/update checks, and DVC/git config isolated."""
    for d in ("dvc-global", "dvc-system", "dvc-site"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "DVC_NO_ANALYTICS": "1",
            "DVC_GLOBAL_CONFIG_DIR": str(tmp / "dvc-global"), "DVC_SYSTEM_CONFIG_DIR": str(tmp / "dvc-system"),
            "DVC_SITE_CACHE_DIR": str(tmp / "dvc-site"), "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_CONFIG_NOSYSTEM": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], cwd: Path, env: dict, ok: bool = True, timeout: float = 1200) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\nstderr:\n{r.stderr}\nstdout:\n{r.stdout[-3000:]}"
    return r


@dataclass
class Repo:
    root: Path
    env: dict

    def dvc(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
        return _run([*DVC, *args], self.root, self.env, ok)

    def git(self, *args: str) -> subprocess.CompletedProcess:
        return _run(["git", *args], self.root, self.env)

    def status(self) -> dict:
        return json.loads(self.dvc("status", "--json").stdout or "{}")


def _init_repo(root: Path, env: dict) -> Repo:
    repo = Repo(root, env)
    repo.git("init", "-q")
    repo.git("config", "user.email", "test@example.com")
    repo.git("config", "user.name", "test")
    repo.dvc("init", "-q")
    repo.dvc("config", "core.check_update", "false")
    return repo


def _ran(output: str) -> list[str]:
    """Stage names `dvc repro` ran (or, with --dry, would run), in order."""
    return re.findall(r"Running stage '([^']+)'", output)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> tuple[Repo, subprocess.CompletedProcess, float]:
    """A tiny workspace in a fresh git + DVC repo, after one full `dvc repro`."""
    if not (BIN / "transfer").exists():
        pytest.skip(f"the `transfer` console script is not installed in {BIN}")
    tmp = tmp_path_factory.mktemp("dvc")
    root = make_workspace(tmp / "ws", FAST)
    # the code deps must exist in the repo; PYTHONPATH makes `transfer stage` run this copy, not the editable install
    for pkg in ("transfer", "flows", "tasks"):
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    (root / ".gitignore").write_text("__pycache__/\n*.pyc\n/dvc_plots/\n/.transfer.lock\n", encoding="utf-8")
    env = {**_env(tmp), "PYTHONPATH": str(root)}
    repo = _init_repo(root, env)
    # make_workspace wrote a smaller demo set than `transfer data demo` would: record it as demo_data's output
    repo.dvc("commit", "-f", "-q", "demo_data")
    t0 = time.perf_counter()
    first = repo.dvc("repro")
    return repo, first, time.perf_counter() - t0


def test_repro_runs_every_stage_then_everything_is_up_to_date(pipeline):
    repo, first, seconds = pipeline
    print(f"full `dvc repro` on the tiny config: {seconds:.0f} s")
    assert _ran(first.stdout) == list(STAGES), first.stdout  # demo_data was committed above, so it is skipped
    ev = json.loads((repo.root / "metrics" / "evaluate.json").read_text())
    assert set(ev) == {"tfidf", "ulmfit_fwd"}  # flat: test accuracy per variant
    assert set(yaml.safe_load((repo.root / "dvc.lock").read_text())["stages"]) == set(PIPELINE)
    assert (repo.root / "artifacts" / "train_classifier" / "model" / "meta.json").exists()

    again = repo.dvc("repro")
    assert _ran(again.stdout) == [], again.stdout
    assert "up to date" in again.stdout.lower(), again.stdout
    assert repo.status() == {}


def test_classifier_param_reruns_only_classifier_and_evaluate(pipeline):
    repo, *_ = pipeline
    params = repo.root / "params.yaml"
    original = params.read_text(encoding="utf-8")
    raw = yaml.safe_load(original)
    raw["classifier"]["lr"] = raw["classifier"]["lr"] * 2
    params.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    try:
        assert set(repo.status()) == {"train_classifier", "evaluate"}
        dry = repo.dvc("repro", "--dry")
        assert _ran(dry.stdout) == ["train_classifier", "evaluate"], dry.stdout
    finally:
        params.write_text(original, encoding="utf-8")
    assert repo.status() == {}


@pytest.mark.parametrize("module, stages", [
    ("schedules.py", {"pretrain", "finetune_lm", "train_classifier", "evaluate"}),
    ("model.py", {"pretrain", "finetune_lm", "train_classifier", "evaluate"}),
    ("tokenizer.py", {"prepare", "tokenize", "pretrain", "finetune_lm", "train_classifier", "evaluate"}),
    ("evaluate.py", {"train_classifier", "evaluate"}),
    ("hygiene.py", {"prepare"}),
    ("demo.py", {"demo_data"}),  # downstream stages then rerun only if the regenerated data differ
    ("plots.py", set()),  # restyling a PNG retrains nothing
])
def test_code_change_reruns_the_stages_that_run_it(pipeline, module, stages):
    repo, *_ = pipeline
    path = repo.root / "transfer" / module
    original = path.read_bytes()
    path.write_bytes(original + b"\n# edited\n")
    try:
        assert set(repo.status()) == stages
    finally:
        path.write_bytes(original)


def test_metrics_and_plots_show(pipeline):
    repo, *_ = pipeline
    shown = repo.dvc("metrics", "show")
    assert "metrics/evaluate.json" in shown.stdout, shown.stdout
    (workspace,) = json.loads(repo.dvc("metrics", "show", "--json").stdout).values()  # keyed "" (the workspace)
    ev = workspace["data"]["metrics/evaluate.json"]["data"]
    assert 0 <= ev["ulmfit_fwd"] <= 1
    assert set(workspace["data"]) == {"metrics/evaluate.json"}  # the stage records are plain outs
    assert max(len(line) for line in shown.stdout.splitlines()) <= 120, shown.stdout

    # every top-level plot names columns its CSV really has
    for plot in yaml.safe_load((repo.root / "dvc.yaml").read_text())["plots"]:
        if isinstance(plot, str):
            assert (repo.root / plot).stat().st_size > 0, plot
            continue
        (title, spec), = plot.items()
        for csv_path, ys in spec["y"].items():
            header = (repo.root / csv_path).read_text().splitlines()[0].split(",")
            wanted = [spec["x"], *([ys] if isinstance(ys, str) else ys)]
            assert set(wanted) <= set(header), f"{title}: {wanted} not all in {csv_path} columns {header}"

    plots = json.loads(repo.dvc("plots", "show", "--json").stdout)["data"]
    kinds = {name: {p["type"] for p in v} for name, v in plots.items()}
    assert sorted(n for n, k in kinds.items() if k == {"image"}) == sorted(
        str(p.relative_to(repo.root)) for p in (repo.root / "plots").glob("*.png"))
    assert sum(k == {"vega"} for k in kinds.values()) == 5, kinds  # no stage-level duplicates
    repo.dvc("plots", "show")
    assert (repo.root / "dvc_plots" / "index.html").stat().st_size > 0


def test_exp_run_with_a_param_override(pipeline):
    """`dvc exp run -S` on a param only `evaluate` reads, so just that stage reruns (the cheap one)."""
    repo, *_ = pipeline
    repo.git("add", "-A")
    repo.git("commit", "-q", "-m", "baseline")  # experiments are commits on top of HEAD
    try:
        r = repo.dvc("exp", "run", "-n", "fwd-only", "-S", "evaluate.variants=[ulmfit_fwd]")
        assert _ran(r.stdout) == ["evaluate"], r.stdout
        exps = json.loads(repo.dvc("exp", "show", "--json").stdout)
        runs = [rev for row in exps for e in (row.get("experiments") or []) for rev in e["revs"]]
        exp = next(rev for rev in runs if rev["name"] == "fwd-only")
        assert exp["data"]["params"]["params.yaml"]["data"]["evaluate"]["variants"] == ["ulmfit_fwd"]
        assert set(exp["data"]["metrics"]["metrics/evaluate.json"]["data"]) == {"ulmfit_fwd"}
        assert json.loads((repo.root / "metrics" / "evaluate.json").read_text()).keys() == {"ulmfit_fwd"}
    finally:  # back to the baseline commit for any later test
        repo.git("checkout", "-q", "--", ".")
        repo.dvc("checkout", "-q")
    assert repo.status() == {}


def test_corpus_under_dvc_push_then_pull_restores_identical_bytes(tmp_path):
    (tmp_path / "repo").mkdir()
    repo = _init_repo(tmp_path / "repo", _env(tmp_path))
    corpus = repo.root / "data" / "corpus" / "general.txt"
    corpus.parent.mkdir(parents=True)
    data = "".join(f"Line {i}: the river near Ashford — café, naïve, 東京.\n" for i in range(2000)).encode()
    corpus.write_bytes(data)
    repo.dvc("add", "-q", "data/corpus/general.txt")
    assert (repo.root / "data" / "corpus" / "general.txt.dvc").exists()
    assert "/general.txt" in (repo.root / "data" / "corpus" / ".gitignore").read_text()
    repo.git("add", "-A")
    repo.git("commit", "-q", "-m", "corpus")

    repo.dvc("remote", "add", "-d", "local", str(tmp_path / "remote"))
    repo.dvc("push", "-q")
    assert json.loads(repo.dvc("status", "--cloud", "--json").stdout or "{}") == {}

    shutil.rmtree(repo.root / ".dvc" / "cache")
    corpus.unlink()
    repo.dvc("pull", "-q")
    assert corpus.read_bytes() == data
    assert repo.status() == {}


def test_dvc_yaml_is_generated_from_the_stage_records(monkeypatch):
    """`transfer dvc-yaml --check` passes on the repo, and fails with a readable diff once a record changes."""
    import dataclasses

    from transfer import dvc_yaml
    from transfer.stages import STAGES

    check = subprocess.run([str(BIN / "transfer"), "dvc-yaml", "--check"], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    p = load_params(REPO / "params.yaml")
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert list(spec) == PIPELINE and all(spec[s]["cmd"] == f"transfer stage {s}" for s in STAGES)
    for stage in STAGES:  # every code dep exists, and the figures module is none of them
        code = [d for d in spec[stage]["deps"] if d.startswith("transfer/")]
        assert code and all((REPO / d).is_file() for d in code) and "transfer/plots.py" not in code, stage

    renamed = dataclasses.replace(STAGES["tokenize"], params=lambda q: {"tokenizer": q.section("tokenizer")})
    monkeypatch.setitem(STAGES, "tokenize", renamed)
    delta = dvc_yaml.diff(REPO / "dvc.yaml", p)
    assert "-      - data.general\n" in delta and "(from the stage records)" in delta, delta


def _mtimes(root: Path) -> dict[str, int]:
    return {str(f.relative_to(root)): f.stat().st_mtime_ns for f in sorted((root / "artifacts").rglob("*"))
            if f.is_file()}


def test_a_general_lm_moves_to_another_machine_with_dvc_push_and_pull(pipeline, tmp_path):
    """DVC users' `transfer lm publish`: the workspace that pretrained pushes the tokenize and pretrain outputs;
    a machine without them (no outputs, an empty cache) pulls the same bytes, and DVC counts both stages done."""
    repo, *_ = pipeline
    moved = ["artifacts/tokenize/spm.model", "artifacts/pretrain/lm-fwd.pt"]  # metrics/*.json travel with git
    before = {f: (repo.root / f).read_bytes() for f in moved}
    cache, kept = repo.root / ".dvc" / "cache", tmp_path / "cache-kept"
    repo.dvc("remote", "add", "-f", "-d", "team", str(tmp_path / "remote"))
    repo.dvc("push", "-q", "tokenize", "pretrain")
    shutil.move(cache, kept)
    try:
        for stage in ("tokenize", "pretrain"):
            shutil.rmtree(repo.root / "artifacts" / stage)
        assert {"tokenize", "pretrain"} <= set(repo.status())
        repo.dvc("pull", "-q", "tokenize", "pretrain")
        assert {f: (repo.root / f).read_bytes() for f in moved} == before
        # this test's machine holds no cache for the other stages' outputs: ask about these two
        assert json.loads(repo.dvc("status", "--json", "tokenize", "pretrain").stdout or "{}") == {}
        assert _ran(repo.dvc("repro", "--dry", "--single-item", "pretrain").stdout) == []  # nothing to pretrain again
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.move(kept, cache)
        repo.dvc("remote", "remove", "team")


def _flow(repo: Repo, api: str) -> subprocess.CompletedProcess:
    env = {**repo.env, "PREFECT_HOME": str(repo.root.parent / "prefect-home"), "PREFECT_API_URL": api,
           "MLFLOW_TRACKING_URI": f"sqlite:///{repo.root.parent / 'mlflow.db'}"}
    return _run([str(BIN / "transfer"), "run", "--no-promote"], repo.root, env)


def test_one_state_for_both_engines(pipeline, prefect_api):
    """After `dvc repro`, `transfer run` trains nothing; a figures edit keeps both engines cached; a fix to the
    model retrains pretrain (new weights, not its old checkpoint) under `transfer run`, which records it for
    DVC. Runs last: it leaves the repo re-committed, with the model edit undone."""
    import torch

    repo, *_ = pipeline
    before = _mtimes(repo.root)
    _flow(repo, prefect_api)
    assert _mtimes(repo.root) == before  # every stage was up to date in dvc.lock: nothing rewritten
    assert repo.status() == {}

    plots, model = repo.root / "transfer" / "plots.py", repo.root / "transfer" / "model.py"
    originals = {f: f.read_bytes() for f in (plots, model)}
    try:
        plots.write_bytes(originals[plots] + b"\n# restyled\n")
        _flow(repo, prefect_api)
        assert _mtimes(repo.root) == before and repo.status() == {}

        ckpt = repo.root / "artifacts" / "pretrain" / "checkpoint-fwd.pt"
        old = torch.load(ckpt, weights_only=True)["fingerprint"]
        old_weights = torch.load(repo.root / "artifacts" / "pretrain" / "lm-fwd.pt", weights_only=True)
        fixed = originals[model].replace(b"uniform_(-0.1, 0.1)", b"uniform_(-0.05, 0.05)")  # the embedding init
        assert fixed != originals[model]
        model.write_bytes(fixed)
        assert {"pretrain", "finetune_lm", "train_classifier", "evaluate"} <= set(repo.status())
        _flow(repo, prefect_api)
        assert torch.load(ckpt, weights_only=True)["fingerprint"] != old  # retrained, not resumed as done
        new_weights = torch.load(repo.root / "artifacts" / "pretrain" / "lm-fwd.pt", weights_only=True)
        assert not torch.equal(new_weights["encoder.embed.weight"], old_weights["encoder.embed.weight"])
        after = _mtimes(repo.root)
        assert after["artifacts/pretrain/lm-fwd.pt"] != before["artifacts/pretrain/lm-fwd.pt"]
        assert after["artifacts/tokenize/spm.model"] == before["artifacts/tokenize/spm.model"]
        assert repo.status() == {}  # the flow committed what it built
    finally:
        for f, data in originals.items():
            f.write_bytes(data)
        repo.dvc("commit", "-f", "-q")
