"""Training metrics: throughput, MFU, memory; `metrics.jsonl` and the end-of-run summary table.

MFU is `flops_per_token(effective length) x tokens/s per device / peak`; the peak, and how it was
obtained, is `hpref.runtime.peak`'s (the RL trainer's MFU uses the same).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from hpref.runfolder.files import append_json_line, read_json_lines, write_text_atomic


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated on a GPU, max RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform != "darwin" else rss / 2**30  # KiB on Linux, bytes on macOS


class MetricsFile:
    """Appends one JSON object per line to `metrics.jsonl` (rank 0 only; other ranks pass None), and
    hands each record to the run's metric loggers (`loggers`: `hpref.builtin.loggers.MetricLoggers`,
    set on rank 0 by `start_run`)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.loggers: Any = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def start(self, resumed_step: int | None) -> None:
        """Make the file describe one history. A fresh run (`None`) starts an empty file; a resumed
        run keeps the records up to the checkpoint's step and drops the later ones, which the
        interrupted run wrote after its last save and this run is about to write again."""
        if self.path is None or not self.path.exists():
            return
        kept = []
        if resumed_step is not None:
            kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= resumed_step]
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            append_json_line(self.path, record)  # a log: appended (`hpref.runfolder.files`)
        if self.loggers:
            self.loggers.train_record(record)

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The end-of-run baselines (what the summary table prints beside the eval log loss), as
        `eval/baseline_<name>` at the last eval's step (`fit` closes the loggers after it)."""
        if not self.loggers:
            return
        baselines = summary.get("baselines") or {}
        values = {f"eval/baseline_{k}": float(v) for k, v in baselines.items() if isinstance(v, int | float)}
        if isinstance(summary.get("gap_closed"), int | float):
            values["eval/gap_closed"] = float(summary["gap_closed"])
        self.loggers.emit(values, int(summary.get("eval_step") or summary.get("steps") or 0), "eval/step")

    def close(self) -> None:
        if self.loggers:
            self.loggers.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """`metrics.jsonl`'s records (a last line cut by a crash is dropped: `read_json_lines`)."""
    return read_json_lines(path)


def summary_table(rows: list[tuple[str, str]], title: str = "hpref train") -> Any:
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table
