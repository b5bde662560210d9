"""Where hpref keeps what it can rebuild: `$HPREF_CACHE`, else `~/.cache/hpref` (tokenizers, converted
GGUF folders, precision probes, warm-up policies, transformers' import structure)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HPREF_CACHE"


def cache_root() -> Path:
    """`$HPREF_CACHE`, else `~/.cache/hpref`."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "hpref"
