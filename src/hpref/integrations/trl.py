"""hpref exports inside TRL: a pairwise judge for online DPO, a reward function for GRPO.

HprefJudge(export) / RemoteJudge(url)
    TRL's pairwise judge interface (`BasePairwiseJudge`: `judge(prompts, completions,
    shuffle_order=True) -> list[int]`, the index of the preferred completion of each pair). Each pair
    is judged in both orders and averaged (`swap`), which cancels the judge's position bias exactly,
    so `shuffle_order` (TRL's way of cancelling it in expectation) is only used with `swap=False`.
    A tie, or equal probabilities, goes to the first completion, as TRL's `OnlineDPOTrainer` ranks
    equal scores (`first >= second`). `return_scores=True` gives P(first preferred) + half P(tie)
    instead; `probabilities(prompts, completions)` the three-way (p_first, p_second, p_tie), and
    `last_probabilities` those of the latest call, for whoever wants them in a log. A reward model's
    export judges too, as in `hpref rl`'s online DPO: its probabilities are Davidson's on its two
    scores with the tie strength it learnt. A folder that is no preference-model export (a policy, a
    TRL reward model) is refused in one line.

    TRL 1.x's `OnlineDPOTrainer` takes `reward_funcs` only (its judges were removed): pass
    `judge.reward_func()`. It is called with the batch's 2B completions, the first completions of the
    B prompts and then the second ones (`prompts = 2 * prompts`), judges completion i against i + B,
    and returns each completion's win probability (+ half tie): the pair's two values sum to 1 and
    the larger is the judge's choice, so TRL's chosen side is the judge's (ties to the first).

HprefReward(export) or HprefReward(url=...)
    A `reward_funcs` entry of `GRPOTrainer` (TRL's signature: `(prompts, completions, **kwargs) ->
    list[float]`): the batch's completions grouped by prompt and scored in one packed pass on the
    trainer's device (`device="auto"`: accelerate's device for this process). A reward model's
    score is its scalar; a judge's is each completion's mean win probability (+ half tie) against
    the other completions of its group, both orders averaged, as `hpref rl`'s `judge` reward.

Prompts may be strings (TRL's standard format) or message lists (conversational); completions
strings or `[{"role": "assistant", "content": ...}]`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpref.integrations.backends import Backend, Probs, completion_text, is_url, open_backend, prompt_of


class _PairwiseJudge:
    """TRL's pairwise judge interface over a judge backend (see the module docstring)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        #: (p_first, p_second, p_tie) of each pair of the latest `judge` / `probabilities` call
        self.last_probabilities: list[Probs] = []

    def probabilities(self, prompts: Sequence[Any], completions: Sequence[Sequence[Any]]) -> list[Probs]:
        """(p_first, p_second, p_tie) of each prompt's pair of completions, in one batched pass."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} pairs of completions")
        turns, pairs = [], []
        for i, (prompt, pair) in enumerate(zip(prompts, completions, strict=True)):
            if len(pair) != 2:
                raise ValueError(f"completions[{i}]: {len(pair)} completions; a pairwise judge compares 2")
            turns.append(prompt_of(prompt, f"prompts[{i}]"))
            pairs.append(tuple(completion_text(c, f"completions[{i}][{k}]") for k, c in enumerate(pair)))
        self.last_probabilities = self.backend.judge_answers(turns, pairs) if pairs else []
        return self.last_probabilities

    def judge(
        self,
        prompts: list[Any],
        completions: list[list[Any]],
        shuffle_order: bool = True,
        return_scores: bool = False,
    ) -> list[int] | list[float]:
        """The index (0 or 1) of the preferred completion of each pair, ties to 0; with
        `return_scores`, P(the first is preferred) + half P(tie). `shuffle_order` matters only with
        `swap=False` (one order judged): then each pair is shown in a random order, as TRL's judges
        do, and its probabilities mapped back to the order given."""
        if not shuffle_order or self.backend.swap:
            probs = self.probabilities(prompts, completions)
        else:
            flips = [random.random() < 0.5 for _ in completions]
            shown = [
                list(pair)[::-1] if flip else list(pair)
                for pair, flip in zip(completions, flips, strict=True)
            ]
            judged = self.probabilities(prompts, shown)
            probs = [(p[1], p[0], p[2]) if flip else p for p, flip in zip(judged, flips, strict=True)]
            self.last_probabilities = probs
        if return_scores:
            return [p_first + 0.5 * p_tie for p_first, _, p_tie in probs]
        return [0 if p_first >= p_second else 1 for p_first, p_second, _ in probs]

    def reward_func(self) -> Callable[..., list[float]]:
        """This judge as TRL 1.x `OnlineDPOTrainer`'s reward function (see the module docstring)."""

        def hpref_judge(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
            half, odd = divmod(len(completions), 2)
            if odd or len(prompts) != len(completions) or list(prompts[:half]) != list(prompts[half:]):
                raise ValueError(
                    "hpref judge: expected OnlineDPOTrainer's batch (the first completion of each prompt, "
                    f"then the second: prompts = 2 * prompts); got {len(prompts)} prompts and "
                    f"{len(completions)} completions"
                )
            pairs = [[completions[i], completions[i + half]] for i in range(half)]
            probs = self.probabilities(list(prompts[:half]), pairs)
            first = [p_first + 0.5 * p_tie for p_first, _, p_tie in probs]
            return [*first, *(1.0 - value for value in first)]

        return hpref_judge


class HprefJudge(_PairwiseJudge):
    """An hpref export (`hpref save`: a judge, or a reward model through its tie model) as a TRL
    pairwise judge, loaded once in this process on `device` ("auto": the trainer's)."""

    def __init__(
        self,
        export: str | Path,
        *,
        device: Any = "auto",
        swap: bool = True,
        micro_batch_tokens: int = 16384,
        precision: str = "fp32",
    ) -> None:
        if is_url(export):
            raise ValueError(f"HprefJudge: {export} is an address; a served judge is RemoteJudge({export!r})")
        backend = open_backend(
            export,
            device=device,
            swap=swap,
            micro_batch_tokens=micro_batch_tokens,
            precision=precision,
            who="HprefJudge",
        )
        super().__init__(backend)


class RemoteJudge(_PairwiseJudge):
    """`hpref serve`'s judge as a TRL pairwise judge: each pair one `POST /v1/judge` (sent together,
    retried as the `remote` reward retries). `url` is the server (`http://HOST:PORT`)."""

    def __init__(
        self,
        url: str,
        *,
        token_file: str | None = None,
        swap: bool = True,
        timeout_s: float = 120.0,
        retries: int = 3,
    ) -> None:
        if not is_url(url):
            raise ValueError(f"RemoteJudge: expected the server's http(s)://HOST:PORT address, got {url!r}")
        backend = open_backend(
            url,
            swap=swap,
            token_file=token_file,
            timeout_s=timeout_s,
            retries=retries,
            who="RemoteJudge",
        )
        super().__init__(backend)


class HprefReward:
    """Any hpref export, or `hpref serve` (`url=`), as a `reward_funcs` entry of TRL's `GRPOTrainer`
    (see the module docstring). `__name__` is what TRL logs its values under: `rewards/<name>/mean`."""

    def __init__(
        self,
        export: str | Path | None = None,
        *,
        url: str | None = None,
        token_file: str | None = None,
        device: Any = "auto",
        swap: bool = True,
        micro_batch_tokens: int = 16384,
        precision: str = "fp32",
        name: str | None = None,
    ) -> None:
        if (export is None) == (url is None):
            raise ValueError("HprefReward: give an export folder or url=, exactly one")
        self.backend = open_backend(
            str(url) if url is not None else export,  # type: ignore[arg-type]
            device=device,
            swap=swap,
            token_file=token_file,
            micro_batch_tokens=micro_batch_tokens,
            precision=precision,
            who="HprefReward",
        )
        self.kind = self.backend.kind
        self.__name__ = name or f"hpref_{self.kind}"

    def __call__(self, prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        """One reward per completion, in order: completions grouped by their prompt (GRPO repeats
        each prompt for its group), every group scored in one batch."""
        if len(prompts) != len(completions):
            raise ValueError(f"{self.__name__}: {len(prompts)} prompts but {len(completions)} completions")
        groups: dict[tuple[str, ...], list[int]] = {}
        texts = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            groups.setdefault(prompt_of(prompt, f"prompts[{i}]"), []).append(i)
            texts.append(completion_text(completion, f"completions[{i}]"))
        scores = self.backend.score_groups(
            list(groups), [[texts[i] for i in members] for members in groups.values()]
        )
        rewards = [0.0] * len(completions)
        for members, values in zip(groups.values(), scores, strict=True):
            for i, value in zip(members, values, strict=True):
                rewards[i] = float(value)
        return rewards
