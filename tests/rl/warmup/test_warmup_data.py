"""The warm-up on the user's own answers (`[rl.warmup] path`): a chat file's last assistant message or
a pair file's chosen side, learnt on its answer tokens only, the held-out loss going down, the
cache, pretrained and LoRA policies, and the one-line refusals before anything starts."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hpref.errors import DataError, RecipeError  # noqa: E402
from hpref.models.causal_lm import encode_prompt, policy_tokenizer  # noqa: E402
from hpref.recipe.rl import PolicyModelConfig, WarmupConfig, parse_rl_section  # noqa: E402
from hpref.rl.control.preflight import preflight  # noqa: E402
from hpref.rl.launch import apply_warmup  # noqa: E402
from hpref.rl.warmup import data as warmup_data  # noqa: E402
from hpref.rl.warmup import supervised as warmup_mod  # noqa: E402
from tests.rl.tiny import TINY as TINY_SETTINGS  # noqa: E402

TINY = PolicyModelConfig(**TINY_SETTINGS)
COLOURS = ("red", "green", "blue", "yellow")
# 40 steps of 8 rows: a second of a tiny model's time, and its held-out loss falls by about half
QUICK = {"steps": 40, "batch_size": 8, "lr": 1e-2, "warmup_steps": 2, "eval_fraction": 0.25}


def question(i: int) -> str:
    return f"What colour is thing {i}?"


def answer(i: int) -> str:
    return f"Thing {i} is {COLOURS[i % 4]}."


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A chat file (every fifth row two turns long) and a pair file in HH-RLHF's transcripts, 80
    rows each, the rejected side always a refusal."""
    root = tmp_path_factory.mktemp("warmup-data")
    chats = []
    for i in range(80):
        messages = [{"role": "user", "content": question(i)}, {"role": "assistant", "content": answer(i)}]
        if i % 5 == 0:
            messages = [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "Hi there."},
                *messages,
            ]
        chats.append({"messages": messages})
    pairs = [
        {
            "chosen": f"\n\nHuman: {question(i)}\n\nAssistant: {answer(i)}",
            "rejected": f"\n\nHuman: {question(i)}\n\nAssistant: I do not know.",
        }
        for i in range(80)
    ]
    return {
        "chat": write_jsonl(root / "chat.jsonl", chats),
        "pairs": write_jsonl(root / "pairs.jsonl", pairs),
        "text": write_jsonl(root / "text.jsonl", [{"text": "hi"}]),
        "no-rejected": write_jsonl(root / "chosen.jsonl", [{"chosen": "\n\nHuman: a\n\nAssistant: b"}]),
    }


def test_rows_become_engine_prompts_and_their_final_or_chosen_answers(files):
    # Wrong if the warm-up taught answers after a prompt the engine never sends (another layout,
    # earlier turns lost), taught the rejected side of a pair, or left out the eos the policy stops at.
    tok = policy_tokenizer(TINY)
    everything = {"eval_fraction": 0.0}
    chat = warmup_data.read_examples(WarmupConfig(path=str(files["chat"]), **everything), tok).train
    assert len(chat) == 80
    ids, start = chat.examples[5].ids.tolist(), chat.prompt_lengths[5]
    assert ids[:start] == encode_prompt(tok, ("hello", "Hi there.", question(5)))
    assert ids[start:] == [*tok.encode(answer(5), add_special_tokens=False), tok.eos_token_id]
    pairs = warmup_data.read_examples(WarmupConfig(path=str(files["pairs"]), **everything), tok).train
    learnt = [tok.decode(e.ids[p:-1]) for e, p in zip(pairs.examples, pairs.prompt_lengths, strict=True)]
    assert learnt == [answer(i) for i in range(80)]  # the chosen side, whichever side the coin put it
    # held out by a hash of the prompt, as [rl.prompts] holds out its eval prompts
    split = warmup_data.read_examples(WarmupConfig(path=str(files["pairs"]), eval_fraction=0.25), tok)
    assert len(split.train) + split.counts["held out"] == 80 and 10 <= len(split.held_out) <= 30


