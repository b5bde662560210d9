"""Bad data files a user can hand to hpref: each is read correctly or refused in one line that names
the file and what is wrong (exit 2), never a traceback, a page of log-handler noise or nonsense."""

from __future__ import annotations

import gzip
import json
import os

import pytest
from tests.conftest import run_hpref_together

from hpref.data.readers import ArenaConfig, ArenaReader, TableFile, arena_rows, write_arena_file
from hpref.data.records import Battle
from hpref.errors import DataError
from hpref.stats.counts import data_stats, format_stats, open_data_file

BATTLES = [
    Battle(str(i), (f"héllo wörld {i} – ✓",), (f"answer a {i}",), (f"answer b {i}",), (1.0, 0.0, 0.0))
    for i in range(5)
]


def _utf8_text(tmp_path, fmt: str) -> str:
    return write_arena_file(tmp_path / f"utf8.{fmt}", BATTLES).read_text(encoding="utf-8")


ENCODINGS = {  # name -> (BOM + encoded text) builder
    "utf-8-sig": lambda t: t.encode("utf-8-sig"),
    "utf-16-le": lambda t: b"\xff\xfe" + t.encode("utf-16-le"),
    "utf-16-be": lambda t: b"\xfe\xff" + t.encode("utf-16-be"),
    "utf-32-le": lambda t: b"\xff\xfe\x00\x00" + t.encode("utf-32-le"),
    "utf-32-be": lambda t: b"\x00\x00\xfe\xff" + t.encode("utf-32-be"),
}


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_a_file_with_a_byte_order_mark_reads_like_its_utf8_twin(tmp_path, fmt, encoding):
    """Excel and Windows tools save UTF-16 with a BOM. Read as UTF-8 such a file had a header of
    NUL-riddled names ("missing column prompt") — the mark says the encoding, so it must be read."""
    path = tmp_path / f"{encoding}.{fmt}"
    path.write_bytes(ENCODINGS[encoding](_utf8_text(tmp_path, fmt)))
    read = list(ArenaReader(ArenaConfig(path=str(path)), seed=0).battles())
    assert read == BATTLES


def test_a_compressed_utf16_file_is_read_too(tmp_path):
    # The mark is found in the decompressed stream, not in the gzip header.
    path = tmp_path / "u16.csv.gz"
    path.write_bytes(gzip.compress(ENCODINGS["utf-16-le"](_utf8_text(tmp_path, "csv"))))
    assert list(ArenaReader(ArenaConfig(path=str(path)), seed=0).battles()) == BATTLES


def test_utf16_file_through_the_cli_has_no_logging_error_spam(stats_cli):
    """The reported bug: `hpref data stats` on a UTF-16 CSV printed ~50 lines of loguru "Logging
    error" before its message. Now it is read; stderr holds at most the one summary log line."""
    _path, result = stats_cli["u16.csv"]
    assert result.returncode == 0, result.stderr
    assert "5 used" in result.stdout
    assert "Logging error" not in result.stderr and len(result.stderr.strip().splitlines()) <= 1


def _write(tmp_path, name: str, data: bytes | str) -> os.PathLike:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _csv_bytes(tmp_path) -> bytes:
    # Incompressible cells, so that half of the gzip stream still holds a header and some rows.
    battles = [Battle(str(i), ("p",), (os.urandom(40).hex(),), ("b",), (1.0, 0.0, 0.0)) for i in range(400)]
    return write_arena_file(tmp_path / "src.csv", battles).read_bytes()


ROW = json.dumps(next(arena_rows(BATTLES[:1])))

# (file name, contents (or a builder from tmp_path), what the one-line message must say)
BAD_FILES = [
    ("u16-no-bom.csv", lambda t: _utf8_text(t, "csv").encode("utf-16-le"), "not UTF-8 text (a NUL byte"),
    ("random.csv", lambda t: os.urandom(2000) + b"\x00", "not UTF-8 text"),
    ("latin1-header.csv", "id,pr\xf3mpt,response_a,response_b\n".encode("latin-1"), "column 2 of the header"),
    ("empty.csv", b"", "empty file, expected a CSV header row"),
    ("empty.jsonl", b"\n\n", "empty file, expected JSON Lines"),
    ("array.json", json.dumps([json.loads(ROW)] * 2, indent=1), "a JSON array, not JSON Lines"),
    ("nulls.jsonl", "null\n[1]\n", "no line is a JSON object (line 1: expected a JSON object"),
    (
        "half.csv.gz",
        lambda t: gzip.compress(_csv_bytes(t))[:3000],
        "the gz data ends early: the file is truncated",
    ),
    ("plain.csv.gz", "id,prompt\n", "not gz-compressed data, though its name ends in .gz"),
    ("zipped.csv", lambda t: gzip.compress(b"id,prompt\n"), "not a text file: it is gzip-compressed"),
    ("sheet.csv", b"PK\x03\x04" + b"\x00" * 40, "not a text file: it is a ZIP archive (an Excel .xlsx?"),
]


