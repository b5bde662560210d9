"""hpref.memory: the two CPU settings that keep a training process's RSS flat across packed
steps of different lengths (see the module docstring for the measurement)."""

from __future__ import annotations

import sys

import pytest

from hpref import memory


def test_onednn_cache_is_capped_unless_the_user_chose(monkeypatch):
    """Unset: 64 (oneDNN's default 1,024 primitives per process grew MiniLM+LoRA's RSS by ~0.7 GiB
    in 80 steps). Set by the user: theirs is kept, else hpref would override a deliberate choice."""
    monkeypatch.delenv(memory.ONEDNN_CACHE_ENV, raising=False)
    assert memory.cap_onednn_cache() == "64"
    monkeypatch.setenv(memory.ONEDNN_CACHE_ENV, "1024")
    assert memory.cap_onednn_cache() == "1024"


def test_ideep_cache_is_capped_unless_the_user_chose(monkeypatch):
    """Unset: 16 (ideep's default 1,024 built matmuls, one per packed length, kept an `hpref serve`
    replica's native memory growing ~0.8 MiB a pass). Set by the user: theirs is kept."""
    monkeypatch.delenv(memory.IDEEP_CACHE_ENV, raising=False)
    assert memory.cap_ideep_cache() == "16" and memory.IDEEP_CACHE_ENV == "LRU_CACHE_CAPACITY"
    monkeypatch.setenv(memory.IDEEP_CACHE_ENV, "1024")
    assert memory.cap_ideep_cache() == "1024"


PROBE = """
import torch
from hpref import memory

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024

if memory._malloc_trim() is None:
    print("no-trim")
    raise SystemExit(0)
memory.release_freed_memory()
blocks, survivors = [], []
for i in range(3000):  # ~64 KB each (~190 MB); a small survivor after every 50th pins the heap's top
    blocks.append(torch.empty(16_000).fill_(2.0))
    if i % 50 == 49:
        survivors.append(torch.empty(16).fill_(1.0))
del blocks
before = rss()
ran = memory.release_freed_memory()
print(ran, before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim and /proc are glibc/Linux")
def test_release_freed_memory_returns_freed_heap_pages():
    """Thousands of freed heap-sized tensors (below malloc's mmap threshold) stay in the process's
    RSS until malloc_trim hands them back (measured: 0 MiB on free, ~180 MiB on trim); if
    release_freed_memory did nothing, long packed runs would keep their largest step's memory.
    In a fresh interpreter: a heap shaped by earlier tests would blur the figure."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    if out == ["no-trim"]:
        pytest.skip("this C library has no malloc_trim")
    assert out[0] == "True"
    assert int(out[1]) > 100 * 2**20, out
