"""What the TRL and verl adapters score with: an export loaded in this process, or `hpref serve`.

`open_backend(source)` reads `source` once: an `http(s)://` address is a server (`RemoteReward`,
which reads its `/info` for the kind it holds), anything else an export folder (`ExportScorer`, moved
to `device`). Both answer the same two questions, in one batched pass or one set of parallel requests:

    judge_answers(prompts, pairs) -> (p_first, p_second, p_tie) of each pair (both orders averaged
                                     with `swap`)
    score_groups(prompts, groups, opponents) -> one score per answer: a reward model's scalar, a
                                     judge's mean win probability (+ half tie) against the other
                                     answers of its group and its opponents

and say their `kind` ("judge" or "reward"). The texts TRL and verl hand over (a prompt as a string or
a message list, a completion as a string or a one-message list) become hpref prompts here
(`prompt_of`, `completion_text`), with one line naming the item that does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpref.builtin.remote_reward import RemoteConfig, RemoteReward
from hpref.builtin.scoring import ExportScorer
from hpref.data.base import RowError
from hpref.data.prompts import prompt_of_messages
from hpref.data.tables import clean_text
from hpref.data.transcripts import parse_messages
from hpref.errors import UserError
from hpref.exports.layout import export_problem

Prompt = tuple[str, ...]
Probs = tuple[float, float, float]


class LocalBackend:
    """An export scored in this process (`ExportScorer`: packed forward passes on its device)."""

    def __init__(self, scorer: ExportScorer, *, swap: bool) -> None:
        self.scorer = scorer
        self.kind = scorer.kind
        self.swap = swap

    def judge_answers(self, prompts: Sequence[Prompt], pairs: Sequence[tuple[str, str]]) -> list[Probs]:
        jobs = [
            self.scorer.judge_job(p, a, b, swap=self.swap) for p, (a, b) in zip(prompts, pairs, strict=True)
        ]
        return self.scorer.run(jobs)

    def score_groups(
        self,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None = None,
    ) -> list[list[float]]:
        return self.scorer.score_groups(prompts, groups, opponents, symmetric=self.swap)


class ServedBackend:
    """`hpref serve` over HTTP (`RemoteReward`: retries, one line naming the URL when it fails)."""

    def __init__(self, remote: RemoteReward, *, swap: bool) -> None:
        self.remote = remote
        self.kind = remote.kind
        self.swap = swap

    def judge_answers(self, prompts: Sequence[Prompt], pairs: Sequence[tuple[str, str]]) -> list[Probs]:
        return self.remote.judge_answers(prompts, pairs, swap=self.swap)

    def score_groups(
        self,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None = None,
    ) -> list[list[float]]:
        return self.remote.score_groups(prompts, groups, opponents)


Backend = LocalBackend | ServedBackend


def is_url(source: str | Path) -> bool:
    return isinstance(source, str) and source.startswith(("http://", "https://"))


def resolve_device(device: Any) -> Any:
    """`"auto"`: the device accelerate gives this process (the one TRL's trainer uses: `cuda:LOCAL_RANK`
    under `accelerate launch`, else the GPU or the CPU); anything else as given."""
    if device != "auto":
        return device
    try:
        from accelerate import PartialState
    except ImportError:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return PartialState().device


def open_backend(
    source: str | Path,
    *,
    device: Any = "cpu",
    swap: bool = True,
    token_file: str | None = None,
    micro_batch_tokens: int = 16384,
    precision: str = "fp32",
    timeout_s: float = 120.0,
    retries: int = 3,
    who: str = "hpref",
) -> Backend:
    """The backend of `source` (see the module docstring); a folder that is not a preference-model
    export (a policy, a stray path) is one line naming `who` and the folder, before anything loads."""
    if is_url(source):
        url = str(source).rstrip("/")
        url = url if url.endswith("/v1/score") else url.removesuffix("/v1/judge") + "/v1/score"
        remote = RemoteReward(
            RemoteConfig(url=url, token_file=token_file, timeout_s=timeout_s, retries=retries)
        )
        return ServedBackend(remote, swap=swap)
    problem = export_problem(source)
    if problem:
        raise UserError(f"{who}: {problem}")
    scorer = ExportScorer.load(source, micro_batch_tokens=micro_batch_tokens, precision=precision)
    return LocalBackend(scorer.to(resolve_device(device)), swap=swap)


# --------------------------------------------------------------------------------------------------
# texts as TRL and verl hand them over


def prompt_of(value: Any, where: str) -> Prompt:
    """A TRL / verl prompt (a string, or chat messages ending with the user turn; an empty assistant
    turn a template opened is dropped) as an hpref prompt; a `ValueError` naming `where` otherwise."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: empty prompt")
        return (clean_text(value),)
    try:
        messages = parse_messages(list(value) if isinstance(value, tuple) else value, where)
    except RowError as exc:
        raise ValueError(f"{where}: {exc.reason}") from None
    while messages and messages[-1][0] == "assistant" and not messages[-1][1].strip():
        messages.pop()
    prompt = prompt_of_messages(messages)
    if not prompt or (messages and messages[-1][0] == "assistant"):
        raise ValueError(
            f"{where}: expected a string or chat messages ending with the user turn being answered"
        )
    return prompt


def completion_text(value: Any, where: str) -> str:
    """A completion: a string, or TRL's conversational `[{"role": "assistant", "content": ...}]`."""
    if isinstance(value, str):
        return clean_text(value)
    try:
        messages = parse_messages(value, where)
    except RowError as exc:
        raise ValueError(f"{where}: {exc.reason}") from None
    if not messages or messages[-1][0] != "assistant":
        raise ValueError(f"{where}: expected a string or messages ending with the assistant's answer")
    return messages[-1][1]
