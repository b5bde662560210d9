"""The numbers `hpref data stats FILE-or-recipe` prints.

`open_data_file(path)` picks the reader from the file's columns (arena schema, or chosen/rejected);
`data_stats(source, formatter=None)` streams the source once and returns a JSON-able dict: the read
summary, label shares, turns per battle and, with a formatter, the token-length distribution after
formatting and the share of battles truncated. For the synthetic arena it adds the uniform log loss,
the Bayes floor and the two baselines — also for a file that carries the true `p_a, p_b, p_tie` of
every labeled row (an exported synthetic arena), split 5-fold by prompt, fold 0 held out, as the
component does. `format_stats` renders that dict as short lines of text.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from hpref.data.base import BattleSource
from hpref.data.readers import (
    ARENA_TEXT_COLUMNS,
    ArenaConfig,
    ArenaReader,
    PairwiseConfig,
    PairwiseReader,
    open_table,
)
from hpref.errors import DataError
from hpref.protocols import Formatter

DUPLICATE_EXAMPLES = 5


def open_data_file(path: str | Path, seed: int = 0, on_error: str = "raise") -> BattleSource:
    """The right reader for a file: arena schema if it has prompt/response_a/response_b, pairwise if
    it has chosen/rejected."""
    columns = set(open_table(path).columns)
    if all(c in columns for c in ARENA_TEXT_COLUMNS):
        return ArenaReader(ArenaConfig(path=str(path), on_error=on_error), seed)
    if {"chosen", "rejected"} <= columns:
        return PairwiseReader(PairwiseConfig(path=str(path), on_error=on_error), seed)
    raise DataError(
        f"{path}: neither an arena file (prompt, response_a, response_b) nor a pairwise file (chosen, "
        f"rejected); found columns: {', '.join(sorted(columns)) or 'none'}"
    )


def _distribution(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    return {
        "min": int(a.min()),
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": int(a.max()),
    }


def data_stats(
    source: BattleSource, formatter: Formatter | None = None, *, chunk: int = 256, ceilings: bool = False
) -> dict[str, Any]:
    """Stream `source` once; see the module docstring for what is returned. `ceilings` adds, for
    the synthetic arena, the log loss a judge reaches per task skill it has (`skill_ceilings`)."""
    labels = np.zeros(3)
    labeled = 0
    turns: Counter[int] = Counter()
    lengths: list[int] = []
    full_lengths: list[int] = []
    truncated = 0
    pending = []
    seen_ids: set[str] = set()
    repeated_rows = 0
    repeated_ids: dict[str, None] = {}  # insertion-ordered: the first repeated ids come first

    def flush() -> None:
        nonlocal truncated
        for encoded in formatter.encode_many(pending):
            lengths.append(len(encoded.ids))
            full_lengths.append(encoded.full_length)
            truncated += bool(encoded.truncated)
        pending.clear()

    with_truth: list[Any] | None = [] if not hasattr(source, "report") else None
    for battle in source.battles():
        turns[len(battle.prompt)] += 1
        if battle.id in seen_ids:
            repeated_rows += 1
            repeated_ids[battle.id] = None
        else:
            seen_ids.add(battle.id)
        if with_truth is not None:
            if battle.truth is not None and battle.label is not None:
                with_truth.append(battle)
            else:
                with_truth = None  # one row without truth: no floor for this file
        if battle.label is not None:
            labels += battle.label
            labeled += 1
        if formatter is not None:
            pending.append(battle)
            if len(pending) >= chunk:
                flush()
    if formatter is not None:
        flush()
    summary = source.summary.as_dict()
    out: dict[str, Any] = {
        "summary": summary,
        "battles": summary["rows_used"],
        "labeled": labeled,
        "label_shares": dict(zip(("a", "b", "tie"), (labels / labeled).tolist(), strict=True))
        if labeled
        else {},
        "turns": dict(sorted(turns.items())),
        # hpref eval joins predictions to battles by id and refuses a file that repeats one, so a
        # file that passes stats silently would fail there; rows without an id column get one from
        # their content, so two identical rows repeat an id too.
        "duplicate_ids": {
            "rows": repeated_rows,
            "ids": len(repeated_ids),
            "examples": list(repeated_ids)[:DUPLICATE_EXAMPLES],
        },
    }
    if formatter is not None:
        out["max_length"] = getattr(formatter, "max_length", None)
        out["tokens"] = _distribution(lengths)
        out["tokens_untruncated"] = _distribution(full_lengths)
        out["truncated_share"] = truncated / len(lengths) if lengths else 0.0
    if hasattr(source, "report"):
        out["synthetic"] = source.report().as_dict()
    elif with_truth:
        from hpref.arena import arena_report
        from hpref.data.splits import FoldAssigner

        assigner = FoldAssigner(5, 0)
        folds = [assigner.fold_of(b) for b in with_truth]
        train = [b for b, f in zip(with_truth, folds, strict=True) if f != 0]
        held_out = [b for b, f in zip(with_truth, folds, strict=True) if f == 0]
        if train and held_out:
            out["synthetic"] = arena_report(train, held_out).as_dict()
    if ceilings and hasattr(source, "skill_ceilings"):
        out["skill_ceilings"] = source.skill_ceilings()
    return out


def format_stats(stats: dict[str, Any]) -> str:
    """Human-readable lines for `data_stats`' dict."""
    s = stats["summary"]
    lines = [
        f"source       {s['source']}",
        f"rows         {s['rows_read']} read, {s['rows_used']} used, {s['rows_skipped']} skipped, "
        f"{s['rows_other_split']} in other folds",
    ]
    lines += [f"  skipped    {n} x {reason}" for reason, n in s["skipped"].items()]
    if stats["label_shares"]:
        shares = stats["label_shares"]
        lines.append(f"labels       A {shares['a']:.1%}  B {shares['b']:.1%}  tie {shares['tie']:.1%}")
    else:
        lines.append("labels       none (unlabeled)")
    lines.append("turns        " + (", ".join(f"{k}: {v}" for k, v in stats["turns"].items()) or "none"))
    duplicates = stats.get("duplicate_ids", {})
    if duplicates.get("rows"):
        shown = ", ".join(repr(i) for i in duplicates["examples"])
        more = ", ..." if duplicates["ids"] > len(duplicates["examples"]) else ""
        lines.append(
            f"ids          {duplicates['rows']} rows repeat an earlier id ({shown}{more}): hpref eval "
            "refuses a file with duplicate ids (it joins predictions to battles by id)"
        )
    if "tokens" in stats and stats["tokens"]:
        t, u = stats["tokens"], stats["tokens_untruncated"]
        lines.append(
            f"tokens       p50 {t['p50']:.0f}  p90 {t['p90']:.0f}  p99 {t['p99']:.0f}  max {t['max']} "
            f"(max_length {stats['max_length']}; before truncation p99 {u['p99']:.0f}, max {u['max']})"
        )
        lines.append(f"truncated    {stats['truncated_share']:.1%} of battles")
    if "synthetic" in stats:
        r = stats["synthetic"]
        lines.append(
            f"synthetic    uniform {r['uniform']:.4f}  Bayes floor {r['bayes_floor']:.4f} "
            f"(expected entropy {r['expected_entropy']:.4f})"
        )
        lines.append(
            f"baselines    label prior {r['prior_baseline']:.4f} ({r['prior_closed']:.0%} of the gap)  "
            f"length-only {r['length_baseline']:.4f} ({r['length_closed']:.0%})  "
            f"bag-of-words {r['bow_baseline']:.4f} ({r['bow_closed']:.0%})"
        )
        gap = r["uniform"] - r["bayes_floor"]
        for i, (skills, value) in enumerate(stats.get("skill_ceilings", {}).items()):
            head = "ceilings     " if i == 0 else "             "
            lines.append(f"{head}{skills:<45} {value:.4f} ({(r['uniform'] - value) / gap:.0%} of the gap)")
    return "\n".join(lines)
