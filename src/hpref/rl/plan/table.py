"""`hpref rl RECIPE --policies a,b --plan [--ray-address ADDR]`: where every actor of every policy
would go and how much memory it would hold, without building a model, starting an actor or
touching the run folder. How a user sizes a cluster run from a laptop.

The placement is `hpref.rl.placement.resources`'s (the same asks and bundles a run reserves), simulated over
the nodes of the cluster at `--ray-address` (joined read-only: no placement group, no actor) or,
without one, over this machine as the one node a local run would start. A GPU's memory is torch's
on this machine and, on a cluster, the vendor's figure for the accelerator type Ray reports
(`hpref.rl.placement.nodes.GPU_MEMORY_GB`); a node whose GPUs hold actors and whose GPU memory is not
known is named "GPU memory unknown: not checked", never "fits". The plan also says what
`rl.share_base` decided for the policies and why (`hpref.rl.placement.shared_base`), as the run does.
Each actor's memory is `hpref.rl.plan.memory`'s estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpref.rl.placement.nodes import Node, local_node, pack, ray_nodes
from hpref.rl.placement.resources import EXECUTOR_CPUS, HOSTED, actor_asks, check_cluster, executor_cpus
from hpref.rl.plan.memory import (
    GIB,
    MIB,
    Memory,
    engine_memory,
    episode_context,
    model_shape,
    planned_bf16,
    process_baseline,
    roles_played,
    seated,
    trainer_memory,
)

if TYPE_CHECKING:
    from hpref.recipe import Recipe
    from hpref.recipe.rl import RLConfig

#: Prompts whose lengths the plan reads (the first rollouts'); the longest sets the padded width.
PROMPT_SAMPLE = 64


@dataclass
class Row:
    actor: str
    node: Node | None
    cpus: float
    gpu_ids: list[int]
    memory: Memory
    #: the policies this actor serves (a shared base's: every policy; the executor's: none)
    serves: tuple[str, ...] = ()


def prompt_lengths(config: RLConfig, order: Sequence[str]) -> dict[str, int]:
    """The longest of the first `PROMPT_SAMPLE` training prompts in each policy's tokens."""
    from hpref.models.causal_lm import encode_prompt, policy_tokenizer
    from hpref.rl.rollout.prompts import build_prompt_source

    source = build_prompt_source(config)
    prompts = source.train_prompts(config.rollout.seed, 0, PROMPT_SAMPLE)
    out = {}
    for p in order:
        tokenizer = policy_tokenizer(config.policies[p].model)
        out[p] = max(len(encode_prompt(tokenizer, turns)) for turns in prompts)
    return out


def plan_rows(
    config: RLConfig,
    order: Sequence[str],
    nodes: Sequence[Node],
    prompts: dict[str, int],
    *,
    baseline: int,
) -> list[Row]:
    """Every actor, where PACK puts it and its memory; the rollout executor last."""
    from hpref.rl.placement.shared_base import placement_order

    # a shared base (`rl.share_base`): the leader's engine and trainer serve every policy
    hosts = placement_order(config, order)
    adapters = len(order) if config.share_base else 1
    asks = actor_asks(config, hosts)
    spots = pack(nodes, asks)
    engine_dtype = 2 if config.engine_config.dtype in ("bfloat16", "float16") else 4
    context = episode_context(config)
    seats = seated(config, list(order))
    rows, hosted = [], []
    for p in hosts:
        policy, rollout = config.policies[p], config.policy_rollout(p)
        shape = model_shape(policy)
        # a policy's rollout holds each of its roles' rows of every episode: that many prompt groups
        trains = list(order) if config.share_base else [p]  # the policies its trainer steps
        groups = rollout.prompts_per_rollout * roles_played(seats, trains)
        trained = rollout.model_copy(update={"prompts_per_rollout": groups})
        bucket = min(
            int(config.weight_sync_bucket_mb * MIB), shape.params * engine_dtype
        )  # a small model: one
        for ask in asks[p]:
            spot = spots.get(ask)  # None for an engine in the executor's process: placed with it below
            node = spot[0] if spot else None
            gpu_memory = node.gpu_memory if node else None
            if ask.role == "engine":
                served = (adapters, shape.trainable) if config.share_base else (0, 0)
                memory = engine_memory(
                    config,
                    shape,
                    rollout,
                    prompts[p],
                    # in the executor's process: its model and caches, not a process of its own
                    baseline=0 if ask.bundle == HOSTED else baseline,
                    gpu_memory=gpu_memory,
                    adapters=served[0],
                    adapter_params=served[1],
                    context=context,
                    together=seats is not None,
                )
            else:
                gpu = ask.gpus > 0
                bf16 = planned_bf16(policy.precision, shape, gpu=gpu)
                memory = trainer_memory(
                    policy,
                    shape,
                    trained,
                    prompts[p],
                    baseline=baseline,
                    bucket=bucket,
                    bf16=bf16,
                    gpu=gpu,
                    adapters=adapters,
                    context=context,
                )
            name = ask.name + (f" (shared by {', '.join(order)})" if config.share_base else "")
            if ask.bundle == HOSTED:
                name = name.replace(" engine", " engine in the rollout executor", 1)
                hosted.append(len(rows))
            rows.append(Row(name, node, ask.cpus, spot[1] if spot else [], memory, tuple(trains)))
    cpus = executor_cpus(config, hosts)  # its own and its hosted engines' (in the driver: none)
    executor_node = next((n for n in nodes if n.take(cpus, 0) is not None), None)
    for i in hosted:
        rows[i].node = executor_node
    rows.append(executor_row(config, executor_node, baseline))
    return rows


