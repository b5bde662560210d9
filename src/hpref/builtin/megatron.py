"""The built-in `megatron-gpt` model component, the `megatron-core` model family (`MEGATRON_FAMILY`):
a Llama / Mistral / Qwen2 judge on megatron-core.

    [model]
    name = "megatron-gpt"
    path = "/models/my-llama"        # a transformers folder (config.json, safetensors, tokenizer)
    tensor_parallel = 2              # data parallel takes the rest of the ranks

or, instead of `path`, `[model.tiny_llama]` (the `tiny-llama` component's settings): the same
random-init tiny Llama and tokenizer `tiny-llama` builds, made in memory, nothing downloaded
(`recipes/megatron-quickstart.toml`).

`pipeline_parallel = N` splits the layers into N stages (`hpref.models.megatron.pipeline`: hpref
runs the schedule, GPipe-style, over torch.distributed point-to-point).

`sequence_parallel = true` (with tensor_parallel > 1) splits the activations between megatron's
tensor-parallel regions by tokens (`hpref.models.megatron.sequence_parallel`); with
tensor_parallel = 1 it changes nothing.

What is refused, in one line each: tensor_parallel x pipeline_parallel not dividing the number of
ranks, pipeline_parallel not dividing the layers, sequence_parallel with pipeline_parallel > 1,
LoRA (`hpref.models.adapters` wraps transformers modules; megatron's fused tensor-parallel linears
are not among PEFT's targets).
megatron-core is the optional extra `pip install 'hpref[megatron]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from hpref.builtin.models import HeadConfig, TinyLlamaArchitecture, head_kwargs
from hpref.families import FamilySupport, ModelBuilder, ModelFamilySpec
from hpref.hookspecs import hookimpl
from hpref.protocols import LoadsPlainState, ParallelizesItself, ReducesOwnGradients, ViewsCheckpoint

if TYPE_CHECKING:
    import torch

    from hpref.models.megatron.preference import MegatronPreferenceModel


class MegatronGPTConfig(HeadConfig):
    path: str | None = Field(
        None, description="local transformers folder of a Llama, Mistral or Qwen2 model (or tiny_llama)"
    )
    tiny_llama: TinyLlamaArchitecture | None = Field(
        None, description="instead of path: the random-init tiny Llama of the tiny-llama component"
    )
    tensor_parallel: int = Field(
        1, ge=1, description="tensor-parallel ranks per model copy (must divide the key/value heads)"
    )
    pipeline_parallel: int = Field(
        1, ge=1, description="pipeline stages (must divide the layers; data parallel takes the rest)"
    )
    sequence_parallel: bool = Field(
        False,
        description="with tensor_parallel > 1: split the activations outside attention and MLP by tokens",
    )
    pooling: Literal["last"] = Field("last", description="token read by the head (a decoder's last)")

    @model_validator(mode="after")
    def _one_source(self) -> MegatronGPTConfig:
        if (self.path is None) == (self.tiny_llama is None):
            raise ValueError("give exactly one of path and tiny_llama")
        return self


def _refuse_unsupported(config: MegatronGPTConfig) -> None:
    from hpref.errors import UserError

    if config.sequence_parallel and config.pipeline_parallel > 1:
        # a stage passes whole rows on (hpref.models.megatron.pipeline), not sequence-split ones
        raise UserError("model.sequence_parallel with model.pipeline_parallel > 1 is not supported")


def _tiny_llama_parts(config: MegatronGPTConfig) -> tuple[Any, Any, Any]:
    """`tiny-llama`'s config, tokenizer and seeded weights, for the same model on megatron."""
    from hpref.builtin.models import tiny_llama_backbone_config
    from hpref.models.tokenizer import load_or_train_tokenizer

    tiny = config.tiny_llama
    assert tiny is not None
    tokenizer = load_or_train_tokenizer(
        vocab_size=tiny.vocab_size,
        min_frequency=tiny.tokenizer_min_frequency,
        num_texts=tiny.tokenizer_texts,
        seed=tiny.tokenizer_seed,
    )
    hf_config = tiny_llama_backbone_config(tiny, tokenizer)

    def seeded_state() -> dict[str, Any]:
        import torch
        from transformers import AutoModel

        with torch.random.fork_rng(devices=[]):  # as hpref.models.hf.build_from_config seeds it
            torch.manual_seed(config.seed)
            return AutoModel.from_config(hf_config, dtype=torch.float32).state_dict()

    return hf_config, tokenizer, seeded_state


