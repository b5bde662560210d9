"""The collator's packed layout, fed to a transformers model, equals running each sequence alone.

transformers detects packed sequences from position_ids that restart at 0 (when no attention mask is
given) and builds a block-diagonal causal mask, the CPU stand-in for flash-attention's cu_seqlens
path (with use_cache=False: a cache disables the detection). If the collator's position_ids or
cu_seqlens were off by one, sequences would attend across boundaries and the outputs would differ.
"""

from __future__ import annotations

import pytest
import torch

from hpref.data.packing import TokenizedExample, collate

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_outputs_match_per_sequence_outputs(attn):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaModel(config).eval()
    model.config._attn_implementation = attn
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (7, 1, 12, 3)]
    batch = collate([TokenizedExample(s, None, row=i) for i, s in enumerate(seqs)])
    with torch.no_grad():
        packed = model(
            input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False
        ).last_hidden_state[0]
        for i, s in enumerate(seqs):
            alone = model(input_ids=torch.tensor([s]), use_cache=False).last_hidden_state[0]
            start, end = batch.cu_seqlens[i].item(), batch.cu_seqlens[i + 1].item()
            torch.testing.assert_close(packed[start:end], alone, atol=1e-5, rtol=1e-4)
            # The verdict token the head reads is the sequence's own last token.
            torch.testing.assert_close(packed[batch.last_token_index[i]], alone[-1], atol=1e-5, rtol=1e-4)


def tiny_backbone_config(family: str, vocab_size: int):
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    if family == "llama":  # causal, rotary positions: the verdict is the last token
        return transformers.LlamaConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128
        )
    # bidirectional, absolute position embeddings: positions that did not restart per sequence
    # would change every output (rotary attention alone cannot see a constant position shift)
    return transformers.BertConfig(**common, num_attention_heads=4, max_position_embeddings=256)


@pytest.mark.parametrize("family", ["llama", "bert"])
@pytest.mark.parametrize("backend", ["sdpa_segments", "sdpa_block_mask"])
def test_planned_batches_through_hpref_varlen_attention(chat_tokenizer, backend, family):
    """The whole data path into hpref's own varlen attention (the cu_seqlens path training uses):
    formatted synthetic battles, a full-swap plan over 2 ranks with a tight token budget (so
    micro-batches hold several sequences), `StepPlan.batches` with its filler id, then
    `PreferenceModel(input_ids, cu_seqlens, position_ids, max_seqlen)`. Every real sequence's logits
    must equal that sequence run alone through stock eager attention (a decoder pools its last token,
    an encoder its first); a collator or plan that misplaced a boundary or a position would make them
    differ."""
    import copy

    from hpref.arena import generate_battles
    from hpref.data.formatting import FormatterConfig, JudgeFormatter
    from hpref.data.packing import plan_steps
    from hpref.models.hf import build_from_config

    formatter = JudgeFormatter("pab", FormatterConfig(instruction="Judge."), chat_tokenizer, 96)
    examples = []
    for row, battle in enumerate(generate_battles(3, seed=2)):
        for swapped, view in ((False, battle), (True, battle.swapped())):
            examples.append(TokenizedExample(formatter.encode(view), view.label, row, swapped))
    lengths = [len(e) for e in examples]
    (plan,) = plan_steps(
        lengths,
        [e.row for e in examples],
        [e.swapped for e in examples],
        batch_size=3,
        world_size=2,
        micro_batch_tokens=2 * max(lengths),
        seed=0,
        epoch=0,
        swap="full",
    )
    config = tiny_backbone_config(family, len(chat_tokenizer))
    model = build_from_config(
        config,
        None,
        init_seed=0,
        num_labels=3,
        device="cpu",
        meta=False,
        pooling="last" if family == "llama" else "first",
        attention=backend,
        head_hidden_size=16,
        head_dropout=0.0,
        seed=0,
        provenance={"test": True},
    ).eval()
    reference = copy.deepcopy(model.backbone)
    reference.set_attn_implementation("eager")
    checked, multi = 0, 0
    with torch.no_grad():
        for rank in range(2):
            for batch in plan.batches(rank, examples, filler_token_id=chat_tokenizer.pad_token_id):
                logits = model(
                    batch.input_ids, batch.cu_seqlens, batch.position_ids, max_seqlen=batch.max_seqlen
                )
                assert logits.shape == (batch.num_sequences, 3)
                multi += batch.num_real_sequences > 1
                for k, row in enumerate(batch.rows.tolist()):
                    if row < 0:
                        continue
                    start, end = batch.cu_seqlens[k].item(), batch.cu_seqlens[k + 1].item()
                    hidden = reference(input_ids=batch.input_ids[start:end][None]).last_hidden_state[0]
                    alone = hidden[-1 if family == "llama" else 0]
                    torch.testing.assert_close(logits[k], model.head(alone[None])[0], atol=1e-5, rtol=1e-4)
                    checked += 1
    assert checked == 6 and multi >= 1  # every view checked, and at least one real packing
