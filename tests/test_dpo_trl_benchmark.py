"""`benchmarks.dpo_trl` (the README's "Offline DPO vs TRL `DPOTrainer`" figure) runs end to end in its
smallest setting: its own pair selection, recipe, `hpref train` process, TRL worker process and report,
on a config-built tiny Llama (random init, ChatML template) and eight toy pairs instead of SmolLM2 and
../shared's HH-RLHF. Both contenders at fp32, two steps of four pairs."""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("trl")  # the benchmark's other contender; hpref itself does not need it
pytest.importorskip("peft")  # both sides' LoRA
pytestmark = pytest.mark.slow

from benchmarks import dpo_trl  # noqa: E402

from tests.rl.tiny import TINY  # noqa: E402
from tests.train.test_dpo import CHATML, write_pairs  # noqa: E402


def test_hpref_and_trl_dpo_start_at_log_2_and_keep_the_same_curve(tmp_path):
    """Wrong if the benchmark behind the README's DPO figure no longer ran (a recipe key, worker spec or
    metrics field it reads changed), if either side's first loss were not log 2 (LoRA's B starts at zero,
    so policy = reference: anything else is another reference, loss or beta), if the two fp32 curves
    parted beyond the benchmark's own tolerance (other tokens, masks or weighting than TRL's), or if the
    wall / memory ratio line the figure quotes were not printed."""
    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig

    lm, tokenizer = build_policy_model(PolicyModelConfig(**TINY))
    tokenizer.chat_template = CHATML  # TRL lays conversational pairs out by the template alone
    lm.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    pairs = write_pairs(tmp_path / "pairs.jsonl", 8)
    out = tmp_path / "report.md"
    argv = ["--data", str(pairs), "--policy", str(tmp_path / "policy"), "--pairs", "8", "--steps", "2"]
    argv += ["--batch", "4", "--lora-r", "4", "--max-length", "128", "--rounds", "1", "--lr", "1e-3"]
    argv += ["--contenders", "hpref-fp32,trl-fp32-no-gc", "--out", str(out)]
    assert dpo_trl.main(argv) == 0
    text = out.read_text()
    curve = {
        int(m[1]): (float(m[2]), float(m[3]))
        for m in re.finditer(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    }
    assert sorted(curve) == [1, 2], text
    assert curve[1] == pytest.approx((math.log(2), math.log(2)), abs=1e-5)
    assert curve[2][0] != pytest.approx(math.log(2), abs=1e-4)  # one step at this lr moves the loss
    gap = re.search(r"hpref-fp32 vs trl-fp32-no-gc: largest per-step loss difference (\S+) \((\w+) ", text)
    assert gap and gap[2] == "within" and float(gap[1]) <= dpo_trl.FP32_TOLERANCE, text
    ratio = re.search(r"hpref-fp32 / trl-fp32-no-gc: wall (\S+)x, peak RSS (\S+)x", text)
    assert ratio and all(0 < float(x) < math.inf for x in ratio.groups()), text
