"""The `remote` reward of `hpref rl`: a reward service over HTTP, so several RL jobs share one judge.

Two shapes (`shape`):

hpref     `hpref serve`'s `POST /v1/score`: one request per prompt, its group's answers (and, against
          a judge, the other policies' answers as `opponents`), sent together so the server scores
          them in one batch. Whether the server holds a judge (pairwise: each answer's reward is its
          mean win probability + half tie) or a reward model (one score per answer) is read from
          its `GET /info` when the reward is built.
openrlhf  OpenRLHF's `POST /get_reward` (any server of that shape, `hpref serve` included): every
          answer of the call in one request, `query` = the conversation and the answer as ChatML
          text, `prompts` = the conversation with the reply opened, `labels` = null; the reward is
          `rewards[i]`.

A server that does not answer is retried (`retries`, with a growing pause; connection errors,
timeouts, 5xx); then, or at once on a 4xx (the server refused the request: retrying would not
help), the call fails with one line naming the URL. A reward is never made up: no zero, no default.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

Prompt = tuple[str, ...]
#: requests in flight at once for one call (one per prompt with the hpref shape)
MAX_PARALLEL_REQUESTS = 16


class RemoteConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        description="the endpoint to POST to: http://HOST:PORT/v1/score (an `hpref serve`) or an "
        "OpenRLHF reward server's /get_reward"
    )
    shape: Literal["hpref", "openrlhf"] = Field(
        "hpref", description="hpref = hpref serve's /v1/score; openrlhf = OpenRLHF's /get_reward"
    )
    token_file: str | None = Field(
        None, description="file holding the bearer token the server wants (hpref serve --token-file)"
    )
    timeout_s: float = Field(120.0, gt=0, description="seconds to wait for one request's answer")
    retries: int = Field(3, ge=0, description="further tries of a request the server did not answer")
    cross_policy: bool = Field(
        True,
        description="against a judge server: also judge each answer against the other policies' "
        "answers to the same prompt",
    )
    opponent_answers: int = Field(
        2, ge=1, description="answers of each other policy per prompt that an answer is judged against"
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s)://HOST:PORT/PATH address, got {url!r}")
        return url

    def export_problem(self) -> str | None:
        """Why the server cannot be the reward, or None: checked before any actor starts, like a
        judge's export (`check_reward_exports`); only that something listens at the address."""
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname, port), timeout=5).close()
        except OSError as exc:
            return (
                f"no reward server answers at {self.url} ({exc.strerror or exc}); start one "
                "(`hpref serve EXPORT`) or fix the address"
            )
        return None


