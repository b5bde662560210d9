"""`hpref serve`'s request shapes without a server: bytes and JSON refused with one line and the right
status, conversations and chat-templated queries split into (conversation, answer), and each shape's
job scored by a real export giving the numbers the in-process scorer gives."""

from __future__ import annotations

import json

import pytest

from hpref.data.prompts import battle_with_answers
from hpref.data.transcripts import parse_chat_text, render_chatml, strip_end_markers
from hpref.serve import shapes
from hpref.serve.shapes import BadRequest, Limits

from .conftest import PROMPT


def refusal(call, *args) -> tuple[int, str]:
    with pytest.raises(BadRequest) as err:
        call(*args)
    assert "\n" not in err.value.message
    return err.value.status, err.value.message


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"", 400, "empty request body"),
        (b"   ", 400, "empty request body"),
        (b'{"conversation": ', 400, "malformed JSON: Expecting value at line 1 column 18"),
        (b'{"a": "\xff"}', 400, "request body is not UTF-8 (byte 7)"),
        (b"[1, 2]", 422, "expected a JSON object, got an array"),
        (b'"text"', 422, "expected a JSON object, got a string"),
        (b"[" * 100_000, 400, "malformed JSON"),
        (b'{"a": "' + b"x" * 300_000 + b'"}', 413, "request body over 200000 bytes"),
    ],
)
def test_bytes_that_are_not_a_json_object_are_refused(body, status, says):
    """Wrong if a body the server cannot read reached the model (or crashed the replica: a deep
    nesting blows Python's recursion limit inside json.loads) instead of one line and a 4xx."""
    got, message = refusal(shapes.decode_json, body, Limits(max_request_bytes=200_000))
    assert got == status and message.startswith(says), message


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ({}, "conversation: Field required (and 2 more)"),
        ({"conversation": 1, "answer_a": "a", "answer_b": "b"}, "conversation: expected a string or a list"),
        ({"conversation": [{"role": "user"}], "answer_a": 1, "answer_b": "b"}, "answer_a: Input should be"),
        (
            {"conversation": [{"role": 3, "content": "x"}], "answer_a": "a", "answer_b": "b"},
            "conversation.0.role",
        ),
        (
            {"conversation": [{"role": "wizard", "content": "x"}], "answer_a": "a", "answer_b": "b"},
            "conversation: message 0 has unknown role 'wizard'",
        ),
        (
            {"conversation": "q", "answer_a": "a", "answer_b": "b", "swap": "yes"},
            "swap: Input should be a valid",
        ),
        (
            {"conversation": "q", "answer_a": "a", "answer_b": "b", "temperature": 1},
            "temperature: Extra inputs",
        ),
        ({"conversation": [], "answer_a": "a", "answer_b": "b"}, "conversation: no user message to answer"),
        (
            {
                "conversation": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
                "answer_a": "a",
                "answer_b": "b",
            },
            "conversation: ends with an assistant message",
        ),
    ],
)
def test_judge_bodies_with_wrong_fields_name_the_field(payload, says):
    """Wrong if a missing field, a wrong type (no coercion: "yes" is not true), an unknown key or a
    conversation with nothing to answer were scored with a default instead of a 422 naming it."""
    status, message = refusal(shapes.parse_judge, payload, None, Limits())
    assert status == 422 and message.startswith(says), message


@pytest.fixture(scope="module")
def scorers(exports):
    from hpref.builtin.scoring import ExportScorer

    return {kind: ExportScorer.load(folder) for kind, folder in exports.items()}


def test_too_many_items_or_comparisons_are_refused(scorers):
    """Wrong if one request could ask for unbounded work: a list longer than max_items, or a judge
    asked to compare so many answers that the pairs exceed max_battles."""
    limits = Limits(max_items=4, max_battles=10)
    status, message = refusal(shapes.parse_get_reward, {"query": ["q"] * 5}, scorers["reward"], limits)
    assert (status, message) == (422, "query: 5 items, more than the 4 allowed")
    body = {"conversation": "q", "answers": ["a", "b", "c", "d"]}
    status, message = refusal(shapes.parse_score, body, scorers["judge"], limits)
    assert status == 422 and message.startswith("the request needs 12 comparisons, more than the 10")
    # the same four answers cost a reward model four sequences: accepted
    job, _ = shapes.parse_score(body, scorers["reward"], limits)
    assert len(job.battles) == 4


