"""Bad input through the real `transfer` CLI: a clear one-paragraph error, a non-zero exit, and no files touched.

Every case copies one prepared workspace (tiny params, demo data, the prepare + tokenize outputs of a good run,
an initialised MLflow database and a few hand-made classifier bundles), changes one thing, runs one CLI
subprocess in it and checks: exit code != 0; stderr names the file / row / key and the problem, without a
traceback; every file in the workspace (artifacts/, metrics/, plots/, .prefect-results/, mlflow.db, data and
params included) has the same bytes afterwards and no file (temp files included) appeared or vanished.

CLI starts cost seconds, so the subprocesses of all selected cases run concurrently, once per session.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.conftest import make_bundle, make_workspace

TRANSFER = str(Path(sys.executable).with_name("transfer"))
TRAIN, TEST, GENERAL = Path("data/demo/train.csv"), Path("data/demo/test.csv"), Path("data/demo/general.txt")
WORKERS = 6  # concurrent CLI processes (each mostly imports torch); more than the cores keeps our share on a busy box
TIMEOUT = 240  # seconds per CLI process


# --------------------------------------------------------------------------- cases


@dataclass
class Case:
    id: str
    args: list[str]  # after `transfer`
    mutate: Callable[[Path], None] = lambda ws: None
    expect: list[str] = field(default_factory=list)  # substrings of stderr (case-sensitive)
    check: Callable[["Result"], None] | None = None  # further assertions


@dataclass
class Result:
    ws: Path
    rc: int
    stdout: str
    stderr: str
    before: dict[str, str]
    after: dict[str, str]
    seconds: float


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def _write_rows(path: Path, rows: list[list[str]], **fmt) -> None:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n", **fmt).writerows(rows)
    path.write_bytes(buf.getvalue().encode("utf-8"))


def edit_table(rel: Path, fn: Callable[[list[list[str]]], list[list[str]] | None], **fmt) -> Callable[[Path], None]:
    """Mutation: rows (header first) of a CSV -> changed rows, written back."""

    def mutate(ws: Path) -> None:
        rows = _rows(ws / rel)
        out = fn(rows)
        _write_rows(ws / rel, rows if out is None else out, **fmt)

    return mutate


def set_cell(row: int, col: int, value: str) -> Callable[[list[list[str]]], None]:
    def fn(rows: list[list[str]]) -> None:
        rows[row][col] = value

    return fn


def edit_params(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(ws: Path) -> None:
        import yaml

        raw = yaml.safe_load((ws / "params.yaml").read_text())
        fn(raw)
        (ws / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))

    return mutate


def write_bytes(rel: str | Path, data: bytes) -> Callable[[Path], None]:
    return lambda ws: (ws / rel).write_bytes(data)


def replace_with_folder(rel: Path) -> Callable[[Path], None]:
    def mutate(ws: Path) -> None:
        (ws / rel).unlink()
        (ws / rel).mkdir()
        (ws / rel / "part-0.csv").write_text("text,label\nhello,world\n")

    return mutate


def bad_byte_in_line(rel: Path, line: int, byte: bytes = b"\xe9") -> Callable[[Path], None]:
    """Mutation: line `line` (1-based) gets a byte that is not valid UTF-8 (latin-1 'é')."""

    def mutate(ws: Path) -> None:
        lines = (ws / rel).read_bytes().split(b"\n")
        lines[line - 1] = lines[line - 1].replace(b"e", b"caf" + byte, 1)
        assert byte in lines[line - 1]
        (ws / rel).write_bytes(b"\n".join(lines))

    return mutate


def domain_file_with_bad_bytes(ws: Path) -> None:
    (ws / "data" / "domain.txt").write_bytes(b"a fine first line\nsecond line, caf\xe9\nthird\n")


def vocab_suggestion_works(r: Result) -> None:
    """The suggested vocab_size really trains on this corpus."""
    from transfer.readers import iter_text_documents
    from transfer.tokenizer import train_tokenizer

    works = int(re.search(r"vocab_size <= (\d+)", r.stderr).group(1))
    assert 200 <= works < 5000
    tok = train_tokenizer(iter_text_documents([r.ws / GENERAL]), r.ws.parent / "suggested.model", works,
                          character_coverage=1.0)
    assert tok.vocab_size == works


def bundle(name: str) -> list[str]:
    return ["predict", "--model", f"bundles/{name}", "a tree saw the harbour again"]


def _merge_rows_with_a_quote(rel: Path, row: int) -> Callable[[Path], None]:
    """Data row `row` opens a quote that only the next row's text closes: the two rows read as one (valid CSV)."""

    def mutate(ws: Path) -> None:
        lines = (ws / rel).read_text().split("\n")
        text, label = lines[row].rsplit(",", 1)
        nxt_text, nxt_label = lines[row + 1].rsplit(",", 1)
        assert '"' not in lines[row] + lines[row + 1]
        lines[row], lines[row + 1] = f'"{text},{label}', f'{nxt_text}",{nxt_label}'
        (ws / rel).write_text("\n".join(lines))

    return mutate


