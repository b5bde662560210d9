"""MkDocs hooks of hpref's documentation site (`mkdocs.yml`: `hooks:`), run by `make docs`.

The reference pages are read from the code when the site is built, so they cannot drift from it:
- one page per command (`commands/<name>.md`: its help, every option, a group's subcommands) from
  the Typer app (`hpref.cli.app`), as `hpref --help` shows them, and `<!-- hpref:commands -->`
  (commands.md) their table;
- `<!-- hpref:hooks -->` (plugins.md): every hook of `hpref.hookspecs` with its docstring;
- the README is the home page, and `benchmarks/*.md` of the repository are pages of the site
  (`benchmarks/README.md` has every table);
- a link to a file of the repository that is not a page (a recipe, a source file) becomes the path in
  code type, not a broken link (`mkdocs build --strict` fails on those).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def on_files(files, config):
    """The README as the home page (its `docs/` links made site links), and the repository's benchmark
    write-ups as pages under `benchmarks/`: one source each, nothing copied by hand."""
    readme = (REPO / "README.md").read_text(encoding="utf-8").replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=readme))
    for name, command in _cli().commands.items():
        files.append(File.generated(config, f"commands/{name}.md", content=command_page(name, command)))
    for path in sorted((REPO / "benchmarks").glob("*.md")):
        files.append(
            File.generated(config, f"benchmarks/{path.name}", content=path.read_text(encoding="utf-8"))
        )
    return files


def on_page_markdown(markdown, page, config, files):
    markdown = markdown.replace("<!-- hpref:commands -->", commands_reference())
    markdown = markdown.replace("<!-- hpref:hooks -->", hooks_reference())
    return _links_to_pages_only(markdown, page, files)


def _links_to_pages_only(markdown: str, page, files) -> str:
    here = Path(page.file.src_uri).parent

    def fix(match: re.Match) -> str:
        text, target = match.group(1), match.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        path = target.split("#", 1)[0]
        resolved = (here / path).as_posix()
        parts: list[str] = []
        for part in resolved.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part not in ("", "."):
                parts.append(part)
        if files.get_file_from_path("/".join(parts)) is not None:
            return match.group(0)
        return f"{text} (`{path}` in the repository)" if text.strip("`") != path else f"`{path}`"

    out, in_code = [], False
    for line in markdown.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        out.append(line if in_code else LINK.sub(fix, line))
    return "".join(out)


#: the guide page that explains each command, linked from its reference page
GUIDES = {
    "train": "training.md",
    "init": "training.md",
    "eval": "evaluation.md",
    "save": "evaluation.md",
    "serve": "serving.md",
    "rl": "rl.md",
    "rl-warmup": "rl.md",
    "recipes": "recipes.md",
    "data": "getting-started.md",
    "components": "plugins.md",
    "plugins": "plugins.md",
    "doctor": "getting-started.md",
}


def _cli():
    import typer.main

    from hpref.cli import app

    return typer.main.get_command(app)


def on_config(config):
    """One page per command under Commands in the navigation (the commands the CLI has now)."""
    pages = [{f"hpref {name}": f"commands/{name}.md"} for name in sorted(_cli().commands)]
    for i, entry in enumerate(config["nav"]):
        if isinstance(entry, dict) and "Commands" in entry:
            config["nav"][i] = {"Commands": ["commands.md", *pages]}
    return config


def _help(command) -> str:
    return inspect.cleandoc(command.help or "").split("\f")[0].strip()


def _options(command) -> list[str]:
    rows = []
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        if param.param_type_name == "argument":
            name = f"`{param.name.upper()}`"
        else:
            name = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
        default = "" if param.required or param.default in (None, False, ()) else f"`{param.default}`"
        help_text = (getattr(param, "help", None) or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {name} | {'yes' if param.required else ''} | {default} | {help_text} |")
    if not rows:
        return []
    return ["| option | required | default | what it does |", "| --- | --- | --- | --- |", *rows, ""]


def command_page(name: str, command) -> str:
    """A command's reference page: its help, options and, for a group, each subcommand's."""
    lines = [f"# hpref {name}", "", _help(command), ""]
    guide = GUIDES.get(name)
    if guide:
        lines += [f"How and when to use it: [{guide[:-3].replace('-', ' ')}](../{guide}).", ""]
    lines += _options(command)
    for sub in sorted(getattr(command, "commands", {}) or {}):
        subcommand = command.commands[sub]
        lines += [f"## hpref {name} {sub}", "", _help(subcommand), "", *_options(subcommand)]
    return "\n".join(lines) + "\n"


def commands_reference() -> str:
    """The commands as a table linking to their pages."""
    root = _cli()
    rows = ["| command | what it does |", "| --- | --- |"]
    for name in sorted(root.commands):
        first = _help(root.commands[name]).split("\n\n")[0].replace("\n", " ")
        rows.append(f"| [`hpref {name}`](commands/{name}.md) | {first} |")
    return "\n".join(rows) + "\n"


def hooks_reference() -> str:
    """Each `register_*` hook of `hpref.hookspecs` with its docstring."""
    from hpref import hookspecs

    lines: list[str] = []
    specs = [(n, f) for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(f, "hpref_spec")]
    for name, function in sorted(specs, key=lambda item: item[1].__code__.co_firstlineno):  # source order
        signature = inspect.signature(function)
        lines.append(f"### `{name}{signature}`\n")
        lines.append((inspect.getdoc(function) or "").strip() + "\n")
    return "\n".join(lines) + "\n"
