"""Bad input at scale for the readers `hpref train` and `hpref rl` read user files with: arena battles
(Kaggle LMSYS schema), chosen/rejected pairs, RL prompt files and chat warm-up files, written as CSV,
JSONL or Parquet, optionally gzip / bz2 / xz compressed, then damaged.

Each example draws rows that are mostly well formed, corrupts some cells (JSON lists of numbers,
nested lists, dicts, null; malformed JSON; 300 KB fields; nesting 5000 deep; 5000-digit numbers;
lone surrogates), drops, adds or repeats columns, writes the table in a drawn format and encoding
(UTF-8 with or without a byte-order mark, UTF-16/32, UTF-16 without a mark, Latin-1, Windows-1252)
and may then damage the bytes (truncated, a byte flipped, invalid UTF-8 / NUL bytes inserted,
garbage after the compressed stream, an empty file). Every read must end in battles whose text is
valid Unicode, or in hpref's one-line `UserError` naming the file (and the row and column for a
bad row) — never another exception, a multi-line message, a silently dropped row, or a hang.
Examples are derandomized: the suite tries the same inputs on every run.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import itertools
import json
import lzma
import math
import re
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.fuzzing import time_bound

from hpref.builtin.prompts import (
    ArenaPromptsConfig,
    FilePromptsConfig,
    PairwisePromptsConfig,
    build_arena,
    build_file,
    build_pairwise,
)
from hpref.data.prompts import PromptFileConfig, PromptFileReader
from hpref.data.readers import (
    ArenaConfig,
    ArenaReader,
    ChatConfig,
    ChatReader,
    PairwiseConfig,
    PairwiseReader,
)
from hpref.data.records import Battle
from hpref.errors import UserError

EXAMPLES = 125  # per reader kind; four kinds
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=5),
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
#: an example that takes longer than this is a hang (the deadline only fires after it returns)
HANG_SECONDS = 30

# -- cell values -----------------------------------------------------------------------------------

text = st.text(max_size=12) | st.sampled_from(["\udcff", "caf\xe9 \u2713", "\r", '"', ",", "\x00", "a\nb"])
#: text a well-formed row has (a prompt or answer with something in it)
words = st.sampled_from(["hi", "What is 2+2?", "4", "caf\xe9 \u2713 \U0001f600", 'a,b\n"c"']) | st.text(
    min_size=1, max_size=12
).map(lambda t: "w" + t)
scalar = st.none() | st.booleans() | st.integers() | st.floats() | text
json_value = st.recursive(
    scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=6
)
HUGE = "x" * 300_000
#: values that broke (or could break) a parser: empty, wrong JSON types, 300 KB, deep, long numbers
NASTY = [
    "",
    " ",
    "null",
    "[]",
    "[null]",
    "[1, 2]",
    '[["a"]]',
    '{"role": "user"}',
    "NaN",
    "[oops",
    '"x"',
    '["\\udcff"]',
    json.dumps([HUGE]),
    HUGE,
    "[" * 5000,
    "[" * 3000 + "]" * 3000,
    "[" + "9" * 5000 + "]",
    '[{"role": "user", "content": ' + "9" * 5000 + "}]",
    10**30,
    math.nan,
    math.inf,
    [HUGE],
]
bad_cell = st.one_of(
    json_value,  # native: a number, a dict, a nested list, null in a text column
    json_value.map(lambda v: json.dumps(v)),  # the same as JSON text (the arena's encoding)
    text,
    st.sampled_from(NASTY),
)

roles = st.sampled_from(["user", "assistant", "system", "human", "gpt"]) | st.sampled_from(
    ["wizard", 3, None, ["user"], "\udcff"]
)


@st.composite
def messages(draw, *, end: str = "user"):
    """A message list, mostly well formed (alternating turns ending with `end`)."""
    n = draw(st.integers(1, 3))
    out = []
    for i in range(n):
        role = ["user", "assistant"][(i + (n % 2 == 0) + (end == "assistant")) % 2]
        out.append({"role": role, "content": draw(words)})
    if draw(st.integers(0, 5)) == 0:  # one broken message
        broken = st.fixed_dictionaries({"role": roles, "content": json_value}) | json_value
        out[draw(st.integers(0, n - 1))] = draw(broken)
    return out


def as_cell(draw, value):
    """A native value, or its JSON text (how CSV and the arena schema carry lists)."""
    return json.dumps(value) if draw(st.booleans()) else value


@st.composite
def arena_row(draw):
    turns = draw(st.integers(1, 2))
    row = {"id": draw(text | st.integers()), "model_a": draw(text), "model_b": draw(text)}
    for column in ("prompt", "response_a", "response_b"):
        row[column] = as_cell(draw, draw(st.lists(words | text | st.none(), min_size=turns, max_size=turns)))
    winner = draw(st.sampled_from([(1, 0, 0), (0, 1, 0), (0, 0, 1), (0.5, 0.25, 0.25)]))
    row.update(zip(("winner_model_a", "winner_model_b", "winner_tie"), winner, strict=True))
    if draw(st.booleans()):
        row.update(p_a=0.5, p_b=0.3, p_tie=0.2)
    return row


@st.composite
def pairwise_row(draw):
    users = draw(st.lists(words, min_size=1, max_size=2))
    form = draw(st.sampled_from(["hh", "messages", "prompt"]))
    row = {"id": draw(text)}
    for side in ("chosen", "rejected"):
        answers = [draw(words | text) for _ in users]
        if form == "hh":
            row[side] = "".join(
                f"\n\nHuman: {u}\n\nAssistant: {a}" for u, a in zip(users, answers, strict=True)
            )
        elif form == "messages":
            conversation = [
                m for u, a in zip(users, answers, strict=True) for m in (("user", u), ("assistant", a))
            ]
            row[side] = as_cell(draw, [{"role": r, "content": c} for r, c in conversation])
        else:
            row[side] = answers[-1]
    if form == "prompt":
        row["prompt"] = users[-1]
    return row


@st.composite
def prompt_row(draw):
    if draw(st.booleans()):
        return {"prompt": draw(words | messages().map(json.dumps)), "answer": draw(text)}
    return {"messages": as_cell(draw, draw(messages())), "id": draw(text)}


@st.composite
def chat_row(draw):
    return {"messages": as_cell(draw, draw(messages(end="assistant"))), "id": draw(text)}


def read_arena(path, on_error):
    return ArenaReader(ArenaConfig(path=str(path), on_error=on_error), 0)


def read_pairwise(path, on_error):
    return PairwiseReader(PairwiseConfig(path=str(path), on_error=on_error), 0)


def read_prompts(path, on_error):
    return PromptFileReader(PromptFileConfig(path=str(path), on_error=on_error))


def read_chat(path, on_error):
    return ChatReader(ChatConfig(path=str(path), on_error=on_error))


RL = {"max_prompt_chars": None, "eval_fraction": 0.0, "on_error": "skip"}
#: kind -> (row strategy, the reader, `hpref rl`'s prompt source over the same file or None)
KINDS = {
    "arena": (arena_row(), read_arena, lambda p: build_arena(ArenaPromptsConfig(path=str(p), **RL))),
    "pairwise": (
        pairwise_row(),
        read_pairwise,
        lambda p: build_pairwise(PairwisePromptsConfig(path=str(p), **RL)),
    ),
    "prompts": (prompt_row(), read_prompts, lambda p: build_file(FilePromptsConfig(path=str(p), **RL))),
    "chat": (chat_row(), read_chat, None),
}

# -- tables -> bytes -------------------------------------------------------------------------------


@st.composite
def table(draw, row_strategy):
    """(column names, rows as lists of cells): drawn rows with columns dropped, added or repeated,
    some cells replaced by bad ones, and (CSV only) rows with a cell too few or too many."""
    rows = draw(st.lists(row_strategy, min_size=1, max_size=4))
    names = list(dict.fromkeys(c for row in rows for c in row)) or ["prompt"]
    change = draw(st.sampled_from(["none", "none", "none", "drop", "extra", "repeat"]))
    if change == "drop":
        names.pop(draw(st.integers(0, len(names) - 1)))
    elif change == "extra":
        names.append(draw(st.sampled_from(["extra", "\udcffid", "Prompt", ""])))
    elif change == "repeat":
        names.append(draw(st.sampled_from(names)))
    cells = [[row.get(c) for c in names] for row in rows]
    for row in cells:
        if draw(st.integers(0, 2)) == 0:  # a third of the rows has a bad cell
            row[draw(st.integers(0, len(row) - 1))] = draw(bad_cell)
    if cells and draw(st.integers(0, 2)) == 0:  # and the nastiest values more often than their share
        row = draw(st.sampled_from(cells))
        row[draw(st.integers(0, len(row) - 1))] = draw(st.sampled_from(NASTY))
    return names, cells


def csv_text(names, rows, ragged: bool) -> str:
    def cell(value):
        if value is None:
            return ""
        return value if isinstance(value, str) else json.dumps(value)

    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(names)
    for i, row in enumerate(rows):
        row = [cell(v) for v in row]
        if ragged and i == 0:
            row = row[:-1] if len(row) > 1 else [*row, "more"]
        writer.writerow(row)
    return out.getvalue()


def jsonl_text(names, rows) -> str:
    # by hand, so that a repeated column is a repeated key
    return "".join(
        "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in zip(names, r, strict=True)) + "}\n"
        for r in rows
    )


def parquet_bytes(names, rows) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def as_text(value):
        if value is None:
            return None
        value = value if isinstance(value, str) else json.dumps(value)
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")

    def write(arrays) -> bytes:
        out = io.BytesIO()
        pq.write_table(pa.Table.from_arrays(arrays, names=[as_text(n) for n in names]), out)
        return out.getvalue()

    def text_column(column):
        return pa.array([as_text(v) for v in column], type=pa.string())

    arrays = []
    for i in range(len(names)):
        column = [row[i] for row in rows]
        try:  # native values where Arrow can type the column (lists, structs, numbers)
            arrays.append(pa.array(column))
        except (pa.ArrowException, ValueError, TypeError, OverflowError, UnicodeError):
            arrays.append(text_column(column))
    try:
        return write(arrays)
    except pa.ArrowException:  # a type Parquet cannot store (a struct of no fields): all as text
        return write([text_column([row[i] for row in rows]) for i in range(len(names))])


ENCODINGS = ["utf-8", "utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-32", "utf-16-le", "latin-1", "cp1252"]
COMPRESSORS = {"": None, ".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}
#: compressed text files are common; a compressed Parquet file is refused, so seldom drawn
SUFFIXES = {"text": ["", "", "", ".gz", ".gz", ".bz2", ".xz"], "parquet": ["", "", "", "", "", ".gz"]}


@st.composite
def data_file(draw, row_strategy):
    """(file name, bytes, rows written, whether the bytes are intact): a table in a drawn format,
    encoding and compression, maybe damaged."""
    names, rows = draw(table(row_strategy))
    fmt = draw(st.sampled_from(["csv", "jsonl", "parquet"]))
    ragged = fmt == "csv" and bool(rows) and draw(st.integers(0, 5)) == 0
    if fmt == "parquet":
        data = parquet_bytes(names, rows)
    else:
        body = csv_text(names, rows, ragged) if fmt == "csv" else jsonl_text(names, rows)
        encoding = draw(st.sampled_from(ENCODINGS))
        data = body.encode(encoding, "replace" if encoding in ("latin-1", "cp1252") else "surrogatepass")
    damage = draw(st.sampled_from(["none"] * 8 + ["empty", "truncate", "flip", "insert"]))
    at = draw(st.integers(0, 1000)) * len(data) // 1000
    if damage == "empty":
        data = b""
    elif damage == "truncate":
        data = data[:at]
    elif damage == "flip" and data:
        data = data[: min(at, len(data) - 1)] + bytes([data[min(at, len(data) - 1)] ^ 0xFF]) + data[at + 1 :]
    elif damage == "insert":
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3(", b"\x00", b"\xed\xa0\x80"])) + data[at:]
    suffix = draw(st.sampled_from(SUFFIXES["parquet" if fmt == "parquet" else "text"]))
    if suffix:
        data = COMPRESSORS[suffix](data)
        after = draw(st.sampled_from(["none", "none", "truncate", "flip", "garbage"]))
        cut = draw(st.integers(0, 1000)) * len(data) // 1000
        if after == "truncate":
            data = data[:cut]
        elif after == "flip":
            cut = min(cut, len(data) - 1)
            data = data[:cut] + bytes([data[cut] ^ 0x55]) + data[cut + 1 :]
        elif after == "garbage":
            data += b"trailing garbage"
        damage = damage if after == "none" else after
    intact = damage == "none" and not ragged
    return (
        f"{fmt}{'.json' if fmt == 'jsonl' and draw(st.booleans()) else '.' + fmt}{suffix}",
        data,
        rows,
        intact,
    )


# -- what every outcome must be --------------------------------------------------------------------


def utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_refusal(exc: UserError, path) -> str:
    """hpref's refusal: one line, valid Unicode, naming the file; a row error names row and column."""
    message = str(exc)
    assert message.startswith(f"{path}: "), message
    assert "\n" not in message and "\r" not in message and utf8(message), repr(message)
    if "on_error" in message:  # a row error
        assert re.search(r": row \d+( \(line \d+\))?, column '[^']*': \S", message), message
    return message


