"""The CLI and recipes: resolution, overrides, shipped recipes, and one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import tomllib

from hpref import __version__
from hpref.errors import RecipeError
from hpref.recipe import load_recipe, parse_override
from tests.conftest import (
    MINIMAL_RECIPE,
    REPO,
    SHARED,
    fake_plugin_site,
    run_hpref,
    run_hpref_here,
    run_hpref_together,
)

SHIPPED = sorted((REPO / "recipes").glob("*.toml"))
GPU_REFERENCES = {"gemma2-9b-arena", "llama3-8b-arena"}
#: recipes that name files their user makes first (reward-model exports): checked with --portable
NEEDS_USER_FILES = {"rl-smollm2", "rl-debate-smollm2"}
GOOD = MINIMAL_RECIPE + '[scheduler]\nname = "cosine"\n'


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
    """`hpref --help` loads every plugin; if one imported torch (or pandas, pyarrow, ...) at module
    level, help would take seconds. Measured 0.47 s in-process on the 2-core CI machine, 0.6 s wall
    with interpreter start-up; the bounds leave room for a loaded machine, the import list does not."""
    code = (
        "import sys, time; t = time.perf_counter(); sys.argv = ['hpref', '--help']\n"
        "from hpref.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('ELAPSED', time.perf_counter() - t)\n"
        "heavy = ('torch', 'transformers', 'ray', 'pandas', 'pyarrow', 'matplotlib', 'safetensors',"
        " 'tokenizers')\n"
        "print('HEAVY', [m for m in heavy if m in sys.modules])\n"
    )
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
    in_process = float(out.stdout.split("ELAPSED")[1].split()[0])
    assert in_process < 2.0, f"--help took {in_process:.2f}s to import and run (a heavy import crept in?)"
    assert elapsed < 5, f"--help took {elapsed:.2f}s with start-up"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["nosuchcmd"], "error: No such command 'nosuchcmd'. (see 'hpref --help')"),
        (["recipes", "chek"], "error: No such command 'chek'. Did you mean 'check'?"),
        (["recipes", "check"], "error: Missing argument 'recipes'. (see 'hpref recipes check --help')"),
        (["recipes", "check", "quickstart", "--bogus"], "error: No such option: --bogus"),
        (["recipes", "check", "quickstart", "--set"], "error: Option '--set' requires an argument"),
        (
            ["train", "quickstart", "--nproc-per-node", "0"],
            "error: Invalid value for '--nproc-per-node': Input should be greater than or equal to 1",
        ),
    ],
)
def test_usage_errors_are_one_line_exit_2(args, expected):
    """A mistyped command, option or flag value is a user error like a bad recipe: one line on stderr,
    exit 2. If this fails, click's multi-line usage box (or a traceback) is back."""
    result = run_hpref(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(expected), lines[0]


def test_no_arguments_prints_help_and_exits_2():
    """`hpref` and `hpref recipes` alone show their help (stdout) and exit 2, with nothing on stderr;
    wrong if the one-line usage-error path swallowed the help or printed it as an error."""
    for args in ([], ["recipes"]):
        result = run_hpref(*args)
        assert result.returncode == 2
        assert "Usage: hpref" in result.stdout and result.stderr == ""
    assert "list" in run_hpref("recipes").stdout and "check" in run_hpref("recipes").stdout


def test_misspelt_shipped_recipe_name_suggests_the_nearest():
    """A bare name that is neither a file nor a shipped recipe says so and suggests the nearest
    shipped one; wrong if it fell through to a bare 'file not found' for a path nobody typed."""
    result = run_hpref("recipes", "check", "quickstrat")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: quickstrat: no such file, nor a shipped recipe of that name (did you mean 'quickstart'?)"
    )
    far = run_hpref("recipes", "show", "zzz")
    assert far.returncode == 2 and "shipped: dpo-smollm2, gemma2-9b-arena, llama3-8b-arena" in far.stderr


