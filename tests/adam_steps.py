"""Two trainers that took the same AdamW steps by different summation orders (a tensor-parallel group's
slices, an FSDP group's shards against one rank, several micro-batches against one), compared with
bounds derived from the computation rather than tuned on one CPU. Shared by tests/rl (live trainers)
and tests/train (a run's checkpoints).

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
   most a rollout's or a step's tokens times the hidden width here, 1e4-1e5, so under 2e-5), and a
   gradient's terms cancel by a small factor in these models, so 1e-4 holds with room on any IEEE CPU,
   while every structural fault a group can make (a slice in the wrong rank, a gradient averaged
   instead of summed, a replicated weight stepped twice, log-probs over half the vocabulary) moves a
   moment by O(1) of its norm. After several steps the two sides' gradients are also taken at
   weights that the steps before rounded apart by Adam's amplification; that gap sits where a
   gradient was near eps and moves the next gradients by far less than the bound (offline DPO, six
   steps: 1e-6 of the norm at every step, as at the first), and `assert_runs_take_the_same_adamw_steps`
   holds every step to it.
2. each trainer's weights moved exactly as AdamW moves them from its own moments: new == old *
   (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps), recomputed in float64, within the fp32 rounding of
   that update: the unit roundoff of each of the weight's three roundings (the decay factor, which
   PyTorch's kernels cast to float32 before the multiply, the decayed weight and the sum), plus at
   most eight of the update term (the square root, the bias corrections, the eps sum, the division
   and the product). Without the factor's own rounding a weight near 0.13 missed by 1.1 ulp.
Together they say the weights differ only by what the moments' rounding explains, whatever the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: the moments' relative disagreement allowed (module docstring, point 1)
MOMENT_REL = 1e-4
#: below this share of the model's moment norm a tensor is compared against the model's norm instead
#: (a tensor whose gradient is itself rounding-level has no relative precision of its own)
TINY_SHARE = 1e-3
FP32_EPS = 2.0**-24  # the unit roundoff of float32


@dataclass(frozen=True)
class AdamState:
    """A trainer's trainable weights and AdamW state at one moment, by parameter name: each tensor's
    moments (m, v) with its step count, and the optimizer's settings. Its `lr` is what the optimizer
    holds now: after a scheduler step that is the next step's rate, not the one just taken."""

    weights: dict[str, torch.Tensor]
    moments: dict[str, tuple[torch.Tensor, torch.Tensor, int]]
    settings: dict[str, float]


def _settings(group: dict[str, Any]) -> dict[str, float]:
    beta1, beta2 = group["betas"]
    return {
        "lr": group["lr"],
        "wd": group["weight_decay"],
        "eps": group["eps"],
        "beta1": beta1,
        "beta2": beta2,
    }


def trainable(trainer: Any) -> dict[str, torch.Tensor]:
    """The trainer's trainable weights by name, cloned (a one-rank trainer: the group's are read back
    through its save, which `load` of a one-rank trainer gathers)."""
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def live_state(trainer: Any) -> AdamState:
    """A one-rank trainer's (`.model`, `.optimizer` with one parameter group) state, now."""
    moments = {}
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            state = trainer.optimizer.state[p]
            moments[name] = (state["exp_avg"].detach(), state["exp_avg_sq"].detach(), int(state["step"]))
    return AdamState(trainable(trainer), moments, _settings(trainer.optimizer.param_groups[0]))


def saved_state(folder: Path) -> AdamState:
    """The state in a training checkpoint (`hpref.train.checkpoint.save_checkpoint`: DCP, model and
    optimizer of what trains), whole tensors whatever world size wrote it (DCP reshards on load),
    read through the one restricted reader. The keys and shapes come from the checkpoint's index."""
    from hpref.runfolder.safe_load import dcp_load, read_dcp_index

    index = read_dcp_index(folder).state_dict_metadata

    def empty(key: str) -> torch.Tensor:
        return torch.empty(index[key].size, dtype=index[key].properties.dtype)

    names = [k.removeprefix("model.") for k in index if k.startswith("model.")]
    names = [n for n in names if f"optim.state.{n}.exp_avg" in index]  # parameters, not buffers
    assert names, f"{folder}: no optimizer state in the checkpoint"
    assert not any(k.startswith("optim.param_groups.1.") for k in index), f"{folder}: several groups"
    weights = {n: empty(f"model.{n}") for n in names}
    optim = {n: {s: empty(f"optim.state.{n}.{s}") for s in ("exp_avg", "exp_avg_sq", "step")} for n in names}
    group: dict[str, Any] = {
        k.removeprefix("optim.param_groups.0."): None for k in index if k.startswith("optim.param_groups.0.")
    }
    dcp_load({"model": weights, "optim": {"state": optim, "param_groups": [group]}}, folder, no_dist=True)
    moments = {n: (s["exp_avg"], s["exp_avg_sq"], int(s["step"])) for n, s in optim.items()}
    return AdamState(weights, moments, _settings(group))


