"""Content-keyed Prefect caching: a task re-runs when its input bytes, params or source change, or its outputs break.

Prefect's DEFAULT policy keys on the flow run id (so nothing is reused across runs) and hashes a `Path`
argument by its string, not its bytes. `content_cache_policy()` keys on

    sha256(task source, every argument canonicalised)

where a `Path` (or list of them) becomes the sha256 of the file or directory tree it names, dicts and
dataclasses become canonical JSON, and output-location arguments (`out*` by default) are keyed by the
resolved path they name, never by what is currently there. A `str` is a value, not a file: pass a `Path`.

Output validation. A task that writes files returns `record_outputs(paths)`: a small dict holding each
output path with its sha256. When the key is computed and a record already sits under it, the policy checks
`outputs_intact(record)`; if a file went missing or changed, the record is rewritten with an expiration in
the past. Prefect's `ResultStore.exists` treats an expired record as absent, so the task body runs and its
commit overwrites the record under the same key. Keying on the outputs' current bytes instead could never
hit: they are absent when the first key is computed and present on every later lookup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prefect.cache_policies import TASK_SOURCE, CachePolicy
from prefect.context import TaskRunContext
from prefect.filesystems import NullFileSystem
from prefect.results import ResultStore
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
from prefect.utilities.hashing import hash_objects

from transfer.io_utils import file_digest
from transfer.stages.record import module_closure  # noqa: F401  (re-exported: the closure a cache key hashes)

__all__ = [
    "ContentCachePolicy",
    "content_cache_policy",
    "content_digest",
    "module_closure",
    "record_outputs",
    "outputs_intact",
    "cache_dir",
]

MISSING = "missing"  # digest of a path that does not exist; keys stay computable and the task reports the error

# abs path -> (stat signature, sha256): one entry per file, so a big corpus is hashed once per process
_digests: dict[str, tuple[tuple[int, ...], str]] = {}


def _file_sha256(path: Path) -> str:
    st = path.stat()
    # ctime too: `cp -p` or `touch -r` can restore mtime, but any write moves ctime; os.replace moves the inode
    signature = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    key = str(path.absolute())
    hit = _digests.get(key)
    if hit is not None and hit[0] == signature:
        return hit[1]
    digest = file_digest(path)
    _digests[key] = (signature, digest)
    return digest


def content_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, or of a directory's (relative path, file sha256) listing; `MISSING` if absent.

    Directory walks skip dot-files (e.g. atomic-write temp files) and `__pycache__`.
    """
    path = Path(path)
    if path.is_file():
        return _file_sha256(path)
    if not path.is_dir():
        return MISSING
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(f for f in files if not f.startswith(".")):
            file = Path(root, name)
            h.update(f"{file.relative_to(path).as_posix()}\0{_file_sha256(file)}\n".encode())
    return "dir:" + h.hexdigest()


def _canonical(value: Any, *, location: bool = False) -> Any:
    """A JSON-able stand-in for `value`: paths by content (or by resolved location), containers recursed."""
    if isinstance(value, Path):
        return {"path": str(value.resolve())} if location else {"sha256": content_digest(value)}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, enum.Enum):
        return _canonical(value.value, location=location)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _canonical(getattr(value, f.name), location=location) for f in dataclasses.fields(value)}
        return {"dataclass": type(value).__qualname__, "fields": fields}
    if isinstance(value, Mapping):
        return {str(k): _canonical(v, location=location) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, location=location) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v, location=location) for v in value), key=json.dumps)
    # anything else (arrays, custom objects): Prefect's JSON-or-cloudpickle hash; raises if unhashable
    return {"object": hash_objects(value, raise_on_failure=True)}


def record_outputs(paths: Iterable[str | Path], **values: Any) -> dict[str, Any]:
    """The result a file-writing task returns: {"outputs": {abs path: sha256}, **values}."""
    outputs = {str(Path(p).resolve()): content_digest(p) for p in paths}
    missing = [p for p, d in outputs.items() if d == MISSING]
    if missing:
        raise FileNotFoundError(f"task output was not written: {missing[0]}")
    return {"outputs": outputs, **values}


def outputs_intact(result: Any) -> bool:
    """True unless `result` records output files that are now missing or whose bytes changed."""
    outputs = result.get("outputs") if isinstance(result, Mapping) else None
    if not isinstance(outputs, Mapping):
        return True  # nothing on disk to vouch for
    return all(content_digest(path) == digest for path, digest in outputs.items())


def _expire_if_broken(store: ResultStore, key: str) -> None:
    """Expire the record under `key` when the files it vouches for changed, so Prefect re-runs the task."""
    if isinstance(store.metadata_storage, NullFileSystem):  # mirror prefect.transactions.transaction()
        store = store.model_copy(update={"metadata_storage": None})
    if not store.exists(key):
        return
    try:
        record = store.read(key)
    except Exception:
        return  # unreadable records are misses for Prefect too
    if outputs_intact(record.result):
        return
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
    store.write(obj=record.result, key=key, expiration=past)


@dataclasses.dataclass
class ContentCachePolicy(CachePolicy):
    """Key = sha256(task source, canonical inputs); expires a cached record whose output files broke.

    outputs: names of arguments that say where to write; keyed by resolved path, not content
        (None: every argument whose name starts with "out").
    exclude: names of arguments left out of the key (loggers, thread counts).
    """

    outputs: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    parts: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # inputs -> what to key on instead of them

    def _is_output(self, name: str) -> bool:
        return name.startswith("out") if self.outputs is None else name in self.outputs

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        source = TASK_SOURCE.compute_key(task_ctx=task_ctx, inputs=inputs, flow_parameters=flow_parameters, **kwargs)
        if self.parts is not None:
            canonical = _canonical(self.parts(inputs or {}))
        else:
            canonical = {
                name: _canonical(value, location=self._is_output(name))
                for name, value in (inputs or {}).items()
                if name not in self.exclude
            }
        blob = json.dumps([source, canonical], sort_keys=True, separators=(",", ":"), allow_nan=True)
        key = hashlib.sha256(blob.encode()).hexdigest()
        if task_ctx is not None and task_ctx.result_store is not None:
            _expire_if_broken(task_ctx.result_store, key)
        return key

    def __add__(self, other: CachePolicy) -> CachePolicy:
        # a compound policy stores records under a different key than the one this policy validates
        raise TypeError("ContentCachePolicy already includes the task source; it does not compose with `+`")


def content_cache_policy(outputs: Iterable[str] | None = None, exclude: Iterable[str] = (),
                         parts: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> ContentCachePolicy:
    """The cache policy for pipeline tasks; use with `@task(cache_policy=..., persist_result=True)`.
    `parts` maps the task's arguments to what the key covers (a Path there is hashed by content)."""
    return ContentCachePolicy(outputs=None if outputs is None else tuple(outputs), exclude=tuple(exclude),
                              parts=parts)


@contextlib.contextmanager
def cache_dir(path: str | Path) -> Iterator[Path]:
    """Persist task results (the cache) under `path` for flows started inside this block."""
    path = Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: path}):
        yield path
