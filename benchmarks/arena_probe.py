"""A frozen-MiniLM probe on real arena votes, beside the style baseline (issue #23, NOTES.md).

    .venv/bin/python -m benchmarks.arena_probe [--folds 5] [--scales 0,0.03,0.1,0.3,1]

The 999 LMSYS battles in ../shared, 5 folds by prompt (`ArenaReader`). Per fold: the style features
(`hpref.prediction.baselines.style_features`) and MiniLM's normalised mean-pooled embedding (256 tokens) of
each answer and of the last user turn, as e_A - e_B, the answers' cosine to the prompt (difference
and its absolute value) and to each other; the embedding block is multiplied by each `--scales`
value (0 = the style baseline alone; smaller = a weaker prior on the embeddings under the shared
penalty) and one logistic regression with its penalty cross-validated on the train split
(`fit_select`) is scored on the eval fold. Prints each fold and the mean. ~2 minutes a fold on 2 cores.

    .venv/bin/python -m benchmarks.arena_probe --reward-export DIR [--reward-export DIR2]

instead asks whether a reward model trained on OTHER preference data (an `hpref save` export with
`head = "reward"`, e.g. `minilm-reward` on HH-RLHF) transfers: its zero-shot score difference
s_A - s_B (log P(A)/P(B) under its Davidson tie model) and |s_A - s_B| per battle, alone and beside
the style features, in the same cross-validated logistic regression.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "lmsys-arena-kaggle-sample-a.csv.gz"
L2S = (1e-2, 1e-1, 1.0, 10.0, 100.0)


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from hpref.data.readers import ArenaConfig, ArenaReader
    from hpref.models.hf import minilm_path
    from hpref.prediction.baselines import fit_select, labels_of, predict_logistic, style_features
    from hpref.prediction.metrics import log_loss

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folds", type=int, default=5, help="how many of the 5 folds to score")
    parser.add_argument("--scales", default="0,0.03,0.1,0.3,1")
    parser.add_argument("--reward-export", action="append", default=[], help="transfer probe (see above)")
    args = parser.parse_args(argv)
    if not DATA.is_file():
        raise SystemExit(f"needs {DATA}")
    if args.reward_export:
        return reward_transfer(args.reward_export, args.folds)
    scales = [float(s) for s in args.scales.split(",")]
    folder = minilm_path()
    tokenizer, encoder = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()

    def embed(texts: list[str]) -> np.ndarray:
        out = []
        for i in range(0, len(texts), 16):
            batch = tokenizer(
                texts[i : i + 16], truncation=True, max_length=256, padding=True, return_tensors="pt"
            )
            with torch.no_grad():
                hidden = encoder(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            out.append(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
        return torch.cat(out).numpy()

    def embedding_features(battles: list) -> np.ndarray:
        ea = embed(["\n".join(b.response_a)[:2000] for b in battles])
        eb = embed(["\n".join(b.response_b)[:2000] for b in battles])
        eq = embed([b.prompt[-1][:1000] for b in battles])
        sa, sb = (ea * eq).sum(1, keepdims=True), (eb * eq).sum(1, keepdims=True)
        return np.concatenate([ea - eb, sa - sb, np.abs(sa - sb), (ea * eb).sum(1, keepdims=True)], axis=1)

    results: dict[float, list[float]] = {s: [] for s in scales}
    for k in range(args.folds):
        train, evaluation = (
            list(ArenaReader(ArenaConfig(path=str(DATA), folds=5, fold=k, split=s), 0).battles())
            for s in ("train", "eval")
        )
        y_train, y_eval = labels_of(train), labels_of(evaluation)
        blocks = []
        for features in (style_features, embedding_features):
            x_train, x_eval = features(train), features(evaluation)
            centre, spread = x_train.mean(0), x_train.std(0) + 1e-9
            blocks.append(((x_train - centre) / spread, (x_eval - centre) / spread))
        (s_train, s_eval), (e_train, e_eval) = blocks
        for scale in scales:
            w = fit_select(np.concatenate([s_train, scale * e_train], 1), y_train, L2S)
            results[scale].append(
                log_loss(predict_logistic(w, np.concatenate([s_eval, scale * e_eval], 1)), y_eval)
            )
        print(f"fold {k}: " + ", ".join(f"scale {s}: {results[s][-1]:.4f}" for s in scales), flush=True)
    print("mean: " + ", ".join(f"scale {s}: {np.mean(v):.4f}" for s, v in results.items()))
    return 0


def reward_transfer(exports: list[str], folds: int) -> int:
    """Style alone, the exports' scores alone, and both, per fold (see the module docstring)."""
    from hpref.builtin.rewards import JudgeConfig, JudgeReward
    from hpref.data.readers import ArenaConfig, ArenaReader
    from hpref.prediction.baselines import fit_select, labels_of, predict_logistic, style_features
    from hpref.prediction.metrics import log_loss

    battles = list(ArenaReader(ArenaConfig(path=str(DATA)), 0).battles())
    scores: dict[str, list[float]] = {b.id: [] for b in battles}
    for export in exports:
        judge = JudgeReward(JudgeConfig(path=export, max_length=512, micro_batch_tokens=8192))
        if not judge.scalar:
            raise SystemExit(f"{export}: not a reward-model export (head = 'reward')")
        for b, (p_a, p_b, _tie) in zip(battles, judge.judge_pairs(battles), strict=True):
            margin = float(np.log(p_a) - np.log(p_b))  # s_A - s_B
            scores[b.id] += [margin, abs(margin)]

    def standardised(features, train, evaluation):
        x_train, x_eval = features(train), features(evaluation)
        centre, spread = x_train.mean(0), x_train.std(0) + 1e-9
        return (x_train - centre) / spread, (x_eval - centre) / spread

    def reward(bs: list) -> np.ndarray:
        return np.array([scores[b.id] for b in bs])

    def both(bs: list) -> np.ndarray:
        return np.concatenate([style_features(bs), reward(bs)], 1)

    results: dict[str, list[float]] = {"style": [], "reward": [], "style + reward": []}
    for k in range(folds):
        train, evaluation = (
            list(ArenaReader(ArenaConfig(path=str(DATA), folds=5, fold=k, split=s), 0).battles())
            for s in ("train", "eval")
        )
        for name, features in zip(results, (style_features, reward, both), strict=True):
            x_train, x_eval = standardised(features, train, evaluation)
            w = fit_select(x_train, labels_of(train), L2S)
            results[name].append(log_loss(predict_logistic(w, x_eval), labels_of(evaluation)))
        print(f"fold {k}: " + ", ".join(f"{n}: {v[-1]:.4f}" for n, v in results.items()), flush=True)
    print("mean: " + ", ".join(f"{n}: {np.mean(v):.4f}" for n, v in results.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
