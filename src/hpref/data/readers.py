"""The `arena`, `pairwise` and `chat` readers: user files -> `Battle` records, streamed in chunks.

All read CSV, Parquet and JSON Lines (optionally .gz / .bz2 / .xz compressed) as a stream
(`hpref.data.tables`), so a 200 MB file is never held in memory, let alone twice. Row numbers in
messages are 1-based data rows: CSV records after the header (blank
lines are not rows; a quoted cell may span lines, so a CSV message also names the file line),
Parquet rows, JSONL lines (blank lines are not rows). "Columns" of a JSONL file are the keys of its
first row; a later row that lacks one is a row error, and so is a line whose object repeats a key
(JSON parsers silently keep one of the two values). A CSV or Parquet header that repeats a column is
a file error. A CSV row with fewer or more cells than the header is a row error too (skippable);
broken quoting (a quote left open to the end of the file) is a file error naming the line, since no
parser can tell where the rows after it start.

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
chat      supervised fine-tuning data: a `messages` column (TRL's conversational format) whose last
          message is the assistant's answer to learn; both sides of the unlabelled battle are it
          (`hpref.rl.warmup.data`, the warm-up on a user's own answers).

Every reader's `path` may also be data as TRL and verl users hold it (`DatasetTable`): a `datasets`
`save_to_disk` folder (a `Dataset`, or a `DatasetDict` and its `hf_split`), or a Hugging Face dataset
name (`owner/name`, with `subset` and `hf_split`) read offline from the local `datasets` cache: no
download at run time, and a name not in the cache is one line saying so. Rows are the dataset's,
numbered from 1; the dataset's fingerprint is the data's identity.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import Field

from hpref.data.base import BattleSource, DatasetConfig, RowError, file_digest
from hpref.data.records import Battle, Probs
from hpref.data.tables import Format, TableFile, clean_text, detect_format, is_missing, load_json
from hpref.data.transcripts import parse_hh_transcript, parse_messages, to_turns
from hpref.errors import DataError

ARENA_TEXT_COLUMNS = ("prompt", "response_a", "response_b")
ARENA_LABEL_COLUMNS = ("winner_model_a", "winner_model_b", "winner_tie")
ARENA_TRUTH_COLUMNS = ("p_a", "p_b", "p_tie")
LABEL_SUM_TOLERANCE = 1e-3


# --------------------------------------------------------------------------------------------------
# arena


def parse_turns(value: Any, column: str) -> list[str]:
    """A JSON list of turns (or a native list) -> list of strings; `null` turns become ""."""
    if is_missing(value):
        raise RowError(column, "missing value")
    if isinstance(value, str):
        if not value.strip():
            raise RowError(column, 'empty cell, expected a JSON list of strings like ["..."]')
        value = load_json(value, column, "not a JSON list")
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
        if is_missing(value) or (isinstance(value, str) and not value.strip()):
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
    path: str = Field(
        description="data file (CSV, Parquet or JSONL; .gz allowed), a `datasets` save_to_disk folder, "
        "or a Hugging Face dataset name (owner/name) in the local datasets cache (read offline)"
    )
    format: Format = Field("auto", description="file format; auto = from the file name")
    subset: str | None = Field(
        None, description="a Hugging Face dataset name's configuration (load_dataset's `name`)"
    )
    hf_split: str = Field(
        "train", description="the split of a Hugging Face dataset name or of a saved DatasetDict folder"
    )


class ArenaConfig(FileConfig):
    pass


#: a Hugging Face dataset id: `name` or `owner/name` (what `load_dataset` takes for a Hub dataset)
_DATASET_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
#: what `save_to_disk` writes: a Dataset's folder, or a DatasetDict's
_SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
#: names that are files, never dataset ids: a missing `data.csv` stays a missing file
_TABLE_SUFFIXES = (".csv", ".parquet", ".pq", ".jsonl", ".json", ".ndjson", ".gz", ".bz2", ".xz", ".zst")


def is_dataset_reference(path: str | Path) -> bool:
    """Whether `path` is data `DatasetTable` reads: a `save_to_disk` folder, or, when no such file
    or folder exists, a Hugging Face dataset id."""
    local = Path(path).expanduser()
    if local.is_dir():
        return any((local / name).is_file() for name in _SAVED_DATASET_FILES)
    if local.exists() or local.suffix.lower() in _TABLE_SUFFIXES:
        return False
    return bool(_DATASET_NAME.fullmatch(str(path)))


@contextlib.contextmanager
def _hub_offline():
    """`datasets` and `huggingface_hub` offline for one load, whatever the process set (both read
    their switch at import): a name resolves to the local cache or fails, never downloads."""
    import datasets
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield datasets
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


class DatasetTable:
    """A `datasets` dataset as a table (what `TableFile` is for a file): `source` for messages,
    `columns`, `rows()` as `(row_number, dict)` from 1, and `identity`, the dataset's fingerprint."""

    def __init__(self, path: str, subset: str | None = None, split: str = "train") -> None:
        local = Path(path).expanduser()
        with _hub_offline() as datasets:
            if local.is_dir():
                self.source = str(local)
                try:
                    loaded = datasets.load_from_disk(str(local))
                except (OSError, ValueError) as exc:  # a folder save_to_disk did not finish
                    detail = " ".join(str(exc).split())
                    raise DataError(
                        f"{local}: not a readable datasets save_to_disk folder ({detail})"
                    ) from None
            else:
                self.source = path + (f" ({subset})" if subset else "") + f" [{split}]"
                loaded = self._load_cached(datasets, path, subset, split)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(
                    f"{self.source}: no split '{split}' (hf_split); it has {', '.join(loaded) or 'none'}"
                )
            loaded = loaded[split]
            self.source = f"{self.source} [{split}]"
        self.dataset = loaded
        self.columns: list[str] = list(loaded.column_names)
        self.identity = f"datasets:{loaded._fingerprint}"

    def _load_cached(self, datasets: Any, name: str, subset: str | None, split: str) -> Any:
        try:
            return datasets.load_dataset(name, subset, split=split)
        except (ConnectionError, FileNotFoundError) as exc:  # offline, and not in the cache
            raise DataError(
                f"{name}: no such data file or folder, and no dataset of that name in the local "
                f"Hugging Face cache ({datasets.config.HF_DATASETS_CACHE}); hpref reads datasets "
                f"offline: run datasets.load_dataset({name!r}) once where the Hub is reachable "
                f"({type(exc).__name__})"
            ) from None
        except ValueError as exc:  # a split or configuration the cached dataset does not have
            raise DataError(f"{self.source}: {' '.join(str(exc).split())}") from None

    def rows(self) -> Iterator[tuple[int, Any]]:
        yield from enumerate(self.dataset, start=1)


