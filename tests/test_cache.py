"""The content cache: real Prefect flows against a temporary server; a counter file records task-body runs."""

import atexit
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

if "prefect" not in sys.modules:  # Prefect reads its home on import: keep test state out of ~/.prefect
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="transfer-tests-prefect-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"

import pytest  # noqa: E402
from prefect import flow, task  # noqa: E402
from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

from tasks.cache import (  # noqa: E402
    cache_dir,
    content_cache_policy,
    content_digest,
    module_closure,
    outputs_intact,
    record_outputs,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prefect_api_url():
    """One temporary Prefect server (start-up takes seconds) with its own database; yields its API URL."""
    with prefect_test_harness(), temporary_settings(updates={"flows.heartbeat_frequency": None}):
        yield PREFECT_API_URL.value()  # no heartbeat thread: joining it costs ~1 s per flow run


@dataclasses.dataclass(frozen=True)
class ShoutParams:
    repeat: int = 1
    sep: str = " "


@task(cache_policy=content_cache_policy(exclude=["calls"]), persist_result=True)
def shout(src: Path, params: ShoutParams, options: dict, out: Path, calls: Path) -> dict:
    with calls.open("a") as f:
        f.write("ran\n")
    out.write_text(params.sep.join([src.read_text().upper()] * params.repeat))
    return record_outputs([out], n_chars=len(out.read_text()))


@flow
def shout_flow(src: Path, params: ShoutParams, options: dict, out: Path, calls: Path) -> tuple[str, dict]:
    state = shout(src, params, options, out, calls, return_state=True)
    return state.name, state.result()


@pytest.fixture
def ws(tmp_path, prefect_api_url):
    """A workspace whose task results persist under ws/cache."""
    (tmp_path / "in.txt").write_text("hello world")
    with cache_dir(tmp_path / "cache"):
        yield tmp_path


def run(ws: Path, src: Path | None = None, params=ShoutParams(), options=None) -> str:
    """Run the flow once; returns the task run's state name."""
    state, _ = shout_flow(src or ws / "in.txt", params, options or {"a": 1, "b": [1, 2]}, ws / "out.txt", ws / "calls")
    return state


def calls(ws: Path) -> int:
    return len((ws / "calls").read_text().splitlines())


def test_same_content_at_another_path_is_a_cache_hit(ws):
    assert run(ws) == "Completed"
    shutil.copy(ws / "in.txt", ws / "copy.txt")
    assert run(ws, src=ws / "copy.txt") == "Cached"
    assert calls(ws) == 1


def test_changed_input_content_is_a_miss(ws):
    assert run(ws) == "Completed"
    (ws / "in.txt").write_text("goodbye")
    assert run(ws) == "Completed"
    assert (ws / "out.txt").read_text() == "GOODBYE"
    assert calls(ws) == 2


def test_changed_params_are_a_miss_and_key_order_is_not(ws):
    assert run(ws, params=ShoutParams(repeat=1), options={"a": 1, "b": 2}) == "Completed"
    assert run(ws, params=ShoutParams(repeat=1), options={"b": 2, "a": 1}) == "Cached"
    assert run(ws, params=ShoutParams(repeat=2), options={"a": 1, "b": 2}) == "Completed"
    assert run(ws, params=ShoutParams(repeat=2), options={"a": 1, "b": 3}) == "Completed"
    assert calls(ws) == 3


def test_deleted_output_is_recomputed(ws):
    assert run(ws) == "Completed"
    (ws / "out.txt").unlink()
    assert run(ws) == "Completed"
    assert (ws / "out.txt").read_text() == "HELLO WORLD"
    assert calls(ws) == 2


def test_corrupted_output_is_recomputed_then_cached_again(ws):
    assert run(ws) == "Completed"
    (ws / "out.txt").write_text("HELLO W0RLD")  # same size, different bytes
    assert run(ws) == "Completed"
    assert (ws / "out.txt").read_text() == "HELLO WORLD"
    assert run(ws) == "Cached"
    assert calls(ws) == 2


FLOW_SCRIPT = """
    import sys
    from pathlib import Path

    from prefect import flow, task
    from prefect.settings import temporary_settings

    from tasks.cache import cache_dir, content_cache_policy, record_outputs

    ws = Path(sys.argv[1])

    @task(cache_policy=content_cache_policy(), persist_result=True)
    def count_words(src: Path, out: Path) -> dict:
        with open(ws / "calls", "a") as f:
            f.write("ran\\n")
        out.write_text(str(len(src.read_text().split())))
        return record_outputs([out])

    @flow
    def words(src: Path) -> str:
        return count_words(src, ws / "n_words.txt", return_state=True).name

    with cache_dir(ws / "cache"), temporary_settings(updates={"flows.heartbeat_frequency": None}):
        print("TASK_STATE", words(ws / "in.txt"))
"""


def test_a_second_process_reads_the_persisted_cache(ws, prefect_api_url):
    script = ws / "words_flow.py"
    script.write_text(textwrap.dedent(FLOW_SCRIPT))
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "PYTHONPATH": str(REPO)}

    def state() -> str:
        proc = subprocess.run([sys.executable, str(script), str(ws)], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split("TASK_STATE")[-1].strip()

    assert state() == "Completed"
    assert state() == "Cached"
    assert calls(ws) == 1
    assert any((ws / "cache").iterdir())


def test_directory_digest_follows_relative_paths_and_bytes_not_location(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "sub").mkdir(parents=True)
        (root / "sub" / "x.txt").write_text("x")
        (root / "y.txt").write_text("y")
    (b / ".y.txt.tmp-1").write_text("half-written")  # atomic-write leftovers are not content
    assert content_digest(a) == content_digest(b)
    (b / "sub" / "x.txt").rename(b / "sub" / "z.txt")
    assert content_digest(a) != content_digest(b)


def test_file_digest_is_sha256_and_sees_rewrites(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"abc")
    assert content_digest(f) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    f.write_bytes(b"abd")
    assert content_digest(f) != "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_outputs_intact_checks_every_recorded_file(tmp_path):
    (tmp_path / "m.pt").write_bytes(b"weights")
    result = record_outputs([tmp_path / "m.pt", tmp_path])
    assert outputs_intact(result)
    (tmp_path / "extra.txt").write_text("new file in a recorded folder")
    assert not outputs_intact(result)
    assert outputs_intact({"accuracy": 0.9})  # records no files: nothing to break


def _package(root: Path) -> Path:
    """A package whose entry module imports some of its modules (one lazily, one relatively) and not others."""
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "entry.py": "import os\nfrom pkg import helper\n\n\ndef run():\n"
                    "    from pkg.sub.deep import VALUE\n    return VALUE\n",
        "helper.py": "from .shared import CONSTANT\n",
        "shared.py": "CONSTANT = 1\n",
        "cli.py": "from pkg.entry import run\n",  # imports the entry; the entry does not import it
        "sub/__init__.py": "",
        "sub/deep.py": "from ..shared import CONSTANT as VALUE\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    return pkg


def test_module_closure_is_what_the_entry_imports_transitively(tmp_path):
    pkg = _package(tmp_path)
    closure = module_closure(pkg, "pkg.entry")
    assert list(closure) == ["pkg", "pkg.entry", "pkg.helper", "pkg.shared", "pkg.sub", "pkg.sub.deep"]
    assert closure["pkg.sub.deep"] == pkg / "sub" / "deep.py"
    assert closure["pkg.sub"] == pkg / "sub" / "__init__.py"


@task(cache_policy=content_cache_policy(exclude=["calls"]), persist_result=True)
def stage(code: dict[str, Path], calls: Path) -> int:
    with calls.open("a") as f:
        f.write("ran\n")
    return 1


@flow
def stage_flow(code: dict[str, Path], calls: Path) -> str:
    return stage(code, calls, return_state=True).name


def test_a_stage_reruns_for_code_it_imports_and_not_for_other_modules(ws):
    pkg = _package(ws)

    def go() -> str:
        return stage_flow(module_closure(pkg, "pkg.entry"), ws / "calls")

    assert go() == "Completed"
    (pkg / "cli.py").write_text("from pkg.entry import run\n\nprint(run())\n")
    assert go() == "Cached"
    (pkg / "shared.py").write_text("CONSTANT = 2\n")  # reached only through two imports
    assert go() == "Completed"
    assert calls(ws) == 2


def test_each_stage_keys_on_its_own_code_not_on_figures_or_other_stages(tmp_path, monkeypatch):
    """On a copy of the library: restyling figures changes no stage's code digest; the evaluation code changes
    only the stages that run it; the model changes every stage that trains one, and never the tokenizer's."""
    from transfer.stages import STAGES, record

    lib = tmp_path / "transfer"
    shutil.copytree(REPO / "transfer", lib, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(record, "LIBRARY", lib)
    digests = lambda: {n: s.code_digest() for n, s in STAGES.items()}  # noqa: E731

    def edited(module: str) -> set[str]:
        before = digests()
        with open(lib / module, "a") as f:
            f.write("\n# edited\n")
        return {n for n, d in digests().items() if d != before[n]}

    assert edited("plots.py") == set()
    assert edited("status.py") == set()  # the display module
    assert edited("evaluate.py") == {"train_classifier", "evaluate"}
    assert edited("model.py") == {"pretrain", "finetune_lm", "train_classifier", "evaluate"}
    assert edited("hygiene.py") == {"prepare"}
    assert edited("stages/record.py") == set(STAGES)  # the fingerprint every stage uses
