"""What trainers and engines share to reach each other, below both: `rendezvous` (a process group's
TCPStore and join) and `weight_channel` (the trainer -> engine broadcast of a weight sync)."""
