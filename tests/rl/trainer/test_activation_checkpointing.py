"""`activation_checkpointing = true` for a policy's trainer (issue #51): each decoder block recomputed
in the backward (`hpref.models.parallelize.checkpoint_blocks`), the prompt's KV cache kept, on one
rank and under FSDP2 alike: the same log-probs and gradients, less held for the backward."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from hpref.models.lm_adapters import decoder_blocks  # noqa: E402
from hpref.models.parallelize import checkpoint_blocks  # noqa: E402
from hpref.rl.policy import completion_logprobs, group_batch, pad_batch  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402

HEADS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
ANSWERS = [[20, 21, 22], [23], [24, 25, 26, 27, 28], [29, 30], [31], [32, 33, 34], [35], [36, 37], [38]]


def tiny_policy(layers: int = 2):
    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig

    model, tok = build_policy_model(PolicyModelConfig(**{**TINY, "num_hidden_layers": layers}))
    return model.train(), tok.pad_token_id


def batches(pad: int) -> dict[str, dict]:
    prompts = [h for h in HEADS for _ in range(3)]
    return {"group": group_batch(prompts, ANSWERS, 3, pad), "pad": pad_batch(prompts, ANSWERS, pad)}


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A GRPO-like loss (per-token weights) of `completion_logprobs`, with entropy, and its gradients."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = completion_logprobs(model, batch, 0.7, entropy=True)
    weights = torch.linspace(-1.0, 1.0, logprobs.numel()).view_as(logprobs)
    loss = (logprobs * weights * batch["mask"]).sum() + 0.01 * entropy.sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_checkpointed_blocks_give_the_same_loss_and_gradients_on_a_shared_kv_cache():
    """Every block recomputed in the backward (its forward runs twice per pass), and the loss and
    every gradient equal the plain model's, for prompt groups on a KV cache and padded rows, full
    weights and LoRA. Wrong if the replay wrote the cache twice or dropped it (transformers' own
    checkpointing turns the cache off: the answers would stop seeing their prompt)."""
    from hpref.models.lm_adapters import apply_lora_to_causal_lm
    from hpref.recipe.schema import LoraSection

    plain, pad = tiny_policy()
    for lora in (False, True):
        if lora:
            apply_lora_to_causal_lm(plain, LoraSection(r=4, alpha=8))
            for name, param in plain.named_parameters():  # B = 0 would hide a wrong path
                if "lora_B" in name:
                    torch.nn.init.normal_(param, std=0.1)
        checkpointed = copy.deepcopy(plain)
        assert checkpoint_blocks(decoder_blocks(checkpointed)) == 2
        runs = []
        mlp = decoder_blocks(checkpointed)[0].mlp
        # a pre-hook: a replay stops once it has recomputed what the backward needs (early stop),
        # before the MLP's forward returns
        mlp.register_forward_pre_hook(lambda *_, runs=runs: runs.append(1))
        for layout, batch in batches(pad).items():
            runs.clear()
            loss, grads = loss_and_grads(plain, batch)
            loss_c, grads_c = loss_and_grads(checkpointed, batch)
            passes = 2 if layout == "group" else 1  # the prompts, then the answers on their cache
            assert len(runs) == 2 * passes, (layout, len(runs))  # each forward again in the backward
            torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=1e-6)
            assert grads_c.keys() == grads.keys() and grads
            for name, grad in grads.items():
                torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        with torch.no_grad():  # the reference's and old log-probs: no backward, nothing recomputed
            runs.clear()
            completion_logprobs(checkpointed, batches(pad)["group"], 0.7)
            assert len(runs) == 2


def test_checkpointing_holds_less_for_the_backward():
    """What a micro-batch holds for its backward (`benchmarks.profile_rl_step.held_for_backward`:
    the tensors saved for it, and a checkpointed block's input) falls to under half with 4 blocks
    checkpointed. Wrong if the blocks still kept
    their activations (checkpointing on in name only)."""
    from benchmarks.profile_rl_step import held_for_backward

    plain, pad = tiny_policy(layers=4)
    checkpointed = copy.deepcopy(plain)
    checkpoint_blocks(decoder_blocks(checkpointed))
    batch = batches(pad)["group"]
    before, after = held_for_backward(plain, batch), held_for_backward(checkpointed, batch)
    assert 0 < after < 0.5 * before, (before, after)


def test_fsdp2_root_over_checkpointed_blocks_gives_the_same_gradients():
    """The trainer's FSDP2 layout (`shard_policy`: a unit per decoder block, the log-probs root) over
    checkpointed blocks, in a one-rank process group: FSDP2's hooks stay outside the replay, and
    the gradients equal the unsharded plain model's. Wrong if the replay ran with the block's
    weights resharded (an error) or gathered them into other numbers."""
    import torch.distributed as dist

    from hpref.rl.trainer.sharding import full, shard_policy

    plain, pad = tiny_policy()
    checkpointed = copy.deepcopy(plain)
    checkpoint_blocks(decoder_blocks(checkpointed))
    batch = batches(pad)["group"]
    loss, grads = loss_and_grads(plain, batch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        root = shard_policy(checkpointed, torch.device("cpu"))
        logprobs, entropy = root(batch, 0.7, entropy=True)
        weights = torch.linspace(-1.0, 1.0, logprobs.numel()).view_as(logprobs)
        loss_c = (logprobs * weights * batch["mask"]).sum() + 0.01 * entropy.sum()
        loss_c.backward()
        torch.testing.assert_close(loss_c.detach(), loss, rtol=1e-6, atol=1e-6)
        for name, param in checkpointed.named_parameters():
            torch.testing.assert_close(full(param.grad), grads[name], rtol=1e-5, atol=1e-7, msg=name)
    finally:
        dist.destroy_process_group()


def test_the_recipe_key_reaches_the_trainer_and_megatron_refuses_it():
    """`activation_checkpointing = true` under a policy: the trainer wraps every decoder block of the
    policy (not its frozen reference) and its step matches the plain trainer's; the megatron
    backend refuses the key in one line. Wrong if the key were read and never applied."""
    from hpref.errors import RecipeError
    from hpref.recipe.rl import parse_rl_section
    from hpref.rl.rollout_types import rollout_of_tokens
    from hpref.rl.trainer.actor import TrainerActor

    def config(**policy):
        return parse_rl_section(
            {
                "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6},
                "defaults": {"model": {**TINY, "num_hidden_layers": 2}, "lr": 1e-2, "precision": "fp32"},
                "policies": {"a": {"algorithm": {"kl_coef": 0.1}, **policy}},
            },
            "test",
        )

    rollout = rollout_of_tokens(
        rollout_id=0,
        group_size=2,
        temperature=1.0,
        rewards=[1.0, 0.0, 0.2, 0.9],
        prompt_ids=[[1, 5, 6, 7]] * 2 + [[1, 8, 3]] * 2,
        completions=[[20, 21], [22], [23, 24, 25], [26]],
        logprobs=[[-1.0, -1.1], [-1.0], [-1.0, -1.1, -1.2], [-1.0]],
    )
    steps, runs = {}, {}
    for on in (False, True):
        trainer = TrainerActor("a", config(activation_checkpointing=on).policies["a"], 1)
        wrapped = [hasattr(b.forward, "__wrapped__") for b in decoder_blocks(trainer.model)]
        assert wrapped == [on, on]
        assert not any(hasattr(b.forward, "__wrapped__") for b in decoder_blocks(trainer.reference))
        calls = runs[on] = []
        decoder_blocks(trainer.model)[0].mlp.register_forward_pre_hook(lambda *_, c=calls: c.append(1))
        steps[on] = (trainer.train(rollout), trainer.model.state_dict())
    # the trainer's own layout (whatever `_micro_batches` lays out) replays every forward pass
    assert len(runs[True]) == 2 * len(runs[False]) > 0, (len(runs[True]), len(runs[False]))
    assert steps[True][0]["loss"] == pytest.approx(steps[False][0]["loss"], abs=1e-6)
    for key, value in steps[False][1].items():
        torch.testing.assert_close(steps[True][1][key], value, atol=1e-6, rtol=1e-6)
    with pytest.raises(RecipeError, match="activation_checkpointing = true is for the transformers"):
        config(activation_checkpointing=True, trainer_backend="megatron")
