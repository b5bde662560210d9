"""An `hpref save` export loaded for scoring: the one owner of judging pairs of answers and scoring
answers with an exported model, for `hpref rl`'s `judge` reward and for `hpref serve`.

Work is described as `ScoringJob`s (the battles a question needs and how their logits answer it)
and run together: `ExportScorer.run` formats every job's battles with the export's formatter, packs
them as `hpref eval` does (`hpref.prediction.predict.packed_logits`: the eval planner, longest first
under a token budget, no padding) and hands each job its rows of logits. The `judge` reward runs one
job per call; `hpref serve` runs the jobs of every request Ray Serve gathered into one batch, so
concurrent requests share packed forward passes.

Two kinds of export answer the same questions:

judge   (`head = "judge"`) one sequence per battle, 3 logits (A / B / tie). A pair judged in both
        orders and averaged (`swap`) cancels the judge's position bias; the score of an answer among
        others is its mean win probability (+ half the tie probability) against them.
reward  (`head = "reward"`) each answer with its conversation is its own sequence, two per battle;
        the logits are Davidson's [s_A, s_B, log nu + (s_A + s_B) / 2], so P(A), P(B), P(tie) of a
        pair come from the tie model the export was trained with, and an answer's score is its s.
        Swapping A and B permutes the probabilities exactly (the two sequences are scored alone), so
        a swap is never computed.

torch is imported only when a scorer is loaded: `hpref --help` and `hpref rl`'s recipe checks read
this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpref.data.prompts import battle_with_answers
from hpref.data.records import Battle
from hpref.exports.layout import export_problem, export_settings
from hpref.protocols import Formatter, PreferenceModel

Prompt = tuple[str, ...]
#: a judge's default formatter when the export does not name one (a reward model always uses "answers")
DEFAULT_JUDGE_FORMATTER = "pab"


def softmax(row: Sequence[float]) -> tuple[float, ...]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    total = sum(exps)
    return tuple(x / total for x in exps)


def win_probability(probs: tuple[float, ...]) -> float:
    """P(the answer shown first wins) + half P(tie): an expected score in [0, 1]."""
    return probs[0] + 0.5 * probs[2]


def pairwise_rewards(n: int, win_prob: Callable[[int, int], float], total: int | None = None) -> list[float]:
    """Reward of each of the first `n` answers: its mean `win_prob(i, j)` over every other answer `j`.

    Answers `n .. total - 1` are opponents (other policies' answers, or a reference answer): they are
    judged against but get no reward. `win_prob(i, j)` is P(i beats j) + half P(tie). With nobody
    to beat the reward is 0.5.
    """
    total = n if total is None else total
    if total == 1:
        return [0.5] * n
    return [sum(win_prob(i, j) for j in range(total) if j != i) / (total - 1) for i in range(n)]


@dataclass
class ScoringJob:
    """The battles one question needs and `finish`, which turns their logits (one row of 3 per
    battle, in order) into the answer."""

    battles: list[Battle]
    finish: Callable[[list[list[float]]], Any]


class ExportScorer:
    """A loaded export, its formatter and a token budget per packed forward pass."""

    def __init__(
        self,
        model: PreferenceModel,
        formatter: Formatter,
        *,
        micro_batch_tokens: int,
        settings: dict[str, Any],
        compute_dtype: Any = None,
    ):
        self.model = model
        #: the backbone's autocast dtype (None: the weights' own, fp32); the head always runs in fp32
        self.compute_dtype = compute_dtype
        self.formatter = formatter
        self.micro_batch_tokens = micro_batch_tokens
        self.settings = settings
        #: a scalar reward model: each answer scored alone (two sequences per battle)
        self.paired = model.paired
        self.kind = "reward" if self.paired else "judge"
        #: where the packed forward passes run (`to`): the CPU, or a trainer's device (TRL, verl)
        self.device: Any = "cpu"

    def to(self, device: Any) -> ExportScorer:
        """The model moved to `device` (a torch.device or its name); the scorer packs its batches there."""
        import torch

        self.device = torch.device(device)
        self.model.to(self.device)
        return self

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        formatter: str | None = None,
        max_length: int | None = None,
        micro_batch_tokens: int = 16384,
        precision: str = "fp32",
    ) -> ExportScorer:
        """The export at `path` on the CPU, in eval mode. `formatter` and `max_length` default to what
        the export was trained with (`hpref_checkpoint.json`), else 'pab' and 512; a reward model
        always reads its answers with the 'answers' formatter. `precision` ("fp32", "bf16" or "auto",
        `hpref.models.precision.resolve_precision`: on a CPU the one measured faster) is the
        backbone's compute dtype; the weights stay fp32 and the head computes in fp32."""
        from hpref.errors import UserError
        from hpref.models import PreferenceModel
        from hpref.plugins import load_plugins

        problem = export_problem(path)
        if problem:
            raise UserError(problem)
        settings = export_settings(path)
        model = PreferenceModel.from_pretrained(str(Path(path).expanduser())).eval()
        name = (
            "answers" if model.paired else formatter or settings.get("formatter") or DEFAULT_JUDGE_FORMATTER
        )
        length = int(max_length or settings.get("max_length") or 512)
        component = load_plugins().get("formatter", name)
        built = component.build(component.config(), model.tokenizer, length)
        import torch

        from hpref.models.precision import ProbeShape, resolve_precision

        dtype = resolve_precision(precision, torch.device("cpu"), ProbeShape.of(model.backbone_config))
        return cls(
            model,
            built,
            micro_batch_tokens=micro_batch_tokens,
            settings=settings,
            compute_dtype=None if dtype == torch.float32 else dtype,
        )

    # ------------------------------------------------------------------------------------ running
    def logits(self, battles: Sequence[Battle]) -> list[list[float]]:
        """The model's 3 logits per battle, formatted and packed into micro-batches.

        Each distinct sequence is scored once: a judge's battles that format alike (GRPO groups
        repeat answers), and a reward model's sequences, which are scored alone and so can be paired
        with any other sequence, of any battle; its battles' logits are then rebuilt from the
        scores with the model's own tie term (`davidson_logits`).
        """
        from hpref.data.formatting import encode_battles

        encoded = encode_battles(self.formatter, battles)
        if not self.paired:
            unique: dict[tuple[int, ...], int] = {}
            rows = [unique.setdefault(tuple(e.ids), len(unique)) for e in encoded]
            scored = self._packed([(list(ids), 0) for ids in unique])
            return [scored[r] for r in rows]
        sequences: dict[tuple[int, ...], int] = {}
        sides = [
            (
                sequences.setdefault(tuple(e.ids[: e.split]), len(sequences)),
                sequences.setdefault(tuple(e.ids[e.split :]), len(sequences)),
            )
            for e in encoded
        ]
        order = list(sequences)
        if len(order) % 2:
            order.append(order[-1])  # the odd one out with itself
        pairs = self._packed(
            [(list(order[k]) + list(order[k + 1]), len(order[k])) for k in range(0, len(order), 2)]
        )
        scores = [pairs[k // 2][k % 2] for k in range(len(sequences))]
        return self._davidson([(scores[a], scores[b]) for a, b in sides])

    def _packed(self, examples: list[tuple[list[int], int]]) -> list[list[float]]:
        """Logits of (ids, split) examples, packed as `hpref eval` packs."""
        from hpref.data.packing import TokenizedExample
        from hpref.prediction.predict import packed_logits

        tokenized = [
            TokenizedExample(ids=ids, label=None, row=i, split=split)
            for i, (ids, split) in enumerate(examples)
        ]
        import contextlib

        import torch

        autocast = (
            torch.autocast(torch.device(self.device).type, dtype=self.compute_dtype)
            if self.compute_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            logits = packed_logits(
                self.model, tokenized, micro_batch_tokens=self.micro_batch_tokens, device=self.device
            )
        return logits.tolist()

    def _davidson(self, pairs: list[tuple[float, float]]) -> list[list[float]]:
        """A reward model's 3 logits of each (s_A, s_B), as its head computes them."""
        import torch

        from hpref.models.heads import davidson_logits

        if not pairs:
            return []
        log_tie = self.model.head.log_tie.detach().float().cpu()
        return davidson_logits(torch.tensor(pairs, dtype=torch.float32).reshape(-1), log_tie).tolist()

    def run(self, jobs: Sequence[ScoringJob]) -> list[Any]:
        """Every job's answer, all their battles scored in one packed pass."""
        battles = [b for job in jobs for b in job.battles]
        rows = self.logits(battles)
        out, start = [], 0
        for job in jobs:
            out.append(job.finish(rows[start : start + len(job.battles)]))
            start += len(job.battles)
        return out

    # ------------------------------------------------------------------------------------ questions
    def judge_pairs(self, battles: list[Battle]) -> list[tuple[float, float, float]]:
        """(p_a, p_b, p_tie) of each battle as given (one order)."""
        return [softmax(row) for row in self.logits(battles)]  # type: ignore[misc]

    def judge_job(self, prompt: Prompt, answer_a: str, answer_b: str, *, swap: bool) -> ScoringJob:
        """(p_a, p_b, p_tie) of one pair; with `swap` a judge also reads B first and the two orders
        are averaged (for a reward model the swap changes nothing and is skipped)."""
        battles = [battle_with_answers(prompt, answer_a, answer_b, "ab")]
        if swap and not self.paired:
            battles.append(battle_with_answers(prompt, answer_b, answer_a, "ba"))

        def finish(rows: list[list[float]]) -> tuple[float, float, float]:
            views = [softmax(rows[0])]
            if len(rows) > 1:
                p_b, p_a, p_tie = softmax(rows[1])  # B was shown first: map back (`predict.unswap`)
                views.append((p_a, p_b, p_tie))
            return tuple(sum(v[k] for v in views) / len(views) for k in range(3))  # type: ignore[return-value]

        return ScoringJob(battles, finish)

    def score_job(
        self,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None = None,
        *,
        symmetric: bool = True,
    ) -> ScoringJob:
        """One score per answer of each group (see the module docstring): a reward model's score of
        the answer alone; a judge's mean win probability (+ half tie) against the other answers of
        its group and `opponents[g]` (judged against, never scored, never among themselves)."""
        if self.paired:
            return self._reward_scores(prompts, groups)
        battles, index = [], {}
        for g, (prompt, answers) in enumerate(zip(prompts, groups, strict=True)):
            everyone = [*answers, *(opponents[g] if opponents else ())]
            n = len(answers)
            for i in range(len(everyone)):
                for j in range(len(everyone)):
                    if i == j or (i >= n and j >= n):
                        continue
                    # one order of a pair is enough when asymmetric; a group answer goes first
                    if not symmetric and (j < i if (i < n and j < n) else i >= n):
                        continue
                    index[(g, i, j)] = len(battles)
                    battles.append(
                        battle_with_answers(tuple(prompt), everyone[i], everyone[j], f"{g}-{i}-{j}")
                    )

        def finish(rows: list[list[float]]) -> list[list[float]]:
            probs = [softmax(row) for row in rows]
            out = []
            for g, answers in enumerate(groups):
                total = len(answers) + (len(opponents[g]) if opponents else 0)

                def win(i: int, j: int, g: int = g) -> float:
                    both = []
                    if (g, i, j) in index:
                        both.append(win_probability(probs[index[(g, i, j)]]))
                    if (g, j, i) in index:  # i shown second: P(B) + half tie
                        p_a, p_b, p_tie = probs[index[(g, j, i)]]
                        both.append(win_probability((p_b, p_a, p_tie)))
                    return sum(both) / len(both)

                out.append(pairwise_rewards(len(answers), win, total))
            return out

        return ScoringJob(battles, finish)

    def _reward_scores(self, prompts: Sequence[Prompt], groups: Sequence[Sequence[str]]) -> ScoringJob:
        """A reward model's score of each answer with its conversation: one battle per answer, the
        answer on both sides (`logits` scores that sequence once), its first logit the score."""
        battles = [
            battle_with_answers(tuple(prompt), answer, answer, f"{g}-{k}")
            for g, (prompt, answers) in enumerate(zip(prompts, groups, strict=True))
            for k, answer in enumerate(answers)
        ]

        def finish(rows: list[list[float]]) -> list[list[float]]:
            scores = iter(row[0] for row in rows)
            return [[next(scores) for _ in answers] for answers in groups]

        return ScoringJob(battles, finish)

    def score_groups(
        self,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None = None,
        *,
        symmetric: bool = True,
    ) -> list[list[float]]:
        return self.run([self.score_job(prompts, groups, opponents, symmetric=symmetric)])[0]
