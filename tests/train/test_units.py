"""Small pure pieces of the engine, no processes."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")


class ToyModel(torch.nn.Module):
    """Mean-pooled embeddings per packed sequence -> 3 logits (the PreferenceModel call shape)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(50, 8, generator=gen))
        self.out = torch.nn.Linear(8, 3)
        with torch.no_grad():
            self.out.weight.copy_(torch.randn(3, 8, generator=gen))
            self.out.bias.zero_()

    def forward(self, input_ids, cu_seqlens, position_ids, max_seqlen=None):
        seg = torch.repeat_interleave(
            torch.arange(len(cu_seqlens) - 1), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        )
        sums = torch.zeros(len(cu_seqlens) - 1, 8).index_add_(0, seg, self.emb[input_ids])
        counts = (cu_seqlens[1:] - cu_seqlens[:-1]).float()[:, None]
        return self.out(sums / counts)


def _examples():
    from hpref.data.packing import TokenizedExample

    gen = torch.Generator().manual_seed(1)
    labels = [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.2, 0.5, 0.3)]
    return [
        TokenizedExample(ids=torch.randint(0, 50, (n,), generator=gen).tolist(), label=lab, row=i)
        for i, (n, lab) in enumerate(zip((3, 7, 2, 5), labels, strict=True))
    ]


def _step(split):
    from hpref.data.packing import collate, filler
    from hpref.train.loop import train_step

    model = ToyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    examples = _examples()
    batches = [collate([examples[i] if i >= 0 else filler() for i in mb]) for mb in split]
    loss_sum, _ = train_step(
        model, opt, batches, step_sequences=4, world_size=1, grad_clip=None, device=torch.device("cpu")
    )
    return loss_sum, model


def test_loss_weighting_is_the_step_mean_whatever_the_packing():
    """One micro-batch of 4, or 3 uneven micro-batches plus a filler, sum to the same step loss. If
    not, fillers are counted or a sequence is lost between micro-batches."""
    from hpref.data.packing import collate
    from hpref.models.loss import soft_cross_entropy

    whole, _ = _step([(0, 1, 2, 3)])
    split, _ = _step([(3,), (0, 2), (1, -1)])
    assert float(whole) == pytest.approx(float(split), rel=1e-6)
    batch = collate(_examples())
    expected = soft_cross_entropy(
        ToyModel()(batch.input_ids, batch.cu_seqlens, batch.position_ids), batch.labels
    )
    assert float(whole) == pytest.approx(float(expected.detach().sum()), rel=1e-6)


def test_gradients_match_between_packings():
    """The gradient of the step equals the mean-loss gradient: if not, micro-batches are weighted
    by count instead of by sequences (a short micro-batch would weigh as much as a long one)."""
    from hpref.data.packing import collate, filler
    from hpref.models.loss import soft_cross_entropy

    def grads(split):
        model = ToyModel()
        examples = _examples()
        for mb in split:
            batch = collate([examples[i] if i >= 0 else filler() for i in mb])
            ce = soft_cross_entropy(
                model(batch.input_ids, batch.cu_seqlens, batch.position_ids), batch.labels
            )
            (ce * batch.weights).sum().div(4).backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads([(0, 1, 2, 3)]), grads([(3,), (0, 2), (1, -1)]), strict=True):
        torch.testing.assert_close(a, b)


def test_soft_cross_entropy_matches_torch_for_hard_and_soft_labels():
    from hpref.models.loss import soft_cross_entropy

    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    labels = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    expected = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(soft_cross_entropy(logits, labels), expected)


def test_eval_metrics():
    """The trainer's eval scores with the one metrics module (`hpref.prediction.metrics`)."""
    import numpy as np

    from hpref.prediction import metrics

    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    labels = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    log_loss, accuracy = metrics.log_loss(probs, labels), metrics.accuracy(probs, labels)
    assert log_loss == pytest.approx(-(np.log(0.7) + np.log(0.1)) / 2)
    assert accuracy == 0.5


def _fake_checkpoint(folder, complete=True):
    folder.mkdir(parents=True)
    if complete:
        (folder / ".metadata").write_bytes(b"x")
        (folder / "train_state.json").write_text(json.dumps({"step": 1}))


def test_partial_checkpoints_are_ignored_with_a_warning(tmp_path, caplog):
    """Resume must pick the newest *complete* checkpoint: a `.tmp-*` folder, a step folder without
    DCP metadata and a `latest` pointer naming either are all distrusted, and each is reported."""
    from loguru import logger

    from hpref.train.checkpoint import find_latest, resolve_resume

    root = tmp_path / "checkpoints"
    _fake_checkpoint(root / "step-000002")
    _fake_checkpoint(root / "step-000004")
    _fake_checkpoint(root / ".tmp-step-000006", complete=False)
    _fake_checkpoint(root / "step-000008", complete=False)
    (root / "latest").write_text("step-000008")
    messages: list[str] = []
    handler = logger.add(lambda m: messages.append(str(m)), level="WARNING", format="{message}")
    try:
        assert find_latest(tmp_path) == root / "step-000004"
    finally:
        logger.remove(handler)
    text = "".join(messages)
    assert ".tmp-step-000006" in text and "step-000008" in text
    assert resolve_resume(tmp_path, None) is None
    assert resolve_resume(tmp_path, "auto") == root / "step-000004"
    assert resolve_resume(tmp_path, tmp_path) == root / "step-000004"  # a run folder
    from hpref.errors import UserError

    with pytest.raises(UserError, match="not a complete checkpoint"):
        resolve_resume(tmp_path, root / ".tmp-step-000006")


