"""Reading a user's table file as a stream: CSV, Parquet or JSON Lines, optionally .gz / .bz2 / .xz.

CSV and JSONL are read line by line, Parquet in record batches, so a 200 MB file is never held in
memory. `TableFile` gives the column names and `(row_number, dict | RowError)` pairs (row numbers as
the readers' messages name them; see `hpref.data.readers`); `clean_text` and `is_missing` normalise
cell values. The readers turn rows into battles.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import math
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from hpref.data.base import RowError
from hpref.errors import DataError

Format = Literal["auto", "csv", "parquet", "jsonl"]
CHUNK_ROWS = 2048


def detect_format(path: Path, fmt: Format = "auto") -> str:
    if fmt != "auto":
        return fmt
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst"):
        suffixes = suffixes[:-1]
    ext = suffixes[-1] if suffixes else ""
    if ext == ".csv":
        return "csv"
    if ext in (".parquet", ".pq"):
        return "parquet"
    if ext in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise DataError(f"{path}: cannot tell the format from the name; set format = 'csv', 'parquet' or 'jsonl'")


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


class TableFile:
    """Column names and a stream of `(row_number, dict | RowError)` for one data file."""

    def __init__(self, path: str | Path, fmt: Format = "auto") -> None:
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise DataError(f"{self.path}: data file not found")
        if self.path.is_dir():
            raise DataError(f"{self.path}: is a folder, expected a CSV, Parquet or JSONL file")
        self.format = detect_format(self.path, fmt)
        self.columns = self._columns()
        self._check_header()

    def _columns(self) -> list[str]:
        try:
            if self.format == "csv":
                with _open_text(self.path, newline="") as f:
                    header = next(_csv_reader(f), None)
                if header is None:
                    raise DataError(f"{self.path}: empty file, expected a CSV header row")
                return self._no_repeats(header)
            if self.format == "parquet":
                import pyarrow.parquet as pq

                suffix = self.path.suffix.lower()
                if suffix in (*_OPENERS, ".zst"):
                    raise DataError(
                        f"{self.path}: a {suffix[1:]}-compressed Parquet file; Parquet compresses its own "
                        "data: decompress it and read the .parquet file"
                    )
                return self._no_repeats(list(pq.ParquetFile(self.path).schema_arrow.names))
            first_error = None
            for number, row in self._jsonl_rows():  # the first object row (a broken one is a row error later)
                if isinstance(row, dict):
                    return list(row)
                first_error = first_error or (number, row)
            if first_error is None:
                raise DataError(f"{self.path}: empty file, expected JSON Lines (one JSON object per line)")
            if self._starts_with("["):
                raise DataError(
                    f"{self.path}: a JSON array, not JSON Lines; write one JSON object per line "
                    "(e.g. pandas' to_json(orient='records', lines=True))"
                )
            number, error = first_error
            raise DataError(f"{self.path}: no line is a JSON object (line {number}: {error.reason})")
        except DataError:
            raise
        except Exception as exc:  # csv / pyarrow / gzip errors: one readable line
            raise self._read_failure(exc) from None

    def _no_repeats(self, header: list[str]) -> list[str]:
        # A repeated name would silently read one of the columns (which one depends on the format).
        duplicated = sorted({c for c in header if header.count(c) > 1})
        if duplicated:
            raise DataError(f"{self.path}: the header repeats column {', '.join(duplicated)}")
        return header

    def _read_failure(self, exc: Exception, after: int = 0) -> DataError:
        """One line for an error of the decompressor, the decoder or pyarrow (`after`: the last row
        read before it, 0 for none)."""
        suffix = self.path.suffix.lower()
        kind = suffix[1:]
        where = f" after row {after}" if after else ""
        # pyarrow's messages may span lines and carry control bytes
        detail = " ".join("".join(c if c.isprintable() else " " for c in str(exc)).split())
        if suffix in _OPENERS and isinstance(exc, EOFError):
            return DataError(
                f"{self.path}: the {kind} data ends early: the file is truncated{where} (an interrupted "
                "download or copy?)"
            )
        # bz2 says "Invalid data stream" with a plain OSError; a PermissionError is not that.
        if suffix in _OPENERS and (
            isinstance(exc, gzip.BadGzipFile | lzma.LZMAError | zlib.error)
            or (suffix == ".bz2" and type(exc) is OSError)
        ):
            with open(self.path, "rb") as f:
                if not f.read(8).startswith(_COMPRESSED_MAGIC[suffix]):
                    return DataError(
                        f"{self.path}: not {kind}-compressed data, though its name ends in {suffix}"
                    )
            return DataError(
                f"{self.path}: damaged {kind} data{where} ({detail}): the file is corrupt; copy or download "
                "it again"
            )
        if isinstance(exc, UnicodeDecodeError):  # UTF-16/32 (by its byte-order mark) cut mid-character
            return DataError(
                f"{self.path}: not valid {exc.encoding} text{where} ({exc.reason}): the file is truncated or "
                "is not in the encoding its byte-order mark names"
            )
        return DataError(f"{self.path}: cannot read as {self.format}{where}: {type(exc).__name__}: {detail}")

    def _starts_with(self, char: str) -> bool:
        with _open_text(self.path) as f:
            return f.read(_SNIFF_BYTES).lstrip().startswith(char)

    def _check_header(self) -> None:
        """Column names with undecodable bytes (a Latin-1 or Windows-1252 header) match no expected
        column, and the "missing column" that would follow blames the wrong thing."""
        for i, column in enumerate(self.columns):
            if isinstance(column, str) and clean_text(column) != column:
                shown = clean_text(column)
                raise DataError(
                    f"{self.path}: not UTF-8 text: column {i + 1} of the header ({shown!r}) has bytes "
                    "that are not UTF-8 (Latin-1 or Windows-1252 text?); save the file as UTF-8"
                )

    def rows(self) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
        read = {"csv": self._csv_rows, "parquet": self._parquet_rows, "jsonl": self._jsonl_rows}
        last = 0
        try:
            for last, row in read[self.format]():
                yield last, row
        except (DataError, GeneratorExit):
            raise
        except Exception as exc:  # csv / pyarrow / gzip errors: one readable line
            raise self._read_failure(exc, last) from None

    def _csv_rows(self) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
        # The stdlib reader streams one record at a time (6x faster than pandas' chunks here) and,
        # unlike pandas' C parser, lets a row with the wrong number of cells be one counted row error
        # instead of aborting the file. Cells stay text: "" stays "", JSON text stays JSON text.
        number = 0
        with _open_text(self.path, newline="") as f:
            reader = _csv_reader(f)
            header = next(reader, None) or []
            width = len(header)
            try:
                for cells in reader:
                    if not cells:  # a blank line
                        continue
                    number += 1
                    if len(cells) == width:
                        yield number, dict(zip(header, cells, strict=True))
                        continue
                    counts = f"{len(cells)} cells, the header has {width}"
                    if len(cells) < width:
                        yield number, RowError(header[len(cells)], f"no cell ({counts})", reader.line_num)
                    else:
                        yield number, RowError("(line)", f"extra cells ({counts})", reader.line_num)
            except csv.Error as exc:
                raise DataError(
                    f"{self.path}: broken CSV quoting after row {number} (line {reader.line_num}): {exc}; "
                    "the rows after it cannot be told apart, so this cannot be skipped"
                ) from None

    def _parquet_rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        import pyarrow.parquet as pq

        number = 0
        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=CHUNK_ROWS):
            for record in batch.to_pylist():
                number += 1
                yield number, record

    def _jsonl_rows(self) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
        with _open_text(self.path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = load_json(line, "(line)", "not valid JSON", _ROW_DECODER)
                except RowError as exc:
                    yield number, exc
                    continue
                if not isinstance(row, dict):
                    yield number, RowError("(line)", f"expected a JSON object, got {type(row).__name__}")
                    continue
                yield number, row


_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_COMPRESSED_MAGIC = {".gz": b"\x1f\x8b", ".bz2": b"BZh", ".xz": b"\xfd7zXZ\x00"}


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json.loads keeps the last of a repeated key)."""
    row = dict(pairs)
    if len(row) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(f"an object repeats the key {clean_text(key)!r}")
            seen.add(key)
    return row


