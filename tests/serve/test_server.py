"""A real `hpref serve` (the console script, Ray Serve, two replicas of a tiny reward export) asked
over HTTP: every endpoint's numbers against the in-process scorer, the bearer token, concurrent
requests batched into one packed pass, bad input refused without harm, a killed replica restarted,
and the `remote` reward of `hpref rl` scoring through it (and failing loudly without it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from hpref.data.prompts import battle_with_answers
from hpref.data.transcripts import render_chatml

from .conftest import PROMPT, TOKEN, free_port

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow

ANSWERS = ["The answer is 42.", "41", "I cannot assist with this request."]


@pytest.fixture(scope="module")
def scorer(exports):
    from hpref.builtin.scoring import ExportScorer

    return ExportScorer.load(exports["reward"])


def post(server, path, body, **kwargs):
    headers = kwargs.pop("headers", server.headers)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60, **kwargs)


def test_every_endpoint_answers_with_the_scorers_numbers(server, scorer, exports):
    """/v1/score, /v1/judge (the reward model's Davidson tie model), OpenRLHF's /get_reward and
    miles' /remote_rm give what the export gives in-process; /info carries the model card. Wrong if
    the server formatted, packed or paired sequences differently from `hpref rl`'s judge reward."""
    [want] = scorer.score_groups([PROMPT], [ANSWERS])
    reply = post(server, "/v1/score", {"conversation": PROMPT[0], "answers": ANSWERS})
    assert reply.status_code == 200 and reply.json()["kind"] == "reward"
    assert reply.json()["scores"] == pytest.approx(want, abs=1e-5)

    [probs] = scorer.judge_pairs([battle_with_answers(PROMPT, *ANSWERS[:2])])
    reply = post(
        server, "/v1/judge", {"conversation": PROMPT[0], "answer_a": ANSWERS[0], "answer_b": ANSWERS[1]}
    )
    got = reply.json()
    assert [got["p_a"], got["p_b"], got["p_tie"]] == pytest.approx(list(probs), abs=1e-6)
    assert sum(probs) == pytest.approx(1.0) and probs[2] > 0.0  # a tie model, not Bradley-Terry

    # OpenRLHF's client: {"query", "prompts", "labels"} of one sample, reads rewards / scores / extra_logs
    messages = [{"role": "user", "content": PROMPT[0]}]
    query = render_chatml([*messages, {"role": "assistant", "content": ANSWERS[1]}]) + "<|endoftext|>"
    body = {"query": [query], "prompts": [render_chatml(messages, open_reply=True)], "labels": [None]}
    got = post(server, "/get_reward", body).json()
    assert got["rewards"] == got["scores"] == pytest.approx([want[1]], abs=1e-5) and got["extra_logs"] == {}

    # miles / slime: the JSON body itself is the sample's reward
    reply = post(server, "/remote_rm", {"prompt": messages, "response": ANSWERS[2], "label": None})
    assert isinstance(reply.json(), float) and reply.json() == pytest.approx(want[2], abs=1e-5)

    info = httpx.get(f"{server.url}/info", headers=server.headers, timeout=30).json()
    assert info["kind"] == "reward" and info["model"] == exports["reward"].name and info["step"] == 3
    assert info["formatter"] == "answers" and info["max_length"] == 256 and info["replicas"] == 2
    assert info["tie_log_nu"] == pytest.approx(float(scorer.model.head.log_tie.detach()))


def test_the_token_guards_everything_but_the_probes(server):
    """Wrong if a request without the token, or with a wrong one, were scored; or if the health
    probes (which load balancers send without credentials) needed it. Clients that cannot send a
    header (OpenRLHF's, miles') pass it in the URL."""
    body = {"conversation": "q", "answers": ["a"]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        reply = post(server, "/v1/score", body, headers=headers)
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
        assert reply.json() == {"error": "missing or wrong bearer token (Authorization: Bearer TOKEN)"}
    assert httpx.get(f"{server.url}/info", timeout=30).status_code == 401
    assert post(server, f"/v1/score?token={TOKEN}", body, headers={}).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200


def test_concurrent_requests_share_packed_passes(server, scorer):
    """Sixteen clients at once: each gets its own answer (no request gets another's score), and the
    replicas scored several requests per forward pass (the batch size each response reports).
    Wrong if @serve.batch were not in the path, or if Ray Serve's per-replica cap of 5 ongoing
    requests had been left in place."""
    answers = [f"answer number {i}" for i in range(16)]
    [want] = scorer.score_groups([PROMPT], [answers])

    async def one(client, answer):
        reply = await client.post(
            f"{server.url}/remote_rm", json={"prompt": PROMPT[0], "response": answer}, headers=server.headers
        )
        return reply.json(), int(reply.headers["x-hpref-batch-size"])

    async def all_at_once():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, a) for a in answers))

    for _ in range(3):  # a loaded machine may deliver them spread out: the largest batch counts
        results = asyncio.run(all_at_once())
        assert [r for r, _ in results] == pytest.approx(want, abs=1e-5)
        if max(b for _, b in results) > 1:
            break
    assert max(b for _, b in results) > 1, results