def test_components_show_required_parameters_without_a_default():
    """The judge reward's `path` is required: JSON says required with no default, the table prints
    (required) unquoted. Wrong if the marker were a string default indistinguishable from a real one."""
    listing = json.loads(run_hpref("components", "reward", "--json").stdout)
    judge = {p["name"]: p for p in next(c for c in listing if c["name"] == "judge")["parameters"]}
    assert judge["path"] == {
        "name": "path",
        "type": "str",
        "default": None,
        "required": True,
        "description": judge["path"]["description"],
    }
    assert judge["formatter"]["default"] == "pab" and judge["formatter"]["required"] is False
    table = run_hpref("components", "reward", env={"COLUMNS": "200"}).stdout
    path_row = next(line for line in table.splitlines() if "│ path " in line)
    assert "(required)" in path_row and "'(required)'" not in path_row


def test_plugins_table_lists_the_example_plugin():
    """The table form of `hpref plugins` (not only --json): every column, and the example plugin's
    row with its distribution, version, hooks and components."""
    table = run_hpref("plugins", env={"COLUMNS": "200"}).stdout
    header = next(line for line in table.splitlines() if "plugin" in line and "distribution" in line)
    for column in ("plugin", "version", "distribution", "hooks", "components"):
        assert column in header
    row = next(line for line in table.splitlines() if "│ example " in line)
    assert "0.1.0" in row and "hpref-example" in row and "dataset:tsv-pairs" in row
    assert "register_algorithms" in row  # the first hook, alphabetically, shares the row


def _needs_absent_shared(recipe) -> bool:
    return "../shared/" in recipe.read_text(encoding="utf-8") and not SHARED.is_dir()


@pytest.fixture(scope="module")
def shipped_checks():
    """`hpref recipes check` of the shipped recipes: one process for those checked as on this machine
    and one (--portable) for the others, side by side. A process per recipe spent ~2-3 s each on
    starting Python, torch and transformers; the command checks several recipes in one go. Returns
    (portable?) -> the finished process."""
    checked = [r for r in SHIPPED if not _needs_absent_shared(r)]
    portable = [r for r in checked if r.stem in GPU_REFERENCES | NEEDS_USER_FILES]
    here = [r for r in checked if r not in portable]
    machine, anywhere = run_hpref_together(
        ["recipes", "check", *map(str, here)], ["recipes", "check", *map(str, portable), "--portable"]
    )
    return {False: machine, True: anywhere}


