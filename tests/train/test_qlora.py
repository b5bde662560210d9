"""QLoRA (`lora.quantize_base = "4bit"`, hpref.models.quantize): the targeted block linears hold
bitsandbytes NF4 weights under PEFT's 4-bit LoRA layers, on CPU as on CUDA. What is 4-bit and what
trains, the one-line error without bitsandbytes, a 2-rank gloo run (base replicated, adapters
sharded) that resumes exactly, and its exports: the adapter folder rebuilds the 4-bit model, the
merged folder is the adapters folded into the full-precision base."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_hpref
from tests.train.conftest import train_losses
from tests.train.test_lora import STEPS, lora_settings, tiny_llama, write_lora_recipe

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

QLORA = 'quantize_base = "4bit"\n'

#: How far the merged export (adapters on the full-precision base) may score from the 4-bit model it
#: was trained as: NF4 rounds each weight by up to ~14% of its 64-weight block's largest magnitude,
#: which moved this tiny model's probabilities by ~3e-4 when measured; 1e-2 leaves room for seeds.
MERGED_PROB_TOLERANCE = 1e-2


def write_qlora_recipe(folder: Path, name: str) -> Path:
    """test_lora's recipe, 64 wide (bitsandbytes' block: narrower layers stay full precision)."""
    path = write_lora_recipe(folder, name)
    text = path.read_text().replace("hidden_size = 32", "hidden_size = 64")
    path.write_text(text.replace("intermediate_size = 64", "intermediate_size = 128") + QLORA)
    return path


def tiny_llama_64(**overrides):
    """The tiny Llama of test_lora at 64 wide: every projection's input is a whole 64-weight block."""
    from hpref.plugins import load_plugins

    component = load_plugins().get("model", "tiny-llama")
    settings = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        tokenizer_texts=500,
    )
    return component, component.config(**{**settings, **overrides})


# --------------------------------------------------------------------------------------------------
# building: what is 4-bit, what trains


def test_targeted_block_linears_are_frozen_nf4_under_peft_4bit_lora_layers():
    """Every Llama projection in every block is a bitsandbytes `Linear4bit` holding packed uint8 NF4
    codes (double-quantised scales), frozen, wrapped by PEFT's own 4-bit LoRA layer; the adapters,
    the head and nothing else train, as many parameters as LoRA on the full-precision base; the
    embeddings stay fp32. The dequantised weights are the originals within NF4's rounding, and with
    LoRA's B at zero the model scores as the plain one up to that rounding. If not, the base is not
    really 4-bit, something frozen trains, or the quantisation is of some other weight."""
    import bitsandbytes as bnb
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

    from hpref.models.adapters import apply_lora, count_parameters
    from hpref.models.quantize import quantized_bytes, quantized_modules
    from tests.models.conftest import packed_batch

    component, config = tiny_llama_64()
    plain = component.build(config, device="cpu")
    full = component.build(config, device="cpu")
    apply_lora(full, lora_settings(r=4))
    model = component.build(config, device="cpu")
    apply_lora(model, lora_settings(r=4, quantize_base="4bit"))

    quantized = quantized_modules(model)
    assert len(quantized) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 blocks
    plain_weights = dict(plain.named_parameters())
    for name, module in quantized.items():
        assert name.endswith(".base_layer")
        assert isinstance(model.get_submodule(name.removesuffix(".base_layer")), PeftLinear4bit)
        weight = module.weight
        assert isinstance(weight, bnb.nn.Params4bit) and weight.dtype == torch.uint8
        assert not weight.requires_grad and weight.quant_state.nested  # double quantisation
        original = plain_weights[name.removesuffix(".base_layer") + ".weight"].detach()
        restored = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
        assert restored.shape == original.shape and not torch.equal(restored, original)
        assert (restored - original).abs().max() <= 0.15 * original.abs().max(), name
    assert model.backbone.embed_tokens.weight.dtype == torch.float32
    assert count_parameters(model) == count_parameters(full)  # 4-bit weights count as what they stand for
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n or n.startswith("head.") for n in trainable), trainable
    # 2 blocks of 64x64 q/o, 32x64 k/v, 128x64 gate/up, 64x128 down: half a byte a weight + scales
    fp32_bytes = 2 * (2 * 4096 + 2 * 2048 + 3 * 8192) * 4
    assert 0 < quantized_bytes(model) < fp32_bytes / 4

    ids, cu, pos, _ = packed_batch(vocab=200)
    with torch.no_grad():
        got, expected = model(ids, cu, pos), plain(ids, cu, pos)
    assert not torch.equal(got, expected)
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0)


