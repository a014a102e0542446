"""Load and robustness test of the served classifier (`mlflow models serve`, 127.0.0.1 only).

Starts `mlflow models serve -m URI --env-manager local -h 127.0.0.1` itself (stopped by PID in `finally`)
unless --url names a running one (it must be a 127.0.0.1/localhost URL). The model is --model-uri (default
models:/transfer-classifier@champion; tracking store from $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in
the current directory) or, with --workspace, the champion of a tiny pipeline run first in a temp dir.

  load       --requests (default 10,000) POSTs of one short text each, --concurrency (default 16) in flight
             (httpx.AsyncClient); throughput, p50/p99/max latency, errors (target 0). An error is a non-200, a
             transport failure, or a 200 whose label/probability differs from the answer the same text got
             sequentially before the phase. The phase also stops after --max-seconds; then the full-size
             duration is projected from the measured rate.
  malformed  missing `text` column, non-string values, empty lists, a 1 MB text, invalid JSON, a non-JSON
             content type: status code and the first 100 characters of each response (2xx or 4xx is fine,
             5xx or a dropped connection is not)
  after      the server must still answer a good request with the same label and probability as before

Exit status: 0 all good; 1 a good request failed or the server died; 3 a malformed payload got a 5xx or
dropped the connection (the server survived).

    python bench/load_test.py --workspace                       # self-contained
    python bench/load_test.py --url http://127.0.0.1:5001 --requests 2000 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from inference import add_model_args, demo_texts, load_line, mlflow_server, model_source, percentiles_ms, split_payload  # noqa: E402

GOOD_TEXT = "The striker scored twice as the home team won the cup final."


async def load_phase(url: str, texts: list[str], expected: list[dict], n: int, concurrency: int, timeout: float,
                     max_seconds: float) -> tuple[list[float], Counter, float, int]:
    """-> (latencies of correct responses, error kinds, wall seconds, requests sent).

    A 200 whose label or probability differs from the sequential answer for the same text is an error too.
    """
    import httpx

    latencies: list[float] = []
    errors: Counter = Counter()
    bodies = [json.dumps(split_payload([t])).encode() for t in texts]
    counter = iter(range(n))
    deadline = time.perf_counter() + max_seconds
    sent = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal sent
        for i in counter:
            if time.perf_counter() > deadline:
                return
            sent += 1
            t0 = time.perf_counter()
            try:
                r = await client.post("/invocations", content=bodies[i % len(bodies)],
                                      headers={"Content-Type": "application/json"})
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    errors[f"HTTP {r.status_code}"] += 1
                    continue
                got, want = r.json()["predictions"][0], expected[i % len(expected)]
                if got["label"] != want["label"] or abs(got["probability"] - want["probability"]) > 1e-4:
                    errors["200 with a wrong answer"] += 1
                else:
                    latencies.append(dt)
            except (httpx.HTTPError, ValueError, IndexError, KeyError, TypeError) as e:
                errors[type(e).__name__] += 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return latencies, errors, time.perf_counter() - t0, sent


def malformed_payloads() -> list[tuple[str, bytes, str]]:
    """(name, body, content type) for each bad request."""
    def j(obj: object) -> bytes:
        return json.dumps(obj).encode()

    big = ("word " * 210_000)[:1_000_000]  # 1,000,000 characters
    return [
        ("missing text column", j({"dataframe_split": {"columns": ["body"], "data": [["hello there"]]}}), "application/json"),
        ("non-string: ints", j({"dataframe_split": {"columns": ["text"], "data": [[1], [2]]}}), "application/json"),
        ("non-string: null", j({"dataframe_split": {"columns": ["text"], "data": [[None]]}}), "application/json"),
        ("non-string: object", j({"dataframe_records": [{"text": {"a": 1}}]}), "application/json"),
        ("empty list (dataframe_split)", j({"dataframe_split": {"columns": ["text"], "data": []}}), "application/json"),
        ("empty list (inputs)", j({"inputs": []}), "application/json"),
        ("1 MB text", j(split_payload([big])), "application/json"),
        ("invalid JSON", b'{"dataframe_split": {"columns": ["text"], "data": [["unterminated', "application/json"),
        ("not JSON (text/plain)", b"just some text", "text/plain"),
    ]


def good_prediction(client, text: str = GOOD_TEXT) -> tuple[int, dict | None]:
    """-> (status, first prediction row or None)."""
    import httpx

    try:
        r = client.post("/invocations", json=split_payload([text]))
        return r.status_code, (r.json()["predictions"][0] if r.status_code == 200 else None)
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return -1, None


@contextlib.contextmanager
def target(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], bool]]]:
    """-> (base URL, alive()): the --url server, or one started here for the model."""
    import httpx

    if args.url:
        parts = urlparse(args.url)
        if parts.hostname not in ("127.0.0.1", "localhost"):
            sys.exit(f"--url must point at 127.0.0.1 (got host {parts.hostname!r}): load only goes to the loopback")
        scheme = parts.scheme or "http"
        url = f"{scheme}://127.0.0.1:{parts.port or (443 if scheme == 'https' else 80)}"  # not ::1

        def alive() -> bool:
            try:
                return httpx.get(url + "/ping", timeout=10).status_code == 200
            except httpx.HTTPError:
                return False

        yield url, alive
        return
    with model_source(args) as (uri, tracking):
        print(f"serving {uri} (tracking {tracking}) with {args.workers} worker(s) ...", flush=True)
        with mlflow_server(uri, tracking, args.port, workers=args.workers,
                           startup_timeout=args.startup_timeout) as server:
            print(f"server up at {server.url} in {server.startup_s:.1f}s (pid {server.proc.pid})", flush=True)
            yield server.url, server.alive
            if not server.alive():
                print("server log tail:\n" + server.log_tail(), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--url", help="use this running server (127.0.0.1 only) instead of starting one")
    ap.add_argument("--requests", type=int, default=10_000, help="good requests in the load phase (default 10000)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    ap.add_argument("--max-seconds", type=float, default=300, help="stop the load phase after this long and "
                    "project the full run (default 300)")
    ap.add_argument("--request-timeout", type=float, default=60, help="seconds per request (default 60)")
    ap.add_argument("--malformed-timeout", type=float, default=300, help="seconds per malformed request "
                    "(the 1 MB text is slow: default 300)")
    ap.add_argument("--workers", type=int, default=1, help="uvicorn workers of a server started here (default 1)")
    ap.add_argument("--port", type=int, default=0, help="port of a server started here (default: a free one)")
    args = ap.parse_args()
    import httpx

    texts = [t for t in demo_texts(400) if len(t) < 200][:64] or [GOOD_TEXT]
    failed_good, server_died, bad_5xx = False, False, False
    print(f"start: {load_line()}", flush=True)
    with target(args) as (url, alive):
        with httpx.Client(base_url=url, timeout=args.request_timeout) as client:
            status, before = good_prediction(client)
            if before is None:
                print(f"a good request failed before the load phase (status {status})")
                return 1
            for t in texts[:20]:  # warm-up: a fresh server answers its first ~10 requests slowly
                client.post("/invocations", json=split_payload([t]))
            expected = []  # the sequential answer for every load text: concurrent answers must equal it
            for t in texts:
                status, row = good_prediction(client, t)
                if row is None:
                    print(f"a good request failed before the load phase (status {status})")
                    return 1
                expected.append(row)

        print(f"load: {args.requests:,} requests, concurrency {args.concurrency}, "
              f"mean text {sum(map(len, texts)) / len(texts):.0f} chars ...", flush=True)
        lat, errors, wall, sent = asyncio.run(load_phase(url, texts, expected, args.requests, args.concurrency,
                                                         args.request_timeout, args.max_seconds))
        n_err = sum(errors.values())
        rate = sent / wall
        p50, p99 = percentiles_ms(lat) if lat else (float("nan"), float("nan"))
        print(f"\n== load ({load_line()} at the end)")
        print(f"requests sent    {sent:,} of {args.requests:,} in {wall:.1f} s"
              + ("" if sent == args.requests else f"  (stopped by --max-seconds {args.max_seconds:.0f})"))
        print(f"throughput       {rate:,.1f} req/s (all responses); {len(lat) / wall:,.1f} correct answers/s")
        print(f"latency          (correct answers) p50 {p50:.1f} ms  p99 {p99:.1f} ms  max {1000 * max(lat, default=float('nan')):.1f} ms")
        print(f"errors           {n_err}" + (f"  {dict(errors)}" if errors else "") + "  (target 0)")
        if sent < args.requests:
            print(f"projected        {args.requests:,} requests at {rate:,.1f} req/s = {args.requests / rate:,.0f} s")
        failed_good |= n_err > 0

        print("\n== malformed payloads")
        with httpx.Client(base_url=url, timeout=args.malformed_timeout) as client:
            for name, body, ctype in malformed_payloads():
                t0 = time.perf_counter()
                try:
                    r = client.post("/invocations", content=body, headers={"Content-Type": ctype})
                    code, text = r.status_code, r.text
                except httpx.HTTPError as e:
                    code, text = -1, f"{type(e).__name__}: {e}"
                dt = time.perf_counter() - t0
                verdict = "ok" if 200 <= code < 500 else "FAIL"
                bad_5xx |= verdict == "FAIL"
                up = alive()
                print(f"{name:<29} {code:>4} {verdict:<4} {dt * 1000:7.0f} ms  server {'up' if up else 'DOWN'}  "
                      f"{text[:100]!r}")
                if not up:
                    server_died = True
                    break

            print("\n== after")
            status, after = good_prediction(client) if not server_died else (-1, None)
            same = (after is not None and after["label"] == before["label"]
                    and abs(after["probability"] - before["probability"]) < 1e-5)
            print(f"good request     status {status}, label {after and after['label']!r} "
                  f"p={after and round(after['probability'], 4)} (before: {before['label']!r} "
                  f"p={round(before['probability'], 4)}) -> {'same' if same else 'DIFFERENT/FAILED'}")
            failed_good |= not same
        server_died |= not alive()
        print(f"server alive     {not server_died}")
    print(f"end: {load_line()}")
    if failed_good or server_died:
        print("RESULT: FAIL (a good request failed or the server died)")
        return 1
    if bad_5xx:
        print("RESULT: FAIL (a malformed payload got a 5xx or dropped the connection)")
        return 3
    print("RESULT: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
