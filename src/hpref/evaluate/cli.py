"""Bodies of `hpref eval` and `hpref save`: plain arguments in, an exit code out.

`hpref.cli` owns the Typer signatures and calls these; every user mistake raises a `UserError`
(one line, exit 2), which the CLI's `main` already turns into its message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loguru import logger

from hpref.errors import UserError


def _print(renderable: Any) -> None:
    from rich.console import Console

    Console().print(renderable)


def _report(
    preds: Any, battles: list[Any] | None, out_path: Path, *, source: str, extra: dict[str, Any], plot: bool
):
    """Score `preds` against labelled `battles` (when labelled): the table, and the metrics JSON and
    reliability PNG named after the predictions file (`layout.side_files`)."""
    from hpref.evaluate.ensemble import labels_for
    from hpref.evaluate.metrics import compute_metrics, metrics_table, write_metrics_json
    from hpref.runfolder.layout import side_files

    if battles is None or not battles or any(b.label is None for b in battles):
        return None
    labels, truth = labels_for(preds, battles, source=source)
    metrics = compute_metrics(preds.probs, labels, truth)
    metrics.extra.update(extra)
    metrics_path, png_path = side_files(out_path)
    path = write_metrics_json(metrics_path, metrics)
    _print(metrics_table(metrics, title=f"hpref eval: {source}"))
    logger.info(f"metrics written to {path}")
    if plot:
        from hpref.evaluate.plots import reliability_diagram

        try:
            png = reliability_diagram(metrics, png_path, title=source)
            logger.info(f"reliability diagram written to {png}")
        except UserError as exc:  # a missing plot must not fail an evaluation
            logger.warning(str(exc))
    return metrics


def eval_command(
    recipe: str | Path | None,
    *,
    checkpoint: str | Path | None = None,
    data: str | Path | None = None,
    out: str | Path | None = None,
    tta: str = "none",
    ensemble: list[str | Path] | None = None,
    weights: str | None = None,
    fit_weights: bool = False,
    soft_labels: str | Path | None = None,
    overrides: list[str] | None = None,
    micro_batch_tokens: int | None = None,
    plot: bool = True,
    device: str = "cpu",
    nproc_per_node: int | None = None,
) -> int:
    """`hpref eval`: predictions for every battle (model or ensemble), metrics when labelled.

    With `nproc_per_node > 1` the model's predictions are computed by that many processes started
    through torchrun (see `hpref.evaluate.worker`); rank 0 writes every output.
    """
    from hpref.evaluate.ensemble import blend, labels_for, parse_weights, read_battles, write_soft_labels
    from hpref.evaluate.ensemble import fit_weights as fit
    from hpref.evaluate.predictions import read_predictions, write_predictions

    if tta not in ("none", "swap"):
        raise UserError(f"--tta {tta!r}: expected none or swap")
    _check_outputs(out=out, soft_labels=soft_labels)
    if nproc_per_node is not None and nproc_per_node > 1:
        if ensemble:
            raise UserError(
                "--nproc-per-node applies to model predictions; an --ensemble blend runs in one process"
            )
        if checkpoint is None or recipe is None:
            raise UserError("--nproc-per-node needs a recipe and --checkpoint")
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            from hpref.evaluate.worker import launch_eval
            from hpref.recipe import load_recipe

            spec = {
                "recipe": str(recipe), "checkpoint": str(checkpoint), "data": data and str(data),
                "out": out and str(out), "tta": tta, "weights": weights, "fit_weights": fit_weights,
                "soft_labels": soft_labels and str(soft_labels), "overrides": list(overrides or []),
                "micro_batch_tokens": micro_batch_tokens, "plot": plot,
            }  # fmt: skip
            run_dir = load_recipe(recipe, overrides).run.run_dir
            return launch_eval(spec, nproc_per_node, run_dir)
    battles = read_battles(data) if data is not None else None
    source = str(data) if data is not None else "dataset.eval"
    extra: dict[str, Any] = {}

    if ensemble:
        if checkpoint is not None:
            raise UserError("--ensemble blends prediction files; it cannot be combined with --checkpoint")
        members = [read_predictions(p) for p in ensemble]
        if fit_weights:
            if battles is None:
                raise UserError("--fit-weights needs labelled --data to fit on")
            labels, _ = labels_for(members[0], battles, source=source)
            w = fit(members, labels)
        else:
            w = parse_weights(weights, len(members))
        preds = blend(members, w)
        extra["weights"] = [float(v) for v in w]
        out_path = Path(out) if out is not None else Path("blend.csv")
    else:
        if recipe is None or checkpoint is None:
            raise UserError("hpref eval needs a RECIPE and --checkpoint (or --ensemble FILES)")
        preds, out_path, battles, extra = _predict_with_model(
            recipe,
            checkpoint,
            battles,
            out,
            tta=tta,
            overrides=overrides,
            mbt=micro_batch_tokens,
            device=device,
        )
        if data is None:
            source = "dataset.eval"
        if _rank() != 0:  # every rank holds the gathered predictions; one writes them
            return 0
    write_predictions(out_path, preds.ids, preds.probs)
    logger.info(f"predictions for {len(preds):,} battles written to {out_path}")
    if soft_labels is not None:
        if battles is None:
            raise UserError("--soft-labels needs the battles the predictions are for (--data)")
        path = write_soft_labels(soft_labels, preds, battles, source=source)
        logger.info(f"soft-label training file written to {path}")
    _report(preds, battles, out_path, source=source, extra=extra, plot=plot)
    if "rows_per_s" in extra:
        print(f"eval throughput: {extra['rows_per_s']:,.1f} rows/s ({extra['sequences']:,} sequences)")
    return 0


def _check_outputs(**paths: str | Path | None) -> None:
    """Refuse an output that would land in a run's own files or a checkpoint (a predictions file in
    `checkpoints/` would be pruned with it, or break it), before any model is loaded."""
    from hpref.runfolder.layout import owner_of, side_files

    for option, path in paths.items():
        if path is None:
            continue
        targets = (Path(path), *side_files(path)) if option == "out" else (Path(path),)
        for target in targets:
            reason = owner_of(target)
            if reason is not None:
                flag = "--" + option.replace("_", "-")
                raise UserError(f"{flag} {path}: {reason}; write outputs outside it")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _predict_with_model(recipe_arg, checkpoint, battles, out, *, tta, overrides, mbt, device):
    from hpref.evaluate.predictions import Predictions
    from hpref.evaluate.runner import build_formatter, load_model, predict
    from hpref.plugins import load_plugins
    from hpref.recipe import load_recipe

    recipe = load_recipe(recipe_arg, overrides)
    if battles is None:
        if recipe.dataset.eval is None:
            raise UserError("no --data and the recipe has no [dataset.eval] section: nothing to evaluate")
        section = recipe.dataset.eval
        source = load_plugins().get("dataset", section.name).build(section.config, recipe.run.seed)
        battles = list(source.battles())
    from hpref.models.adapters import is_adapter_export, load_adapter_export

    if is_adapter_export(checkpoint):  # `hpref save --adapter`: base + PEFT adapter + head
        model = load_adapter_export(checkpoint, device=device)
    else:
        model = load_model(checkpoint, recipe, device=device)
    formatter = build_formatter(recipe, model.tokenizer)
    result = predict(
        model,
        battles,
        formatter,
        micro_batch_tokens=mbt or recipe.train.micro_batch_tokens,
        tta=tta == "swap",
        device=device,
    )
    out_path = Path(out) if out is not None else recipe.run.run_dir / "eval" / "predictions.csv"
    extra = {
        "checkpoint": str(checkpoint),
        "tta": tta,
        "rows_per_s": result.rows_per_s,
        "sequences": result.sequences,
        "tokens": result.tokens,
        "eval_seconds": result.seconds,
        "world_size": result.world_size,
    }
    return Predictions(result.ids, result.probs, source=str(checkpoint)), out_path, battles, extra


def save_command(
    run_dir: str | Path,
    *,
    to: str | Path | None = None,
    step: str = "latest",
    dtype: str = "fp32",
    now: bool = False,
    timeout: float = 1800.0,
    overwrite: bool = False,
    recipe: str | Path | None = None,
    adapter: bool = False,
) -> int:
    """`hpref save`: export a checkpoint (`--to`), or with `--now` ask a live run for one first.
    A LoRA run exports merged weights, or with `adapter` PEFT's adapter folder and hpref's head."""
    from hpref.evaluate.export import save_export
    from hpref.runfolder.save_trigger import request_save_now

    if now:
        path = request_save_now(run_dir, timeout=timeout)
        print(path)
        if to is None:
            return 0
        step = str(path)
    if to is None:
        raise UserError("hpref save needs --to DIR (or --now to only trigger a checkpoint)")
    source: str | Path = step if now else run_dir
    folder = save_export(
        source,
        to,
        step=None if now else step,  # type: ignore[arg-type]
        dtype=dtype,  # type: ignore[arg-type]
        recipe_path=recipe,
        overwrite=overwrite,
        adapter=adapter,
    )
    print(folder)
    return 0
