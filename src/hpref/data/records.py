"""The one internal record every reader produces: a battle between two answers to one conversation."""

from __future__ import annotations

from dataclasses import dataclass

#: Label order everywhere in hpref: P(A wins), P(B wins), P(tie) — the Kaggle LMSYS column order.
LABELS = ("winner_model_a", "winner_model_b", "winner_tie")

Probs = tuple[float, float, float]


@dataclass(frozen=True, slots=True)
class Battle:
    """One comparison. `prompt[i]` is the user's i-th turn; `response_a[i]` / `response_b[i]` are the
    two assistants' answers to it (`""` for a missing turn, so the three have equal length).

    `label` is (p_a, p_b, p_tie): one-hot for hard labels, any distribution for soft labels, None
    for unlabeled (test) rows. `truth` is the generating distribution when it is known (the
    synthetic arena), used for the Bayes floor.
    """

    id: str
    prompt: tuple[str, ...]
    response_a: tuple[str, ...]
    response_b: tuple[str, ...]
    label: Probs | None = None
    model_a: str | None = None
    model_b: str | None = None
    truth: Probs | None = None

    def swapped(self) -> Battle:
        """The same battle with A and B exchanged (labels and truth exchanged too)."""

        def swap(p: Probs | None) -> Probs | None:
            return None if p is None else (p[1], p[0], p[2])

        return Battle(
            id=self.id,
            prompt=self.prompt,
            response_a=self.response_b,
            response_b=self.response_a,
            label=swap(self.label),
            model_a=self.model_b,
            model_b=self.model_a,
            truth=swap(self.truth),
        )
