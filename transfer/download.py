"""`transfer data`: download the public data sets, verify their sha256, convert them to what params.yaml reads.

Archives are read member by member, never unpacked onto disk, so a hostile member path cannot escape
`dest_dir` and IMDb's 100k small files never hit the file system. Every output is written atomically.

  wikitext-103 -> train.txt, valid.txt, test.txt     one Wikipedia article per line (data.general_doc_per: line)
  imdb         -> train.csv, test.csv (text,label)   label is pos/neg; unsup.txt: 50k unlabelled reviews, one per line
"""

from __future__ import annotations

import csv
import hashlib
import http.client
import io
import re
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from transfer import __version__
from transfer.errors import TransferError
from transfer.io_utils import atomic_path, file_digest

__all__ = ["Dataset", "DATASETS", "download", "fetch"]

_CHUNK = 1 << 20  # bytes read per network round


@dataclass(frozen=True)
class Dataset:
    url: str
    sha256: str  # of the archive as published
    filename: str  # archive name kept in dest_dir, so a re-run skips the download
    convert: Callable[[Path, Path], dict[str, Path]]  # (archive, dest_dir) -> outputs by name
    about: str


def _clean(text: str) -> str:
    """One line of text: IMDb's <br /> tags and all runs of whitespace become one space."""
    return " ".join(re.sub(r"<br\s*/?>", " ", text).split())


def _convert_wikitext(archive: Path, dest: Path) -> dict[str, Path]:
    outputs = {}
    try:
        with zipfile.ZipFile(archive) as zf:
            for split in ("train", "valid", "test"):
                member = f"wikitext-103-raw/wiki.{split}.raw"
                try:
                    raw = zf.open(member)
                except KeyError:
                    raise TransferError(f"{archive}: archive has no {member}") from None
                with raw, atomic_path(dest / f"{split}.txt") as tmp, open(tmp, "w", encoding="utf-8") as out:
                    lines = io.TextIOWrapper(raw, encoding="utf-8")
                    _write_articles(lines, out)
                outputs[split] = dest / f"{split}.txt"
    except (zipfile.BadZipFile, UnicodeDecodeError, EOFError) as e:
        raise TransferError(f"{archive}: not a readable WikiText zip ({e})") from None
    return outputs


_ARTICLE_TITLE = re.compile(r"^ = [^=].* = $")  # " = Title = "; sections are " = = Section = = "


def _write_articles(lines: io.TextIOBase, out: io.TextIOBase) -> None:
    """Join each article's paragraphs and headings into one line."""
    article: list[str] = []
    for line in lines:
        line = line.rstrip("\n")
        if _ARTICLE_TITLE.match(line) and article:
            out.write(" ".join(article) + "\n")
            article = []
        if line.strip():
            article.append(line.strip())
    if article:
        out.write(" ".join(article) + "\n")


_IMDB_MEMBER = re.compile(r"^aclImdb/(train|test)/(pos|neg|unsup)/(\d+)_(\d+)\.txt$")  # id_rating.txt


def _convert_imdb(archive: Path, dest: Path) -> dict[str, Path]:
    reviews: dict[tuple[str, str], list[tuple[int, str]]] = {}
    try:
        with tarfile.open(archive, "r:gz") as tf:
            for member in tf:
                m = _IMDB_MEMBER.match(member.name)
                if not m or not member.isfile():
                    continue
                split, label, review_id = m.group(1), m.group(2), int(m.group(3))
                data = tf.extractfile(member).read()
                try:
                    text = _clean(data.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise TransferError(f"{archive}: {member.name} is not UTF-8 ({e})") from None
                reviews.setdefault((split, label), []).append((review_id, text))
    except (tarfile.TarError, EOFError, OSError) as e:
        raise TransferError(f"{archive}: not a readable aclImdb tar.gz ({e})") from None

    outputs = {}
    for split in ("train", "test"):
        rows = [(text, label) for label in ("neg", "pos") for _, text in sorted(reviews.get((split, label), []))]
        if not rows:
            raise TransferError(f"{archive}: no aclImdb/{split}/pos or neg reviews found")
        path = dest / f"{split}.csv"
        with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["text", "label"])
            writer.writerows(rows)
        outputs[split] = path
    unsup = [text for _, text in sorted(reviews.get(("train", "unsup"), []))]
    if unsup:
        with atomic_path(dest / "unsup.txt") as tmp:
            tmp.write_text("".join(t + "\n" for t in unsup if t), encoding="utf-8")
        outputs["unsup"] = dest / "unsup.txt"
    return outputs


