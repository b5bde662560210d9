"""The tables `hpref plugins` and `hpref components` print: kept out of `hpref.cli`, which holds only
the commands' signatures (and a size limit)."""

from __future__ import annotations

from typing import Any


def print_plugins(listing: dict[str, Any]) -> None:
    """One row per loaded plugin, then one line per plugin that failed to load."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hpref plugins")
    for column in ("plugin", "version", "distribution", "hooks", "components"):
        table.add_column(column, overflow="fold")
    for row in listing["plugins"]:
        table.add_row(
            row["name"],
            row["version"],
            row["distribution"],
            "\n".join(row["hooks"]),
            "\n".join(row["components"]),
        )
    console = Console()
    console.print(table)
    for f in listing["failed"]:
        console.print(f"[red]failed to load[/red] plugin '{f['name']}' ({f['distribution']}): {f['error']}")


def print_components(kinds: list[str], listing: list[dict[str, Any]]) -> None:
    """One table per component (its parameters), kind by kind."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    for k in kinds:
        items = [c for c in listing if c["kind"] == k]
        if not items:
            console.print(f"[dim]no {k} components registered[/dim]")
            continue
        for c in items:
            table = Table(
                title=f"{k} [bold]{c['name']}[/bold] — {escape(c['description'])} [dim]({c['plugin']})[/dim]",
                title_justify="left",
            )
            for column in ("parameter", "type", "default", "description"):
                table.add_column(column)
            for p in c["parameters"]:
                default = "(required)" if p["required"] else escape(repr(p["default"]))
                table.add_row(p["name"], escape(p["type"]), default, escape(p["description"]))
            if not c["parameters"]:
                table.add_row("-", "-", "-", "no parameters")
            console.print(table)
