"""The trainer's packed layout (`hpref.rl.policy.packed_batch`): a rollout's rows without padding
through the varlen attention path, each prompt once before its group's answers. It must compute what
the padded layouts do (log-probs and gradients), for answers and for multi-turn episodes' masks."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from hpref.models.pair_logprobs import pack_prefix_groups, prefix_tree_mask  # noqa: E402
from hpref.rl.policy import completion_logprobs, group_batch, packed_batch, pad_batch  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402


def test_prefix_groups_pack_each_prompt_once_and_predict_each_answer_token_from_its_own_branch():
    """The layout's numbers by hand: a wrong position (an answer not continuing its prompt's), a
    token predicted from another answer's position, or an answer seeing its sibling would make the
    packed rows another computation than each answer after its own prompt."""
    packed = pack_prefix_groups([[1, 2, 3], [4]], [[[10, 11, 12], [13], []], [[14, 15]]])
    # segment 0: prompt, answer 0 minus its last token, answer 1 has no input token; segment 1 likewise
    assert packed["input_ids"].tolist() == [1, 2, 3, 10, 11, 4, 14]
    assert packed["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert packed["cu_seqlens"].tolist() == [0, 5, 7] and packed["max_seqlen"] == 5
    assert packed["branch_lengths"] == [[2, 0, 0], [1]]
    # 10 <- prompt's last (2), 11 <- 10 (3), 12 <- 11 (4); 13 <- 2; 14 <- 5 (the prompt 4), 15 <- 6
    assert packed["predict_at"].tolist() == [2, 3, 4, 2, 5, 6]
    mask = prefix_tree_mask(2, [2, 1])
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],
    ]


@pytest.fixture(scope="module")
def tiny_lm():
    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig

    model, tok = build_policy_model(PolicyModelConfig(**{**TINY, "num_hidden_layers": 2}))
    return model.double(), tok.pad_token_id


def _run(model, batch, temperature=0.7):
    model.zero_grad(set_to_none=True)
    logp, entropy = completion_logprobs(model, batch, temperature, entropy=True)
    tokens = logp[batch["mask"].bool()]
    # a weight per answer token, so a token scored at the wrong place changes the gradient
    (tokens * torch.linspace(0.5, 1.5, tokens.numel(), dtype=tokens.dtype)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return tokens.detach(), entropy[batch["mask"].bool()], grads


@pytest.mark.parametrize("episodes", [False, True])
def test_packed_rows_give_the_padded_layouts_logprobs_and_gradients(tiny_lm, episodes):
    """Packed rows (each prompt once, its answers after it, no padding) equal `pad_batch` (every
    answer after its own copy of the prompt) and `group_batch` (the prompt's KV cache) in float64:
    log-probs, entropies and every weight's gradient to 1e-9. With `episodes` the answers are
    multi-turn transcripts whose mask leaves observation tokens out: the packed layout must score
    exactly the masked tokens. A leaking sibling answer, a shifted position or target would differ."""
    model, pad = tiny_lm
    packed_model = copy.deepcopy(model)  # switched to varlen attention on its first packed call
    heads = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    answers = [[20, 21, 22], [23], [24, 25, 26, 27, 28], [29, 30], [31], [32, 33, 34], [35], [36, 37], [38]]
    prompts = [h for h in heads for _ in range(3)]
    masks = None
    if episodes:  # the policy's tokens, then an observation (0s), then the policy's again
        masks = [[1] * len(a) for a in answers]
        masks[2][1:3] = [0, 0]
        masks[5][1] = 0
    padded = pad_batch(prompts, answers, pad, masks)
    grouped = group_batch(prompts, answers, 3, pad, masks)
    packed = packed_batch(prompts, answers, 3, masks)
    assert packed["input_ids"].numel() == sum(map(len, heads)) + sum(len(a) - 1 for a in answers)
    want, cached, got = _run(model, padded), _run(model, grouped), _run(packed_model, packed)
    assert got[0].shape == want[0].shape == (sum(map(sum, masks or [[1] * len(a) for a in answers])),)
    for other in (want, cached):
        torch.testing.assert_close(got[0], other[0], atol=1e-9, rtol=0)
        torch.testing.assert_close(got[1], other[1], atol=1e-9, rtol=0)
        assert got[2].keys() == other[2].keys() and got[2]
    for name, grad in cached[2].items():  # the same maths as the KV-cache layout: float64 rounding
        torch.testing.assert_close(got[2][name], grad, atol=1e-9, rtol=0)
    # transformers' padded forward (eager or SDPA) rounds its gradients at ~1e-7 of their size even
    # in float64 (the KV-cache layout differs from it just as much); a wrong token is ~1e-2 of it
    norm = sum(g.norm() ** 2 for g in want[2].values()) ** 0.5
    diff = sum((got[2][n] - g).norm() ** 2 for n, g in want[2].items()) ** 0.5
    assert float(diff) < 1e-6 * float(norm)
    # rows that are not whole groups of one prompt: each its own packed sequence
    rows = packed_batch([heads[0], heads[1]], answers[:2], 2)
    assert rows["cu_seqlens"].tolist() == [0, 7, 9]
    got = _run(packed_model, rows)
    want = _run(model, pad_batch([heads[0], heads[1]], answers[:2], pad))
    torch.testing.assert_close(got[0], want[0], atol=1e-9, rtol=0)


def test_packed_micro_batches_cover_every_row_once_over_ranks_with_equal_counts():
    """Over two ranks the packed plan gives each prompt group (or each online-DPO pair) to one rank
    whole, every row exactly once, at most `micro_batch_tokens` packed tokens per micro-batch unless
    one group alone is more, and both ranks the same number of micro-batches (FSDP2's collectives
    hang otherwise), the extra ones weight-0 `padding` copies of the rank's own rows."""
    from hpref.rl.rollout_types import TrainingRows
    from hpref.rl.trainer.batches import packed_micro_batches

    prompts = [[1] * n for n in (30, 30, 4, 4, 12, 12)]
    completions = [[7] * n for n in (5, 9, 3, 2, 6, 1)]
    rows = TrainingRows(prompts, completions, 2, None, 1.0)
    per_rank = [packed_micro_batches(rows, 40, 2, r) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    real = [b for rank in per_rank for b in rank if not b[0].get("padding")]
    assert sorted(i for _, r in real for i in r) == list(range(6))
    for batch, r in real:
        assert all(r[j] // 2 == r[j + 1] // 2 for j in range(0, len(r), 2))  # whole groups
        assert batch["input_ids"].numel() <= 40 or len(r) == 2
    # costs: 30 + 4 + 8 = 42 (alone, over budget), 4 + 2 + 1 = 7, 12 + 5 + 0 = 17 -> 42 | 17 + 7
    assert sorted(len(b[1]) for b in real) == [2, 4]
    assert sum(b[0].get("padding", False) for rank in per_rank for b in rank) == 0
    # three groups, four ranks: the fourth rank has none and runs a padding copy
    alone = [packed_micro_batches(rows, 40, 4, r) for r in range(4)]
    assert [len(a) for a in alone] == [1, 1, 1, 1]
    assert [bool(a[0][0].get("padding")) for a in alone] == [False, False, False, True]


def test_packed_rows_under_activation_checkpointing_give_the_same_gradients(tiny_lm):
    """The trainer's blocks may be checkpointed (`activation_checkpointing = true`): their replay in
    the backward must run the packed attention as the forward did (the varlen function, each
    answer's mask), or the gradients would be another function's. float64, 1e-9."""
    from hpref.models.lm_adapters import decoder_blocks
    from hpref.models.parallelize import checkpoint_blocks

    model, _pad = tiny_lm
    plain, checkpointed = copy.deepcopy(model), copy.deepcopy(model)
    first, calls = decoder_blocks(checkpointed)[0], []
    inner = first.forward
    first.forward = lambda *a, **k: calls.append(1) or inner(*a, **k)
    assert checkpoint_blocks(decoder_blocks(checkpointed)) == 2
    prompts = [[5, 6, 7]] * 2 + [[8, 9]] * 2
    answers = [[20, 21, 22], [23, 24], [25], [26, 27, 28]]
    batch = packed_batch(prompts, answers, 2, [[1, 0, 1], [1, 1], [1], [1, 1, 0]])
    want, got = _run(plain, batch), _run(checkpointed, batch)
    assert len(calls) == 2  # the block ran in the forward and again in the backward
    torch.testing.assert_close(got[0], want[0], atol=1e-9, rtol=0)
    assert got[2].keys() == want[2].keys() and got[2]
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-9, rtol=0)
