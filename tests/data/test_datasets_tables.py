"""Data as TRL and verl users hold it: a `datasets` `save_to_disk` folder or a Hugging Face dataset
name in the local cache, read by the readers that take a path, offline, with the same battles as
the same rows in a JSONL file and one line for what does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.conftest import run_hpref_here

from hpref.data.prompts import PromptFileConfig, PromptFileReader, prompt_of_battle
from hpref.data.readers import PairwiseConfig, PairwiseReader
from hpref.errors import DataError

datasets = pytest.importorskip("datasets")

#: TRL's preference formats: conversational (message lists) and standard (strings) rows
ROWS = [
    {
        "prompt": [{"role": "user", "content": "What is 12 + 30?"}],
        "chosen": [{"role": "assistant", "content": "42"}],
        "rejected": [{"role": "assistant", "content": "41"}],
    },
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."},
        ],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "No."}],
    },
]
STANDARD = [{"prompt": "Say hi.", "chosen": "Hi!", "rejected": "Go away."}]


def cache_as_hub_dataset(cache: Path, name: str, splits: dict[str, list[dict]]) -> None:
    """`rows` in `cache` as `datasets.load_dataset(name)` leaves a Hub dataset there (the arrow
    files and dataset_info.json of `owner___name/default/0.0.0/HASH/`), without the Hub."""
    import pyarrow as pa

    owner, short = name.split("/")
    folder = cache / f"{owner}___{short}" / "default" / "0.0.0" / ("0" * 16)
    folder.mkdir(parents=True)
    infos = datasets.SplitDict(dataset_name=short)
    for split, rows in splits.items():
        table = datasets.Dataset.from_list(rows)
        arrow = folder / f"{short}-{split}.arrow"
        with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.data.schema) as writer:
            writer.write_table(table.data.table)
        infos.add(datasets.SplitInfo(split, num_examples=len(rows), dataset_name=short))
    info = datasets.DatasetInfo(config_name="default", dataset_name=short, features=table.features)
    info.splits = infos
    info.write_to_directory(str(folder))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def _battles(config_class, reader_class, path: str, **settings):
    reader = reader_class(config_class(path=path, **settings), 0)
    return list(reader.battles()), reader


def test_saved_folders_and_cached_names_read_as_the_jsonl_file_does(tmp_path, hub_cache):
    """The same TRL rows as a JSONL file, a `save_to_disk` Dataset folder, a DatasetDict folder's
    split and a cached Hub name give the same battles (pairs and prompts), offline; the dataset's
    fingerprint is the data's identity. Wrong if native message lists were read differently from
    JSON text, a split were ignored, or the token cache keyed two datasets alike."""
    import huggingface_hub.constants as hub

    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    want, _ = _battles(PairwiseConfig, PairwiseReader, str(jsonl))
    assert [b.prompt for b in want] == [("What is 12 + 30?",), ("Be brief.\n\nhi", "Name a colour.")]

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(STANDARD), "test": datasets.Dataset.from_list(ROWS)}
    ).save_to_disk(str(tmp_path / "saved-dict"))
    cache_as_hub_dataset(hub_cache, "hpref-test/prefs", {"train": ROWS[:1], "test": ROWS})
    cache_as_hub_dataset(hub_cache, "hpref-test/standard", {"train": STANDARD})
    offline_before = hub.HF_HUB_OFFLINE
    for path, split in [
        (tmp_path / "saved", "train"),
        (tmp_path / "saved-dict", "test"),
        ("hpref-test/prefs", "test"),
    ]:
        got, reader = _battles(PairwiseConfig, PairwiseReader, str(path), hf_split=split)
        assert got == want, path
        assert (
            reader.summary.rows_used == 2
            and reader.fingerprint() != _battles(PairwiseConfig, PairwiseReader, str(jsonl))[1].fingerprint()
        )
    assert offline_before == hub.HF_HUB_OFFLINE  # offline for the load only

    assert _battles(PairwiseConfig, PairwiseReader, "hpref-test/prefs")[0] == want[:1]  # train: the default
    [standard], reader = _battles(PairwiseConfig, PairwiseReader, "hpref-test/standard")
    assert reader.source == "hpref-test/standard [train]" and standard.prompt == ("Say hi.",)
    assert {standard.response_a[-1], standard.response_b[-1]} == {"Hi!", "Go away."}
    prompts, _ = _battles(PromptFileConfig, PromptFileReader, str(tmp_path / "saved-dict"), hf_split="test")
    assert [p.prompt for p in prompts] == [b.prompt for b in want]
    # `hpref rl`'s prompt sources ([rl.prompts]) pass the dataset settings through
    from hpref.builtin.prompts import FilePromptsConfig, PairwisePromptsConfig, build_file, build_pairwise

    rl_pairs = build_pairwise(
        PairwisePromptsConfig(path="hpref-test/prefs", hf_split="test", eval_fraction=0.0)
    )
    rl_file = build_file(
        FilePromptsConfig(path=str(tmp_path / "saved-dict"), hf_split="test", eval_fraction=0.0)
    )
    assert sorted(rl_pairs.train) == sorted(rl_file.train) == sorted(prompt_of_battle(b) for b in want)

    saved = PairwiseConfig(path=str(tmp_path / "saved"))
    assert PairwiseReader(saved, 0).fingerprint() == PairwiseReader(saved, 0).fingerprint()


def test_what_does_not_fit_is_one_line_and_a_command_exits_2(tmp_path, hub_cache):
    """A name not in the cache, a split the dataset lacks, a half-written folder, a missing column
    and a bad row each give one line naming the dataset (and the row and column); `hpref data stats
    NAME` exits 2 with it. Wrong if a name missing from the cache read as anything else, a split
    were made up, or a user's mistake stopped with a traceback."""
    absent = r"^hpref-test/absent: no such data file or folder, and no dataset of that name in the local"
    with pytest.raises(DataError, match=absent + r" Hugging Face cache .*hpref reads datasets offline"):
        PairwiseReader(PairwiseConfig(path="hpref-test/absent"), 0)

    datasets.DatasetDict({"train": datasets.Dataset.from_list(STANDARD)}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(DataError, match=rf"^{tmp_path}/d: no split 'eval' \(hf_split\); it has train$"):
        PairwiseReader(PairwiseConfig(path=str(tmp_path / "d"), hf_split="eval"), 0)
    cache_as_hub_dataset(hub_cache, "hpref-test/prefs", {"train": STANDARD})
    with pytest.raises(
        DataError, match=r"^hpref-test/prefs \[eval\]: Unknown split \"eval\". Should be one of \['train'\]"
    ):
        PairwiseReader(PairwiseConfig(path="hpref-test/prefs", hf_split="eval"), 0)
    with pytest.raises(
        DataError,
        match=r"^hpref-test/prefs \[train\]: missing column better \(found: prompt, chosen, rejected\)",
    ):
        PairwiseReader(PairwiseConfig(path="hpref-test/prefs", chosen_column="better"), 0)

    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "state.json").write_text("{}")  # a save_to_disk that never finished
    with pytest.raises(DataError, match=rf"^{tmp_path}/half: not a readable datasets save_to_disk folder"):
        PairwiseReader(PairwiseConfig(path=str(tmp_path / "half")), 0)

    bad = [*STANDARD, {"prompt": "Again?", "chosen": "[1, 2]", "rejected": "x"}]
    datasets.Dataset.from_list(bad).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(
        DataError, match=rf"^{tmp_path}/bad: row 2, column 'chosen': message 0 is not an object"
    ):
        list(PairwiseReader(PairwiseConfig(path=str(tmp_path / "bad")), 0).battles())

    result = run_hpref_here("data", "stats", "hpref-test/absent")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "error: hpref-test/absent: no such data file or folder" in lines[0]
