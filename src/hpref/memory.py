"""Keep a CPU training process's memory flat across steps of different lengths.

Packed batches change length every step, and two CPU libraries keep something per shape:

- oneDNN (PyTorch's CPU matmul backend) caches a compiled primitive per matmul shape, up to 1,024
  of them, each with its own buffers. `ONEDNN_PRIMITIVE_CACHE_CAPACITY` bounds that; hpref sets 64
  unless the user set it (oneDNN reads it when it builds its first primitive, so this runs at
  worker start, before any matmul).
- glibc's malloc keeps freed blocks of every size in its heaps instead of returning them, so a
  heap grows with each new largest activation. `malloc_trim(0)` after a step hands the free pages
  back (a few milliseconds).

Measured on MiniLM + LoRA r 8, HH-RLHF, 80 steps (peak RSS at steps 10 / 80): 1.28 / 2.51 GiB as
before, 1.27 / 1.80 GiB with the cache capped at 64, 1.14 / 1.44 GiB with both; tokens/s unchanged
within noise (benchmarks/NOTES.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_DEFAULT = "64"


def cap_onednn_cache() -> str:
    """Bound oneDNN's per-shape primitive cache (the user's own setting wins); returns the value."""
    return os.environ.setdefault(ONEDNN_CACHE_ENV, ONEDNN_CACHE_DEFAULT)


#: ideep (PyTorch's C++ wrapper of oneDNN, which runs bf16 matmuls on the CPU) keeps its own cache
#: of built matmul primitives, one per input shape, up to this many (ideep's default: 1,024); it is
#: read when the cache is first used, so it too must be set before the first matmul
IDEEP_CACHE_ENV = "LRU_CACHE_CAPACITY"
IDEEP_CACHE_DEFAULT = "16"


def cap_ideep_cache() -> str:
    """Bound ideep's per-shape matmul cache (the user's own setting wins); returns the value. For a
    `hpref serve` replica, whose every packed pass has a new token count: uncapped, its live native
    memory grew ~0.8 MiB a pass for hundreds of passes (MiniLM reward, bf16; `python -m
    benchmarks.serve_replica_memory`); 16 entries hold one pass's few shapes (QKV, FFN up and
    down), so a pass still reuses them layer after layer."""
    return os.environ.setdefault(IDEEP_CACHE_ENV, IDEEP_CACHE_DEFAULT)


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None on a C library without it (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Return freed heap pages to the OS (glibc only); True when it ran."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class PeriodicRelease:
    """`release_freed_memory` at most once per `interval_s`: for a service, whose many passes a
    second would each pay the trim's few milliseconds. Measured on `hpref serve`'s MiniLM reward
    replica (benchmarks/serve_soak.py, HH-RLHF requests in passes of 1-32): 250 passes grew RSS to
    1.97 GiB untrimmed, 1.16 GiB trimmed after each (3.5 s of trims in 90 s); a replica under
    overload grew 38 % in four minutes after its first."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._last = 0.0

    def __call__(self) -> None:
        import time

        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            release_freed_memory()
