"""`hpref data stats` numbers: label shares, token lengths, truncation share, synthetic floor."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpref.arena import generate_battles
from hpref.arena.source import SyntheticArena, SyntheticArenaConfig
from hpref.data.formatting import FormatterConfig, JudgeFormatter
from hpref.data.readers import ArenaReader, PairwiseReader, write_arena_file
from hpref.errors import DataError
from hpref.stats.counts import data_stats, format_stats, open_data_file

SHARED_HH = Path(__file__).resolve().parents[3] / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"


def test_stats_on_an_arena_file(tmp_path, chat_tokenizer):
    path = write_arena_file(tmp_path / "a.csv", generate_battles(40, 0))
    source = open_data_file(path)
    assert isinstance(source, ArenaReader)
    formatter = JudgeFormatter("pab", FormatterConfig(), chat_tokenizer, 90)
    stats = data_stats(source, formatter)
    assert stats["battles"] == 40 and sum(stats["turns"].values()) == 40
    assert sum(stats["label_shares"].values()) == pytest.approx(1.0)
    assert stats["tokens"]["max"] <= 90  # after truncation
    # The share truncated is exactly the share whose untruncated length exceeds the budget.
    over = sum(1 for b in generate_battles(40, 0) if formatter.encode_with_info(b).full_length > 90)
    assert stats["truncated_share"] == pytest.approx(over / 40) and over > 0
    text = format_stats(stats)
    assert "40 used" in text and "truncated" in text and "tie" in text


def test_stats_on_synthetic_include_floor_and_baselines():
    stats = data_stats(SyntheticArena(SyntheticArenaConfig(num_battles=600), 0))
    r = stats["synthetic"]
    assert r["bayes_floor"] < r["uniform"] and "Bayes floor" in format_stats(stats)


def test_stats_ceilings_are_printed_as_shares_of_the_gap():
    """`hpref data stats --ceilings` must print one line per skill set, the full set at 100% of the
    gap (it is the Bayes floor); a wrong share formula or a missing key would show here."""
    stats = data_stats(SyntheticArena(SyntheticArenaConfig(num_battles=600), 0), ceilings=True)
    text = format_stats(stats)
    assert text.count("of the gap)") == 1 + len(stats["skill_ceilings"])  # + the prior baseline
    assert "style only" in text and text.rstrip().endswith("(100% of the gap)")


def test_stats_on_an_exported_synthetic_file_report_the_floor(tmp_path):
    """A synthetic arena exported to a file keeps p_a, p_b, p_tie; `hpref data stats FILE` must then
    give the same floor and baselines as the component (same 5-fold split, fold 0 held out), and a
    file without truth columns must not get a made-up floor."""
    config = SyntheticArenaConfig(num_battles=600)
    path = write_arena_file(tmp_path / "synth.jsonl", SyntheticArena(config, 0).battles())
    from_file = data_stats(open_data_file(path))["synthetic"]
    from_component = data_stats(SyntheticArena(config, 0))["synthetic"]
    for key in ("n_train", "n_eval", "bayes_floor", "expected_entropy", "length_baseline", "bow_baseline"):
        assert from_file[key] == pytest.approx(from_component[key], rel=1e-6), key
    plain = [
        b.__class__(b.id, b.prompt, b.response_a, b.response_b, b.label) for b in generate_battles(60, 0)
    ]
    assert "synthetic" not in data_stats(open_data_file(write_arena_file(tmp_path / "plain.csv", plain)))


def test_unknown_columns(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(DataError, match="neither an arena file"):
        open_data_file(path)


@pytest.mark.shared
@pytest.mark.skipif(not SHARED_HH.exists(), reason="../shared/data is absent")
def test_stats_on_real_hh_rlhf():
    source = open_data_file(SHARED_HH)
    assert isinstance(source, PairwiseReader)
    stats = data_stats(source)
    assert stats["battles"] == 2312 and stats["label_shares"]["tie"] == 0.0
