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
