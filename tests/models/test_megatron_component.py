"""The `megatron-gpt` model component (issue #15): registered like every model, the same model as
`tiny-llama` from the same settings, a transformers export, one-line refusals."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is the optional [megatron] extra")

from hpref.errors import UserError  # noqa: E402
from tests.conftest import TINY_LLAMA as TINY  # noqa: E402


@pytest.fixture
def alone():
    """The component sets up a one-process group and megatron's parallel state; tear both down."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def packed_row():
    generator = torch.Generator().manual_seed(3)
    lengths = [7, 12, 4]
    ids = torch.randint(5, 300, (sum(lengths),), generator=generator)
    cu = torch.tensor([0, 7, 19, 23], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return ids, cu, positions


def build(**config):
    from hpref.plugins import load_plugins

    component = load_plugins().get("model", "megatron-gpt")
    return component.build(component.config(**config))


def test_megatron_gpt_is_the_tiny_llama_model_on_megatron(alone):
    """From the same `tiny_llama` settings and seed, megatron-gpt's logits on a packed row equal
    the tiny-llama component's (transformers) logits: same tokenizer, same initial weights converted,
    same head. If this fails, the megatron quickstart would not start from the quickstart's model
    (a different seed or init order), or the conversion / pooling differs."""
    from hpref.builtin.models import TinyLlamaConfig, build_tiny_llama

    ours = build(tiny_llama=TINY, seed=5)
    theirs = build_tiny_llama(TinyLlamaConfig(**TINY, seed=5))
    assert type(ours).__name__ == "MegatronPreferenceModel"
    ids, cu, positions = packed_row()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, cu, positions), theirs(ids, cu, positions), atol=1e-5, rtol=1e-5)


def test_save_pretrained_writes_a_transformers_folder_hpref_reloads(alone, tmp_path):
    """`save_pretrained` of a megatron-gpt model converts back to transformers keys: the folder
    loads with transformers' AutoModel (strict) and through hpref's export loader gives the same
    logits. If this fails, `hpref save` of a megatron run writes megatron's layout or loses a weight."""
    from transformers import AutoModel

    from hpref.models import PreferenceModel

    model = build(tiny_llama=TINY)
    with torch.no_grad():  # a trained-looking model: the conversion of every tensor shows
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(tmp_path / "export")
    AutoModel.from_pretrained(tmp_path / "export")
    reloaded = PreferenceModel.from_pretrained(tmp_path / "export").eval()
    assert type(reloaded) is PreferenceModel
    ids, cu, positions = packed_row()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(ids, cu, positions), model(ids, cu, positions), atol=1e-5, rtol=1e-5
        )


