"""Offline DPO's numbers and refusals, in-process on a tiny random Llama (no run started here).

The packed answer log-probs (`hpref.models.pair_logprobs`) must be a plain transformers forward's,
whatever the packing; pairs are tokenized as TRL does; and every bad input is one line naming the
file, row or key before anything trains. `test_dpo_train.py` runs whole trainings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hpref.data.records import Battle  # noqa: E402
from hpref.errors import DataError, RecipeError  # noqa: E402
from hpref.models.dpo_loss import dpo_loss  # noqa: E402
from hpref.recipe import recipe_from_dict  # noqa: E402
from hpref.recipe.rl import PolicyModelConfig  # noqa: E402

TINY_POLICY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 512,
    "tokenizer_texts": 500,
}
WORDS = ["apple", "river", "stone", "cloud", "green", "light", "music", "paper", "table", "window"]


def write_pairs(path: Path, n: int, seed: int = 0) -> Path:
    """A toy preference in TRL's prompt/chosen/rejected JSONL: the chosen answer starts with "yes"
    and ends with "thanks", the rejected one starts with "no" (lengths differ, so packing matters)."""
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            topic = " ".join(rng.sample(WORDS, rng.randint(2, 6)))
            good = "yes " + " ".join(rng.sample(WORDS, rng.randint(1, 5))) + " thanks"
            bad = "no " + " ".join(rng.sample(WORDS, rng.randint(1, 5)))
            f.write(json.dumps({"prompt": f"tell me about {topic}", "chosen": good, "rejected": bad}) + "\n")
    return path


def dpo_recipe(pairs: Path, output_dir: Path, name: str = "dpo", **sections: dict) -> dict:
    """A tiny DPO recipe as a dict (LoRA unless `lora=None`), folds 4: 3/4 train, 1/4 eval."""
    recipe = {
        "run": {"name": name, "output_dir": str(output_dir), "seed": 0},
        "dpo": {"beta": 0.5, "model": dict(TINY_POLICY)},
        "dataset": {
            "train": {"name": "pairwise", "path": str(pairs), "folds": 4, "split": "train"},
            "eval": {"name": "pairwise", "path": str(pairs), "folds": 4, "split": "eval"},
        },
        "optimizer": {"lr": 3e-3},
        "train": {
            "epochs": 2,
            "batch_size": 8,
            "micro_batch_tokens": 4096,
            "max_length": 64,
            "precision": "fp32",
            "log_interval": 1,
            "checkpoint_interval": 2,
            "keep_checkpoints": 10,
        },
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
    }
    for key, value in sections.items():
        if value is None:
            recipe.pop(key, None)
        else:
            recipe[key] = {**recipe.get(key, {}), **value}
    return recipe


def toml_of(recipe: dict, path: Path) -> Path:
    from hpref.recipe.loading import dump_toml

    path.write_text(dump_toml(recipe))
    return path


def plain_answer_logps(lm, ids: list[int], start: int) -> float:
    """The summed log-prob of `ids[start:]` given what precedes it: one unpacked transformers forward
    of one sequence (its own attention implementation, not hpref's varlen one)."""
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([ids])).logits[0].float()
    logps = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return float(logps[start - 1 :].sum())


@pytest.fixture(scope="module")
def tiny_lm():
    from hpref.models.causal_lm import build_policy_model

    return build_policy_model(PolicyModelConfig(**TINY_POLICY))