def executor_row(config: RLConfig, node: Node | None, baseline: int) -> Row:
    """The rollout executor's row; in the driver (`rl.executor_in_driver`) Ray reserves nothing for
    it, and its process (one baseline) is the driver's."""
    if config.executor_in_driver:
        return Row("rollout executor (in hpref rl)", node, 0.0, [], Memory({"baseline": baseline}))
    return Row("rollout executor", node, EXECUTOR_CPUS, [], Memory({"baseline": baseline}))


def problems(rows: Sequence[Row], nodes: Sequence[Node]) -> list[str]:
    """What would not fit: an actor no node holds, a node's memory, a GPU's memory (when known)."""
    out = [f"{r.actor}: no node has room for its CPUs and GPUs" for r in rows if r.node is None]
    for node in nodes:
        here = [r for r in rows if r.node is node]
        used = sum(r.memory.host for r in here)
        if node.memory and used > node.memory:
            largest = max(here, key=lambda r: r.memory.host)
            out.append(
                f"{node.name}: its actors need {used / GIB:.2f} GiB of its {node.memory / GIB:.2f} GiB "
                f"(the largest: {largest.actor}, {largest.memory.host / GIB:.2f} GiB)"
            )
        for gpu in range(node.gpus):
            on = [r for r in here if gpu in r.gpu_ids]
            need = sum(r.memory.device for r in on)
            if node.gpu_memory and need > node.gpu_memory:
                names = ", ".join(r.actor for r in on)
                out.append(
                    f"{node.name} GPU {gpu}: {names} need {need / GIB:.2f} GiB of its "
                    f"{node.gpu_memory / GIB:.0f} GiB"
                )
    return out


def unchecked(rows: Sequence[Row], nodes: Sequence[Node]) -> list[str]:
    """The nodes whose GPUs hold actors' memory while their size is unknown: not checked, named."""
    out = []
    for node in nodes:
        used = any(r.node is node and r.gpu_ids and r.memory.device for r in rows)
        if used and node.gpu_memory is None:
            out.append(f"GPU memory unknown: not checked on {node.name} ({node.gpu_note})")
    return out


def render(
    rows: Sequence[Row],
    nodes: Sequence[Node],
    found: Sequence[str],
    header: str,
    *,
    notes: Sequence[str] = (),
) -> list[str]:
    """The plan as text lines: a header (and `notes`), one row per actor, one line per node, the
    verdict: what does not fit, each node whose GPU memory went unchecked, else "fits"."""
    table = [("actor", "node", "CPUs", "GPUs", "host GiB", "GPU GiB", "memory (GiB)")]
    for r in rows:
        ids = ",".join(map(str, r.gpu_ids)) or "-"
        device = f"{r.memory.device / GIB:.2f}" if r.memory.gpu else "-"
        node = r.node.name if r.node else "(nowhere)"
        table.append(
            (r.actor, node, f"{r.cpus:g}", ids, f"{r.memory.host / GIB:.2f}", device, r.memory.text())
        )
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]) - 1)]
    lines = [header, *notes, ""]
    lines += [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in table
    ]
    lines.append("")
    for node in nodes:
        here = [r for r in rows if r.node is node]
        memory = f" of {node.memory / GIB:.1f}" if node.memory else ""
        size = (
            f"{node.gpu_memory / GIB:.1f} GiB each, {node.gpu_note}" if node.gpu_memory else "memory unknown"
        )
        gpus = f", {node.gpus - sum(node.free_gpus):g} of {node.gpus} GPUs ({size})" if node.gpus else ""
        lines.append(
            f"{node.name}: {sum(r.memory.host for r in here) / GIB:.2f}{memory} GiB, "
            f"{node.cpus - node.free_cpus:g} of {node.cpus:g} CPUs{gpus}"
        )
    lines.append("")
    lines += [f"does not fit: {p}" for p in found] + unchecked(rows, nodes) or ["fits"]
    return lines


