"""The memory estimate of `hpref rl --plan` (`hpref.rl.plan.table`): what each actor of a policy would
hold, counted from the policy's config on the meta device
(`hpref.rl.policy.policy_skeleton`) and the first prompts' lengths, per actor (GiB):

- trainer rank (FSDP2 over `ranks`): fp32 weights / ranks (a LoRA base too: frozen, but sharded),
  gradients and AdamW's two moments of what trains / ranks, the frozen KL reference (full
  fine-tuning with `kl_coef` > 0 or `measure_kl`; LoRA's reference is its base with the adapters
  off), then the largest of what a step adds on top: one micro-batch's saved activations and one
  chunk of the LM head's logits (packed rows, `micro_batch_activations`)
  (with bf16 autocast's bf16 copy of the weights, or two gathered FSDP units with several ranks),
  the optimizer step's temporaries, a weight sync's bucket;
- engine: its weights in its dtype, its KV cache (vLLM: `kv_cache_gib` on CPU, its
  `gpu_memory_utilization` of a GPU; the transformers engine: the rollout's sequences, with every
  step's logits, which `generate` keeps) or the prompt forward's logits, whichever is larger, or a
  sync's bucket (the rest of a sync waits in a stage file, `hpref.rl.engines.staging`);
- every actor: the process baseline, measured here (this process after importing torch,
  transformers and the trainer) plus a Ray worker's own (`RAY_WORKER_BYTES`).

With an environment other than `single-turn` (`[rl.environment]`, issue #49) a row is an episode: the
trainer's row holds the prompt, every turn and observation, up to `max_context_tokens`, and the
transformers engine's KV cache grows to that per row over the turns, each later turn's prefill
forwarding every live episode's context; so there the context bound stands in for prompt +
`max_new_tokens` (`episode_context`). When the policies play the episodes together (`[rl.environment]
roles`, issue #50) a policy's rollout holds a row per episode for each role it plays (self-play: two
rows per episode), so its trainer counts that many prompt groups; an engine is asked, each round,
for the episodes whose acting role its policy plays, at most one row per episode, so a shared base's
engine counts the episodes once, not once per policy it serves (`seated`, `roles_played`).

The activation constants are counted from the tensors autograd saves for a transformers Llama
block (`benchmarks/rl_plan_memory.py` measures the estimate against real actors' peak RSS).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpref.rl.placement.resources import engines_on_gpu

if TYPE_CHECKING:
    from hpref.recipe.rl import PolicyConfig, RLConfig, RolloutConfig

GIB = 2**30
MIB = 2**20
#: A Ray actor's resident set over a plain process with the same imports (measured here: 661 vs
#: 610 MiB after importing torch, transformers and the trainer): Ray's core worker and its threads.
RAY_WORKER_BYTES = 64 * MIB
#: CUDA's context and kernels in each GPU process (not measured here, where there is no GPU).
CUDA_CONTEXT_BYTES = 512 * MIB
#: Bytes per answer token per vocabulary entry of the LM head's chunk (`hpref.models.head_logprobs`):
#: its fp32 logits, their softmax (in place, as the gradient in the backward) and the compute-dtype
#: copy the matmul with the weights reads (three fp32-sized copies at most).
LOGIT_BYTES = 12
#: A micro-batch's peak resident set over the tensors autograd saves: the forward's temporaries and
#: what the allocator keeps of them (measured on SmolLM2-135M, one 556-token micro-batch under bf16
#: autocast, steady-state steps: 1.44x full fine-tuning, 1.35x LoRA; `benchmarks/rl_plan_memory.py`).
MICRO_BATCH_SLACK = 1.4


# --------------------------------------------------------------------------------------------------
# the model, from its config


@dataclass(frozen=True)
class Shape:
    """What the memory of a policy's model depends on, read from its skeleton."""

    params: int  # every parameter (LoRA's adapters included)
    trainable: int  # what the optimizer steps: all, or the adapters
    largest_unit: int  # an FSDP unit: the largest decoder block, or the root (embeddings, norm, head)
    hidden: int
    intermediate: int
    heads: int  # attention heads (the precision probe's shape)
    layers: int
    kv_width: int  # key/value heads x head size
    vocab: int