def test_packed_answer_logps_and_loss_equal_a_plain_forward_whatever_the_packing(tiny_lm, tmp_path):
    """Six pairs (one a tie) packed into one micro-batch, and again one pair per micro-batch, through
    `PackedLogProbs` on the varlen attention: every answer's log-prob equals an unpacked plain
    transformers forward of that one sequence, and so does every per-pair loss of all three loss
    types. If this fails, packed sequences attend across their boundary, positions do not restart,
    the answer mask is off by one, or a prompt token is counted as an answer token."""
    from hpref.data.packing import collate
    from hpref.models.attention import register_varlen_attention
    from hpref.models.pair_logprobs import PackedLogProbs, answer_positions
    from hpref.train.dpo_data import tokenize_pairs

    lm, tokenizer = tiny_lm
    torch.manual_seed(1)
    battles = [
        Battle(str(i), (f"question {w}",), (f"answer {w} " * (i + 1),), (f"other {w}",), (1.0, 0.0, 0.0))
        for i, w in enumerate(WORDS[:5])
    ] + [Battle("5", ("a tie?",), ("same",), ("also same",), (0.0, 0.0, 1.0))]
    data = tokenize_pairs(battles, tokenizer, max_length=64, name="pairs")
    plain = torch.tensor(
        [
            [
                plain_answer_logps(lm, list(e.ids[: e.split]), p),
                plain_answer_logps(lm, list(e.ids[e.split :]), p),
            ]
            for e, p in zip(data.examples, data.prompt_lengths, strict=True)
        ]
    )
    lm.set_attn_implementation(register_varlen_attention())
    try:
        root = PackedLogProbs(lm)
        for packing in ([list(range(6))], [[i] for i in range(6)]):
            packed = []
            for indices in packing:
                batch = collate([data.examples[i] for i in indices])
                lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
                at, of = answer_positions(lengths, [data.prompt_lengths[i] for i in indices for _ in (0, 1)])
                with torch.no_grad():
                    out = root(
                        batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen, at, of
                    )
                packed.append(out.reshape(-1, 2))
            packed = torch.cat(packed)
            assert torch.allclose(packed, plain, atol=1e-4, rtol=0), (packed - plain).abs().max()
            labels = torch.tensor([list(e.label) for e in data.examples])
            ref = plain + torch.randn_like(plain)  # any reference: the losses must agree for it
            for loss_type in ("sigmoid", "ipo", "davidson"):
                ours = dpo_loss(
                    packed[:, 0], packed[:, 1], ref[:, 0], ref[:, 1], labels, beta=0.3, loss_type=loss_type
                )
                theirs = dpo_loss(
                    plain[:, 0], plain[:, 1], ref[:, 0], ref[:, 1], labels, beta=0.3, loss_type=loss_type
                )
                assert torch.allclose(ours.loss, theirs.loss, atol=1e-5), loss_type
    finally:
        lm.set_attn_implementation("sdpa")


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_pairs_are_tokenized_as_trl_does_with_a_chat_template(tiny_lm):
    """With a chat template (ChatML, as SmolLM2's) a pair is TRL `DPOTrainer`'s tokens: each sequence
    is the templated whole conversation, the prompt the templated conversation with its generation
    prompt, and the answer what follows it, end-of-turn marker included. If this fails, hpref and TRL
    train on different tokens (the benchmark's loss curves would part), or the answer lost its
    end-of-turn marker (the policy would never learn to stop)."""
    import copy

    from hpref.train.dpo_data import encode_pair

    tokenizer = copy.deepcopy(tiny_lm[1])
    tokenizer.chat_template = CHATML
    turns = ("Hi there", "Hello!", "How are you?")
    seq_a, seq_b, start = encode_pair(tokenizer, turns, "Fine.", "Bad.")
    messages = [{"role": r, "content": t} for r, t in zip(("user", "assistant", "user"), turns, strict=True)]

    def template(msgs, generation=False):
        return list(
            tokenizer.apply_chat_template(
                msgs, add_generation_prompt=generation, tokenize=True, return_dict=False
            )
        )

    assert seq_a == template([*messages, {"role": "assistant", "content": "Fine."}])
    assert seq_b == template([*messages, {"role": "assistant", "content": "Bad."}])
    assert seq_a[:start] == seq_b[:start] == template(messages, generation=True)
    answer = tokenizer.decode(seq_a[start:]).replace(" ", "")
    assert answer.startswith("Fine") and answer.rstrip().endswith("<|im_end|>")


# --------------------------------------------------------------------------------------------------
# refusals: one line naming the file, row or key, exit 2, before anything trains


