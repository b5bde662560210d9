"""Every CPU attention path must give, token for token, what each sequence gives on its own.

The reference runs each packed sequence alone through the same backbone with transformers' stock
eager attention and default positions. A mismatch means tokens attend across a sequence boundary,
a decoder peeks at the future, positions do not restart per sequence, or GQA heads are mis-mapped.
"""

from __future__ import annotations

import pytest
import torch

from hpref.models.attention import resolve_backend
from hpref.models.packed_layout import VarlenContext, block_diagonal_mask, segment_ids_from_cu_seqlens

from .conftest import (
    model_from_config,
    packed_batch,
    reference_backbone,
    tiny_bert_config,
    tiny_gemma2_config,
    tiny_llama_config,
    tiny_roberta_config,
)

CPU_BACKENDS = ("sdpa_segments", "sdpa_block_mask", "auto")
CONFIGS = {
    "llama": tiny_llama_config,
    "bert": tiny_bert_config,
    "roberta": tiny_roberta_config,
    "gemma2": tiny_gemma2_config,
}


def packed_hidden(model, input_ids, cu, positions):
    """Run the PreferenceModel and capture the backbone's packed hidden states alongside the logits."""
    captured = {}
    handle = model.backbone.register_forward_hook(lambda m, a, out: captured.update(h=out.last_hidden_state))
    try:
        logits = model(input_ids, cu, positions)
    finally:
        handle.remove()
    return captured["h"][0], logits


def alone(model, seqs):
    """Hidden states and logits with each sequence run by itself through stock eager attention."""
    ref = reference_backbone(model.backbone)
    hidden = [ref(input_ids=s[None]).last_hidden_state[0] for s in seqs]
    index = 0 if model.pooling == "first" else -1
    logits = model.head(torch.stack([h[index] for h in hidden]))
    return torch.cat(hidden), logits


def test_segment_ids_and_mask_are_block_diagonal_and_causal():
    cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    seg = segment_ids_from_cu_seqlens(cu, 6)
    assert seg.tolist() == [0, 0, 1, 2, 2, 2]
    mask = block_diagonal_mask(seg, causal=True)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    windowed = block_diagonal_mask(seg, causal=True, window=2)
    assert windowed[5].tolist() == [False, False, False, False, True, True]  # i - j < 2 only
    bidirectional = block_diagonal_mask(seg, causal=False)
    assert bidirectional[3].tolist() == [False, False, False, True, True, True]


def test_context_caches_one_mask_per_kind():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    ctx = VarlenContext(backend="sdpa_block_mask", cu_seqlens=cu, max_seqlen=3)
    assert ctx.block_mask(True, None) is ctx.block_mask(True, None)  # built once, reused by every layer
    assert ctx.boundaries == [0, 2, 5]


