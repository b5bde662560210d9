"""The body of `hpref eval` on one process (or one rank of several): predict, write, score.

A model (export folder, adapter export, checkpoint or run folder) + battles -> views (each battle,
and its swap with `--tta swap`) tokenized by the recipe's formatter at the recipe's max_length,
exactly as in training (`hpref.data.cache.encode_views`) -> probabilities per battle -> the
predictions file, all in `hpref.prediction.evaluation.evaluate_battles`, the call the train loop's
eval makes too (packed micro-batches, all_gather over ranks when a process group is up, swapped views
mapped back and averaged, rank 0 writing). Or an ensemble: prediction files blended by id. Then rank
0 writes the predictions, the optional soft-label file, and, for labelled battles, `metrics.json`,
the table and the reliability diagram (`hpref.prediction.metrics`).

`hpref.evaluate.command.eval_command` calls `run_eval` in its own process, or starts N ranks through
`hpref.evaluate.launch`, each of which (`hpref.evaluate.worker`) calls `run_eval`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from hpref.data.records import Battle
from hpref.errors import UserError
from hpref.exports.layout import is_adapter_export, is_export_folder
from hpref.prediction.evaluation import evaluate_battles
from hpref.protocols import Formatter, PreferenceModel
from hpref.runfolder.layout import EVAL, EVAL_PREDICTIONS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hpref.evaluate.request import EvalRequest
    from hpref.recipe import Recipe


def load_model(source: str | Path, recipe: Recipe | None = None, *, device: Any = "cpu") -> PreferenceModel:
    """An export folder (`hpref save` output), a checkpoint folder or a run folder (latest checkpoint)."""
    from hpref.models.preference import PreferenceModel
    from hpref.runfolder.checkpoints import resolve_checkpoint
    from hpref.runtime.checkpoint import load_model_from_checkpoint

    source = Path(source)
    if is_export_folder(source):
        model = PreferenceModel.from_pretrained(source, device=device)
    else:
        model = load_model_from_checkpoint(resolve_checkpoint(source), recipe, device=str(device)).model
    model.eval()
    return model


def formatter_for(
    recipe: Recipe | None, tokenizer: PreTrainedTokenizerBase, max_length: int | None = None
) -> Formatter:
    """The recipe's formatter at the recipe's (or the given) max_length; `pab` without a recipe."""
    from hpref.components import Components, default_formatter

    if recipe is None:
        return default_formatter(tokenizer, max_length)
    return Components(recipe).formatter(tokenizer, max_length)


# --------------------------------------------------------------------------------------------------
# hpref eval


def run_eval(request: EvalRequest, *, device: str = "cpu") -> int:
    """Predictions for every battle (model or ensemble), metrics when labelled; the exit code.

    Collective for a model under a process group: every rank predicts its share, rank 0 writes."""
    from hpref.evaluate.ensemble import (
        blend,
        cross_fitted_log_loss,
        labels_for,
        parse_weights,
        read_battles,
        write_soft_labels,
    )
    from hpref.evaluate.ensemble import fit_weights as fit
    from hpref.prediction.files import read_predictions, write_predictions

    data, out, ensemble, checkpoint = request.data, request.out, request.ensemble, request.checkpoint
    battles = read_battles(data) if data is not None else None
    source = str(data) if data is not None else "dataset.eval"
    extra: dict[str, Any] = {}

    if ensemble:
        if checkpoint is not None:
            raise UserError("--ensemble blends prediction files; it cannot be combined with --checkpoint")
        members = [read_predictions(p) for p in ensemble]
        if request.fit_weights:
            if battles is None:
                raise UserError("--fit-weights needs labelled --data to fit on")
            labels, _ = labels_for(members[0], battles, source=source)
            w = fit(members, labels)
            if len(members) > 1:  # what the fitted weights are worth on rows they did not see
                extra["cross_fitted_log_loss"] = cross_fitted_log_loss(members, labels)
                print(
                    f"blend log loss with weights fitted on the other 4 of 5 folds: "
                    f"{extra['cross_fitted_log_loss']:.4f} (the table below is in-sample)"
                )
        else:
            w = parse_weights(request.weights, len(members))
        preds = blend(members, w)
        extra["weights"] = [float(v) for v in w]
        out_path = Path(out) if out is not None else Path("blend.csv")
    else:
        if request.recipe is None or checkpoint is None:
            raise UserError("hpref eval needs a RECIPE and --checkpoint (or --ensemble FILES)")
        preds, out_path, battles, extra = _predict_with_model(request, battles, device=device)
        if _rank() != 0:  # every rank holds the gathered predictions; rank 0 has written them
            return 0
    if ensemble:
        write_predictions(out_path, preds.ids, preds.probs)
    logger.info(f"predictions for {len(preds):,} battles written to {out_path}")
    if request.soft_labels is not None:
        if battles is None:
            raise UserError("--soft-labels needs the battles the predictions are for (--data)")
        path = write_soft_labels(request.soft_labels, preds, battles, source=source)
        logger.info(f"soft-label training file written to {path}")
    _report(preds, battles, out_path, source=source, extra=extra, plot=request.plot)
    if "rows_per_s" in extra:
        print(f"eval throughput: {extra['rows_per_s']:,.1f} rows/s ({extra['sequences']:,} sequences)")
    return 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _predict_with_model(request: EvalRequest, battles: list[Battle] | None, *, device: str):
    from hpref.components import Components
    from hpref.evaluate.adapter_export import load_adapter_export
    from hpref.prediction.files import Predictions
    from hpref.recipe import load_recipe

    checkpoint, out, tta = request.checkpoint, request.out, request.tta
    assert checkpoint is not None
    recipe = load_recipe(request.recipe, list(request.overrides))
    if battles is None:
        source = Components(recipe).source("eval")
        if source is None:
            raise UserError("no --data and the recipe has no [dataset.eval] section: nothing to evaluate")
        battles = list(source.battles())
    if is_adapter_export(checkpoint):  # `hpref save --adapter`: base + PEFT adapter + head
        model = load_adapter_export(checkpoint, device=device)
    else:
        model = load_model(checkpoint, recipe, device=device)
    out_path = Path(out) if out is not None else recipe.run.run_dir / EVAL / EVAL_PREDICTIONS
    result = evaluate_battles(  # rank 0 writes the predictions file
        model,
        battles,
        formatter=formatter_for(recipe, model.tokenizer),
        tta=tta == "swap",
        micro_batch_tokens=request.micro_batch_tokens or recipe.train.micro_batch_tokens,
        device=device,
        write_to=[out_path],
    )
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


def _print(renderable: Any) -> None:
    from rich.console import Console

    Console().print(renderable)


def _report(
    preds: Any, battles: list[Any] | None, out_path: Path, *, source: str, extra: dict[str, Any], plot: bool
):
    """Score `preds` against labelled `battles` (when labelled): the table, and the metrics JSON and
    reliability PNG named after the predictions file (`layout.side_files`)."""
    from hpref.evaluate.ensemble import labels_for
    from hpref.prediction.metrics import compute_metrics, metrics_table, write_metrics_json
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
