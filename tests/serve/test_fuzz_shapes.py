"""Bad requests at scale for `hpref serve`, at the level of `hpref.serve.shapes` (in-process, no Ray):
the bytes a client may send to /v1/judge, /v1/score, /get_reward and /remote_rm go through
`decode_json` and the endpoint's `parse_*` exactly as the replica does, against a reward model and a
judge stand-in (the real `ExportScorer` job builders, no model weights: scoring is not under test).

Three families: arbitrary JSON values as the body; each endpoint's well-formed body with one key
replaced by an arbitrary JSON value, dropped, joined by an unknown key, or blown past the limits
(long lists, long strings, many answers); and bytes that are not a JSON object (not UTF-8,
truncated, UTF-16, nested 5000 deep, 5000-digit numbers, random bytes). Every request must end in
`BadRequest` with a 4xx status and a one-line message, or in a job within the limits whose response
serialises as the replica's JSONResponse does — never another exception or a hang.
Examples are derandomized: the suite tries the same requests on every run.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpref.builtin.scoring import ExportScorer
from hpref.data.records import Battle
from hpref.data.transcripts import render_chatml
from hpref.serve import shapes
from hpref.serve.shapes import BadRequest, Limits
from tests.fuzzing import time_bound

FUZZ = settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
#: an example that takes longer than this is a hang (the deadline only fires after it returns)
HANG_SECONDS = 30
#: small limits, so that going past each of them costs kilobytes, not megabytes
LIMITS = Limits(max_request_bytes=64 * 1024, max_items=8, max_battles=40)


class StandIn(ExportScorer):
    """The job builders of an `ExportScorer` (`judge_job`, `score_job`) without a model."""

    def __init__(self, paired: bool) -> None:
        self.paired = paired
        self.kind = "reward" if paired else "judge"


SCORERS = {"reward": StandIn(paired=True), "judge": StandIn(paired=False)}
PARSERS = {
    "judge": shapes.parse_judge,
    "score": shapes.parse_score,
    "get_reward": shapes.parse_get_reward,
    "remote_rm": shapes.parse_remote_rm,
}

# -- requests --------------------------------------------------------------------------------------

text = st.text(max_size=10) | st.sampled_from(["\udcff", "\ud800 x", "caf\xe9", "\x00", "<|im_end|>", "a\nb"])
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
#: values that break a parser or a limit: past max_request_bytes, past max_items, deep, long numbers
NASTY = st.sampled_from(
    [
        "x" * (LIMITS.max_request_bytes + 1),
        "y" * (LIMITS.max_request_bytes // 2),
        ["a"] * (LIMITS.max_items + 1),
        ["a", "b"] * (LIMITS.max_items // 2),
        [{"role": "user", "content": "q"}] * (LIMITS.max_items * 4),
        [[[[[["deep"]]]]]],
        "",
        " ",
        [],
        {},
        None,
        math.nan,
        10**40,
    ]
)
words = st.sampled_from(["What is 2+2?", "4", "Four.", "caf\xe9 \u2713"]) | text
role = st.sampled_from(["user", "assistant", "system", "human", "gpt", "model", "wizard"])
#: any list of messages: wrong roles, an assistant last, no user turn
message_list = st.lists(st.fixed_dictionaries({"role": role, "content": words | st.none()}), max_size=4)


@st.composite
def chat(draw, *, answered: bool = False):
    """Messages a client means: (a system message,) user, assistant, ..., user (, the answer)."""
    turns = draw(st.integers(1, 3)) * 2 - 1 + answered
    system = [{"role": "system", "content": draw(words)}] if draw(st.booleans()) else []
    return system + [{"role": ("user", "assistant")[i % 2], "content": draw(words)} for i in range(turns)]


conversation = words | chat() | message_list


@st.composite
def query(draw):
    """(query, prompt): a policy's decoded text as OpenRLHF sends it, a ChatML conversation and its
    answer, or a prompt and what follows it."""
    if draw(st.booleans()):
        messages = draw(chat(answered=True) | message_list)
        end = draw(st.sampled_from(["", "<|im_end|>", "<|endoftext|>"]))
        return render_chatml(messages) + end, render_chatml(messages[:-1], open_reply=True)
    prompt = draw(words)
    return prompt + draw(words), prompt


def template(kind: str):
    """A well-formed body of endpoint `kind` (its fields may still carry bad values)."""
    if kind == "judge":
        return st.fixed_dictionaries(
            {"conversation": conversation, "answer_a": words, "answer_b": words},
            optional={"swap": st.booleans()},
        )
    if kind == "score":
        return st.fixed_dictionaries(
            {"conversation": conversation, "answers": st.lists(words, min_size=1, max_size=4)},
            optional={"opponents": st.lists(words, max_size=3), "reference": words | st.none()},
        )
    if kind == "get_reward":
        return st.lists(query(), min_size=1, max_size=4).flatmap(
            lambda pairs: st.fixed_dictionaries(
                {"query": st.just([q for q, _ in pairs]), "prompts": st.just([p for _, p in pairs])},
                optional={"labels": st.lists(words | json_value, min_size=len(pairs), max_size=len(pairs))},
            )
        )
    return st.fixed_dictionaries(
        {"prompt": conversation | query().map(lambda pair: pair[1]), "response": words},
        optional={"label": words | json_value},
    )


def places(value, path=()):
    """Every (path, value) inside a JSON tree, the root included."""
    yield path, value
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from places(inner, (*path, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield from places(inner, (*path, index))


def replaced(tree, path, new):
    """`tree` with the value at `path` replaced by `new` (`DROP`: removed)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        out = dict(tree)
        if new is DROP and not rest:
            del out[head]
        else:
            out[head] = replaced(tree[head], rest, new)
        return out
    out = list(tree)
    if new is DROP and not rest:
        del out[head]
    else:
        out[head] = replaced(tree[head], rest, new)
    return out


