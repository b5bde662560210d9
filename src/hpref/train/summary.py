"""What a finished training run reports: `summary.json` and the table printed at the end.

Beside the run's own numbers, the eval log loss is put next to what cheap baselines reach on the
same battles: the synthetic arena's Bayes floor and baselines when the eval source can compute them
(`report()`), else a label-prior, length-only and bag-of-words baseline fitted on the train split
(`hpref.prediction.baselines`), whose eval predictions are written beside the model's so that `hpref eval
--ensemble` can blend them. A baseline is a nicety: failing to compute one never fails a run.
"""

from __future__ import annotations

from typing import Any

from loguru import logger

from hpref.train.metrics import peak_memory_gib


def summarise(setup: Any, stats: Any, wall: float) -> dict[str, Any]:
    """`summary.json` of a finished run: steps, throughput, MFU, memory, parameters, last eval.
    `setup` is the `TrainSetup`, `stats` the loop's `RunStats`."""
    out: dict[str, Any] = {
        "steps": stats.step,
        "total_steps": setup.total_steps,
        "world_size": setup.world_size,
        "wall_s": wall,
        "train_loss": stats.last_loss,
        "tokens_per_s": stats.tokens / stats.seconds if stats.seconds else None,
        "mfu": stats.flops / stats.seconds / setup.world_size / setup.peak.flops if stats.seconds else None,
        "peak": str(setup.peak),
        "peak_memory_gib": peak_memory_gib(setup.device),
    }
    from hpref.models.adapters import count_parameters

    out["trainable_params"], out["params"] = count_parameters(setup.model)
    if isinstance(stats.eval, dict):  # a `TrainObjective`'s eval (DPO): its metrics, eval_-prefixed
        out.update(stats.eval, eval_step=stats.eval_step)
    elif stats.eval is not None:
        out.update(
            eval_log_loss=stats.eval.log_loss, eval_accuracy=stats.eval.accuracy, eval_step=stats.eval_step
        )
    return out