def check_battle(battle: Battle) -> None:
    assert isinstance(battle, Battle) and isinstance(battle.id, str) and battle.id
    texts = [battle.id, *battle.prompt, *battle.response_a, *battle.response_b]
    texts += [t for t in (battle.model_a, battle.model_b) if t is not None]
    assert all(isinstance(t, str) and utf8(t) for t in texts), battle
    assert len(battle.prompt) == len(battle.response_a) == len(battle.response_b) >= 1
    for probs in (battle.label, battle.truth):
        assert probs is None or (len(probs) == 3 and all(0 <= p <= 1 for p in probs))


def read(build, path, on_error):
    """(battles, summary) or the refusal's message."""
    try:
        reader = build(path, on_error)
        battles = list(reader.battles())
    except UserError as exc:
        return check_refusal(exc, path)
    for battle in battles:
        check_battle(battle)
    return battles, reader.summary


counter = itertools.count()


@FUZZ
@pytest.mark.parametrize("kind", list(KINDS))
@given(draw=st.data())
def test_a_damaged_file_reads_or_is_refused_in_one_line(tmp_path, kind, draw):
    """Wrong if a bad file or row let anything but hpref's own one-line refusal escape (a raw
    RecursionError, ValueError, UnicodeDecodeError, zlib.error, EOFError or pyarrow error, as the
    JSON cells nested 5000 deep, 5000-digit numbers and damaged compressed files once did); if a
    message lost the file, the row or the column; if a battle carried undecodable bytes; or if
    `on_error = "skip"` and "raise" disagreed on which rows are bad (a row dropped without being
    counted). `hpref rl`'s prompt source over the same file must end the same way."""
    rows_strategy, build, prompt_source = KINDS[kind]
    name, data, rows, intact = draw.draw(data_file(rows_strategy), label="file")
    path = tmp_path / f"{next(counter)}-{name}"
    path.write_bytes(data)
    with time_bound(HANG_SECONDS, "an example"):
        strict = read(build, path, "raise")
        lenient = read(build, path, "skip")
        if prompt_source is not None:
            try:
                prompt_source(path)
            except UserError as exc:
                check_refusal(exc, path)
    if isinstance(lenient, str):  # a file-level refusal: never a row error under "skip"
        assert "on_error" not in lenient, lenient
        assert isinstance(strict, str), (strict, lenient)
        return
    battles, summary = lenient
    assert summary.complete and summary.rows_used == len(battles)
    assert summary.rows_used + summary.rows_skipped + summary.rows_other_split == summary.rows_read
    assert sum(summary.skipped.values()) == summary.rows_skipped
    if intact:  # every written row was read: used or counted as skipped
        assert summary.rows_read == len(rows), (summary, len(rows))
    if isinstance(strict, str):
        assert summary.rows_skipped > 0 or "on_error" not in strict, (strict, str(summary))
    else:
        assert strict[0] == battles and summary.rows_skipped == 0, str(summary)


