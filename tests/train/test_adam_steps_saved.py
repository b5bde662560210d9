"""The checkpoint side of tests/adam_steps.py (`saved_state`, `assert_runs_take_the_same_adamw_steps`),
on which test_dpo_train.py's one-rank/two-rank comparison rests, reads what a run saved and can fail: a
check that passed on anything would let that test pass having compared nothing. Tiny runs saved by
`hpref.train.checkpoint.save_checkpoint` (DCP, one process, no process group), in-process."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.adam_steps import assert_runs_take_the_same_adamw_steps  # noqa: E402


def saved_run(folder, steps=2, grad_scale=1.0, tiny=0.0, every=1, tamper_at=None):
    """A one-linear run of `steps` AdamW steps (hpref's fused AdamW) on fixed gradients, its rate
    changing every step, saved after every `every`-th step; `tamper_at`: that step's bias is moved
    past what its moments say, after the step."""
    from hpref.train.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - 0.2 * s)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * grad_scale
        model.weight.grad[0, 0] = 1e-8 + tiny  # an element near eps: Adam amplifies its rounding
        optimizer.step()
        scheduler.step()
        if step == tamper_at:
            with torch.no_grad():
                model.bias.sub_(3e-3 * 0.01)  # a replica's decay applied twice
        if step % every == 0:
            state = {"sampler": {}, "scheduler": scheduler.state_dict()}
            save_checkpoint(folder, step, model=model, optimizer=optimizer, train_state=state, keep=10)
    return folder


def test_saved_runs_of_the_same_steps_pass_and_different_steps_fail(tmp_path):
    # Wrong if the comparison of two runs' checkpoints passed a different run (a gradient off by 1e-3,
    # a weight moved past its moments, nothing compared at all), failed runs whose only difference is
    # rounding amplified by Adam near eps, or checked a step at the rate the scheduler set after it.
    from tests.adam_steps import saved_state

    a = saved_run(tmp_path / "a")
    b = saved_run(tmp_path / "b", grad_scale=1 + 2**-23, tiny=1e-12)  # rounding, amplified near eps
    gap = saved_state(a / "checkpoints" / "step-000002").weights["weight"][0, 0]
    gap -= saved_state(b / "checkpoints" / "step-000002").weights["weight"][0, 0]
    assert float(gap.abs()) > 1e-8  # a fixed 1e-8 bound on the weights would have failed these runs
    assert assert_runs_take_the_same_adamw_steps(a, b)[0] == 1  # step 2, at 2.4e-3 (step 1's 3e-3)

    c = saved_run(tmp_path / "c", grad_scale=1 + 1e-3)  # a gradient that is not the same one
    with pytest.raises(AssertionError, match="step 1: .* moment m differs"):
        assert_runs_take_the_same_adamw_steps(a, c)

    d = saved_run(tmp_path / "d", tamper_at=2)
    with pytest.raises(AssertionError, match="step-000002: bias: the weights are not this trainer's AdamW"):
        assert_runs_take_the_same_adamw_steps(a, d)

    e = saved_run(tmp_path / "e", every=2)
    with pytest.raises(AssertionError, match=r"no two consecutive checkpoints in \[2\]"):
        assert_runs_take_the_same_adamw_steps(e, e)