def assert_adamw_step(before: dict[str, torch.Tensor], after: AdamState, lr: float, who: str = "") -> None:
    """Point 2 of the module docstring: `after.weights` are AdamW's step from `before` with `after`'s
    moments at learning rate `lr` (the rate the optimizer held when it stepped)."""
    s = after.settings
    assert after.weights.keys() == before.keys() == after.moments.keys(), who
    for name, (m, v, step) in after.moments.items():
        m64, v64, old = m.double(), v.double(), before[name].double()
        update = (m64 / (1 - s["beta1"] ** step)) / ((v64 / (1 - s["beta2"] ** step)).sqrt() + s["eps"])
        want = old * (1 - lr * s["wd"]) - lr * update
        new = after.weights[name].double()
        slack = (2 * old.abs() + new.abs()) * FP32_EPS + 8 * FP32_EPS * lr * update.abs() + 1e-45
        worst = float(((new - want).abs() - slack).max())
        assert worst <= 0, (
            f"{who}{name}: the weights are not this trainer's AdamW step from its moments ({worst:.3g} over)"
        )


def moment_gap(a: AdamState, b: AdamState) -> float:
    """Point 1 of the module docstring: the largest moment disagreement of any tensor, as a share of
    the norm it is measured against (so `MOMENT_REL` is the bound); also checks the two took the same
    number of steps with the same optimizer settings."""
    assert a.moments.keys() == b.moments.keys(), "the two trainers train different tensors"
    assert all(a.moments[n][2] == b.moments[n][2] for n in a.moments), (
        "the two trainers took a different number of steps"
    )
    assert a.settings == b.settings, f"different optimizer settings: {a.settings} and {b.settings}"
    worst = 0.0
    for which in (0, 1):  # m, then v
        total = sum(float(t[which].double().norm() ** 2) for t in a.moments.values()) ** 0.5
        assert total > 0, "no moments: the trainers never stepped"
        for name in a.moments:
            x, y = a.moments[name][which].double(), b.moments[name][which].double()
            assert x.shape == y.shape, name
            share = float((x - y).norm()) / max(float(x.norm()), TINY_SHARE * total)
            assert share <= MOMENT_REL, f"{name}: moment {'mv'[which]} differs by {share:.3g} of its norm"
            worst = max(worst, share)
    return worst


def assert_moved_as_adamw(trainer: Any, before: dict[str, torch.Tensor]) -> None:
    """Point 2 for a live one-rank trainer whose rate did not change with its step: its weights are its
    AdamW step from `before`."""
    state = live_state(trainer)
    assert_adamw_step(before, state, state.settings["lr"])


def assert_same_adamw_step(
    a: Any, b: Any, a_before: dict[str, torch.Tensor], b_before: dict[str, torch.Tensor]
) -> None:
    """Two one-rank trainers after the same rollouts (one of them a group's state read back through its
    save): moments equal within summation-order rounding, and each trainer's weights its own AdamW step
    (module docstring). If this fails, the two took different steps, not the same step rounded apart."""
    moment_gap(live_state(a), live_state(b))
    assert_moved_as_adamw(a, a_before)
    assert_moved_as_adamw(b, b_before)


def assert_runs_take_the_same_adamw_steps(a_run: Path, b_run: Path) -> tuple[int, float]:
    """Two training runs of one recipe, by different summation orders (ranks, micro-batches), each
    saving a checkpoint at the same steps: at every checkpoint their moments agree (point 1), and
    wherever two checkpoints are one step apart each run's weights are its own AdamW step between them
    at the rate its optimizer held after the first (point 2). Returns (the steps checked by point 2,
    the largest moment gap: `moment_gap`'s share); a pair of runs with no two consecutive checkpoints
    fails rather than compare nothing."""
    from hpref.runfolder.checkpoints import complete_checkpoints, step_of

    a_saves, b_saves = complete_checkpoints(a_run), complete_checkpoints(b_run)
    steps = [step_of(p) for p in a_saves]
    assert steps == [step_of(p) for p in b_saves], "the two runs saved different steps"
    checked, worst, last = 0, 0.0, None
    for step, a_save, b_save in zip(steps, a_saves, b_saves, strict=True):
        now = (saved_state(a_save), saved_state(b_save))
        try:
            worst = max(worst, moment_gap(*now))
        except AssertionError as exc:
            raise AssertionError(f"step {step}: {exc}") from None
        if last is not None and last[0] == step - 1:
            for save, before, after in zip((a_save, b_save), last[1], now, strict=True):
                assert_adamw_step(before.weights, after, before.settings["lr"], f"{save}: ")
            checked += 1
        last = (step, now)
    assert checked, f"no two consecutive checkpoints in {steps}: no step was checked"
    return checked, worst
