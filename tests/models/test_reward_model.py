"""The scalar reward model (`head = "reward"`): one score per answer, Davidson / Bradley-Terry
probabilities, packed scoring equal to scoring alone, and an export that transformers loads as a
sequence classifier with one label giving the same scores."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hpref.builtin import models as builtin_models
from hpref.errors import UserError
from hpref.models.heads import davidson_logits

from .conftest import model_from_config, packed_batch, tiny_bert_config, tiny_roberta_config
from .test_components import TINY, builtin_models_texts

PAIRS = (5, 3, 1, 9, 7, 4)  # three (A, B) pairs, one A of a single token


def word_tokenizer(vocab=96):
    """A tokenizer to save beside a tiny BERT (the export needs one); never downloaded."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3} | {f"w{i}": i for i in range(4, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def tiny_llama_reward():
    config = builtin_models.TinyLlamaConfig(**TINY, head="reward")
    return builtin_models.build_tiny_llama(config, texts=builtin_models_texts, texts_source="test-builtin")


def tiny_bert_reward():
    model = model_from_config(tiny_bert_config(pad_token_id=0), head="reward")
    model.tokenizer = word_tokenizer()
    return model


def trained(model):
    """A head that is not the seeded one, and a tie parameter that is not 0."""
    with torch.no_grad():
        model.head.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
        model.head.log_tie.fill_(-0.7)
    return model


def test_davidson_and_bradley_terry_probabilities_by_hand():
    """softmax([s_A, s_B, log nu + (s_A + s_B)/2]) is Davidson's model; with nu -> 0, Bradley-Terry.
    A wrong tie logit would mis-price every arena tie (and leak probability to ties on pairwise data)."""
    scores = torch.tensor([1.0, 0.0, -0.5, -0.5])
    probs = torch.softmax(davidson_logits(scores, torch.tensor([math.log(0.5)])), dim=-1)
    e = math.e
    total = e + 1 + 0.5 * math.sqrt(e)
    assert probs[0].tolist() == pytest.approx([e / total, 1 / total, 0.5 * math.sqrt(e) / total], abs=1e-6)
    assert probs[1].tolist() == pytest.approx([1 / 2.5, 1 / 2.5, 0.5 / 2.5], abs=1e-6)  # equal scores
    bt = torch.softmax(davidson_logits(scores, torch.tensor([-30.0])), dim=-1)
    assert bt[0, 0].item() == pytest.approx(1 / (1 + math.exp(-1.0)), abs=1e-6)  # sigmoid(s_A - s_B)
    with pytest.raises(ValueError, match="pairs"):
        davidson_logits(torch.zeros(3), torch.zeros(1))