# json.loads(line, object_pairs_hook=...) would build a decoder per line (3x slower)
_ROW_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)
_CELL_DECODER = json.JSONDecoder()


def load_json(text: str, column: str, what: str, decoder: json.JSONDecoder = _CELL_DECODER) -> Any:
    """`json.loads` of a cell or a line, or a `RowError` naming `column` and saying `what` it is not
    (malformed, nested too deeply for Python's parser, or a number of more digits than it converts)."""
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as exc:
        raise RowError(column, f"{what}: {exc.msg} at char {exc.pos}") from None
    except _RepeatedKey as exc:  # valid JSON, but which of the two values is meant?
        raise RowError(column, str(exc)) from None
    except RecursionError:
        raise RowError(column, f"{what}: nested too deeply") from None
    except ValueError:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        digits = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise RowError(column, f"{what}: a number of more than {digits} digits") from None


# Byte-order marks, longest first: UTF-32 LE starts with the UTF-16 LE mark. Python's "utf-16" and
# "utf-32" codecs read the mark, pick the byte order from it and drop it; "utf-8-sig" drops its own.
_BOMS = (
    (b"\xff\xfe\x00\x00", "utf-32", "UTF-32"),
    (b"\x00\x00\xfe\xff", "utf-32", "UTF-32"),
    (b"\xef\xbb\xbf", "utf-8-sig", "UTF-8"),
    (b"\xff\xfe", "utf-16", "UTF-16"),
    (b"\xfe\xff", "utf-16", "UTF-16"),
)
# What a file that is not text at all starts with, so the message can say what it is.
_MAGIC = (
    (b"\x1f\x8b", "gzip-compressed (name it .gz)"),
    (b"BZh", "bzip2-compressed (name it .bz2)"),
    (b"\xfd7zXZ\x00", "xz-compressed (name it .xz)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed (decompress it, or recompress it as .gz)"),
    (b"PAR1", "a Parquet file (name it .parquet)"),
    (b"PK\x03\x04", "a ZIP archive (an Excel .xlsx? export it as CSV)"),
)
_SNIFF_BYTES = 4096