def test_layers_narrower_than_a_quantisation_block_stay_full_precision():
    """In the 32-wide tiny Llama only the MLP's down projection (64 inputs) is a whole number of
    bitsandbytes' 64-weight blocks per row; the others stay full precision (their LoRA trains all
    the same). If not, bitsandbytes' CPU dequantiser would give those layers errors of up to ~87%
    of a block's largest weight (measured in bitsandbytes 0.50) instead of NF4's ~15%."""
    from hpref.models.adapters import apply_lora
    from hpref.models.quantize import quantized_modules

    component, config = tiny_llama()
    model = component.build(config, device="cpu")
    apply_lora(model, lora_settings(r=4, quantize_base="4bit"))
    assert sorted(quantized_modules(model)) == [
        f"backbone.layers.{i}.mlp.down_proj.base_layer" for i in range(2)
    ]
    assert type(model.backbone.layers[0].self_attn.q_proj.base_layer) is torch.nn.Linear


def test_without_bitsandbytes_qlora_is_a_one_line_user_error(tmp_path, monkeypatch):
    """With bitsandbytes not installed, building the model and `hpref recipes check`'s machine
    checks each stop with one line that names the key and the extra to install. If not, a missing
    package would surface as an ImportError traceback from inside PEFT or the trainer."""
    from hpref.errors import RecipeError, UserError
    from hpref.models.adapters import apply_lora
    from hpref.recipe import load_recipe
    from hpref.train.checks import check_train

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    expected = "lora.quantize_base: '4bit' (QLoRA) needs bitsandbytes: pip install 'hpref[qlora]'"
    component, config = tiny_llama()
    with pytest.raises(UserError) as info:
        apply_lora(component.build(config, device="cpu"), lora_settings(quantize_base="4bit"))
    assert str(info.value) == expected
    recipe = load_recipe(write_qlora_recipe(tmp_path, "q"))
    with pytest.raises(RecipeError) as info:
        check_train(recipe)
    assert str(info.value).endswith(expected) and "\n" not in str(info.value)


#: run first in each child: every hub kernel request is recorded (and answered with an error)
RECORD_KERNEL_FETCHES = """
import kernels
fetched = []
def get_kernel(repo_id, *args, **kwargs):
    fetched.append(repo_id)
    raise RuntimeError("no hub kernels in this test")
kernels.get_kernel = get_kernel
"""


def test_bitsandbytes_imported_through_hpref_fetches_no_hub_kernel():
    """bitsandbytes' CPU backend asks the `kernels` package for a Hub kernel when it is imported on
    an AVX512-BF16 CPU (online: downloaded code run in-process; offline: a warning on the console).
    Plain `import bitsandbytes` makes that request (else this CPU never would, and the test
    skips); after `import hpref` it must not, whoever imports bitsandbytes (peft, QLoRA). If it did,
    an hpref run that uses LoRA would download and run a stranger's code, and print a warning on
    every offline command."""
    pytest.importorskip("kernels")

    def fetched(code):
        code = RECORD_KERNEL_FETCHES + code + "\nprint(fetched)"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    plain = fetched("import bitsandbytes")
    if plain == "[]":
        pytest.skip("bitsandbytes asks for no hub kernel on this CPU (no AVX512-BF16)")
    assert plain == "['kernels-community/quantization-bitsandbytes']"
    through_hpref = (
        "import hpref, sys\n"
        "import bitsandbytes, peft\n"
        # hidden for bitsandbytes' import only: transformers' own `kernels` module is left in place
        "assert sys.modules['kernels'] is kernels\n"
    )
    assert fetched(through_hpref) == "[]"


