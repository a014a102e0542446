"""`transfer serve`: a classifier behind a small HTTP API that checks every request before the model sees it.

POST /invocations takes JSON in MLflow's request shapes, with text where the model expects text:
`{"inputs": ["..."]}`, `{"instances": ["..."]}` (or `[{"text": "..."}]`), `{"dataframe_records": [{"text": "..."}]}`,
`{"dataframe_split": {"columns": ["text"], "data": [["..."]]}}`, and answers `{"predictions": [{"label", "probability",
"prob_<class>"...}]}`. GET /health and GET /version say whether it is up and what it serves.

A malformed request gets a 4xx and a JSON `{"error": ...}` naming the problem, never a 5xx: no or another
Content-Type (415), a body over the limit (413), bytes that are not UTF-8 JSON or nest too deeply (400), a shape
other than the above, an empty batch, too many texts, or a text that is not a string (422).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from transfer.errors import TransferError

__all__ = ["create_app", "texts_from_payload", "RequestError"]

MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~1,000 texts of 1,000 characters
MAX_TEXTS = 1000  # per request; larger batches go in several requests
SHAPES = ("inputs", "instances", "dataframe_records", "dataframe_split")


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _strings(values: Any, where: str) -> list[str]:
    if not isinstance(values, list):
        raise RequestError(422, f"{where} must be a list of texts, got {type(values).__name__}")
    if not values:
        raise RequestError(422, f"{where} holds no texts")
    if len(values) > MAX_TEXTS:
        raise RequestError(422, f"{where} holds {len(values)} texts; send at most {MAX_TEXTS} per request")
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise RequestError(422, f"{where}[{i}] is {_kind(v)}, not a string")
    return values


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", bool: "a boolean", type(None): "null"}.get(type(v), f"a {type(v).__name__}")


def _column(records: Any, where: str) -> list[Any]:
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise RequestError(422, f"{where} must be a list of objects with a 'text' field")
    missing = [i for i, r in enumerate(records) if "text" not in r]
    if missing:
        raise RequestError(422, f"{where}[{missing[0]}] has no 'text' field")
    return [r["text"] for r in records]


def texts_from_payload(payload: Any) -> list[str]:
    """The texts of a request body in one of MLflow's shapes; RequestError(422) naming what is wrong."""
    if not isinstance(payload, dict):
        raise RequestError(422, f"the body must be a JSON object with one of {list(SHAPES)}, got {_kind(payload)}")
    keys = [k for k in SHAPES if k in payload]
    extra = sorted(set(payload) - set(SHAPES) - {"params"})
    if len(keys) != 1 or extra:
        raise RequestError(422, f"the body must hold exactly one of {list(SHAPES)}"
                                + (f"; unknown field {extra[0]!r}" if extra else f"; got {keys or 'none'}"))
    key, value = keys[0], payload[keys[0]]
    if key == "inputs" and isinstance(value, dict):
        return _strings(value.get("text"), "inputs.text")
    if key == "instances" and isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return _strings(_column(value, key), key)
    if key in ("inputs", "instances"):
        return _strings(value, key)
    if key == "dataframe_records":
        return _strings(_column(value, key), key)
    if not isinstance(value, dict) or not isinstance(value.get("columns"), list) or not isinstance(value.get("data"), list):
        raise RequestError(422, "dataframe_split needs 'columns' (a list) and 'data' (a list of rows)")
    if "text" not in value["columns"]:
        raise RequestError(422, f"dataframe_split has no 'text' column; got {value['columns'][:10]}")
    at, width = value["columns"].index("text"), len(value["columns"])
    rows = value["data"]
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, list) or len(r) != width), None)
    if bad is not None:
        raise RequestError(422, f"dataframe_split.data[{bad}] must be a list of {width} values")
    return _strings([r[at] for r in rows], "dataframe_split.data")


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise RequestError(413, f"the body is over the limit of {limit} bytes" if declared.isdigit()
                           else "Content-Length is not a number")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _payload(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError(400, "the body is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise RequestError(400, f"the body is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise RequestError(400, f"the body is not valid JSON ({e})") from None
    except RecursionError:
        raise RequestError(400, "the JSON body nests too deeply") from None


def create_app(model: Any, classes: list[str], source: str, max_body: int = MAX_BODY_BYTES) -> FastAPI:
    from transfer import __version__

    app = FastAPI(title="transfer classifier", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        return {"model": source, "classes": classes, "transfer": __version__}

    @app.post("/invocations")
    async def invocations(request: Request) -> JSONResponse:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise RequestError(415, f"Content-Type must be application/json, got {ctype or 'none'}")
        texts = texts_from_payload(_payload(await _body(request, max_body)))
        # in a worker thread: a batch being scored must not hold up /health or other requests
        out: pd.DataFrame = await run_in_threadpool(model.predict, pd.DataFrame({"text": texts}))
        return JSONResponse({"predictions": out.to_dict(orient="records")})

    return app