def test_only_answer_tokens_are_in_the_loss(files):
    # Wrong if a prompt token (or the next sequence's first token) were a target: the warm-up would
    # teach the policy to write its user's questions.
    import torch

    from hpref.models.attention import register_varlen_attention
    from hpref.models.causal_lm import build_policy_model
    from hpref.models.pair_logprobs import PackedLogProbs

    tok = policy_tokenizer(TINY)
    data = warmup_data.read_examples(WarmupConfig(path=str(files["chat"]), eval_fraction=0.0), tok).train
    rows = [0, 1, 2]
    input_ids, _, cu_seqlens, _, at, _ = warmup_data.packed_answers(data, rows)
    starts = cu_seqlens[:-1].tolist()
    # by hand: sequence s's prompt ends at starts[s] + p - 1, whose next token is its answer's first
    want_at = [
        starts[k] + p - 1 + t
        for k, (p, e) in enumerate((data.prompt_lengths[i], data.examples[i]) for i in rows)
        for t in range(len(e) - p)
    ]
    assert at.tolist() == want_at
    answers = [t for i in rows for t in data.examples[i].ids[data.prompt_lengths[i] :].tolist()]
    assert input_ids[at + 1].tolist() == answers
    # and the packed loss is the plain model's answer-token NLL, sequence by sequence
    plain, _ = build_policy_model(TINY)
    packed, _ = build_policy_model(TINY)
    packed.set_attn_implementation(register_varlen_attention())
    by_hand = 0.0
    with torch.no_grad():
        for i in rows:
            ids, p = torch.tensor(data.examples[i].ids, dtype=torch.long), data.prompt_lengths[i]
            logp = plain(input_ids=ids[None]).logits[0, :-1].log_softmax(-1)
            by_hand -= float(logp[p - 1 :].gather(1, ids[p:, None]).sum())
        got = float(warmup_data.answer_nll(PackedLogProbs(packed), data, rows))
    assert got == pytest.approx(by_hand, rel=1e-4)
    assert data.answer_tokens(rows) == len(answers)


@pytest.fixture(scope="module")
def chat_warmup(files, tmp_path_factory):
    """The tiny policy warmed up on the chat file (one training, shared by the tests below), in the
    session's cache (a module fixture runs before the autouse fixtures that point HPREF_CACHE there)."""
    config = WarmupConfig(path=str(files["chat"]), **QUICK)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))
        return config, warmup_mod.warmup_checkpoint(TINY, config)


def test_chat_warmup_lowers_the_held_out_loss_and_is_cached(chat_warmup, files, tmp_path, monkeypatch):
    # Wrong if the warm-up did not learn the user's answers (the held-out loss must fall), left a
    # folder the engine cannot load (the packed attention saved in its config), trained again on a
    # second call, or reused a checkpoint of other data or adapters.
    from hpref.models.causal_lm import build_policy_model

    config, folder = chat_warmup
    meta = json.loads((folder / warmup_mod.META_FILE).read_text())
    assert meta["eval_loss_after"] < 0.7 * meta["eval_loss_before"], meta
    assert meta["held_out_measured"] >= 10 and meta["checkpoint"] == "every weight trained"
    lm, _ = build_policy_model(PolicyModelConfig(path=str(folder)))
    assert lm.config._attn_implementation != "hpref_varlen"

    def no_training(*args, **kwargs):
        raise AssertionError("the cached warm-up was trained again")

    monkeypatch.setattr(warmup_data, "train_on_data", no_training)
    assert warmup_mod.warmup_checkpoint(TINY, config) == folder
    assert warmup_mod.cache_key(TINY, config.model_copy(update={"threads": 3})) == folder.name
    grown = tmp_path / "chat.jsonl"
    grown.write_text(files["chat"].read_text() + json.dumps({"messages": [{"role": "user", "content": "x"}]}))
    assert warmup_mod.cache_key(TINY, config.model_copy(update={"path": str(grown)})) != folder.name
    lora = (
        parse_rl_section({"policies": {"a": {"lora": {"r": 4}}}}, "r.toml", resolve=False).policies["a"].lora
    )
    assert warmup_mod.cache_key(TINY, config, lora) != folder.name
    # the arena's warm-up keeps the key it always had: the new settings are not in it
    arena = WarmupConfig(steps=3)
    old_keys = ("steps", "batch_size", "lr", "warmup_steps", "battles", "answers", "families")
    old_keys += ("max_answer_tokens", "seed")
    old_settings = {k: v for k, v in arena.model_dump(mode="json").items() if k in old_keys}
    legacy = {"format": 1, "model": TINY.model_dump(mode="json"), "warmup": old_settings}
    digest = hashlib.sha256(json.dumps(legacy, sort_keys=True).encode()).hexdigest()[:16]
    assert warmup_mod.cache_key(TINY, arena) == digest


