"""`hpref recipes check` refuses what `hpref train` would refuse (hpref.train.checks), and
`run.name` can only name a folder inside `run.output_dir`. Every refusal: one line, the file, the
dotted key, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from hpref.errors import RecipeError, UserError
from hpref.models.attention import BackendUnavailable, resolve_backend
from hpref.recipe import load_recipe
from hpref.train.checks import check_train
from tests.conftest import MINIMAL_RECIPE, REPO, run_hpref

GOOD = MINIMAL_RECIPE
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA refuses")


def _recipe(tmp_path, text: str = GOOD):
    path = tmp_path / "r.toml"
    path.write_text(text)
    return path


def _one_line_exit_2(result, path, expected: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {path}: ") and expected in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "model: the recipe has no [model] section, and training needs one"),
        ('[model]\nname = "tiny-llama"\n', "dataset.train: the recipe has no [dataset.train] section"),
    ],
)
def test_check_refuses_a_recipe_that_train_refuses(tmp_path, text, expected):
    """Before: `recipes check` said "ok" to a recipe with no model or no training data, and `hpref
    train` then refused it. Both must refuse; check says so in one line naming the key."""
    path = _recipe(tmp_path, text)
    _one_line_exit_2(run_hpref("recipes", "check", str(path)), path, expected)
    train = run_hpref("train", str(path), "--set", "run.output_dir=" + repr(str(tmp_path / "runs")))
    assert train.returncode == 2, train.stdout + train.stderr


def test_good_recipe_passes_and_rl_recipes_are_not_held_to_training(tmp_path):
    assert run_hpref("recipes", "check", str(_recipe(tmp_path)), "rl-arena").returncode == 0


def test_max_length_beyond_the_models_positions(tmp_path):
    # The worker refuses this after building the model; the recipe states both numbers.
    recipe = load_recipe(_recipe(tmp_path), ["model.max_position_embeddings=64", "train.max_length=128"])
    with pytest.raises(RecipeError, match=r"train.max_length: 128 exceeds the model's 64 positions"):
        check_train(recipe, machine=False)


@NO_CUDA
@pytest.mark.parametrize("backend", ["flash_varlen", "torch_varlen"])
def test_cuda_only_attention_is_refused_at_recipe_time(tmp_path, backend):
    """Before: `model.attention = "flash_varlen"` on a CPU machine passed check, and train set up
    data and model, then died in the first forward pass with exit 1."""
    path = _recipe(tmp_path)
    result = run_hpref("recipes", "check", str(path), "--set", f'model.attention="{backend}"')
    line = _one_line_exit_2(result, path, f"model.attention: '{backend}' needs a CUDA GPU")
    assert "no CUDA GPU is visible" in line
    # --portable: the recipe may be meant for a GPU machine.
    portable = run_hpref("recipes", "check", str(path), "--portable", "--set", f'model.attention="{backend}"')
    assert portable.returncode == 0, portable.stderr


def test_cuda_only_attention_with_gloo_or_fp32_is_refused_even_with_cuda(tmp_path, monkeypatch):
    """On a GPU machine a gloo run computes on CPU and an fp32 run in fp32: neither can use the
    CUDA fp16/bf16 kernels, which the recipe says before any process starts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import hpref.models.attention as attention

    monkeypatch.setattr(attention, "_flash_varlen_func", lambda: object())
    base = load_recipe(_recipe(tmp_path), ['model.attention="flash_varlen"'])
    gloo = base.model_copy(update={"launch": base.launch.model_copy(update={"backend": "gloo"})})
    with pytest.raises(RecipeError, match=r"launch.backend = 'gloo' runs on CPU"):
        check_train(gloo)
    fp32 = base.model_copy(update={"train": base.train.model_copy(update={"precision": "fp32"})})
    with pytest.raises(
        RecipeError, match=r"model.attention: 'flash_varlen' needs fp16/bf16 compute.*float32"
    ):
        check_train(fp32)


def test_an_unavailable_attention_backend_in_the_forward_is_a_user_error():
    # What train hits if a run gets past the recipe check anyway (another caller, another device):
    # exit 2 with one line, not an internal error with exit 1.
    with pytest.raises(UserError, match="attention 'flash_varlen' needs a CUDA GPU"):
        resolve_backend("flash_varlen", device=torch.device("cpu"), dtype=torch.bfloat16)
    assert issubclass(BackendUnavailable, RuntimeError)


@NO_CUDA
def test_gpu_references_check_portably_and_are_refused_here(tmp_path):
    # launch.backend = "nccl": train on this CPU machine refuses it, so check does too.
    result = run_hpref("recipes", "check", "gemma2-9b-arena")
    assert result.returncode == 2 and "launch.backend: 'nccl' needs CUDA GPUs" in result.stderr
    assert run_hpref("recipes", "check", "gemma2-9b-arena", "--portable").returncode == 0


def test_missing_data_file_and_output_dir_that_is_a_file(tmp_path):
    path = _recipe(
        tmp_path,
        GOOD.replace(
            'name = "synthetic-arena"\nnum_battles = 100', f'name = "arena"\npath = "{tmp_path}/no.csv"'
        ),
    )
    result = run_hpref("recipes", "check", str(path))
    _one_line_exit_2(result, path, f"dataset.train: {tmp_path}/no.csv: data file not found")
    (tmp_path / "afile").write_text("x")
    result = run_hpref(
        "recipes", "check", str(_recipe(tmp_path)), "--set", f'run.output_dir="{tmp_path}/afile"'
    )
    _one_line_exit_2(result, tmp_path / "r.toml", f"run.output_dir: {tmp_path}/afile is a file")


@pytest.mark.parametrize(
    "name",
    ["/etc/cron.d", "..", ".", "../../x", "a/b", "a\\b", "", "  ", "x\x00y", "tab\there", "n" * 256],
)
def test_run_name_must_be_one_plain_folder_name(tmp_path, name):
    """Before: `run.name = "/etc/cron.d"` made the run folder /etc/cron.d (pathlib drops output_dir
    before an absolute name) and ".." climbed out of output_dir."""
    with pytest.raises(RecipeError, match=r"run\.name: Value error"):
        load_recipe(_recipe(tmp_path), [f"run.name={json.dumps(name)}"])


@pytest.mark.parametrize("name", ["t", "my-run_2", "-leading-dash", "ünïcode", "a.b", "..x"])
def test_plain_run_names_stay_inside_output_dir(tmp_path, name):
    recipe = load_recipe(_recipe(tmp_path), [f'run.name="{name}"', f'run.output_dir="{tmp_path}/runs"'])
    assert recipe.run.run_dir.parent == tmp_path / "runs" and recipe.run.run_dir.name == name


def test_run_name_error_through_the_cli(tmp_path):
    path = _recipe(tmp_path)
    result = run_hpref("recipes", "check", str(path), "--set", 'run.name="/etc/cron.d"')
    _one_line_exit_2(result, path, "run.name: Value error, must be one plain folder name")
    train = run_hpref("train", str(path), "--dry-run", "--set", 'run.name="../escape"')
    _one_line_exit_2(train, path, "run.name: Value error, must be one plain folder name")
    assert not (REPO / "escape").exists()


def test_a_utf16_recipe_is_named_as_such(tmp_path):
    # Windows editors save "Unicode" as UTF-16; the message said "invalid start byte at byte 0".
    path = tmp_path / "r.toml"
    path.write_bytes(GOOD.encode("utf-16"))
    result = run_hpref("recipes", "check", str(path))
    _one_line_exit_2(result, path, "UTF-16 or UTF-32 text, and TOML must be UTF-8")
