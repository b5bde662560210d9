"""The `hpref` command.

Each command parses its arguments, validates the recipe, then calls one function that does the
work. torch, transformers and ray are imported only inside the commands that need them, so
`hpref --help` stays fast. Errors a user caused end as one line and exit code 2; anything else
exits 1 with the traceback kept in the log file (`hpref.logs.cli_log_file()`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Literal

import typer

from hpref import __version__
from hpref.errors import UserError
from hpref.recipe.catalog import resolve_recipe_path

app = typer.Typer(
    name="hpref",
    help="Human-preference modelling: train, evaluate and export preference models; multi-policy RL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
recipes_app = typer.Typer(help="List, show and check recipes.", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")
data_app = typer.Typer(help="Inspect preference data.", no_args_is_help=True)
app.add_typer(data_app, name="data")

SetOption = typer.Option([], "--set", "-s", help="Override a recipe value: section.key=value (repeatable).")
LogOption = typer.Option([], "--log", help="Also log metrics to: tensorboard, wandb (repeatable).")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"hpref {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    pass


def _console():
    from rich.console import Console

    return Console()


# --------------------------------------------------------------------------------------------------
# plugins and components


@app.command("plugins")
def plugins_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List every loaded plugin: version, distribution, hooks and the components it provides."""
    from hpref.plugins import plugin_listing

    listing = plugin_listing()
    if as_json:
        typer.echo(json.dumps(listing, indent=2))
        return
    from hpref.check.tables import print_plugins

    print_plugins(listing)