def test_rng_state_round_trips_through_json():
    import random

    import numpy as np

    from hpref.train.checkpoint import rng_state, set_rng_state

    state = json.loads(json.dumps(rng_state()))
    expected = (torch.rand(3), random.random(), np.random.rand())
    set_rng_state(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    torch.testing.assert_close(expected[0], again[0])
    assert expected[1:] == again[1:]


def test_optimizer_groups_give_the_head_its_own_lr():
    from hpref.builtin.optimizers import AdamWConfig, build_adamw

    class WithHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 3)

    opt = build_adamw(AdamWConfig(lr=1e-4, head_lr=1e-3, weight_decay=0.1), WithHead())
    by_lr = {(g["lr"], g["weight_decay"]): sum(p.numel() for p in g["params"]) for g in opt.param_groups}
    assert by_lr == {(1e-4, 0.1): 16, (1e-4, 0.0): 4, (1e-3, 0.1): 12, (1e-3, 0.0): 3}


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_checkpoint_metadata_refuses_arbitrary_pickle(tmp_path):
    """DCP's `.metadata` is a pickle: ours admits only checkpoint metadata. If this fails, resuming
    from a tampered run folder could run arbitrary code."""
    import pickle

    from hpref.runfolder.safe_load import dcp_reader
    from hpref.train.checkpoint import UnsafeCheckpointError

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system"):
        dcp_reader(tmp_path).read_metadata()


def test_checkpoint_metadata_of_a_real_save_is_admitted(tmp_path):
    """The allow-list must cover everything DCP itself writes (tensors, bytes, sizes, dtypes)."""
    import torch.distributed.checkpoint as dcp

    from hpref.runfolder.safe_load import dcp_load, dcp_reader

    state = {"w": torch.randn(3, 2), "step": 3, "nested": {"b": torch.zeros(2, dtype=torch.bfloat16)}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = dcp_reader(tmp_path).read_metadata()
    assert {"w", "step", "nested.b"} <= set(metadata.state_dict_metadata)
    target = {"w": torch.empty(3, 2), "step": 0, "nested": {"b": torch.empty(2, dtype=torch.bfloat16)}}
    dcp_load(target, tmp_path, no_dist=True)
    torch.testing.assert_close(target["w"], state["w"])
    assert target["step"] == 3


def test_cpu_peak_is_stated_and_deterministic():
    """MFU needs a peak that does not depend on the neighbours' load: the CPU one is computed from
    the core's FLOP/cycle, the clock and this rank's threads, and says so."""
    from hpref.runtime.peak import cpu_peak

    a, b = cpu_peak(torch.float32), cpu_peak(torch.float32)
    assert a == b and a.flops > 0
    assert "thread(s)" in str(a)


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    """ENOSPC while DCP writes a shard: one line naming the checkpoint, the rank and the OS error
    (DCP's own `CheckpointException` is a BaseException, multi-line, that the worker's `except
    Exception` let through as two tracebacks), and nothing is left that a resume would trust."""
    import builtins
    import errno
    import io

    from hpref.train.checkpoint import resolve_resume, save_checkpoint

    model = ToyModel()
    real_open = builtins.open

    def full_disk(file, mode="r", *args, **kwargs):
        if str(file).endswith(".distcp") and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk)
    monkeypatch.setattr(io, "open", full_disk)  # pathlib's Path.open, which DCP's writer uses
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(RuntimeError) as info:
        save_checkpoint(tmp_path, 7, model=model, optimizer=optimizer, train_state={"epoch": 0}, keep=1)
    message = str(info.value)
    assert "\n" not in message and "step-000007 not written: rank 0: OSError" in message, message
    assert "No space left on device" in message
    assert resolve_resume(tmp_path, "auto") is None
    assert not list((tmp_path / "checkpoints").glob("step-*"))


def test_the_launcher_names_the_killed_rank_not_the_peer_that_lost_it():
    """Rank 1 SIGKILLed (OOM killer, kill -9) and rank 0's gloo error saying its peer went away, in
    the same second: the run's failure is rank 1's. A rank with an error of its own still comes
    before a rank torchrun stopped afterwards. Wrong: the console names rank 0 and its log."""
    from types import SimpleNamespace as Failure

    from hpref.runtime.torchrun import _first_real_failure

    killed = Failure(exitcode=-9, message="Signal 9 (SIGKILL) received by PID 1", timestamp=100)
    peer = Failure(exitcode=1, message="RuntimeError: gloo: Connection reset by peer", timestamp=100)
    assert _first_real_failure(Failure(failures={0: peer, 1: killed}))[0] == 1
    own = Failure(exitcode=1, message="ValueError: loss is nan", timestamp=101)
    stopped = Failure(exitcode=-15, message="Signal 15 (SIGTERM)", timestamp=100)
    assert _first_real_failure(Failure(failures={0: stopped, 1: own}))[0] == 1