def episode_line(config: RLConfig) -> str:
    """What the estimate assumed of an environment's episodes (`memory.episode_context`)."""
    environment = config.environment
    return (
        f"episodes ({environment.name!r} environment): trainer rows and engine KV caches counted up to "
        f"max_context_tokens = {environment.max_context_tokens} tokens, not prompt + max_new_tokens"
    )


def roles_line(config: RLConfig, seats: dict[str, str], rows: Sequence[Row]) -> str:
    """Which policy plays each role, on which of the plan's actors, and the policies that play
    several (self-play: a trainer row per role of each episode, what the estimate counted)."""
    played = ", ".join(
        f"{role} by {p} ({', '.join(r.actor for r in rows if p in r.serves)})" for role, p in seats.items()
    )
    several = {p: n for p in dict.fromkeys(seats.values()) if (n := list(seats.values()).count(p)) > 1}
    counted = "".join(f"; {p} trains a row per role of each episode ({n})" for p, n in several.items())
    return f"roles ({config.environment.name!r} environment, played together): {played}{counted}"


def run_plan(
    recipe: Recipe, order: Sequence[str], ray_address: str | None, *, out: Callable[[str], Any] = print
) -> int:
    """Print the plan of `hpref rl --plan`; returns 2 when something does not fit, else 0 (also
    when a node's GPU memory is unknown: the plan then says it did not check it)."""
    from hpref.errors import RecipeError
    from hpref.recipe.rl import resolve_engine

    config = recipe.rl
    assert config is not None
    where = str(getattr(recipe, "_source", None) or "recipe")
    if config.engine_config is None:
        config.engine_config = resolve_engine(config.engine, where)
    from hpref.rl.policy import check_policy_lora, check_policy_models

    # a missing folder or a LoRA target the model lacks: the run's own one-line refusals, not a traceback
    check_policy_models(config, list(order), where)
    check_policy_lora(config, list(order), where)
    from hpref.rl.placement.engine_process import resolve_engine_process
    from hpref.rl.placement.shared_base import placement_order, resolve_share_base

    # as the run decides them
    config = resolve_engine_process(resolve_share_base(config, order, where), where)
    # a cast that cannot play the environment: the run's own one-line refusal (`check_cast`)
    seats = seated(config, list(order), where)
    baseline = process_baseline()
    nodes = ray_nodes(ray_address) if ray_address else [local_node()]
    found = []
    try:  # what `hpref rl` refuses before any actor starts, said here as the verdict
        totals = {"CPU": sum(n.cpus for n in nodes), "GPU": float(sum(n.gpus for n in nodes))}
        resources = [{"CPU": n.cpus, "GPU": float(n.gpus)} for n in nodes]
        check_cluster(config, placement_order(config, order), totals, where, nodes=resources)
    except RecipeError as exc:
        found.append(str(exc))
    prompts = prompt_lengths(config, order)
    rows = plan_rows(config, order, nodes, prompts, baseline=baseline)
    found += problems(rows, nodes)
    place = f"the Ray cluster at {ray_address}" if ray_address else "this machine"
    total_gpus = sum(n.gpus for n in nodes)
    plural = "s" if len(nodes) > 1 else ""
    header = (
        f"hpref rl --plan: policies {', '.join(order)} on {place} ({len(nodes)} node{plural}, "
        f"{sum(n.cpus for n in nodes):g} CPUs, {total_gpus or 'no'} GPUs); prompts up to "
        f"{max(prompts.values())} tokens (the first {PROMPT_SAMPLE}); nothing was started"
    )
    from hpref.rl.placement.engine_process import engine_process_line, executor_process_line
    from hpref.rl.placement.shared_base import share_base_line

    notes = [share_base_line(config)] if len(order) > 1 else []
    notes += [episode_line(config)] if episode_context(config) is not None else []
    notes += [roles_line(config, seats, rows)] if seats is not None else []
    notes += [engine_process_line(config), executor_process_line(config)]
    for line in render(rows, nodes, found, header, notes=notes):
        out(line)
    return 2 if found else 0