def planned_bf16(precision: str, shape: Shape, *, gpu: bool) -> bool:
    """Whether a trainer of `precision` computes under bf16 autocast: `auto` on a GPU does; on a CPU,
    what the precision probe decided on this machine (`hpref.models.precision`: pinned, known or
    cached; the plan never probes), and where it has not run, fp32 (the larger activations)."""
    if precision != "auto":
        return precision == "bf16"
    if gpu:
        return True
    from hpref.models.precision import ProbeShape, auto_precision

    probe = ProbeShape(shape.hidden, shape.intermediate, shape.heads)
    return auto_precision(probe, measure=False).dtype_name == "bf16"


def model_shape(policy: PolicyConfig) -> Shape:
    """The policy's `Shape` from its config on the meta device (LoRA injected there too)."""
    from hpref.rl.policy import policy_skeleton

    skeleton = policy_skeleton(policy.model)
    config = skeleton.config
    if policy.lora is not None:
        from hpref.models.lm_adapters import apply_lora_to_causal_lm

        apply_lora_to_causal_lm(skeleton, policy.lora, seed=policy.model.seed)
    params = sum(p.numel() for p in skeleton.parameters())
    blocks = skeleton.get_decoder().layers
    block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shape(
        params=params,
        trainable=sum(p.numel() for p in skeleton.parameters() if p.requires_grad),
        largest_unit=max(block, params - in_blocks),
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=heads,
        layers=config.num_hidden_layers,
        kv_width=getattr(config, "num_key_value_heads", heads) * head_dim,
        vocab=config.vocab_size,
    )


# --------------------------------------------------------------------------------------------------
# memory per actor


def episode_context(config: RLConfig) -> int | None:
    """The tokens an episode's row may reach (`[rl.environment] max_context_tokens`), or None for
    `single-turn`, whose row is a prompt and one answer."""
    environment = config.environment
    return None if environment.name == "single-turn" else environment.max_context_tokens


def seated(config: RLConfig, order: list[str], where: str = "recipe") -> dict[str, str] | None:
    """role -> policy when the policies play the environment's episodes together (`[rl.environment]
    roles`, as the run seats them: `environments.registry.seated_roles`, whose one-line refusal of a
    cast that cannot play it raises), else None."""
    if config.environment.name == "single-turn":
        return None
    from hpref.rl.environments.registry import build_environment, seated_roles

    return seated_roles(config, build_environment(config, where), list(order), where)


def roles_played(seats: dict[str, str] | None, policies: list[str]) -> int:
    """The most roles any of `policies` plays (a trainer's prompt groups per prompt: one without
    seats, each policy then in episodes of its own)."""
    if not seats:
        return 1
    return max(sum(1 for p in seats.values() if p == q) for q in policies)


def row_after_prompt(rollout: RolloutConfig, prompt: int, context: int | None) -> int:
    """The tokens a row holds after its prompt: one answer, or an episode's turns and observations up
    to `context` (never less than the first answer, which the engine generates whole)."""
    answer = rollout.max_new_tokens
    return answer if context is None else max(context - prompt, answer)


@dataclass(frozen=True)
class Memory:
    """An actor's estimate: `terms` in bytes (what it holds all run, and the largest transient on
    top, named), of which `host_terms` stay in host memory when the actor computes on a GPU."""

    terms: dict[str, int]
    gpu: bool = False
    host_terms: tuple[str, ...] = ("baseline",)

    @property
    def host(self) -> int:
        return sum(v for k, v in self.terms.items() if not self.gpu or k in self.host_terms)

    @property
    def device(self) -> int:
        return sum(v for k, v in self.terms.items() if self.gpu and k not in self.host_terms)

    def text(self) -> str:
        return " + ".join(f"{k} {v / GIB:.2f}" for k, v in self.terms.items() if v)