BAD_REQUESTS = [
    ("/v1/score", b"{not json", 400, "malformed JSON"),
    ("/v1/score", b"", 400, "empty request body"),
    ("/v1/score", b'{"conversation": "\xff\xfe"}', 400, "request body is not UTF-8"),
    ("/v1/score", b"[]", 422, "expected a JSON object, got an array"),
    ("/v1/score", json.dumps({"conversation": "q"}).encode(), 422, "answers: Field required"),
    (
        "/v1/score",
        json.dumps({"conversation": "q", "answers": "a"}).encode(),
        422,
        "answers: Input should be",
    ),
    (
        "/v1/score",
        json.dumps({"conversation": "q", "answers": []}).encode(),
        422,
        "answers: List should have",
    ),
    (
        "/v1/judge",
        json.dumps({"conversation": 5, "answer_a": "a", "answer_b": "b"}).encode(),
        422,
        "conversation",
    ),
    ("/get_reward", json.dumps({"query": ["x"] * 300}).encode(), 422, "query: 300 items, more than the 256"),
    (
        "/get_reward",
        json.dumps({"query": ["plain"], "prompts": ["other"]}).encode(),
        422,
        "query.0: cannot tell",
    ),
    ("/remote_rm", json.dumps({"prompt": "q"}).encode(), 422, "response: Field required"),
    (
        "/v1/score",
        b'{"answers": ["' + b"x" * (9 * 1024 * 1024) + b'"]}',
        413,
        "request body over 8388608 bytes",
    ),
    ("/v1/nothing", b"{}", 404, "Not Found"),
]


def test_bad_input_is_refused_and_the_service_keeps_answering(server, scorer):
    """Each malformed, incomplete, mistyped, oversized or non-UTF-8 request gets a 4xx with a
    one-line reason, then a good request is answered as before. Wrong if any of them took a replica
    down (a 5xx, a hang) or was scored anyway."""
    for path, body, status, says in BAD_REQUESTS:
        reply = post(server, path, body)
        assert reply.status_code == status, (path, body[:60], reply.text[:300])
        message = reply.json()["error"]
        assert says in message and "\n" not in message, (path, message)
    [want] = scorer.score_groups([PROMPT], [ANSWERS[:1]])
    reply = post(server, "/v1/score", {"conversation": PROMPT[0], "answers": ANSWERS[:1]})
    assert reply.status_code == 200 and reply.json()["scores"] == pytest.approx(want, abs=1e-5)


