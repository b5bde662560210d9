"""Prompt sources of `hpref rl` (`[rl.prompts]`): the conversation before the final answer, read from
the user's files, split, capped and streamed by position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpref.builtin.prompts import (
    ArenaPromptsConfig,
    FilePromptsConfig,
    PairwisePromptsConfig,
    build_arena,
    build_file,
    build_pairwise,
)
from hpref.data.prompts import battle_with_answers, prompt_of_battle
from hpref.data.splits import prompt_key
from hpref.errors import DataError, RecipeError
from hpref.recipe.rl import parse_rl_section

SHARED_HH = (
    Path(__file__).resolve().parents[3].parent / "shared" / "data" / "hh-rlhf-helpful-base-test.jsonl.gz"
)


def hh(human: list[str], assistant: list[str]) -> str:
    return "".join(f"\n\nHuman: {h}\n\nAssistant: {a}" for h, a in zip(human, assistant, strict=True))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hh_file(tmp_path: Path, n: int = 60) -> Path:
    rows = []
    for i in range(n):
        users = [f"question {i}", f"follow-up {i}"] if i % 3 == 0 else [f"question {i}"]
        earlier = [f"answer {i}"] * (len(users) - 1)
        rows.append(
            {"chosen": hh(users, [*earlier, "good"]), "rejected": hh(users, [*earlier, "bad"])},
        )
    return write_jsonl(tmp_path / "hh.jsonl", rows)


def test_pairwise_prompts_are_the_conversation_before_the_final_answer(tmp_path):
    # Wrong if a multi-turn HH conversation lost its earlier assistant turn (the policy would answer
    # a different conversation than the one the data holds) or kept the final answer.
    source = build_pairwise(PairwisePromptsConfig(path=str(hh_file(tmp_path)), eval_fraction=0.0))
    prompts = set(source.train)
    assert ("question 3", "answer 3", "follow-up 3") in prompts
    assert ("question 1",) in prompts
    assert all(len(p) % 2 == 1 for p in prompts)  # user, assistant, ..., user
    assert not any("good" in t or "bad" in t for p in prompts for t in p)


def test_eval_split_is_by_prompt_and_stable(tmp_path):
    # Wrong if a prompt could be both trained on and evaluated on, or if the split moved with the
    # file's order (a shuffled copy of the same data must hold out the same prompts).
    path = hh_file(tmp_path, 400)
    config = PairwisePromptsConfig(path=str(path), eval_fraction=0.2)
    source = build_pairwise(config)
    train_keys = {prompt_key(p) for p in source.train}
    eval_keys = {prompt_key(p) for p in source.eval}
    assert not train_keys & eval_keys
    assert 40 < len(source.eval) < 120 and len(source.train) + len(source.eval) == 400
    rows = path.read_text().splitlines()[::-1]
    reversed_file = tmp_path / "reversed.jsonl"
    reversed_file.write_text("\n".join(rows) + "\n")
    again = build_pairwise(config.model_copy(update={"path": str(reversed_file)}))
    assert again.eval_prompts(0, 10) == source.eval_prompts(0, 10)  # same held-out prompts, same order


def test_training_stream_is_positional_and_covers_every_prompt_each_pass(tmp_path):
    # Wrong if prompt i depended on how the stream was cut into rollouts (a resume at rollout r would
    # see other prompts than the run it continues), or a pass skipped or repeated prompts.
    source = build_pairwise(PairwisePromptsConfig(path=str(hh_file(tmp_path, 30)), eval_fraction=0.0))
    n = len(source.train)
    whole = source.train_prompts(0, 0, 2 * n)
    assert whole == source.train_prompts(0, 0, 7) + source.train_prompts(0, 7, 2 * n - 7)
    assert sorted(whole[:n]) == sorted(source.train) == sorted(whole[n:])
    assert whole[:n] != whole[n:]  # a new order each pass
    assert source.train_prompts(1, 0, n) != whole[:n]  # the seed shuffles


def test_duplicates_and_long_prompts_are_counted_not_silently_dropped(tmp_path, log_messages):
    # Wrong if a duplicate prompt were drawn twice as often, a prompt over the cap reached a policy,
    # or either were left out without a word in the log.
    rows = [{"chosen": hh(["same  question"], ["a"]), "rejected": hh(["same  question"], ["b"])}] * 3
    rows.append({"chosen": hh(["Same question"], ["a"]), "rejected": hh(["Same question"], ["b"])})
    rows.append({"chosen": hh(["x" * 500], ["a"]), "rejected": hh(["x" * 500], ["b"])})
    rows.append({"chosen": hh(["short"], ["a"]), "rejected": hh(["short"], ["b"])})
    path = write_jsonl(tmp_path / "dups.jsonl", rows)
    source = build_pairwise(PairwisePromptsConfig(path=str(path), eval_fraction=0.0, max_prompt_chars=100))
    assert sorted(source.train) == [("same  question",), ("short",)]
    assert source.counts["duplicate"] == 3
    assert source.counts["longer than max_prompt_chars = 100"] == 1
    assert any("3 duplicate" in m and "1 longer than max_prompt_chars = 100" in m for m in log_messages)


def test_arena_prompts_take_side_a_for_earlier_turns(tmp_path):
    # Wrong if a multi-turn arena battle's context were B's answers or missing.
    from hpref.data.readers import write_arena_file
    from hpref.data.records import Battle

    battles = [
        Battle(
            "1", ("hi", "and then?"), ("A says hello", "A final"), ("B says hi", "B final"), (1.0, 0.0, 0.0)
        ),
        Battle("2", ("solo",), ("x",), ("y",), (0.0, 0.0, 1.0)),
    ]
    path = write_arena_file(tmp_path / "arena.csv", battles)
    source = build_arena(ArenaPromptsConfig(path=str(path), eval_fraction=0.0))
    assert sorted(source.train) == [("hi", "A says hello", "and then?"), ("solo",)]


def test_plain_prompt_files_in_both_shapes(tmp_path):
    # Wrong if a chat-format row kept its trailing assistant answer (the policy would be asked to
    # continue an answered conversation), or a plain `prompt` column were not one user turn.
    plain = tmp_path / "prompts.csv"
    plain.write_text('prompt\n"Write a haiku"\n"What is 2+2?"\n')
    assert sorted(build_file(FilePromptsConfig(path=str(plain), eval_fraction=0.0)).train) == [
        ("What is 2+2?",),
        ("Write a haiku",),
    ]
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "joke?"},
                    {"role": "assistant", "content": "the answer to drop"},
                ]
            }
        ],
    )
    assert build_file(FilePromptsConfig(path=str(chat), eval_fraction=0.0)).train == [
        ("Be brief.\n\nhi", "hello", "joke?")
    ]


def test_bad_prompt_files_get_one_line_naming_file_row_and_column(tmp_path):
    # Wrong if a bad row were skipped silently or the error did not say where it is.
    bad = write_jsonl(
        tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "ok"}]}, {"messages": 5}]
    )
    with pytest.raises(DataError, match=r"bad.jsonl: row 2, column 'messages': expected a list of messages"):
        build_file(FilePromptsConfig(path=str(bad)))
    answered = write_jsonl(
        tmp_path / "answered.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}]
    )
    with pytest.raises(DataError, match=r"no usable training prompts|no user message to answer"):
        build_file(FilePromptsConfig(path=str(answered)))
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match=r"wrong.jsonl: no 'prompt' or 'messages' column \(found: text\)"):
        build_file(FilePromptsConfig(path=str(wrong)))
    skipped = write_jsonl(tmp_path / "skipped.jsonl", [{"prompt": ""}, {"prompt": "  "}])
    with pytest.raises(DataError, match=r"skipped.jsonl: no usable training prompts \(0 read"):
        build_file(FilePromptsConfig(path=str(skipped), on_error="skip"))


def test_judge_battles_keep_the_conversation():
    # Wrong if a judge scored a multi-turn answer without the earlier turns it answers.
    battle = battle_with_answers(("hi", "hello", "joke?"), "A's joke", "B's joke")
    assert battle.prompt == ("hi", "joke?")
    assert battle.response_a == ("hello", "A's joke") and battle.response_b == ("hello", "B's joke")
    assert prompt_of_battle(battle) == ("hi", "hello", "joke?")


def test_rl_prompts_section_is_validated_against_the_component():
    # Wrong if a typo in [rl.prompts] reached an actor instead of being one line with the key.
    base = {"policies": {"a": {}}}
    with pytest.raises(
        RecipeError, match=r"^r: rl.prompts.name: unknown prompts 'pairwize'.*did you mean 'pairwise'"
    ):
        parse_rl_section({**base, "prompts": {"name": "pairwize", "path": "x"}}, "r")
    with pytest.raises(RecipeError, match=r"^r: rl.prompts.eval_fraction"):
        parse_rl_section({**base, "prompts": {"name": "pairwise", "path": "x", "eval_fraction": 2}}, "r")
    assert parse_rl_section(base, "r").prompts.name == "synthetic"


@pytest.mark.shared
@pytest.mark.skipif(not SHARED_HH.is_file(), reason="../shared/data is absent")
def test_real_hh_rlhf_prompts():
    # Wrong if real HH-RLHF transcripts did not parse into prompts, or the held-out split leaked.
    source = build_pairwise(PairwisePromptsConfig(path=str(SHARED_HH), max_prompt_chars=1500))
    assert len(source.train) > 1800 and len(source.eval) > 60
    assert {prompt_key(p) for p in source.train}.isdisjoint(prompt_key(p) for p in source.eval)
    assert sum(len(p) > 1 for p in source.train) > 500  # HH is mostly multi-turn
    assert all(sum(len(t) for t in p) <= 1500 for p in source.train)


def test_a_plugin_prompt_source_is_chosen_by_name():
    # Wrong if `register_prompts` components were not found through the plugin registry, their
    # parameters not validated, or the rollout stream did not draw from them.
    from pydantic import BaseModel, ConfigDict

    from hpref.hookspecs import hookimpl
    from hpref.plugins import load_plugins, reset_plugins
    from hpref.rl.rollout.prompts import build_prompt_source, rollout_prompts

    class CountingConfig(BaseModel):
        model_config = ConfigDict(extra="forbid")
        word: str = "count"

    class Counting:
        source, ground_truth = "counting", False

        def __init__(self, word: str) -> None:
            self.word = word

        def train_prompts(self, seed: int, first: int, count: int) -> list[tuple[str, ...]]:
            return [(f"{self.word} to {i}",) for i in range(first, first + count)]

        def eval_prompts(self, seed: int, count: int) -> list[tuple[str, ...]]:
            return [(f"{self.word} backwards from {i}",) for i in range(count)]

    class Plugin:
        @hookimpl
        def register_prompts(self, register):
            register(name="counting", config=CountingConfig, build=lambda c: Counting(c.word))

    load_plugins(extra=[Plugin()])
    try:
        config = parse_rl_section(
            {
                "policies": {"a": {}},
                "prompts": {"name": "counting", "word": "tally"},
                "rollout": {"prompts_per_rollout": 2},
            },
            "r",
        )
        source = build_prompt_source(config)
        assert rollout_prompts(source, config.rollout, 3) == [("tally to 6",), ("tally to 7",)]
        with pytest.raises(RecipeError, match=r"rl.prompts.wrod"):
            parse_rl_section({"policies": {"a": {}}, "prompts": {"name": "counting", "wrod": "x"}}, "r")
    finally:
        reset_plugins()  # the built-ins alone again for the other tests