def test_backend_resolution_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", device=cpu, dtype=torch.bfloat16) == "sdpa_segments"
    assert resolve_backend("sdpa_block_mask", device=cpu, dtype=torch.float32) == "sdpa_block_mask"
    with pytest.raises(RuntimeError, match="CUDA"):
        resolve_backend("torch_varlen", device=cpu, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="flash"):
        resolve_backend("flash_varlen", device=cpu, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("eager", device=cpu, dtype=torch.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_packed_matches_each_sequence_alone(family, backend):
    model = model_from_config(CONFIGS[family](), attention=backend)
    input_ids, cu, positions, seqs = packed_batch()
    with torch.no_grad():
        hidden, logits = packed_hidden(model, input_ids, cu, positions)
        ref_hidden, ref_logits = alone(model, seqs)
    assert model.pooling == ("first" if family in ("bert", "roberta") else "last")
    assert logits.shape == (len(seqs), 3) and logits.dtype == torch.float32
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


def test_gradients_match_each_sequence_alone():
    """Backward through the packed path gives the per-sequence gradients (no cross-talk in grads)."""
    model = model_from_config(tiny_llama_config(), attention="sdpa_block_mask")
    input_ids, cu, positions, seqs = packed_batch()
    model(input_ids, cu, positions).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = reference_backbone(model.backbone)
    total = sum(model.head(ref(input_ids=s[None]).last_hidden_state[0, -1]).sum() for s in seqs)
    total.backward()
    for name, param in ref.named_parameters():
        torch.testing.assert_close(packed[f"backbone.{name}"], param.grad, atol=1e-5, rtol=1e-4, msg=name)
    for name, param in model.head.named_parameters():
        torch.testing.assert_close(packed[f"head.{name}"], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_activation_checkpointing_keeps_the_gradients():
    """Recomputing blocks in backward must reproduce the stored-activation gradients exactly."""
    model = model_from_config(tiny_llama_config()).train()
    input_ids, cu, positions, _ = packed_batch()

    def grads():
        model.zero_grad()
        torch.manual_seed(0)  # the head's dropout draws the same mask in both runs
        model(input_ids, cu, positions).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    stored = grads()
    model.set_activation_checkpointing(True)
    assert all(block.gradient_checkpointing for block in model.blocks())
    recomputed = grads()
    for name, grad in stored.items():
        torch.testing.assert_close(recomputed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_forward_runs_in_bf16_and_returns_float32():
    """bf16 params and compute (what FSDP2 mixed precision gives) must not be forced back to fp32."""
    model = model_from_config(tiny_llama_config())
    input_ids, cu, positions, _ = packed_batch()
    with torch.no_grad():
        fp32 = model(input_ids, cu, positions)
        model.to(torch.bfloat16)
        hidden, bf16 = packed_hidden(model, input_ids, cu, positions)
    assert hidden.dtype == torch.bfloat16
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, fp32, atol=2e-2, rtol=5e-2)


def test_bf16_training_attention_upcasts_inside_and_stays_bf16_outside():
    """A bf16 training step computes CPU attention in fp32 (its backward is faster there) but hands
    bf16 back to the layer. If this fails, either the upcast leaked fp32 activations into the bf16
    model (memory and speed) or the fp32 detour changed the maths beyond bf16 rounding."""
    from hpref.models.attention import upcast_for_backward

    model = model_from_config(tiny_llama_config())
    input_ids, cu, positions, _ = packed_batch()
    model(input_ids, cu, positions).sum().backward()
    fp32_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.to(torch.bfloat16)
    hidden, logits = packed_hidden(model, input_ids, cu, positions)
    assert hidden.dtype == torch.bfloat16
    logits.sum().backward()
    for name, param in model.named_parameters():
        assert param.grad.dtype == torch.bfloat16, name
        torch.testing.assert_close(param.grad.float(), fp32_grads[name], atol=3e-2, rtol=1e-1, msg=name)
    q = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert upcast_for_backward(q, None)
    assert not upcast_for_backward(q, 50.0)  # soft-capping takes the explicit maths path as it is
    assert not upcast_for_backward(q.detach(), None)  # inference: the bf16 forward is the faster one
    with torch.no_grad():
        assert not upcast_for_backward(q, None)


def test_under_autocast_a_training_attention_runs_in_fp32_and_hands_back_bf16(monkeypatch):
    """The RL trainer trains under bf16 autocast over fp32 weights: RoPE's fp32 tables leave q and k
    in fp32 and v in bf16, and CPU autocast casts SDPA's inputs to bf16 whatever they are, so the
    fp32 detour above never happened there and the backward ran bf16's slower kernel (3.2 vs 1.2
    ms a call on SmolLM2). With a backward to come, SDPA must get fp32 with autocast off, and the
    layer bf16 back (what the call under autocast gives); without one (inference, a reference
    without `fp32_attention`) it stays on autocast's bf16. If this fails, the RL trainer's bf16 step
    is back on the slow kernel (~15 % of a SmolLM2 step on the 2-core EPYC)."""
    from hpref.models import attention
    from hpref.models.attention import varlen_attention_forward

    seen = []
    real = attention.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 4, 9, 8, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 4, 9, 8, generator=gen).bfloat16().requires_grad_(True)
    ctx = VarlenContext(
        backend="sdpa_segments", cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32), max_seqlen=5
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = varlen_attention_forward(torch.nn.Module(), q, k, v, None, hpref_varlen=ctx)
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
        assert seen == [(torch.float32, torch.float32, torch.float32, False)] * 2
        assert q.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16
        seen.clear()
        with torch.no_grad():
            out, _ = varlen_attention_forward(torch.nn.Module(), q, k, v, None, hpref_varlen=ctx)
        assert out.dtype == torch.bfloat16 and [s[3] for s in seen] == [True, True]


def test_attention_mask_is_rejected():
    """The packed function builds its own masks; a padded-batch mask would mean the caller is wrong."""
    from hpref.models.attention import varlen_attention_forward

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="attention_mask"):
        varlen_attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 1, 3, 3))