DROP = object()


@st.composite
def mutated_body(draw, kind: str):
    """The endpoint's body with one place changed: a wrong type, a value past a limit, a key
    dropped, an unknown key added."""
    body = draw(template(kind))
    path, _ = draw(st.sampled_from(list(places(body))[1:]))
    change = draw(st.sampled_from(["value", "value", "nasty", "drop", "unknown", "none", "none", "none"]))
    if change == "value":
        body = replaced(body, path, draw(json_value))
    elif change == "nasty":
        body = replaced(body, path, draw(NASTY))
    elif change == "drop":
        body = replaced(body, path, DROP)
    elif change == "unknown":
        body = {**body, draw(st.sampled_from(["temperature", "Answers", "\udcffkey", ""])): draw(json_value)}
    return json.dumps(body).encode()


@st.composite
def damaged_bytes(draw, kind: str):
    """Bytes that are not a readable JSON object: cut, with an invalid UTF-8 byte, in UTF-16, deep,
    with a number of 5000 digits, or random."""
    text = json.dumps(draw(template(kind)), ensure_ascii=False)
    body = text.encode("utf-8", "surrogatepass")  # a lone surrogate: bytes that are not UTF-8
    at = draw(st.integers(0, len(body)))
    return draw(
        st.sampled_from(
            [
                body[:at],
                body[:at] + b"\xff" + body[at:],
                body[:at] + b"\xed\xa0\x80" + body[at:],
                text.encode("utf-16", "surrogatepass"),
                b"\xef\xbb\xbf" + body,
                b"[" * 5000 + b"]" * 5000,
                b'{"query": ' + b"[" * 5000,
                b'{"answers": [' + b"9" * 5000 + b"]}",
                b'{"conversation": "' + b"z" * LIMITS.max_request_bytes + b'"}',
                body + b"\n{}",
            ]
        )
        | st.binary(max_size=64)
    )


# -- what every outcome must be --------------------------------------------------------------------


