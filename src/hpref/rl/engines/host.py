"""`EngineHost`, the Ray actor around whichever registered engine component a recipe names
(`[rl.engine] name = ...`: the built-in `transformers` engine, vLLM, or a plugin's): it builds the
component inside the actor's process and forwards every `Engine` method (`hpref.rl.protocols`),
keeping a colocated engine asleep while its trainer steps.

An engine may instead run inside the rollout executor's process (`rl.engines_in_executor`,
`hpref.rl.placement.engine_process`): the launcher sends its `EngineSpec`, the executor builds the
`EngineHost` there and calls it through an `InProcessEngine` (each call in the engine's own thread),
and the driver and the trainer groups call it through a `HostedEngine`, which reaches it through
the executor's `engine_call`. Both are called as the actor is: `await engine.method.remote(...)`.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpref.recipe.rl import PolicyModelConfig
from hpref.rl.policy import apply_env

if TYPE_CHECKING:
    from hpref.rl.rollout_types import Generation, GenerationRequest


class EngineHost:
    """The Ray actor around a registered engine component (`[rl.engine] name = ...`).

    Ray needs the actor's methods on its class, so this class names every engine method and
    forwards it; the component itself is built inside the actor's process by its plugin's `build`.
    `adapters`: a shared base's LoRA policies by id (`rl.share_base`), passed to `build` only when
    given, so an engine plugin that serves no adapters needs no such argument.
    """

    def __init__(
        self,
        name: str,
        config: Any,
        policy: str,
        model: PolicyModelConfig,
        env: dict[str, str] | None = None,
        adapters: dict[str, Any] | None = None,
    ) -> None:
        apply_env(env)
        from hpref.plugins import load_plugins

        component = load_plugins().get("engine", name)
        if not isinstance(config, component.config):
            config = component.config.model_validate(config or {})
        extra = {"adapters": adapters} if adapters else {}
        self.engine = component.build(config, policy=policy, model=model, env=env, **extra)
        # A colocated engine (`rl.colocate`) sleeps while its trainer steps, and a `generate` that
        # arrives meanwhile (the executor's next rollout) waits for `wake`; for the wake to arrive,
        # the launcher gives such an actor two threads (max_concurrency=2), and this lock keeps the
        # engine itself at one call at a time, as a one-thread actor does.
        self._awake = threading.Event()
        self._awake.set()
        self._lock = threading.Lock()

    def _generating(self, call: Any) -> Any:
        from hpref.memory import release_freed_memory

        self._awake.wait()
        with self._lock:
            out = call()
        release_freed_memory()  # a rollout's logits and KV caches: GiBs glibc would keep (hpref.memory)
        return out

    def generate(self, *args: Any, **kwargs: Any) -> Generation:
        return self._generating(lambda: self.engine.generate(*args, **kwargs))

    def generate_batch(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Several policies' `generate` requests in one go (a shared base's engine)."""
        return self._generating(lambda: self.engine.generate_batch(requests))

    def sleep(self) -> None:
        with self._lock:
            self._awake.clear()
            self.engine.sleep()

    def wake(self) -> None:
        with self._lock:
            self.engine.wake()
            self._awake.set()

    def begin_update(self, version: int, adapter: str | None = None) -> None:
        with self._lock:
            self.engine.begin_update(version, **_adapter(adapter))

    def load_weights(self, state: dict[str, Any], adapter: str | None = None) -> None:
        with self._lock:
            self.engine.load_weights(state, **_adapter(adapter))

    def weight_dtype(self) -> str:
        return self.engine.weight_dtype()

    def weight_channel_device(self) -> str:
        return self.engine.weight_channel_device()

    def connect_weight_channel(self, host: str, port: int, device: str) -> None:
        self.engine.connect_weight_channel(host, port, device)

    def receive_weights(self, layout: list[tuple[str, tuple[int, ...]]], adapter: str | None = None) -> None:
        with self._lock:
            self.engine.receive_weights(layout, **_adapter(adapter))

    def commit_update(self, adapter: str | None = None) -> int:
        from hpref.memory import release_freed_memory

        with self._lock:
            version = self.engine.commit_update(**_adapter(adapter))
        release_freed_memory()  # the staged state dict, copied into the model
        return version

    def abort_update(self, adapter: str | None = None) -> None:
        with self._lock:
            self.engine.abort_update(**_adapter(adapter))

    def get_version(self, adapter: str | None = None) -> int:
        return self.engine.get_version(**_adapter(adapter))