def test_unsupported_settings_are_refused_in_one_line(alone, monkeypatch):
    """Sequence parallelism with pipeline stages, stages that do not divide the layers, tensor x
    pipeline parallel sizes that do not divide the ranks (more stages than ranks, or a remainder),
    and a recipe naming both or neither weight source, are one line each, before anything is built.
    If this fails, a recipe asking for them would train something else than it says (or fail deep
    inside megatron)."""
    import torch.distributed as dist
    from pydantic import ValidationError

    with pytest.raises(UserError, match="pipeline_parallel = 3 must divide the model's 2 layers"):
        build(tiny_llama=TINY, pipeline_parallel=3)
    with pytest.raises(
        UserError, match="sequence_parallel with model.pipeline_parallel > 1 is not supported"
    ):
        build(tiny_llama=TINY, pipeline_parallel=2, sequence_parallel=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for world, tp, pp in ((2, 2, 2), (3, 1, 2)):
        monkeypatch.setattr(dist, "get_world_size", lambda *args, _world=world, **kwargs: _world)
        message = rf"pipeline_parallel = {tp} x {pp} must divide the number of ranks \({world}\)"
        with pytest.raises(UserError, match=message):
            build(tiny_llama=TINY, tensor_parallel=tp, pipeline_parallel=pp)
    monkeypatch.undo()
    with pytest.raises(ValidationError, match="exactly one of path and tiny_llama"):
        build()
    with pytest.raises(ValidationError, match="exactly one of path and tiny_llama"):
        build(tiny_llama=TINY, path="/somewhere")


def test_lora_with_megatron_is_refused(alone):
    """[lora] with megatron-gpt is a one-line error: PEFT cannot wrap megatron's fused
    tensor-parallel linears, and training would silently fine-tune every weight instead."""
    from hpref.components import Components
    from hpref.recipe import recipe_from_dict

    recipe = recipe_from_dict(
        {
            "run": {"name": "t"},
            "model": {"name": "megatron-gpt", "tiny_llama": TINY},
            "dataset": {"train": {"name": "synthetic-arena", "num_battles": 10}},
            "lora": {"r": 4},
        }
    )
    with pytest.raises(UserError, match=r"\[lora\] is not supported with model 'megatron-gpt'"):
        Components(recipe).model()


def test_tensor_parallel_model_is_built_unsplit_alone_but_not_trained_alone(alone):
    """One process (`hpref save`, `hpref eval`) builds a tensor_parallel = 2 model unsplit, with the
    vocabulary padded as the 2-rank run padded it (so its checkpoint fits); training it alone is a
    one-line error. If this fails, either a TP = 2 run cannot be exported on one process, or a
    recipe asking for TP = 2 on one rank silently trains something else."""
    import torch

    model = build(tiny_llama=TINY, tensor_parallel=2)
    assert model.parallel.tp_size == 1
    vocab = len(model.tokenizer)
    rows = model.backbone.gpt.embedding.word_embeddings.weight.shape[0]
    assert rows == vocab + vocab % 2
    with pytest.raises(UserError, match="model.tensor_parallel = 2 needs a multiple of that many ranks"):
        model.parallelize_self(param_dtype=torch.float32, activation_checkpointing=False)


def test_pipeline_parallel_model_is_built_unsplit_alone_but_not_trained_alone(alone):
    """One process (`hpref save`, `hpref eval`) builds a pipeline_parallel = 2 model whole (every
    layer, the embedding, the norm and the head: the keys a pipeline run's checkpoint stores);
    training it alone is a one-line error. If this fails, a PP = 2 run cannot be exported on one
    process, or a recipe asking for two stages on one rank silently trains something else."""
    model = build(tiny_llama=TINY, pipeline_parallel=2)
    assert type(model).__name__ == "MegatronPreferenceModel"
    assert model.parallel.pp_size == 1 and len(model.backbone.blocks()) == 2
    with pytest.raises(UserError, match="model.pipeline_parallel = 2 needs a multiple of that many ranks"):
        model.parallelize_self(param_dtype=torch.float32, activation_checkpointing=False)


def test_a_pipeline_stage_names_its_layers_as_the_unsplit_model_does():
    """A stage's local layer `i` is the unsplit model's layer `i + offset` (checkpoint keys, initial
    weights); the embedding belongs to the first stage, the final norm and the head to the last.
    If this fails, a stage loads another layer's weights, or stores its layers under keys a
    one-process `hpref save` (or another stage) reads as other layers."""
    from hpref.models.megatron.pipeline import PipelineStage

    def stage(rank: int) -> PipelineStage:
        return PipelineStage(rank, 2, None, None, None, 1, layer_offset=2 * rank, num_layers=2)

    layer = "backbone.gpt.decoder.layers.{}.mlp.linear_fc1.weight"
    unsplit = {
        "backbone.gpt.embedding.word_embeddings.weight": 0,
        **{layer.format(i): i for i in range(4)},
        "backbone.norm.weight": 5,
        "head.out_proj.bias": 6,
    }
    first, last = stage(0).select(unsplit), stage(1).select(unsplit)
    assert first == {
        "backbone.gpt.embedding.word_embeddings.weight": 0,
        layer.format(0): 0,
        layer.format(1): 1,
    }
    assert last == {
        layer.format(0): 2,
        layer.format(1): 3,
        "backbone.norm.weight": 5,
        "head.out_proj.bias": 6,
    }
    assert stage(1).to_global(layer.format(1)) == layer.format(3)
    assert stage(1).to_global("optim.state." + layer.format(0)) == "optim.state." + layer.format(2)
    assert stage(1).to_global("head.out_proj.bias") == "head.out_proj.bias"


def test_load_plain_state_reads_what_save_pretrained_wrote(alone, tmp_path):
    """`hpref init` writes a megatron-gpt model's transformers-layout folder, and `hpref train`
    starts from it through `load_plain_state`: the model that loads it gives the saved model's
    logits. If this fails, a run started after `hpref init` would train from other weights."""
    from hpref.train.sharding import read_init_weights

    saved = build(tiny_llama=TINY, seed=1)
    with torch.no_grad():
        for param in saved.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    saved.save_pretrained(tmp_path / "init")
    fresh = build(tiny_llama=TINY, seed=2)
    fresh.load_plain_state(read_init_weights(tmp_path / "init"))
    ids, cu, positions = packed_row()
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids, cu, positions), saved(ids, cu, positions))


