"""The derived step comparison of tests/adam_steps.py can fail: a check that passes on anything would
let the tensor-parallel and FSDP group tests pass having compared nothing. In-process, milliseconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from tests.adam_steps import assert_same_adamw_step, trainable  # noqa: E402


def stepped(grad_scale=1.0, tiny=0.0):
    """A one-linear "trainer" after one AdamW step on a fixed gradient (scaled, with one near-eps entry)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    trainer = SimpleNamespace(model=model, optimizer=optimizer)
    before = trainable(trainer)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * grad_scale
    model.weight.grad[0, 0] = 1e-8 + tiny  # an element near eps: Adam amplifies its rounding
    optimizer.step()
    return trainer, before


def test_the_same_step_rounded_apart_passes_and_a_different_step_fails():
    # Wrong if the comparison passed a different step (a gradient off by 1e-3, a weight moved twice)
    # or failed a step whose only difference is rounding amplified by Adam near eps.
    a, before = stepped()
    b, _ = stepped(grad_scale=1 + 2**-23, tiny=1e-12)  # rounding of a cancelling sum, amplified near eps
    moved = float((a.model.weight[0, 0] - b.model.weight[0, 0]).abs())
    assert moved > 1e-8  # a fixed 1e-8 bound on the weights would have failed this same step
    assert_same_adamw_step(a, b, before, before)

    c, _ = stepped(grad_scale=1 + 1e-3)  # a gradient that is not the same gradient
    with pytest.raises(AssertionError, match="moment m differs"):
        assert_same_adamw_step(a, c, before, before)

    d, _ = stepped()
    with torch.no_grad():
        d.model.bias.sub_(
            3e-3 * 0.01
        )  # a weight stepped beyond what its moments say (a replica stepped twice)
    with pytest.raises(AssertionError, match="not this trainer's AdamW step"):
        assert_same_adamw_step(a, d, before, before)
