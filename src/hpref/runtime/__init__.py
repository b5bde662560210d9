"""What the commands share to run processes, below every command package and above the components.

distributed   a rank's process group (`init_distributed`, `DistInfo`) and its seeds
torchrun      torchrun in this process: the launch, the one-node loopback rendezvous, a failed or
              stalled rank named in one line (`run_torchrun`)
stores        rendezvous stores bound to their address (torch's bind every interface), gloo
              pinned to loopback for a group that meets there
watchdog      the workers' heartbeat and the launcher's check of it; workers die with the launcher
stop_signals  SIGTERM and Ctrl-C: a launcher's graceful stop (the ranks save at the next step and
              end; a second signal stops at once), `hpref train`'s
ray_cluster   starting or joining the Ray cluster (`hpref rl`'s actors, `hpref serve`'s replicas)
peak          a device's peak FLOP/s, the denominator of every MFU (`hpref train`'s, the RL trainer's)
checkpoint    a train checkpoint (or run folder) -> the model it holds, with its recipe: the one
              loader `hpref eval` and `hpref save` both use

Train, evaluate, rl and serve import from here; none of them imports another.
"""
