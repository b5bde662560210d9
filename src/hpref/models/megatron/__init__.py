"""The megatron-core backend, one package: a preference backbone that parallelises itself.

backbone            megatron-core's GPT stack as hpref's backbone (varlen attention, its CUDA and CPU
                    seams, `transformer_config`, `require_megatron`)
preference          the preference model on it: tensor parallel groups, the head, gradient reduction
                    and clipping, checkpoints in transformers' layout
pipeline            one pipeline stage of it and hpref's GPipe schedule (composition, not a subclass
                    of the training loop)
sequence_parallel   `sequence_parallel = true`: norms and dropout split by tokens
convert             config and weights to and from transformers (read tensor by tensor through
                    `hpref.models.safetensors_folder`)
causal_lm           the causal LM the rl trainer trains with `trainer_backend = "megatron"` (through
                    `hpref.rl.trainer.backends.MegatronBackend`), converted to and from transformers' layout

megatron-core is an optional extra (`pip install 'hpref[megatron]'`): importing this package does
not import it; `require_megatron` does, with a one-line error when it is missing. The backbone's
public names are importable from here (`from hpref.models.megatron import MegatronBackbone`).
"""

from hpref.models.megatron.backbone import (
    MegatronBackbone,
    cpu_rotary,
    require_megatron,
    transformer_config,
    varlen_layer_spec,
)

__all__ = ["MegatronBackbone", "cpu_rotary", "require_megatron", "transformer_config", "varlen_layer_spec"]
