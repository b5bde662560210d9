"""Hypothesis against the readers: round trips through every format, and garbage that must end in
a battle or a DataError — never another exception. Cases that broke the readers are kept as
explicit tests at the bottom."""

from __future__ import annotations

import json
import os
import re

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpref.data.readers import ArenaConfig, ArenaReader, PairwiseConfig, PairwiseReader
from hpref.errors import DataError

# HPREF_FUZZ_EXAMPLES=2000 for a long hunt; the default keeps the suite fast.
FUZZ = settings(
    max_examples=int(os.environ.get("HPREF_FUZZ_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
turns = st.lists(st.one_of(st.none(), text), max_size=3)
label = st.sampled_from([(1, 0, 0), (0, 1, 0), (0, 0, 1), (0.25, 0.25, 0.5)])


def expected(prompt, a, b):
    n = max(len(prompt), len(a), len(b))
    return tuple(tuple([*("" if t is None else t for t in x), *[""] * (n - len(x))]) for x in (prompt, a, b))


def write(path, records):
    frame = pd.DataFrame(records)
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    elif path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))


@FUZZ
@given(
    rows=st.lists(st.tuples(turns.filter(bool), turns, turns, label), min_size=1, max_size=5),
    suffix=st.sampled_from([".csv", ".parquet", ".jsonl"]),
)
def test_arena_round_trip(tmp_path, rows, suffix):
    records = [
        {
            "id": str(i),
            "prompt": json.dumps(p),
            "response_a": json.dumps(a),
            "response_b": json.dumps(b),
            "winner_model_a": lab[0],
            "winner_model_b": lab[1],
            "winner_tie": lab[2],
        }
        for i, (p, a, b, lab) in enumerate(rows)
    ]
    path = tmp_path / f"fuzz{suffix}"
    write(path, records)
    battles = list(ArenaReader(ArenaConfig(path=str(path)), 0).battles())
    assert len(battles) == len(rows)
    for battle, (p, a, b, lab) in zip(battles, rows, strict=True):
        assert (battle.prompt, battle.response_a, battle.response_b) == expected(p, a, b)
        assert battle.label == pytest.approx(tuple(map(float, lab)))


@FUZZ
@given(cell=st.one_of(text, st.text(alphabet='[]{}",\\nul0123456789 .e-', max_size=20)))
def test_arena_garbage_cell_is_a_battle_or_a_data_error(tmp_path, cell):
    path = tmp_path / "g.csv"
    pd.DataFrame([{"prompt": cell, "response_a": '["a"]', "response_b": '["b"]'}]).to_csv(path, index=False)
    try:
        battles = list(ArenaReader(ArenaConfig(path=str(path)), 0).battles())
    except DataError as exc:
        # Usually the prompt; a bare "\r" (pandas writes it unquoted) ends the record early, and then
        # the first absent cell is named.
        assert re.search(r"g\.csv: row 1( \(line 2\))?, column '(prompt|response_a)'", str(exc)), str(exc)
    else:
        assert len(battles) == 1 and all(isinstance(t, str) for t in battles[0].prompt)


cell = st.one_of(st.sampled_from(['["a"]', '["x", null]', "[]", '[""]', "[oops"]), text)


@FUZZ
@given(records=st.lists(st.lists(cell, min_size=1, max_size=5), min_size=1, max_size=6))
def test_ragged_csv_every_row_is_used_or_counted(tmp_path, records):
    """CSV rows with too few or too many cells, quotes, commas and newlines in cells: every record
    must end as a battle or a counted skip (never dropped, never a crash), and on_error = "raise"
    must name a row and a column."""
    import csv

    path = tmp_path / "ragged.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "response_a", "response_b"])
        writer.writerows(records)
    nonblank = len(records)  # csv.writer writes a lone empty cell as '""', not as a blank line
    reader = ArenaReader(ArenaConfig(path=str(path), on_error="skip"), 0)
    battles = list(reader.battles())
    s = reader.summary
    assert s.rows_read == nonblank and s.rows_used == len(battles)
    assert s.rows_used + s.rows_skipped == s.rows_read and sum(s.skipped.values()) == s.rows_skipped
    assert len(battles) <= sum(1 for r in records if len(r) == 3)  # a ragged row is never a battle
    try:
        list(ArenaReader(ArenaConfig(path=str(path)), 0).battles())
    except DataError as exc:
        assert "ragged.csv: row " in str(exc) and ", column '" in str(exc), str(exc)


safe = text.filter(lambda s: "Human:" not in s and "Assistant:" not in s).map(str.strip)


@FUZZ
@given(turns=st.lists(st.tuples(safe, safe, safe), min_size=1, max_size=3))
def test_hh_round_trip(tmp_path, turns):
    def transcript(last_index):
        return "".join(f"\n\nHuman: {u}\n\nAssistant: {(c, r)[last_index]}" for u, c, r in turns)

    path = tmp_path / "hh.jsonl"
    path.write_text(json.dumps({"chosen": transcript(0), "rejected": transcript(1)}) + "\n")
    try:
        (battle,) = PairwiseReader(PairwiseConfig(path=str(path)), 0).battles()
    except DataError as exc:
        # Only a row whose text hides a transcript marker may fail, and then with a row error.
        assert "row 1" in str(exc)
        return
    chosen = battle.response_a if battle.label[0] == 1.0 else battle.response_b
    rejected = battle.response_b if battle.label[0] == 1.0 else battle.response_a
    assert battle.prompt == tuple(u for u, _, _ in turns)
    assert chosen == tuple(c for _, c, _ in turns) and rejected == tuple(r for _, _, r in turns)


# -- cases found by fuzzing, kept explicit -------------------------------------------------------


def test_json_string_cell_is_one_turn(tmp_path):
    # '"x"' is valid JSON but not a list: read as one turn rather than iterating its characters.
    path = tmp_path / "s.csv"
    pd.DataFrame([{"prompt": '"hello"', "response_a": '["a"]', "response_b": '["b"]'}]).to_csv(
        path, index=False
    )
    (battle,) = ArenaReader(ArenaConfig(path=str(path)), 0).battles()
    assert battle.prompt == ("hello",)


def test_json_number_cell_is_a_row_error(tmp_path):
    path = tmp_path / "n.csv"
    pd.DataFrame([{"prompt": "1e5", "response_a": '["a"]', "response_b": '["b"]'}]).to_csv(path, index=False)
    with pytest.raises(DataError, match="expected a list of strings, got float"):
        list(ArenaReader(ArenaConfig(path=str(path)), 0).battles())


def test_whitespace_only_transcript_turns(tmp_path):
    # A carriage return or spaces as the whole answer strip to "" instead of breaking the parse.
    path = tmp_path / "w.jsonl"
    row = {"chosen": "\n\nHuman: \r\n\nAssistant:  ", "rejected": "\n\nHuman: \r\n\nAssistant: no"}
    path.write_text(json.dumps(row) + "\n")
    (battle,) = PairwiseReader(PairwiseConfig(path=str(path)), 0).battles()
    assert battle.prompt == ("",) and {battle.response_a, battle.response_b} == {("",), ("no",)}


def test_csv_cell_with_a_carriage_return_and_quotes(tmp_path):
    """Found while fuzzing the stdlib CSV reader: a cell holding "\r" and quote characters, written
    by csv.writer, must come back as the same text (with newline="" the "\r" is not a line end)."""
    import csv

    path = tmp_path / "cr.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "response_a", "response_b"])
        writer.writerow([json.dumps(['say "hi"\r']), '["a"]', '["b"]'])
    (battle,) = ArenaReader(ArenaConfig(path=str(path)), 0).battles()
    assert battle.prompt == ('say "hi"\r',)


def test_bare_carriage_return_cell_written_by_pandas(tmp_path):
    """Found by the garbage-cell fuzz after the CSV reader moved to the stdlib: pandas writes a cell
    "0\r" unquoted, so the "\r" ends the record. That must be a row error naming the first absent
    cell (and a counted skip; the rest of the line is a second row, with an empty prompt), not a crash."""
    path = tmp_path / "g.csv"
    pd.DataFrame([{"prompt": "0\r", "response_a": '["a"]', "response_b": '["b"]'}]).to_csv(path, index=False)
    with pytest.raises(DataError, match=r"row 1 \(line 2\), column 'response_a': no cell \(1 cells"):
        list(ArenaReader(ArenaConfig(path=str(path)), 0).battles())
    reader = ArenaReader(ArenaConfig(path=str(path), on_error="skip"), 0)
    assert list(reader.battles()) == []
    assert (reader.summary.rows_read, reader.summary.rows_skipped) == (2, 2)