def test_pair_file_warms_pretrained_and_lora_policies(chat_warmup, files):
    # Wrong if a pretrained policy were left cold while [rl.warmup] has a path, a LoRA policy's
    # checkpoint were an adapter the engines cannot start from, or its held-out loss did not fall.
    from transformers import AutoModelForCausalLM

    _, pretrained = chat_warmup  # a causal-LM folder with a tokenizer, as any pretrained model
    section = {
        "warmup": {"path": str(files["pairs"]), **QUICK},
        "policies": {
            "a": {"model": {"path": str(pretrained)}, "lora": {"r": 8, "alpha": 64}},
            "p": {"model": {"path": str(pretrained)}},
        },
    }
    config = parse_rl_section(section, "r.toml", resolve=False)
    folders = apply_warmup(config, ["a", "p"])
    assert set(folders) == {"a", "p"} and folders["a"] != folders["p"]
    assert config.policies["p"].model.path == folders["p"] and config.policies["a"].model.path == folders["a"]
    # 0.80 -> 0.45 nats trained whole, 0.80 -> 0.69 through rank-8 adapters of a 32-wide model
    for p, most in (("a", 0.9), ("p", 0.7)):
        meta = json.loads((Path(folders[p]) / warmup_mod.META_FILE).read_text())
        assert meta["eval_loss_after"] < most * meta["eval_loss_before"], (p, meta)
    merged = Path(folders["a"])
    assert json.loads((merged / warmup_mod.META_FILE).read_text())["checkpoint"] == "merged LoRA"
    assert not (merged / "adapter_config.json").exists()
    lm, start = (AutoModelForCausalLM.from_pretrained(f).state_dict() for f in (merged, pretrained))
    assert lm.keys() == start.keys()  # a plain causal LM, no adapter tensors
    # the adapters' update folded into the block linears; the embeddings LoRA does not target untouched
    assert not lm["model.layers.0.self_attn.q_proj.weight"].equal(
        start["model.layers.0.self_attn.q_proj.weight"]
    )
    assert lm["model.embed_tokens.weight"].equal(start["model.embed_tokens.weight"])
    # without a path, the arena's warm-up leaves pretrained policies as they are (as it always did)
    assert not warmup_mod.has_warmup(PolicyModelConfig(path=str(pretrained)), WarmupConfig())
    # policies on a shared base share one warm-up: the leader's adapters, so one folder for both
    two = {p: {"model": {"path": "x"}, "lora": {"r": r}} for p, r in (("a", 4), ("b", 8))}
    shared = parse_rl_section({**section, "policies": two}, "r.toml", resolve=False)
    shared = shared.model_copy(update={"share_base": True})
    plan = warmup_mod.warmup_settings(shared, ["b", "a"])
    assert plan["a"][1].r == plan["b"][1].r == 8


@pytest.mark.parametrize(
    ("warmup", "message"),
    [
        ({"path": "{missing}"}, "r.toml: rl.warmup.path: {missing}: data file not found"),
        ({"path": "{text}"}, "no 'chosen' column (a pair file, whose chosen side is learnt) or 'messages'"),
        ({"path": "{no-rejected}"}, "missing column rejected"),
        ({"path": "{chat}", "battles": 100}, "r.toml: rl.warmup: battles: synthetic-arena settings"),
        ({"eval_fraction": 0.1}, "r.toml: rl.warmup: eval_fraction: settings of a warm-up on your data"),
    ],
)
def test_refusals_are_one_line_naming_the_key(files, tmp_path, warmup, message):
    # Wrong if a bad warm-up source surfaced as a traceback, or only after actors had started.
    names = {f"{{{k}}}": str(v) for k, v in files.items()} | {"{missing}": str(tmp_path / "missing.jsonl")}
    table = {k: names.get(v, v) if isinstance(v, str) else v for k, v in warmup.items()}
    message = next((message.replace(k, v) for k, v in names.items() if k in message), message)
    with pytest.raises(RecipeError) as info:
        config = parse_rl_section({"warmup": table, "policies": {"a": {}}}, "r.toml", resolve=False)
        warmup_data.check_source(config.warmup, "r.toml")
    assert "\n" not in str(info.value) and message in str(info.value), str(info.value)
    assert info.value.exit_code == 2


def test_no_usable_rows_and_a_bad_file_stop_hpref_rl_before_it_starts(files, tmp_path):
    # Wrong if `hpref rl` started writing or starting actors for a warm-up that cannot run, or if a
    # file whose every prompt is too long failed later than the warm-up, without a row count.
    from hpref.recipe import load_recipe

    tok = policy_tokenizer(TINY)
    long = write_jsonl(
        tmp_path / "long.jsonl",
        [{"messages": [{"role": "user", "content": "tell me " * 20}, {"role": "assistant", "content": "ok"}]}]
        * 3,
    )
    with pytest.raises(
        DataError, match=r"no usable rows to train on \(3 read, 0 held out; left out: 3 prompt of 16 "
    ):
        warmup_data.read_examples(WarmupConfig(path=str(long), max_length=16), tok)
    tiny = ", ".join(f"{k} = {v}" for k, v in TINY_SETTINGS.items())
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        textwrap.dedent(f"""
        [run]
        name = "w"
        output_dir = "{tmp_path.as_posix()}"
        [rl.warmup]
        path = "{(tmp_path / "gone.jsonl").as_posix()}"
        [rl.defaults]
        model = {{ {tiny} }}
        [rl.policies.a]
        """)
    )
    with pytest.raises(RecipeError, match=r"rl\.warmup\.path: .*gone\.jsonl: data file not found$"):
        preflight(load_recipe(recipe), ["a"])
