"""A spy on `os.fsync` / `os.replace` that tells whether a file was written durably and atomically:
its data fsynced under a temporary name, renamed over the target, and the folder entry fsynced."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest


class DurableWrites:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        if not Path("/proc/self/fd").is_dir():
            pytest.skip("needs /proc to name the fsynced files")
        self.fsynced: list[Path] = []
        self.renamed: list[tuple[Path, Path]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            with contextlib.suppress(OSError):
                self.fsynced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def replace(src, dst, *args, **kwargs):
            self.renamed.append((Path(src).resolve(), Path(dst).resolve()))
            return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def assert_durable(self, path: str | Path) -> None:
        path = Path(path).resolve()
        sources = [src for src, dst in self.renamed if dst == path]
        assert sources, f"{path} was written in place, not renamed over from a complete temporary file"
        assert sources[-1] in self.fsynced, f"{path}: its data was not fsynced before the rename"
        assert path.parent in self.fsynced, f"{path}: the rename was not made durable (folder fsync)"
