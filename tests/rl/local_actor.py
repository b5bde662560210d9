"""An in-process stand-in for a Ray actor handle, for tests that run the rl driver without Ray."""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any


class LocalActor:
    """An in-process stand-in for a Ray actor handle: `await h.method.remote(...)`.

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

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                if inspect.iscoroutinefunction(fn):
                    return fn(*args, **kwargs)

                def locked() -> Any:
                    with lock:
                        return fn(*args, **kwargs)

                return asyncio.to_thread(locked)

        return _Method()