@pytest.mark.parametrize("recipe", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_recipes_check(recipe, shipped_checks):
    # Every shipped recipe, the GPU references included, must validate on this CPU-only machine; the
    # GPU references (launch.backend = "nccl", their data on the GPU machine) with --portable, which
    # leaves out what train would refuse on this machine only (tests/test_recipe_checks.py).
    if _needs_absent_shared(recipe):
        pytest.skip(f"{recipe.name} reads its data from ../shared, which is absent here")
    # the command stops at the first recipe that fails: its error is on stderr, and the recipes after
    # it have no `ok` line
    result = shipped_checks[recipe.stem in GPU_REFERENCES | NEEDS_USER_FILES]
    ok = [line for line in result.stdout.splitlines() if line.startswith(f"ok  {recipe}  (")]
    assert len(ok) == 1, result.stdout + result.stderr[-3000:]


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
        "from hpref.recipe.catalog import resolve_recipe_path, shipped_recipes_dir; "
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


#: (recipe text, --set overrides, what the one error line must say): mistakes users make
BAD_RECIPES = [
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
]


@pytest.fixture(scope="module")
def bad_recipe_checks(tmp_path_factory):
    """`hpref recipes check` of each of BAD_RECIPES, the processes side by side (each ~1 s of start-up
    on its own): [(recipe path, finished process)], in BAD_RECIPES' order."""
    paths, calls = [], []
    for i, (text, overrides, _) in enumerate(BAD_RECIPES):
        path = write(tmp_path_factory.mktemp(f"bad-recipe-{i}"), text)
        paths.append(path)
        calls.append(["recipes", "check", str(path), *(a for o in overrides for a in ("--set", o))])
    return list(zip(paths, run_hpref_together(*calls), strict=True))


@pytest.mark.parametrize("case", range(len(BAD_RECIPES)), ids=[e[:40] for _, _, e in BAD_RECIPES])
def test_bad_recipes_give_one_line_and_exit_2(bad_recipe_checks, case):
    # Each is a mistake a user makes; each must be one readable line naming file and key, exit 2.
    expected = BAD_RECIPES[case][2]
    path, result = bad_recipe_checks[case]
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
    env = fake_plugin_site(
        tmp_path,
        "buggy",
        "from hpref.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def register_commands(app):\n"
        "    @app.command('explode')\n"
        "    def explode():\n"
        "        raise RuntimeError('kaboom')\n",
    )
    home = tmp_path / "home"
    result = run_hpref("explode", env={**env, "HPREF_HOME": str(home)})
    assert result.returncode == 1
    assert result.stderr.strip().startswith("internal error: RuntimeError: kaboom (traceback in ")
    assert "Traceback" not in result.stderr
    log = (home / "logs" / "hpref.log").read_text()
    assert "Traceback" in log and "kaboom" in log


def test_data_stats_on_a_recipe_reports_the_bayes_floor(tmp_path):
    # `hpref data stats` must stream the recipe's dataset and report the synthetic arena's floor.
    path = write(tmp_path, GOOD)
    result = run_hpref_here("data", "stats", str(path), "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["summary"]["rows_used"] == 100
    text = run_hpref_here("data", "stats", str(path)).stdout
    assert "Bayes floor" in text and "uniform 1.0986" in text


def test_data_stats_bad_split_exit_2(tmp_path):
    result = run_hpref_here("data", "stats", str(write(tmp_path, GOOD)), "--split", "eval")
    assert result.returncode == 2
    assert "dataset.eval: the recipe has no such section" in result.stderr


def test_data_stats_on_a_file_with_on_error_and_a_recipe_for_tokens(tmp_path):
    """`hpref data stats FILE`: a bad row stops it with the row named (exit 2) unless `--on-error
    skip`, which counts it; `--tokens` takes the tokenizer, formatter and max_length from `--recipe`
    (with its `--set`s), and without one it is a usage error rather than silently ignored. If this
    fails, a file with one bad row cannot be summarised, or token lengths are made up or dropped."""
    from hpref.arena import generate_battles
    from hpref.data.readers import write_arena_file

    data = write_arena_file(tmp_path / "a.csv", generate_battles(30, 0))
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join([*lines[:3], "broken,row\n", *lines[3:]]))
    bad = run_hpref_here("data", "stats", str(data))
    assert bad.returncode == 2 and "row 3" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    skipped = run_hpref_here("data", "stats", str(data), "--on-error", "skip", "--json")
    assert skipped.returncode == 0, skipped.stderr
    summary = json.loads(skipped.stdout)["summary"]
    assert (summary["rows_read"], summary["rows_used"], summary["rows_skipped"]) == (31, 30, 1)
    no_recipe = run_hpref_here("data", "stats", str(data), "--on-error", "skip", "--tokens")
    assert no_recipe.returncode == 2 and "--tokens on a data file needs --recipe" in no_recipe.stderr
    recipe = write(tmp_path, GOOD)
    with_tokens = run_hpref_here(
        "data", "stats", str(data), "--on-error", "skip", "--tokens", "--recipe", str(recipe),
        "--set", "train.max_length=150", "--json",
    )  # fmt: skip
    assert with_tokens.returncode == 0, with_tokens.stderr
    stats = json.loads(with_tokens.stdout)
    assert stats["tokens"]["max"] <= 150 and 0 < stats["truncated_share"] <= 1


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


def test_console_log_on_rank_0_only_file_on_every_rank(tmp_path, capsys):
    """`setup_logging`: rank 0 logs to the console and its file; rank 1 only to its file. Wrong if
    every rank printed (N copies of each line) or a non-zero rank lost its full log."""
    from loguru import logger

    from hpref.logs import setup_logging

    try:
        for rank in (0, 1):
            setup_logging(tmp_path / f"rank{rank}.log", rank=rank)
            logger.debug(f"debug from rank {rank}")
            logger.info(f"info from rank {rank}")
            logger.remove()
        console = capsys.readouterr().err
        assert "info from rank 0" in console and "debug from rank 0" not in console  # INFO on the console
        assert "rank 1" not in console
        for rank in (0, 1):
            log = (tmp_path / f"rank{rank}.log").read_text()
            assert f"| rank {rank} |" in log  # the file records which rank wrote each line
            assert f"debug from rank {rank}" in log and f"info from rank {rank}" in log
    finally:
        logger.remove()
        logger.add(sys.stderr)


@pytest.fixture
def restore_loguru():
    """`main()` in-process replaces loguru's handlers; put the default one back afterwards."""
    yield
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr)