def test_chat_templates_split_into_conversation_and_answer():
    """Wrong if the response OpenRLHF decodes (ChatML, Llama 3, Gemma, HH) were not told from its
    prompt, if a system message were lost, or if end-of-turn tokens stayed in the scored answer."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chatml = render_chatml([*messages, {"role": "assistant", "content": "hello"}]) + "<|endoftext|>"
    assert shapes.split_query(chatml, None, 0) == (("Be brief.\n\nhi",), "hello")
    llama = (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nThat.<|eot_id|>"
    )
    assert shapes.split_query(llama, None, 0) == (("What?",), "That.")
    gemma = "<bos><start_of_turn>user\nQ1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
    gemma += "<start_of_turn>user\nQ2<end_of_turn>\n<start_of_turn>model\nA2<end_of_turn>"
    assert shapes.split_query(gemma, None, 0) == (("Q1", "A1", "Q2"), "A2")
    assert parse_chat_text("\n\nHuman: hi\n\nAssistant: yo") == [("user", "hi"), ("assistant", "yo")]
    # no template: what follows the prompt is the response
    assert shapes.split_query("Question: 2+2? Answer: 4</s>", "Question: 2+2? Answer:", 3) == (
        ("Question: 2+2? Answer:",),
        "4",
    )
    status, message = refusal(shapes.split_query, "plain text", "other", 3)
    assert status == 422 and message.startswith("query.3: cannot tell the response from the prompt")
    assert strip_end_markers("done<|im_end|>\n<|endoftext|> ") == "done"


def test_judge_swap_average_is_both_orders_mapped_back(scorers):
    """Wrong if the swapped view were averaged unmapped (its p_a is the original B's), or if a reward
    model paid for a swap that cannot change its answer."""
    judge = scorers["judge"]
    body = {
        "conversation": [{"role": "user", "content": PROMPT[0]}],
        "answer_a": "42",
        "answer_b": "I cannot help.",
    }
    forward, backward = judge.judge_pairs(
        [
            battle_with_answers(PROMPT, "42", "I cannot help."),
            battle_with_answers(PROMPT, "I cannot help.", "42"),
        ]
    )
    job, respond = shapes.parse_judge({**body, "swap": True}, judge, Limits())
    answer = respond(judge.run([job])[0])
    want = [(forward[0] + backward[1]) / 2, (forward[1] + backward[0]) / 2, (forward[2] + backward[2]) / 2]
    assert [answer["p_a"], answer["p_b"], answer["p_tie"]] == pytest.approx(want, abs=1e-6)
    assert answer["swap_averaged"] and answer["kind"] == "judge"
    assert abs(forward[0] - backward[1]) > 1e-4  # this judge has a position bias the swap cancels
    job, respond = shapes.parse_judge({**body, "swap": True}, scorers["reward"], Limits())
    assert len(job.battles) == 1 and respond(scorers["reward"].run([job])[0])["swap_averaged"] is False


def test_pointwise_shapes_score_like_the_scorer(scorers):
    """A reward model's /get_reward and /remote_rm rewards are its score of the response alone; a
    judge's are the response's win probability (+ half tie) against the label as a reference,
    judged in both orders. Wrong if a label changed a reward model's score, or if a judge scored a
    response with nothing to compare it to instead of refusing."""
    reward, judge = scorers["reward"], scorers["judge"]
    query = render_chatml([{"role": "user", "content": PROMPT[0]}, {"role": "assistant", "content": "42"}])
    [[alone]] = reward.score_groups([PROMPT], [["42"]])
    for payload, parse in (
        ({"query": [query], "prompts": [None], "labels": ["the label"]}, shapes.parse_get_reward),
        ({"prompt": PROMPT[0], "response": "42<|im_end|>", "label": 7}, shapes.parse_remote_rm),
    ):
        job, respond = parse(payload, reward, Limits())
        out = respond(reward.run([job])[0])
        got = out if isinstance(out, float) else out["rewards"][0]
        assert got == pytest.approx(alone, abs=1e-5)
    assert json.loads(json.dumps(out)) == out  # a bare number for miles / slime
    [[versus]] = judge.score_groups([PROMPT], [["42"]], [["41"]])
    job, respond = shapes.parse_remote_rm(
        {"prompt": PROMPT[0], "response": "42", "label": "41"}, judge, Limits()
    )
    assert respond(judge.run([job])[0]) == pytest.approx(versus, abs=1e-6)
    status, message = refusal(shapes.parse_get_reward, {"query": [query]}, judge, Limits())
    assert status == 422 and message.startswith(
        "labels.0: a judge export scores one response against a reference"
    )


def test_a_job_that_cannot_be_scored_fails_alone(scorers):
    """Jobs of one batch: a job whose battle the formatter refuses gets a 422 naming it, one that
    breaks while answering gets a 500, and the good job between them still gets its score. Wrong if
    one bad request failed every request that shared its batch."""
    from hpref.builtin.scoring import ScoringJob
    from hpref.data.records import Battle

    reward = scorers["reward"]
    good = reward.score_job([PROMPT], [["42"]])
    refused = ScoringJob([Battle("empty", (), (), ())], lambda rows: rows)
    broken = ScoringJob([battle_with_answers(PROMPT, "a", "b")], lambda rows: 1 / 0)
    first, second, third = shapes.score_jobs(reward, [refused, good, broken])
    assert isinstance(first, shapes.Failed) and first.status == 422 and "no turns" in first.message
    assert second == [pytest.approx(reward.score_groups([PROMPT], [["42"]])[0], abs=1e-6)]
    assert third == shapes.Failed(500, "internal error: ZeroDivisionError")


def test_text_that_is_not_valid_unicode_is_scored_not_crashed(scorers):
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which the Rust tokenizers refuse: they are
    replaced, as the data readers do, and the request is scored. Wrong if it became a 500."""
    body = json.loads('{"conversation": "hi \\ud800", "answers": ["a \\udc00 b"]}')
    job, respond = shapes.parse_score(body, scorers["reward"], Limits())
    [score] = respond(shapes.score_jobs(scorers["reward"], [job])[0])["scores"]
    assert isinstance(score, float)


def test_bf16_compute_scores_like_fp32_with_the_head_in_fp32(exports, scorers):
    """`hpref serve --precision bf16` (auto picks it on bf16 CPUs for a model >= 256 wide): the
    backbone under bf16 autocast must give the fp32 scores to bf16's precision, and the head must
    still compute in fp32 — bf16 logits would round every score to ~3 significant digits and put
    many answers on the same few values (a GRPO group's advantages would then be mostly ties)."""
    import torch

    from hpref.builtin.scoring import ExportScorer

    bf16 = ExportScorer.load(exports["reward"], precision="bf16")
    assert bf16.compute_dtype == torch.bfloat16
    assert ExportScorer.load(exports["reward"], precision="auto").compute_dtype is None  # 32 wide: fp32
    prompts = [("What is two plus two?",), ("Name a colour.",)]
    groups = [["Four.", "It is 4, of course.", "five"], ["Blue.", "Red, or green.", "I cannot say."]]
    exact = scorers["reward"].score_groups(prompts, groups)
    fast = bf16.score_groups(prompts, groups)
    flat_exact = [s for g in exact for s in g]
    flat_fast = [s for g in fast for s in g]
    spread = max(flat_exact) - min(flat_exact)
    assert spread > 0
    assert max(abs(a - b) for a, b in zip(flat_exact, flat_fast, strict=True)) < 0.05 * spread + 1e-3
    as_bf16 = [float(torch.tensor(s).bfloat16().float()) for s in flat_fast]
    assert as_bf16 != flat_fast, "every score is a bf16 number: the head ran in bf16"
