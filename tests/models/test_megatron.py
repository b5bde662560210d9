"""The megatron-core backbone (issue #15): same numbers as transformers on packed batches, lossless
weight conversion both ways, tensor parallelism over gloo equal to one rank, one-line refusals."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is the optional [megatron] extra")

from hpref.errors import UserError  # noqa: E402
from hpref.models.attention import CONTEXT_KWARG  # noqa: E402
from hpref.models.megatron import MegatronBackbone  # noqa: E402
from hpref.models.megatron.convert import (  # noqa: E402
    hf_to_megatron,
    megatron_to_hf,
    shape_of,  # noqa: E402
)
from hpref.models.packed_layout import VarlenContext  # noqa: E402

WORKER = Path(__file__).with_name("megatron_tp_worker.py")
LENGTHS = [5, 9, 3]


def tiny_config(model_type: str = "llama", **overrides):
    from transformers import AutoConfig

    settings = dict(
        vocab_size=99,  # odd: the tensor-parallel embedding pads it to a multiple of the ranks
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
    )
    settings.update(overrides)
    return AutoConfig.for_model(model_type, **settings)


def hf_model(config, seed: int = 0):
    from transformers import AutoModel

    torch.manual_seed(seed)
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # random norms and biases, so a swapped or dropped one shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    return model


@pytest.fixture
def model_parallel():
    """megatron's parallel state over a one-rank gloo group in this process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def packed_batch(vocab: int):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (sum(LENGTHS),), generator=generator)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return ids, positions, cu


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_megatron_backbone_matches_transformers_on_a_packed_batch(model_parallel, model_type):
    """Every token's final hidden state from megatron-core's GPTModel (fused QKV per query group,
    fused gate/up, RoPE from cu_seqlens, hpref's varlen attention) equals transformers' model run on
    each sequence alone, fp32, 1e-4. If this fails, a converted checkpoint is a different model: a
    head or group permuted in the QKV fusion, gate and up swapped, RoPE positions not restarting
    per packed sequence, or Qwen2's Q/K/V biases lost."""
    config = tiny_config(model_type)
    reference = hf_model(config)
    shape = shape_of(config)
    backbone = MegatronBackbone(shape)
    backbone.load_hf_state(reference.state_dict())
    ids, positions, cu = packed_batch(config.vocab_size)
    ctx = VarlenContext(backend="sdpa_segments", cu_seqlens=cu, max_seqlen=max(LENGTHS))
    with torch.no_grad():
        ours = backbone(ids[None], positions[None], **{CONTEXT_KWARG: ctx}).last_hidden_state[0]
        theirs = torch.cat(
            [
                reference(input_ids=ids[a:b][None], position_ids=positions[a:b][None]).last_hidden_state[0]
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
            ]
        )
    assert ours.shape == (sum(LENGTHS), config.hidden_size)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_weight_conversion_round_trips_exactly(tp_size):
    """transformers -> megatron shards (one per tensor-parallel rank) -> transformers gives back every
    tensor bit for bit, with no key added or lost. If this fails, `hpref save` of a megatron run
    exports different weights than it trained (or cannot be loaded by transformers)."""
    config = tiny_config("qwen2")
    state = {k: v for k, v in hf_model(config).state_dict().items()}
    shape = shape_of(config)
    shards = [hf_to_megatron(state, shape, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    if tp_size == 2:  # each rank holds half of every split tensor, the padded vocab included
        embed = shards[0]["gpt.embedding.word_embeddings.weight"]
        assert embed.shape == (shape.padded_vocab(2) // 2, config.hidden_size) == (50, 64)
    back = megatron_to_hf(shards, shape)
    assert set(back) == set(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_conversion_from_a_folder_reads_each_tensor_once_when_it_needs_it(tmp_path):
    """A causal-LM folder split over two safetensors files (`model.`-prefixed keys, an LM head) is
    converted from a `SafetensorsFolder` to the same shards as from the loaded state dict, reading
    each backbone tensor exactly once and the LM head never. If this fails, converting a big model
    would hold the whole checkpoint in memory on every rank (or read tensors twice, e.g. through
    Mapping's default `in`)."""
    from safetensors.torch import save_file

    from hpref.models.safetensors_folder import SafetensorsFolder

    config = tiny_config()
    state = {f"model.{k}": v.contiguous() for k, v in hf_model(config).state_dict().items()}
    state["lm_head.weight"] = torch.randn(config.vocab_size, config.hidden_size)
    keys = sorted(state)
    files = [tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"]
    save_file({k: state[k] for k in keys[::2]}, str(files[0]))
    save_file({k: state[k] for k in keys[1::2]}, str(files[1]))

    reads: list[str] = []

    class Counting(SafetensorsFolder):
        def __getitem__(self, key):
            reads.append(key)
            return super().__getitem__(key)

    folder = Counting(files)
    assert set(folder) == set(state) and "lm_head.weight" in folder and "nothing" not in folder
    assert reads == []  # listing and `in` read nothing
    shape = shape_of(config)
    lazy = hf_to_megatron(folder, shape, tp_rank=1, tp_size=2)
    eager = hf_to_megatron(state, shape, tp_rank=1, tp_size=2)
    assert sorted(reads) == sorted(k for k in state if k != "lm_head.weight")
    assert set(lazy) == set(eager)
    for key, value in eager.items():
        assert torch.equal(lazy[key], value), key


def test_unsupported_configs_are_refused_in_one_line():
    """A config that does not map onto megatron's GPT layer is a one-line UserError naming what is
    wrong, not a silent wrong model. If this fails, e.g. a GPT-2 (GELU, learned positions) or a
    Llama-3.1 scaled-RoPE folder would be converted into a model that computes something else."""
    from transformers import GPT2Config

    with pytest.raises(UserError, match="model_type is 'gpt2'"):
        shape_of(GPT2Config())
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}
    scaled = tiny_config(rope_scaling={**llama3_rope, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    with pytest.raises(UserError, match="rope_type is 'llama3'"):
        shape_of(scaled)
    with pytest.raises(UserError, match="must divide the 2 key/value heads"):
        from hpref.models.megatron import transformer_config

        transformer_config(shape_of(tiny_config()), tp_size=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_tp(folder: Path, out: Path) -> dict:
    """megatron_tp_worker.py on two gloo ranks: each mode's losses and gathered weights."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _attempt in range(3):  # a free port can be taken by another test's process before torchrun binds it
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={_free_port()}",
            str(WORKER),
        ]
        done = subprocess.run(
            [*cmd, str(folder), str(out)], env=env, capture_output=True, text=True, timeout=300
        )
        if "EADDRINUSE" not in done.stderr:
            break
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in done.stderr  # megatron's CUDA advice, off on CPU
    return json.loads(out.read_text())


@pytest.mark.slow
def test_tensor_parallel_over_two_gloo_ranks_equals_one_rank(tmp_path):
    """TP = 2 on two CPU processes (gloo), without and with sequence parallelism, gives the loss curve
    of TP = 1 over four SGD steps, and the trained weights gathered back into transformers keys
    agree. If this fails, megatron's tensor-parallel split of hpref's conversion (query groups,
    gate/up halves, row-parallel inputs, padded vocab) or its collectives on gloo differ from the
    one-rank model; with sequence parallel, the padding of the odd-length row, the gather of the
    output or the sum of the norms' partial gradients is wrong."""
    folder = tmp_path / "tiny-llama"
    hf_model(tiny_config()).save_pretrained(folder)
    runs = _run_tp(folder, tmp_path / "tp.json")
    one = runs["tp1"]
    assert one["losses"][-1] < one["losses"][0]  # the steps did train
    for mode in ("tp2", "tp2-sequence-parallel"):
        run = runs[mode]
        assert run["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-6), mode
        assert set(run["checksum"]) == set(one["checksum"])
        for key, value in one["checksum"].items():
            assert run["checksum"][key] == pytest.approx(value, rel=1e-4, abs=1e-4), key
