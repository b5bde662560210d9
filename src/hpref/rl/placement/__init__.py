"""Where actors go and what a shared base decides: `resources` (Ray asks, bundles, nodes, GPU memory)
and `shared_base` (one engine and one trainer for several LoRA policies of one base: the decision,
the placement order and the adapter views). Read by the plan, the driver, the launcher and the
trainer group; imports only `transport` and the shared modules below."""
