"""Shared fixtures: run the real `hpref` console script, and keep tests off the user's caches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# `make test` runs two pytest-xdist workers on this machine's two cores: each worker's torch, and
# every process it starts, computes on one thread. With torch's default (a thread per core) the two
# workers' OpenMP pools spin-wait against each other: small training steps run side by side took
# 7.5x as long as one alone (28.6 vs 3.8 s), against 1.0x with a thread each (4.4 vs 4.3 s; a
# script of six 256-wide linears on this CPU). Multi-rank runs (torchrun) and rl
# actors already use one thread per process; serve replicas and vLLM engines set their own.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

# `precision = "auto"` measures fp32 against bf16 on a CPU with bf16 instructions
# (`hpref.models.precision`), and a probe on a loaded 2-core machine can flip from one run to the
# next. The suite pins what `auto` takes where it would measure (a model >= 256 wide on such a CPU)
# to bf16, the rule `auto` followed before it measured, so no test's precision depends on a timing;
# set before any test starts a process, Ray worker or torchrun rank, which inherit it.
# tests/models/test_precision_probe.py unsets it to test the probe itself.
os.environ.setdefault("HPREF_AUTO_PRECISION", "bf16")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

#: The smallest recipe `hpref train` accepts: a tiny model and synthetic training data.
MINIMAL_RECIPE = """\
[run]
name = "t"
[model]
name = "tiny-llama"
hidden_size = 64
[dataset.train]
name = "synthetic-arena"
num_battles = 100
"""


#: The longest modules, longest first: their summed test durations in a `make test` on the 2-core
#: machine of the README's figures (`pytest --durations=0`, added up per module).
#: `make test` runs the suite on two pytest-xdist workers, a module at a time and in collection order
#: (`--dist loadfile --no-loadscope-reorder`): a long module handed out last would keep one core busy
#: for minutes while the other sits idle. A module not named here runs after these, in file order.
LONGEST_MODULES_FIRST = (
    "tests/rl/engines/test_vllm_engine.py",
    "tests/rl/test_real_model.py",
    "tests/rl/control/test_chaos_rl.py",
    "tests/train/test_megatron_train.py",
    "tests/rl/control/test_stop_signals.py",
    "tests/train/test_real_hh_accuracy.py",
    "tests/rl/environments/test_episodes_on_ray.py",
    "tests/rl/test_rl_shared_benchmark.py",
    "tests/rl/test_rl_tool_benchmark.py",
    "tests/train/test_engine.py",
    "tests/train/test_watchdog.py",
    "tests/train/test_qlora.py",
    "tests/train/test_megatron_pipeline.py",
    "tests/serve/test_server.py",
    "tests/models/test_gguf_decoder.py",
    "tests/rl/control/test_actor_death.py",
    "tests/rl/placement/test_cluster.py",
    "tests/rl/test_default_paths.py",
    "tests/train/test_stop_signals.py",
    "tests/rl/trainer/test_rl_megatron.py",
    "tests/rl/trainer/test_trainer_group.py",
    "tests/rl/placement/test_placement.py",
    "tests/rl/placement/test_shared_base.py",
    "tests/rl/environments/test_signal.py",
    "tests/train/test_recipe_reads.py",
    "tests/train/test_learns_pairwise.py",
    "tests/rl/transport/test_weight_sync.py",
    "tests/test_cli_recipes.py",
    "tests/train/test_dpo_train.py",
    "tests/rl/algorithms/test_online_dpo.py",
    "tests/train/test_lora.py",
    "tests/test_plugins.py",
    "tests/rl/test_e2e_ray.py",
    "tests/models/test_megatron.py",
    "tests/train/test_multinode.py",
    "tests/rl/control/test_save_now_rl.py",
    "tests/test_dpo_trl_benchmark.py",
    "tests/train/test_save_now.py",
    "tests/test_profile_rl_step.py",
    "tests/rl/trainer/test_activation_checkpointing.py",
    "tests/rl/engines/test_staging.py",
    "tests/integrations/test_trl_verl_page.py",
    "tests/rl/trainer/test_packed_rows.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (a stable sort: each module's own tests keep their order)."""
    rank = {module: i for i, module in enumerate(LONGEST_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder `build(folder)` fills, built once for the whole `make test`: the pytest-xdist workers
    share the session's temporary root, the first to ask builds under a file lock and the others
    wait, then read it. For deterministic reference runs only (read, never written, by the tests).
    A build that failed leaves no completion mark: the next worker to ask builds it again."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = root / name, root / f"{name}.complete"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Logs (HPREF_HOME) and token/tokenizer caches (HPREF_CACHE) of tests go to the session's temporary
    folder, never to ~/.cache. Sub-folder conftests may point HPREF_CACHE elsewhere; theirs wins."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("HPREF_HOME", str(base / "hpref-home"))
    monkeypatch.setenv("HPREF_CACHE", str(base / "hpref-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def fresh_registry():
    """The plugin registry reloaded before the test and after it: what a test registers (a fake
    plugin site, a monkeypatched hook) is gone for the tests after it."""
    from hpref.plugins import reset_plugins

    reset_plugins()
    yield
    reset_plugins()


@pytest.fixture
def log_messages():
    """Every loguru message (any level) emitted during the test."""
    from loguru import logger

    messages: list[str] = []
    handler = logger.add(lambda m: messages.append(str(m)), level="DEBUG", format="{level} {message}")
    yield messages
    logger.remove(handler)


def fake_plugin_site(tmp_path: Path, entry_point: str, source: str) -> dict[str, str]:
    """An installed-looking third-party plugin: distribution `<entry_point>-plugin` 1.0 with module
    `<entry_point>_plugin_module` (`source`) under the `hpref` entry point `entry_point`, in a fresh
    site folder. Returns the env (`PYTHONPATH`) that makes `run_hpref` see it."""
    site = tmp_path / "site"
    dist = site / f"{entry_point}_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {entry_point}-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[hpref]\n{entry_point} = {entry_point}_plugin_module\n")
    (site / f"{entry_point}_plugin_module.py").write_text(source)
    return {"PYTHONPATH": str(site)}


def run_hpref(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120):
    """Run `python -m hpref ARGS` in a fresh process: real exit codes, real stdout/stderr."""
    return run_hpref_together(list(args), env=env, cwd=cwd, timeout=timeout)[0]


def run_hpref_here(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`hpref ARGS` through the console script's own entry point (`hpref.cli.main`: the same parsing,
    checks, one-line errors and exit codes) in this process: what `run_hpref` returns, without a new
    interpreter's seconds of torch, transformers and peft imports. For commands that start no
    process: a refusal (a bad recipe, flag or file), a command that works in this process (`hpref
    save --to`), or `hpref rl` joining the Ray cluster already up in this process (`ray_cluster`:
    its actors write to their log files, never to a console). Anything that starts a process, a
    cluster or a server goes through `run_hpref` (what that process wrote would go to the real
    stderr, not to the result's), and so does every check of the process itself (exit on a signal,
    its console). The working directory, environment, loguru's handlers and the app's plugin
    commands are put back as they were."""
    import contextlib
    import io

    from loguru import logger

    from hpref import cli

    out, err = io.StringIO(), io.StringIO()
    env = dict(os.environ)
    commands, groups = len(cli.app.registered_commands), len(cli.app.registered_groups)
    here = os.getcwd()
    code: int = 0
    try:
        os.chdir(cwd or here)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(env)
        del cli.app.registered_commands[commands:], cli.app.registered_groups[groups:]
        logger.remove()  # main's sinks write to the StringIOs; loguru's default writes to stderr
        logger.add(lambda message: sys.stderr.write(message))
    return subprocess.CompletedProcess(["hpref", *args], code, out.getvalue(), err.getvalue())


def run_hpref_together(
    *calls: list[str], env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> list[subprocess.CompletedProcess]:
    """`python -m hpref ARGS` for each argument list, the processes side by side: each a fresh
    `python -m hpref` with its own exit code and output, but their seconds of Python, torch and
    transformers start-up overlap. Results in the order of `calls`."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "hpref", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            cwd=cwd or REPO,
        )
        for args in calls
    ]
    results = []
    try:
        for args, proc in zip(calls, procs, strict=True):
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess([*args], proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


#: the tiny-llama settings of the unit tests that build a model in-process (a 2-layer, 32-wide Llama)
TINY_LLAMA = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=400,
    tokenizer_texts=300,
)
