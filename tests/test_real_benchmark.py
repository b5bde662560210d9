"""The real-data benchmark's plumbing (benchmarks/real_pairwise.py), without training anything: it
must skip cleanly where ../shared is absent, split by prompt so no prompt sits on both sides, and
point each contender at the right shipped recipe and settings."""

from __future__ import annotations

import json

from benchmarks import real_pairwise


def _pairs(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        prompt = (
            f"\n\nHuman: question {i % (n // 2)}?"  # every prompt twice: the split must keep them together
        )
        rows.append(
            {"chosen": f"{prompt}\n\nAssistant: good {i}", "rejected": f"{prompt}\n\nAssistant: bad {i}"}
        )
    return rows


def test_skips_cleanly_without_the_data(tmp_path, capsys):
    """No ../shared (a fresh clone, CI elsewhere): exit 0 with one line, not a traceback; otherwise
    the benchmark would break every machine that lacks the real data."""
    assert (
        real_pairwise.main(["--data", str(tmp_path / "absent.jsonl.gz"), "--out", str(tmp_path / "o.md")])
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("skipped:")
    assert not (tmp_path / "o.md").exists()


def test_split_is_by_prompt_and_fixed(tmp_path):
    """Both pairs of one prompt go to the same side (else eval would score prompts seen in training),
    the eval share is about a fifth, and the split does not change between calls."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _pairs(400)))
    first = tmp_path / "a"
    second = tmp_path / "b"
    first.mkdir(), second.mkdir()
    train, evaluation, n_train, n_eval = real_pairwise.split_by_prompt(data, first, None)
    assert n_train + n_eval == 400 and 0.1 < n_eval / 400 < 0.3
    prompts = [
        {real_pairwise.prompt_key(json.loads(line)["chosen"]) for line in path.read_text().splitlines()}
        for path in (train, evaluation)
    ]
    assert not prompts[0] & prompts[1]
    again = real_pairwise.split_by_prompt(data, second, None)
    assert again[1].read_text() == evaluation.read_text()


def test_contenders_use_the_shipped_recipes_and_their_variants(tmp_path):
    """hpref-reward is the shipped minilm-reward (mean pooling), -cls the CLS pooler TRL uses, -lora
    LoRA r 8; --backbone smollm2 swaps in smollm2-reward. A wrong mapping would compare other models
    than the table says."""
    from hpref.recipe import load_recipe

    train, evaluation = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
    made = {
        (name, backbone): load_recipe(
            real_pairwise.write_recipe(name, train, evaluation, tmp_path, backbone), []
        )
        for name, backbone in [
            ("hpref-reward", "minilm"),
            ("hpref-reward-cls", "minilm"),
            ("hpref-reward-lora", "minilm"),
            ("hpref-reward", "smollm2"),
        ]
    }
    assert made["hpref-reward", "minilm"].model.name == "minilm"
    assert made["hpref-reward", "minilm"].model.config.pooling == "mean"
    assert made["hpref-reward", "minilm"].lora is None
    assert made["hpref-reward-cls", "minilm"].model.config.pooling == "first"
    assert made["hpref-reward-lora", "minilm"].lora.r == 8
    assert made["hpref-reward", "smollm2"].model.name == "smollm2"
    for recipe in made.values():
        assert recipe.train.epochs == 1 and recipe.train.batch_size == 8
        assert recipe.dataset.train.config.path == str(train)


def test_hpref_is_compared_with_trls_default_and_with_trl_at_its_fastest():
    """The headline ratio must be against the peer at its best, not only at its default (#26): with
    TRL's default (gradient checkpointing on) slower than bf16 without it, the table gives hpref's
    ratio to both and names the faster one; LoRA stays compared with TRL + LoRA only."""

    def run(wall: float, accuracy: float = 0.6) -> dict:
        return {
            "accuracy": accuracy, "log_loss": 0.65, "train_s": wall - 10, "wall_s": wall,
            "peak_rss_gib": 2.0, "load_mean": 2.0, "tokens": 100_000,
        }  # fmt: skip

    results = {
        "hpref-reward": [run(300.0, 0.64)],
        "trl": [run(900.0)],
        "trl-bf16-no-gc": [run(450.0)],
        "trl-fp32-no-gc": [run(600.0)],
        "hpref-reward-lora": [run(320.0)],
        "trl-lora": [run(800.0)],
    }
    lines = real_pairwise.table(results, n_train=900, n_eval=200)
    ratios = [line for line in lines if " / " in line and "wall" in line]
    assert any(line.startswith("hpref-reward / trl: wall 0.33x") for line in ratios), ratios
    assert any(
        line.startswith("hpref-reward / trl-bf16-no-gc (TRL at its fastest): wall 0.67x") for line in ratios
    ), ratios
    assert [line.split(":")[0] for line in ratios if line.startswith("hpref-reward-lora")] == [
        "hpref-reward-lora / trl-lora"
    ]


def test_step_comparison_feeds_trl_the_same_pairs_through_its_own_collator():
    """benchmarks.step_vs_trl compares one step of each side on the SAME pairs: TRL's batch must hold
    every real token of hpref's step plan (fillers left out), chosen rows first then rejected, each
    right-padded with the pad id; if it did not, the per-token rates it prints compare different work."""
    from types import SimpleNamespace

    import numpy as np
    from benchmarks import step_vs_trl

    from hpref.data.packing import FILLER, TokenizedExample

    examples = [
        TokenizedExample(ids=np.array([1, 2, 3, 4, 5], dtype=np.int32), label=None, row=0, split=3),
        TokenizedExample(ids=np.array([6, 7, 8], dtype=np.int32), label=None, row=1, split=1),
    ]
    setup = SimpleNamespace(train_data=SimpleNamespace(examples=examples), filler_token_id=0)
    plan = SimpleNamespace(micro_batches=(((0, FILLER), (1,)),), num_tokens=8)  # one rank, two micro-batches
    ids, mask = step_vs_trl._trl_batch(setup, plan)
    assert ids.tolist() == [[1, 2, 3], [6, 0, 0], [4, 5, 0], [7, 8, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]]
    assert (int(mask.sum()), ids.numel()) == (plan.num_tokens, 12)


def test_the_accuracy_comparison_is_paired_over_the_same_eval_pairs():
    """Two models right on 6 and 5 of 8 pairs differ by +0.125; paired, the interval comes from the
    per-pair differences (here 1 - 0 on one pair, equal elsewhere), and the discordant counts are
    what each alone got right. A table that compared unpaired figures, or pairs by position rather
    than id, would print other numbers."""
    ids = [f"p{i}" for i in range(8)]
    hpref = dict(zip(ids, [1, 1, 1, 1, 1, 1, 0, 0], strict=True))
    trl = dict(zip(reversed(ids), [0, 0, 1, 1, 1, 1, 1, 0], strict=True))  # stored in another order
    run = {"train_s": 10.0, "wall_s": 12.0, "peak_rss_gib": 1.0, "load_mean": 1.9, "tokens": 100}
    results = {
        "hpref-reward": [{**run, "accuracy": 0.75, "log_loss": 0.6, "hits": hpref}],
        "trl": [{**run, "accuracy": 0.625, "log_loss": 0.6, "hits": trl}],
    }
    rows = real_pairwise.table(results, n_train=80, n_eval=8)
    # by id the two differ on p0 alone (hpref right): mean 1/8, sd sqrt(0.875 / 7), so the interval
    # is 0.125 -/+ 1.96 x 0.3536 / sqrt(8); by position they would differ on three pairs (2 vs 1)
    expected = (
        "accuracy hpref-reward - trl, paired over 8 eval pairs: +0.125 (95 % interval -0.120 .. "
        "+0.370; right where the other is wrong: 1 vs 0)"
    )
    assert expected in rows, rows
    assert real_pairwise.paired_difference(results["hpref-reward"], [{"accuracy": 0.6}]) is None