def _folder_parts(config: MegatronGPTConfig) -> tuple[Any, Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from hpref.errors import UserError
    from hpref.models.hf import resolve_backbone_path

    folder = resolve_backbone_path(str(config.path))
    hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder}: no *.safetensors weights (the megatron backend reads safetensors)")

    def state() -> Any:
        from hpref.models.safetensors_folder import SafetensorsFolder

        return SafetensorsFolder(files)  # read tensor by tensor while converting, not all at once

    return hf_config, tokenizer, state


def build_megatron_gpt(
    config: MegatronGPTConfig, *, num_labels: int = 3, device: Any = "cpu", meta: bool = False
) -> MegatronPreferenceModel:
    """A judge (or reward model) whose backbone is a megatron-core GPTModel, tensor parallel over
    megatron's groups (set up here from the process group, see hpref.models.megatron.preference)."""
    from hpref.models.megatron.backbone import require_megatron

    _refuse_unsupported(config)
    require_megatron()
    from hpref.models.megatron.pipeline import MegatronPipelineModel
    from hpref.models.megatron.preference import build_megatron_model

    parts = _tiny_llama_parts(config) if config.tiny_llama is not None else _folder_parts(config)
    hf_config, tokenizer, hf_state = parts
    return build_megatron_model(
        hf_config,
        tokenizer,
        hf_state,
        tensor_parallel=config.tensor_parallel,
        pipeline_parallel=config.pipeline_parallel,
        sequence_parallel=config.sequence_parallel,
        num_labels=num_labels,
        device=device,
        meta=meta,
        head_kwargs=head_kwargs(config),
        provenance={"component": "megatron-gpt", "config": config.model_dump(mode="json")},
        pipeline_class=MegatronPipelineModel,
    )


def parallelize_megatron(
    model: MegatronPreferenceModel, *, param_dtype: torch.dtype, activation_checkpointing: bool
) -> MegatronPreferenceModel:
    """megatron's own parallelism (`parallelize_self`): tensor parallel inside, data parallel by one
    gradient all-reduce per step, no FSDP2 (it would make megatron's shards DTensors its layers do
    not expect)."""
    return model.parallelize_self(param_dtype=param_dtype, activation_checkpointing=activation_checkpointing)


#: The megatron-core family: it parallelises itself, reduces and clips its own gradients, stores its
#: tensor-parallel shards as views of the full tensors and converts `hpref init`'s plain weights;
#: no LoRA, a decoder's last-token pooling.
MEGATRON_FAMILY = ModelFamilySpec(
    name="megatron-core",
    description="a megatron-core GPTModel backbone + hpref's head: tensor, pipeline, sequence parallel",
    models=(ModelBuilder("megatron-gpt", MegatronGPTConfig, build_megatron_gpt),),
    parallelize=parallelize_megatron,
    capabilities=(ParallelizesItself, ReducesOwnGradients, ViewsCheckpoint, LoadsPlainState),
    supports=FamilySupport(
        lora=False,
        no_lora_reason="its layers are not transformers modules PEFT can wrap",
        poolings=frozenset({"last"}),
        parallelisms=frozenset({"tensor", "pipeline", "sequence"}),
    ),
)


@hookimpl
def register_model_families(register):
    register(MEGATRON_FAMILY)
