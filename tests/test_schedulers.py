"""The built-in LR schedules, as multipliers over total steps."""

from __future__ import annotations

import math

import pytest

from hpref.plugins import load_plugins


def curve(name: str, total: int, **params) -> list[float]:
    component = load_plugins().get("scheduler", name)
    multiplier = component.build(component.config(**params), total)
    return [multiplier(s) for s in range(total)]


def test_constant_is_one_after_warmup():
    # Wrong if warm-up starts at 0 (a wasted step) or the plateau is not exactly the base LR.
    values = curve("constant", 10, warmup_steps=4)
    assert values[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert values[4:] == [1.0] * 6


def test_linear_warmup_then_decay_to_min_ratio():
    # Wrong if the peak is not reached after warm-up or the last step does not land on min_ratio.
    values = curve("linear", 22, warmup_steps=1, min_ratio=0.1)  # decay over steps 1..21
    assert values[0] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert values[11] == pytest.approx(0.1 + 0.9 * 0.5)


def test_cosine_midpoint_and_end():
    # Wrong if the half-cosine is mis-scaled: at half the decay it must be halfway to min_ratio.
    values = curve("cosine", 101, warmup_steps=0, min_ratio=0.0)
    assert values[0] == pytest.approx(1.0)
    assert values[50] == pytest.approx(0.5)
    assert values[25] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))
    assert values[-1] == pytest.approx(0.0, abs=1e-12)


def test_composite_matches_the_seed_schedule():
    # The LMSYS seed: linear 0.001 -> 1 over the first 10%, then 1 -> 0.001 at the last step.
    values = curve("composite", 100)
    assert values[0] == pytest.approx(0.001)
    assert values[10] == pytest.approx(1.0)
    assert values[5] == pytest.approx(0.001 + 0.999 * 0.5)
    assert values[-1] == pytest.approx(0.001)
    assert max(values) == pytest.approx(1.0)


def test_schedule_rejects_zero_steps():
    # A run with no steps is a recipe bug; a silent constant would hide it.
    component = load_plugins().get("scheduler", "linear")
    with pytest.raises(ValueError, match="at least one step"):
        component.build(component.config(), 0)


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_decay_schedules_warm_up_linearly_first(name):
    # Wrong if the decaying schedules ignored warmup_steps or started the decay before the peak.
    values = curve(name, 14, warmup_steps=4, min_ratio=0.1)
    assert values[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])  # decay starts at step 4, from 1
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[3:], values[4:], strict=False))


def test_warmup_fraction_is_a_share_of_total_steps():
    # warmup_fraction 0.25 of 20 steps = 5 warm-up steps; wrong if the fraction were read as steps.
    values = curve("cosine", 20, warmup_fraction=0.25, min_ratio=0.0)
    assert values[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert values[5] == pytest.approx(1.0) and values[-1] == pytest.approx(0.0, abs=1e-12)


def test_composite_ramp_fraction_is_a_share_of_total_steps():
    # ramp_fraction 0.25 of 8 steps = 2 ramp steps: 0.001, halfway, then the peak, then linear to 0.001.
    values = curve("composite", 8, ramp_fraction=0.25)
    assert values[:3] == pytest.approx([0.001, 0.5005, 1.0])
    assert values[2:] == pytest.approx([1.0 + (0.001 - 1.0) * k / 5 for k in range(6)])