DATASETS: dict[str, Dataset] = {
    # Stephen Merity's own host; the original s3://research.metamind.io copy is gone.
    # 191,984,949 bytes (md5 0ca3512bd7a238be4a63ce7b434f8935).
    "wikitext-103": Dataset(
        url="https://wikitext.smerity.com/wikitext-103-raw-v1.zip",
        sha256="91c00ae287f0d699e18605c84afc9e45c192bc6b7797ff8837e5474655a33794",
        filename="wikitext-103-raw-v1.zip",
        convert=_convert_wikitext,
        about="WikiText-103 raw (Merity et al. 2016): ~103M words of Wikipedia articles, for LM pretraining",
    ),
    # md5 7c2ac02c03563afcf9b574c7e56c153a.
    "imdb": Dataset(
        url="https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz",
        sha256="c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe",
        filename="aclImdb_v1.tar.gz",
        convert=_convert_imdb,
        about="IMDb Large Movie Review v1 (Maas et al. 2011): 25k/25k labelled pos/neg reviews + 50k unlabelled",
    ),
}


def download(
    name: str,
    dest_dir: str | Path,
    url_override: str | None = None,
    progress: bool = True,
    sha256_override: str | None = None,
) -> dict[str, Path]:
    """Fetch data set `name` into dest_dir, verify it, convert it; returns {"archive": ..., output name: path}.

    url_override points at a mirror (http(s):// or file://); sha256_override is for archives other than
    the published one (tests, private mirrors).
    """
    if name not in DATASETS:
        raise TransferError(f"unknown data set {name!r}; choose one of {sorted(DATASETS)}")
    spec = DATASETS[name]
    dest = Path(dest_dir)
    created = not dest.exists()
    try:
        archive = fetch(url_override or spec.url, dest / spec.filename, sha256_override or spec.sha256, progress)
    except TransferError:
        if created and dest.is_dir() and not any(dest.iterdir()):
            dest.rmdir()
        raise
    return {"archive": archive, **spec.convert(archive, dest)}


def fetch(url: str, path: str | Path, sha256: str, progress: bool = True, timeout: float = 60.0) -> Path:
    """Stream `url` to `path` and keep it only if its sha256 matches; an already verified file is kept as is."""
    path = Path(path)
    sha256 = sha256.lower()
    if path.is_file() and file_digest(path) == sha256:
        return path
    with atomic_path(path) as tmp:  # deleted on any error, so a failed fetch leaves nothing
        digest = _stream(url, tmp, progress, timeout)
        if digest != sha256:
            raise TransferError(
                f"{url}: sha256 mismatch (expected {sha256}, got {digest}); the download was deleted")
    return path


def _stream(url: str, tmp: Path, progress: bool, timeout: float) -> str:
    request = urllib.request.Request(url, headers={"User-Agent": f"transfer/{__version__}"})
    h = hashlib.sha256()
    done = 0
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp, open(tmp, "wb") as f:
            total = int(resp.headers.get("Content-Length") or 0)
            while chunk := resp.read(_CHUNK):
                h.update(chunk)
                f.write(chunk)
                done += len(chunk)
                if progress:
                    of = f" / {total / 2**20:.1f}" if total else ""
                    print(f"\r{url}: {done / 2**20:.1f}{of} MiB", end="", file=sys.stderr, flush=True)
    except urllib.error.HTTPError as e:
        raise TransferError(f"{url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise TransferError(f"{url}: cannot download ({e.reason})") from None
    except (OSError, http.client.HTTPException) as e:
        raise TransferError(f"{url}: download failed after {done} bytes ({e!r})") from None
    finally:
        if progress and done:
            print(file=sys.stderr)
    if total and done != total:
        raise TransferError(f"{url}: download truncated at {done} of {total} bytes")
    return h.hexdigest()
