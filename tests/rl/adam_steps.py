"""Two trainers that took the same AdamW step by different summation orders (a tensor-parallel group's
slices, an FSDP group's shards against one rank), compared with bounds derived from the computation
rather than tuned on one CPU.

Why their weights cannot be compared with a fixed tolerance: AdamW moves each weight by
lr * m_hat / (sqrt(v_hat) + eps), on the first step lr * g / (|g| + eps). Where a gradient element is
near eps (an embedding row of a token the rollout barely has, a weight whose terms cancel), a
relative rounding difference d in g becomes up to lr * |g| * d / eps in the update: the amplification
depends on how small this CPU's kernels make that element, so a bound on the weights that held on an
AMD EPYC failed on an Intel Xeon (issue #47: 3.19e-6 against 1.45e-6 on one MLP weight).

What is compared instead, for every trainable tensor:
1. the two trainers' Adam moments agree in norm within `MOMENT_REL` of the tensor's moment norm (or of
   the model's, for a tensor whose own moments are near nothing). The moments are the gradients' running
   mean and mean square, and both trainers sum the same terms in another order: fp32 summation of n
   terms is off by about sqrt(n) * 2**-24 of the sum of their magnitudes (random-walk rounding; n is at
   most the rollout's tokens times the hidden width here, ~1e4, so ~6e-6), and a gradient's terms
   cancel by a small factor in these models, so 1e-4 holds with room on any IEEE CPU, while every
   structural fault a group can make (a slice in the wrong rank, a gradient averaged instead of summed,
   a replicated weight stepped twice, log-probs over half the vocabulary) moves a moment by O(1) of its
   norm.
2. each trainer's weights moved exactly as AdamW moves them from its own moments: new == old *
   (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps), recomputed in float64, within the fp32 rounding of
   that update (half an ulp of each of the two roundings of the weight, plus at most eight of the
   update term: the square root, the bias corrections, the eps sum, the division and the product).
Together they say the weights differ only by what the moments' rounding explains, whatever the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

#: the moments' relative disagreement allowed (module docstring, point 1)
MOMENT_REL = 1e-4
#: below this share of the model's moment norm a tensor is compared against the model's norm instead
#: (a tensor whose gradient is itself rounding-level has no relative precision of its own)
TINY_SHARE = 1e-3
FP32_EPS = 2.0**-24  # the unit roundoff of float32


def trainable(trainer: Any) -> dict[str, torch.Tensor]:
    """The trainer's trainable weights by name, cloned (a one-rank trainer: the group's are read back
    through its save, which `load` of a one-rank trainer gathers)."""
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _moments(trainer: Any) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, int]], dict[str, float]]:
    group = trainer.optimizer.param_groups[0]
    settings = {"lr": group["lr"], "wd": group["weight_decay"], "eps": group["eps"]}
    settings["beta1"], settings["beta2"] = group["betas"]
    out = {}
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            state = trainer.optimizer.state[p]
            out[name] = (state["exp_avg"].detach(), state["exp_avg_sq"].detach(), int(state["step"]))
    return out, settings


def assert_moved_as_adamw(trainer: Any, before: dict[str, torch.Tensor]) -> None:
    """Point 2 of the module docstring for one trainer: its weights are its AdamW step from `before`."""
    moments, s = _moments(trainer)
    after = trainable(trainer)
    assert after.keys() == before.keys() == moments.keys()
    for name, (m, v, step) in moments.items():
        m64, v64, old = m.double(), v.double(), before[name].double()
        update = (m64 / (1 - s["beta1"] ** step)) / ((v64 / (1 - s["beta2"] ** step)).sqrt() + s["eps"])
        want = old * (1 - s["lr"] * s["wd"]) - s["lr"] * update
        new = after[name].double()
        slack = (old.abs() + new.abs()) * FP32_EPS + 8 * FP32_EPS * s["lr"] * update.abs() + 1e-45
        worst = float(((new - want).abs() - slack).max())
        assert worst <= 0, (
            f"{name}: the weights are not this trainer's AdamW step from its moments ({worst:.3g} over)"
        )


def assert_same_adamw_step(
    a: Any, b: Any, a_before: dict[str, torch.Tensor], b_before: dict[str, torch.Tensor]
) -> None:
    """Two one-rank trainers after the same rollouts (one of them a group's state read back through its
    save): moments equal within summation-order rounding, and each trainer's weights its own AdamW step
    (module docstring). If this fails, the two took different steps, not the same step rounded apart."""
    ma, _ = _moments(a)
    mb, _ = _moments(b)
    assert ma.keys() == mb.keys()
    assert all(ma[n][2] == mb[n][2] for n in ma), "the two trainers took a different number of steps"
    for which in (0, 1):  # m, then v
        total = sum(float(t[which].double().norm() ** 2) for t in ma.values()) ** 0.5
        assert total > 0, "no moments: the trainers never stepped"
        for name in ma:
            x, y = ma[name][which].double(), mb[name][which].double()
            assert x.shape == y.shape, name
            scale = max(float(x.norm()), TINY_SHARE * total)
            gap = float((x - y).norm())
            assert gap <= MOMENT_REL * scale, (
                f"{name}: moment {'mv'[which]} differs by {gap / scale:.3g} of its norm"
            )
    assert_moved_as_adamw(a, a_before)
    assert_moved_as_adamw(b, b_before)