def summary_rows(setup: Any, summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The printed summary's (name, value) rows; adds the eval baselines to `summary`."""
    rows = [
        ("steps", f"{summary['steps']} of {summary['total_steps']} on {summary['world_size']} rank(s)"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("train loss (last log)", f"{summary['train_loss']:.4f}"),
    ]
    if summary.get("tokens_per_s"):
        rows.append(("tokens/s (all ranks)", f"{summary['tokens_per_s']:,.0f}"))
        rows.append(("MFU", f"{summary['mfu']:.2%} of {summary['peak']}"))
    rows.append(("peak memory (rank 0)", f"{summary['peak_memory_gib']:.2f} GiB"))
    if summary["trainable_params"] != summary["params"]:
        share = summary["trainable_params"] / summary["params"]
        rows.append(
            (
                "trainable parameters",
                f"{summary['trainable_params']:,} of {summary['params']:,} ({share:.2%})",
            )
        )
    for key, name in (
        ("eval_loss", "eval loss"),
        ("eval_rewards_accuracy", "eval reward accuracy"),
        ("eval_rewards_margin", "eval reward margin"),
        ("eval_tie_reward_gap", "eval tie reward gap"),
    ):
        if key in summary:
            rows.append((name, f"{summary[key]:.4f}"))
    if "eval_log_loss" in summary:
        rows.append(("eval log loss", f"{summary['eval_log_loss']:.4f}"))
        rows.append(("eval accuracy", f"{summary['eval_accuracy']:.3f}"))
        report = _baselines(setup)
        if report is None:
            rows += _cheap_baseline_rows(setup, summary)
        else:
            summary["baselines"] = report.as_dict()
            summary["gap_closed"] = report.closed(summary["eval_log_loss"])
            rows += [
                ("uniform", f"{report.uniform:.4f}"),
                ("length-only baseline", f"{report.length_baseline:.4f}"),
                ("bag-of-words baseline", f"{report.bow_baseline:.4f}"),
                ("Bayes floor", f"{report.bayes_floor:.4f}"),
                ("gap closed (uniform -> floor)", f"{summary['gap_closed']:.0%}"),
            ]
    return rows


# bag-of-words features are a dense [n, 2 x vocab] matrix: past this many train battles only the
# label prior and the length baseline are fitted (the Kaggle LMSYS train set has 57k)
BOW_BASELINE_MAX_BATTLES = 20_000


def _cheap_baseline_rows(setup: Any, summary: dict[str, Any]) -> list[tuple[str, str]]:
    """On data without a known floor (real arena votes, chosen/rejected pairs): the eval log loss
    beside what the train split's label prior, answer lengths, answer layout and word counts reach, fitted
    on the train split and scored on the same eval battles. A model that does not beat these has
    learned nothing about the answers."""
    if setup.train_source is None or setup.eval_source is None:
        return []
    from hpref.prediction.baselines import baseline_probabilities, score_baselines
    from hpref.prediction.files import write_predictions
    from hpref.runfolder.layout import BASELINE_PREDICTIONS, PREDICTIONS, PREDICTIONS_DIR

    try:
        train = [b for b in setup.train_source.battles() if b.label is not None]
        evaluation = [b for b in setup.eval_source.battles() if b.label is not None]
        probs = baseline_probabilities(train, evaluation, bow=len(train) <= BOW_BASELINE_MAX_BATTLES)
        cheap = score_baselines(probs, len(train), evaluation)
        ids, folder = [b.id for b in evaluation], setup.run_dir / PREDICTIONS_DIR
        files = [
            write_predictions(folder / BASELINE_PREDICTIONS.format(name=name), ids, p, unique_ids=False)
            for name, p in probs.items()
        ]
    except Exception as exc:  # a baseline is a nicety; never fail a finished run over it
        logger.warning(f"could not compute the eval baselines: {exc}")
        return []
    logger.info(
        f"the baselines' eval predictions, to blend with the model's ({setup.run_dir / PREDICTIONS}) "
        f"through hpref eval --ensemble ... --fit-weights: {', '.join(str(f) for f in files)}"
    )
    summary["baselines"] = cheap.as_dict()
    rows = [
        ("label-prior baseline", f"{cheap.prior:.4f}"),
        ("length-only baseline", f"{cheap.length:.4f}"),
    ]
    rows.append(("style baseline", f"{cheap.style:.4f}"))
    if cheap.bow is not None:
        rows.append(("bag-of-words baseline", f"{cheap.bow:.4f}"))
    best = min(v for v in (cheap.prior, cheap.length, cheap.style, cheap.bow) if v is not None)
    rows.append(("vs best cheap baseline", f"{summary['eval_log_loss'] - best:+.4f} nats"))
    blended = _cross_fitted_blend(setup.run_dir / PREDICTIONS, ids, probs["style"], evaluation)
    if blended is not None:
        summary["blend_with_style"] = blended
        rows.append(("model + style blend (cross-fitted)", f"{blended:.4f}"))
    return rows


def _cross_fitted_blend(
    model_file: Any, ids: list[str], baseline: Any, evaluation: list[Any]
) -> float | None:
    """The log loss of the model's eval predictions blended with a baseline's, each row's weights
    fitted on the other 4 of 5 folds of the eval split (`hpref.prediction.blend`): the cheap way
    to add what the baseline knows (answer layout, on arena votes) to what the model read, told
    honestly (in-sample weights would flatter the blend). None when the model's file does not
    cover exactly these battles (repeated ids): `hpref eval --ensemble` is the general tool."""
    import numpy as np

    from hpref.prediction.baselines import labels_of
    from hpref.prediction.blend import cross_fitted_mixture_loss
    from hpref.prediction.files import read_predictions

    try:
        if len(set(ids)) != len(ids):
            return None
        model = read_predictions(model_file).reorder(ids)
        return cross_fitted_mixture_loss(np.stack([model.probs, baseline]), labels_of(evaluation))
    except Exception as exc:  # a nicety, as the baselines are
        logger.warning(f"could not blend the model with the style baseline: {exc}")
        return None


def _baselines(setup: Any) -> Any:
    """The eval source's floor and cheap baselines, when it can compute them (the synthetic arena)."""
    report = getattr(setup.eval_source, "report", None)
    if report is None:
        return None
    try:
        return report()
    except Exception as exc:  # a report is a nicety; never fail a finished run over it
        logger.warning(f"could not compute the eval baselines: {exc}")
        return None
