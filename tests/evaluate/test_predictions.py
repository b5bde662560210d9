"""Prediction files: round trips in every format, and each way a file can be broken."""

from __future__ import annotations

import numpy as np
import pytest

from hpref.errors import DataError
from hpref.prediction.files import Predictions, read_predictions, write_predictions

IDS = ["b7", "a1", "0042", "x y"]  # not sorted, a leading zero and a space: ids are text, kept as given
PROBS = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3], [0.25, 0.7, 0.05]])


@pytest.mark.parametrize("name", ["p.csv", "p.parquet", "p.jsonl"])
def test_round_trip_keeps_ids_order_and_full_precision(tmp_path, name):
    path = write_predictions(tmp_path / name, IDS, PROBS)
    back = read_predictions(path)
    assert back.ids == IDS  # "0042" -> 42 would break joins with the data file
    np.testing.assert_allclose(back.probs, PROBS, rtol=0, atol=1e-14)
    assert not list(tmp_path.glob(".*part"))


def test_csv_header_is_the_kaggle_submission_format(tmp_path):
    path = write_predictions(tmp_path / "submission.csv", IDS, PROBS)
    assert path.read_text().splitlines()[0] == "id,winner_model_a,winner_model_b,winner_tie"


def _write(tmp_path, text):
    path = tmp_path / "bad.csv"
    path.write_text("id,winner_model_a,winner_model_b,winner_tie\n" + text)
    return path


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("a,0.5,0.5,0\na,0.2,0.2,0.6\n", r"row 2, column 'id': duplicate id 'a' \(first at row 1\)"),
        ("a,0.5,0.5,0\n,0.2,0.2,0.6\n", r"row 2, column 'id': missing id"),
        ("a,0.5,0.5,0\nb,0.5,0.6,0.1\n", r"row 2, columns winner_model_a,winner_model_b,winner_tie: .*1.2"),
        ("a,0.5,0.5,0\nb,nan,0.5,0.5\n", r"row 2, column 'winner_model_a': NaN"),
        ("a,0.5,0.5,0\nb,0.5,,0.5\n", r"row 2, column 'winner_model_b': missing value"),
        ("a,0.5,0.5,0\nb,0.5,0.5,-0.0001\n", r"row 2, column 'winner_tie': .* outside \[0, 1\]"),
        ("a,0.5,0.5,0\nb,x,0.5,0.5\n", r"row 2, column 'winner_model_a': 'x' is not a number"),
        ("", r"no prediction rows"),
    ],
)
def test_broken_files_name_file_row_and_column(tmp_path, body, message):
    path = _write(tmp_path, body)
    with pytest.raises(DataError, match=message) as info:
        read_predictions(path)
    assert str(path) in str(info.value)


def test_missing_column_lists_what_was_found(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("id,winner_model_a,winner_model_b\na,0.5,0.5\n")
    found = "found: id, winner_model_a, winner_model_b"
    with pytest.raises(DataError, match=f"missing column winner_tie .*{found}"):
        read_predictions(path)


def test_rows_within_tolerance_are_renormalised(tmp_path):
    back = read_predictions(_write(tmp_path, "a,0.500001,0.3,0.2\n"))
    assert back.probs.sum() == pytest.approx(1.0, abs=1e-15)


def test_writing_duplicate_ids_is_refused(tmp_path):
    with pytest.raises(DataError, match="duplicate id 'a'"):
        write_predictions(tmp_path / "p.csv", ["a", "a"], PROBS[:2])


def test_reorder():
    preds = Predictions(IDS, PROBS)
    again = preds.reorder(list(reversed(IDS)))
    np.testing.assert_array_equal(again.probs, PROBS[::-1])
    with pytest.raises(DataError, match="'nope'"):
        preds.reorder(["nope", *IDS[1:]])
