"""The `arena` and `pairwise` readers: user files -> `Battle` records, streamed in chunks.

Both read CSV, Parquet and JSON Lines (optionally .gz / .bz2 / .xz compressed) as a stream — CSV
and JSONL line by line, Parquet in record batches — so a 200 MB file is never held in memory, let
alone twice. Row numbers in messages are 1-based data rows: CSV records after the header (blank
lines are not rows; a quoted cell may span lines, so a CSV message also names the file line),
Parquet rows, JSONL lines (blank lines are not rows). "Columns" of a JSONL file are the keys of its
first row; a later row that lacks one is a row error. A CSV row with fewer or more cells than the
header is a row error too (skippable); broken quoting (a quote left open to the end of the file) is
a file error naming the line, since no parser can tell where the rows after it start.

arena     Chatbot-Arena / Kaggle LMSYS: `id, model_a, model_b, prompt, response_a, response_b,
          winner_model_a, winner_model_b, winner_tie`, the text columns JSON lists with one string per
          turn (or native lists in Parquet/JSONL). `null` turns become "", empty lists and unequal
          turn counts are padded with "", so the three always have one entry per turn. Without the
          three winner columns the file is unlabeled (a test file); with them each row's labels must
          be numbers in [0, 1] summing to 1 (hard or soft). Optional `p_a, p_b, p_tie` columns (as the
          synthetic arena writes them) become `Battle.truth`.
pairwise  chosen/rejected data: HH-RLHF transcripts ("\\n\\nHuman: ...\\n\\nAssistant: ..."), TRL
          message lists (`{"chosen": [{"role", "content"}, ...], "rejected": [...]}`), or TRL
          prompt/chosen/rejected columns (strings or message lists). Which side becomes A is a seeded
          coin per row, so a model cannot learn "A is better"; labels are two-way (no tie).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import hashlib
import io
import json
import lzma
import math
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from hpref.data.base import BattleSource, DatasetConfig, RowError, file_digest
from hpref.data.records import Battle, Probs
from hpref.errors import DataError

Format = Literal["auto", "csv", "parquet", "jsonl"]

ARENA_TEXT_COLUMNS = ("prompt", "response_a", "response_b")
ARENA_LABEL_COLUMNS = ("winner_model_a", "winner_model_b", "winner_tie")
ARENA_TRUTH_COLUMNS = ("p_a", "p_b", "p_tie")
LABEL_SUM_TOLERANCE = 1e-3
CHUNK_ROWS = 2048


# --------------------------------------------------------------------------------------------------
# files


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


def _missing(value: Any) -> bool:
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
                duplicated = sorted({c for c in header if header.count(c) > 1})
                if duplicated:
                    raise DataError(f"{self.path}: the header repeats column {', '.join(duplicated)}")
                return header
            if self.format == "parquet":
                import pyarrow.parquet as pq

                return list(pq.ParquetFile(self.path).schema_arrow.names)
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

    def _read_failure(self, exc: Exception) -> DataError:
        suffix = self.path.suffix.lower()
        if suffix in _OPENERS and isinstance(exc, EOFError):
            return DataError(
                f"{self.path}: the {suffix[1:]} data ends early: the file is truncated (an interrupted "
                "download or copy?)"
            )
        # bz2 says "Invalid data stream" with a plain OSError; a PermissionError is not that.
        if isinstance(exc, gzip.BadGzipFile | lzma.LZMAError) or (suffix == ".bz2" and type(exc) is OSError):
            return DataError(
                f"{self.path}: not {suffix[1:]}-compressed data, though its name ends in {suffix}"
            )
        return DataError(f"{self.path}: cannot read as {self.format}: {type(exc).__name__}: {exc}")

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
        try:
            if self.format == "csv":
                yield from self._csv_rows()
            elif self.format == "parquet":
                yield from self._parquet_rows()
            else:
                yield from self._jsonl_rows()
        except (DataError, GeneratorExit):
            raise
        except Exception as exc:  # csv / pyarrow / gzip errors: one readable line
            raise self._read_failure(exc) from None

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
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield number, RowError("(line)", f"not valid JSON: {exc.msg} at char {exc.pos}")
                    continue
                if not isinstance(row, dict):
                    yield number, RowError("(line)", f"expected a JSON object, got {type(row).__name__}")
                    continue
                yield number, row


_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}

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


# --------------------------------------------------------------------------------------------------
# arena


def parse_turns(value: Any, column: str) -> list[str]:
    """A JSON list of turns (or a native list) -> list of strings; `null` turns become ""."""
    if _missing(value):
        raise RowError(column, "missing value")
    if isinstance(value, str):
        if not value.strip():
            raise RowError(column, 'empty cell, expected a JSON list of strings like ["..."]')
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(column, f"not a JSON list: {exc.msg} at char {exc.pos}") from None
        if isinstance(value, str):  # a JSON string: one turn
            value = [value]
        elif value is None:
            raise RowError(column, 'JSON null, expected a list of strings like ["..."]')
    if not isinstance(value, list | tuple):
        raise RowError(column, f"expected a list of strings, got {type(value).__name__}")
    turns = []
    for i, turn in enumerate(value):
        if turn is None:
            turns.append("")
        elif isinstance(turn, str):
            turns.append(clean_text(turn))
        else:
            raise RowError(column, f"turn {i} is {type(turn).__name__}, expected a string or null")
    return turns


def parse_probs(values: list[Any], columns: tuple[str, ...], what: str) -> Probs:
    """Three numbers in [0, 1] that sum to one (within tolerance; then renormalised)."""
    probs = []
    for column, value in zip(columns, values, strict=True):
        if _missing(value) or (isinstance(value, str) and not value.strip()):
            raise RowError(column, f"missing {what}")
        if isinstance(value, bool):
            value = float(value)
        try:
            p = float(value)
        except (TypeError, ValueError):
            raise RowError(column, f"{what} {value!r} is not a number") from None
        if not math.isfinite(p) or p < 0.0 or p > 1.0:
            raise RowError(column, f"{what} {value!r} is outside [0, 1]")
        probs.append(p)
    total = sum(probs)
    if abs(total - 1.0) > LABEL_SUM_TOLERANCE:
        raise RowError(",".join(columns), f"{what}s sum to {total:.6g}, expected 1")
    return (probs[0] / total, probs[1] / total, probs[2] / total)


class FileConfig(DatasetConfig):
    path: str = Field(description="data file (CSV, Parquet or JSONL; .gz allowed)")
    format: Format = Field("auto", description="file format; auto = from the file name")


class ArenaConfig(FileConfig):
    pass


class ArenaReader(BattleSource):
    """Arena-schema battles from a CSV, Parquet or JSONL file (see module docstring)."""

    def __init__(self, config: ArenaConfig, seed: int) -> None:
        self.file = TableFile(config.path, config.format)
        super().__init__(config, seed, str(self.file.path))
        columns = set(self.file.columns)
        missing = [c for c in ARENA_TEXT_COLUMNS if c not in columns]
        if missing:
            raise DataError(
                f"{self.source}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                f"(found: {', '.join(self.file.columns) or 'none'})"
            )
        label_present = [c for c in ARENA_LABEL_COLUMNS if c in columns]
        if label_present and len(label_present) < 3:
            absent = [c for c in ARENA_LABEL_COLUMNS if c not in columns]
            raise DataError(
                f"{self.source}: has {', '.join(label_present)} but not {', '.join(absent)}; "
                "a labeled file needs all three winner columns, a test file none"
            )
        self.labeled = bool(label_present)
        self.has_truth = all(c in columns for c in ARENA_TRUTH_COLUMNS)

    def _rows(self):
        return self.file.rows()

    def _data_identity(self) -> str:
        return file_digest(self.file.path)

    def _parse(self, row: dict[str, Any]) -> Battle:
        for column in ARENA_TEXT_COLUMNS:
            if column not in row:
                raise RowError(column, "missing column")
        prompt, a, b = (parse_turns(row[c], c) for c in ARENA_TEXT_COLUMNS)
        n = max(len(prompt), len(a), len(b))
        if n == 0:
            raise RowError("prompt", "no turns in prompt, response_a or response_b")
        prompt, a, b = ([*t, *[""] * (n - len(t))] for t in (prompt, a, b))
        label = None
        if self.labeled:
            for column in ARENA_LABEL_COLUMNS:
                if column not in row:
                    raise RowError(column, "missing column")
            label = parse_probs([row[c] for c in ARENA_LABEL_COLUMNS], ARENA_LABEL_COLUMNS, "label")
        truth = None
        if self.has_truth:
            truth = parse_probs([row.get(c) for c in ARENA_TRUTH_COLUMNS], ARENA_TRUTH_COLUMNS, "probability")
        return Battle(
            id=_text_or_none(row.get("id")) or str(_content_id(row)),
            prompt=tuple(prompt),
            response_a=tuple(a),
            response_b=tuple(b),
            label=label,
            model_a=_text_or_none(row.get("model_a")),
            model_b=_text_or_none(row.get("model_b")),
            truth=truth,
        )


def _text_or_none(value: Any) -> str | None:
    if _missing(value):
        return None
    text = str(value).strip()
    return text or None


def _content_id(row: dict[str, Any]) -> str:
    # Rows without an id get a content hash: stable across runs and independent of the row order.
    return hashlib.blake2b(json.dumps(row, sort_keys=True, default=str).encode(), digest_size=6).hexdigest()


# --------------------------------------------------------------------------------------------------
# pairwise

USER_ROLES = {"user", "human", "prompter"}
ASSISTANT_ROLES = {"assistant", "gpt", "bot", "model"}
HH_MARKERS = ("\n\nHuman:", "\n\nAssistant:")


def parse_hh_transcript(text: str, column: str) -> list[tuple[str, str]]:
    """`"\\n\\nHuman: hi\\n\\nAssistant: hello"` -> [("user", "hi"), ("assistant", "hello")]."""
    if text.startswith(("Human:", "Assistant:")):
        text = "\n\n" + text
    messages: list[tuple[str, str]] = []
    first = min((i for i in (text.find(m) for m in HH_MARKERS) if i >= 0), default=-1)
    if first < 0:
        raise RowError(
            column,
            "no '\\n\\nHuman:' / '\\n\\nAssistant:' markers: expected an HH-RLHF transcript, a message "
            "list, or a prompt column beside plain-string answers",
        )
    if text[:first].strip():
        raise RowError(column, "text before the first '\\n\\nHuman:' marker")
    position = first
    while position < len(text):
        marker = next(m for m in HH_MARKERS if text.startswith(m, position))
        role = "user" if marker == HH_MARKERS[0] else "assistant"
        start = position + len(marker)
        following = [i for i in (text.find(m, start) for m in HH_MARKERS) if i >= 0]
        end = min(following, default=len(text))
        messages.append((role, text[start:end].strip()))
        position = end
    return messages


def parse_messages(value: Any, column: str) -> list[tuple[str, str]]:
    """A TRL-style message list (or its JSON text) -> [(role, content), ...] with roles normalised."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(column, f"not a message list: {exc.msg} at char {exc.pos}") from None
    if not isinstance(value, list | tuple):
        raise RowError(column, f"expected a list of messages, got {type(value).__name__}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise RowError(column, f"message {i} is not an object with 'role' and 'content'")
        role = str(message["role"]).lower()
        content = message["content"]
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RowError(column, f"message {i} content is {type(content).__name__}, expected a string")
        if role in USER_ROLES:
            role = "user"
        elif role in ASSISTANT_ROLES:
            role = "assistant"
        elif role != "system":
            raise RowError(column, f"message {i} has unknown role {message['role']!r}")
        messages.append((role, clean_text(content)))
    return messages


def to_turns(messages: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Messages -> (user turns, assistant answers), one answer per user turn.

    System text is prepended to the first user turn (the record has no system field, and dropping it
    would change the task). Consecutive messages of one role are merged (HH-RLHF has a few); an
    answer before any user message gets an empty user turn.
    """
    system = [c for r, c in messages if r == "system" and c]
    users: list[str] = []
    answers: list[str] = []
    answered = True
    for role, content in messages:
        if role == "user":
            if not answered:  # a second user message before any answer: the same turn
                users[-1] = f"{users[-1]}\n\n{content}" if users[-1] else content
                continue
            users.append(content)
            answers.append("")
            answered = False
        elif role == "assistant":
            if not users:
                users.append("")
                answers.append("")
            answers[-1] = f"{answers[-1]}\n\n{content}" if answers[-1] else content
            answered = True
    if system:
        head = "\n\n".join(system)
        if users:
            users[0] = f"{head}\n\n{users[0]}" if users[0] else head
        else:
            users, answers = [head], [""]
    return users, answers


class PairwiseConfig(FileConfig):
    prompt_column: str = Field("prompt", description="prompt column (TRL prompt/chosen/rejected); optional")
    chosen_column: str = Field("chosen", description="the preferred side")
    rejected_column: str = Field("rejected", description="the other side")


class PairwiseReader(BattleSource):
    """Chosen/rejected pairs as two-way battles with a seeded random A/B side (see module docstring)."""

    def __init__(self, config: PairwiseConfig, seed: int) -> None:
        self.file = TableFile(config.path, config.format)
        super().__init__(config, seed, str(self.file.path))
        columns = set(self.file.columns)
        missing = [c for c in (config.chosen_column, config.rejected_column) if c not in columns]
        if missing:
            raise DataError(
                f"{self.source}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                f"(found: {', '.join(self.file.columns) or 'none'})"
            )

    def _rows(self):
        # The coin uses the row number, so it does not move when other rows are skipped or filtered.
        for number, row in self.file.rows():
            if isinstance(row, dict):
                row = {**row, "\0row": number}
            yield number, row

    def _data_identity(self) -> str:
        return f"{file_digest(self.file.path)}:coin-seed={self.seed}"

    def _stratum(self, battle: Battle) -> Probs:
        # Every pair is "chosen wins" before the coin; stratifying by the coin's A/B label would tie
        # the folds to the run seed (seed 0 and seed 1 shared only 40% of their HH-RLHF eval fold).
        return (1.0, 0.0, 0.0)

    def _side(self, row: dict[str, Any], column: str, prompt: list[tuple[str, str]] | None):
        if column not in row:
            raise RowError(column, "missing column")
        value = row[column]
        if _missing(value):
            raise RowError(column, "missing value")
        if isinstance(value, str) and not value.lstrip().startswith("["):
            if prompt is None:  # no prompt column: the string must be a whole transcript
                return parse_hh_transcript(clean_text(value), column)
            return [*prompt, ("assistant", clean_text(value))]
        messages = parse_messages(value, column)
        return messages if prompt is None else [*prompt, *messages]

    def _parse(self, row: dict[str, Any]) -> Battle:
        config = self.config
        prompt = None
        if not _missing(row.get(config.prompt_column)):  # per row: JSONL rows may differ
            value = row[config.prompt_column]
            if isinstance(value, str) and not value.lstrip().startswith("["):
                prompt = [("user", clean_text(value))] if value.strip() else []
            else:
                prompt = parse_messages(value, config.prompt_column)
        chosen_users, chosen = to_turns(self._side(row, config.chosen_column, prompt))
        rejected_users, rejected = to_turns(self._side(row, config.rejected_column, prompt))
        if not chosen_users:
            raise RowError(config.chosen_column, "no messages")
        if chosen_users != rejected_users:
            turn = next(
                (i for i, (u, v) in enumerate(zip(chosen_users, rejected_users, strict=False)) if u != v),
                min(len(chosen_users), len(rejected_users)),
            )
            raise RowError(
                config.rejected_column, f"its user turns differ from the chosen side's at turn {turn}"
            )
        number = row["\0row"]
        coin = hashlib.blake2b(f"{self.seed}:{number}".encode(), digest_size=1).digest()[0] & 1
        row_id = _text_or_none(row.get("id")) or str(number)
        if coin == 0:
            return Battle(row_id, tuple(chosen_users), tuple(chosen), tuple(rejected), (1.0, 0.0, 0.0))
        return Battle(row_id, tuple(chosen_users), tuple(rejected), tuple(chosen), (0.0, 1.0, 0.0))


# --------------------------------------------------------------------------------------------------
# writing


def arena_rows(battles: Iterable[Battle]) -> Iterator[dict[str, Any]]:
    """Battles as arena-schema rows (text columns JSON-encoded, `p_a, p_b, p_tie` when known)."""
    for b in battles:
        row: dict[str, Any] = {
            "id": b.id,
            "model_a": b.model_a or "",
            "model_b": b.model_b or "",
            "prompt": json.dumps(list(b.prompt), ensure_ascii=False),
            "response_a": json.dumps(list(b.response_a), ensure_ascii=False),
            "response_b": json.dumps(list(b.response_b), ensure_ascii=False),
        }
        if b.label is not None:
            row.update(zip(ARENA_LABEL_COLUMNS, b.label, strict=True))
        if b.truth is not None:
            row.update(zip(ARENA_TRUTH_COLUMNS, b.truth, strict=True))
        yield row


def write_arena_file(path: str | Path, battles: Iterable[Battle], fmt: Format = "auto") -> Path:
    """Write battles in the arena schema (CSV, Parquet or JSONL by extension), e.g. to export the
    synthetic arena for other tools; `ArenaReader` reads it back, truth included."""
    import pandas as pd

    path = Path(path)
    kind = detect_format(path, fmt)
    frame = pd.DataFrame(list(arena_rows(battles)))
    if kind == "csv":
        frame.to_csv(path, index=False)
    elif kind == "parquet":
        frame.to_parquet(path, index=False)
    else:
        frame.to_json(path, orient="records", lines=True, force_ascii=False)
    return path
