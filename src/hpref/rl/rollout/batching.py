"""A shared base's one engine serves every policy's requests: `RequestBatcher` sends it, in one
`generate_batch`, every request that queued while it worked (in passes of at most `max_rows`
answers), so policies generate together and a batch never changes a policy's answers.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hpref.rl.rollout_types import Generation, GenerationRequest


class RequestBatcher:
    """The generate requests of a shared-base engine (`rl.share_base`), sent together: while the
    engine works on one batch, every request that arrives waits, and the next call takes them all
    (`generate_batch`), so the policies' rollouts, evals and opponents' answers share its passes.
    What a request gets does not depend on its batch (`hpref.rl.engines.sampling`). `max_rows`: the answers
    one call may ask for (0: all that queued), so an engine that runs a batch in passes anyway
    (the transformers engine's `batch_rows`) gets one pass per call and a weight sync waits for one
    pass, not for every policy's rollout."""

    def __init__(self, engine: Any, max_rows: int = 0) -> None:
        self.engine = engine
        self.max_rows = max_rows
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None

    async def generate(self, request: GenerationRequest) -> Generation:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # the requests made in this turn of the event loop go together
        while self._pending:
            waiting = [(r, f) for r, f in self._pending if not f.done()]
            batch, rows = [], 0
            for request, future in waiting:
                n = request.rows if self.max_rows else 0
                if batch and self.max_rows and rows + n > self.max_rows:
                    break
                batch.append((request, future))
                rows += n
            self._pending = waiting[len(batch) :]
            if not batch:
                continue
            try:
                results = await self.engine.generate_batch.remote([r for r, _ in batch])
            except Exception as exc:  # each waiting request gets the engine's error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), out in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(out)

    def cancel(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        for _, future in self._pending:
            future.cancel()
        self._pending = []
