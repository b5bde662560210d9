"""An open weight update's stage (`hpref.rl.engines.staging`): what a sync has sent so far waits in a
temporary file, not in the engine's memory, and comes back bit for bit at the commit."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

from hpref.rl.engines.staging import ALIGN, StagedUpdate, StageHandle  # noqa: E402


def anon_bytes() -> int:
    """This process's anonymous resident memory (what a stage held in memory would add to)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_a_stage_gives_back_every_tensor_bit_for_bit_whatever_its_dtype_or_shape(tmp_path, monkeypatch):
    """Parts of several dtypes (bf16 and fp32 weights, integer and bool buffers, an empty tensor, a
    scalar) staged in two parts, one name sent twice: the commit's views hold exactly the last
    value of each name, with its shape and dtype, each at an aligned offset; the stage's file is
    gone from its folder as soon as it is opened (a killed engine leaves nothing on disk). If this
    fails, a sync would load other values than the trainer sent (a misaligned view, a lost part,
    a stale value of a resent name) or fill the disk with dead engines' stages."""
    monkeypatch.setenv("HPREF_STAGE_DIR", str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    first = {
        "a": torch.randn(3, 5, generator=gen),
        "b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64),
        "resent": torch.zeros(2, 2),
    }
    second = {
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "resent": torch.ones(2, 2),
    }
    stage = StagedUpdate(version=3)
    stage.add(first)
    stage.add(second)
    if sys.platform.startswith("linux"):
        assert os.listdir(tmp_path) == []
    assert stage.version == 3
    meta = stage.meta()
    assert {n: (tuple(t.shape), t.dtype, t.device.type) for n, t in meta.items()} == {
        n: (tuple(t.shape), t.dtype, "meta") for n, t in {**first, **second}.items()
    }
    got = stage.state()
    assert list(got) == ["a", "b", "steps", "resent", "mask", "empty", "scalar"]
    for name, want in {**first, **second}.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name
    assert all(offset % ALIGN == 0 for offset, _, _ in stage.entries.values())
    stage.close()


def test_staged_parts_wait_outside_the_engines_memory(tmp_path, monkeypatch):
    """64 MiB of weights staged: the process's anonymous memory grows by far less than that (the
    parts went to the file), and the commit's mapping reads each back into a tensor of its own that
    it does not keep (so a loader copying tensor by tensor, as both engines do, holds one at a
    time). If this fails, the stage holds the sync in memory again: a second copy of the whole
    model in the engine until the commit (on a GPU engine, in its GPU memory)."""
    monkeypatch.setenv("HPREF_STAGE_DIR", str(tmp_path))
    parts = [{f"w{i}": torch.full((1 << 20,), float(i))} for i in range(16)]  # 16 x 4 MiB
    stage = StagedUpdate(version=1)
    before = anon_bytes()
    for part in parts:
        stage.add(part)
    grown = anon_bytes() - before
    assert grown < 8 << 20, f"staging 64 MiB grew anonymous memory by {grown / 2**20:.1f} MiB"
    state = stage.state()
    for name, tensor in state.items():
        assert torch.equal(tensor, parts[int(name[1:])][name])
    # read into a tensor of its own each time and never kept: dropped, it is gone
    import weakref

    read = state["w3"]
    alive = weakref.ref(read)
    assert torch.equal(read, parts[3]["w3"]) and state["w3"] is not read
    del read
    assert alive() is None
    stage.close()


def _sums_in_another_process(handle) -> dict[str, tuple[str, list[int], float]]:
    """What a vLLM worker process does with a stage's handle: open it, read each tensor."""
    with handle.opened() as state:
        return {n: (str(t.dtype), list(t.shape), float(t.double().sum())) for n, t in state.items()}


def test_another_process_reads_the_stage_through_its_handle_and_nothing_is_left(tmp_path, monkeypatch):
    """The handle (what an RPC to vLLM's tensor-parallel workers carries: a path and the entries, no
    tensors) opens the stage in a spawned process, whose reads give back every tensor; once the
    stage closes, nothing is left. If this fails, a tensor-parallel engine's workers could not load
    a sync, or each would need the whole state serialised again (a model's copy per process)."""
    import json
    import multiprocessing

    monkeypatch.setenv("HPREF_STAGE_DIR", str(tmp_path))
    want = {"w": torch.arange(12.0).reshape(3, 4), "h": torch.ones(5, dtype=torch.bfloat16) / 3}
    stage = StagedUpdate(version=2)
    stage.add(want)
    handle = stage.handle()
    wire = handle.wire()  # what vLLM's RPC (msgpack) carries: strings, ints, lists; no tensor
    assert len(json.dumps(wire)) < 1024 and StageHandle.from_wire(*json.loads(json.dumps(wire))) == handle
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_sums_in_another_process, (handle,))
    assert got == {n: (str(t.dtype), list(t.shape), float(t.double().sum())) for n, t in want.items()}
    stage.close()
    if sys.platform.startswith("linux"):  # the open file's own path: nothing on disk at any time
        assert handle.path.startswith(f"/proc/{os.getpid()}/fd/") and os.listdir(tmp_path) == []
    else:
        assert not os.path.exists(handle.path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's resettable peak RSS")
def test_an_engine_takes_a_bucketed_sync_with_a_bucket_of_memory_not_a_model(tmp_path):
    """`benchmarks.rl_sync_memory` (the README's engine-sync figure) on a config-built Llama of 13
    MiB in 1 MiB buckets, in a fresh process: the sync loads exactly the values sent (the benchmark
    checks every weight) and the engine's peak grows by well under half the weights (measured: 0.15x,
    two buckets; the tree before the stage file: 0.99x, the whole model).
    If this fails, the engine holds a sync's buckets in memory until the commit again, or its
    reader gathers the whole state before the first copy."""
    import json

    from benchmarks import rl_sync_memory

    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig
    from tests.rl.tiny import TINY

    model = {**TINY, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip
    lm, tokenizer = build_policy_model(PolicyModelConfig(**model))
    lm.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    out = tmp_path / "sync.json"
    argv = ["--bucket-mb", "1", "--policy", str(tmp_path / "policy"), "--out", str(out)]
    assert rl_sync_memory.main(argv) == 0
    got = json.loads(out.read_text())
    assert got["weights_mib"] > 8 * got["bucket_mib"], got  # several buckets: a real bucketed sync
    assert got["x_weights"] < 0.5, got