def test_remote_reward_scores_through_the_server(server, scorer, tmp_path):
    """The `remote` reward component of `hpref rl`, built through the plugin registry as a recipe's
    `[rl.reward] name = "remote"` is, scores GRPO groups through the server in both shapes with
    the numbers the export gives in-process. Wrong if groups were mixed up, the token not sent, or
    OpenRLHF's shape lost the conversation."""
    from hpref.plugins import load_plugins

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    component = load_plugins().get("reward", "remote")
    prompts = [PROMPT, ("Say hi.", "Hi!", "Again?")]
    groups = [ANSWERS, ["Hi again!", "No."]]
    want = scorer.score_groups(prompts, groups)
    hpref_shape = component.build(component.config(url=f"{server.url}/v1/score", token_file=str(token_file)))
    assert not hpref_shape.pairwise and not hpref_shape.wants_opponents  # the server holds a reward model
    assert hpref_shape.score_groups(prompts, groups) == [pytest.approx(g, abs=1e-5) for g in want]
    openrlhf = component.build(
        component.config(url=f"{server.url}/get_reward?token={TOKEN}", shape="openrlhf")
    )
    assert openrlhf.score_groups(prompts, groups) == [pytest.approx(g, abs=1e-5) for g in want]
    # a refusal is not retried and says why
    from hpref.errors import UserError

    with pytest.raises(UserError, match=r"refused the request \(401\): missing or wrong bearer token"):
        component.build(component.config(url=f"{server.url}/v1/score"))


def test_a_killed_replica_is_restarted_while_the_other_serves(server, scorer):
    """SIGKILL one replica: requests keep being answered (the other replica), /ready says 503 with
    one replica running until Ray Serve has started a new one, then 200 with two. Wrong if the
    deployment were left short, or /ready said ready while it was."""
    psutil = pytest.importorskip("psutil")
    replicas = [
        p
        for p in psutil.Process(server.process.pid).children(recursive=True)
        if "ServeReplica:hpref:HprefScorer" in " ".join(p.cmdline())
    ]
    assert len(replicas) == 2, [p.cmdline() for p in replicas]
    os.kill(replicas[0].pid, signal.SIGKILL)
    [want] = scorer.score_groups([PROMPT], [ANSWERS[:1]])
    seen_short, deadline = False, time.monotonic() + 90
    while time.monotonic() < deadline:
        reply = post(server, "/v1/score", {"conversation": PROMPT[0], "answers": ANSWERS[:1]})
        assert reply.status_code == 200 and reply.json()["scores"] == pytest.approx(want, abs=1e-5)
        ready = httpx.get(f"{server.url}/ready", timeout=30)
        if ready.status_code == 503:
            seen_short = True
            assert ready.json()["replicas_running"] < 2
        elif seen_short:
            assert ready.json() == {"ready": True, "replicas_running": 2, "replicas_wanted": 2}
            break
        time.sleep(0.5)
    else:
        pytest.fail("the killed replica was not replaced within 90 s")
    new = [
        p
        for p in psutil.Process(server.process.pid).children(recursive=True)
        if "ServeReplica:hpref:HprefScorer" in " ".join(p.cmdline())
    ]
    assert len(new) == 2 and replicas[0].pid not in {p.pid for p in new}


def test_the_remote_reward_without_a_server_fails_with_the_url(tmp_path):
    """Nothing listens at the URL: building the reward fails after its retries with one line naming
    the URL (never a zero reward), and `hpref rl`'s preflight refuses the recipe before Ray starts."""
    from hpref.builtin.remote_reward import RemoteConfig, RemoteReward
    from hpref.builtin.rewards import check_reward_exports
    from hpref.errors import RecipeError, UserError

    url = f"http://127.0.0.1:{free_port()}/v1/score"
    started = time.monotonic()
    with pytest.raises(UserError) as err:
        RemoteReward(RemoteConfig(url=url, retries=2, timeout_s=5))
    message = str(err.value)
    assert (
        message.startswith(f"remote reward {url}: no answer from http://127.0.0.1:")
        and "after 3 tries" in message
    )
    assert "\n" not in message and time.monotonic() - started < 10  # two pauses: 0.5 s and 1 s
    with pytest.raises(RecipeError, match=rf"recipe: rl.reward.url: no reward server answers at {url}"):
        check_reward_exports({"rl.reward": RemoteConfig(url=url)}, "recipe")
