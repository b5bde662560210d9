"""A step's micro-batches on one trainer rank: the rows an algorithm prepared (`TrainingRows`) cut
into micro-batches of at most `micro_batch_tokens` padded tokens, whole prompt groups as
`group_batch`es where the model takes a KV cache, else rows as `pad_batch`es (whole groups still,
when the algorithm pairs rows: online DPO). A group's ranks split the groups (or rows) by padded
tokens (`sharding.split_groups`) and every rank gets as many micro-batches as the busiest one: FSDP2's
collectives need every rank to run the same passes, so a lighter rank adds weight-0 `padding` ones.
"""

from __future__ import annotations

from typing import Any

from hpref.rl.policy import group_batch, micro_batches, pad_batch, whole_groups
from hpref.rl.rollout_types import TrainingRows

Batch = tuple[dict[str, Any], list[int]]  # a micro-batch's tensors and the step's rows it holds


def rank_micro_batches(
    prepared: TrainingRows,
    pad_id: int,
    takes_cache: bool,
    micro_batch_tokens: int,
    data_ranks: int = 1,
    data_rank: int = 0,
) -> list[Batch]:
    """This rank's part of the step's rows as (batch, its row indices) (see the module docstring).
    `takes_cache`: the model shares a prompt's KV cache across its group's answers
    (`hpref.rl.policy.shares_prefix`)."""
    prompts, completions, group = prepared.prompts, prepared.completions, prepared.group
    masks = prepared.masks
    if takes_cache and whole_groups(prompts, group):
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