@pytest.mark.parametrize("build", [tiny_llama_reward, tiny_bert_reward], ids=["llama", "bert"])
def test_packed_scores_equal_each_pair_alone(build):
    """Three pairs packed in one row give the logits each pair gets alone: no sequence attends
    across its boundary, positions restart, and the last (decoder) or CLS (encoder) token is read."""
    model = trained(build())
    ids, cu, positions, seqs = packed_batch(PAIRS, vocab=90)
    with torch.no_grad():
        packed = model(ids, cu, positions)
        alone = []
        for a, b in zip(seqs[0::2], seqs[1::2], strict=True):
            cu_one = torch.tensor([0, len(a), len(a) + len(b)], dtype=torch.int32)
            pos = torch.cat([torch.arange(len(a)), torch.arange(len(b))])
            alone.append(model(torch.cat([a, b]), cu_one, pos))
    assert packed.shape == (3, 3)
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)
    # symmetric by construction: B/A is A/B with the first two columns exchanged
    swapped_order = [seqs[i ^ 1] for i in range(len(seqs))]
    lengths = [len(s) for s in swapped_order]
    cu_s = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        back = model(torch.cat(swapped_order), cu_s, torch.cat([torch.arange(n) for n in lengths]))
    torch.testing.assert_close(back, packed[:, [1, 0, 2]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", [tiny_llama_reward, tiny_bert_reward], ids=["llama", "bert"])
def test_export_is_a_transformers_sequence_classifier_with_the_same_scores(build, tmp_path):
    """`save_pretrained` of a reward model loads with AutoModelForSequenceClassification (num_labels 1,
    no missing or unexpected keys) and scores each answer as hpref's packed forward does (1e-4),
    one at a time and right-padded in a batch; nu is in hpref_model.json; hpref loads it back."""
    from transformers import AutoModelForSequenceClassification

    from hpref.models import PreferenceModel

    model = trained(build())
    folder = model.save_pretrained(tmp_path / "export")
    info = json.loads((folder / "hpref_model.json").read_text())
    assert info["head"] == "reward" and info["tie_log_nu"] == pytest.approx(-0.7)
    hf, loading = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    hf.eval()
    assert hf.config.num_labels == 1
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    ids, cu, positions, seqs = packed_batch(PAIRS, vocab=90)
    with torch.no_grad():
        scores = model.head.score(_pooled(model, ids, cu, positions)).squeeze(-1)
        one_by_one = torch.stack([hf(input_ids=s[None]).logits[0, 0] for s in seqs])
        longest = max(len(s) for s in seqs)
        pad = hf.config.pad_token_id
        batch = torch.full((len(seqs), longest), pad, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for i, s in enumerate(seqs):
            batch[i, : len(s)], mask[i, : len(s)] = s, 1
        padded = hf(input_ids=batch, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(one_by_one, scores, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(padded, scores, atol=1e-4, rtol=1e-4)
    loaded = PreferenceModel.from_pretrained(folder)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(ids, cu, positions), model(ids, cu, positions), atol=1e-6, rtol=1e-6
        )
    assert loaded.head_kind == "reward"


def _pooled(model, ids, cu, positions):
    """The pooled state the reward head scores (what HF's classifier reads), via the forward's hook."""
    seen = {}
    handle = model.head.score.register_forward_hook(lambda m, args, out: seen.setdefault("x", args[0]))
    model(ids, cu, positions)
    handle.remove()
    return seen["x"]


def test_the_tie_parameter_starts_at_the_label_prior():
    """Pairwise labels never tie: log nu starts near log(1e-4 / 0.5), so P(tie) ~ 1e-4 from step 0
    instead of a third; arena labels give their own tie rate when the scores are equal."""
    import numpy as np

    from hpref.train.head_prior import prior_logits

    model = tiny_bert_reward()
    model.set_output_bias(prior_logits(np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]] * 5)))
    assert model.head.log_tie.item() == pytest.approx(math.log(1e-4 / 0.5), abs=1e-2)
    model.set_output_bias(prior_logits(np.array([[0.4, 0.35, 0.25]])))
    probs = torch.softmax(davidson_logits(torch.zeros(2), model.head.log_tie), dim=-1)[0]
    assert probs[2].item() == pytest.approx(0.25 / (0.25 + 2 * math.sqrt(0.4 * 0.35)), abs=1e-5)


def test_mean_pooled_encoder_reward_model_scores_the_mean_and_round_trips_through_hpref(tmp_path):
    """pooling = "mean" on an encoder (how sentence embedders such as MiniLM were tuned): each score is
    the score linear on the sequence's mean hidden state, BERT's CLS pooler is not applied, and the
    export is hpref's own folder (a plain backbone, not a sequence classifier that transformers would
    silently pool by CLS) that hpref loads back with identical logits. If the pooler still ran, or the
    export claimed a sequence-classifier class, a TRL/OpenRLHF user would get different scores."""
    from hpref.models import PreferenceModel

    model = model_from_config(tiny_bert_config(pad_token_id=0), head="reward", pooling="mean")
    model.tokenizer = word_tokenizer()
    model = trained(model)
    assert not model.exports_sequence_classifier
    ids, cu, positions, seqs = packed_batch(PAIRS, vocab=90)
    with torch.no_grad():
        # each sequence through the plain transformers backbone alone: the reference mean
        means = torch.stack([model.backbone(input_ids=s[None]).last_hidden_state[0].mean(0) for s in seqs])
        expected = model.head.score(means).squeeze(-1)
        torch.testing.assert_close(_pooled(model, ids, cu, positions), means, atol=1e-6, rtol=1e-6)
        logits = model(ids, cu, positions)
    torch.testing.assert_close(logits[:, :2], expected.reshape(-1, 2), atol=1e-5, rtol=1e-5)
    folder = model.save_pretrained(tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    assert not any("SequenceClassification" in a for a in config.get("architectures") or [])
    assert json.loads((folder / "hpref_model.json").read_text())["pooling"] == "mean"
    loaded = PreferenceModel.from_pretrained(folder)
    assert loaded.pooling == "mean" and loaded.head_kind == "reward"
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, cu, positions), logits, atol=1e-6, rtol=1e-6)


