"""A device's peak FLOP/s, the denominator of every MFU hpref reports (`hpref train`'s and the RL
trainer's): `HPREF_PEAK_TFLOPS` when set, a datasheet value for known GPUs (a matmul measured at
start for unknown ones), and on a CPU the theoretical rate of the threads a rank uses: threads x
FLOP/cycle x clock, with 64 fp32 FLOP/cycle for AVX-512 (two 16-lane FMA units), 32 for AVX2, and
1024 bf16 FLOP/cycle for AMX, at the clock the OS reports (nominal: turbo can beat it, a calm
2-thread fp32 matmul reached 0.43 TFLOP/s against 0.33 stated at 2.6 GHz). A CPU peak is not
measured at start: on a shared machine a short burst measures the neighbours, not the hardware (it
gave 0.07 to 0.43 TFLOP/s for the same two fp32 threads here). The peak's source is printed beside
every MFU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

#: Dense bf16 peak (no sparsity) in TFLOP/s, matched against `torch.cuda.get_device_name()`.
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "4090": 165.0,
    "MI300X": 1307.4,
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