@app.command("components")
def components_command(
    kind: str | None = typer.Argument(
        None, help="model, dataset, scheduler, optimizer, formatter, reward or engine."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """List registered components with their parameters (name, type, default) from their config schema."""
    from hpref.plugins import component_kinds, component_listing

    kinds = component_kinds(kind)
    listing = component_listing(kinds)
    if as_json:
        typer.echo(json.dumps(listing, indent=2, default=str))
        return
    from hpref.check.tables import print_components

    print_components(kinds, listing)


@app.command("doctor")
def doctor_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """What this installation can do: versions, torch build, devices, bf16, extras, Ray, ../shared data."""
    from hpref.check.doctor import doctor_report, print_report

    report = doctor_report()
    typer.echo(json.dumps(report, indent=2)) if as_json else print_report(report)


# --------------------------------------------------------------------------------------------------
# recipes


@recipes_app.command("list")
def recipes_list(
    folders: list[Path] = typer.Argument(None, help="Extra folders to search for *.toml recipes."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the shipped recipes and those in any folder given."""
    from hpref.recipe.catalog import list_recipes

    rows = list_recipes(list(folders or []))
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="recipes")
    for column in ("name", "model", "dataset", "description"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(*(escape(r[k]) for k in ("name", "model", "dataset", "description")))
    _console().print(table)


@recipes_app.command("show")
def recipes_show(
    recipe: str = typer.Argument(..., help="Recipe file or shipped recipe name."),
    overrides: list[str] = SetOption,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of TOML."),
) -> None:
    """Print the fully resolved recipe: overrides applied, every default filled in."""
    from hpref.recipe import load_recipe

    resolved = load_recipe(resolve_recipe_path(recipe), overrides)
    if as_json:
        typer.echo(json.dumps(resolved.to_dict(), indent=2))
    else:
        typer.echo(resolved.to_toml(), nl=False)


@recipes_app.command("check")
def recipes_check(
    recipes: list[str] = typer.Argument(..., help="Recipe files or shipped recipe names."),
    overrides: list[str] = SetOption,
    portable: bool = typer.Option(
        False,
        "--portable",
        help="Skip what depends on this machine (CUDA, flash-attn, data files), for another machine.",
    ),
) -> None:
    """Validate recipes as `hpref train` does before it starts anything; exit 2 on the first error.

    The schema, every component's parameters, and what training needs (a model, training data,
    settings this machine can run: `hpref.train.checks`)."""
    from hpref.check.command import check_recipes

    for line in check_recipes(recipes, overrides, portable=portable):
        typer.echo(line)


# --------------------------------------------------------------------------------------------------
# training


@app.command("init")
def init_command(
    recipe: str = typer.Argument(..., help="Recipe file or shipped recipe name."),
    overrides: list[str] = SetOption,
) -> None:
    """Build the recipe's model (backbone + new head), save it as safetensors in the run folder, exit."""
    from hpref.train.command import InitRequest
    from hpref.train.command import init_command as run_init_command

    folder = run_init_command(InitRequest(resolve_recipe_path(recipe), tuple(overrides)))
    typer.echo(str(folder))


@app.command("train")
def train_command(
    recipe: str = typer.Argument(..., help="Recipe file or shipped recipe name."),
    overrides: list[str] = SetOption,
    log: list[str] = LogOption,
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", min=1, help="Processes per node (default: GPUs, else launch.nproc)."
    ),
    nnodes: int | None = typer.Option(
        None, "--nnodes", min=1, help="Number of nodes (default: launch.nnodes)."
    ),
    node_rank: int | None = typer.Option(None, "--node-rank", min=0, help="This node's rank."),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of the torchrun rendezvous (default: a free local port)."
    ),
    rdzv_timeout: int | None = typer.Option(
        None, "--rdzv-timeout", min=1, help="Seconds a node waits for the others (launch.rdzv_timeout_s)."
    ),
    resume: str | None = typer.Option(
        None, "--resume", help="'auto' (latest complete checkpoint) or a path."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the launch command and resolved recipe."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Delete the run already in the run folder (only the files hpref wrote) and start afresh.",
    ),
) -> None:
    """Train a preference model: FSDP2 processes through torchrun (one process runs in-process)."""
    from hpref.train.command import TrainRequest
    from hpref.train.command import train_command as run_train_command

    request = TrainRequest(
        resolve_recipe_path(recipe), tuple(overrides), nproc_per_node=nproc_per_node, nnodes=nnodes,
        node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_timeout=rdzv_timeout, resume=resume,
        dry_run=dry_run, overwrite=overwrite, log=tuple(log),
    )  # fmt: skip
    raise typer.Exit(run_train_command(request))


@app.command("rl")
def rl_command(
    recipe: str = typer.Argument(..., help="Recipe file or shipped recipe name with an rl section."),
    policies: str = typer.Option(
        ..., "--policies", help="Policy ids to run, comma-separated; the first leads."
    ),
    overrides: list[str] = SetOption,
    log: list[str] = LogOption,
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="An existing Ray cluster (default: start a local one)."
    ),
    resume: str | None = typer.Option(None, "--resume", help="'auto' or a run folder to resume from."),
    plan: bool = typer.Option(
        False,
        "--plan",
        help="Print where every actor would go (node, CPUs, GPU ids) and its memory estimate, then exit "
        "without starting anything (exit 2 when something does not fit); with --ray-address, that cluster's "
        "nodes, joined read-only.",
    ),
) -> None:
    """Multi-policy RL on Ray: several policies trained at once on shared rollouts, led by the first."""
    from hpref.rl.command import RlRequest
    from hpref.rl.command import rl_command as run_rl_command

    request = RlRequest(
        resolve_recipe_path(recipe), policies, tuple(overrides), ray_address=ray_address, resume=resume,
        plan=plan, log=tuple(log),
    )  # fmt: skip
    raise typer.Exit(run_rl_command(request))


@app.command("rl-warmup")
def rl_warmup_command(
    recipe: str = typer.Argument(..., help="Recipe file or shipped recipe name with an rl.warmup table."),
    policies: str | None = typer.Option(
        None, "--policies", help="Policy ids to warm up, comma-separated (default: every policy)."
    ),
    overrides: list[str] = SetOption,
) -> None:
    """Build (or find in the cache) the supervised warm-up checkpoints `hpref rl` starts policies from.

    `hpref rl` does the same on its own before the first rollout; this command does it ahead of time
    and prints one line per policy: its id, a tab, the checkpoint folder (a transformers causal LM).
    """
    from hpref.rl.command import WarmupRequest, warmup_lines

    for line in warmup_lines(WarmupRequest(resolve_recipe_path(recipe), policies, tuple(overrides))):
        typer.echo(line)


# --------------------------------------------------------------------------------------------------
# evaluation and export