def as_response(content) -> bytes:
    """What Starlette's JSONResponse does to a body: strict JSON (no NaN), encoded as UTF-8."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def serve(kind: str, scorer: str, body: bytes) -> None:
    """One request as the replica handles it; asserts the outcome is a 4xx line or a bounded job."""
    with time_bound(HANG_SECONDS, "a request"):
        try:
            payload = shapes.decode_json(body, LIMITS)
            job, respond = PARSERS[kind](payload, SCORERS[scorer], LIMITS)
        except BadRequest as exc:
            assert 400 <= exc.status < 500, exc.status
            assert exc.message and "\n" not in exc.message and "\r" not in exc.message, repr(exc.message)
            as_response({"error": exc.message})  # the error response itself must encode
            return
        assert 1 <= len(job.battles) <= LIMITS.max_battles, len(job.battles)
        for battle in job.battles:
            assert isinstance(battle, Battle)
            for part in (battle.prompt, battle.response_a, battle.response_b):
                assert part and all(isinstance(t, str) for t in part)
                as_response(list(part))  # valid Unicode: a tokenizer can read it
        logits = [[0.3, -0.2, 0.1 * i] for i in range(len(job.battles))]
        as_response(respond(job.finish(logits)))


endpoint = st.sampled_from(list(PARSERS))
scorer_kind = st.sampled_from(list(SCORERS))


#: every key some endpoint reads, so that arbitrary objects also hit the known keys with wrong types
KEYS = ["conversation", "answer_a", "answer_b", "swap", "answers", "opponents", "reference", "query"]
KEYS += ["prompts", "labels", "prompt", "response", "label"]
objects = st.dictionaries(st.sampled_from(KEYS) | text, json_value | NASTY, max_size=5)


@FUZZ
@given(kind=endpoint, scorer=scorer_kind, value=json_value | NASTY | objects)
def test_any_json_value_as_a_body_is_a_4xx_or_a_job(kind, scorer, value):
    """Wrong if some JSON value (an array, a number, an object of wrong keys, NaN, a 40-digit
    number) made `decode_json` or a `parse_*` raise anything but `BadRequest`: in the replica that
    is a 500 and a traceback in its log for what is the client's mistake."""
    serve(kind, scorer, json.dumps(value).encode())


@FUZZ
@given(draw=st.data(), kind=endpoint, scorer=scorer_kind)
def test_a_body_with_one_bad_field_is_a_4xx_naming_it_or_a_job(draw, kind, scorer):
    """Wrong if a wrong type at any key (a number for a message, a dict for a label, null in a
    list), a dropped or unknown key, a list past max_items or a string past max_request_bytes
    escaped as another exception, got a message of several lines or undecodable text, or built a
    job over max_battles (unbounded work for one request)."""
    serve(kind, scorer, draw.draw(mutated_body(kind), label="body"))


@FUZZ
@given(draw=st.data(), kind=endpoint, scorer=scorer_kind)
def test_bytes_that_are_not_a_json_object_are_a_4xx(draw, kind, scorer):
    """Wrong if a truncated body, a byte that is not UTF-8, a UTF-16 body, nesting 5000 deep (past
    Python's recursion limit) or a number of 5000 digits (past int()'s digit limit: a raw
    ValueError before) escaped `decode_json` as anything but a one-line 4xx."""
    serve(kind, scorer, draw.draw(damaged_bytes(kind), label="bytes"))


# -- what the fuzz found, kept explicit ------------------------------------------------------------


def test_the_requests_the_fuzz_found_are_one_line_4xx():
    """Wrong if a number of 5000 digits escaped `decode_json` as a raw ValueError again (a 500 and a
    traceback in the replica's log), or if a key that is "" or not valid Unicode were blamed on the
    whole "body" instead of named."""
    cases = [
        (
            b'{"answers": [' + b"9" * 5000 + b"]}",
            shapes.parse_score,
            400,
            "a number of more than 4300 digits",
        ),
        (
            b'{"conversation": "q", "answer_a": "a", "answer_b": "b", "": 1}',
            shapes.parse_judge,
            422,
            '"": Extra',
        ),
        (
            b'{"conversation": "q", "answer_a": "a", "answer_b": "b", "\\udcffk": 1}',
            shapes.parse_judge,
            422,
            "the key '\\udcffk' is not valid Unicode",
        ),
    ]
    for body, parse, status, says in cases:
        try:
            parse(shapes.decode_json(body, LIMITS), SCORERS["judge"], LIMITS)
        except BadRequest as exc:
            assert (exc.status, exc.message.startswith(says)) == (status, True), exc.message
        else:
            raise AssertionError(f"{body[:60]!r} was accepted")
