"""`benchmarks.rl_trainer_speed` runs in its smallest setting: two steps of a config-built tiny Llama
in every layout on multi-turn episodes, its table printed as benchmarks/README.md reads it."""

from __future__ import annotations

from benchmarks import rl_trainer_speed


def test_the_benchmark_trains_every_layout_on_the_same_rollouts_and_prints_the_comparison(capsys):
    """Wrong if a layout trained other rollouts or weights than the first (its loss, KL or gradient
    norm would differ by far more than fp32 rounding; a `@bf16` one by more than bf16's), a step's
    tokens were not the episodes' policy tokens, or the table lost a layout, its ratio to the first
    or its MFU (against the peak the table names)."""
    rollouts = rl_trainer_speed.rollouts(2, True, 300)
    assert [r.rollout_id for r in rollouts] == [0, 1]
    assert all(sum(map(sum, r.masks)) < sum(map(len, r.completions)) for r in rollouts)  # observations
    assert (
        rl_trainer_speed.main(
            ["--tiny", "--steps", "2", "--episodes", "--layouts", "group,packed,padded,packed@bf16"]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("MFU: ") and "TFLOP/s (CPU " in line for line in lines), lines
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in lines
        if line.startswith("| ") and "---" not in line
    }
    assert set(rows) == {"layout", "group", "packed", "padded", "packed@bf16"}
    assert rows["group"][1].strip() == "1.00x"
    for name in ("packed", "padded"):
        speed, ratio, mfu, _seconds, _peak, d_loss, d_kl, d_grad = (c.strip() for c in rows[name])
        assert float(speed) > 0 and ratio.endswith("x") and 0 < float(mfu.rstrip("%")) <= 100
        assert float(d_loss) < 1e-6 and float(d_kl) < 1e-6 and float(d_grad) < 1e-6
    # the same packed step under bf16 autocast: the same rollouts and weights, so its loss differs from
    # fp32's by bf16 rounding only (a wrong rollout or model would differ by far more)
    speed, *_, d_loss, d_kl, _d_grad = (c.strip() for c in rows["packed@bf16"])
    assert float(speed) > 0 and 0 < float(d_loss) < 0.05 and float(d_kl) < 0.05
    # `--memory`'s worker (in-process here): a step's peak over the trainer before it, in MiB (bytes: ~1e7)
    assert 0 <= rl_trainer_speed.step_peak_mib("packed", episodes=False, tiny=True, precision="fp32") < 1024
