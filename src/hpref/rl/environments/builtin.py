"""The built-in environments, registered through `register_environments` like a plugin's."""

from __future__ import annotations

from hpref.hookspecs import hookimpl
from hpref.rl.environments.debate import DebateConfig, build_debate
from hpref.rl.environments.propose_solve import ProposeSolveConfig, build_propose_solve
from hpref.rl.environments.signal import SignalConfig, build_signal
from hpref.rl.environments.single_turn import SingleTurnConfig, build_single_turn
from hpref.rl.environments.tool import ToolConfig, build_tool


@hookimpl
def register_environments(register):
    register(name="single-turn", config=SingleTurnConfig, build=build_single_turn)
    register(name="tool", config=ToolConfig, build=build_tool)
    register(name="signal", config=SignalConfig, build=build_signal)
    register(name="debate", config=DebateConfig, build=build_debate)
    register(name="propose-solve", config=ProposeSolveConfig, build=build_propose_solve)
