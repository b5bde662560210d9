"""The arena reader on hand-made files shaped like the real Kaggle LMSYS ones."""

from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest

from hpref.data.readers import ArenaConfig, ArenaReader, write_arena_file
from hpref.data.records import Battle
from hpref.errors import DataError

HEADER = "id,model_a,model_b,prompt,response_a,response_b,winner_model_a,winner_model_b,winner_tie\n"


def q(value: object) -> str:
    """A CSV cell holding `value` as JSON, quoted the way pandas / Kaggle write it."""
    return '"' + json.dumps(value).replace('"', '""') + '"'


def read(path, **kw) -> tuple[list[Battle], ArenaReader]:
    reader = ArenaReader(ArenaConfig(path=str(path), **kw), seed=0)
    return list(reader.battles()), reader


def test_real_world_quirks_become_equal_length_turns(tmp_path):
    rows = [
        ("1", "m1", "m2", ["Hi", "And?"], ["Hello", None], ["Hey"], "1", "0", "0"),
        ("2", "m3", "m4", [""], [""], ["answer, with comma\nand newline"], "0", "1", "0"),
        ("3", "m5", "m6", ["q"], [], ['quote "x"'], "0", "0", "1"),
    ]
    text = HEADER + "".join(
        ",".join([i, a, b, q(p), q(ra), q(rb), wa, wb, wt]) + "\n" for i, a, b, p, ra, rb, wa, wb, wt in rows
    )
    path = tmp_path / "train.csv"
    path.write_text(text)
    battles, reader = read(path)
    # null turns -> "", missing turns padded, so a formatter can zip prompt/A/B turn by turn.
    assert battles[0].prompt == ("Hi", "And?")
    assert battles[0].response_a == ("Hello", "")
    assert battles[0].response_b == ("Hey", "")
    assert battles[0].label == (1.0, 0.0, 0.0)
    assert battles[1].response_b == ("answer, with comma\nand newline",)  # CSV quoting survived
    assert battles[2].response_a == ("",) and battles[2].response_b == ('quote "x"',)
    assert battles[2].label == (0.0, 0.0, 1.0)
    assert (battles[0].model_a, battles[0].model_b) == ("m1", "m2")
    s = reader.summary
    assert (s.rows_read, s.rows_used, s.rows_skipped, s.complete) == (3, 3, 0, True)
    assert dict(s.labels) == {"a": 1, "b": 1, "tie": 1}


def test_csv_parquet_and_jsonl_give_the_same_battles(tmp_path):
    battles = [
        Battle("a", ("p1", "p2"), ("x", ""), ("y", "z"), (0.2, 0.5, 0.3), "m1", "m2"),
        Battle("b", ("p",), ("ü🙂",), ("",), (0.0, 1.0, 0.0), "m3", "m4"),
    ]
    results = []
    for name in ("f.csv", "f.parquet", "f.jsonl", "f.csv.gz"):
        write_arena_file(tmp_path / name, battles)
        results.append(read(tmp_path / name)[0])
    # A format that lost soft labels, empty turns or non-ASCII text would differ from the others.
    assert all(r == battles for r in results)


def test_native_list_columns_in_parquet(tmp_path):
    frame = pd.DataFrame(
        {"id": ["1"], "prompt": [["a", None]], "response_a": [["b"]], "response_b": [["c", "d"]]}
    )
    frame.to_parquet(tmp_path / "lists.parquet")
    (battle,), _ = read(tmp_path / "lists.parquet")
    assert battle.prompt == ("a", "") and battle.response_a == ("b", "") and battle.label is None


def test_unlabeled_test_file(tmp_path):
    path = tmp_path / "test.csv"
    path.write_text("id,prompt,response_a,response_b\n" + f"7,{q(['p'])},{q(['a'])},{q(['b'])}\n")
    (battle,), reader = read(path)
    assert battle.label is None and battle.id == "7" and battle.model_a is None
    assert dict(reader.summary.labels) == {"unlabeled": 1}


