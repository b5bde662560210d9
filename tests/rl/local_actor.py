"""An in-process stand-in for a Ray actor handle, for tests that run the rl driver without Ray."""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any


class LocalRef:
    """One of the values of a `h.method.options(num_returns=n).remote(...)` call: awaitable, and
    resolved to its value when passed to another actor's method, as Ray does with an ObjectRef."""

    def __init__(self, call: Any, index: int) -> None:
        self._call, self._index = call, index

    def __await__(self) -> Any:
        return self._value().__await__()

    async def _value(self) -> Any:
        return (await self._call)[self._index]


async def _stream(generate: Any) -> Any:
    """What a Ray streaming generator gives an `async for`: each value as an awaitable ref, as the
    generator yields it (it runs in a thread, under the actor's lock, while the caller consumes: a
    generator that waits on another actor between yields, as a weight sync's sender does, must not
    be run to its end first)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    end = object()

    def run() -> None:
        try:
            for value in generate():
                loop.call_soon_threadsafe(queue.put_nowait, (value, None))
        except BaseException as exc:
            loop.call_soon_threadsafe(queue.put_nowait, (None, exc))
        loop.call_soon_threadsafe(queue.put_nowait, (end, None))

    worker = asyncio.ensure_future(asyncio.to_thread(run))
    while True:
        value, exc = await queue.get()
        if exc is not None:
            raise exc
        if value is end:
            break
        yield LocalRef(_done(value), 0)
    await worker


async def _done(value: Any) -> tuple[Any]:
    return (value,)


class LocalActor:
    """An in-process stand-in for a Ray actor handle: `await h.method.remote(...)`,
    `h.method.options(num_returns=n).remote(...)` for n `LocalRef`s, and
    `options(num_returns="streaming")` for a generator method's values.

    Calls run one at a time, as on a Ray actor: synchronous methods in a worker thread under a
    lock, coroutine methods on the caller's event loop.
    """

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        self._lock = threading.Lock()

    @property
    def wrapped(self) -> Any:
        return self._obj

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._obj, name)
        lock = self._lock

        async def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple([await a if isinstance(a, LocalRef) else a for a in args])
            kwargs = {k: await v if isinstance(v, LocalRef) else v for k, v in kwargs.items()}
            if inspect.iscoroutinefunction(fn):
                return await fn(*args, **kwargs)

            def locked() -> Any:
                with lock:
                    return fn(*args, **kwargs)

            return await asyncio.to_thread(locked)

        def streamed(*args: Any, **kwargs: Any) -> Any:
            with lock:
                yield from fn(*args, **kwargs)

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                return call(*args, **kwargs)

            @staticmethod
            def options(num_returns: int | str = 1, **_ray_only: Any) -> Any:
                class _Split:
                    @staticmethod
                    def remote(*args: Any, **kwargs: Any) -> Any:
                        if num_returns == "streaming":  # a generator method: its values, as refs
                            return _stream(lambda: streamed(*args, **kwargs))
                        task = asyncio.ensure_future(call(*args, **kwargs))
                        return tuple(LocalRef(task, i) for i in range(int(num_returns)))

                return _Split()

        return _Method()


def length_scored_rollouts(
    tmp_path_factory: Any, mp: Any, cfg: Any, reward_module: str, count: int = 4
) -> tuple[Any, list[Any]]:
    """(a local engine for policy 'a', `count` of its rollouts sampled from its start), scored by a
    rule reward that prefers short answers, written as `reward_module` on the path `mp` patches.

    A random tiny policy's answers all score alike under the arena rules, so every advantage would
    be 0 (no gradient); answer length separates the answers of a group. The trainers that use these
    rollouts take them off-policy, which is all a trainer-level test needs."""
    from hpref.rl.engines.transformers_engine import EngineActor
    from hpref.rl.rollout.executor import RolloutExecutor

    mp.setenv("HPREF_CACHE", str(tmp_path_factory.mktemp("hpref-cache")))
    module = tmp_path_factory.mktemp("reward")
    (module / f"{reward_module}.py").write_text(
        "def score(prompt, answer):\n    return -float(len(answer))\n"
    )
    mp.syspath_prepend(str(module))
    engine = LocalActor(EngineActor("a", cfg.policies["a"].model))

    async def collect() -> list[Any]:
        executor = RolloutExecutor(cfg, ["a"], {"a": engine})
        out = [await executor.get(r, "a") for r in range(count)]
        await executor.shutdown()
        return out

    return engine, asyncio.run(collect())