def _parquet_with_numbers(ws: Path) -> None:
    import pandas as pd

    pd.DataFrame({"text": list(range(40)), "label": ["a", "b"] * 20}).to_parquet(ws / "data/demo/train.parquet")


CASES = [
    # ---- the labelled table (transfer stage prepare)
    Case("empty_file", ["stage", "prepare"], write_bytes(TRAIN, b""), [f"{TRAIN}: file is empty"]),
    Case("missing_file", ["stage", "prepare", "-S", "data.train=data/mine.csv"], expect=["data/mine.csv: file not found"]),
    Case("folder_not_file", ["stage", "prepare"], replace_with_folder(TRAIN), [f"{TRAIN}: is a folder", ".csv"]),
    Case("missing_text_column", ["stage", "prepare"], edit_table(TRAIN, set_cell(0, 0, "body")),
         [f"{TRAIN}: text column 'text' not found", "available columns: 'body', 'label'"]),
    Case("misnamed_label_column", ["stage", "prepare"], edit_table(TRAIN, set_cell(0, 1, "labels")),
         [f"{TRAIN}: label column 'label' not found", "'labels'"]),
    Case("empty_text_quoted", ["stage", "prepare"], edit_table(TRAIN, set_cell(3, 0, ""), quoting=csv.QUOTE_ALL),
         [f"{TRAIN}, data row 3: text is empty or missing (column 'text')"]),
    Case("whitespace_only_text", ["stage", "prepare"], edit_table(TRAIN, set_cell(3, 0, "  \t  ")),
         [f"{TRAIN}, data row 3: text is empty"]),
    Case("nan_text_empty_cell", ["stage", "prepare"], edit_table(TRAIN, set_cell(5, 0, "")),
         [f"{TRAIN}, data row 5: text is empty or missing"]),
    Case("empty_label", ["stage", "prepare"], edit_table(TRAIN, set_cell(4, 1, "")),
         [f"{TRAIN}, data row 4: label is empty or missing (column 'label')"]),
    Case("label_only_in_test", ["stage", "prepare"], edit_table(TEST, set_cell(2, 1, "weather")),
         [f"{TEST}: label 'weather' occurs in the test rows but never in training"]),
    Case("single_class", ["stage", "prepare"], edit_table(TRAIN, lambda rows: [rows[0]] + [[t, "world"] for t, _ in rows[1:]]),
         [f"{TRAIN}: only one class ('world')", "at least two"]),
    Case("class_with_one_example", ["stage", "prepare"], edit_table(TRAIN, set_cell(7, 1, "rare")),
         [f"{TRAIN}: class 'rare' has 1 row", "at least 2 rows per class"]),
    Case("non_utf8_bytes", ["stage", "prepare"], bad_byte_in_line(TRAIN, 6),
         [f"{TRAIN}, line 6: bytes are not valid utf-8", "0xe9", "data.encoding: latin-1"]),
    Case("semicolon_delimiter", ["stage", "prepare"], edit_table(TRAIN, lambda rows: None, delimiter=";"),
         [f"{TRAIN}", "delimiter"]),
    Case("duplicate_header", ["stage", "prepare"], edit_table(TRAIN, lambda rows: [r + [r[0]] for r in rows]),
         [f"{TRAIN}: duplicate column name 'text'"]),
    Case("max_train_labels_too_large", ["stage", "prepare", "-S", "data.max_train_labels=5000"],
         expect=["data.max_train_labels is 5000", f"{TRAIN} has only 216 training rows"]),
    # the labelled tables are fine (and would change: 100 labels); the domain text fails while being read
    Case("domain_text_non_utf8", ["stage", "prepare", "-S", "data.domain=[data/domain.txt]", "-S",
                                  "data.max_train_labels=100"], domain_file_with_bad_bytes,
         ["data/domain.txt, line 2: bytes are not valid utf-8"]),
    # ---- hygiene: rows merged by a quote, conflicting labels, numbers where text belongs (transfer/hygiene.py)
    Case("unterminated_quote_merges_rows", ["stage", "prepare"], _merge_rows_with_a_quote(TRAIN, 4),
         [f"{TRAIN}, data row 4: a quoted field runs over several lines", "closing quote missing"]),
    Case("conflicting_labels", ["stage", "prepare"], edit_table(TRAIN, lambda rows: rows + [[rows[1][0], "sports"
                                                                   if rows[1][1] != "sports" else "world"]]),
         [f"{TRAIN}: 1 text carries conflicting labels", "data row 1", "data.on_conflict"]),
    Case("on_conflict_unknown", ["stage", "prepare", "-S", "data.on_conflict=vote"],
         expect=["data.on_conflict must be one of ['error', 'drop', 'majority'], got 'vote'"]),
    Case("parquet_integer_text", ["stage", "prepare", "-S", "data.train=data/demo/train.parquet"],
         _parquet_with_numbers, ["data/demo/train.parquet, data row 1: text column 'text' holds the number 0"]),
    Case("jsonl_number_text", ["stage", "prepare", "-S", "data.train=data/demo/train.jsonl"],
         write_bytes("data/demo/train.jsonl", b'{"text": "fine words here", "label": "a"}\n{"text": 3.5, "label": "b"}\n'),
         ["data/demo/train.jsonl, line 2: text column 'text' holds the number 3.5"]),
    # ---- the general corpus (transfer stage tokenize)
    Case("vocab_too_large_for_corpus", ["stage", "tokenize", "-S", "tokenizer.vocab_size=5000"],
         expect=["tokenizer vocab_size=5000 is too large", "use vocab_size <= "], check=vocab_suggestion_works),
    Case("vocab_too_small", ["stage", "tokenize", "-S", "tokenizer.vocab_size=9"],
         expect=["tokenizer vocab_size=9 is too small", "pieces (one per character of the corpus"]),
    Case("general_corpus_blank", ["stage", "tokenize"], write_bytes(GENERAL, b"\n  \n\t\n\n"),
         [f"{GENERAL}: no text found"]),
    Case("general_corpus_non_utf8", ["stage", "tokenize"], bad_byte_in_line(GENERAL, 10, b"\xff"),
         [f"{GENERAL}, line 10: bytes are not valid utf-8", "0xff"]),
    # ---- params.yaml and -S overrides
    Case("params_unknown_key", ["stage", "prepare"], edit_params(lambda p: p["classifier"].update(lrr=0.1)),
         ["params.yaml: unknown key 'classifier.lrr' (did you mean 'lr'?)"]),
    Case("params_wrong_type", ["stage", "prepare"], edit_params(lambda p: p["classifier"].update(bs="lots")),
         ["params.yaml: classifier.bs must be an integer, got 'lots'"]),
    Case("params_negative_lr", ["stage", "prepare", "-S", "classifier.lr=-0.01"],
         expect=["override 'classifier.lr=-0.01': classifier.lr must be > 0, got -0.01"]),
    Case("params_zero_lr", ["stage", "prepare"], edit_params(lambda p: p["pretrain"].update(lr=0)),
         ["params.yaml: pretrain.lr must be > 0, got 0"]),
    Case("params_drop_mult_1_5", ["stage", "prepare", "-S", "classifier.drop_mult=1.5"],
         expect=["classifier.drop_mult must be in [0, 1], got 1.5"]),
    Case("params_drop_mult_negative", ["stage", "prepare"], edit_params(lambda p: p["finetune_lm"].update(drop_mult=-0.1)),
         ["params.yaml: finetune_lm.drop_mult must be in [0, 1], got -0.1"]),
    Case("params_max_train_labels_zero", ["stage", "prepare", "-S", "data.max_train_labels=0"],
         expect=["data.max_train_labels must be >= 1, got 0"]),
    Case("override_without_equals", ["stage", "prepare", "-S", "classifier.lr"],
         expect=["override 'classifier.lr': expected section.key=value"]),
    Case("override_unknown_section", ["stage", "prepare", "-S", "classifer.lr=0.1"],
         expect=["override 'classifer.lr=0.1': unknown section 'classifer' (did you mean 'classifier'?)"]),
    Case("params_unknown_section", ["stage", "prepare"], edit_params(lambda p: p.update(optimiser={"lr": 0.1})),
         ["params.yaml: unknown section 'optimiser'"]),
    Case("params_not_yaml", ["stage", "prepare"], write_bytes("params.yaml", b"data:\n  train: [oops\n"),
         ["params.yaml, line", "not valid YAML"]),
    # the message is printed with rich: brackets in a value are text, not (broken) markup
    Case("params_value_looks_like_markup", ["stage", "prepare", "-S", "classifier.precision='[/bold]'"],
         expect=["classifier.precision must be one of ['auto', 'fp32', 'bf16'], got '[/bold]'"]),
    Case("params_file_missing", ["stage", "prepare", "--params", "nope.yaml"], expect=["nope.yaml: file not found"]),
    # ---- models: the registry and bundle folders (transfer predict / promote)
    Case("model_uri_not_registered", ["predict", "--model", "models:/nope@champion", "hi"],
         expect=["model 'models:/nope@champion' could not be loaded", "nope not found"]),
    Case("predict_without_tracking_db", ["predict", "hi"], lambda ws: (ws / "mlflow.db").unlink(),
         ["mlflow.db: no MLflow tracking database"]),
    Case("promote_unknown_version", ["promote", "99"], expect=["model 'transfer-classifier' has no version '99'"]),
    Case("bundle_vocab_mismatch", bundle("wrong_vocab"),
         expect=["bundles/wrong_vocab: spm.model has 200 pieces but the weights expect 300"]),
    Case("bundle_architecture_mismatch", bundle("ok"),
         lambda ws: _edit_meta(ws / "bundles/ok", lambda m: m["config"].update(hidden_size=48)),
         ["bundles/ok/fwd.pt: weights do not fit the architecture in meta.json"]),
    Case("bundle_checkpoint_garbage", bundle("ok"), write_bytes("bundles/ok/fwd.pt", os.urandom(4096)),
         ["bundles/ok/fwd.pt: not a readable checkpoint"]),
    Case("bundle_spm_garbage", bundle("ok"), write_bytes("bundles/ok/spm.model", b"\x00junk" * 100),
         ["bundles/ok/spm.model: not a valid sentencepiece model file"]),
    Case("bundle_meta_not_json", bundle("ok"), write_bytes("bundles/ok/meta.json", b"{classes: oops"),
         ["bundles/ok: not a loadable classifier bundle", "JSONDecodeError"]),
    # ---- the LR finder needs the stages up to the domain LM
    Case("lr_find_before_the_domain_lm", ["lr-find"],
         expect=["artifacts/finetune_lm/lm-fwd.pt: missing", "up to finetune_lm"]),
    Case("lr_find_unknown_direction", ["lr-find", "--direction", "sideways"],
         expect=["direction 'sideways' is not in model.directions"]),
]


