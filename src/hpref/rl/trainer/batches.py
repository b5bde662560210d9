"""A step's micro-batches on one trainer rank: the rows an algorithm prepared (`TrainingRows`) cut
into micro-batches of at most `micro_batch_tokens` tokens, in one of three layouts (`Layout`):

- `packed` (a transformers LM): padding-free `packed_batch`es through the varlen attention path,
  whole prompt groups as one packed sequence each (the prompt once, its answers after it), else
  rows (whole groups still, when the algorithm pairs rows: online DPO); the units are spread over
  the group's ranks and packed by tokens with `hpref.data.packing`'s planner, every rank the same
  number of micro-batches (the planner splits a rank's fullest one, or a rank runs a weight-0
  `padding` copy of one of its own);
- `group`: whole prompt groups as `group_batch`es (each prompt once, its answers on its KV cache);
- `padded`: rows as `pad_batch`es (the megatron model, which takes neither a cache nor varlen).

The last two are split by padded tokens (`sharding.split_groups`), and every rank gets as many
micro-batches as the busiest one: FSDP2's collectives need every rank to run the same passes, so a
lighter rank adds weight-0 `padding` ones. `group` is what the trainer ran before `packed`;
`benchmarks/rl_trainer_speed.py` runs both on the same rollouts.
"""

from __future__ import annotations

from typing import Any, Literal

from hpref.rl.policy import group_batch, micro_batches, packed_batch, pad_batch, whole_groups
from hpref.rl.rollout_types import TrainingRows

Batch = tuple[dict[str, Any], list[int]]  # a micro-batch's tensors and the step's rows it holds
Layout = Literal["packed", "group", "padded"]


def packed_micro_batches(
    prepared: TrainingRows, micro_batch_tokens: int, data_ranks: int = 1, data_rank: int = 0
) -> list[Batch]:
    """This rank's part of the step's rows as `packed_batch`es (the module docstring's `packed`)."""
    from hpref.data.packing import FILLER, spread_and_pack

    prompts, completions, group, masks = (
        prepared.prompts,
        prepared.completions,
        prepared.group,
        prepared.masks,
    )
    shared = group > 1 and whole_groups(prompts, group)
    unit = group if shared or prepared.whole_groups else 1
    units = [list(range(u * unit, (u + 1) * unit)) for u in range(len(completions) // unit)]
    # a unit's packed tokens: its prompt once when shared (else per row) and its answers' inputs
    costs = [
        (len(prompts[rows[0]]) if shared else sum(len(prompts[i]) for i in rows))
        + sum(max(len(completions[i]) - 1, 0) for i in rows)
        for rows in units
    ]

    def make(items: list[int]) -> Batch:
        rows = [i for u in sorted(items) for i in units[u]]
        picked = [masks[i] for i in rows] if masks is not None else None
        size = group if shared else 1
        return packed_batch([prompts[i] for i in rows], [completions[i] for i in rows], size, picked), rows

    plan = spread_and_pack(costs, data_ranks, micro_batch_tokens)[data_rank]
    out = [make(list(mb)) for mb in plan if FILLER not in mb]
    spare = out[0] if out else make([0])  # a rank with nothing of its own repeats unit 0, weight 0
    return out + [(dict(spare[0], padding=True), spare[1]) for mb in plan if FILLER in mb]


def rank_micro_batches(
    prepared: TrainingRows,
    pad_id: int,
    layout: Layout,
    micro_batch_tokens: int,
    data_ranks: int = 1,
    data_rank: int = 0,
) -> list[Batch]:
    """This rank's part of the step's rows as (batch, its row indices) in `layout` (see the module
    docstring; `packed` and `group` need a transformers LM: `hpref.rl.policy.shares_prefix`)."""
    if layout == "packed":
        return packed_micro_batches(prepared, micro_batch_tokens, data_ranks, data_rank)
    prompts, completions, group = prepared.prompts, prepared.completions, prepared.group
    masks = prepared.masks
    if layout == "group" and whole_groups(prompts, group):
        # a group's padded cost: its prompt once and its answers at their longest
        answers = [completions[g : g + group] for g in range(0, len(completions), group)]
        costs = [len(prompts[g * group]) + group * max(map(len, a)) for g, a in enumerate(answers)]

        def make(items: list[int]) -> Batch:
            rows = [g * group + j for g in sorted(items) for j in range(group)]
            picked = [masks[i] for i in rows] if masks is not None else None
            return group_batch(
                [prompts[i] for i in rows], [completions[i] for i in rows], group, pad_id, picked
            ), rows

    else:
        # rows, or whole groups of rows when the loss reads a group together (online DPO's pairs)
        unit = group if prepared.whole_groups else 1
        costs = [
            sum(len(prompts[i]) + len(completions[i]) for i in range(u * unit, (u + 1) * unit))
            for u in range(len(completions) // unit)
        ]

        def make(items: list[int]) -> Batch:
            rows = [u * unit + j for u in items for j in range(unit)]
            picked = [masks[i] for i in rows] if masks is not None else None
            return pad_batch([prompts[i] for i in rows], [completions[i] for i in rows], pad_id, picked), rows

    mine = list(range(len(costs)))
    if data_ranks > 1:
        from hpref.rl.trainer.sharding import split_groups

        mine = split_groups(costs, data_ranks)[data_rank]
    out = [
        make([mine[j] for j in chunk])
        for chunk in micro_batches([costs[i] for i in mine], micro_batch_tokens)
    ]
    if data_ranks > 1:
        from hpref.rl.trainer.sharding import max_over_group

        spare = out[0] if out else make([0])
        out += [(dict(spare[0], padding=True), spare[1]) for _ in range(max_over_group(len(out)) - len(out))]
    return out
