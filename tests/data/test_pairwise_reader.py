"""The pairwise reader: HH-RLHF transcripts, TRL message lists, prompt/chosen/rejected columns."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from hpref.data.readers import PairwiseConfig, PairwiseReader
from hpref.data.transcripts import parse_hh_transcript, to_turns
from hpref.errors import DataError

SHARED_HH = Path(__file__).resolve().parents[3] / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read(path, seed=0, **kw):
    reader = PairwiseReader(PairwiseConfig(path=str(path), **kw), seed=seed)
    return list(reader.battles()), reader


def test_hh_transcript_shares_earlier_turns_and_merges_repeated_roles():
    text = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: one\n\nHuman: two\n\nAssistant: bye"
    users, answers = to_turns(parse_hh_transcript(text, "chosen"))
    # Two Human messages in a row are one user turn (8 rows of the real file have them).
    assert users == ["hi", "one\n\ntwo"] and answers == ["hello", "bye"]


def test_hh_rows_map_onto_battles_with_a_seeded_side(tmp_path):
    rows = [
        {
            "chosen": f"\n\nHuman: q{i}\n\nAssistant: good{i}",
            "rejected": f"\n\nHuman: q{i}\n\nAssistant: bad{i}",
        }
        for i in range(400)
    ]
    path = write_jsonl(tmp_path / "hh.jsonl", rows)
    battles, reader = read(path)
    assert reader.summary.rows_used == 400
    for b in battles:
        good_is_a = b.response_a[0].startswith("good")
        assert b.label == ((1.0, 0.0, 0.0) if good_is_a else (0.0, 1.0, 0.0))  # two-way, no tie
        assert b.prompt == (f"q{b.id and int(b.id) - 1}",)
    sides = Counter(b.label for b in battles)
    # A reader that always put "chosen" in A would teach a model that A wins; the coin must be fair.
    assert 160 < sides[(1.0, 0.0, 0.0)] < 240
    again, _ = read(path)
    other_seed, _ = read(path, seed=1)
    assert again == battles  # deterministic per seed
    assert other_seed != battles


def test_trl_message_lists_and_prompt_columns(tmp_path):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    rows = [
        {
            "chosen": [*conv, {"role": "assistant", "content": "4"}],
            "rejected": [*conv, {"role": "assistant", "content": "5"}],
        },
        {"prompt": "capital of France?", "chosen": "Paris", "rejected": "Rome"},
        {
            "prompt": conv,
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "22"}],
        },
    ]
    battles, _ = read(write_jsonl(tmp_path / "trl.jsonl", rows))
    assert battles[0].prompt == ("be brief\n\n2+2?",)  # system text kept, in front of the first turn
    assert {battles[0].response_a[0], battles[0].response_b[0]} == {"4", "5"}
    assert battles[1].prompt == ("capital of France?",)
    chosen_side = 0 if battles[1].label[0] == 1.0 else 1
    assert (battles[1].response_a, battles[1].response_b)[chosen_side] == ("Paris",)
    assert {battles[2].response_a[0], battles[2].response_b[0]} == {"4", "22"}


def test_parquet_with_message_list_columns(tmp_path):
    frame = pd.DataFrame(
        {
            "chosen": [[{"role": "user", "content": "u"}, {"role": "assistant", "content": "c"}]],
            "rejected": [[{"role": "user", "content": "u"}, {"role": "assistant", "content": "r"}]],
        }
    )
    frame.to_parquet(tmp_path / "p.parquet")
    (battle,), _ = read(tmp_path / "p.parquet")
    assert battle.prompt == ("u",) and {battle.response_a[0], battle.response_b[0]} == {"c", "r"}


@pytest.mark.parametrize(
    ("row", "column", "reason"),
    [
        ({"chosen": "no markers here", "rejected": "\n\nHuman: a\n\nAssistant: b"}, "chosen", "markers"),
        (
            {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: X\n\nAssistant: b"},
            "rejected",
            "differ from the chosen side's at turn 0",
        ),
        ({"chosen": [{"role": "wizard", "content": "x"}], "rejected": []}, "chosen", "unknown role"),
        ({"chosen": [{"role": "user"}], "rejected": []}, "chosen", "'role' and 'content'"),
        ({"chosen": "\n\nHuman: a\n\nAssistant: b"}, "rejected", "missing column"),
        ({"chosen": None, "rejected": "x"}, "chosen", "missing value"),
        ({"chosen": "preamble\n\nHuman: a\n\nAssistant: b", "rejected": "x"}, "chosen", "text before"),
    ],
)
def test_bad_pairs_name_row_and_column(tmp_path, row, column, reason):
    good = {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(DataError) as info:
        read(path)
    message = str(info.value)
    assert "bad.jsonl: row 2" in message and f"column '{column}'" in message and reason in message, message
    battles, reader = read(path, on_error="skip")
    assert len(battles) == 1 and reader.summary.rows_skipped == 1


def test_missing_chosen_column_is_a_file_error(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"good": "a", "rejected": "b"}])
    with pytest.raises(DataError, match="missing column chosen"):
        PairwiseReader(PairwiseConfig(path=str(path)), seed=0)


@pytest.mark.shared
@pytest.mark.skipif(not SHARED_HH.exists(), reason="../shared/data is absent")
def test_real_hh_rlhf_file():
    battles, reader = read(SHARED_HH)
    s = reader.summary
    # Every one of the 2,312 real pairs must parse: a skipped row here is a parser bug.
    assert (s.rows_read, s.rows_used, s.rows_skipped) == (2312, 2312, 0)
    assert all(len(b.prompt) == len(b.response_a) == len(b.response_b) >= 1 for b in battles)
    assert all(b.response_a[:-1] == b.response_b[:-1] for b in battles)  # only the last answer differs
    assert all(not any("\n\nHuman:" in t or "\n\nAssistant:" in t for t in b.prompt) for b in battles)
    share_a = sum(b.label[0] for b in battles) / len(battles)
    assert 0.45 < share_a < 0.55
