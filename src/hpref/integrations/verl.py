"""hpref exports as verl's custom reward function.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)` per
response (its `naive` reward manager) or `compute_score_batch(data_sources, solution_strs,
ground_truths, extra_infos, **reward_kwargs)` per batch (its `batch` manager); `reward_kwargs` come
from the config (`reward.custom_reward_function.reward_kwargs`):

    export       an `hpref save` folder, loaded once per worker process (on `device`, default CPU:
                 verl's reward workers hold no GPU of their own) and kept for every later call
    url          or `hpref serve`'s address (http://HOST:PORT) with `token_file`
    prompt_key   where the prompt is: verl hands a reward function the response, not the prompt, so
                 the prompt must travel in `extra_info` (verl's own preprocessing scripts put the
                 question there); a string or chat messages. Default "question".

A reward model's score is its scalar score of the response to the prompt. A judge compares: the
score is the response's win probability (+ half tie) against the reference answer, `ground_truth`
(which must then be a string), both orders averaged, as `hpref serve`'s `/remote_rm` scores it.
The batched variant scores the whole batch in one packed pass (or one set of parallel requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpref.integrations.backends import Backend, completion_text, open_backend, prompt_of

#: one backend per (export or url, settings) in this process: verl calls the function per response
_BACKENDS: dict[tuple[Any, ...], Backend] = {}


def backend_for(
    export: str | None = None,
    url: str | None = None,
    token_file: str | None = None,
    device: str = "cpu",
    micro_batch_tokens: int = 16384,
) -> Backend:
    """The process's backend for these settings, opened on first use."""
    if (export is None) == (url is None):
        raise ValueError(
            "hpref verl reward: set exactly one of reward_kwargs.export (an hpref save folder) or "
            "reward_kwargs.url (an hpref serve address)"
        )
    key = (export, url, token_file, str(device), micro_batch_tokens)
    if key not in _BACKENDS:
        _BACKENDS[key] = open_backend(
            str(url or export),
            device=device,
            token_file=token_file,
            micro_batch_tokens=micro_batch_tokens,
            who="hpref verl reward",
        )
    return _BACKENDS[key]


def compute_score(
    data_source: Any,
    solution_str: str,
    ground_truth: Any = None,
    extra_info: dict[str, Any] | None = None,
    *,
    export: str | None = None,
    url: str | None = None,
    token_file: str | None = None,
    prompt_key: str = "question",
    device: str = "cpu",
    micro_batch_tokens: int = 16384,
    **_: Any,
) -> float:
    """verl's per-response custom reward (see the module docstring)."""
    return compute_score_batch(
        [data_source],
        [solution_str],
        [ground_truth],
        [extra_info],
        export=export,
        url=url,
        token_file=token_file,
        prompt_key=prompt_key,
        device=device,
        micro_batch_tokens=micro_batch_tokens,
    )[0]


def compute_score_batch(
    data_sources: Sequence[Any],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict[str, Any] | None],
    *,
    export: str | None = None,
    url: str | None = None,
    token_file: str | None = None,
    prompt_key: str = "question",
    device: str = "cpu",
    micro_batch_tokens: int = 16384,
    **_: Any,
) -> list[float]:
    """verl's batched custom reward (`reward_manager.name=batch`): one score per response."""
    backend = backend_for(export, url, token_file, device, micro_batch_tokens)
    prompts = []
    for i, info in enumerate(extra_infos):
        if not isinstance(info, dict) or prompt_key not in info:
            raise ValueError(
                f"extra_infos[{i}]: no '{prompt_key}' (the prompt the response answers; verl passes "
                "the reward function no prompt, so put it in extra_info when preparing the data, or "
                "set reward_kwargs.prompt_key)"
            )
        prompts.append(prompt_of(info[prompt_key], f"extra_infos[{i}].{prompt_key}"))
    answers = [[completion_text(s, f"solution_strs[{i}]")] for i, s in enumerate(solution_strs)]
    references = None
    if backend.kind == "judge":
        for i, truth in enumerate(ground_truths):
            if not isinstance(truth, str) or not truth.strip():
                raise ValueError(
                    f"ground_truths[{i}]: a judge export scores a response against the reference "
                    f"answer, which must be text; got {type(truth).__name__}"
                )
        references = [[truth] for truth in ground_truths]
    scores = backend.score_groups(prompts, answers, references)
    return [float(group[0]) for group in scores]
