"""`hpref.models.head_logprobs`: the chunked log-probs of taken tokens equal the full logits' path,
in value, entropy and gradient (hidden states, head weight, bias), without the `[N, V]` logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpref.models.head_logprobs import fusable_head, head_logprobs
from hpref.rl.logprobs import token_entropy


def _case(dtype: torch.dtype, bias: bool = True, n: int = 37, hidden: int = 32, vocab: int = 50):
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.3)
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=gen, dtype=dtype))
    h = torch.randn(n, hidden, generator=gen, dtype=dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=torch.float32)
    return head, h, targets, upstream


def _full(head: nn.Linear, h: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = head(h)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


def _grads(
    head: nn.Linear, h: torch.Tensor, logps: torch.Tensor, upstream: torch.Tensor
) -> list[torch.Tensor]:
    params = [h, head.weight] + ([head.bias] if head.bias is not None else [])
    return list(torch.autograd.grad((logps * upstream.to(logps.dtype)).sum(), params))


@pytest.mark.parametrize("bias", [True, False])
def test_chunked_logprobs_equal_full_path_in_float64(bias: bool) -> None:
    """In float64 the chunked path is the full one up to rounding (1e-10): a wrong softmax
    gradient, a temperature applied once too often or not at all in the backward, a bias left out,
    a chunk boundary dropping or double-counting a row would all show far above it."""
    head, h, targets, upstream = _case(torch.float64, bias=bias)
    # 8 rows a chunk: 37 rows cut into 5 chunks, the last a partial one
    logps, entropy = head_logprobs(h, head, targets, 0.7, chunk_elements=8 * 50)
    full = _full(head, h, targets, 0.7)
    assert logps.dtype == torch.float64 and logps.shape == (37,)
    ref = torch.log_softmax(head(h).detach() / 0.7, -1)
    assert torch.allclose(logps, full, atol=1e-10, rtol=0)
    assert torch.allclose(entropy, -(ref.exp() * ref).sum(-1), atol=1e-10, rtol=0)
    assert not entropy.requires_grad
    for got, want in zip(_grads(head, h, logps, upstream), _grads(head, h, full, upstream), strict=True):
        assert torch.allclose(got, want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_a_frozen_head_takes_the_hidden_gradient_in_the_forward_and_it_is_the_full_one(bias: bool) -> None:
    """A LoRA policy's head is frozen, so its hidden states' gradient is taken in the forward and
    only scaled by the upstream gradient in the backward: a wrong temperature factor, a softmax
    from the wrong chunk or a missing upstream scale would differ from the full path's gradient
    (float64, 1e-10); and the head's weights must get no gradient at all."""
    head, h, targets, upstream = _case(torch.float64, bias=bias)
    head.requires_grad_(False)
    logps, _ = head_logprobs(h, head, targets, 0.7, entropy=False, chunk_elements=8 * 50)
    full = _full(head, h, targets, 0.7)
    assert torch.allclose(logps, full, atol=1e-10, rtol=0)
    (got,) = torch.autograd.grad((logps * upstream.double()).sum(), [h])
    (want,) = torch.autograd.grad((full * upstream.double()).sum(), [h])
    assert torch.allclose(got, want, atol=1e-10, rtol=0)
    assert head.weight.grad is None


def test_chunked_logprobs_in_float32_within_the_summation_bound() -> None:
    """In float32 the chunks' matmuls may sum a row's 32 products in another order than the full
    matmul: each logit then differs by at most 32 * 2^-24 * sum|h_i w_i| (~4 here), so ~8e-6, and a
    log-prob (a logit minus a log-sum-exp of them) by twice that; the gradients are sums of 37
    (weight) or 50 (hidden) such products of softmax values <= 1. A tolerance of 2e-5 on values and
    gradients holds by that bound and fails on any mistake in the maths."""
    head, h, targets, upstream = _case(torch.float32)
    logps, entropy = head_logprobs(h, head, targets, 1.3, chunk_elements=5 * 50)
    full = _full(head, h, targets, 1.3)
    assert torch.allclose(logps, full, atol=2e-5, rtol=0)
    assert torch.allclose(entropy, token_entropy(head(h).detach(), 1.3), atol=2e-5, rtol=0)
    for got, want in zip(_grads(head, h, logps, upstream), _grads(head, h, full, upstream), strict=True):
        assert torch.allclose(got, want, atol=2e-5, rtol=0)


def test_chunked_logprobs_under_bf16_autocast_compute_the_head_in_bf16() -> None:
    """Under the trainers' bf16 autocast the head's matmul runs in bf16 as the full path's does (the
    logits, then log-softmax in float32): computed in float32 instead, the log-probs would move by
    the bf16 rounding of the logits (~1e-2 here) and the policy's and the reference's numbers would
    not be the ones the rest of the step sees. The gradients come back in the inputs' dtypes."""
    head, h, targets, upstream = _case(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps, _ = head_logprobs(h, head, targets, 1.0, chunk_elements=1 << 20)
        full = _full(head, h, targets, 1.0)
    assert torch.allclose(logps, full, atol=1e-6, rtol=0)
    assert not torch.allclose(logps, _full(head, h, targets, 1.0), atol=1e-3, rtol=0)
    grads = _grads(head, h, logps, upstream)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    for got, want in zip(grads, _grads(head, h, _full(head, h, targets, 1.0), upstream), strict=True):
        assert torch.allclose(got, want, atol=5e-2, rtol=5e-2)


def test_only_a_plain_linear_head_is_fused() -> None:
    """An adapter-wrapped head (a LoRA'd lm_head) has weights `head_logprobs` would not see: fusing
    it would train without its adapters' contribution, so only a plain `nn.Linear` is fused."""

    class Wrapped(nn.Linear):
        pass

    assert fusable_head(nn.Linear(4, 5))
    assert not fusable_head(Wrapped(4, 5))
    assert not fusable_head(nn.Sequential(nn.Linear(4, 5)))
    assert not fusable_head(None)
