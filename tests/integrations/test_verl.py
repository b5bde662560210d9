"""hpref exports as verl's custom reward function, through verl's own reward managers.

verl 0.9 installs here without its GPU stack (`pip install verl` with tensordict, omegaconf and
codetiming; its reward managers are plain Python over a `DataProto`), so these tests build a batch
as verl's rollout leaves it (left-padded prompt ids, right-padded response ids, one attention
mask) and let verl's reward-loop `naive` manager, loaded from the config lines the docs give, and
its `batch` manager call hpref's functions."""

from __future__ import annotations

import pytest

from .conftest import tiny_policy

pytest.importorskip("verl", reason="verl is not installed (pip install verl tensordict omegaconf codetiming)")

QUESTIONS = ["What is 12 + 30?", "Name a colour."]
RESPONSES = ["The answer is 42.", "Blue, I think."]
REFERENCES = ["42", "Red."]


def verl_batch(tokenizer, responses: list[str], references: list[str]):
    """A `DataProto` as verl's rollout hands it to the reward manager."""
    import numpy as np
    import torch
    from verl import DataProto

    prompts = [tokenizer(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    answers = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    width_p, width_r = max(map(len, prompts)) + 1, max(map(len, answers)) + 2
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts])
    response_ids = torch.tensor([a + [pad] * (width_r - len(a)) for a in answers])
    mask = torch.tensor(
        [
            [0] * (width_p - len(p)) + [1] * (len(p) + len(a)) + [0] * (width_r - len(a))
            for p, a in zip(prompts, answers, strict=True)
        ]
    )
    return DataProto.from_dict(
        tensors={"prompts": prompt_ids, "responses": response_ids, "attention_mask": mask},
        non_tensors={
            "data_source": np.array(["hpref-test"] * len(prompts), dtype=object),
            "reward_model": np.array([{"ground_truth": r} for r in references], dtype=object),
            "extra_info": np.array(
                [{"question": q, "index": i} for i, q in enumerate(QUESTIONS)], dtype=object
            ),
        },
    ), [len(a) for a in answers]


def config(export, name: str, manager: str):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": "pkg://hpref.integrations.verl",
                    "name": name,
                    "reward_kwargs": {"export": str(export), "prompt_key": "question"},
                },
                "reward_manager": {"source": "register", "name": manager},
            }
        }
    )


def test_verl_reward_managers_score_responses_with_the_export(tiny_exports):
    """verl's reward-loop `naive` manager (loaded by `load_reward_manager` from the documented
    config) gets the reward model's score of each response to the prompt in `extra_info`; verl's
    `batch` manager with `compute_score_batch` gets a judge's win probability against the reference
    answer, both orders averaged, on each response's last token. Wrong if the prompt were not read
    from extra_info, the reference ignored, or the export reloaded per call."""
    from verl.trainer.ppo.reward import get_custom_reward_fn, load_reward_manager
    from verl.workers.reward_manager import BatchRewardManager

    from hpref.integrations import verl as hpref_verl

    _, tokenizer = tiny_policy()
    data, lengths = verl_batch(tokenizer, RESPONSES, REFERENCES)

    reward = hpref_verl.backend_for(export=str(tiny_exports["reward"]))
    want = [s[0] for s in reward.score_groups([(q,) for q in QUESTIONS], [[r] for r in RESPONSES])]
    manager = load_reward_manager(config(tiny_exports["reward"], "compute_score", "naive"), tokenizer)
    got = [
        manager.loop.run_until_complete(manager.run_single(data[i : i + 1]))["reward_score"] for i in range(2)
    ]
    assert got == pytest.approx(want, abs=1e-5)
    assert hpref_verl.backend_for(export=str(tiny_exports["reward"])) is reward  # loaded once

    judge = hpref_verl.backend_for(export=str(tiny_exports["judge"]))
    scorer = judge.scorer
    want = [
        (p[0] + p[2] / 2)
        for p in scorer.run(
            [
                scorer.judge_job((q,), r, ref, swap=True)
                for q, r, ref in zip(QUESTIONS, RESPONSES, REFERENCES, strict=True)
            ]
        )
    ]
    compute = get_custom_reward_fn(config(tiny_exports["judge"], "compute_score_batch", "batch"))
    rewards = BatchRewardManager(tokenizer, num_examine=0, compute_score=compute)(data)
    assert [rewards[i, n - 1].item() for i, n in enumerate(lengths)] == pytest.approx(want, abs=1e-5)
    assert float(rewards.abs().sum()) == pytest.approx(sum(want), abs=1e-5)  # nothing elsewhere


def test_verl_reward_bad_input_is_one_line(tiny_exports):
    """The mistakes a verl user makes get one line naming the item: no prompt in extra_info, a
    judge without a text reference, neither export nor url. Wrong if the reward scored an empty
    prompt, made a reference up, or failed with a traceback from deep inside."""
    from hpref.integrations.verl import compute_score

    judge = str(tiny_exports["judge"])
    with pytest.raises(ValueError, match=r"^extra_infos\[0\]: no 'question' \(the prompt"):
        compute_score("src", "4", "4", {"index": 0}, export=judge)
    with pytest.raises(ValueError, match=r"^ground_truths\[0\]: a judge export .* got NoneType"):
        compute_score("src", "4", None, {"prompt": "2+2?"}, export=judge, prompt_key="prompt")
    with pytest.raises(ValueError, match="exactly one of reward_kwargs.export"):
        compute_score("src", "4", "4", {"question": "2+2?"})
    messages = [{"role": "user", "content": "2+2?"}]
    assert compute_score("src", "4", "4", {"question": messages}, export=judge) == pytest.approx(
        compute_score("src", "4", "4", {"question": "2+2?"}, export=judge)
    )
