"""The export format's one home (`hpref.exports`): its metadata files written exactly as every
earlier export was, and its readers refusing a folder that is not one in a line naming the file."""

from __future__ import annotations

import json

import pytest
import torch

from hpref.errors import UserError
from hpref.exports.layout import (
    ADAPTER_JSON,
    CHECKPOINT_JSON,
    EXPORT_JSON,
    HEAD_FILE,
    PEFT_CONFIG_FILE,
    PEFT_WEIGHTS_FILE,
    export_meta,
    export_problem,
    export_settings,
    is_adapter_export,
    is_export_folder,
    read_adapter_meta,
    read_export_meta,
    write_meta,
)
from hpref.exports.sentence_transformers import write_sentence_transformers_layout

#: `hpref_model.json` of a mean-pooled reward export, as hpref wrote it before the format moved here
#: (sorted keys, two-space indent, final newline): a reader such as `hpref serve` or an old hpref
#: must keep finding the same file
MODEL_JSON_TEXT = """{
  "format": 1,
  "head": "reward",
  "head_dropout": 0.1,
  "head_hidden_size": 16,
  "num_labels": 3,
  "pooling": "mean",
  "provenance": {
    "component": "test"
  },
  "seed": 0,
  "tie_log_nu": -0.5
}
"""


def test_metadata_and_sentence_transformers_files_are_written_as_before(tmp_path):
    """`hpref_model.json` and sentence-transformers' module files hold exactly the text earlier
    exports held (an export written before and after the move compared byte for byte), and the
    `Dense` module holds the reward head's `score`. A changed key, indent or module path would make
    `SentenceTransformer(folder)` or an older reader load a different model, or none."""
    reward = dict(
        num_labels=3,
        pooling="mean",
        head="reward",
        head_hidden_size=16,
        head_dropout=0.1,
        seed=0,
        provenance={"component": "test"},
        tie_log_nu=-0.5,
    )
    write_meta(tmp_path / EXPORT_JSON, export_meta(**reward))
    assert (tmp_path / EXPORT_JSON).read_text() == MODEL_JSON_TEXT
    judge = export_meta(**{**reward, "head": "judge", "tie_log_nu": None})
    assert "tie_log_nu" not in judge  # a judge has no tie parameter to record

    score = {"weight": torch.arange(4.0).reshape(1, 4), "bias": torch.tensor([0.25])}
    write_sentence_transformers_layout(tmp_path, score, hidden_size=4, max_seq_length=64)
    modules = json.loads((tmp_path / "modules.json").read_text())
    assert [(m["path"], m["type"].rsplit(".", 1)[1]) for m in modules] == [
        ("", "Transformer"),
        ("1_Pooling", "Pooling"),
        ("2_Dense", "Dense"),
    ]
    assert (tmp_path / "modules.json").read_text().startswith('[\n  {\n    "idx": 0,\n    "name": "0",')
    assert (tmp_path / "sentence_bert_config.json").read_text() == (
        '{\n  "max_seq_length": 64,\n  "do_lower_case": false\n}\n'
    )
    pooling = json.loads((tmp_path / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] and not pooling["pooling_mode_cls_token"]
    dense = json.loads((tmp_path / "2_Dense" / "config.json").read_text())
    assert dense == {
        "in_features": 4,
        "out_features": 1,
        "bias": True,
        "activation_function": "torch.nn.modules.linear.Identity",
    }
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "2_Dense" / "model.safetensors"))
    assert torch.equal(tensors["linear.weight"], score["weight"])
    assert torch.equal(tensors["linear.bias"], score["bias"])