def test_pairs_whose_conversations_differ_before_the_answer_are_refused_naming_the_row(tmp_path, tiny_lm):
    """A TRL message-list pair whose earlier assistant turn differs between chosen and rejected has no
    single prompt: refused naming the row (skipped and counted with differing_history = "skip"); a
    pair whose user turns differ is refused by the reader, naming the row too. If this fails, DPO
    would train on a prompt that only one of the two answers continues."""
    from hpref.data.readers import PairwiseConfig, PairwiseReader
    from hpref.train.dpo_data import tokenize_pairs

    def turn(role, text):
        return {"role": role, "content": text}

    same = [turn("user", "hi"), turn("assistant", "hello"), turn("user", "and?")]
    rows = [
        {"chosen": [*same, turn("assistant", "good")], "rejected": [*same, turn("assistant", "bad")]},
        {
            "chosen": [
                turn("user", "hi"),
                turn("assistant", "hello"),
                turn("user", "and?"),
                turn("assistant", "x"),
            ],
            "rejected": [
                turn("user", "hi"),
                turn("assistant", "HEY"),
                turn("user", "and?"),
                turn("assistant", "y"),
            ],
        },
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, tokenizer = tiny_lm
    reader = PairwiseReader(PairwiseConfig(path=str(path)), seed=0)
    with pytest.raises(DataError) as err:
        tokenize_pairs(reader.battles(), tokenizer, max_length=64, name="dataset.train")
    message = str(err.value)
    assert "\n" not in message and err.value.exit_code == 2
    assert message.startswith("dataset.train: row 2: the two answers continue different conversations")
    kept = tokenize_pairs(reader.battles(), tokenizer, max_length=64, differing_history="skip", name="d")
    assert kept.counts["differing_history"] == 1 and kept.num_battles == 1

    rows[1]["rejected"][2] = turn("user", "something else")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"pairs.jsonl.*row 2.*user turns differ"):
        list(PairwiseReader(PairwiseConfig(path=str(path)), seed=0).battles())


def test_ties_are_trained_or_dropped_and_counted_never_silently():
    """An arena tie trains with its loss's tie form by default and is dropped, counted, with
    dpo.ties = "drop". If this fails, ties vanish without a word or crash the tokenizer."""
    from hpref.models.causal_lm import build_policy_model
    from hpref.train.dpo_data import tokenize_pairs

    _, tokenizer = build_policy_model(PolicyModelConfig(**TINY_POLICY))
    battles = [
        Battle("1", ("q",), ("a",), ("b",), (0.0, 0.0, 1.0)),
        Battle("2", ("q",), ("a",), ("b",), (0.0, 1.0, 0.0)),
    ]
    kept = tokenize_pairs(battles, tokenizer, max_length=64, name="d")
    assert kept.counts["ties"] == 1 and kept.num_battles == 2
    dropped = tokenize_pairs(battles, tokenizer, max_length=64, ties="drop", name="d")
    assert dropped.counts["ties_dropped"] == 1 and [b.id for b in dropped.battles] == ["2"]


@pytest.mark.parametrize(
    ("dpo", "expected"),
    [
        ({"loss_type": "hinge"}, "r.toml: dpo.loss_type: Input should be 'sigmoid', 'ipo' or 'davidson'"),
        ({"beta": 0}, "r.toml: dpo.beta: Input should be greater than 0"),
        ({"beta": -0.1}, "r.toml: dpo.beta: Input should be greater than 0"),
        (
            {"loss_type": "ipo", "label_smoothing": 0.1},
            "r.toml: dpo.label_smoothing: Value error, 0.1 is conservative DPO's",
        ),
        ({"ties": "ignore"}, "r.toml: dpo.ties: Input should be 'train' or 'drop'"),
    ],
)
def test_bad_dpo_settings_are_one_line_naming_the_key(tmp_path, dpo, expected):
    """If this fails, a bad [dpo] setting reaches the trainer (or the loss) instead of being refused
    when the recipe loads, or the message no longer names the key."""
    recipe = dpo_recipe(tmp_path / "p.jsonl", tmp_path)
    recipe["dpo"].update(dpo)
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(recipe, source=Path("r.toml"))
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    assert err.value.exit_code == 2


def _causal_config(folder: Path, architecture: str) -> None:
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, architectures=[architecture]
    ).save_pretrained(folder)


