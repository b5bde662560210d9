"""Tokenize once: a dataset's formatted token ids, cached on disk.

`tokenize_dataset(dataset, formatter, swap=...)` returns `list[TokenizedExample]`, one per view of
each battle in `dataset.battles()` order (row = the battle's index; with swap "full" or "random" both
the A/B and the B/A view are stored, the plan picks per epoch). `formatter` may be a list: several
formats per battle (e.g. pab and papb), all views of a battle sharing its row, so "full" puts them
in one step and "random" draws one of them per epoch. The first call formats and tokenizes;
later calls — a second run, every later epoch, every rank after the first — load the arrays.
`encode_views(battles, formatter, both_views=...)` is the encoding itself, without the cache: eval
data and `hpref eval` call it directly.

The key is a hash of everything that changes the ids:
  data       `dataset.fingerprint()`: the file's bytes (blake2b) or the generator's seed and version,
             plus the reader settings (fold selection, on_error, limit, ...)
  tokenizer  its full serialisation (vocab, merges, normalizer, added tokens), chat template and
             special tokens — not its name, since two folders can share a name
  formatter  `formatter.fingerprint()`: layout, truncation settings, max_length
  views      whether swapped views are stored
  extra      any `key_parts` the caller adds
The cache lives in `$HPREF_CACHE`, else `~/.cache/hpref/tokens`: one `<key>.npz` (flat int32 ids,
offsets, labels, rows, swap flags, truncation flags, untruncated lengths, and where a paired
example's second sequence starts) and a `<key>.json` with the
read summary and the key's parts, for humans. Files are written to a temporary name and renamed, so
concurrent ranks or runs never read half a file. A source without `fingerprint()` is tokenized
every time (there is no safe key), with a log line saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from loguru import logger

from hpref.data.formatting import encode_battles
from hpref.data.packing import TokenizedExample
from hpref.data.records import Battle
from hpref.protocols import BattleSource, Formatter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_ENV = "HPREF_CACHE"
# 2: pairwise folds no longer depend on the run seed (same key, other rows)
# 3: entries store `splits` (a reward model's paired examples); older entries lack the array
CACHE_VERSION = 3
_ENCODE_CHUNK = 256


def cache_root() -> Path:
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "hpref" / "tokens"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Identity of a tokenizer's behaviour (its serialised vocab/model/normalizer, chat template,
    special tokens)."""
    h = hashlib.blake2b(digest_size=16)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    special = getattr(tokenizer, "special_tokens_map", {})
    h.update(json.dumps(special, sort_keys=True, default=str).encode())
    h.update(type(tokenizer).__name__.encode())
    return h.hexdigest()


def formatter_fingerprint(formatter: Formatter) -> str:
    if hasattr(formatter, "fingerprint"):
        return str(formatter.fingerprint())
    config = getattr(formatter, "config", None)
    settings = config.model_dump(mode="json") if hasattr(config, "model_dump") else repr(config)
    payload = {
        "type": type(formatter).__qualname__,
        "config": settings,
        "max_length": getattr(formatter, "max_length", None),
    }
    return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=16).hexdigest()


@dataclass
class TokenArrays:
    """All views of a dataset, as flat arrays (what the cache stores)."""

    ids: np.ndarray  # int32, all sequences concatenated
    offsets: np.ndarray  # int64 [n + 1]
    labels: np.ndarray  # float32 [n, 3], NaN rows = unlabeled
    rows: np.ndarray  # int64 [n]
    swapped: np.ndarray  # bool [n]
    truncated: np.ndarray  # bool [n]
    full_lengths: np.ndarray  # int64 [n], length before truncation
    splits: np.ndarray  # int64 [n], start of a paired example's second sequence (0 = one sequence)
    summary: dict[str, Any] = field(default_factory=dict)
    from_cache: bool = False

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def examples(self) -> list[TokenizedExample]:
        out = []
        for i in range(len(self.rows)):
            label = None if np.isnan(self.labels[i, 0]) else tuple(float(x) for x in self.labels[i])
            out.append(
                TokenizedExample(
                    ids=self.ids[self.offsets[i] : self.offsets[i + 1]],
                    label=label,  # type: ignore[arg-type]
                    row=int(self.rows[i]),
                    swapped=bool(self.swapped[i]),
                    split=int(self.splits[i]),
                )
            )
        return out


def _formatters(formatter: Formatter) -> list[Formatter]:
    return list(formatter) if isinstance(formatter, list | tuple) else [formatter]


def cache_key(
    dataset: BattleSource, formatter: Formatter, views: int, key_parts: Mapping[str, Any] | None = None
) -> dict:
    formatters = _formatters(formatter)
    return {
        "version": CACHE_VERSION,
        "data": dataset.fingerprint(),
        "tokenizer": [tokenizer_fingerprint(f.tokenizer) for f in formatters],
        "formatter": [formatter_fingerprint(f) for f in formatters],
        "views": views,
        "extra": dict(key_parts or {}),
    }


