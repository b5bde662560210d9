"""The trainer of one `hpref rl` policy: a step of its algorithm per rollout, weights for its engine,
save and load.

What a step trains on and its loss are the policy's algorithm's (`hpref.rl.protocols.Algorithm`,
built by `hpref.rl.algorithms.registry`: `grpo`, `online-dpo` or a plugin's); the trainer runs the
micro-batches, the optimizer and the group's reductions. The padding maths is `hpref.rl.policy`
(`packed_batch`: rows without padding through the varlen attention path, each prompt once before its
group's answers; `pad_batch` for the megatron model); a step's FLOPs and MFU are
`hpref.rl.trainer.throughput`'s. The policy's model is a transformers causal LM, or with
`trainer_backend = "megatron"` a megatron-core GPTModel (`hpref.models.megatron.causal_lm`) that
computes the same log-probs and hands the engine, and a save, the transformers layout. Saves are
`hpref.rl.trainer.state`'s. With `ranks` > 1 each rank is one actor of the policy's trainer group
(`hpref.rl.trainer.group`, `hpref.rl.trainer.sharding`): the model sharded over the group, the
rollout's prompt groups split between the ranks, and the weights reaching the engine through the
weight channel (`hpref.rl.transport.weight_channel`).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from hpref.memory import release_freed_memory
from hpref.recipe.rl import PolicyConfig
from hpref.rl.policy import (
    apply_env,
    completion_logprobs,
    on_mask,
    shares_prefix,
)
from hpref.rl.protocols import PreparesBatches
from hpref.rl.rollout_types import Rollout, TrainingRows
from hpref.rl.staleness import expected_version
from hpref.rl.trainer.backends import trainer_backend
from hpref.rl.trainer.batches import Batch, rank_micro_batches
from hpref.rl.trainer.slots import PolicySlot, add_adapters, slot_attribute
from hpref.rl.trainer.throughput import FlopShape, batch_flops, mfu

if TYPE_CHECKING:
    from torch import nn

    from hpref.rl.transport.weight_channel import Layout


class TrainerActor:
    """One policy, or every LoRA policy of a shared base: a step of its algorithm per rollout,
    weights for the engine, save and load."""

    policy = slot_attribute("policy")
    config = slot_attribute("config")
    optimizer = slot_attribute("optimizer")
    trainable = slot_attribute("trainable")
    rollouts_done = slot_attribute("rollouts_done")
    version = slot_attribute("version")

    def __init__(
        self,
        policy: str,
        config: PolicyConfig | dict[str, Any],
        update_interval: int,
        threads: int = 1,
        env: dict[str, str] | None = None,
        rank: int = 0,
        world_size: int = 1,
        shared: dict[str, PolicyConfig | dict[str, Any]] | None = None,
    ):
        """`shared`: every policy of a shared base by id (`policy` is one of them), each trained as
        its own LoRA adapter (named by the policy's id) over the one base; None: `policy` alone."""
        apply_env(env)
        import torch

        from hpref.rl.trainer.sharding import trainer_device

        torch.set_num_threads(threads)
        given = shared if shared is not None else {policy: config}
        self.slots = {
            p: PolicySlot(p, c if isinstance(c, PolicyConfig) else PolicyConfig.model_validate(c))
            for p, c in given.items()
        }
        self.shared = shared is not None
        self.active = self.slots[policy]
        self.update_interval = update_interval
        self.rank, self.world_size = rank, world_size
        self.device = trainer_device(policy, rank, self.config.gpus_per_rank)
        self.backend = trainer_backend(self.config.trainer_backend)  # hpref.rl.trainer.backends
        self._store: Any = None  # rank 0 of a group: the group's TCPStore (`open_rendezvous`)
        self._channel_store: Any = None  # rank 0: the weight channel's store (`open_weight_channel`)
        if world_size == 1:
            self._build()
        # else: the group builds once every rank has joined (`open_rendezvous`, `join_group`)

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0 of a group: serve the group's store; returns its (host, port) for the other ranks."""
        from hpref.rl.transport.rendezvous import open_rendezvous

        self._store, host, port = open_rendezvous(self.world_size)
        return host, port

    def join_group(self, host: str, port: int) -> None:
        """Join the policy's process group, then build the policy and shard it over the group."""
        from hpref.rl.transport.rendezvous import join_group

        join_group(self._store, host, port, self.rank, self.world_size, self.device)
        self._build()

    def _build(self) -> None:
        import torch

        from hpref.runtime.peak import peak_flops

        self.model, self.tokenizer = self.backend.build(self.config.model)
        self.model.to(self.device)
        self.lora = None  # PEFT's handle when the policy has [lora]; self.model stays the LM it adapts
        if self.config.lora is not None:
            self.lora = add_adapters(self.model, self.slots, self.policy, self.shared)
        self.model.train()
        self.reference = None
        if self.wants_reference and self.lora is None:  # the frozen starting policy
            # (with LoRA the frozen base is the start: `_reference_logprobs` turns the adapters off)
            start = self.backend.frozen_copy(self.model, self.config.model)
            self.reference = start.to(self.device).eval().requires_grad_(False)
        if self.config.activation_checkpointing:  # after the copy: the reference runs no backward
            from hpref.models.lm_adapters import decoder_blocks
            from hpref.models.parallelize import checkpoint_blocks

            checkpoint_blocks(decoder_blocks(self.model))  # FSDP2's units wrap these blocks, outside
        # a group's forward runs through the roots its backend shards (transformers: FSDP2,
        # `hpref.rl.trainer.sharding.shard_policy`); the KL reference is sharded the same way, so no rank
        # holds a whole copy of either. What the ranks split is the rollout's data (`data_split`).
        self.root = self.reference_root = None
        self.data_rank, self.data_ranks = self.backend.data_split(self.rank, self.world_size)
        if self.world_size > 1:
            # the reference never runs a backward: it reshards after every forward whatever the policy does
            self.root = self.backend.shard(self.model, self.device, self.config.reshard_after_forward)
            if self.reference is not None:
                self.reference_root = self.backend.shard(self.reference, self.device)
            release_freed_memory()  # the whole weights each rank loaded before it kept its shards
        # Only what trains: all weights, or the adapters alone (a frozen base needs no Adam moments);
        # read after sharding, which replaces each parameter by its shard. On a shared base each
        # policy's optimizer holds its own adapter's.
        for slot in self.slots.values():
            if self.shared:
                from hpref.models.lm_adapters import adapter_parameters

                slot.trainable = adapter_parameters(self.model, slot.policy)
            else:
                slot.trainable = [p for p in self.model.parameters() if p.requires_grad]
            slot.optimizer = torch.optim.AdamW(
                slot.trainable,
                lr=slot.config.lr,
                betas=slot.config.betas,
                weight_decay=slot.config.weight_decay,
            )
        # bf16 autocast or fp32 (`precision`) on the model's device; the megatron trainer computes in fp32
        self.compute_dtype = self.backend.compute_dtype(self.config.precision, self.model)
        self.peak = peak_flops(self.device, self.compute_dtype)  # each rank's device: `train_mfu`'s

    @property
    def wants_reference(self) -> bool:
        """Whether the active policy's step needs its start's log-probs (its algorithm's call: GRPO's KL
        term or its measure, DPO's reference)."""
        return self.active.algorithm.wants_reference()

    def select(self, policy: str | None) -> None:
        """Work on `policy` (None: the one the trainer has); on a shared base, its adapter is the
        one PEFT runs and trains."""
        if policy is None or policy == self.policy:
            return
        if policy not in self.slots:
            raise KeyError(f"trainer: no policy '{policy}' here (it trains {', '.join(self.slots)})")
        self.active = self.slots[policy]
        if self.shared and self.lora is not None:
            self.lora.set_adapter(policy)

    def _logprobs(self, model: nn.Module, batch: dict, temperature: float, entropy: bool = False) -> Any:
        """`completion_logprobs` (`entropy`: and the entropies) in the trainer's compute dtype (log-softmax
        in fp32), on the model's device; `model` is the LM or, in a group, its FSDP2 root."""
        import torch

        bf16 = self.compute_dtype == torch.bfloat16
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            if model is self.root or model is self.reference_root:
                return model(batch, temperature, entropy=entropy)
            return completion_logprobs(model, batch, temperature, entropy=entropy)

    def close(self) -> None:
        """Release what the trainer set up beyond its memory (the backend's: megatron's parallel
        state and the one-rank process group made for it; a group's process group; a killed Ray
        actor has nothing else to free)."""
        from hpref.rl.transport.rendezvous import leave_group

        if hasattr(self, "model"):
            self.backend.close(self.model)
        if self.world_size > 1:
            leave_group()

    def train(self, rollout: Rollout) -> dict[str, float]:
        """One update of the policy's algorithm on a rollout (`epochs_per_rollout` passes); returns
        its metrics.

        The algorithm (`hpref.rl.protocols.Algorithm`: GRPO, online DPO, a plugin's) says which rows
        the step trains on and the loss of each micro-batch; the trainer runs them in micro-batches of
        at most `micro_batch_tokens` padded tokens (whole prompt groups, or rows, of similar length
        together: `hpref.rl.trainer.batches`) and accumulates their gradients before one optimizer
        step. Each micro-batch's loss is its share of the step's, so the step equals the one-batch
        step. In a group each rank runs its share of the prompt groups (`hpref.rl.trainer.sharding`)
        and every rank returns the group's metrics (the policy's entropy on its own answers among
        them)."""
        from hpref.rl.logprobs import entropy_metrics

        self.select(rollout.policy if self.shared else None)
        if rollout.rollout_id != self.rollouts_done:
            raise RuntimeError(
                f"trainer '{self.policy}' got rollout {rollout.rollout_id}, expected {self.rollouts_done}"
            )
        start = time.perf_counter()
        # the last sync's merged state dict is garbage now (Ray has sent it): hand its pages back
        release_freed_memory()
        cfg, algorithm = self.config, self.active.algorithm
        prepared = algorithm.prepare(rollout, self.tokenizer)
        total_tokens = max(prepared.trained_tokens(), 1)
        batches = self._step_batches(prepared)
        stats: dict[str, float] = {}
        for epoch in range(cfg.epochs_per_rollout):
            sums = self._one_pass(batches, prepared, epoch, stats, total_tokens)
        self.rollouts_done += 1
        # glibc keeps a step's freed activations (GiBs at micro_batch_tokens 2,048) in its heaps;
        # without this the process sits at its largest step's peak for the rest of the run, and two
        # trainers plus their engines outgrew a 24 GiB machine (hpref.memory, benchmarks/NOTES.md)
        release_freed_memory()
        seconds = time.perf_counter() - start
        stats.update(
            prepared.metrics,  # the algorithm's, of the whole step (the advantages' spread)
            **entropy_metrics(sums),  # the policy's on its own answers, in the last pass as the loss
            train_tokens=float(total_tokens),
            train_tokens_per_s=total_tokens * cfg.epochs_per_rollout / max(seconds, 1e-9),
            train_mfu=mfu(sums["flops"] * cfg.epochs_per_rollout, seconds, self.world_size, self.peak.flops),
            train_s=seconds,
            # the trainer process's peak RSS so far: a run that grows shows it here, rollout by
            # rollout, before a memory monitor stops it (a two-policy SmolLM2 run was, at update 19)
            # (in a group: rank 0's)
            trainer_peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        )
        return stats

    def _step_batches(self, prepared: TrainingRows) -> list[dict[str, Any]]:
        """The step's micro-batches on this rank's device, each with its rows, the engine's log-probs
        (`old`, where the algorithm kept them) and the reference's; then the algorithm's values of
        the whole step, when it has any (REINFORCE++'s advantages)."""
        import torch

        from hpref.rl.trainer.sharding import reduce_over

        batches = []
        for batch, rows in self._micro_batches(prepared):
            if prepared.behaviour is not None:  # the engine's log-probs where the mask is 1, row by row
                lps = torch.tensor([lp for i in rows for lp in prepared.behaviour[i]], dtype=torch.float32)
                batch["old"] = on_mask(batch["mask"].bool(), lps)
            batch = self._on_device(batch)
            batch["rows"] = rows
            batch["ref"] = self._reference_logprobs(batch, prepared.temperature)
            batches.append(batch)
        algorithm = self.active.algorithm
        if isinstance(algorithm, PreparesBatches):  # values of the whole step (REINFORCE++'s advantages)
            # a group's sums and maxima; as they are on one data rank
            algorithm.prepare_batches(batches, prepared, reduce_over(self.data_ranks))
        return batches

    def _one_pass(
        self,
        batches: list[dict[str, Any]],
        prepared: TrainingRows,
        epoch: int,
        stats: dict[str, float],
        total_tokens: int,
    ) -> dict[str, float]:
        """One pass over the step's micro-batches and one optimizer step; the group's metrics go into
        `stats` (the first pass: the trainer's log-probs against the engine's too). Returns its sums."""
        import torch

        from hpref.rl.logprobs import entropy_sums
        from hpref.rl.trainer.sharding import full, reduce_over

        cfg, algorithm = self.config, self.active.algorithm
        model = self.root if self.root is not None else self.model
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"mismatch": 0.0, "flops": 0.0}
        shape = FlopShape.of(self.model.config, None if self.lora is None else self.trainable)
        sums["micro_batches"] = float(sum(not b.get("padding") for b in batches))  # the group's, summed
        worst = 0.0
        for batch in batches:
            logp, entropy = self._logprobs(model, batch, prepared.temperature, entropy=True)
            loss, own = algorithm.loss(logp, batch, batch["rows"], prepared)
            # a group's padding pass runs the backward FSDP2 needs from every rank, adding nothing;
            # FSDP2 averages gradients over the group: scaled back up, the group sums them
            (loss * (0.0 if batch.get("padding") else self.data_ranks)).backward()
            if batch.get("padding"):
                continue
            own = {**own, **entropy_sums(entropy, batch["mask"], batch["rows"], prepared.sampled)}
            own["flops"] = batch_flops(shape, batch)  # hpref.rl.trainer.throughput
            for key, value in own.items():
                sums[key] = sums.get(key, 0.0) + value
            if epoch == 0 and "old" in batch:  # before any step: the trainer's and the engine's view
                gap = (logp.detach() - batch["old"]).abs() * batch["mask"]
                sums["mismatch"] += float(gap.sum())
                worst = max(worst, float(gap.max()))
        grad_norm = (
            self.backend.clip_grad_norm(self.model, self.trainable, cfg.grad_clip)  # the global norm
            if cfg.grad_clip
            else torch.tensor(0.0)
        )
        self.optimizer.step()
        sums, maxes = reduce_over(self.data_ranks)(sums, {"worst": worst})
        worst, grad_norm = maxes["worst"], full(grad_norm)
        if epoch == 0 and prepared.behaviour is not None:
            stats["engine_trainer_logprob_diff"] = sums["mismatch"] / total_tokens
            # the largest per-token |log importance ratio| between trainer and engine: one token
            # far off (a bf16 engine, a stale or half-loaded weight) hides in the mean
            stats["engine_trainer_logprob_diff_max"] = worst
        stats.update(
            algorithm.summarise(sums), micro_batches=sums["micro_batches"], grad_norm=float(grad_norm)
        )
        return sums

    def _on_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        import torch

        if self.device.type == "cpu":
            return batch
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _micro_batches(self, prepared: TrainingRows) -> list[Batch]:
        """This rank's part of the step's rows (`hpref.rl.trainer.batches`)."""
        layout = "packed" if shares_prefix(self.model) else "padded"  # megatron: no varlen, no cache
        return rank_micro_batches(
            prepared,
            self.tokenizer.pad_token_id,
            layout,
            self.config.micro_batch_tokens,
            self.data_ranks,
            self.data_rank,
        )

    def _reference_logprobs(self, batch: dict[str, Any], temperature: float) -> Any:
        """Log-probs under the frozen starting policy, or None when no KL is asked for."""
        import torch

        if not self.wants_reference:
            return None
        with torch.no_grad():
            if self.lora is not None:
                # LoRA's B starts at zero and the base never steps, so the base alone is the start
                with self.lora.disable_adapter():
                    return self._logprobs(self.root or self.model, batch, temperature)
            if self.reference_root is None:
                return self._logprobs(self.reference, batch, temperature)
            out = self._logprobs(self.reference_root, batch, temperature)
            # FSDP2 keeps a root's weights gathered after its forward, for the backward that
            # follows; the reference has none, so without this every rank would hold the whole
            # embeddings and head of the reference for the rest of the run
            self.reference_root.reshard()
            return out

    def update_weights(self, policy: str | None = None) -> tuple[int, dict[str, Any]]:
        """The current weights whole, in one CPU state dict of copies: (the new version, the state).
        What a sync streams in buckets (`sync_version`, `weight_buckets`), for one-process callers."""
        from hpref.rl.trainer.sharding import full

        version = self.sync_version(policy)
        return version, {k: full(v).clone() for k, v in self._plain_items()}

    def sync_version(self, policy: str | None = None) -> int:
        """The version the next sync publishes (every rank of a group agrees on it)."""
        self.select(policy)
        self.version = expected_version(self.rollouts_done, self.update_interval)
        return self.version

    def device_type(self) -> str:
        return self.device.type

    def open_weight_channel(self) -> tuple[str, int]:
        """Rank 0: serve the store of the channel to this policy's engine
        (`hpref.rl.transport.weight_channel`)."""
        from hpref.rl.transport.weight_channel import open_channel

        self._channel_store, host, port = open_channel()
        return host, port

    def connect_weight_channel(self, host: str, port: int, device: str) -> None:
        """Rank 0: join the channel (as its rank 0; the engine joins as rank 1) on `device`'s kind."""
        import torch

        from hpref.rl.transport.weight_channel import connect

        # NCCL when both ends are on GPUs; a GPU trainer feeding a CPU engine sends from CPU buffers
        where = self.device if device == self.device.type else torch.device(device)
        self.channel = connect(self._channel_store, host, port, 0, where)

    def send_weights(self, bucket_bytes: int, dtype: str, policy: str | None = None) -> Iterator[Layout]:
        """The weights for the engine in buckets of at most `bucket_bytes` in the engine's `dtype`:
        a Ray streaming generator that yields each bucket's layout (names and shapes, through Ray)
        and then sends its bytes through the channel, where the engine's `receive_weights(layout)`
        takes them. A sync holds one bucket beyond the model (`hpref.rl.transport.weight_channel`).

        With LoRA the engine gets merged weights (base + B A alpha/r, under the plain LM's keys), not
        the adapter: it then loads a plain transformers state dict whether or not the policy has
        adapters, so no engine (nor an engine plugin such as vLLM) has to know PEFT, hold the base
        separately, or pay for the adapter's extra matmuls while generating. In a group the other
        ranks send their shards to rank 0, which alone packs and sends. On a shared base (whose
        engine holds the adapters) only the policy's adapter is sent, under PEFT's saved names."""
        import torch

        from hpref.rl.transport.weight_channel import pack_buckets, send_shards

        self.select(policy)
        if self.rank != 0:  # its shards go to rank 0, which packs and sends
            send_shards(self._plain_items())
            return
        for layout, flat in pack_buckets(
            self._plain_items(), bucket_bytes, getattr(torch, dtype), self.channel.device
        ):
            yield layout
            self.channel.send(flat)
        release_freed_memory()

    def _plain_items(self) -> Iterator[tuple[str, Any]]:
        if self.shared:
            from hpref.models.lm_adapters import adapter_items
            from hpref.rl.trainer.sharding import full

            return adapter_items(self.model, self.policy, full)
        return self.backend.plain_items(self.model, self.lora is not None)

    def save(self, folder: str, policy: str | None = None) -> None:
        """The model as a transformers folder (a usable starting checkpoint), optimizer and counters
        (LoRA: the adapter alone and the base it adapts); a group's rank 0 writes the one-rank
        files (`hpref.rl.trainer.state.save_trainer`)."""
        from hpref.rl.trainer.state import save_trainer

        self.select(policy)
        save_trainer(self, folder)

    def load(self, folder: str, policy: str | None = None) -> int:
        """Restore from `folder`; returns the rollout id to start at (0 when there is nothing there)."""
        from hpref.rl.trainer.state import load_trainer

        self.select(policy)
        return load_trainer(self, folder)