@pytest.mark.slow
def test_without_bitsandbytes_the_commands_exit_2_with_one_line(tmp_path):
    """The real commands in a Python where bitsandbytes cannot be imported (a `sitecustomize` masks
    it): `hpref recipes check` and `hpref train` print one line and exit 2 before anything trains."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        textwrap.dedent(
            """\
            import sys
            sys.modules["bitsandbytes"] = None  # find_spec -> None, import -> ImportError
            """
        )
    )
    path = write_qlora_recipe(tmp_path, "q")

    env = {"PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])}
    for command in (["recipes", "check"], ["train"]):
        result = run_hpref(*command, str(path), env=env)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "needs bitsandbytes: pip install 'hpref[qlora]'" in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------------
# training on 2 gloo ranks, resume, checkpoints, exports


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """The uninterrupted 2-rank QLoRA reference run (10 steps, CPU, gloo)."""
    from hpref.train import run_train

    folder = tmp_path_factory.mktemp("qlora-ref")
    base = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HPREF_CACHE", str(base / "hpref-cache"))
        env.setenv("HPREF_HOME", str(base / "hpref-home"))
        assert run_train(write_qlora_recipe(folder, "qlora"), nproc_per_node=2) == 0
    return folder / "runs" / "qlora"


@pytest.mark.slow
def test_qlora_replicates_the_4bit_base_shards_the_adapters_and_checkpoints_only_them(qlora_run):
    """On 2 ranks the 4-bit weights stay whole on each rank (FSDP2's ignored parameters) while
    every adapter is sharded (DCP stores one chunk per rank); the checkpoint holds the adapters and
    the head only (no packed weight, no bitsandbytes scales) and names its base with
    `quantize_base`. If not, FSDP2 sharded or dropped the 4-bit base, or checkpoints carry it."""
    from hpref.runfolder.safe_load import read_dcp_index

    log = (qlora_run / "logs" / "rank1.log").read_text()
    assert "14 4-bit base weights replicated on every rank" in log
    assert "lora.quantize_base = '4bit' on CPU" in log
    step = qlora_run / "checkpoints" / f"step-{STEPS:06d}"
    index = read_dcp_index(step).state_dict_metadata
    keys = [k for k in index if k.startswith("model.")]
    assert keys and all(".lora_A." in k or ".lora_B." in k or k.startswith("model.head.") for k in keys), keys
    adapters = [k for k in keys if ".lora_" in k]
    assert len(adapters) == 2 * 2 * 7
    assert all(len(index[k].chunks) == 2 for k in adapters)  # sharded over the 2 ranks
    state = json.loads((step / "train_state.json").read_text())
    assert state["base_model"]["name"] == "tiny-llama" and state["base_model"]["quantize_base"] == "4bit"
    summary = json.loads((qlora_run / "summary.json").read_text())
    assert summary["trainable_params"] < summary["params"] / 4


@pytest.mark.slow
def test_qlora_run_killed_mid_epoch_resumes_to_the_same_losses_on_2_ranks(tmp_path, qlora_run, monkeypatch):
    """Crash after step 5 (latest checkpoint: step 3), resume on 2 ranks: every later step has the
    uninterrupted run's loss (1e-6). If not, the rebuilt 4-bit base differs from the one trained
    on, or the adapters' state is not restored."""
    from hpref.train import run_train

    recipe = write_qlora_recipe(tmp_path, "qlora")
    monkeypatch.setenv("HPREF_DEBUG_CRASH_AFTER_STEP", "5")
    assert run_train(recipe, nproc_per_node=2) != 0
    monkeypatch.delenv("HPREF_DEBUG_CRASH_AFTER_STEP")
    assert run_train(recipe, nproc_per_node=2, resume="auto") == 0
    resumed, reference = train_losses(tmp_path / "runs" / "qlora"), train_losses(qlora_run)
    assert sorted(reference) == list(range(1, STEPS + 1))
    for step in range(4, STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step
    assert "resumed from" in (tmp_path / "runs" / "qlora" / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_qlora_exports_adapter_rebuilds_the_4bit_model_merged_folds_into_full_precision(qlora_run, tmp_path):
    """`hpref eval` of the checkpoint and of the `--adapter` export (which rebuilds the 4-bit base
    from `hpref_adapter.json`) give the predictions the run wrote at its last eval (6 decimals). The
    merged export is a plain transformers folder whose weights are the full-precision base plus the
    adapters: it scores within `MERGED_PROB_TOLERANCE` of the 4-bit model, and not identically (the
    difference is the base's quantisation error). If not, an export is another model than the one
    trained, or the merge went into the 4-bit copy."""
    from safetensors.torch import load_file

    from hpref.evaluate.command import EvalRequest, eval_command
    from hpref.prediction.files import read_predictions
    from hpref.save.command import SaveRequest, save_command

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert save_command(SaveRequest(qlora_run, to=merged)) == 0
    assert save_command(SaveRequest(qlora_run, to=adapter, adapter=True)) == 0
    meta = json.loads((adapter / "hpref_adapter.json").read_text())
    assert meta["base"]["quantize_base"] == "4bit" and meta["lora"]["quantize_base"] == "4bit"

    trained = np.loadtxt(qlora_run / "predictions.csv", delimiter=",", skiprows=1, usecols=(1, 2, 3))
    recipe = qlora_run / "recipe.toml"
    probs = {}
    for name, source in (("checkpoint", qlora_run), ("adapter", adapter), ("merged", merged)):
        out = tmp_path / f"{name}.csv"
        assert eval_command(EvalRequest(recipe, checkpoint=source, out=out, plot=False)) == 0
        probs[name] = read_predictions(out).probs
    np.testing.assert_allclose(probs["checkpoint"], trained, atol=2e-6)
    np.testing.assert_allclose(probs["adapter"], probs["checkpoint"], atol=2e-6)
    gap = np.abs(probs["merged"] - probs["checkpoint"]).max()
    assert 0 < gap < MERGED_PROB_TOLERANCE, gap

    weights = load_file(str(merged / "model.safetensors"))
    assert not any("lora" in k or "base_layer" in k or "absmax" in k or "quant" in k for k in weights)
    assert all(v.dtype == torch.float32 for v in weights.values())
    component, config = tiny_llama_64(head_dropout=0.0)
    base = component.build(config, device="cpu").backbone.state_dict()
    key = "layers.0.self_attn.q_proj.weight"
    assert weights[key].shape == base[key].shape and not torch.equal(weights[key], base[key])
    shutil.rmtree(merged)
