"""Specification of transfer.readers: lazy corpus reading and labelled tables, with errors naming file and row."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transfer.errors import TransferError
from transfer.readers import iter_text_documents, read_table


def write(path: Path, content: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


WIKI = ('<doc id="12" url="http://en.wikipedia.org/wiki?curid=12" title="Anarchism">\n'
        "Anarchism\n\nAnarchism is a political philosophy.\n</doc>\n"
        '<doc id="25" url="http://en.wikipedia.org/wiki?curid=25" title="Autism">\n'
        "Autism\n\nAutism is a disorder.\n</doc>\n")


# --------------------------------------------------------------------------- iter_text_documents


def test_each_non_blank_line_is_a_document_crlf_and_cr_included(tmp_path: Path) -> None:
    f = write(tmp_path / "a.txt", b"first line\r\n\r\n  second  \rthird\n\n")
    assert list(iter_text_documents([f])) == ["first line", "second", "third"]


def test_wikiextractor_tags_are_stripped(tmp_path: Path) -> None:
    f = write(tmp_path / "wiki_00", WIKI)
    assert list(iter_text_documents([f])) == [
        "Anarchism", "Anarchism is a political philosophy.", "Autism", "Autism is a disorder."]


def test_doc_per_file_gives_one_document_per_file_or_wiki_article(tmp_path: Path) -> None:
    plain = write(tmp_path / "book.txt", "Chapter 1\n\nIt was dark.\n")
    wiki = write(tmp_path / "wiki_00", WIKI)
    assert list(iter_text_documents([plain, wiki], doc_per="file")) == [
        "Chapter 1\nIt was dark.", "Anarchism\nAnarchism is a political philosophy.", "Autism\nAutism is a disorder."]


def test_folders_are_recursed_in_sorted_order_skipping_hidden_files(tmp_path: Path) -> None:
    write(tmp_path / "corpus" / "b.txt", "b\n")
    write(tmp_path / "corpus" / "a" / "z.txt", "a/z\n")
    write(tmp_path / "corpus" / ".hidden", "hidden\n")
    write(tmp_path / "corpus" / ".git" / "x", "git\n")
    assert list(iter_text_documents([tmp_path / "corpus"])) == ["a/z", "b"]


def test_globs_and_a_single_path_string(tmp_path: Path) -> None:
    for name in ["wiki_01", "wiki_00", "other"]:
        write(tmp_path / name, name + "\n")
    assert list(iter_text_documents([str(tmp_path / "wiki_*")])) == ["wiki_00", "wiki_01"]
    assert list(iter_text_documents(str(tmp_path / "other"))) == ["other"]


def test_latin1_encoding(tmp_path: Path) -> None:
    f = write(tmp_path / "a.txt", "café naïve\n".encode("latin-1"))
    assert list(iter_text_documents([f], encoding="latin-1")) == ["café naïve"]


def test_utf8_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    f = write(tmp_path / "a.txt", b"\xef\xbb\xbfhello\n")
    assert list(iter_text_documents([f])) == ["hello"]


def test_undecodable_byte_names_file_and_line_after_yielding_earlier_documents(tmp_path: Path) -> None:
    # well past the reader's 8 KiB decode chunk, so documents stream out before the bad line is reached
    f = write(tmp_path / "x.txt", b"good line\n" * 20_000 + b"caf\xe9\n")
    docs = iter_text_documents([f])
    assert next(docs) == "good line"
    with pytest.raises(TransferError) as err:
        list(docs)
    assert str(err.value) == f"{f}, line 20001: bytes are not valid utf-8 (byte 0xe9; try data.encoding: latin-1)"


@pytest.mark.parametrize("setup, arg, expected", [
    (lambda d: None, "missing.txt", "missing.txt: no such file or folder"),
    (lambda d: None, "nothing_*.txt", "nothing_*.txt: no files match"),
    (lambda d: (d / "empty").mkdir(), "empty", "empty: folder holds no files"),
    (lambda d: write(d / "blank.txt", "\n  \n<doc id=1>\n</doc>\n"), "blank.txt", "blank.txt: no text found"),
])
def test_nothing_to_read_is_an_error_naming_the_path(tmp_path: Path, setup, arg: str, expected: str) -> None:
    setup(tmp_path)
    with pytest.raises(TransferError, match=expected.replace("*", r"\*")):
        list(iter_text_documents([str(tmp_path / arg)]))


def test_bad_arguments_are_errors(tmp_path: Path) -> None:
    f = write(tmp_path / "a.txt", "x\n")
    with pytest.raises(TransferError, match="doc_per"):
        iter_text_documents([f], doc_per="paragraph")
    with pytest.raises(TransferError, match="unknown text encoding 'klingon'"):
        iter_text_documents([f], encoding="klingon")


# --------------------------------------------------------------------------- read_table


def test_csv_with_header_joins_text_columns(tmp_path: Path) -> None:
    f = write(tmp_path / "t.csv", 'title,body,label\nHi, there ,pos\n"A, quoted","two\nlines ",neg\n')
    df = read_table(f, ["title", "body"], "label")
    assert list(df.columns) == ["text", "label"]
    assert df["text"].tolist() == ["Hi there", "A, quoted two\nlines"]
    assert df["label"].tolist() == ["pos", "neg"]


def test_ag_news_style_headerless_csv(tmp_path: Path) -> None:
    f = write(tmp_path / "train.csv", '"3","Wall St. Bears","Reuters - Short-sellers\\are back."\n'
                                      '"4","Title","Desc"\n')
    df = read_table(f, ["1", "2"], "0", header=False)
    assert df["text"].tolist() == ["Wall St. Bears Reuters - Short-sellers\\are back.", "Title Desc"]
    assert df["label"].tolist() == ["3", "4"]


def test_values_are_read_as_text(tmp_path: Path) -> None:
    f = write(tmp_path / "t.csv", "text,label\nNA,01\nnull,NaN\n")
    df = read_table(f, ["text"], "label")
    assert df.values.tolist() == [["NA", "01"], ["null", "NaN"]]


def test_no_label_column_gives_none_labels(tmp_path: Path) -> None:
    f = write(tmp_path / "t.tsv", "text\tother\nhello world\tx\n")
    df = read_table(f, ["text"], None)
    assert df["text"].tolist() == ["hello world"] and df["label"].tolist() == [None]


def test_bom_mixed_line_endings_and_latin1(tmp_path: Path) -> None:
    f = write(tmp_path / "bom.csv", b"\xef\xbb\xbftext,label\r\na,1\nb,2\rc,3\r\n")
    assert read_table(f, ["text"], "label")["text"].tolist() == ["a", "b", "c"]
    g = write(tmp_path / "l1.csv", "text,label\ncafé,1\n".encode("latin-1"))
    assert read_table(g, ["text"], "label", encoding="latin-1")["text"].tolist() == ["café"]


def test_ten_megabyte_single_line(tmp_path: Path) -> None:
    f = write(tmp_path / "big.csv", "text,label\n" + "word " * 2_000_000 + ",1\n")
    assert len(read_table(f, ["text"], "label")["text"][0]) == 10_000_000 - 1


def test_parquet_jsonl_and_json_array(tmp_path: Path) -> None:
    pd.DataFrame({"text": ["a b", "c"], "label": [1, 0]}).to_parquet(tmp_path / "t.parquet")
    write(tmp_path / "t.jsonl", '{"text": "a b", "label": 1}\n\n{"text": "c", "label": 0}\n')
    write(tmp_path / "t.json", json.dumps([{"text": "a b", "label": 1}, {"text": "c", "label": 0}], indent=1))
    for name in ["t.parquet", "t.jsonl", "t.json"]:
        df = read_table(tmp_path / name, ["text"], "label")
        assert df.values.tolist() == [["a b", "1"], ["c", "0"]], name


def bad_parquet(path: Path) -> None:
    pd.DataFrame({"text": ["ok", None], "label": ["a", "b"]}).to_parquet(path)


ERROR_CASES = {
    # id: (file name, content or writer, read_table kwargs, substrings of the message after the file name)
    "missing file": ("nope.csv", None, {}, ["file not found"]),
    "folder": ("dir.csv", "mkdir", {}, ["is a folder"]),
    "empty file": ("e.csv", b"", {}, ["file is empty"]),
    "blank file": ("e.csv", b"\n\n", {}, ["empty"]),
    "unknown suffix": ("t.xlsx", b"text,label\na,b\n", {}, ["unknown table format '.xlsx'", ".csv"]),
    "missing text column": ("t.csv", b"body,label\na,b\n", {}, ["text column 'text' not found", "'body', 'label'"]),
    "missing label column": ("t.csv", b"text,y\na,b\n", {}, ["label column 'label' not found", "'text', 'y'"]),
    "header=False names": ("t.csv", b"a,b\n", {}, ["not found", "header=False"]),
    "empty text": ("t.csv", b"text,label\na,1\n,2\n", {}, ["data row 2: text is empty"]),
    "whitespace text": ("t.csv", b"text,label\na,1\nb,2\n  \t ,3\n", {}, ["data row 3: text is empty"]),
    "short row": ("t.csv", b"text,label\na,1\nb\n", {}, ["data row 2: label is empty"]),
    "empty label": ("t.csv", b"text,label\na,\nb,\n", {}, ["data row 1: label is empty", "2 rows"]),
    "null text in parquet": ("t.parquet", bad_parquet, {}, ["data row 2: text is empty or missing"]),
    "undecodable": ("t.csv", b"text,label\na,1\ncaf\xe9,2\n", {}, ["line 3: bytes are not valid utf-8", "latin-1"]),
    "duplicate header": ("t.csv", b"text,label,text\na,1,b\n", {}, ["duplicate column name 'text'"]),
    "wrong delimiter": ("t.csv", b"text;label\na;1\n", {}, ["only 1 column found; is the delimiter right?"]),
    "header only": ("t.csv", b"text,label\n", {}, ["no data rows"]),
    "extra field": ("t.csv", b"text,label\na,1\nb,2,3\n", {}, ["cannot parse as CSV", "line 3"]),
    "open quote": ("t.csv", b'text,label\n"a,1\n', {}, ["cannot parse as CSV"]),
    "bad json line": ("t.jsonl", b'{"text": "a", "label": 1}\n{"text": \n', {}, ["line 2: not valid JSON"]),
    "json not object": ("t.jsonl", b'{"text": "a", "label": 1}\n[1]\n', {}, ["line 2: expected a JSON object"]),
    "json missing key": ("t.jsonl", b'{"text": "a", "label": 1}\n\n{"label": 1}\n', {}, ["line 3: text is empty"]),
    "json nested value": ("t.jsonl", b'{"text": {"a": 1}, "label": 1}\n', {}, ["line 1: column 'text' holds a dict"]),
    "corrupt parquet": ("t.parquet", b"PAR1 not really", {}, ["cannot read as Parquet"]),
}


@pytest.mark.parametrize("case", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_bad_tables_raise_errors_naming_file_and_row(tmp_path: Path, case) -> None:
    name, content, kwargs, expected = case
    path = tmp_path / name
    if content == "mkdir":
        path.mkdir()
    elif callable(content):
        content(path)
    elif content is not None:
        write(path, content)
    header = "header=False" not in expected
    with pytest.raises(TransferError) as err:
        read_table(path, ["text"], "label", header=header, **kwargs)
    message = str(err.value)
    assert message.startswith(str(path)), message
    for part in expected:
        assert part in message, message
    assert err.value.__cause__ is None


def test_ag_news_like_file_read_with_header_true_says_which_columns_exist(tmp_path: Path) -> None:
    f = write(tmp_path / "train.csv", '"3","Wall St.","Desc"\n"4","T","D"\n')
    with pytest.raises(TransferError) as err:
        read_table(f, ["1", "2"], "0")
    assert str(err.value) == (f"{f}: text columns '1', '2' not found; available columns: '3', 'Wall St.', 'Desc' "
                              "(the first row was read as the header; use header=False to name columns by position)")


# --------------------------------------------------------------------------- any bytes: a result or TransferError

TABLE_BYTES = st.one_of(
    st.binary(max_size=200),
    st.lists(st.sampled_from([b"text", b"label", b",", b",", b"\n", b"\r\n", b"\r", b'"', b"a", b"b c", b" ", b"\t",
                              b"\xe9", b"\xef\xbb\xbf", b"\x00", b";", b"1", b"{", b"}", b"<doc id=1>", b"</doc>"]),
             max_size=40).map(b"".join),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=TABLE_BYTES, header=st.booleans())
def test_any_bytes_give_a_table_or_transfer_error(tmp_path: Path, content: bytes, header: bool) -> None:
    path = write(tmp_path / "any.csv", content)
    text_cols, label_col = (["text"], "label") if header else (["0"], "1")
    try:
        df = read_table(path, text_cols, label_col, header=header)
    except TransferError as e:
        assert str(e).startswith(str(path))
        return
    assert list(df.columns) == ["text", "label"] and len(df) > 0
    assert all(isinstance(t, str) and t.strip() for t in df["text"])
    assert all(isinstance(v, str) and v for v in df["label"])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=TABLE_BYTES, doc_per=st.sampled_from(["line", "file"]))
def test_any_bytes_give_documents_or_transfer_error(tmp_path: Path, content: bytes, doc_per: str) -> None:
    path = write(tmp_path / "any.txt", content)
    try:
        docs = list(iter_text_documents([path], doc_per=doc_per))
    except TransferError as e:
        assert str(e).startswith(str(path))
        return
    assert docs and all(isinstance(d, str) and d.strip() == d and d for d in docs)


def test_a_utf16_file_read_as_utf8_is_told_what_its_bytes_look_like(tmp_path):
    for name, data, want in [("bom.csv", "text,label\nhello,a\n".encode("utf-16"), "UTF-16 byte-order mark"),
                             ("nobom.csv", "text,label\nhello,a\n".encode("utf-16-le"), "every other byte is NUL"),
                             ("latin.csv", "text,label\ncaf\xe9,a\n".encode("latin-1"), "latin-1")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TransferError, match=want):
            read_table(tmp_path / name, ["text"], "label")
    (tmp_path / "right.csv").write_bytes("text,label\nhello,a\n".encode("utf-16-le"))
    assert list(read_table(tmp_path / "right.csv", ["text"], "label", encoding="utf-16-le")["text"]) == ["hello"]
