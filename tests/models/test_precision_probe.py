"""`precision = "auto"` on a CPU: measured on the model's shape, cached, logged, shown by `hpref doctor`.

The probe's timings are injected (`probe_timings` replaced), so the decisions here never depend on
this machine's load; one test runs the real probe on a tiny shape for its form only.
"""

from __future__ import annotations

import json

import pytest
import torch

from hpref.models import precision

CPU = torch.device("cpu")
MINILM = precision.ProbeShape(384, 1536, 12)


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """A CPU with bf16 instructions, no pin, a fresh cache, and a probe that returns `timings`
    (fp32 s, bf16 s) and counts its calls."""
    monkeypatch.delenv(precision.PIN_ENV, raising=False)
    monkeypatch.setenv("HPREF_CACHE", str(tmp_path))
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    state = {"timings": (1.0, 0.5), "calls": []}

    def fake(shape):
        state["calls"].append(shape)
        return state["timings"]

    monkeypatch.setattr(precision, "probe_timings", fake)
    return state


def test_auto_takes_the_precision_measured_faster(probe, log_messages):
    """bf16 when the probe measured it faster, fp32 when fp32 was (a different shape, so a second
    probe), both logged with their timings. Wrong if `auto` still guessed from CPU flags (the same
    answer both ways) or hid what it measured."""
    assert precision.resolve_precision("auto", CPU, MINILM) == torch.bfloat16
    probe["timings"] = (0.4, 0.6)  # bf16 slower: the Xeon without AMX of issue #51
    smollm2 = precision.ProbeShape(576, 1536, 9)
    assert precision.resolve_precision("auto", CPU, smollm2) == torch.float32
    assert probe["calls"] == [MINILM, smollm2]
    logged = [m for m in log_messages if "precision auto" in m]
    assert "bf16 (measured: fp32 1000.0 ms, bf16 500.0 ms" in logged[0], logged
    assert "fp32 (measured: fp32 400.0 ms, bf16 600.0 ms" in logged[1], logged
    # within BF16_MARGIN of fp32 is noise: fp32 keeps its precision
    probe["timings"] = (1.0, 0.97)
    assert precision.resolve_precision("auto", CPU, precision.ProbeShape(512, 2048, 8)) == torch.float32


def test_the_probe_is_cached_per_machine_torch_build_and_shape(probe, monkeypatch, tmp_path):
    """A second resolve of the same shape reads the cache file (no second probe, even when the
    probe would now answer differently); another shape or another torch build probes again.
    Wrong if every trainer, engine and rank re-measured, or a new torch kept an old decision."""
    assert precision.resolve_precision("auto", CPU, MINILM) == torch.bfloat16
    probe["timings"] = (0.1, 9.9)
    assert precision.resolve_precision("auto", CPU, MINILM) == torch.bfloat16  # cached, not re-probed
    assert probe["calls"] == [MINILM]
    stored = json.loads((tmp_path / precision.CACHE_FILE).read_text())
    [(key, entry)] = stored["probes"].items()
    assert key.endswith("|384x1536x12") and f"torch {torch.__version__}" in key
    assert entry["dtype"] == "bf16" and (entry["fp32_s"], entry["bf16_s"]) == (1.0, 0.5)

    wider = precision.ProbeShape(384, 3072, 12)
    assert precision.resolve_precision("auto", CPU, wider) == torch.float32  # new shape, new probe
    monkeypatch.setattr(torch, "__version__", "99.0.0+cpu")
    assert precision.resolve_precision("auto", CPU, MINILM) == torch.float32  # new build, new probe
    assert probe["calls"] == [MINILM, wider, MINILM]


def test_known_answers_and_explicit_settings_never_probe(probe, monkeypatch):
    """fp32 / bf16 are obeyed; a model narrower than 256, a CPU without bf16 instructions, CUDA and
    the pin decide without a probe. Wrong if an explicit setting were second-guessed or the
    suite's pin were ignored (a test's precision would then hang on a timing)."""
    assert precision.resolve_precision("fp32", CPU, MINILM) == torch.float32
    assert precision.resolve_precision("bf16", CPU, precision.ProbeShape(64, 256, 4)) == torch.bfloat16
    assert precision.resolve_precision("auto", CPU, precision.ProbeShape(128, 512, 4)) == torch.float32
    assert precision.resolve_precision("auto", CPU, None) == torch.float32
    monkeypatch.setenv(precision.PIN_ENV, "fp32")
    assert precision.resolve_precision("auto", CPU, MINILM) == torch.float32
    monkeypatch.setenv(precision.PIN_ENV, "bf16")
    assert precision.resolve_precision("auto", CPU, MINILM) == torch.bfloat16
    monkeypatch.delenv(precision.PIN_ENV)
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    assert precision.resolve_precision("auto", CPU, MINILM) == torch.float32
    assert probe["calls"] == []


def test_doctor_shows_the_decision_and_both_timings(probe):
    """`hpref doctor`'s rows: each shipped shape's decision with both timings (measured once, then
    cached), and a shape a run measured here. Wrong if the doctor showed only CPU flags, the
    guess that issue #51 found wrong."""
    from hpref.check.doctor import torch_rows

    precision.resolve_precision("auto", CPU, precision.ProbeShape(1024, 4096, 16))
    probe["timings"] = (0.3, 0.2)
    rows = torch_rows()
    minilm = rows["auto precision, MiniLM-L6 (minilm-reward)"]
    assert minilm.startswith("bf16 (measured: fp32 300.0 ms, bf16 200.0 ms"), minilm
    assert minilm.endswith("hidden 384, MLP 1536, 12 heads")
    assert rows["auto precision, hidden 1024, MLP 4096, 16 heads"].startswith(
        "bf16 (measured: fp32 1000.0 ms, bf16 500.0 ms"
    )
    assert len(probe["calls"]) == 3  # the run's shape, then the two shipped ones
    torch_rows()
    assert len(probe["calls"]) == 3  # a second doctor reads the cache


def test_the_real_probe_times_both_precisions_and_leaves_the_caller_as_it_was():
    """The probe itself, on a tiny shape: two positive timings of a forward + backward, run from
    under `no_grad` (an engine's or a scorer's set-up), with the global random state as it found
    it. Wrong if it failed on the CPU build (autocast, SDPA, RMSNorm), or a run's later random
    draws (LoRA init, sampling) changed with whether its probe ran or was read from the cache."""
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    with torch.no_grad():
        fp32_s, bf16_s = precision.probe_timings(precision.ProbeShape(64, 128, 2))
    assert 0 < fp32_s < 60 and 0 < bf16_s < 60
    assert torch.equal(torch.rand(3), expected)


def test_a_process_groups_ranks_take_rank_0s_decision(probe, monkeypatch):
    """In a process group only rank 0 probes and every rank computes in its decision (FSDP2 shards
    one dtype). Wrong if a rank probed on its own (ranks on one machine would measure each other's
    load, and might disagree) or kept its own answer. The group is simulated in-process: this is
    rank 1 of 2, rank 0 having measured bf16 slower."""
    import torch.distributed as dist

    sent = precision.ProbeResult("fp32", 0.4, 0.6, "probed now")
    broadcasts = []

    def broadcast(objects, src):
        broadcasts.append(src)
        objects[0] = sent

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    assert precision.resolve_precision("auto", CPU, MINILM) == torch.float32  # its own probe: bf16
    assert probe["calls"] == [] and broadcasts == [0]