@app.command("eval")
def eval_cmd(
    recipe: str | None = typer.Argument(
        None, help="Recipe file or shipped recipe name (model, data, formatter)."
    ),
    checkpoint: Path | None = typer.Option(
        None, "--checkpoint", help="An export folder (hpref save), a checkpoint folder or a run folder."
    ),
    data: Path | None = typer.Option(
        None, "--data", help="Battles to score (default: the recipe's eval set)."
    ),
    out: Path | None = typer.Option(None, "--out", help="Predictions file: .csv, .parquet or .jsonl."),
    tta: str = typer.Option("none", "--tta", help="none | swap (score both A/B orders and average)."),
    ensemble: list[Path] = typer.Option([], "--ensemble", help="Prediction files to blend (repeatable)."),
    weights: str | None = typer.Option(None, "--weights", help="Ensemble weights, e.g. 2,1."),
    fit_weights: bool = typer.Option(False, "--fit-weights", help="Fit ensemble weights on labelled --data."),
    soft_labels: Path | None = typer.Option(
        None, "--soft-labels", help="Write the blend joined with --data as a soft-label arena file."
    ),
    micro_batch_tokens: int | None = typer.Option(None, "--micro-batch-tokens", min=16, help="Token budget."),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="Save a reliability diagram PNG."),
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", min=1, help="Score with N processes through torchrun (gathered on rank 0)."
    ),
    overrides: list[str] = SetOption,
) -> None:
    """Predict (Kaggle format), score with log loss / accuracy / ECE, swap TTA, blend ensembles."""
    from hpref.evaluate.command import EvalRequest, eval_command

    request = EvalRequest(
        resolve_recipe_path(recipe) if recipe else None, checkpoint=checkpoint, data=data, out=out,
        tta=tta, ensemble=tuple(ensemble), weights=weights, fit_weights=fit_weights,
        soft_labels=soft_labels, overrides=tuple(overrides), micro_batch_tokens=micro_batch_tokens,
        plot=plot, nproc_per_node=nproc_per_node,
    )  # fmt: skip
    raise typer.Exit(eval_command(request))


@app.command("save")
def save_cmd(
    run_dir: Path = typer.Argument(..., help="A train or rl run folder (or one of its saves)."),
    to: Path | None = typer.Option(None, "--to", help="Export folder to write (HF-style, self-contained)."),
    step: str = typer.Option("latest", "--step", help="Step number, rl: rollout-N, or latest."),
    dtype: str = typer.Option("fp32", "--dtype", help="bf16 | fp32 weights in the export."),
    now: bool = typer.Option(False, "--now", help="Ask the live run to checkpoint now; print its path."),
    timeout: float = typer.Option(1800, "--timeout", help="With --now: seconds to wait for the checkpoint."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace an earlier hpref export at --to (never a folder holding anything else).",
    ),
    recipe: Path | None = typer.Option(
        None,
        "--recipe",
        help="Recipe (default: the run folder's recipe.toml, which may not enable trust_remote_code).",
    ),
    adapter: bool = typer.Option(
        False,
        "--adapter",
        help="LoRA run: write PEFT's adapter folder + hpref's head instead of merged weights.",
    ),
    policy: str | None = typer.Option(None, "--policy", help="rl run: the policy to export (a causal LM)."),
) -> None:
    """Export a checkpoint as an HF-style folder with a model card, or checkpoint a live run (--now)."""
    from hpref.save.command import SaveRequest, save_command

    request = SaveRequest(
        run_dir, to=to, step=step, dtype=dtype, now=now, timeout=timeout, overwrite=overwrite,
        recipe=recipe, adapter=adapter, policy=policy,
    )  # fmt: skip
    raise typer.Exit(save_command(request))


@app.command("serve")
def serve_cmd(
    export: Path = typer.Argument(..., help="An export folder (hpref save): a judge or a reward model."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (default: loopback only)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="HTTP port."),
    replicas: int = typer.Option(
        1, "--replicas", min=1, help="Copies of the model, each a Ray Serve replica."
    ),
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="An existing Ray cluster (default: start a local one)."
    ),
    token_file: Path | None = typer.Option(
        None, "--token-file", help="File with a bearer token every request must send."
    ),
    threads: int | None = typer.Option(
        None, "--threads", min=1, help="torch threads (and Ray CPUs) per replica (default: cores / replicas)."
    ),
    max_batch_size: int = typer.Option(
        32, "--max-batch-size", min=1, help="Concurrent requests scored together in one packed pass."
    ),
    precision: Literal["auto", "fp32", "bf16"] = typer.Option(
        "auto", "--precision", help="Compute dtype (auto: the one measured faster on this CPU)."
    ),
    max_queued: int = typer.Option(
        64,
        "--max-queued",
        min=0,
        help="Requests waiting per replica once it holds 2 x --max-batch-size (past it: 503, Retry-After).",
    ),
    request_timeout: float = typer.Option(
        60.0,
        "--request-timeout",
        min=0.001,
        help="Seconds a request may take when it sends no X-Request-Timeout header; past it: 504.",
    ),
    drain_timeout: float = typer.Option(
        30.0,
        "--drain-timeout",
        min=0.0,
        help="On SIGTERM or Ctrl-C, seconds the requests in flight have to finish.",
    ),
) -> None:
    """Serve an exported judge or reward model over HTTP on Ray Serve (hpref's, OpenRLHF's, miles' shapes)."""
    from hpref.serve.command import ServeRequest, serve_command

    request = ServeRequest(
        export, host=host, port=port, replicas=replicas, ray_address=ray_address, token_file=token_file,
        threads=threads, max_batch_size=max_batch_size, precision=precision, max_queued=max_queued,
        request_timeout_s=request_timeout, drain_timeout_s=drain_timeout,
    )  # fmt: skip
    raise typer.Exit(serve_command(request))


