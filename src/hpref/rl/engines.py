"""Built-in inference engines of `hpref rl`, registered through the `register_engines` hook.

An engine component's `build(config, *, policy, model, env)` returns an object with the engine
methods the rollout executor and the driver call (see `hpref.hookspecs.register_engines`). The
built-in `transformers` engine is `hpref.rl.actors.EngineActor`: `model.generate` on CPU (or on
whatever device torch defaults to), weights swapped in begin/load/commit steps. vLLM or SGLang
engines can come from plugins the same way, chosen by `[rl.engine] name = "..."`.

This module is loaded by `hpref --help` (it is a built-in plugin): torch is imported inside build.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hpref.hookspecs import hookimpl


class TransformersEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threads: int = Field(1, ge=1, description="torch threads of each engine actor")
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs each engine actor reserves")


def build_transformers(config: TransformersEngineConfig, *, policy: str, model: Any, env: Any = None) -> Any:
    """transformers `generate` on CPU, with versioned weights (begin/load/commit updates)."""
    from hpref.rl.actors import EngineActor

    return EngineActor(policy, model, threads=config.threads, env=env)


@hookimpl
def register_engines(register):
    register(name="transformers", config=TransformersEngineConfig, build=build_transformers)