def _adapter(adapter: str | None) -> dict[str, str]:
    """`adapter=` for an engine call on a shared base's adapter; nothing otherwise, so an engine
    plugin that serves no adapters keeps its one-policy signatures."""
    return {"adapter": adapter} if adapter is not None else {}


# --------------------------------------------------------------------------------------------------
# an engine in the rollout executor's process (`rl.engines_in_executor`)


@dataclass(frozen=True)
class EngineSpec:
    """What the executor needs to build a policy's `EngineHost` in its own process: the arguments
    the launcher would have given the engine actor."""

    name: str
    config: Any
    policy: str
    model: PolicyModelConfig
    adapters: dict[str, Any] | None = None

    def start(self, env: dict[str, str] | None) -> InProcessEngine:
        """The engine built in this process, called as its actor would be."""
        host = EngineHost(self.name, self.config, self.policy, self.model, env=env, adapters=self.adapters)
        return InProcessEngine(host, self.policy, getattr(self.config, "threads", None))


def _torch_threads(threads: int) -> None:
    """An engine thread's torch threads. OpenMP keeps a thread count per thread: the engine's own
    `torch.set_num_threads` ran in the thread that built it, and a new thread starts from the
    process's default, all the cores (an actor's process had Ray's OMP_NUM_THREADS, from its CPUs;
    the driver's has no such bound: two SmolLM2 engines in it ran on two threads each, 2x their
    trainers' step time)."""
    import torch

    torch.set_num_threads(threads)


class _InThread:
    """`method.remote(...)` of an `InProcessEngine`: the call submitted to the engine's thread now,
    as a Ray call is sent when made, and awaited as Ray's ObjectRef is."""

    def __init__(self, thread: ThreadPoolExecutor, method: Any) -> None:
        self._thread, self._method = thread, method

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
        return asyncio.wrap_future(self._thread.submit(self._method, *args, **kwargs))


class InProcessEngine:
    """An `EngineHost` in this process, called as its actor is. Each engine has one thread of its
    own, so calls run one at a time and in the order they were made, as on a one-thread actor, while
    the executor's event loop and the other policies' engines go on (torch releases the GIL in its
    kernels, so two engines still generate on two cores)."""

    def __init__(self, host: EngineHost, policy: str, threads: int | None = None) -> None:
        self.host = host
        # `threads`: the engine's torch threads, set in its own thread (`_torch_threads`)
        start = {"initializer": _torch_threads, "initargs": (threads,)} if threads else {}
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{policy}", **start)

    def __getattr__(self, name: str) -> _InThread:
        if name.startswith("_"):  # not an engine method (`_actor_id`: this is no Ray actor)
            raise AttributeError(name)
        return _InThread(self._thread, getattr(self.host, name))

    def stop_thread(self) -> None:
        """No more calls: those queued are dropped; one running finishes in its thread (a generation
        in flight: the process waits for it at exit, bounded by one batch of `max_new_tokens`)."""
        self._thread.shutdown(wait=False, cancel_futures=True)


class _ThroughExecutor:
    """`method.remote(...)` of a `HostedEngine`: the executor's `engine_call` of that method."""

    def __init__(
        self, executor: Any, policy: str, method: str, options: dict[str, Any] | None = None
    ) -> None:
        self._executor, self._policy, self._method = executor, policy, method
        self._options = options or {}

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        call = self._executor.engine_call
        if self._options:
            call = call.options(**self._options)
        return call.remote(self._policy, self._method, *args, **kwargs)

    def options(self, **options: Any) -> _ThroughExecutor:
        return _ThroughExecutor(self._executor, self._policy, self._method, {**self._options, **options})


class HostedEngine:
    """The driver's handle of a policy's engine in the rollout executor's process: called as the
    engine actor would be, each call goes to the executor's `engine_call`. Ray's own questions to an
    actor (`__ray_ready__`, `_actor_id`) go to the executor, whose process the engine lives and dies
    in (`hpref.runtime.ray_cluster.actor_names` names it so)."""

    def __init__(self, executor: Any, policy: str) -> None:
        self.executor, self.policy = executor, policy

    @property
    def _actor_id(self) -> Any:
        return self.executor._actor_id

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__ray_"):
            return getattr(self.executor, name)
        if name.startswith("_"):
            raise AttributeError(name)
        return _ThroughExecutor(self.executor, self.policy, name)