def test_rl_writes_resolved_recipe_and_log_before_the_run(tmp_path, monkeypatch, capsys, restore_loguru):
    """`hpref rl` starts its run folder like `hpref train`: resolved recipe and a full log file exist
    when the run begins. The Ray run itself is replaced by a probe (tests/rl run it for real). Wrong
    if rl left no recipe.toml or log in its folder, or wrote them for a refused fresh start."""
    import hpref.rl
    from hpref.cli import main

    seen = {}

    def probe(recipe, policies, ray_address, resume, prompts=None, signals=None):
        from loguru import logger

        run_dir = recipe.run.run_dir
        seen["recipe"] = (run_dir / "recipe.toml").read_text()
        logger.debug("probe: inside the run")
        seen["policies"] = policies
        return 0

    monkeypatch.setattr(hpref.rl, "run_rl", probe)
    args = ["rl", "rl-arena", "--policies", "b,a", "--set", f"run.output_dir={tmp_path}"]
    args += ["--set", "run.seed=5"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 0 and seen["policies"] == ["b", "a"]
    recipe = load_recipe(REPO / "recipes" / "rl-arena.toml", [f"run.output_dir={tmp_path}", "run.seed=5"])
    # the resolved recipe says what `share_base` decided (rl-arena's policies train every weight)
    # and where the engines run (CPU transformers engines: in the rollout executor's process, the
    # executor in the driver's)
    decided = {"share_base": False, "engines_in_executor": True, "executor_in_driver": True}
    recipe.rl = recipe.rl.model_copy(update=decided)
    assert seen["recipe"] == recipe.to_toml() and "share_base = false" in seen["recipe"]
    assert "engines_in_executor = true" in seen["recipe"] and "executor_in_driver = true" in seen["recipe"]
    log = (recipe.run.run_dir / "logs" / "rl.log").read_text()
    assert "resolved recipe in recipe.toml" in log and "probe: inside the run" in log

    # A fresh start on a folder holding another run's record is refused before anything is written.
    other = tmp_path / "other"
    monkeypatch.setattr("hpref.rl.launch.read_record", lambda folder: object())
    with pytest.raises(SystemExit) as exit_info:
        main(["rl", "rl-arena", "--policies", "a", "--set", f"run.output_dir={other}"])
    assert exit_info.value.code == 2 and not other.exists()
    assert "already holds a checkpoint record" in capsys.readouterr().err

    # share_base = true for policies of different bases is one line naming policy and key, exit 2,
    # before the run folder is written (#37)
    shared = tmp_path / "shared"
    monkeypatch.setattr("hpref.rl.launch.read_record", lambda folder: None)
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "rl",
                "rl-arena",
                "--policies",
                "a,b",
                "--set",
                f"run.output_dir={shared}",
                "--set",
                "rl.share_base=true",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and not shared.exists()
    assert "rl.share_base = true, but rl.policies.a.lora: policy 'a' trains every weight" in err


def _fake_venv(tmp_path, pytest_exit: int):
    """A venv whose python exits with `pytest_exit`, already "installed" (stamp newer than the inputs),
    so `make test` runs only its pytest line."""
    venv = tmp_path / f"venv{pytest_exit}"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexit {pytest_exit}\n")
    python.chmod(0o755)
    (venv / ".hpref-installed").touch()
    return venv


@pytest.mark.parametrize(("pytest_exit", "ci_ok"), [(0, True), (1, False), (5, False)])
def test_ci_run_passes_only_when_pytest_passes(tmp_path, pytest_exit, ci_ok):
    """`.ci/run` runs `make test`; pytest's exit 5 (no tests collected) must fail CI and say why,
    a real test failure must fail it too, and a pass must pass. Uses a fake venv, so the suite is
    not run again. Wrong if exit 5 passed, or failed without naming the cause."""
    env = dict(os.environ, VENV=str(_fake_venv(tmp_path, pytest_exit)))
    env.pop("MAKEFLAGS", None)
    result = subprocess.run(
        [str(REPO / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path
    )
    assert (result.returncode == 0) == ci_ok, result.stdout + result.stderr
    named = "pytest collected no tests (exit 5): failing" in result.stderr
    assert named == (pytest_exit == 5), result.stderr
