"""`transfer serve` as a real process: every malformed request gets a 4xx naming the problem, and the server stays up.

The model is a hand-made bundle (random weights, real tokenizer): the HTTP contract does not depend on training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import CLASSES, make_bundle
from tests.processes import BIN, clean_env, free_port, start, stop, tail
from transfer.demo import make_demo

JSON = {"content-type": "application/json"}
LIMIT_KB = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    make_demo(root / "demo", n_general_docs=300, n_labelled=40)
    bundle = make_bundle(root / "bundle", root / "demo" / "general.txt")
    port, log = free_port(), root / "serve.log"
    proc = start([str(BIN / "transfer"), "serve", "--model", str(bundle), "--port", str(port),
                  "--max-body-kb", str(LIMIT_KB)], clean_env(root / "home"), root, log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"transfer serve exited with {proc.returncode}:\n{tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"transfer serve did not answer:\n{tail(log)}")
        time.sleep(0.5)
    yield url, proc, log
    stop(proc)


def _nested(depth: int) -> bytes:
    return b'{"inputs": ' + b"[" * depth + b"]" * depth + b"}"


# (id, method, path, headers, body) -> must be a 4xx
MALFORMED = [
    ("no_content_type", "POST", "/invocations", {}, b'{"inputs": ["a text"]}'),
    ("text_plain", "POST", "/invocations", {"content-type": "text/plain"}, b"a text"),
    ("csv", "POST", "/invocations", {"content-type": "text/csv"}, b"text\na text\n"),
    ("form", "POST", "/invocations", {"content-type": "application/x-www-form-urlencoded"}, b"text=a"),
    ("empty_body", "POST", "/invocations", JSON, b""),
    ("not_json", "POST", "/invocations", JSON, b"{inputs: nope"),
    ("truncated_json", "POST", "/invocations", JSON, b'{"inputs": ["a text"'),
    ("not_utf8", "POST", "/invocations", JSON, b'{"inputs": ["caf\xe9"]}'),
    ("deeply_nested", "POST", "/invocations", JSON, _nested(100_000 // 2)),
    ("nested_lists", "POST", "/invocations", JSON, _nested(3)),
    ("json_null", "POST", "/invocations", JSON, b"null"),
    ("json_string", "POST", "/invocations", JSON, b'"a text"'),
    ("json_list", "POST", "/invocations", JSON, b'["a text"]'),
    ("numbers", "POST", "/invocations", JSON, b'{"instances": [1, 2]}'),
    ("huge_integer", "POST", "/invocations", JSON, b'{"inputs": [' + b"9" * 5000 + b"]}"),
    ("null_text", "POST", "/invocations", JSON, b'{"inputs": [null]}'),
    ("bool_text", "POST", "/invocations", JSON, b'{"inputs": [true]}'),
    ("object_text", "POST", "/invocations", JSON, b'{"inputs": [{"a": 1}]}'),
    ("empty_batch", "POST", "/invocations", JSON, b'{"inputs": []}'),
    ("two_shapes", "POST", "/invocations", JSON, b'{"inputs": ["a"], "instances": ["b"]}'),
    ("unknown_field", "POST", "/invocations", JSON, b'{"inputs": ["a"], "extra": 1}'),
    ("no_shape", "POST", "/invocations", JSON, b'{"text": ["a"]}'),
    ("records_without_text", "POST", "/invocations", JSON, b'{"dataframe_records": [{"body": "a"}]}'),
    ("records_not_objects", "POST", "/invocations", JSON, b'{"dataframe_records": ["a"]}'),
    ("split_without_text", "POST", "/invocations", JSON, b'{"dataframe_split": {"columns": ["x"], "data": [["a"]]}}'),
    ("split_ragged", "POST", "/invocations", JSON, b'{"dataframe_split": {"columns": ["text"], "data": [["a", "b"]]}}'),
    ("split_number", "POST", "/invocations", JSON, b'{"dataframe_split": {"columns": ["text"], "data": [[5]]}}'),
    ("too_many_texts", "POST", "/invocations", JSON, json.dumps({"inputs": ["a"] * 1001}).encode()),
    ("body_over_limit", "POST", "/invocations", JSON, json.dumps({"inputs": ["x" * (LIMIT_KB * 1024)]}).encode()),
    ("get_invocations", "GET", "/invocations", {}, None),
    ("put_invocations", "PUT", "/invocations", JSON, b'{"inputs": ["a"]}'),
    ("unknown_path", "POST", "/predict", JSON, b'{"inputs": ["a"]}'),
]


@pytest.mark.parametrize("method,path,headers,body", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_requests_get_a_4xx_and_the_server_stays_up(server, method, path, headers, body):
    url, proc, log = server
    r = httpx.request(method, url + path, headers=headers, content=body, timeout=60)
    assert 400 <= r.status_code < 500, f"{r.status_code}: {r.text[:300]}\n{tail(log)}"
    if path == "/invocations" and method == "POST":
        assert r.json()["error"], r.text  # says what is wrong
    assert proc.poll() is None and httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_well_formed_requests_in_every_shape_get_predictions(server):
    url, _, _ = server
    texts = ["The striker scored twice.", "Shares fell after the forecast."]
    bodies = [{"inputs": texts}, {"instances": texts}, {"instances": [{"text": t} for t in texts]},
              {"dataframe_records": [{"text": t} for t in texts]},
              {"dataframe_split": {"columns": ["id", "text"], "data": [[i, t] for i, t in enumerate(texts)]}}]
    answers = []
    for body in bodies:
        r = httpx.post(f"{url}/invocations", json=body, timeout=60)
        assert r.status_code == 200, r.text
        preds = r.json()["predictions"]
        assert len(preds) == 2 and all(p["label"] in CLASSES for p in preds)
        assert all(abs(sum(p[f"prob_{c}"] for c in CLASSES) - 1) < 1e-4 for p in preds)
        answers.append(preds)
    assert all(a == answers[0] for a in answers)  # the shape does not change the answer
    assert httpx.get(f"{url}/version", timeout=10).json()["classes"] == CLASSES
