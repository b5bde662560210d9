"""The built-in RL algorithms, registered through `register_algorithms` like a plugin's. torch is
imported only when an algorithm runs: `hpref --help` loads this module."""

from __future__ import annotations

from hpref.hookspecs import hookimpl
from hpref.rl.algorithms.grpo import GrpoConfig, build_grpo
from hpref.rl.algorithms.online_dpo import OnlineDpoConfig, build_online_dpo


@hookimpl
def register_algorithms(register):
    register(name="grpo", config=GrpoConfig, build=build_grpo)
    register(name="online-dpo", config=OnlineDpoConfig, build=build_online_dpo)
