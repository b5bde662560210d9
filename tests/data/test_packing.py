"""Packed micro-batches and the step plan: the invariants FSDP training relies on."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpref.data.packing import (
    FILLER,
    StepSampler,
    TokenizedExample,
    collate,
    filler,
    plan_eval,
    plan_steps,
)


def test_collate_layout_numbers():
    examples = [
        TokenizedExample(np.array([5, 6, 7], dtype=np.int32), (1.0, 0.0, 0.0), row=4, swapped=False),
        filler(9),
        TokenizedExample([8, 9], None, row=2, swapped=True),
    ]
    b = collate(examples)
    assert b.input_ids.tolist() == [5, 6, 7, 9, 8, 9] and b.input_ids.dtype == torch.long
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6] and b.cu_seqlens.dtype == torch.int32
    assert b.position_ids.tolist() == [0, 1, 2, 0, 0, 1]  # restarts per sequence
    assert b.last_token_index.tolist() == [2, 3, 5]
    assert b.labels.tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0]] and b.has_label.tolist() == [
        True,
        False,
        False,
    ]
    assert b.rows.tolist() == [4, FILLER, 2] and b.swapped.tolist() == [False, False, True]
    assert b.weights.tolist() == [1.0, 0.0, 1.0]  # the filler never contributes to the loss
    assert (b.num_sequences, b.num_real_sequences, b.num_tokens, b.max_seqlen) == (3, 2, 5, 3)
    assert b.to("cpu").cu_seqlens.tolist() == [0, 3, 4, 6]


def examples_for(lengths_per_battle):
    """Two views (A/B and B/A) per battle, as tokenize_dataset makes them for swap != 'none'."""
    lengths, rows, swapped = [], [], []
    for row, n in enumerate(lengths_per_battle):
        for view in (False, True):
            lengths.append(n + int(view))  # the views differ slightly, as real ones do
            rows.append(row)
            swapped.append(view)
    return lengths, rows, swapped


def check_plan(plans, lengths, rows, world_size, budget):
    seen = Counter()
    for plan in plans:
        counts = {len(plan.for_rank(r)) for r in range(world_size)}
        assert len(counts) == 1, "ranks run different numbers of micro-batches: FSDP would hang"
        real = [i for r in range(world_size) for mb in plan.for_rank(r) for i in mb if i != FILLER]
        assert plan.num_sequences == len(real)
        assert plan.num_tokens == sum(lengths[i] for i in real)
        for r in range(world_size):
            for mb in plan.for_rank(r):
                assert mb, "empty micro-batch"
                tokens = sum(lengths[i] for i in mb if i != FILLER)
                assert tokens <= budget or len(mb) == 1, "over budget with more than one sequence"
                assert FILLER not in mb or mb == (FILLER,)
        seen.update(real)
    return seen


@settings(max_examples=80, deadline=None)
@given(
    battle_lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    batch_size=st.integers(1, 12),
    world_size=st.integers(1, 5),
    budget=st.integers(16, 600),
    seed=st.integers(0, 3),
)
def test_full_swap_plan_invariants(battle_lengths, batch_size, world_size, budget, seed):
    lengths, rows, swapped = examples_for(battle_lengths)
    plans = plan_steps(
        lengths,
        rows,
        swapped,
        batch_size=batch_size,
        world_size=world_size,
        micro_batch_tokens=budget,
        seed=seed,
        epoch=0,
        swap="full",
    )
    seen = check_plan(plans, lengths, rows, world_size, budget)
    assert seen == Counter(range(len(lengths)))  # every view exactly once per epoch
    for plan in plans:  # a battle and its swapped copy share the step
        step_rows = Counter(
            rows[i] for r in range(world_size) for mb in plan.for_rank(r) for i in mb if i >= 0
        )
        assert all(c == 2 for c in step_rows.values())
        assert len(step_rows) <= batch_size
    assert len(plans) == -(-len(battle_lengths) // batch_size)


def test_plan_is_deterministic_and_reshuffled_per_epoch():
    lengths, rows, swapped = examples_for(list(range(5, 205, 5)))
    kw = dict(batch_size=8, world_size=2, micro_batch_tokens=512, swap="full")
    a = plan_steps(lengths, rows, swapped, seed=1, epoch=0, **kw)
    assert a == plan_steps(lengths, rows, swapped, seed=1, epoch=0, **kw)
    assert a != plan_steps(lengths, rows, swapped, seed=1, epoch=1, **kw)
    assert a != plan_steps(lengths, rows, swapped, seed=2, epoch=0, **kw)


def test_ranks_are_token_balanced():
    rng = np.random.default_rng(0)
    lengths, rows, swapped = examples_for(rng.integers(20, 800, size=64).tolist())
    (plan,) = plan_steps(
        lengths,
        rows,
        swapped,
        batch_size=64,
        world_size=4,
        micro_batch_tokens=4096,
        seed=0,
        epoch=0,
        swap="full",
    )
    per_rank = [sum(lengths[i] for mb in plan.for_rank(r) for i in mb if i >= 0) for r in range(4)]
    # Token-balanced within 10%: an unbalanced split makes every rank wait for the slowest.
    assert max(per_rank) - min(per_rank) < 0.1 * np.mean(per_rank), per_rank


def test_few_sequences_get_fillers_and_long_ones_are_alone():
    (plan,) = plan_steps(
        [5000], [0], [False], batch_size=4, world_size=3, micro_batch_tokens=100, seed=0, epoch=0, swap="none"
    )
    assert plan.micro_batches == (((0,),), ((FILLER,),), ((FILLER,),))
    assert plan.num_sequences == 1
    batches = plan.batches(1, [TokenizedExample([1] * 5000, (1.0, 0.0, 0.0), 0)])
    assert batches[0].rows.tolist() == [FILLER] and batches[0].weights.tolist() == [0.0]


def test_swap_modes_select_views():
    lengths, rows, swapped = examples_for([10] * 200)
    kw = dict(batch_size=200, world_size=1, micro_batch_tokens=10_000, seed=0)
    (none,) = plan_steps(lengths, rows, swapped, epoch=0, swap="none", **kw)
    assert all(not swapped[i] for mb in none.for_rank(0) for i in mb)
    (rand0,) = plan_steps(lengths, rows, swapped, epoch=0, swap="random", **kw)
    (rand1,) = plan_steps(lengths, rows, swapped, epoch=1, swap="random", **kw)
    picked0 = sorted(i for mb in rand0.for_rank(0) for i in mb)
    picked1 = sorted(i for mb in rand1.for_rank(0) for i in mb)
    assert sorted(rows[i] for i in picked0) == list(range(200))  # one view per battle
    assert 70 < sum(swapped[i] for i in picked0) < 130  # about half swapped
    assert picked0 != picked1  # a new draw each epoch


def test_eval_plan_covers_everything_once():
    lengths = [30, 10, 500, 7, 7, 64, 1]
    plan = plan_eval(lengths, world_size=4, micro_batch_tokens=64)
    got = [i for r in range(4) for mb in plan.for_rank(r) for i in mb]
    assert sorted(i for i in got if i != FILLER) == list(range(7))
    assert len({len(plan.for_rank(r)) for r in range(4)}) == 1
    tiny = plan_eval([3, 3], world_size=4, micro_batch_tokens=64)
    assert sum(mb == (FILLER,) for r in range(4) for mb in tiny.for_rank(r)) == 2


def test_sampler_resumes_mid_epoch():
    lengths, rows, swapped = examples_for(list(range(1, 101)))

    def make():
        return StepSampler(
            lengths, rows, swapped, batch_size=10, world_size=2, micro_batch_tokens=128, seed=3
        )

    reference = make()
    all_steps = list(reference)
    assert len(all_steps) == 10 and reference.epoch == 1 and reference.step == 0
    first = make()
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == all_steps[4:]  # the same remaining steps, in order
    other = StepSampler(lengths, rows, swapped, batch_size=11, world_size=2, micro_batch_tokens=128, seed=3)
    with pytest.raises(ValueError, match="different data or batching"):
        other.load_state_dict(state)