def _text_encoding(path: Path, head: bytes) -> str:
    """The codec for a text data file from its first bytes: its byte-order mark, else UTF-8.

    Without a mark, a NUL byte means the file is not UTF-8 text (UTF-16/32 without a mark, or
    binary): read as UTF-8 it would become a header of garbage names and rows of nonsense, and those
    names, full of undecodable bytes, are what once broke the log file with pages of "Logging error".
    """
    for bom, codec, _name in _BOMS:
        if head.startswith(bom):
            return codec
    nul = head.find(b"\x00")
    if nul < 0:
        return "utf-8"
    for magic, what in _MAGIC:
        if head.startswith(magic):
            raise DataError(f"{path}: not a text file: it is {what}")
    raise DataError(
        f"{path}: not UTF-8 text (a NUL byte at byte {nul}: UTF-16 or UTF-32 without a byte-order mark, "
        "or a binary file); save it as UTF-8"
    )


def _open_text(path: Path, newline: str | None = None):
    """A text stream of a (possibly compressed) file in the encoding its byte-order mark names
    (UTF-8, UTF-16 or UTF-32; UTF-8 without one). Undecodable bytes become lone surrogates, which
    `clean_text` replaces, so one bad byte costs one character, not the file."""
    suffix = path.suffix.lower()
    if suffix == ".zst":
        raise DataError(f"{path}: zstd-compressed files are not supported; decompress it or use .gz")
    opener = _OPENERS.get(suffix, open)
    raw = opener(path, "rb")
    try:
        # peek: the stream must still start at byte 0, so the mark is read (and dropped) by the codec.
        # It returns what one read buffered, at least one byte unless the file is empty.
        encoding = _text_encoding(path, raw.peek(_SNIFF_BYTES)[:_SNIFF_BYTES])
    except BaseException:
        raw.close()
        raise
    return io.TextIOWrapper(raw, encoding=encoding, errors="surrogateescape", newline=newline)


def _csv_reader(f):
    # strict: a quote left open is an error, not a cell that silently swallows the rest of the file.
    csv.field_size_limit(sys.maxsize)  # arena answers can exceed the default 128 KiB per cell
    return csv.reader(f, strict=True)


def clean_text(text: str) -> str:
    """Replace lone UTF-16 surrogates (real arena files contain them; Rust tokenizers reject them)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