# --------------------------------------------------------------------------------------------------
# data


@data_app.command("stats")
def data_stats_command(
    source: str = typer.Argument(..., help="A data file (arena or chosen/rejected schema) or a recipe."),
    split: str = typer.Option("train", help="With a recipe: which dataset section, train or eval."),
    tokens: bool = typer.Option(
        False, "--tokens", help="Also format and tokenize, for token lengths and truncation."
    ),
    recipe_for_tokens: str | None = typer.Option(
        None,
        "--recipe",
        help="With a data file and --tokens: the recipe whose model, formatter and max_length to use.",
    ),
    on_error: str = typer.Option(
        "raise", "--on-error", help="With a data file: raise on a bad row, or skip and count it."
    ),
    ceilings: bool = typer.Option(
        False, "--ceilings", help="Synthetic arena: log loss of judges that have only some task skills."
    ),
    overrides: list[str] = SetOption,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """Rows read/used/skipped, label shares, turns, token lengths; the Bayes floor for synthetic data."""
    from hpref.stats.command import StatsRequest, stats_command
    from hpref.stats.counts import format_stats

    request = StatsRequest(
        source,
        split=split,
        tokens=tokens,
        recipe_for_tokens=recipe_for_tokens,
        on_error=on_error,
        ceilings=ceilings,
        overrides=tuple(overrides),
    )
    stats = stats_command(request)
    if as_json:
        typer.echo(json.dumps(stats, indent=2, default=str))
    else:
        typer.echo(format_stats(stats))


# --------------------------------------------------------------------------------------------------
# entry point


def _register_plugin_commands() -> None:
    from hpref.plugins import register_plugin_commands

    register_plugin_commands(app)


def _click_errors() -> tuple[type[Exception], type[Exception]]:
    """Click's `ClickException` and `Abort`, found through Typer's public `BadParameter`: recent Typer
    vendors click (`typer._click`), older Typer uses click itself, and both classes differ by version."""
    mro = typer.BadParameter.__mro__
    click_exception = next(c for c in mro if c.__name__ == "ClickException")
    return click_exception, typer.Abort


def _usage_line(exc: Exception) -> str:
    """A click usage error (unknown command or option, missing argument, bad flag value) as one line."""
    message = " ".join(exc.format_message().split())  # type: ignore[attr-defined]
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return f"error: {message}{hint}"


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the app and turns exceptions into exit codes."""
    from hpref.logs import cli_log_file, file_only, route_library_logs, setup_logging

    log_file = cli_log_file()
    setup_logging(log_file, console=True, level=os.environ.get("HPREF_LOG_LEVEL", "INFO"))
    route_library_logs()  # libraries' records to the log file: the console keeps hpref's lines
    click_exception, abort = _click_errors()
    try:
        _register_plugin_commands()
        # standalone_mode=False: click hands usage errors to us (one line below) instead of printing
        # its multi-line box, and returns the exit code of `typer.Exit` instead of exiting.
        code = app(args=argv, prog_name="hpref", standalone_mode=False)
    except UserError as exc:
        file_only().opt(exception=exc).debug("user error")
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click_exception as exc:
        # `hpref` or `hpref recipes` alone: the help is already printed; exit 2 as click does.
        if type(exc).__name__ != "NoArgsIsHelpError":
            typer.echo(_usage_line(exc), err=True)
        sys.exit(exc.exit_code)  # type: ignore[attr-defined]
    except (KeyboardInterrupt, abort):
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as exc:
        file_only().opt(exception=exc).error("internal error")
        typer.echo(f"internal error: {type(exc).__name__}: {exc} (traceback in {log_file})", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