@pytest.mark.parametrize(("name", "data", "expected"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files_are_one_clear_data_error(tmp_path, name, data, expected):
    """Before: the UTF-16/binary/Latin-1 files were read as garbage (a header of NUL-riddled names, then
    "missing column" or pages of logging errors), a JSON array was "missing columns (found: none)",
    a truncated .gz was a raw EOFError. Each must be a `DataError` naming the file and the cause."""
    path = _write(tmp_path, name, data(tmp_path) if callable(data) else data)
    with pytest.raises(DataError) as info:
        list(open_data_file(path).battles())
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert expected in message, message
    assert "\n" not in message and "\\x00" not in message and "\x00" not in message


CLI_BAD_FILES = ["random.csv", "latin1-header.csv", "array.json", "half.csv.gz"]


@pytest.fixture(scope="module")
def stats_cli(tmp_path_factory):
    """`hpref data stats FILE` of each file the CLI tests of this module read, the processes side by
    side (each a fresh process: its exit code and every line it printed): name -> (path, result)."""
    folder = tmp_path_factory.mktemp("stats-cli")
    paths = {}
    for name in CLI_BAD_FILES:
        data = next(d for n, d, _ in BAD_FILES if n == name)
        paths[name] = _write(folder, name, data(folder) if callable(data) else data)
    paths["u16.csv"] = _write(folder, "u16.csv", ENCODINGS["utf-16-le"](_utf8_text(folder, "csv")))
    paths["dup.jsonl"] = write_arena_file(folder / "dup.jsonl", [*BATTLES, BATTLES[0]])
    results = run_hpref_together(*(["data", "stats", str(p)] for p in paths.values()))
    return {name: (path, result) for (name, path), result in zip(paths.items(), results, strict=True)}


@pytest.mark.parametrize("name", CLI_BAD_FILES)
def test_bad_files_through_the_cli_are_one_line_exit_2(stats_cli, name):
    expected = next(e for n, _, e in BAD_FILES if n == name)
    path, result = stats_cli[name]
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr  # one line
    assert result.stderr.startswith(f"error: {path}: ") and expected in result.stderr
    assert "Traceback" not in result.stderr and "Logging error" not in result.stderr


def test_a_folder_is_not_a_data_file(tmp_path):
    (tmp_path / "d.csv").mkdir()
    with pytest.raises(DataError, match="is a folder, expected a CSV, Parquet or JSONL file"):
        TableFile(tmp_path / "d.csv")


def test_a_non_object_jsonl_line_is_a_row_error_that_skip_counts(tmp_path):
    # One bad line among good ones is a row (skippable), not the whole file.
    path = _write(tmp_path, "mixed.jsonl", f"{ROW}\n[1, 2]\n{ROW}\n")
    with pytest.raises(DataError, match=r"row 2, column '\(line\)': expected a JSON object, got list"):
        list(open_data_file(path).battles())
    source = open_data_file(path, on_error="skip")
    assert len(list(source.battles())) == 2 and source.summary.rows_skipped == 1


def test_undecodable_bytes_in_a_message_do_not_break_the_log_file(tmp_path, capfd):
    """The root cause of the "Logging error" pages: a message carrying a lone surrogate (an
    undecodable byte of a user's file) could not be encoded by the strict UTF-8 log file, and loguru
    printed its handler-error report — with a traceback — for every such record."""
    from loguru import logger

    from hpref.logs import file_only, setup_logging

    log_file = tmp_path / "logs" / "hpref.log"
    setup_logging(log_file, console=True)
    try:
        try:
            raise DataError("bad.csv: column '\udcff\udcfeid' is not known")
        except DataError as exc:
            file_only().opt(exception=exc).debug("user error")
        logger.info("after \udcff")
    finally:
        logger.remove()
    err = capfd.readouterr().err
    assert "Logging error" not in err, err[:500]
    text = log_file.read_text(encoding="utf-8")
    assert "\\udcff\\udcfeid" in text and "after \\udcff" in text


def test_stats_reports_duplicate_ids_that_eval_would_refuse(tmp_path):
    """`hpref eval` refuses a file that repeats an id (predictions are joined by id); stats used to
    pass such a file without a word. It must count the repeats and name the first few."""
    repeated = [*BATTLES, BATTLES[1], BATTLES[3], BATTLES[1]]
    stats = data_stats(open_data_file(write_arena_file(tmp_path / "dup.csv", repeated)))
    assert stats["duplicate_ids"] == {"rows": 3, "ids": 2, "examples": ["1", "3"]}
    text = format_stats(stats)
    assert "3 rows repeat an earlier id ('1', '3')" in text and "hpref eval refuses" in text
    clean = data_stats(open_data_file(write_arena_file(tmp_path / "ok.csv", BATTLES)))
    assert clean["duplicate_ids"]["rows"] == 0 and "repeat an earlier id" not in format_stats(clean)


def test_stats_cli_prints_the_duplicates(stats_cli):
    _path, result = stats_cli["dup.jsonl"]
    assert result.returncode == 0, result.stderr
    assert "1 rows repeat an earlier id ('0')" in result.stdout
