"""The CLI and recipes: resolution, overrides, shipped recipes, and one-line errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import tomllib

from hpref import __version__
from hpref.errors import RecipeError
from hpref.recipe import load_recipe, parse_override
from tests.conftest import REPO, run_hpref

SHIPPED = sorted((REPO / "recipes").glob("*.toml"))
GOOD = textwrap.dedent(
    """
    [run]
    name = "t"
    [model]
    name = "tiny-llama"
    hidden_size = 64
    [dataset.train]
    name = "synthetic-arena"
    num_battles = 100
    [scheduler]
    name = "cosine"
    """
)


def write(tmp_path, text: str, name: str = "r.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_version_and_help_list_the_commands():
    assert run_hpref("--version").stdout.strip() == f"hpref {__version__}"
    help_text = run_hpref("--help").stdout
    for command in ("plugins", "components", "recipes"):
        assert command in help_text


def test_help_does_not_import_heavy_libraries():
    # `hpref --help` loads every plugin; if one imported torch at module level, help would take seconds.
    code = (
        "import sys; sys.argv = ['hpref', '--help']\n"
        "from hpref.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
    assert elapsed < 5, f"--help took {elapsed:.2f}s (a heavy import crept in?)"


@pytest.mark.parametrize("recipe", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_recipes_check(recipe):
    # Every shipped recipe, the GPU references included, must validate on this CPU-only machine.
    result = run_hpref("recipes", "check", str(recipe))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok  ")


def test_recipes_list_shows_shipped():
    rows = json.loads(run_hpref("recipes", "list", "--json").stdout)
    assert {r["name"] for r in rows} >= {
        "quickstart",
        "minilm-pairwise",
        "gemma2-9b-arena",
        "llama3-8b-arena",
    }


def test_recipes_list_extra_folder(tmp_path):
    write(tmp_path, GOOD, "mine.toml")
    rows = json.loads(run_hpref("recipes", "list", str(tmp_path), "--json").stdout)
    mine = next(r for r in rows if r["name"] == "mine")
    assert mine["model"] == "tiny-llama" and mine["dataset"] == "synthetic-arena"


def test_show_fills_defaults_and_applies_overrides(tmp_path):
    path = write(tmp_path, GOOD)
    result = run_hpref(
        "recipes", "show", str(path), "--set", "train.epochs=3", "--set", "model.num_hidden_layers=2"
    )
    assert result.returncode == 0, result.stderr
    resolved = tomllib.loads(result.stdout)
    assert resolved["train"]["epochs"] == 3  # CLI beats the default
    assert resolved["model"]["hidden_size"] == 64  # file beats the default
    assert resolved["model"]["num_hidden_layers"] == 2  # CLI override of a component parameter
    assert resolved["model"]["num_attention_heads"] == 4  # component default filled in
    assert resolved["scheduler"] == {"name": "cosine", "warmup_fraction": 0.1, "min_ratio": 0.0}
    assert resolved["optimizer"]["betas"] == [0.9, 0.999]


def test_resolved_recipe_round_trips(tmp_path):
    # The resolved recipe written into a run folder must load back to the same recipe.
    recipe = load_recipe(write(tmp_path, GOOD), ["train.batch_size=8"])
    written = recipe.write(tmp_path / "run")
    again = load_recipe(written)
    assert again.to_dict() == recipe.to_dict()
    assert again.train.batch_size == 8


def test_wheel_ships_the_recipes(tmp_path):
    """A user who installs the wheel (not a checkout) must still get `hpref train quickstart` and a
    non-empty `hpref recipes list`: setup.py copies recipes/ into the wheel as hpref/recipes. If this
    fails the copy hook broke, or the installed lookup no longer finds the packaged folder."""
    import zipfile

    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("hpref-*.whl")
    shipped = {p.name for p in (REPO / "recipes").glob("*.toml")}
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        packaged = {name.rsplit("/", 1)[-1] for name in names if name.startswith("hpref/recipes/")}
        archive.extractall(tmp_path / "site")
    assert packaged == shipped
    # The installed package (outside any checkout) resolves `quickstart` to its packaged copy.
    probe = (
        "from hpref.cli import resolve_recipe_path, shipped_recipes_dir; "
        "print(shipped_recipes_dir()); print(resolve_recipe_path('quickstart'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
        cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    folder, quickstart = out.stdout.split()
    assert folder == str(tmp_path / "site" / "hpref" / "recipes")
    assert quickstart == str(tmp_path / "site" / "hpref" / "recipes" / "quickstart.toml")


def test_shipped_recipe_by_name():
    result = run_hpref("recipes", "show", "quickstart", "--json")
    assert json.loads(result.stdout)["run"]["name"] == "quickstart"


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        ("[train]\nepocs = 2\n", [], "train.epocs: unknown key (did you mean 'epochs'?)"),
        ("[trian]\nepochs = 2\n", [], "trian: unknown key (did you mean 'train'?)"),
        ("[train]\nepochs = 'two'\n", [], "train.epochs: Input should be a valid integer"),
        ("[train]\nepochs = 0\n", [], "train.epochs: Input should be greater than or equal to 1, got 0"),
        ("[train]\nprecision = 'fp8'\n", [], "train.precision: Input should be 'auto', 'bf16' or 'fp32'"),
        (
            '[model]\nname = "tiny-lama"\n',
            [],
            "model.name: unknown model 'tiny-lama' (did you mean 'tiny-llama'?)",
        ),
        (
            '[model]\nname = "tiny-llama"\nhiden_size = 3\n',
            [],
            "model.hiden_size: unknown key (did you mean 'hidden_size'?)",
        ),
        ("[model]\nhidden_size = 3\n", [], "model.name: required key is missing"),
        (
            '[scheduler]\nname = "cosine"\nwarmup_fraction = 2.0\n',
            [],
            "scheduler.warmup_fraction: Input should be less than 1",
        ),
        ("[train\nepochs = 2\n", [], "invalid TOML"),
        ("", ["train.epochs"], "--set 'train.epochs': expected section.key=value"),
        ("", ["epochs=3"], "--set 'epochs=3': the key must be dotted"),
        (
            "[train]\nepochs = 2\n",
            ["train.epochs.x=3"],
            "--set 'train.epochs.x=3': 'train.epochs' is a value, not a section",
        ),
        ("", ["train.batchsize=3"], "train.batchsize: unknown key (did you mean 'batch_size'?)"),
        ("", ["dataset.train.name=nope"], "dataset.train.name: unknown dataset 'nope'"),
        ("[run]\nseed = [1]\n", [], "run.seed: Input should be a valid integer, got [1]"),
        (
            '[dataset.eval]\nname = "synthetic-arena"\nsplit = "eval"\n',
            [],
            "dataset.eval: Value error, split = 'eval' needs folds >= 2",
        ),
    ],
)
def test_bad_recipes_give_one_line_and_exit_2(tmp_path, text, overrides, expected):
    # Each is a mistake a user makes; each must be one readable line naming file and key, exit 2.
    path = write(tmp_path, text)
    args = ["recipes", "check", str(path)]
    for o in overrides:
        args += ["--set", o]
    result = run_hpref(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {path}: ") or lines[0].startswith("error: --set"), lines[0]
    assert expected in lines[0]
    assert not lines[0].endswith("got a table")  # a section-wide check has no single bad value to echo
    assert "Traceback" not in result.stderr


def test_missing_recipe_file(tmp_path):
    result = run_hpref("recipes", "check", str(tmp_path / "nope.toml"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'nope.toml'}: recipe file not found"


def test_unknown_component_kind_exit_2():
    result = run_hpref("components", "modle")
    assert result.returncode == 2
    assert "unknown component kind 'modle' (did you mean 'model'?)" in result.stderr


def test_override_values_are_toml_literals():
    assert parse_override("train.epochs=3") == (["train", "epochs"], 3)
    assert parse_override("optimizer.betas=[0.9, 0.95]") == (["optimizer", "betas"], [0.9, 0.95])
    assert parse_override("run.name=my-run") == (["run", "name"], "my-run")  # bare words stay strings
    assert parse_override('run.name="3"') == (["run", "name"], "3")
    with pytest.raises(RecipeError):
        parse_override("=3")


def test_internal_error_exits_1_with_traceback_in_log(tmp_path):
    # A bug (not the user's fault) exits 1, prints one line, and keeps the traceback in the log file.
    site = tmp_path / "site"
    dist = site / "buggy_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: buggy-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[hpref]\nbuggy = buggy_plugin_module\n")
    (site / "buggy_plugin_module.py").write_text(
        "from hpref.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def register_commands(app):\n"
        "    @app.command('explode')\n"
        "    def explode():\n"
        "        raise RuntimeError('kaboom')\n"
    )
    home = tmp_path / "home"
    result = run_hpref("explode", env={"PYTHONPATH": str(site), "HPREF_HOME": str(home)})
    assert result.returncode == 1
    assert result.stderr.strip().startswith("internal error: RuntimeError: kaboom (traceback in ")
    assert "Traceback" not in result.stderr
    log = (home / "logs" / "hpref.log").read_text()
    assert "Traceback" in log and "kaboom" in log


def test_data_stats_on_a_recipe_reports_the_bayes_floor(tmp_path):
    # `hpref data stats` must stream the recipe's dataset and report the synthetic arena's floor.
    path = write(tmp_path, GOOD)
    result = run_hpref("data", "stats", str(path), "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["summary"]["rows_used"] == 100
    text = run_hpref("data", "stats", str(path)).stdout
    assert "Bayes floor" in text and "uniform 1.0986" in text


def test_data_stats_bad_split_exit_2(tmp_path):
    result = run_hpref("data", "stats", str(write(tmp_path, GOOD)), "--split", "eval")
    assert result.returncode == 2
    assert "dataset.eval: the recipe has no such section" in result.stderr


def test_train_dry_run_prints_the_torchrun_command():
    # The quickstart asks for 2 CPU ranks: the command must be torchrun with 2 processes, and the
    # resolved recipe must follow it; nothing may start.
    result = run_hpref("train", "quickstart", "--dry-run", "--set", "train.epochs=1")
    assert result.returncode == 0, result.stderr
    first, _, rest = result.stdout.partition("\n")
    assert first.startswith("torchrun --nproc-per-node 2 --nnodes 1")
    assert "--module hpref.train.worker" in first and "train.epochs=1" in first
    assert tomllib.loads(rest)["train"]["epochs"] == 1


def test_train_bad_recipe_exits_2_before_any_process(tmp_path):
    result = run_hpref("train", str(write(tmp_path, "[train]\nbatch_size = -1\n")))
    assert result.returncode == 2
    assert "train.batch_size: Input should be greater than or equal to 1" in result.stderr


def test_rl_section_is_validated_with_the_recipe():
    # The [rl] section is part of the recipe: a misspelt policy key is a recipe error, exit 2.
    assert run_hpref("recipes", "check", "rl-arena").returncode == 0
    result = run_hpref("recipes", "check", "rl-arena", "--set", "rl.policies.a.lrr=3")
    assert result.returncode == 2
    assert "rl.policies.a.lrr: unknown key (did you mean 'lr'?)" in result.stderr


def test_rl_unknown_policy_and_missing_section_exit_2():
    result = run_hpref("rl", "rl-arena", "--policies", "a,c")
    assert result.returncode == 2 and "no policy 'c' in [rl.policies]" in result.stderr
    result = run_hpref("rl", "quickstart", "--policies", "a")
    assert result.returncode == 2 and "rl: the recipe has no [rl] section" in result.stderr
