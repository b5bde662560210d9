"""The RL trainer's FLOPs and MFU (`hpref.rl.trainer.throughput`): the weights counted are the
model's own, the attention pairs the packed mask's own, and `train_mfu` is a step's counted FLOPs
over its seconds and its devices' peak."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hpref.models.pair_logprobs import pack_prefix_groups, prefix_tree_mask  # noqa: E402
from hpref.rl.policy import group_batch, pad_batch  # noqa: E402
from hpref.rl.trainer.throughput import FlopShape, batch_flops, mfu  # noqa: E402


def _llama(tied: bool):
    config = transformers.LlamaConfig(
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # not hidden / heads: a config's own head_dim wins
        intermediate_size=80,
        vocab_size=101,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("tied", [True, False])
def test_the_counted_weights_are_the_models_projections_and_its_lm_head(tied):
    # Wrong if a tied LM head went uncounted (SmolLM2's is a fifth of its matmul weights), an untied
    # one counted twice, the embedding lookup counted as a matmul, or the key/value heads of GQA
    # counted as query heads: every MFU would be off by that share.
    model = _llama(tied)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())  # a tied weight once
    shape = FlopShape.of(model.config)
    # tied: the one table is the head (a matmul), counted once; untied: the head, not the lookup
    assert shape.trained == total - norms - (0 if tied else embedding)
    assert shape.frozen == 0 and shape.attention == 2 * 4 * 16
    lora = FlopShape.of(model.config, adapters=[torch.zeros(3, 48), torch.zeros(5, 3)])
    assert (lora.trained, lora.frozen) == (3 * 48 + 5 * 3, shape.trained)


def test_packed_groups_count_the_pairs_their_mask_allows_and_one_answer_is_a_plain_sequence():
    # Wrong if the prompt were counted once per answer (the padded layout's cost, not the packed
    # one's), if an answer's tokens were charged the other answers' keys, or if the convention
    # differed from a plain sequence's n x n (hpref train's): MFU would not compare across layouts.
    shape = FlopShape(trained=7, frozen=0, attention=1)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    answers = [[[8, 9, 10, 11], [12, 13], [14]], [[15, 16, 17]]]
    packed = pack_prefix_groups(prompts, answers)
    tokens = int(packed["input_ids"].numel())
    allowed = sum(
        int(prefix_tree_mask(p, b).sum())
        for p, b in zip(packed["prefix_lengths"], packed["branch_lengths"], strict=True)
    )
    assert batch_flops(shape, packed) == 42 * tokens + 12 * (2 * allowed - tokens)
    # the layout before packing (prompt groups on a KV cache, answers right-padded): real tokens only
    grouped = group_batch([[1, 2, 3], [1, 2, 3]], [[4, 5], [6, 7, 8]], group_size=2, pad_id=0)
    assert grouped["mask"].shape == (2, 3)
    assert batch_flops(shape, grouped) == 42 * (3 + 2 + 3) + 12 * (9 + 2 * (6 + 2) + 3 * (6 + 3))
    one = pack_prefix_groups([[1, 2, 3]], [[[4, 5, 6, 7]]])  # 3 + 3 input tokens: a sequence of 6
    padded = pad_batch([[1, 2, 3]], [[4, 5, 6]], pad_id=0)
    assert batch_flops(shape, one) == batch_flops(shape, padded) == 42 * 6 + 12 * 36


def test_padded_rows_count_their_real_tokens_and_never_their_padding():
    # Wrong if the megatron layout's padding (the longest row's width for every row) were counted
    # as work: a batch of one long and one short row would look as busy as two long ones.
    shape = FlopShape(trained=10, frozen=5, attention=2)
    batch = pad_batch([[1, 2], [3]], [[4, 5, 6, 7, 8], [9]], pad_id=0)
    assert batch["input_ids"].shape == (2, 7)
    assert batch_flops(shape, batch) == (60 + 20) * 9 + 24 * (49 + 4)


def test_mfu_is_flops_over_seconds_devices_and_peak():
    # Wrong if a group's MFU divided by one device (a two-rank group would read twice its use).
    assert mfu(4e12, 2.0, 2, 1e12) == pytest.approx(1.0)
    assert mfu(1e12, 2.0, 1, 1e12) == pytest.approx(0.5)
