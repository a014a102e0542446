"""transfer.download against a real HTTP server on 127.0.0.1 serving small archives shaped like the real ones."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import socket
import tarfile
import threading
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from transfer.download import DATASETS, download, fetch
from transfer.errors import TransferError

IMDB_FILES = {
    "aclImdb/README": "not a review",
    "aclImdb/imdb.vocab": "the\nfilm\n",
    "aclImdb/train/pos/1_9.txt": "A wonderful film.<br /><br />Loved every minute, truly.",
    "aclImdb/train/pos/0_10.txt": "Best \"movie\" of the year, with commas, quotes\nand a newline.",
    "aclImdb/train/neg/0_2.txt": "Dull and far too long.",
    "aclImdb/train/urls_pos.txt": "http://www.imdb.com/title/tt0000000/usercomments",
    "aclImdb/train/unsup/0_0.txt": "An unlabelled review.",
    "aclImdb/train/unsup/1_0.txt": "Another one, caf\u00e9 included.",
    "aclImdb/test/pos/0_8.txt": "Charming.",
    "aclImdb/test/neg/0_1.txt": "Awful acting.",
}

WIKI_TRAIN = (
    " \n = Alpha = \n \n Alpha is a letter . \n \n = = History = = \n \n It is old . \n"
    " \n = Beta = \n \n Beta follows alpha . \n"
)


def _imdb_tar(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, text in IMDB_FILES.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _wikitext_zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("wikitext-103-raw/wiki.train.raw", WIKI_TRAIN)
        zf.writestr("wikitext-103-raw/wiki.valid.raw", " \n = Gamma = \n \n Gamma . \n")
        zf.writestr("wikitext-103-raw/wiki.test.raw", " \n = Delta = \n \n Delta . \n")
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, served folder) of an HTTP server holding aclImdb_v1.tar.gz and wikitext-103-raw-v1.zip."""
    root = tmp_path_factory.mktemp("served")
    _imdb_tar(root / "aclImdb_v1.tar.gz")
    _wikitext_zip(root / "wikitext-103-raw-v1.zip")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", root
    httpd.shutdown()
    httpd.server_close()


def _download_imdb(server, dest: Path, **kwargs) -> dict[str, Path]:
    base, root = server
    kwargs.setdefault("sha256_override", _sha256(root / "aclImdb_v1.tar.gz"))
    return download("imdb", dest, url_override=f"{base}/aclImdb_v1.tar.gz", progress=False, **kwargs)


def test_imdb_download_is_verified_and_converted_to_text_label_tables(server, tmp_path):
    out = _download_imdb(server, tmp_path / "imdb")

    assert out["archive"].read_bytes() == (server[1] / "aclImdb_v1.tar.gz").read_bytes()
    train = pd.read_csv(out["train"])
    test = pd.read_csv(out["test"])
    assert list(train.columns) == ["text", "label"]
    assert train.to_dict("records") == [  # neg before pos, ordered by review id; <br /> and newlines gone
        {"text": "Dull and far too long.", "label": "neg"},
        {"text": "Best \"movie\" of the year, with commas, quotes and a newline.", "label": "pos"},
        {"text": "A wonderful film. Loved every minute, truly.", "label": "pos"},
    ]
    assert test.to_dict("records") == [{"text": "Awful acting.", "label": "neg"}, {"text": "Charming.", "label": "pos"}]
    assert out["unsup"].read_text(encoding="utf-8") == "An unlabelled review.\nAnother one, caf\u00e9 included.\n"
    assert sorted(p.name for p in (tmp_path / "imdb").iterdir()) == [
        "aclImdb_v1.tar.gz", "test.csv", "train.csv", "unsup.txt"]  # no temp files, nothing unpacked


def test_verified_archive_is_not_downloaded_again(server, tmp_path):
    base, root = server
    _download_imdb(server, tmp_path)
    again = download("imdb", tmp_path, url_override=f"{base}/gone.tar.gz", progress=False,
                     sha256_override=_sha256(root / "aclImdb_v1.tar.gz"))
    assert pd.read_csv(again["test"])["label"].tolist() == ["neg", "pos"]


def test_checksum_mismatch_raises_and_leaves_nothing_behind(server, tmp_path):
    dest = tmp_path / "imdb"
    with pytest.raises(TransferError, match="sha256 mismatch"):
        _download_imdb(server, dest, sha256_override="0" * 64)
    assert not dest.exists()


def test_checksum_mismatch_keeps_an_existing_folder_but_adds_no_file(server, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(TransferError, match="sha256 mismatch"):
        _download_imdb(server, tmp_path, sha256_override="0" * 64)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_published_checksum_rejects_a_different_archive(server, tmp_path):
    with pytest.raises(TransferError, match=DATASETS["imdb"].sha256):
        _download_imdb(server, tmp_path, sha256_override=None)
    assert list(tmp_path.iterdir()) == []


def test_http_404_is_a_transfer_error(server, tmp_path):
    with pytest.raises(TransferError, match="HTTP 404"):
        download("imdb", tmp_path / "x", url_override=f"{server[0]}/missing.tar.gz", progress=False)
    assert not (tmp_path / "x").exists()


def test_unreachable_host_is_a_transfer_error(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransferError, match="cannot download"):
        fetch(f"http://127.0.0.1:{port}/a.zip", tmp_path / "a.zip", "0" * 64, progress=False, timeout=5)
    assert list(tmp_path.iterdir()) == []


def test_wikitext_is_converted_to_one_article_per_line(server, tmp_path):
    base, root = server
    out = download("wikitext-103", tmp_path, url_override=f"{base}/wikitext-103-raw-v1.zip", progress=True,
                   sha256_override=_sha256(root / "wikitext-103-raw-v1.zip"))
    assert out["train"].read_text(encoding="utf-8").splitlines() == [
        "= Alpha = Alpha is a letter . = = History = = It is old .",
        "= Beta = Beta follows alpha .",
    ]
    assert out["valid"].read_text(encoding="utf-8") == "= Gamma = Gamma .\n"
    assert out["test"].read_text(encoding="utf-8") == "= Delta = Delta .\n"


def test_a_verified_file_that_is_not_the_expected_archive_is_a_transfer_error(tmp_path):
    bogus = tmp_path / "served" / "aclImdb_v1.tar.gz"
    bogus.parent.mkdir()
    bogus.write_bytes(b"not a tarball")
    with pytest.raises(TransferError, match="not a readable aclImdb tar.gz"):
        download("imdb", tmp_path / "out", url_override=bogus.as_uri(), progress=False, sha256_override=_sha256(bogus))


def test_unknown_data_set_is_rejected(tmp_path):
    with pytest.raises(TransferError, match="unknown data set 'imbd'"):
        download("imbd", tmp_path)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_registry_pins_an_https_url_and_a_sha256(name):
    spec = DATASETS[name]
    assert spec.url.startswith("https://") and spec.url.endswith(spec.filename)
    assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
