"""`hpref train` reads its recipe once per process (issue #27): the launcher reads the recipe the
user named and checks it; the in-process worker is handed that `Recipe`, and each torchrun rank reads
the resolved `recipe.toml` the launcher wrote, never the recipe and its `--set`s again. The 2-rank run
also shows what a run folder holds (the resolved recipe, a log per rank) and what the console shows.

Counted, not assumed: a `sitecustomize` on the subprocesses' PYTHONPATH wraps
`hpref.recipe.loading.read_toml` (the one place a recipe file is read) and appends `pid<TAB>path` to
a log for every call, in the launcher and in every rank torchrun starts.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import tomllib

from tests.conftest import run_hpref, run_hpref_here

SITECUSTOMIZE = """
import os

if os.environ.get("HPREF_TEST_RECIPE_READS"):
    import hpref.recipe.loading as _loading

    _read_toml = _loading.read_toml

    def _counted(path):
        with open(os.environ["HPREF_TEST_RECIPE_READS"], "a", encoding="utf-8") as log:
            log.write(f"{os.getpid()}\\t{path}\\n")
        return _read_toml(path)

    _loading.read_toml = _counted
"""

#: the shipped quickstart recipe, cut to a few steps of a smaller tokenizer and data set
QUICKSTART_SMALL = [
    "train.max_steps=2",
    "train.eval_interval=0",
    "dataset.train.num_battles=200",
    "dataset.eval.num_battles=100",
    "model.vocab_size=512",
    "model.tokenizer_texts=500",
]


@pytest.mark.parametrize("nproc", [1, 2])
def test_hpref_train_quickstart_reads_the_recipe_once_per_process(tmp_path, nproc):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "reads.log"
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    overrides = [arg for text in QUICKSTART_SMALL for arg in ("--set", text)]
    result = run_hpref(
        "train",
        "quickstart",
        "--nproc-per-node",
        str(nproc),
        "--set",
        f"run.output_dir={str(tmp_path / 'runs')!r}",
        *overrides,
        env={"PYTHONPATH": pythonpath, "HPREF_TEST_RECIPE_READS": str(log)},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reads = [line.split("\t") for line in log.read_text().splitlines()]
    per_process = Counter(pid for pid, _ in reads)
    # the launcher (which is the only process with one rank) and each torchrun rank
    assert len(per_process) == (1 if nproc == 1 else 1 + nproc), reads
    assert set(per_process.values()) == {1}, reads
    resolved = (tmp_path / "runs" / "quickstart" / "recipe.toml").resolve()
    files = Counter(Path(path).resolve() for _, path in reads)
    assert sum(n for path, n in files.items() if path.name == "quickstart.toml") == 1, reads
    assert files[resolved] == (0 if nproc == 1 else nproc), reads
    if nproc == 1:
        return
    # and the run folder holds the recipe resolved (overrides and defaults, as `recipes show` gives
    # it) and one full log per rank, while the console carries rank 0's lines only. Wrong if the
    # recipe were copied unresolved, or ranks > 0 printed
    run_dir = tmp_path / "runs" / "quickstart"
    shown = run_hpref_here(
        "recipes", "show", "quickstart", "--set", f"run.output_dir={str(tmp_path / 'runs')!r}", *overrides
    )
    assert (run_dir / "recipe.toml").read_text() == shown.stdout
    assert tomllib.loads(shown.stdout)["train"]["max_steps"] == 2
    assert "rank 0/2 on cpu" in result.stderr and "rank 1/2" not in result.stderr
    assert "rank 1/2 on cpu" in (run_dir / "logs" / "rank1.log").read_text()
    assert "step 2/2 loss" in (run_dir / "logs" / "rank0.log").read_text()