def encode_views(battles: Iterable[Battle], formatter: Formatter, *, both_views: bool) -> TokenArrays:
    """Every view of `battles` formatted and tokenized: hpref's one tokenization entry point.

    Row i is the i-th battle; with `both_views` its swapped copy (B/A, label swapped) follows it.
    `formatter` may be a list (several formats per battle, all views of a battle sharing its row).
    Training data reaches it through the cache (`tokenize_arrays`), eval data and `hpref eval`
    directly (they keep the battles, whose ids the predictions need)."""
    views = 2 if both_views else 1
    formatters = _formatters(formatter)
    chunks: list[np.ndarray] = []
    lengths: list[int] = []
    labels: list[tuple[float, float, float]] = []
    rows: list[int] = []
    swapped: list[bool] = []
    truncated: list[bool] = []
    full: list[int] = []
    splits: list[int] = []
    pending: list[tuple[int, bool, Any]] = []

    def flush() -> None:
        shown = [b for _, _, b in pending]
        per_formatter = [encode_battles(f, shown) for f in formatters]
        # Views of one battle stay adjacent: for each battle, each formatter's A/B (then B/A) view.
        ordered = [
            (pending[k], per_formatter[j][k])
            for start in range(0, len(pending), views)
            for j in range(len(formatters))
            for k in range(start, start + views)
        ]
        for (row, is_swapped, battle), encoded in ordered:
            chunks.append(np.asarray(encoded.ids, dtype=np.int32))
            lengths.append(len(encoded.ids))
            labels.append(battle.label if battle.label is not None else (np.nan, np.nan, np.nan))
            rows.append(row)
            swapped.append(is_swapped)
            truncated.append(encoded.truncated)
            full.append(encoded.full_length)
            splits.append(encoded.split)
        pending.clear()

    for row, battle in enumerate(battles):
        pending.append((row, False, battle))
        if both_views:
            pending.append((row, True, battle.swapped()))
        if len(pending) >= _ENCODE_CHUNK:
            flush()
    flush()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenArrays(
        ids=np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32),
        offsets=offsets,
        labels=np.array(labels, dtype=np.float32).reshape(-1, 3),
        rows=np.array(rows, dtype=np.int64),
        swapped=np.array(swapped, dtype=np.bool_),
        truncated=np.array(truncated, dtype=np.bool_),
        full_lengths=np.array(full, dtype=np.int64),
        splits=np.array(splits, dtype=np.int64),
    )


def _encode(dataset: BattleSource, formatter: Formatter, views: int) -> TokenArrays:
    arrays = encode_views(dataset.battles(), formatter, both_views=views == 2)
    summary = getattr(dataset, "summary", None)
    arrays.summary = summary.as_dict() if hasattr(summary, "as_dict") else {}
    return arrays


_FIELDS = ("ids", "offsets", "labels", "rows", "swapped", "truncated", "full_lengths", "splits")


def _save(path: Path, arrays: TokenArrays, key: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{name: getattr(arrays, name) for name in _FIELDS})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    meta = {"key": key, "summary": arrays.summary, "sequences": len(arrays.rows)}
    meta_tmp = path.with_suffix(".json.tmp")
    meta_tmp.write_text(json.dumps(meta, indent=2, default=str))
    os.replace(meta_tmp, path.with_suffix(".json"))


def _load(path: Path) -> TokenArrays | None:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = TokenArrays(**{name: data[name] for name in _FIELDS})
        meta_path = path.with_suffix(".json")
        if meta_path.exists():
            arrays.summary = json.loads(meta_path.read_text()).get("summary", {})
    except (OSError, KeyError, ValueError) as exc:  # a damaged entry is rebuilt, not trusted
        logger.warning(f"token cache entry {path} is unreadable ({exc}); tokenizing again")
        return None
    arrays.from_cache = True
    return arrays


def tokenize_arrays(
    dataset: Any,
    formatter: Formatter,
    *,
    swap: str = "none",
    key_parts: Mapping[str, Any] | None = None,
    use_cache: bool = True,
    root: Path | None = None,
) -> TokenArrays:
    """The dataset's views as `TokenArrays`, from the cache when possible (see the module docstring)."""
    if swap not in ("none", "full", "random"):
        raise ValueError(f"swap must be none, full or random, got {swap!r}")
    views = 1 if swap == "none" else 2
    if not use_cache or not hasattr(dataset, "fingerprint"):
        if use_cache:
            logger.info(f"{type(dataset).__name__} has no fingerprint(); tokenizing without a cache")
        return _encode(dataset, formatter, views)
    key = cache_key(dataset, formatter, views, key_parts)
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    path = (root or cache_root()) / f"{digest}.npz"
    if path.exists():
        arrays = _load(path)
        if arrays is not None:
            logger.info(f"token cache hit: {len(arrays.rows)} sequences from {path}")
            return arrays
    arrays = _encode(dataset, formatter, views)
    _save(path, arrays, key)
    logger.info(f"token cache write: {len(arrays.rows)} sequences to {path}")
    return arrays


def tokenize_dataset(
    dataset: Any,
    formatter: Formatter,
    *,
    swap: str = "none",
    key_parts: Mapping[str, Any] | None = None,
    use_cache: bool = True,
    root: Path | None = None,
) -> list[TokenizedExample]:
    """`list[TokenizedExample]` for `dataset` formatted by `formatter`: views in battle order
    (A/B then B/A per battle when swap != "none"), tokenized once and cached."""
    return tokenize_arrays(
        dataset, formatter, swap=swap, key_parts=key_parts, use_cache=use_cache, root=root
    ).examples()