def _training_steps(num_steps: int, vocab: int):
    """`num_steps` steps of 2 micro-batches of 3 judge rows each (20-90 tokens, soft labels)."""
    from hpref.data.packing import TokenizedExample, collate

    generator = torch.Generator().manual_seed(11)

    def example(row: int) -> TokenizedExample:
        length = int(torch.randint(20, 90, (), generator=generator))
        label = torch.softmax(torch.randn(3, generator=generator) * 2, -1).tolist()
        ids = torch.randint(5, vocab, (length,), generator=generator).tolist()
        return TokenizedExample(ids=ids, label=tuple(label), row=row)

    return [[collate([example(r) for r in range(3)]) for _ in range(2)] for _ in range(num_steps)]


def test_megatron_gpt_takes_tiny_llamas_optimizer_steps_at_the_quickstart_settings(alone, monkeypatch):
    """megatron-gpt and tiny-llama built from the same settings and trained side by side through the
    trainer's `train_step` with the judge quickstart's optimizer (the adamw component: lr 3e-3,
    betas (0.9, 0.99), weight decay 0.01 on matrices only) and a gradient clip that engages, in
    float64, keep the same loss (1e-9), gradient norm and every weight (megatron's mapped to
    transformers names; 1e-6) over 8 steps. float64 because in float32 Adam turns the rounding of
    near-zero gradient entries (each backend sums in its own order) into updates of up to the
    learning rate, so two float32 runs part after a step whatever the code; in float64 what is left
    is megatron-gpt's float32 gradient norm (a clip coefficient ~1e-8 off, ~1e-7 in the weights).
    If this fails, megatron-gpt does not train the model tiny-llama trains (issue #15's parity, which
    megatron-quickstart shows against quickstart): a parameter grouped for weight decay differently,
    a gradient scaled or clipped by another norm, a weight the optimizer does not hold, or a forward
    that differs."""
    import transformers.models.llama.modeling_llama as llama

    from hpref.builtin.models import TinyLlamaConfig, build_tiny_llama
    from hpref.builtin.optimizers import AdamWConfig, build_adamw
    from hpref.models.megatron.convert import megatron_to_hf
    from hpref.train.loop import train_step

    def rms_norm_in_input_dtype(self, hidden):  # transformers' computes in float32 whatever the input
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
    megatron = build(tiny_llama=TINY, seed=3).double().train()
    reference = build_tiny_llama(TinyLlamaConfig(**TINY, seed=3)).double().train()
    optimizer = AdamWConfig(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01)
    optimizers = {id(m): build_adamw(optimizer, m) for m in (megatron, reference)}

    def as_transformers(model) -> dict[str, torch.Tensor]:
        state = {k: v.detach() for k, v in model.named_parameters()}
        backbone = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
        out = {f"backbone.{k}": v for k, v in megatron_to_hf([backbone], model.backbone.shape).items()}
        return out | {k: v for k, v in state.items() if k.startswith("head.")}

    clipped = 0
    for k, batches in enumerate(_training_steps(8, vocab=reference.backbone.config.vocab_size)):
        step = dict(step_sequences=6, world_size=1, grad_clip=0.2, device=torch.device("cpu"))
        loss, norm = train_step(megatron, optimizers[id(megatron)], batches, **step)
        ref_loss, ref_norm = train_step(reference, optimizers[id(reference)], batches, **step)
        assert float(loss) == pytest.approx(float(ref_loss), abs=1e-9), f"step {k}"
        # megatron-gpt sums the squares in float32 (reduce_and_clip_gradients): float32's norm
        assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6), f"step {k}"
        clipped += float(ref_norm) > 0.2
        ours, theirs = as_transformers(megatron), dict(reference.named_parameters())
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            torch.testing.assert_close(ours[key], value.detach(), atol=1e-6, rtol=0, msg=f"step {k}: {key}")
    assert clipped, "the gradient clip never engaged: raise the learning rate or lower grad_clip"