def _fake_varlen(q, k, v, cu, *, scale, left, right, causal, softcap=None, cu_k=None):
    """flash-attn's documented varlen semantics on [T, H, D], written independently with loops.

    Sequence n's queries are `q[cu[n]:cu[n+1]]`, its keys `k[cu_k[n]:cu_k[n+1]]` (`cu_k`: `cu`
    when not given). With `shift` = its keys' count minus its queries' (the mask aligned to the
    bottom right, flash-attn >= 2.1's documented rule), key j is visible from query i when
    i + shift - left <= j <= i + shift + right (-1 = unbounded) and, if causal, j <= i + shift.
    KV heads are shared by groups of query heads.
    """
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    bounds, key_bounds = cu.tolist(), (cu if cu_k is None else cu_k).tolist()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        k_start, k_end = key_bounds[n], key_bounds[n + 1]
        shift = (k_end - k_start) - (end - start)
        i = torch.arange(end - start)[:, None] + shift
        j = torch.arange(k_end - k_start)[None, :]
        allowed = torch.ones(end - start, k_end - k_start, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        if causal:
            allowed &= j <= i
        for h in range(q.shape[1]):
            scores = q[start:end, h] @ k[k_start:k_end, h // groups].T * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[start:end, h] = probs @ v[k_start:k_end, h // groups]
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["flash_varlen", "torch_varlen"])
def test_gpu_backends_plumbing_against_documented_semantics(monkeypatch, backend, causal, window):
    """The GPU kernels cannot run here; this checks what we hand them (layouts, cu_seqlens, causal and
    window conventions, GQA) by swapping in a CPU function with the kernels' documented semantics and
    comparing with the tested sdpa_segments path. It does not test the kernels themselves."""
    from hpref.models import attention

    def fake_flash(
        q,
        k,
        v,
        *,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
    ):
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k == 6 and dropout_p == 0.0
        left, right = window_size
        scale = softmax_scale
        return _fake_varlen(
            q, k, v, cu_seqlens_q, scale=scale, left=left, right=right, causal=causal, softcap=softcap
        )

    def fake_torch(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
        assert enable_gqa == (q.shape[1] != k.shape[1]) and max_q == max_k == 6
        left, right = window_size
        return _fake_varlen(q, k, v, cu_q, scale=scale, left=left, right=right, causal=False)

    monkeypatch.setattr(attention, "_flash_varlen_func", lambda: fake_flash)
    monkeypatch.setattr(attention, "_torch_varlen_func", lambda: fake_torch)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 12, 8, generator=gen)
    k, v = torch.randn(2, 1, 2, 12, 8, generator=gen)  # 2 KV heads for 4 query heads
    cu = torch.tensor([0, 6, 7, 12], dtype=torch.int32)
    ctx = VarlenContext(backend=backend, cu_seqlens=cu, max_seqlen=6)
    kwargs = dict(causal=causal, scale=0.3, window=window, softcap=None, dropout=0.0)
    got = attention._IMPLEMENTATIONS[backend](q, k, v, ctx, **kwargs)
    expected = attention._sdpa_segments(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), ctx, **kwargs
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_a_prefix_tree_attends_piece_by_piece_as_its_whole_mask_does(softcap):
    """A packed prompt group (`PrefixTree`: a prompt, then answers that each see the prompt and
    themselves) attended piece by piece gives the outputs and gradients of one masked call over the
    whole sequence, with an answer of no input token among them, and a plain causal sequence beside
    it; with a sliding window too, whose distances are positions in the sequence (the last answer's
    first token is 5 from the prompt's first, though 8 places after it in the row). If this fails,
    the RL trainer's packed rows (whose attention this is) compute another function than the masked
    square they replace (an answer seeing a sibling, a prompt token seeing an answer, a lost empty
    answer, a window over the packed places)."""
    from hpref.models.attention import varlen_attention_forward
    from hpref.models.packed_layout import PrefixTree

    gen = torch.Generator().manual_seed(0)
    tree = PrefixTree.of(5, [3, 0, 4])
    # the tree (5 + 3 + 0 + 4 tokens), then a causal sequence of 6; float64, so that the two
    # summation orders agree to 1e-12 (the soft-capped path's softmax runs in fp32: 1e-6)
    tol = {"rtol": 1e-6, "atol": 1e-6} if softcap else {"rtol": 1e-12, "atol": 1e-12}
    q, k, v = (torch.randn(1, 4, 18, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 12, 18], dtype=torch.int32)

    def run(own, window=None, plain=None):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ctx = VarlenContext(backend="sdpa_segments", cu_seqlens=cu, max_seqlen=12, segment_masks=[own, plain])
        module = torch.nn.Module()
        out, _ = varlen_attention_forward(
            module, *leaves, None, scaling=0.3, is_causal=True, softcap=softcap, sliding_window=window,
            hpref_varlen=ctx,
        )  # fmt: skip
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return out, [t.grad for t in leaves]

    whole = tree.full_mask()
    assert whole.shape == (12, 12) and not whole[5:8, 8:].any() and not whole[:5, 5:].any()
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8])  # the prompt, then each answer
    for window in (None, 4):
        out, grads = run(tree, window)
        # the reference: the whole square, the window over the tokens' positions in the mask itself
        near = positions[:, None] - positions[None, :] < (window or 99)
        plain = torch.ones(6, 6, dtype=torch.bool).tril()
        plain &= torch.arange(6)[:, None] - torch.arange(6)[None, :] < (window or 99)
        ref_out, ref_grads = run(whole & near, plain=plain)
        torch.testing.assert_close(out, ref_out, **tol)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("backend", ["flash_varlen", "torch_varlen"])
