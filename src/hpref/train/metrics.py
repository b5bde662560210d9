"""Training metrics: throughput, MFU, memory; `metrics.jsonl` and the end-of-run summary table.

MFU is `flops_per_token(effective length) x tokens/s per device / peak`. The peak is stated with
every MFU number: `HPREF_PEAK_TFLOPS` when set, a datasheet value for known GPUs (a matmul measured
at start for unknown ones), and on a CPU the theoretical rate of the threads a rank uses:
threads x FLOP/cycle x clock, with 64 fp32 FLOP/cycle for AVX-512 (two 16-lane FMA units), 32 for
AVX2, and 1024 bf16 FLOP/cycle for AMX, at the clock the OS reports (nominal: turbo can beat it,
a calm 2-thread fp32 matmul reached 0.43 TFLOP/s against 0.33 stated at 2.6 GHz). A CPU peak is
not measured at start: on a shared machine a short burst measures the neighbours, not the hardware
(it gave 0.07 to 0.43 TFLOP/s for the same two fp32 threads here).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpref.runfolder.files import append_json_line, read_json_lines, write_text_atomic

#: Dense bf16 peak (no sparsity) in TFLOP/s, matched against `torch.cuda.get_device_name()`.
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "4090": 165.0,
}


@dataclass(frozen=True)
class Peak:
    flops: float  # per device, per second
    source: str  # how it was obtained, printed beside every MFU

    def __str__(self) -> str:
        return f"{self.flops / 1e12:.2f} TFLOP/s ({self.source})"


def measure_matmul_peak(dtype: torch.dtype, size: int = 1024, seconds: float = 0.3) -> float:
    """FLOP/s of a square matmul on the CPU in `dtype`, best of a short burst."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - t))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> Peak:
    env = os.environ.get("HPREF_PEAK_TFLOPS")
    if env:
        return Peak(float(env) * 1e12, "HPREF_PEAK_TFLOPS")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                scale = 1.0 if dtype != torch.float32 else 0.5  # TF32 tensor cores: half the bf16 rate
                return Peak(tflops * 1e12 * scale, f"{name} datasheet, dense")
        return Peak(measure_matmul_peak(dtype), f"{name}: measured matmul")
    return cpu_peak(dtype)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _cpu_ghz() -> float | None:
    for source in ("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq",):
        try:
            return int(Path(source).read_text()) / 1e6
        except (OSError, ValueError):
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.partition(":")[2]) / 1e3
    except (OSError, ValueError):
        pass
    return None


def cpu_peak(dtype: torch.dtype) -> Peak:
    """Theoretical peak of this rank's CPU threads in `dtype` (see the module docstring)."""
    flags = _cpu_flags()
    threads = torch.get_num_threads()
    ghz = _cpu_ghz()
    vector = 64 if "avx512f" in flags else 32 if "avx2" in flags else 16
    if dtype == torch.bfloat16 and "amx_bf16" in flags:
        per_cycle, unit = 1024, "AMX bf16"
    elif dtype == torch.bfloat16 and "avx512_bf16" in flags:  # VDPBF16PS: two bf16 products per fp32 lane
        per_cycle, unit = 2 * vector, "AVX512-BF16"
    else:
        per_cycle, unit = vector, ("AVX-512" if vector == 64 else "AVX2" if vector == 32 else "SSE") + " fp32"
    if ghz is None:
        return Peak(measure_matmul_peak(dtype), f"CPU matmul measured at start, {threads} thread(s)")
    return Peak(
        threads * per_cycle * ghz * 1e9,
        f"CPU theoretical: {threads} thread(s) x {per_cycle} {unit} FLOP/cycle x {ghz:.2f} GHz",
    )


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