def _edit_meta(folder: Path, fn: Callable[[dict], None]) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    fn(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


# ---- inputs that must work


def _bom(ws: Path) -> None:
    (ws / TRAIN).write_bytes(b"\xef\xbb\xbf" + (ws / TRAIN).read_bytes())


def _mixed_line_endings(ws: Path) -> None:
    lines = (ws / TRAIN).read_bytes().split(b"\n")
    (ws / TRAIN).write_bytes(b"".join(line + (b"\r\n", b"\n", b"\r")[i % 3] for i, line in enumerate(lines[:-1])))


BIG = 10_000_000


def _ten_mb_line(ws: Path) -> None:
    rows = _rows(ws / TRAIN)
    words = " ".join(t for t, _ in rows[1:])
    rows[9][0] = (words * (BIG // len(words) + 1))[:BIG].strip()
    _write_rows(ws / TRAIN, rows)


def _prepared(r: Result) -> None:
    """The stage ran (its summary is on stdout) and found the template's rows and classes."""
    prep = json.loads(r.stdout)
    assert prep["classes"] == ["business", "science", "sports", "world"]
    assert (prep["n_train"], prep["n_valid"], prep["n_test"]) == (216, 24, 80)
    assert json.loads((r.ws / "metrics/prepare.json").read_text())["n_train"] == 216


def _prepared_like_template(r: Result) -> None:
    """The same bytes as the clean run's outputs: no BOM, no \\r, no shifted row survives into artifacts/."""
    _prepared(r)
    assert not _changes(r), _changes(r)


def _ten_mb_prepared(r: Result) -> None:
    _prepared(r)
    domain = (r.ws / "artifacts/prepare/domain.txt").read_text().splitlines()
    assert max(map(len, domain)) >= BIG - 10
    assert {"artifacts/prepare/domain.txt", "artifacts/prepare/train.csv"} <= {c.split(":")[0] for c in _changes(r)}


def _bundle_predicts(r: Result) -> None:
    label, prob, text = r.stdout.strip().split("\t")
    assert label in {"business", "science", "sports", "world"} and 0 < float(prob) <= 1


POSITIVE = [
    Case("utf8_bom", ["stage", "prepare"], _bom, check=_prepared_like_template),
    Case("mixed_line_endings", ["stage", "prepare"], _mixed_line_endings, check=_prepared_like_template),
    Case("ten_mb_single_line", ["stage", "prepare"], _ten_mb_line, check=_ten_mb_prepared),
    Case("bundle_ok", bundle("ok"), check=_bundle_predicts),  # the hand-made bundles are sound but for the flaw
]

DEBUG = Case("debug_shows_traceback", ["--debug", "stage", "prepare"], edit_table(TRAIN, set_cell(3, 0, "   ")),
             [f"{TRAIN}, data row 3: text is empty", "Traceback (most recent call last)", "TransferError"])

# The same bad params, and a sample of bad tables, through the whole flow: `transfer run` must fail as cleanly as
# `transfer stage`. A bad table costs a Prefect server start (~30 s on a busy 2-core box), so the sample is small.
RUN_TABLES = {"empty_file", "missing_text_column", "non_utf8_bytes", "label_only_in_test", "class_with_one_example",
              "unterminated_quote_merges_rows", "conflicting_labels", "parquet_integer_text"}
RUN_CASES = [Case(f"run-{c.id}", ["run", *c.args[2:]], c.mutate, c.expect) for c in CASES
             if c.args[:2] == ["stage", "prepare"] and (c.id in RUN_TABLES or c.id.startswith(("params_", "override_",
                                                                                                  "on_conflict_")))]

ALL = {c.id: c for c in [*CASES, *POSITIVE, DEBUG, *RUN_CASES]}
assert len(ALL) == len(CASES) + len(POSITIVE) + 1 + len(RUN_CASES), "case ids must be unique"


# --------------------------------------------------------------------------- workspace and runner


LOCK_FILE = ".transfer.lock"  # `transfer stage` takes the workspace lock; the (empty) lock file stays by design


def snapshot(ws: Path) -> dict[str, str]:
    """sha256 of every file under the workspace (artifacts/, metrics/, plots/, .prefect-results/, mlflow.db ...)."""
    out = {}
    for f in sorted(ws.rglob("*")):
        if f.name == LOCK_FILE and f.parent == ws:
            continue
        if f.is_file() or f.is_symlink():
            out[str(f.relative_to(ws))] = hashlib.sha256(f.read_bytes()).hexdigest()
        elif f.is_dir() and not any(f.iterdir()):
            out[str(f.relative_to(ws)) + "/"] = "empty folder"
    return out


def _make_bundles(ws: Path) -> None:
    """bundles/ok (random weights, matching vocab) and bundles/wrong_vocab (weights for 300 pieces, spm has 200)."""
    make_bundle(ws / "bundles" / "ok", ws / GENERAL)
    make_bundle(ws / "bundles" / "wrong_vocab", ws / GENERAL, weights_vocab=300)


@pytest.fixture(scope="session")
def template(tmp_path_factory) -> Path:
    """A workspace after a good `prepare` + `tokenize`, with an initialised mlflow.db and bundles/."""
    from mlflow import MlflowClient

    from transfer.config import load_params
    from transfer.stages import Workspace, run_stage

    ws = make_workspace(tmp_path_factory.mktemp("bad-input") / "template")
    cwd = os.getcwd()
    os.chdir(ws)  # params name data files relative to the workspace
    try:
        p = load_params("params.yaml")
        run_stage("prepare", p, Workspace(ws))
        run_stage("tokenize", p, Workspace(ws))
    finally:
        os.chdir(cwd)
    MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}").search_experiments()  # creates the tables
    _make_bundles(ws)
    return ws


def _run(case: Case, ws: Path, api: str | None = None) -> Result:
    before = snapshot(ws)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{ws / 'mlflow.db'}", "OMP_NUM_THREADS": "1",
           "COLUMNS": "200", "PREFECT_HOME": str(ws.parent / f"{ws.name}.prefect")}
    if api:  # `transfer run` cases share one real Prefect server instead of starting a temporary one each
        env["PREFECT_API_URL"] = api
    t0 = time.perf_counter()
    p = subprocess.run([TRANSFER, *case.args], cwd=ws, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    return Result(ws, p.returncode, p.stdout, p.stderr, before, snapshot(ws), time.perf_counter() - t0)


@pytest.fixture(scope="session")
def results(request, template, tmp_path_factory) -> Iterator[dict[str, Result]]:
    """Run every selected case's CLI subprocess, concurrently; case id -> Result."""
    wanted = {item.callspec.id for item in request.session.items
              if item.module.__name__ == __name__ and hasattr(item, "callspec")}
    if any(item.module.__name__ == __name__ and item.name == "test_debug_prints_traceback"
           for item in request.session.items):
        wanted.add(DEBUG.id)
    flows = [cid for cid in wanted if cid.startswith("run-") and not cid.startswith(("run-params_", "run-override_"))]
    # the cases that reach a flow share the session's Prefect server; bad params fail before any server is needed
    api = request.getfixturevalue("prefect_api") if flows else None
    yield _run_all(wanted, template, tmp_path_factory, api)


def _run_all(wanted: set[str], template: Path, tmp_path_factory, api: str | None) -> dict[str, Result]:
    t_start = time.perf_counter()
    root = tmp_path_factory.mktemp("cases")
    jobs = []
    for cid in sorted(wanted & set(ALL)):
        ws = root / cid
        shutil.copytree(template, ws, symlinks=True)
        ALL[cid].mutate(ws)
        jobs.append((cid, ws))
    jobs.sort(key=lambda j: j[0].startswith(("params_", "override_")))  # slow ones first; params fail fast
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {cid: pool.submit(_run, ALL[cid], ws, api if cid.startswith("run-") else None) for cid, ws in jobs}
        out = {cid: f.result() for cid, f in futures.items()}
    if os.environ.get("BAD_INPUT_TIMES"):
        for cid, r in sorted(out.items(), key=lambda kv: -kv[1].seconds):
            print(f"{r.seconds:6.1f}s  {cid}", file=sys.stderr)
        print(f"all cases: {time.perf_counter() - t_start:.1f}s", file=sys.stderr)
    return out


def _report(r: Result) -> str:
    return f"rc={r.rc} ({r.seconds:.1f}s)\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-4000:]}"


def _changes(r: Result) -> list[str]:
    keys = sorted(set(r.before) | set(r.after))
    return [f"{k}: {'created' if k not in r.before else 'removed' if k not in r.after else 'changed'}"
            for k in keys if r.before.get(k) != r.after.get(k)]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_cleanly(case: Case, results: dict[str, Result]) -> None:
    r = results[case.id]
    assert r.rc != 0, _report(r)
    assert r.rc == 2, f"a TransferError exits 2\n{_report(r)}"
    err = r.stderr.strip()
    assert "Traceback" not in err, _report(r)
    assert err.startswith("error: "), _report(r)
    assert "\n" not in err, f"the message must be one paragraph, with nothing else on stderr\n{_report(r)}"
    for s in case.expect:
        assert s in err, f"{s!r} not in the message\n{_report(r)}"
    assert r.stdout.strip() == "", _report(r)
    assert not _changes(r), f"files changed: {_changes(r)}\n{_report(r)}"
    if case.check:
        case.check(r)


@pytest.mark.parametrize("case", POSITIVE, ids=[c.id for c in POSITIVE])
def test_quirky_but_valid_input_works(case: Case, results: dict[str, Result]) -> None:
    r = results[case.id]
    assert r.rc == 0, _report(r)
    assert "Traceback" not in r.stderr
    case.check(r)
    leftovers = [k for k in r.after if ".tmp-" in k]
    assert not leftovers, leftovers


OUTPUTS = ("artifacts/", "metrics/", "plots/", "data/", "params.yaml")


@pytest.mark.parametrize("case", RUN_CASES, ids=[c.id for c in RUN_CASES])
def test_bad_input_fails_cleanly_through_transfer_run(case: Case, results: dict[str, Result]) -> None:
    """Prefect may log its own lines, but the error is the same one line, with no traceback, no retry, no stage
    output and no registry version."""
    from mlflow import MlflowClient

    r = results[case.id]
    assert r.rc == 2, _report(r)
    assert "Traceback" not in r.stderr + r.stdout, _report(r)
    assert not any(s in r.stderr + r.stdout for s in ("Retrying", "AwaitingRetry")), _report(r)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, _report(r)
    for s in case.expect:
        assert s in errors[0], f"{s!r} not in the message\n{_report(r)}"
    changed = [c for c in _changes(r) if c.startswith(OUTPUTS)]
    assert not changed, f"stage outputs changed: {changed}\n{_report(r)}"
    client = MlflowClient(tracking_uri=f"sqlite:///{r.ws / 'mlflow.db'}")
    assert client.search_model_versions() == []
    for record in (r.ws / ".prefect-results").glob("*"):  # failure records are JSON, never pickles
        json.loads(record.read_text())


def test_debug_prints_traceback(results: dict[str, Result]) -> None:
    r = results[DEBUG.id]
    assert r.rc == 2, _report(r)
    for s in DEBUG.expect:
        assert s in r.stderr, f"{s!r} not in stderr\n{_report(r)}"
    assert r.stderr.rstrip().splitlines()[-1].startswith("error: "), _report(r)
    assert not _changes(r), _changes(r)
