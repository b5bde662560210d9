"""The request and response shapes `hpref serve` answers, and the checks every request passes.

Pure functions over bytes and dicts (no Ray, FastAPI or torch), so every refusal is tested directly:
`decode_json` turns a body into a JSON object or a `BadRequest` (one line, a 4xx status); each
`parse_*` turns that object into a `ScoringJob` of the export's `ExportScorer` and a function that
turns the job's result into the response body.

hpref's own
    POST /v1/judge   {"conversation", "answer_a", "answer_b", "swap": false}
                     -> {"p_a", "p_b", "p_tie", "swap_averaged", "kind"}
    POST /v1/score   {"conversation", "answers": [...], "opponents": [], "reference": null}
                     -> {"scores": [...], "kind"}
    A conversation is one user message (a string) or chat messages ([{"role", "content"}], system
    text joining the first user turn) ending with the user turn the answers reply to.

OpenRLHF's remote reward model (`--reward.remote_url`; its client `openrlhf/utils/agent.py`, read at
OpenRLHF 3c3be62 (2026-08-13, after v0.11.0), and `remote_rm_utils.py` of v0.8 / v0.9)
    POST /get_reward {"query": [prompt + response, ...], "prompts": [...], "labels": [...]}
                     -> {"rewards": [...], "scores": [...], "extra_logs": {}}
    `query` is the policy's decoded text (its chat template included): the response is the last
    assistant message of a ChatML / Llama 3 / Gemma / HH-RLHF transcript, else what follows
    `prompts[i]`.

miles / slime `--rm-type remote_rm` (`rollout/rm_hub/__init__.py`, read at radixark/miles 31f1ca9
and THUDM/slime 624b824, both 2026-08-21)
    POST /remote_rm  {"prompt": str or messages, "response": str, "label": ...} -> a bare number
    (the client stores the JSON body as the sample's reward; leave `--reward-key` unset).

A judge export scores a single response (the last two shapes) against a reference answer: the
label, which must then be a string; a reward model ignores labels. Foreign shapes ignore fields
they do not know (clients add some); hpref's own refuse them (a typo is a 422, not a default).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hpref.data.base import RowError
from hpref.data.prompts import prompt_of_messages
from hpref.data.tables import clean_text
from hpref.data.transcripts import parse_chat_text, parse_messages, strip_end_markers

if TYPE_CHECKING:
    from hpref.builtin.scoring import ExportScorer, ScoringJob

Prompt = tuple[str, ...]
#: in a replica, Ray Serve writes this logger to the replica's log file
logger = logging.getLogger("ray.serve")


class BadRequest(Exception):
    """A request that cannot be scored: `status` (4xx) and a one-line `message` saying why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = " ".join(message.split())


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: bytes of body, items in any list, battles it costs."""

    max_request_bytes: int = 8 * 1024 * 1024
    max_items: int = 256
    max_battles: int = 1024


def decode_json(body: bytes, limits: Limits) -> dict[str, Any]:
    """The request's JSON object, or a `BadRequest` naming what is wrong with the bytes."""
    if len(body) > limits.max_request_bytes:
        raise BadRequest(413, f"request body over {limits.max_request_bytes} bytes")
    if not body.strip():
        raise BadRequest(400, "empty request body: expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(400, f"request body is not UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(400, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise BadRequest(400, "malformed JSON: nested too deeply") from None
    except ValueError:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        digits = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise BadRequest(400, f"a number of more than {digits} digits in the JSON") from None
    if not isinstance(value, dict):
        raise BadRequest(422, f"expected a JSON object, got {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


# --------------------------------------------------------------------------------------------------
# bodies


class _Body(BaseModel):
    # strict: "1" is not a number and 1 is not a string; JSON gives every type exactly
    model_config = ConfigDict(strict=True, extra="forbid")


class _ForeignBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Message(_ForeignBody):
    role: str
    content: str | None = None


class JudgeBody(_Body):
    conversation: str | list[Message]
    answer_a: str
    answer_b: str
    swap: bool = False


class ScoreBody(_Body):
    conversation: str | list[Message]
    answers: list[str] = Field(min_length=1)
    opponents: list[str] = Field(default_factory=list)
    reference: str | None = None


class GetRewardBody(_ForeignBody):
    query: list[str] = Field(min_length=1)
    prompts: list[str | None] | None = None
    labels: list[Any] | None = None


class RemoteRMBody(_ForeignBody):
    prompt: str | list[Message]
    response: str
    label: Any = None


#: what a field that takes one of several shapes expects, said once instead of once per shape
EXPECTED = {
    "conversation": "a string or a list of {role, content} messages",
    "prompt": "a string or a list of {role, content} messages",
}


def _validate(model: type[BaseModel], payload: dict[str, Any]) -> Any:
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise BadRequest(422, _one_line(exc.errors())) from None


def _one_line(errors: list[Any]) -> str:
    """The first bad field of a validation error, as `field.index: what is wrong`. A field with
    several accepted shapes reports what it expects, or the inner error of the shape it is closest
    to (a list for a message list), not one complaint per shape."""
    first = errors[0]
    if not first["loc"] and first["type"] == "string_unicode":  # a key pydantic cannot read as text
        return f"the key {first['input']!r} is not valid Unicode (a lone surrogate)"
    field = first["loc"][0] if first["loc"] else "body"
    mine = [e for e in errors if e["loc"][:1] == (field,)]
    if field in EXPECTED and len(first["loc"]) > 1:
        deep = [e for e in mine if len(e["loc"]) > 2]
        if not deep:
            return f"{field}: expected {EXPECTED[field]}"
        first = deep[0]
        loc = (field, *first["loc"][2:])  # without the name of the shape pydantic tried
    else:
        loc = first["loc"]
    more = len(errors) - len(mine)
    where = ".".join(str(part) if part != "" else '""' for part in loc) or "body"  # the key "" too
    return f"{where}: {first['msg']}" + (f" (and {more} more)" if more > 0 else "")


# --------------------------------------------------------------------------------------------------
# conversations


def conversation_prompt(value: str | list[Message], field: str, *, templated: bool = False) -> Prompt:
    """A request's conversation as a prompt (user, assistant, ..., user). A string is one user
    message, or with `templated` (clients that send a policy's rendered prompt) a chat-templated
    conversation when it is one; an empty assistant turn the template opened at the end is dropped."""
    if isinstance(value, str):
        messages = (parse_chat_text(value) if templated else None) or [("user", clean_text(value))]
    else:
        try:
            messages = parse_messages([m.model_dump() for m in value], field)
        except RowError as exc:
            raise BadRequest(422, f"{field}: {exc.reason}") from None
    while messages and messages[-1][0] == "assistant" and not messages[-1][1].strip():
        messages = messages[:-1]
    if messages and messages[-1][0] == "assistant":
        raise BadRequest(
            422, f"{field}: ends with an assistant message; it must end with the user turn being answered"
        )
    prompt = prompt_of_messages(messages)
    if not prompt:
        raise BadRequest(422, f"{field}: no user message to answer")
    return prompt


def split_query(query: str, prompt: str | None, index: int) -> tuple[Prompt, str]:
    """OpenRLHF's `query` (prompt and response as one decoded text) -> (conversation, response)."""
    messages = parse_chat_text(query)
    if messages and len(messages) > 1 and messages[-1][0] == "assistant":
        conversation = prompt_of_messages(messages[:-1])
        if conversation:
            return conversation, messages[-1][1]
    if prompt is not None and prompt.strip() and query.startswith(prompt):
        response = strip_end_markers(query[len(prompt) :]).strip()
        return conversation_prompt(prompt, f"prompts.{index}", templated=True), clean_text(response)
    raise BadRequest(
        422,
        f"query.{index}: cannot tell the response from the prompt: not a chat transcript (ChatML, "
        f"Llama 3, Gemma, HH-RLHF) ending with the assistant's answer, and it does not start with "
        f"prompts.{index}",
    )


# --------------------------------------------------------------------------------------------------
# requests -> jobs


Respond = Callable[[Any], Any]


def _check_items(field: str, items: list[Any], limits: Limits) -> None:
    if len(items) > limits.max_items:
        raise BadRequest(422, f"{field}: {len(items)} items, more than the {limits.max_items} allowed")


def _check_job(job: ScoringJob, limits: Limits) -> ScoringJob:
    if len(job.battles) > limits.max_battles:
        raise BadRequest(
            422,
            f"the request needs {len(job.battles)} comparisons, more than the {limits.max_battles} "
            "allowed (a judge compares every pair of answers: send fewer per request)",
        )
    return job


def parse_judge(payload: dict[str, Any], scorer: ExportScorer, limits: Limits) -> tuple[ScoringJob, Respond]:
    body = _validate(JudgeBody, payload)
    prompt = conversation_prompt(body.conversation, "conversation")
    job = scorer.judge_job(prompt, clean_text(body.answer_a), clean_text(body.answer_b), swap=body.swap)
    swapped = len(job.battles) > 1

    def respond(probs: tuple[float, float, float]) -> dict[str, Any]:
        p_a, p_b, p_tie = probs
        return {"p_a": p_a, "p_b": p_b, "p_tie": p_tie, "swap_averaged": swapped, "kind": scorer.kind}

    return _check_job(job, limits), respond


def parse_score(payload: dict[str, Any], scorer: ExportScorer, limits: Limits) -> tuple[ScoringJob, Respond]:
    body = _validate(ScoreBody, payload)
    prompt = conversation_prompt(body.conversation, "conversation")
    answers = [clean_text(a) for a in body.answers]
    others = [clean_text(a) for a in body.opponents]
    if body.reference is not None:
        others.append(clean_text(body.reference))
    _check_items("answers", answers + others, limits)
    if scorer.kind == "judge" and len(answers) + len(others) < 2:
        raise BadRequest(
            422, "a judge export compares answers: send two or more answers, opponents, or a reference"
        )
    job = scorer.score_job([prompt], [answers], [others] if scorer.kind == "judge" else None)

    def respond(scores: list[list[float]]) -> dict[str, Any]:
        return {"scores": scores[0], "kind": scorer.kind}

    return _check_job(job, limits), respond


def _reference(label: Any, field: str) -> str:
    """A judge's reference answer: the item's label, which must be text."""
    if not isinstance(label, str) or not label.strip():
        raise BadRequest(
            422,
            f"{field}: a judge export scores one response against a reference answer: send it as the "
            "label (a non-empty string)",
        )
    return clean_text(label)


def _pointwise_job(
    prompts: list[Prompt], responses: list[str], references: list[str] | None, scorer: ExportScorer
):
    groups = [[r] for r in responses]
    return scorer.score_job(prompts, groups, [[r] for r in references] if references is not None else None)


def parse_get_reward(
    payload: dict[str, Any], scorer: ExportScorer, limits: Limits
) -> tuple[ScoringJob, Respond]:
    body = _validate(GetRewardBody, payload)
    n = len(body.query)
    _check_items("query", body.query, limits)
    for field, values in (("prompts", body.prompts), ("labels", body.labels)):
        if values is not None and len(values) != n:
            raise BadRequest(422, f"{field}: {len(values)} items for {n} queries")
    pairs = [
        split_query(q, body.prompts[i] if body.prompts is not None else None, i)
        for i, q in enumerate(body.query)
    ]
    references = None
    if scorer.kind == "judge":
        labels = body.labels or [None] * n
        references = [_reference(label, f"labels.{i}") for i, label in enumerate(labels)]
    job = _pointwise_job([p for p, _ in pairs], [r for _, r in pairs], references, scorer)

    def respond(scores: list[list[float]]) -> dict[str, Any]:
        rewards = [group[0] for group in scores]
        return {"rewards": rewards, "scores": rewards, "extra_logs": {}}

    return _check_job(job, limits), respond


def parse_remote_rm(
    payload: dict[str, Any], scorer: ExportScorer, limits: Limits
) -> tuple[ScoringJob, Respond]:
    body = _validate(RemoteRMBody, payload)
    prompt = conversation_prompt(body.prompt, "prompt", templated=True)
    response = clean_text(strip_end_markers(body.response).strip())
    references = [_reference(body.label, "label")] if scorer.kind == "judge" else None
    job = _pointwise_job([prompt], [response], references, scorer)
    return _check_job(job, limits), lambda scores: scores[0][0]


# --------------------------------------------------------------------------------------------------
# scoring a batch


@dataclass
class Failed:
    """A job of a batch that could not be scored: its request gets `status` and this line."""

    status: int
    message: str


def score_jobs(scorer: ExportScorer, jobs: list[ScoringJob]) -> list[Any]:
    """Each job's result, all in one packed pass; when that fails, each job alone, so a request
    whose text cannot be scored fails with its own `Failed` and never takes its neighbours along."""
    try:
        return scorer.run(jobs)
    except Exception as exc:
        if len(jobs) == 1:
            return [_failure(exc)]
    return [score_jobs(scorer, [job])[0] for job in jobs]


def _failure(exc: Exception) -> Failed:
    from hpref.errors import UserError

    if isinstance(exc, UserError):  # the formatter refused this request's text (DataError and friends)
        return Failed(422, " ".join(str(exc).split()))
    logger.exception("scoring failed")
    return Failed(500, f"internal error: {type(exc).__name__}")
