"""Every figure the README and the docs quote names the command that reproduces it, and that command is
real (issue #47, point 9): the README's two figure tables give each row a `reproduce` command; every
`python -m benchmarks.X ...` written in README.md, docs/ or benchmarks/*.md names a benchmark module
that exists and takes each option the text gives it (read from the module's own argparse parser,
captured in process: nothing is run); the `hpref`, `make` and `pytest` commands name a real command,
recipe, target or test file; and each benchmark a README figure rests on is run by a test of the
suite in a small setting. In process, about a second."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "benchmarks").glob("*.md")),
]
BENCHMARK = re.compile(r"python -m benchmarks\.([a-z_0-9]+)((?:[^`\n]|\\\n)*)")


def readme_rows() -> list[dict[str, str]]:
    """The rows of every README table whose header has a `reproduce` column."""
    rows, header = [], None
    for line in (REPO / "README.md").read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif set("".join(cells)) <= set("-: "):
            continue
        elif "reproduce" in header:
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


def benchmark_commands() -> list[tuple[str, str, list[str]]]:
    """(page, module, options) for every `python -m benchmarks.X ...` in the pages."""
    found = []
    for page in PAGES:
        for module, rest in BENCHMARK.findall(page.read_text()):
            found.append((page.name, module, re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest.split("#")[0])))
    return found


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(module: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The benchmark's own parser, taken at its `parse_args` call, before anything runs."""

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        m.setattr("sys.argv", [module])
        main = importlib.import_module(f"benchmarks.{module}").main
        with pytest.raises(_Captured) as got:
            main() if main.__code__.co_argcount == 0 else main([])
    return got.value.parser


def test_every_readme_figure_names_the_command_that_reproduces_it():
    # Wrong if a headline or guarantee row could be quoted with no way for a reader to rerun it.
    rows = readme_rows()
    assert len(rows) >= 10, "the README's figure tables lost their reproduce column"
    for row in rows:
        command = re.fullmatch(r"`([^`]+)`", row["reproduce"])
        assert command and command.group(1).split()[0] in {"python", "hpref", "make", "pytest"}, row["what"]


def test_every_benchmark_command_in_the_docs_is_one_the_benchmark_takes(monkeypatch):
    # Wrong if a page tells a reader to run a benchmark that is gone or an option it no longer has
    # (a renamed flag would send them an argparse error instead of the figure).
    commands = benchmark_commands()
    assert len(commands) >= 30  # the pages quote many; a broken pattern would check none
    parsers: dict[str, argparse.ArgumentParser] = {}
    for page, module, options in commands:
        assert (REPO / "benchmarks" / f"{module}.py").is_file(), f"{page}: no benchmarks/{module}.py"
        if module not in parsers:
            parsers[module] = parser_of(module, monkeypatch)
        known = parsers[module]._option_string_actions
        unknown = [o for o in options if o not in known]
        assert not unknown, f"{page}: benchmarks.{module} has no option {', '.join(unknown)}"


def test_the_other_reproduce_commands_name_real_commands_recipes_targets_and_tests():
    # Wrong if a row's `hpref` command, recipe, make target or test file did not exist.
    import typer

    from hpref.cli import app
    from hpref.recipe.catalog import resolve_recipe_path

    commands = typer.main.get_command(app).commands
    makefile = (REPO / "Makefile").read_text()
    for row in readme_rows():
        words = shlex.split(row["reproduce"].strip("`"))
        if words[0] == "hpref":
            assert words[1] in commands, row["what"]
            assert resolve_recipe_path(words[2]).is_file(), row["what"]
        elif words[0] == "make":
            assert re.search(rf"^{words[1]}:", makefile, re.M), row["what"]
        elif words[0] == "pytest":
            assert all((REPO / w).is_file() for w in words[1:] if not w.startswith("-")), row["what"]


def test_each_readme_figures_benchmark_is_run_by_the_suite():
    # Wrong if a headline's benchmark could rot (an import error, a changed result shape) with no test
    # noticing until someone reruns it for a release.
    figures = {m for row in readme_rows() for m in re.findall(r"benchmarks\.([a-z_0-9]+)", row["reproduce"])}
    assert figures >= {"real_pairwise", "chaos_train", "chaos_rl", "serve_soak", "dpo_trl", "rl_shared"}
    tests = [p for p in (REPO / "tests").rglob("test_*.py") if p.name != Path(__file__).name]
    text = "\n".join(p.read_text() for p in tests)
    run = {m for m in figures if re.search(rf"benchmarks(\.{m}\b| import [^\n]*\b{m}\b)", text)}
    assert not figures - run, f"no suite test runs benchmarks.{', benchmarks.'.join(sorted(figures - run))}"