def open_table(
    path: str | Path, fmt: Format = "auto", subset: str | None = None, split: str = "train"
) -> TableFile | DatasetTable:
    """The table at `path`: a file (`TableFile`), or with `fmt = "auto"` a `datasets` folder or name
    (`DatasetTable`). What every reader of a user's table opens it with."""
    if fmt == "auto" and is_dataset_reference(path):
        return DatasetTable(str(path), subset, split)
    return TableFile(path, fmt)


def table_source(table: TableFile | DatasetTable) -> str:
    """How messages name the table: the file's path, or the dataset's folder or name and split."""
    return table.source if isinstance(table, DatasetTable) else str(table.path)


class TableReader(BattleSource):
    """A reader of one table (`FileConfig`): a file's rows in file order and its bytes as the data's
    identity, or a `datasets` dataset's rows and fingerprint (`DatasetTable`), and one message for
    columns it needs and the table lacks."""

    def __init__(self, config: FileConfig, seed: int) -> None:
        self.file = open_table(config.path, config.format, config.subset, config.hf_split)
        super().__init__(config, seed, table_source(self.file))

    def require_columns(self, needed: Iterable[str]) -> None:
        missing = [c for c in needed if c not in self.file.columns]
        if missing:
            raise DataError(
                f"{self.source}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                f"(found: {', '.join(self.file.columns) or 'none'})"
            )

    def _rows(self):
        return self.file.rows()

    def _data_identity(self) -> str:
        if isinstance(self.file, DatasetTable):
            return self.file.identity
        return file_digest(self.file.path)


