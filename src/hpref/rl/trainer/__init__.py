"""A policy's trainer: the `actor` (one rank's step, weights for the engine, save and load), its
`group` of ranks (`TrainerGroup`: what the driver calls), `sharding` (FSDP2 over the ranks, the
rollout's split), `backends` (transformers or megatron-core), `state` (saves) and `throughput` (a
step's FLOPs and MFU). Never imports engine code: weights leave through `transport.weight_channel`."""