class RemoteError(Exception):
    """A request the server refused (`status`, its one-line reason): not worth retrying."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class RemoteReward:
    """Scores groups of answers by asking a reward server (see the module docstring)."""

    def __init__(self, config: RemoteConfig) -> None:
        from hpref import arena as synthetic

        self.config = config
        self._synthetic = synthetic
        self.headers = {"Content-Type": "application/json"}
        if config.token_file:
            from hpref.errors import UserError

            try:
                token = Path(config.token_file).expanduser().read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise UserError(f"remote reward token_file {config.token_file}: {exc.strerror}") from None
            self.headers["Authorization"] = f"Bearer {token}"
        self.kind = "reward"
        if config.shape == "hpref":
            self.kind = self._call("GET", _sibling(config.url, "/info"), None)["kind"]
        #: a judge's scores within a group are win probabilities against each other
        self.pairwise = self.kind == "judge"
        self.wants_opponents = self.pairwise and config.cross_policy
        self.opponent_answers = config.opponent_answers

    def true_utility(self, prompt: Prompt, answer: str) -> float:
        return float(self._synthetic.answer_utility(prompt, answer))

    def score_groups(
        self,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None = None,
    ) -> list[list[float]]:
        from hpref.data.prompts import conversation_messages

        if self.config.shape == "openrlhf":
            return self._openrlhf(prompts, groups)
        bodies = [
            {
                "conversation": conversation_messages(tuple(prompt)),
                "answers": list(answers),
                **({"opponents": list(opponents[g])} if opponents and self.pairwise else {}),
            }
            for g, (prompt, answers) in enumerate(zip(prompts, groups, strict=True))
        ]
        with ThreadPoolExecutor(max_workers=max(1, min(len(bodies), MAX_PARALLEL_REQUESTS))) as pool:
            answers = list(pool.map(lambda body: self._call("POST", self.config.url, body), bodies))
        return [
            self._numbers(reply, "scores", len(group)) for reply, group in zip(answers, groups, strict=True)
        ]

    def judge_answers(
        self, prompts: Sequence[Prompt], pairs: Sequence[tuple[str, str]], *, swap: bool = True
    ) -> list[tuple[float, float, float]]:
        """(p_first, p_second, p_tie) of each pair from `hpref serve`'s `POST /v1/judge` (one request
        per pair, sent together; with `swap` the server judges both orders and averages them)."""
        from hpref.data.prompts import conversation_messages

        if self.config.shape != "hpref":
            raise self._error("judging pairs needs hpref serve's /v1/judge (shape = 'hpref')")
        url = _sibling(self.config.url, "/v1/judge")
        bodies = [
            {"conversation": conversation_messages(tuple(p)), "answer_a": a, "answer_b": b, "swap": swap}
            for p, (a, b) in zip(prompts, pairs, strict=True)
        ]
        with ThreadPoolExecutor(max_workers=max(1, min(len(bodies), MAX_PARALLEL_REQUESTS))) as pool:
            replies = list(pool.map(lambda body: self._call("POST", url, body), bodies))
        return [self._probabilities(reply) for reply in replies]

    def _probabilities(self, reply: Any) -> tuple[float, float, float]:
        keys = ("p_a", "p_b", "p_tie")
        values = [reply.get(k) for k in keys] if isinstance(reply, dict) else []
        if len(values) != 3 or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        ):
            raise self._error(f"answered without numbers in 'p_a', 'p_b', 'p_tie': {json.dumps(reply)[:200]}")
        return (float(values[0]), float(values[1]), float(values[2]))

    def _openrlhf(self, prompts: Sequence[Prompt], groups: Sequence[Sequence[str]]) -> list[list[float]]:
        from hpref.data.prompts import conversation_messages
        from hpref.data.transcripts import render_chatml

        queries, contexts = [], []
        for prompt, answers in zip(prompts, groups, strict=True):
            messages = conversation_messages(tuple(prompt))
            for answer in answers:
                queries.append(render_chatml([*messages, {"role": "assistant", "content": answer}]))
                contexts.append(render_chatml(messages, open_reply=True))
        body = {"query": queries, "prompts": contexts, "labels": [None] * len(queries)}
        rewards = iter(self._numbers(self._call("POST", self.config.url, body), "rewards", len(queries)))
        return [[next(rewards) for _ in answers] for answers in groups]

    # ------------------------------------------------------------------------------------ HTTP
    def _numbers(self, reply: Any, key: str, n: int) -> list[float]:
        values = reply.get(key) if isinstance(reply, dict) else None
        if (
            not isinstance(values, list)
            or len(values) != n
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        ):
            raise self._error(f"answered without {n} numbers in '{key}': {json.dumps(reply)[:200]}")
        return [float(v) for v in values]

    def _error(self, what: str) -> Exception:
        from hpref.errors import UserError

        return UserError(f"remote reward {self.config.url}: {what}")

    def _call(self, method: str, url: str, body: dict[str, Any] | None) -> Any:
        """The JSON answer, after up to `retries` more tries of what may pass (no answer, 5xx)."""
        tries = self.config.retries + 1
        reason = ""
        for attempt in range(tries):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 10.0))
            try:
                return self._request(method, url, body)
            except RemoteError as exc:
                if exc.status < 500:
                    raise self._error(f"{url} refused the request ({exc.status}): {exc}") from None
                reason = f"{exc.status}: {exc}"
            except (OSError, ValueError) as exc:  # refused, reset, timed out; not JSON
                reason = str(getattr(exc, "reason", None) or exc)
        raise self._error(
            f"no answer from {url} after {tries} tries ({reason}); is the server running (`hpref serve`)?"
        )

    def _request(self, method: str, url: str, body: dict[str, Any] | None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            with contextlib.suppress(ValueError, AttributeError):  # hpref serve's {"error": ...}
                text = json.loads(text).get("error", text)
            raise RemoteError(exc.code, " ".join(str(text).split())[:300]) from None


def _sibling(url: str, path: str) -> str:
    """`url` with its last path segment(s) replaced: /v1/score -> /info on the same server."""
    parts = urlsplit(url)
    base = parts.path.removesuffix("/v1/score").rstrip("/")
    return urlunsplit((parts.scheme, parts.netloc, base + path, "", ""))


def build_remote(config: RemoteConfig) -> RemoteReward:
    """A reward server over HTTP (`hpref serve`, or any OpenRLHF-shaped one)."""
    return RemoteReward(config)