def test_mean_pooled_export_is_a_sentence_transformers_model_with_hprefs_scores(tmp_path):
    """The mean-pooled export loads in sentence-transformers with remote code off (stock Transformer,
    Pooling and Dense modules) and its `encode` gives each text hpref's score (1e-5), for texts one at
    a time and padded together in one batch (the mean must skip the padding). If this fails, the
    README's "mean pooling exports to sentence-transformers" hands users a model that scores
    differently from the one hpref evaluated; sentence-transformers' own mean over the attention mask
    (special tokens included) is the contract."""
    st = pytest.importorskip("sentence_transformers")

    from tokenizers.pre_tokenizers import WhitespaceSplit

    model = model_from_config(tiny_bert_config(pad_token_id=0), head="reward", pooling="mean")
    model.tokenizer = word_tokenizer()
    model.tokenizer.backend_tokenizer.pre_tokenizer = WhitespaceSplit()  # "w5 w7" -> ids 5, 7
    model = trained(model)
    with torch.no_grad():
        model.head.score.bias.fill_(0.25)  # a bias that must travel too
    folder = model.save_pretrained(tmp_path / "export")
    loaded = st.SentenceTransformer(str(folder), device="cpu", trust_remote_code=False)
    _ids, _cu, _positions, seqs = packed_batch(PAIRS, vocab=90)
    texts = [" ".join(f"w{int(i)}" for i in s) for s in seqs]  # the word tokenizer maps w<i> to id i
    with torch.no_grad():
        means = [model.backbone(input_ids=s[None]).last_hidden_state[0].mean(0) for s in seqs]
        expected = model.head.score(torch.stack(means)).squeeze(-1)
    batched = torch.as_tensor(loaded.encode(texts, batch_size=len(texts), convert_to_numpy=True)).squeeze(-1)
    one_by_one = torch.tensor([float(loaded.encode([t], convert_to_numpy=True)[0, 0]) for t in texts])
    torch.testing.assert_close(batched, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one_by_one, expected, atol=1e-5, rtol=1e-5)
    # the same folder still loads in hpref with the identical model
    assert (folder / "hpref_model.json").is_file() and (folder / "head.safetensors").is_file()


def test_reward_head_refuses_what_it_cannot_export():
    """A family whose transformers classifier is not one linear on the pooled state (RoBERTa) and a
    pooling unlike transformers' would export a model that scores differently: both are refused."""
    with pytest.raises(UserError, match="not one linear"):
        model_from_config(tiny_roberta_config(), head="reward")
    with pytest.raises(UserError, match="'last'"):  # mean on a decoder: only encoders may mean-pool
        builtin_models.build_tiny_llama(
            builtin_models.TinyLlamaConfig(**TINY, head="reward", pooling="mean"),
            texts=builtin_models_texts,
            texts_source="test-builtin",
        )