def test_the_gpu_kernels_attend_a_prefix_tree_in_one_call_on_gathered_keys(monkeypatch, backend, window):
    """On a GPU a packed prompt group goes to the varlen kernel in one call: its queries as packed,
    each piece's keys gathered (the prompt's own; an answer's, the prompt's then its own) and the
    kernel's bottom-right causal rule doing the rest (`GatheredKeys`). The kernels cannot run here:
    a CPU function with their documented semantics stands in (`_fake_varlen`), so this checks the
    layout handed to them, not the kernels (benchmarks/gpu.sh section 1 does, on a GPU). Outputs
    and the gradients of q, k and v must equal the tested piece-by-piece path on the same tree
    (GQA, an empty answer, a plain causal sequence beside it, a sliding window); a boolean mask
    must still go to `sdpa_segments`. If this fails, a GPU RL trainer's packed rows compute another
    attention than the CPU's (an answer seeing a sibling, a prompt seeing an answer)."""
    from hpref.models import attention
    from hpref.models.attention import varlen_attention_forward
    from hpref.models.packed_layout import PrefixTree

    calls = []

    def fake_flash(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap):  # fmt: skip
        calls.append((cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), max_seqlen_q, max_seqlen_k))
        left, right = window_size
        return _fake_varlen(q, k, v, cu_seqlens_q, cu_k=cu_seqlens_k, scale=softmax_scale, left=left,
                            right=right, causal=causal)  # fmt: skip

    def fake_torch(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
        left, right = window_size
        return _fake_varlen(q, k, v, cu_q, cu_k=cu_k, scale=scale, left=left, right=right, causal=right == 0)

    monkeypatch.setattr(attention, "_flash_varlen_func", lambda: fake_flash)
    monkeypatch.setattr(attention, "_torch_varlen_func", lambda: fake_torch)
    monkeypatch.setattr(attention, "resolve_backend", lambda requested, **_: requested)
    gen = torch.Generator().manual_seed(0)
    # a plain causal sequence of 4, then a tree of a 5-token prompt and answers of 3, 0 and 4
    q = torch.randn(1, 4, 16, 8, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, 16, 8, generator=gen, dtype=torch.float64)  # 2 KV heads for 4
    cu = torch.tensor([0, 4, 16], dtype=torch.int32)
    tree = PrefixTree.of(5, [3, 0, 4])

    def run(name, own):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ctx = VarlenContext(backend=name, cu_seqlens=cu, max_seqlen=12, segment_masks=[None, own])
        out, _ = varlen_attention_forward(torch.nn.Module(), *leaves, None, scaling=0.3, is_causal=True,
                                          sliding_window=window, hpref_varlen=ctx)  # fmt: skip
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return out, [t.grad for t in leaves]

    got, got_grads = run(backend, tree)
    # the pieces: the causal 4, the prompt's 5, the answers' 3 and 4 (the empty one dropped), their
    # keys the prompt's 5 before each answer's own
    assert calls == [([0, 4, 9, 12, 16], [0, 4, 9, 17, 26], 5, 9)]
    want, want_grads = run("sdpa_segments", tree)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    calls.clear()
    masked, _ = run(backend, tree.full_mask())  # a boolean mask: no kernel takes it
    assert calls == [] and (window is not None or torch.allclose(masked, want))