def test_missing_column_names_file_and_column(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('id,prompt,response_a\n1,"[""p""]","[""a""]"\n')
    with pytest.raises(DataError, match=r"bad\.csv: missing column response_b"):
        ArenaReader(ArenaConfig(path=str(path)), seed=0)


def test_partial_label_columns_are_an_error_not_an_unlabeled_file(tmp_path):
    path = tmp_path / "half.csv"
    path.write_text(f"prompt,response_a,response_b,winner_model_a\n{q(['p'])},{q(['a'])},{q(['b'])},1\n")
    with pytest.raises(DataError, match="winner_model_b, winner_tie"):
        ArenaReader(ArenaConfig(path=str(path)), seed=0)


BAD_ROWS = [
    # (cells after id, expected column, expected reason fragment)
    (['["p"', q(["a"]), q(["b"]), "1", "0", "0"], "prompt", "not a JSON list"),
    ([q(["p"]), q([1]), q(["b"]), "1", "0", "0"], "response_a", "turn 0 is int"),
    ([q(["p"]), q(["a"]), q({"x": 1}), "1", "0", "0"], "response_b", "expected a list"),
    ([q(["p"]), q(["a"]), q(["b"]), "1", "1", "0"], "winner_model_a,winner_model_b,winner_tie", "sum to 2"),
    ([q(["p"]), q(["a"]), q(["b"]), "x", "0", "1"], "winner_model_a", "is not a number"),
    ([q(["p"]), q(["a"]), q(["b"]), "", "0", "1"], "winner_model_a", "missing label"),
    ([q(["p"]), q(["a"]), q(["b"]), "1.5", "-0.5", "0"], "winner_model_a", "outside [0, 1]"),
    ([q([]), q([]), q([]), "1", "0", "0"], "prompt", "no turns"),
    (["", q(["a"]), q(["b"]), "1", "0", "0"], "prompt", "empty cell"),
]


@pytest.mark.parametrize(("cells", "column", "reason"), BAD_ROWS)
def test_bad_row_raises_with_file_row_and_column(tmp_path, cells, column, reason):
    path = tmp_path / "rows.csv"
    good = ",".join(["g", "m", "n", q(["p"]), q(["a"]), q(["b"]), "0", "1", "0"])
    path.write_text(HEADER + good + "\n" + ",".join(["bad", "m", "n", *cells]) + "\n")
    with pytest.raises(DataError) as info:
        read(path)
    message = str(info.value)
    assert "rows.csv: row 2" in message, message  # the second data row, not the header
    assert f"column '{column}'" in message and reason in message, message


def test_skip_counts_bad_rows_with_reasons(tmp_path):
    path = tmp_path / "rows.csv"
    good = ",".join(["g", "m", "n", q(["p"]), q(["a"]), q(["b"]), "0", "1", "0"])
    bad_json = ",".join(["x", "m", "n", "[oops", q(["a"]), q(["b"]), "0", "1", "0"])
    bad_sum = ",".join(["y", "m", "n", q(["p"]), q(["a"]), q(["b"]), "0.5", "0.4", "0"])
    path.write_text(HEADER + "\n".join([good, bad_json, good, bad_sum, bad_json]) + "\n")
    battles, reader = read(path, on_error="skip")
    s = reader.summary
    assert len(battles) == 2 and (s.rows_read, s.rows_used, s.rows_skipped) == (5, 2, 3)
    reasons = dict(s.skipped)
    assert sum(reasons.values()) == 3  # never dropped without a count
    json_reason = next(r for r in reasons if r.startswith("prompt: not a JSON list"))
    assert reasons[json_reason] == 2 and s.skipped_rows[json_reason] == [2, 5]
    assert "3 skipped" in str(s) and "rows 2, 5" in str(s)


def test_short_csv_row_names_the_first_absent_cell(tmp_path):
    path = tmp_path / "short.csv"
    path.write_text("prompt,response_a,response_b\n" + q(["p"]) + "," + q(["a"]) + "\n")
    # The absent cell must be reported, not read as an empty answer.
    expected = r"row 1 \(line 2\), column 'response_b': no cell \(2 cells, the header has 3\)"
    with pytest.raises(DataError, match=expected):
        read(path)


def test_ragged_csv_rows_are_row_errors_that_skip_counts(tmp_path):
    """A CSV row with an extra cell (a stray comma in hand-edited data) used to abort the whole file
    in pandas' parser, even with on_error = "skip". It must be one counted row error, with the rows
    after it read and numbered as before; a failure here means ragged rows kill or shift the file."""
    good = ",".join(["g", "m", "n", q(["p"]), q(["a"]), q(["b"]), "0", "1", "0"])
    pretty = '"' + json.dumps(["two\nlines"], indent=1).replace('"', '""') + '"'  # a cell over 3 lines
    multiline = ",".join(["ml", "m", "n", pretty, q(["a"]), q(["b"]), "1", "0", "0"])
    path = tmp_path / "ragged.csv"
    path.write_text(HEADER + "\n".join([good, multiline, good + ",stray", good, "g2,m,n", good]) + "\n")
    expected = r"ragged\.csv: row 3 \(line 6\), column '\(line\)': extra cells \(10 cells"
    with pytest.raises(DataError, match=expected):
        read(path)
    battles, reader = read(path, on_error="skip")
    s = reader.summary
    assert [b.id for b in battles] == ["g", "ml", "g", "g"]
    assert battles[1].prompt == ("two\nlines",)  # a quoted cell spanning lines is one cell
    assert (s.rows_read, s.rows_used, s.rows_skipped) == (6, 4, 2)
    assert dict(s.skipped) == {
        "(line): extra cells (10 cells, the header has 9)": 1,
        "prompt: no cell (3 cells, the header has 9)": 1,
    }
    assert s.skipped_rows["prompt: no cell (3 cells, the header has 9)"] == [5]


def test_broken_csv_quoting_is_a_file_error_naming_the_line(tmp_path):
    """A quote left open would swallow every later row into one cell: silently, with a lenient
    parser. It must stop the read, under on_error = "skip" too, and say after which row."""
    good = ",".join(["g", "m", "n", q(["p"]), q(["a"]), q(["b"]), "0", "1", "0"])
    path = tmp_path / "open_quote.csv"
    path.write_text(HEADER + good + "\n" + 'x,m,n,"[""p""],' + "\n" + good + "\n")
    for on_error in ("raise", "skip"):
        with pytest.raises(DataError, match=r"open_quote\.csv: broken CSV quoting after row 1 \(line 4\)"):
            read(path, on_error=on_error)


def test_csv_header_problems_are_file_errors(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataError, match=r"empty\.csv: empty file, expected a CSV header row"):
        read(tmp_path / "empty.csv")
    cells = f"{q(['p'])},{q(['a'])},{q(['b'])},x"
    (tmp_path / "dup.csv").write_text(f"prompt,response_a,response_b,prompt\n{cells}\n")
    # With a repeated column one of the two would silently win.
    with pytest.raises(DataError, match="the header repeats column prompt"):
        read(tmp_path / "dup.csv")


def test_files_are_streamed_not_loaded(tmp_path, monkeypatch):
    """Reading must stream: the first battle arrives after reading a small prefix of the file, and a
    full pass opens the file once (plus one header read at construction). A reader that loaded the
    whole file (or read it twice per pass) would fail the prefix or the open count."""
    import hpref.data.tables as tables

    def noise(i: int, side: str) -> str:  # incompressible text, so the .gz file is not tiny
        return hashlib.sha256(f"{side}{i}".encode()).hexdigest() * 3

    battles = [
        Battle(str(i), (f"p{i}",), (noise(i, "a"),), (noise(i, "b"),), (1.0, 0.0, 0.0)) for i in range(4000)
    ]
    for name in ("big.csv", "big.jsonl", "big.csv.gz"):
        path = write_arena_file(tmp_path / name, battles)
        opened = []
        real_open = tables._open_text

        def counting_open(p, newline=None, _real=real_open, _opened=opened):
            f = _real(p, newline=newline)
            _opened.append(f)
            return f

        monkeypatch.setattr(tables, "_open_text", counting_open)
        reader = ArenaReader(ArenaConfig(path=str(path)), seed=0)
        stream = reader.battles()
        assert next(stream).id == "0"
        raw = opened[-1].buffer
        position = raw.fileobj.tell() if hasattr(raw, "fileobj") else raw.tell()  # gzip: compressed bytes
        assert position < path.stat().st_size / 10, (name, position, path.stat().st_size)
        assert sum(1 for _ in stream) == 3999
        assert len(opened) == 2, name  # header at construction + one streaming pass
        monkeypatch.setattr(tables, "_open_text", real_open)


def test_jsonl_row_missing_a_key_and_broken_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    lines = [
        {
            "prompt": ["p"],
            "response_a": ["a"],
            "response_b": ["b"],
            "winner_model_a": 1,
            "winner_model_b": 0,
            "winner_tie": 0,
        },
        {"prompt": ["p"], "response_a": ["a"], "winner_model_a": 1, "winner_model_b": 0, "winner_tie": 0},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n{not json\n")
    with pytest.raises(DataError, match=r"row 2, column 'response_b': missing column"):
        read(path)
    battles, reader = read(path, on_error="skip")
    assert len(battles) == 1 and reader.summary.rows_skipped == 2
    assert any(r.startswith("(line): not valid JSON") for r in reader.summary.skipped)
    assert reader.summary.skipped_rows[next(r for r in reader.summary.skipped if "(line)" in r)] == [4]


def test_lone_surrogates_are_replaced(tmp_path):
    path = tmp_path / "s.csv"
    # JSON escapes for a lone high surrogate, as found in the Kaggle test file.
    path.write_text("prompt,response_a,response_b\n" + '"[""x \\ud83d y""]","[""a""]","[""b""]"\n')
    (battle,), _ = read(path)
    assert battle.prompt == ("x \ufffd y",)
    battle.prompt[0].encode("utf-8")  # a tokenizer can take it


def test_truth_columns_round_trip(tmp_path):
    battle = Battle("s", ("p",), ("a",), ("b",), (1.0, 0.0, 0.0), truth=(0.5, 0.3, 0.2))
    write_arena_file(tmp_path / "synth.csv", [battle])
    (back,), _ = read(tmp_path / "synth.csv")
    assert back.truth == pytest.approx((0.5, 0.3, 0.2))


def test_limit_and_missing_file(tmp_path):
    battles = [Battle(str(i), ("p",), ("a",), ("b",), (1.0, 0.0, 0.0)) for i in range(10)]
    write_arena_file(tmp_path / "ten.jsonl", battles)
    got, reader = read(tmp_path / "ten.jsonl", limit=4)
    assert len(got) == 4 and reader.summary.rows_read == 4
    with pytest.raises(DataError, match="data file not found"):
        read(tmp_path / "nope.csv")


def test_jsonl_columns_come_from_the_first_readable_row(tmp_path):
    path = tmp_path / "first_broken.jsonl"
    good = {"prompt": ["p"], "response_a": ["a"], "response_b": ["b"]}
    path.write_text("{broken\n" + json.dumps(good) + "\n")
    # A broken first line must be reported as row 1, not as a file with no prompt column.
    with pytest.raises(DataError, match=r"row 1, column '\(line\)': not valid JSON"):
        read(path)
    battles, reader = read(path, on_error="skip")
    assert len(battles) == 1 and reader.summary.rows_skipped == 1