# -- what the fuzz found, kept explicit ------------------------------------------------------------


def _parquet(columns: dict[str, list], names: list[str] | None = None) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    arrays = [pa.array(v) for v in columns.values()]
    pq.write_table(pa.Table.from_arrays(arrays, names=names or list(columns)), out)
    return out.getvalue()


ARENA_HEADER = "prompt,response_a,response_b\n"
GOOD_JSONL = json.dumps({"prompt": ["q"], "response_a": ["a"], "response_b": ["b"]}) + "\n"
CSV_ROWS = (ARENA_HEADER + '"[""q""]","[""a""]","[""b""]"\n' * 3).encode()
# (name, reader, bytes, what the one-line message says)
FOUND = [
    # a raw RecursionError / ValueError escaped the reader from a CSV cell
    (
        "deep.csv",
        read_arena,
        (ARENA_HEADER + "[" * 5000 + ',"[]","[]"\n').encode(),
        "row 1, column 'prompt': not a JSON list: nested too deeply",
    ),
    (
        "digits.csv",
        read_arena,
        (ARENA_HEADER + '"[' + "9" * 5000 + ']","[]","[]"\n').encode(),
        "row 1, column 'prompt': not a JSON list: a number of more than",
    ),
    (
        "deep-pairs.csv",
        read_pairwise,
        ("chosen,rejected\n" + "[" * 5000 + ",x\n").encode(),
        "row 1, column 'chosen': not a message list: nested too deeply",
    ),
    (
        "deep-prompts.csv",
        read_prompts,
        ("prompt\n" + "[" * 5000 + "\n").encode(),
        "row 1, column 'prompt': not a message list: nested too deeply",
    ),
    # the same in a JSONL line was a file error naming no row
    (
        "deep.jsonl",
        read_arena,
        (GOOD_JSONL + "[" * 5000 + "\n").encode(),
        "row 2, column '(line)': not valid JSON: nested too deeply",
    ),
    (
        "digits.jsonl",
        read_arena,
        (GOOD_JSONL + '{"prompt": ' + "9" * 5000 + "}\n").encode(),
        "row 2, column '(line)': not valid JSON: a number of more than",
    ),
    # a repeated column was read silently (one of the two values, which one depending on the format)
    (
        "repeat.jsonl",
        read_arena,
        (GOOD_JSONL + GOOD_JSONL[:-2] + ', "prompt": ["again"]}\n').encode(),
        "row 2, column '(line)': an object repeats the key 'prompt'",
    ),
    (
        "repeat.parquet",
        read_arena,
        _parquet(
            {"p": ['["q"]'], "r": ['["a"]'], "s": ['["b"]'], "t": ['["c"]']},
            ["prompt", "response_a", "response_b", "prompt"],
        ),
        "the header repeats column prompt",
    ),
    # a damaged .gz was "not gz-compressed data"; a damaged Parquet page a message of three lines
    (
        "crc.csv.gz",
        read_arena,
        gzip.compress(CSV_ROWS)[:-8] + b"\x00" * 8,
        "damaged gz data after row 3 (CRC check failed",
    ),
    (
        "page.parquet",
        read_arena,
        (lambda b: b[:4] + b"\x00" * 4 + b[8:])(
            _parquet({"prompt": ['["q"]'], "response_a": ['["a"]'], "response_b": ['["b"]']})
        ),
        "cannot read as parquet: OSError: Couldn't deserialize thrift",
    ),
    (
        "packed.parquet.gz",
        read_arena,
        gzip.compress(_parquet({"prompt": ['["q"]']})),
        "a gz-compressed Parquet file; Parquet compresses its own data",
    ),
    # UTF-16 (by its byte-order mark) cut in the middle of a character: a raw UnicodeDecodeError text
    (
        "cut.csv",
        read_arena,
        b"\xff\xfe" + CSV_ROWS.decode().encode("utf-16-le") + b"A",
        "not valid utf-16-le text after row 3 (truncated data)",
    ),
]