def test_full_and_adapter_exports_are_told_apart_and_settings_merge(tmp_path):
    """A full export is known by `hpref_model.json`, an adapter export by `hpref_adapter.json`, and
    `hpref save`'s `hpref_checkpoint.json` adds to what the model says (formatter, max_length). A
    mix-up would load an adapter export as a full one (`hpref eval`), or serve a judge with the
    default formatter instead of the one it was trained with."""
    full, adapter, empty = tmp_path / "full", tmp_path / "adapter", tmp_path / "empty"
    for folder in (full, adapter, empty):
        folder.mkdir()
    (full / EXPORT_JSON).write_text(json.dumps({"head": "judge", "pooling": "last"}))
    (full / CHECKPOINT_JSON).write_text(json.dumps({"formatter": "pba", "max_length": 96}))
    (adapter / ADAPTER_JSON).write_text("{}")
    assert (is_export_folder(full), is_adapter_export(full)) == (True, False)
    assert (is_export_folder(adapter), is_adapter_export(adapter)) == (False, True)
    assert export_problem(full) is None
    problem = export_problem(empty)
    assert problem is not None and str(empty) in problem and "\n" not in problem
    assert export_settings(full) == {"head": "judge", "pooling": "last", "formatter": "pba", "max_length": 96}


def _write(folder, meta, files=(PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, HEAD_FILE)):
    folder.mkdir()
    (folder / ADAPTER_JSON).write_text(meta if isinstance(meta, str) else json.dumps(meta))
    for name in files:
        (folder / name).write_bytes(b"")


GOOD = {"format": 1, "base": {"name": "tiny-llama"}, "num_labels": 3}


@pytest.mark.parametrize(
    ("meta", "files", "expected"),
    [
        ("{not json", None, "hpref_adapter.json: unreadable"),
        ({**GOOD, "format": 2}, None, "hpref_adapter.json: not an hpref adapter description (format 1)"),
        ({"format": 1, "base": "tiny-llama"}, None, "not an hpref adapter description"),
        (GOOD, (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE), "no head.safetensors; not a complete adapter export"),
        (GOOD, (PEFT_CONFIG_FILE, HEAD_FILE), "no adapter_model.safetensors"),
        (
            {**GOOD, "base": {"name": "hf-classifier", "trust_remote_code": True}},
            None,
            "base.trust_remote_code = true: a folder being loaded may not enable remote code",
        ),
    ],
)
def test_an_adapter_export_that_is_not_one_is_refused_in_one_line(tmp_path, meta, files, expected):
    """`hpref eval --checkpoint` on a broken or foreign adapter export stops before building any
    model, in one line naming the folder and what is wrong; a folder that enables remote code is
    refused (it came from elsewhere, like a run folder's recipe). Without these checks a bad folder
    fails deep inside PEFT or runs the folder's code."""
    folder = tmp_path / "adapter"
    _write(folder, meta, (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, HEAD_FILE) if files is None else files)
    with pytest.raises(UserError) as err:
        read_adapter_meta(folder)
    message = str(err.value)
    assert expected in message and str(folder) in message and "\n" not in message


def test_a_complete_adapter_description_reads_back(tmp_path):
    """A complete adapter export's description comes back as written (the base section the model is
    rebuilt from); were it refused, no adapter export could be evaluated."""
    folder = tmp_path / "adapter"
    _write(folder, GOOD)
    assert read_adapter_meta(folder) == GOOD


@pytest.mark.parametrize(
    ("meta", "needs", "expected"),
    [
        (None, {}, "is not an hpref model export (no hpref_model.json)"),
        ({"format": 2, "num_labels": 3}, {}, "has export format 2; this hpref reads 1"),
        ({"format": 1, "num_labels": 3}, {"num_labels": 2}, "has 3 labels, the run needs 2"),
        ({"format": 1, "num_labels": 3, "head": "reward"}, {"head": "judge"}, "is a reward head"),
        ({"format": 1, "num_labels": 3}, {"head": "reward"}, "is a judge head"),  # old exports: judge
    ],
)
def test_an_export_the_run_cannot_use_is_refused_in_one_line(tmp_path, meta, needs, expected):
    """`keep_head = true`, `hpref eval` and `PreferenceModel.from_pretrained` read an export's
    description first: another format, a head with other labels or of the other kind stops in one
    line naming the folder, instead of a model scoring a task its head was not trained for."""
    if meta is not None:
        (tmp_path / EXPORT_JSON).write_text(json.dumps(meta))
    with pytest.raises(UserError) as err:
        read_export_meta(tmp_path, **needs)
    message = str(err.value)
    assert expected in message and str(tmp_path) in message and "\n" not in message