def micro_batch_activations(
    shape: Shape, prompt: int, answers: int, groups: int, group: int, bf16: bool
) -> int:
    """Bytes autograd keeps for one micro-batch of `groups` prompt groups (each prompt once, its
    `group` answers of `answers` tokens after it, as `hpref.rl.policy.packed_batch` packs them).

    Per decoder position and block, counted from the saved tensors of a transformers Llama block:
    fp32: 10 hidden-wide (norms, residual, q, attention out, o_proj input), 4 intermediate-wide
    (gate, up, SiLU, product) and 2 key/value-wide; under bf16 autocast the norms and residual stay
    fp32 (6 hidden-wide), the rest is bf16. The packed attention (`hpref.models.attention`'s
    `sdpa_segments`, fp32 in every forward) keeps each position's keys and values repeated to every
    head in fp32, and under bf16 an fp32 copy of its query too. The LM head runs in chunks over the
    answer tokens (`hpref.models.head_logprobs`): one chunk's logits at a time, `LOGIT_BYTES` per
    vocabulary entry, and the answer positions' hidden states it reads, in fp32."""
    from hpref.models.head_logprobs import CHUNK_ELEMENTS

    h, i, kv = shape.hidden, shape.intermediate, shape.kv_width
    per_position = (6 * h * 4 + (4 * h + 4 * i + 2 * kv) * 2) if bf16 else (10 * h + 4 * i + 2 * kv) * 4
    positions = groups * (prompt + group * answers)
    attention = positions * (3 if bf16 else 2) * h * 4
    tokens = groups * group * answers
    chunk = min(tokens, max(1, CHUNK_ELEMENTS // max(shape.vocab, 1)))
    return (
        shape.layers * (positions * per_position + attention)
        + tokens * h * 4
        + chunk * shape.vocab * LOGIT_BYTES
    )


def trainer_memory(
    policy: PolicyConfig,
    shape: Shape,
    rollout: RolloutConfig,
    prompt: int,
    *,
    baseline: int,
    bucket: int,
    bf16: bool,
    gpu: bool = False,
    adapters: int = 1,
    context: int | None = None,
) -> Memory:
    """One trainer rank's memory (every rank of a policy holds the same: FSDP2 shards evenly).
    `adapters`: the policies of a shared base this trainer holds (`rl.share_base`): each its own
    adapter, gradients and AdamW moments, one micro-batch at a time. `context`: an episode's bound
    (`episode_context`), each row then up to it."""
    ranks = policy.ranks
    answers, group = row_after_prompt(rollout, prompt, context), rollout.group_size
    from hpref.rl.algorithms.registry import build_algorithm

    # the algorithm's call (GRPO: a KL term or its measure; DPO: always); LoRA's is its base
    full_reference = policy.lora is None and build_algorithm("plan", policy).wants_reference()
    terms = {
        "weights": (shape.params + (adapters - 1) * shape.trainable) * 4 // ranks,
        "grads": adapters * shape.trainable * 4 // ranks,
        "AdamW": adapters * shape.trainable * 8 // ranks,
        "KL reference": shape.params * 4 // ranks if full_reference else 0,
    }
    # whole prompt groups per micro-batch: as many as `micro_batch_tokens` holds (at least one), of
    # this rank's share of the rollout
    groups_here = math.ceil(rollout.prompts_per_rollout / ranks)
    groups = max(1, min(groups_here, policy.micro_batch_tokens // (prompt + group * answers)))
    step = micro_batch_activations(shape, prompt, answers, groups, group, bf16)
    if ranks > 1:  # FSDP2 gathers a unit in the compute dtype and prefetches the next
        step += 2 * shape.largest_unit * (2 if bf16 else 4)
    elif bf16:  # autocast keeps a bf16 copy of every weight it casts until the micro-batch ends
        step += shape.params * 2
    transients = {
        "micro-batch": int(step * MICRO_BATCH_SLACK),
        "optimizer step": 2 * shape.trainable * 4 // ranks,  # foreach AdamW's temporaries
        "sync bucket": bucket,
    }
    largest = max(transients, key=lambda k: transients[k])
    terms[largest] = transients[largest]
    if gpu:
        terms["CUDA context"] = CUDA_CONTEXT_BYTES
        terms["host staging"] = shape.params * 4 // ranks  # a rank's shard passes through the host
    terms["baseline"] = baseline
    return Memory(terms, gpu=gpu, host_terms=("baseline", "host staging"))


def engine_memory(
    config: RLConfig,
    shape: Shape,
    rollout: RolloutConfig,
    prompt: int,
    *,
    baseline: int,
    gpu_memory: int | None = None,
    adapters: int = 0,
    adapter_params: int = 0,
    context: int | None = None,
    together: bool = False,
) -> Memory:
    """One engine's memory: the built-in transformers engine (fp32 on CPU), vLLM (its dtype; CPU or
    GPU) or a plugin engine (its weights in fp32 and the baseline: nothing else is known of it).
    `adapters`: the LoRA policies of a shared base it serves (`adapter_params` each), whose rollouts
    it may batch all at once. `context`: an episode's bound (`episode_context`): the transformers
    engine's rows grow to it over the turns (vLLM's cache is its fixed `kv_cache_gib` or GPU share).
    `together`: the policies play the episodes together, one acting role per episode each round, so
    the rows are the episodes, however many of the policies the engine serves."""
    name, engine = config.engine.name, config.engine_config
    gpus = engines_on_gpu(config)
    rows = rollout.prompts_per_rollout * rollout.group_size * (1 if together else max(adapters, 1))
    shape = dataclasses.replace(shape, params=shape.params + adapters * adapter_params)
    if name == "vllm":
        dtype = 4 if engine.dtype == "float32" else 2
        parallel = engine.tensor_parallel_size
        weights = shape.params * dtype // (parallel if gpus else 1)
        if gpus:  # vLLM takes its share of the GPU up front: weights, KV cache and all
            share = engine.gpu_memory_utilization
            held = int(share * gpu_memory) if gpu_memory else weights
            terms = {
                "gpu_memory_utilization" if gpu_memory else "weights": held,
                "CUDA context": CUDA_CONTEXT_BYTES,
            }
            return Memory({**terms, "baseline": baseline}, gpu=True)
        terms = {"weights": weights, "KV cache": engine.kv_cache_gib * GIB}
        return Memory({**terms, "baseline": baseline})
    weights = shape.params * 4
    if name != "transformers":
        return Memory({"weights": weights, "baseline": baseline})
    # `generate` grows each block's keys and values by concatenation (old and new alive at once);
    # a step's sampling holds a few [rows, vocab] tensors (`hpref.rl.engines.sampling`: the scores, their
    # log-softmax, the Gumbel noise, the processed scores)
    longest = prompt + row_after_prompt(rollout, prompt, context)
    kv = rows * longest * shape.layers * 2 * shape.kv_width * 4 * 2
    generation = kv + 4 * rows * shape.vocab * 4
    prefill = rollout.prompts_per_rollout * prompt * shape.vocab * 4  # the prompt forward's logits
    if context is not None:  # a later turn forwards each live episode's context, up to one answer short
        prefill = max(prefill, rows * (longest - rollout.max_new_tokens) * shape.vocab * 4)
    # a sync: one received bucket (a tensor larger than a bucket, the embedding, comes alone), the
    # rest of it in the stage file until the commit reads it back a tensor at a time
    bucket = min(int(config.weight_sync_bucket_mb * MIB), weights)
    sync = max(bucket, shape.vocab * shape.hidden * 4)
    transients = {"generation": generation, "prompt logits": prefill, "sync bucket": sync}
    largest = max(transients, key=lambda k: transients[k])
    return Memory({"weights": weights, largest: transients[largest], "baseline": baseline})


def process_baseline() -> int:
    """This process's resident set after importing what an actor imports (torch, transformers, the
    trainer), plus a Ray worker's own: the memory an actor holds before its model."""
    import torch  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401  (transformers' model code, as an actor's)

    import hpref.rl.trainer.actor  # noqa: F401

    return resident_bytes() + RAY_WORKER_BYTES


def resident_bytes() -> int:
    """This process's resident set (Linux's VmRSS; elsewhere its peak, `ru_maxrss`)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