def test_a_dpo_recipe_with_a_sequence_classifier_or_no_chat_template_is_refused(tmp_path):
    """`hpref train`'s checks (run before any process starts): a judge `[model]` beside `[dpo]`, a
    dpo.model.path holding a sequence classifier, and a causal LM whose tokenizer has no chat template
    are each one line naming the key and the folder. If this fails, the run would build the wrong
    model, or lay prompts out without the template, after minutes of setup."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from hpref.train.checks import check_train

    pairs = write_pairs(tmp_path / "p.jsonl", 8)
    with_model = dpo_recipe(pairs, tmp_path)
    with_model["model"] = {"name": "tiny-llama"}
    with pytest.raises(
        RecipeError, match=r"^r.toml: model: a DPO recipe trains the causal LM of \[dpo\] model"
    ):
        check_train(recipe_from_dict(with_model, source=Path("r.toml")), machine=False)

    classifier = tmp_path / "classifier"
    _causal_config(classifier, "LlamaForSequenceClassification")
    recipe = dpo_recipe(pairs, tmp_path, dpo={"model": {"path": str(classifier)}})
    with pytest.raises(RecipeError) as err:
        check_train(recipe_from_dict(recipe, source=Path("r.toml")))
    assert str(err.value).startswith(
        f"r.toml: dpo.model.path: {classifier}: not a causal LM (LlamaForSequenceClassification)"
    )

    plain = tmp_path / "no-template"
    _causal_config(plain, "LlamaForCausalLM")
    vocab = {"[UNK]": 0, "hello": 1}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]"))).save_pretrained(
        plain
    )
    recipe = dpo_recipe(pairs, tmp_path, dpo={"model": {"path": str(plain)}})
    with pytest.raises(RecipeError) as err:
        check_train(recipe_from_dict(recipe, source=Path("r.toml")))
    assert str(err.value).startswith(f"r.toml: dpo.model.path: {plain}: its tokenizer has no chat template")
    assert "\n" not in str(err.value)


def test_hpref_train_refuses_a_pair_file_with_two_prompts_with_exit_2_before_training(tmp_path):
    """The whole command, in-process: a pair file whose row 2 continues two different conversations
    ends `hpref train` with exit 2 and one line naming the file's section and the row, before any
    step (no metrics, no checkpoint). If this fails, the refusal happens too late (after steps were
    taken) or surfaces as a crash (exit 1) instead of a user error."""
    from hpref.train import run_train

    same = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [
        {
            "chosen": [*same[:1], {"role": "assistant", "content": "a"}],
            "rejected": [*same[:1], {"role": "assistant", "content": "b"}],
        },
        {
            "chosen": [*same, {"role": "user", "content": "and?"}, {"role": "assistant", "content": "x"}],
            "rejected": [
                same[0],
                {"role": "assistant", "content": "HEY"},
                {"role": "user", "content": "and?"},
                {"role": "assistant", "content": "y"},
            ],
        },
    ]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = dpo_recipe(pairs, tmp_path / "runs", "bad")
    recipe["dataset"] = {"train": {"name": "pairwise", "path": str(pairs)}}
    assert run_train(toml_of(recipe, tmp_path / "bad.toml")) == 2
    run_dir = tmp_path / "runs" / "bad"
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "dataset.train: row 2: the two answers continue different conversations" in log
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def test_arena_votes_train_their_ties_and_name_a_multi_turn_row(tiny_lm):
    """The arena sample from ../shared (Kaggle LMSYS votes): its ties become tie-labelled pairs (the
    loss's tie form trains them), and a multi-turn battle, whose two models answered the earlier
    turns differently, is refused naming its row, or skipped and counted with differing_history =
    "skip". If this fails, arena ties are lost or mislabelled, or DPO trains on a prompt that only
    one answer continues."""
    from hpref.data.readers import ArenaConfig, ArenaReader
    from hpref.train.dpo_data import prompt_turns, tokenize_pairs
    from tests.conftest import SHARED

    path = SHARED / "data" / "lmsys-arena-kaggle-sample-a.csv.gz"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    battles = list(ArenaReader(ArenaConfig(path=str(path), limit=100), seed=0).battles())
    _, tokenizer = tiny_lm
    multi = next(b for b in battles if prompt_turns(b) is None)
    with pytest.raises(DataError, match=rf"^arena: row {multi.id}: the two answers continue different"):
        tokenize_pairs(battles, tokenizer, max_length=256, name="arena")
    data = tokenize_pairs(battles, tokenizer, max_length=256, differing_history="skip", name="arena")
    kept_ties = [e for e in data.examples if e.label == (0.0, 0.0, 1.0)]
    assert data.counts["ties"] == len(kept_ties) > 0  # trained as ties, none dropped
    assert data.counts["differing_history"] == sum(prompt_turns(b) is None for b in battles) > 0
    assert all(e.label == b.label for e, b in zip(data.examples, data.battles, strict=True))