@pytest.mark.parametrize(("name", "build", "data", "says"), FOUND, ids=[f[0] for f in FOUND])
def test_the_inputs_the_fuzz_found_are_one_line_refusals(tmp_path, name, build, data, says):
    """Wrong if one of the inputs that once broke a reader (a raw exception, a file error that named
    no row, a misleading cause, a message of several lines, a column read silently) did again."""
    path = tmp_path / name
    path.write_bytes(data)
    result = read(build, path, "raise")
    assert isinstance(result, str) and says in result, result


def test_an_id_or_model_name_with_undecodable_bytes_is_valid_text(tmp_path):
    """Wrong if a Latin-1 id or a JSON "\\udcff" model name reached the battle as a lone surrogate,
    which the prediction files (UTF-8) and the tokenizers cannot take: text cells were cleaned, the
    id and model names were not."""
    path = tmp_path / "ids.jsonl"
    row = (
        '{"id": "\\ud800x", "model_a": "\\udcff", "prompt": ["q"], "response_a": ["a"], "response_b": ["b"]}'
    )
    path.write_text(row + "\n")
    (battle,) = read(read_arena, path, "raise")[0]
    assert battle.id == "\ufffdx" and battle.model_a == "\ufffd"
    latin = tmp_path / "ids.csv"
    latin.write_bytes(b'id,prompt,response_a,response_b\n\xe9t\xe9,"[""q""]","[""a""]","[""b""]"\n')
    (battle,) = read(read_arena, latin, "raise")[0]
    assert battle.id == "\ufffdt\ufffd"