def test_sequence_parallel_pads_a_row_with_one_extra_sequence_only_when_needed():
    """Sequence parallelism splits a packed row into equal parts per tensor-parallel rank: a row is
    padded to a multiple of them by one extra sequence of its own (a new `cu_seqlens` bound), so no
    real sequence's attention or last token changes; a row that already divides is left alone. If
    this fails, padding would join a real sequence (its last token would move) or split unequally."""
    from hpref.models.megatron.sequence_parallel import pad_packed_row

    ids = torch.tensor([[5, 6, 7, 8, 9]])
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    padded, bounds, longest = pad_packed_row(ids, cu, 3, multiple=4)
    assert padded.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert bounds.tolist() == [0, 2, 5, 8] and bounds.dtype == torch.int32
    assert longest == 3
    same = pad_packed_row(ids, cu, 3, multiple=5)
    assert same[0] is ids and same[1] is cu and same[2] == 3
    assert pad_packed_row(ids[:, :1], cu[:2] * 0 + torch.tensor([0, 1], dtype=torch.int32), 1, 8)[2] == 7


def test_a_folder_is_converted_into_the_model_one_tensor_at_a_time(alone, tmp_path, monkeypatch):
    """megatron-gpt built from a transformers folder has the tiny-llama model's logits (same
    weights, same seeded head), and while it converts, at most a handful of the folder's tensors are
    alive at once (each is read when its converted tensor is made, copied into its parameter and
    dropped). If this fails, a folder is loaded wrongly, or a big model's checkpoint (or a converted
    copy of it) is held whole in every rank's memory while the model is built."""
    import weakref

    from hpref.builtin.models import TinyLlamaConfig, build_tiny_llama
    from hpref.models import safetensors_folder

    settings = {**TINY, "num_hidden_layers": 6}
    theirs = build_tiny_llama(TinyLlamaConfig(**settings, seed=5))
    folder = tmp_path / "tiny-llama"
    theirs.backbone.save_pretrained(folder)
    theirs.tokenizer.save_pretrained(folder)

    returned: list[weakref.ref] = []
    most_alive = 0

    class Watched(safetensors_folder.SafetensorsFolder):
        def __getitem__(self, key):
            nonlocal most_alive  # tensors hold no reference cycles: refcounting frees them at once
            most_alive = max(most_alive, sum(ref() is not None for ref in returned))
            tensor = super().__getitem__(key)
            returned.append(weakref.ref(tensor))
            return tensor

    monkeypatch.setattr(safetensors_folder, "SafetensorsFolder", Watched)
    ours = build(path=str(folder), seed=5)
    assert len(returned) == 2 + 9 * 6  # embeddings, final norm; 9 tensors per layer, read once each
    assert most_alive <= 5, most_alive  # the old dict path held all 56
    ids, cu, positions = packed_row()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, cu, positions), theirs(ids, cu, positions), atol=1e-5, rtol=1e-5)


def test_a_meta_built_model_loads_the_same_weights_and_keeps_megatron_marks(alone):
    """The trainer builds megatron-gpt on the meta device (no random CPU initialisation to throw
    away) and then loads its weights: the result equals the eagerly built model, and the parameters
    keep megatron's tensor-parallel marks. If this fails, a training run starts from other weights,
    or (marks lost with the new parameter objects) its tensor-parallel shards would be clipped and
    checkpointed as replicated tensors."""
    from hpref.plugins import load_plugins

    component = load_plugins().get("model", "megatron-gpt")
    lazy = component.build(component.config(tiny_llama=TINY, seed=5), meta=True)
    assert all(p.is_meta for p in lazy.backbone.parameters())
    lazy.load_pretrained_weights(device="cpu")
    assert not any(p.is_meta for p in lazy.parameters())
    qkv = lazy.backbone.gpt.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.tensor_model_parallel and qkv.partition_dim == 0
    assert lazy._params_by_key()["backbone.gpt.decoder.layers.0.self_attention.linear_qkv.weight"] is qkv
    eager = build(tiny_llama=TINY, seed=5)
    ids, cu, positions = packed_row()
    with torch.no_grad():
        torch.testing.assert_close(lazy(ids, cu, positions), eager(ids, cu, positions), atol=0, rtol=0)