class ArenaReader(TableReader):
    """Arena-schema battles from a CSV, Parquet or JSONL file (see module docstring)."""

    def __init__(self, config: ArenaConfig, seed: int) -> None:
        super().__init__(config, seed)
        self.require_columns(ARENA_TEXT_COLUMNS)
        columns = set(self.file.columns)
        label_present = [c for c in ARENA_LABEL_COLUMNS if c in columns]
        if label_present and len(label_present) < 3:
            absent = [c for c in ARENA_LABEL_COLUMNS if c not in columns]
            raise DataError(
                f"{self.source}: has {', '.join(label_present)} but not {', '.join(absent)}; "
                "a labeled file needs all three winner columns, a test file none"
            )
        self.labeled = bool(label_present)
        self.has_truth = all(c in columns for c in ARENA_TRUTH_COLUMNS)

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
    if is_missing(value):
        return None
    text = clean_text(str(value)).strip()  # an id or model name with undecodable bytes, too
    return text or None


def _content_id(row: dict[str, Any]) -> str:
    # Rows without an id get a content hash: stable across runs and independent of the row order.
    return hashlib.blake2b(json.dumps(row, sort_keys=True, default=str).encode(), digest_size=6).hexdigest()


# --------------------------------------------------------------------------------------------------
# pairwise


class PairwiseConfig(FileConfig):
    prompt_column: str = Field("prompt", description="prompt column (TRL prompt/chosen/rejected); optional")
    chosen_column: str = Field("chosen", description="the preferred side")
    rejected_column: str = Field("rejected", description="the other side")


class PairwiseReader(TableReader):
    """Chosen/rejected pairs as two-way battles with a seeded random A/B side (see module docstring)."""

    def __init__(self, config: PairwiseConfig, seed: int) -> None:
        super().__init__(config, seed)
        self.require_columns((config.chosen_column, config.rejected_column))

    def _rows(self):
        # The coin uses the row number, so it does not move when other rows are skipped or filtered.
        for number, row in self.file.rows():
            if isinstance(row, dict):
                row = {**row, "\0row": number}
            yield number, row

    def _data_identity(self) -> str:
        return f"{super()._data_identity()}:coin-seed={self.seed}"

    def _stratum(self, battle: Battle) -> Probs:
        # Every pair is "chosen wins" before the coin; stratifying by the coin's A/B label would tie
        # the folds to the run seed (seed 0 and seed 1 shared only 40% of their HH-RLHF eval fold).
        return (1.0, 0.0, 0.0)

    def _side(self, row: dict[str, Any], column: str, prompt: list[tuple[str, str]] | None):
        if column not in row:
            raise RowError(column, "missing column")
        value = row[column]
        if is_missing(value):
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
        if not is_missing(row.get(config.prompt_column)):  # per row: JSONL rows may differ
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
# chat


class ChatConfig(FileConfig):
    messages_column: str = Field("messages", description="the conversation: a message list (JSON or native)")


class ChatReader(TableReader):
    """Conversations that end with the answer to learn (supervised fine-tuning data): each row one
    unlabelled battle whose two sides are the same, the last assistant message its final answer."""

    def __init__(self, config: ChatConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        self.require_columns((config.messages_column,))

    def _parse(self, row: dict[str, Any]) -> Battle:
        column = self.config.messages_column
        if column not in row or is_missing(row[column]):
            raise RowError(column, "missing value")
        messages = parse_messages(row[column], column)
        if not messages or messages[-1][0] != "assistant" or not messages[-1][1].strip():
            raise RowError(column, "does not end with an assistant message (the answer to learn)")
        users, answers = to_turns(messages)
        row_id = _text_or_none(row.get("id")) or str(_content_id(row))
        return Battle(row_id, tuple(users), tuple(answers), tuple(answers))


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
