"""The compute dtype of a step: `precision = "auto" | "fp32" | "bf16"` resolved from measurements.

Used by `hpref train` (the preference model's FSDP2 mixed precision) and by `hpref rl` (a policy
trainer's autocast, an engine's prompt prefill), so both read one rule.
"""

from __future__ import annotations

import torch


def cpu_has_fast_bf16() -> bool:
    """True on x86 CPUs whose bf16 matmuls beat fp32: AMX tiles (Intel Sapphire Rapids and later)
    or AVX512-BF16 (AMD Zen 4, Intel Cooper Lake). Measured on a 2-core AMD EPYC with avx512_bf16
    and no AMX: 1024^2 matmul 127 vs 42 GFLOP/s, and a MiniLM train step 2,049 vs 1,041 tokens/s
    (`python -m benchmarks.profile_step benchmarks/minilm-synthetic.toml --variant
    fp32:threads=1,train.precision=fp32 --variant bf16:threads=1,train.precision=bf16 --rounds 3`)."""
    probes = [
        getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    ]
    try:
        return any(bool(probe()) for probe in probes if probe is not None)
    except Exception:  # an old build without the probes
        return False


#: Narrowest model for which `precision = "auto"` picks bf16 on a bf16 CPU (see resolve_precision).
CPU_BF16_MIN_HIDDEN = 256


def resolve_precision(precision: str, device: torch.device, hidden_size: int | None = None) -> torch.dtype:
    """The compute dtype; `auto` picks what was measured faster.

    CUDA: bf16 where supported. CPU: bf16 only with AMX or AVX512-BF16 (`cpu_has_fast_bf16`) and a
    model at least 256 wide. Measured with
    `python -m benchmarks.precision_step` (one-rank FSDP2 train step, Llama shape, 4096-token micro-batches,
    best of 4 rounds, 2-core Xeon with AMX), bf16 / fp32 tokens/s: hidden 64: 0.87x, 128: 0.94x,
    256: 1.36x, 512: 2.01x — below 256 the casts cost more than AMX saves.
    """
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    wide = hidden_size is None or hidden_size >= CPU_BF16_MIN_HIDDEN
    return torch.bfloat16 if cpu_has_fast_bf16() and wide else torch.float32
