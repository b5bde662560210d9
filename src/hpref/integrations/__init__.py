"""hpref's judges and reward models inside the RL libraries users already train with.

trl     `HprefJudge` / `RemoteJudge`: a judge export (or `hpref serve` holding one) as a TRL pairwise
        judge (`judge(prompts, completions)`, both orders averaged, the three-way probabilities
        kept), and as `OnlineDPOTrainer`'s reward function (`judge.reward_func()`); `HprefReward`:
        any export (or server) as a `reward_funcs` entry of `GRPOTrainer`, batched, on the trainer's
        device.
verl    `compute_score` / `compute_score_batch`: verl's custom reward function signatures, backed by
        an export loaded once per worker process, or by `hpref serve`.

Both score through `hpref.builtin.scoring.ExportScorer` (an export in this process) or
`hpref.builtin.remote_reward.RemoteReward` (a server), chosen by `backends.open_backend`; data as
TRL and verl users hold it (a `datasets` name or `save_to_disk` folder) is read by hpref's own
readers (`hpref.data.readers`). Nothing here imports TRL or verl: their trainers call these objects.
"""
