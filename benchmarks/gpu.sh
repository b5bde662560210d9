#!/usr/bin/env bash
# GPU checks for hpref, for a CUDA machine. NOT RUN on the development machine (it has no GPU):
# nothing below has been executed yet; treat the first run as its test.
#
#   bash benchmarks/gpu.sh            # from the repo root, with hpref installed (pip install -e '.[gpu]')
#
# 1. Correctness: the flash_varlen and torch_varlen packed-attention paths must give, per sequence,
#    the logits each sequence gets when run alone (bf16 tolerance), as tests/models/test_attention.py
#    checks for the CPU paths. 1b: a packed prompt group (`PrefixTree`: a prompt, then answers that
#    each see it and themselves) through both kernels on gathered keys (`GatheredKeys`: one call a
#    layer, the kernels' bottom-right causal rule) against the piece-by-piece SDPA path, outputs and
#    gradients: the rule the CPU test assumes of the kernels, checked on the kernels.
# 2. Speed: tokens/s and MFU (hpref's own, against the GPU datasheet bf16 peak) of a ~1B Llama-shaped
#    decoder (hidden 2048, 16 layers, MLP 8192: ~0.97B non-embedding parameters) trained by
#    `hpref train` for a few steps, once per attention backend.
set -euo pipefail
PY=${PY:-python}
OUT=${OUT:-/tmp/hpref-gpu-bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "no CUDA GPU"; exit 1; }

"$PY" - <<'PYEOF'
import torch
from hpref.plugins import load_plugins

assert torch.cuda.is_available()
comp = load_plugins().get("model", "tiny-llama")
cfg = comp.config(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=512, vocab_size=2048, tokenizer_texts=2000, head_dropout=0.0)
model = comp.build(cfg, device="cuda").to(torch.bfloat16).eval()
gen = torch.Generator().manual_seed(0)
lengths = [37, 128, 5, 300, 64]
seqs = [torch.randint(3, 1000, (n,), generator=gen).cuda() for n in lengths]
ids = torch.cat(seqs)
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])
with torch.inference_mode():
    model.attention = "sdpa_segments"
    ref = torch.cat([model(s, torch.tensor([0, len(s)], dtype=torch.int32, device="cuda"),
                           torch.arange(len(s), device="cuda")) for s in seqs])
    for backend in ("flash_varlen", "torch_varlen"):
        model.attention = backend
        try:
            got = model(ids, cu, pos)
        except Exception as exc:  # missing package or kernel: report, keep going
            print(f"{backend}: unavailable ({exc})")
            continue
        err = (got - ref).abs().max().item()
        print(f"{backend}: max |packed - alone| logit difference {err:.4f} -> {'OK' if err < 0.05 else 'FAIL'}")
PYEOF

"$PY" - <<'PYEOF'
import torch
from hpref.models.attention import varlen_attention_forward
from hpref.models.packed_layout import PrefixTree, VarlenContext

gen = torch.Generator().manual_seed(0)
tree = PrefixTree.of(180, [64, 0, 41, 63], device="cuda")  # a GRPO group; an empty answer among them
lengths = [37, 180 + 64 + 41 + 63, 90]  # a plain causal sequence on each side of it
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
qkv = [torch.randn(1, h, sum(lengths), 64, generator=gen).cuda().bfloat16() for h in (8, 2, 2)]

def attend(backend):
    leaves = [t.clone().requires_grad_(True) for t in qkv]
    ctx = VarlenContext(backend=backend, cu_seqlens=cu, max_seqlen=max(lengths), segment_masks=[None, tree, None])
    out, _ = varlen_attention_forward(torch.nn.Module(), *leaves, None, is_causal=True, hpref_varlen=ctx)
    (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
    return [out, *(t.grad for t in leaves)]

ref = attend("sdpa_segments")
for backend in ("flash_varlen", "torch_varlen"):
    try:
        got = attend(backend)
    except Exception as exc:  # missing package or kernel: report, keep going
        print(f"{backend} prefix tree: unavailable ({exc})")
        continue
    errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(got, ref)]
    ok = all(e < 0.05 for e in errs)
    print(f"{backend} prefix tree: max |difference| out/dq/dk/dv {errs} -> {'OK' if ok else 'FAIL'}")
PYEOF

# the ~1B decoder (tiny-llama's settings, random init) and the run shape sections 2-4 and 5b share
DECODER_1B=(--set model.hidden_size=2048 --set model.num_hidden_layers=16 --set model.num_attention_heads=16 \
  --set model.num_key_value_heads=4 --set model.intermediate_size=8192 \
  --set train.precision=bf16 --set train.max_length=2048 --set train.micro_batch_tokens=16384 \
  --set train.max_steps=20 --set train.log_interval=5 --set train.eval_interval=0 \
  --set dataset.train.num_battles=4000)
for backend in flash_varlen torch_varlen; do
  "$PY" -m hpref train recipes/quickstart-judge.toml \
    --set run.output_dir="$OUT" --set run.name="1b-$backend" \
    "${DECODER_1B[@]}" --set model.attention=$backend || { echo "$backend: hpref train failed"; continue; }
  "$PY" -c "import json,sys; s=json.load(open('$OUT/1b-$backend/summary.json')); \
print('$backend', f\"{s['tokens_per_s']:,.0f} tok/s, MFU {s['mfu']:.1%} of {s['peak']}, peak mem {s['peak_memory_gib']:.1f} GiB\")"
done

# 3. LoRA under FSDP2 on GPU (#13): the same ~1B decoder with `--set lora.r=16`: adapters and head in
#    fp32 master weights, the frozen base stored in bf16, nccl; trainable parameters, tokens/s and
#    peak memory against the full fine-tuning run above.
"$PY" -m hpref train recipes/quickstart-judge.toml \
  --set run.output_dir="$OUT" --set run.name="1b-lora" "${DECODER_1B[@]}" --set lora.r=16 || echo "lora: hpref train failed"
"$PY" -c "import json; s=json.load(open('$OUT/1b-lora/summary.json')); \
print('lora', f\"{s['trainable_params']:,} of {s['params']:,} trainable, {s['tokens_per_s']:,.0f} tok/s, peak mem {s['peak_memory_gib']:.1f} GiB\")" || true

# 4. QLoRA under FSDP2 on GPU (#13; `pip install -e '.[gpu]'` brings bitsandbytes): section 3's run
#    with `lora.quantize_base = "4bit"`: the block projections quantised to NF4 on the GPU (built
#    materialised on CPU first), replicated on every rank (FSDP2 ignored params), adapters and head
#    sharded; trainable parameters, tokens/s and peak memory against section 3 (expect a smaller peak).
"$PY" -m hpref train recipes/quickstart-judge.toml \
  --set run.output_dir="$OUT" --set run.name="1b-qlora" "${DECODER_1B[@]}" --set lora.r=16 --set 'lora.quantize_base="4bit"' \
  || echo "qlora: hpref train failed"
"$PY" -c "import json; s=json.load(open('$OUT/1b-qlora/summary.json')); \
print('qlora', f\"{s['trainable_params']:,} of {s['params']:,} trainable, {s['tokens_per_s']:,.0f} tok/s, peak mem {s['peak_memory_gib']:.1f} GiB\")" || true

# 5. The megatron-core backend (`megatron-gpt`, #15; pip install -e '.[gpu,megatron]'). Not run yet.
#    a) Correctness on CUDA: megatron-gpt built from tiny-llama's settings gives tiny-llama's logits
#       on a packed row (fp32; on CUDA megatron's own RoPE path runs, the CPU seam is off, and
#       attention goes through hpref's flash / torch varlen kernels in THD).
"$PY" - <<'PYEOF' || echo "megatron: correctness check failed"
import torch
from hpref.plugins import load_plugins

plugins = load_plugins()
tiny = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            intermediate_size=512, vocab_size=2048, tokenizer_texts=2000)
ref = plugins.get("model", "tiny-llama")
ref = ref.build(ref.config(**tiny, head_dropout=0.0), device="cuda").eval()
meg = plugins.get("model", "megatron-gpt")
meg = meg.build(meg.config(tiny_llama=tiny, head_dropout=0.0), device="cuda").eval()
lengths = [37, 128, 5, 300, 64]
gen = torch.Generator().manual_seed(0)
ids = torch.randint(3, 1000, (sum(lengths),), generator=gen).cuda()
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])
with torch.inference_mode():
    for backend in ("sdpa_segments", "torch_varlen", "flash_varlen"):
        ref.attention = meg.attention = backend
        try:
            err = (meg(ids, cu, pos) - ref(ids, cu, pos)).abs().max().item()
        except Exception as exc:
            print(f"megatron {backend}: unavailable ({exc})")
            continue
        print(f"megatron {backend}: max |megatron - transformers| logit {err:.2e} -> {'OK' if err < 1e-3 else 'FAIL'}")
PYEOF

#    b) Speed: the ~1B decoder of section 2 as the quickstart's reward model (megatron-quickstart
#       mirrors recipes/quickstart.toml), on FSDP2 (one GPU) and on megatron-gpt with TP = 1 on one
#       GPU and TP = 2 over two GPUs where they exist (tensor-parallel over nccl): the same task, so
#       the tokens/s compare.
MEGATRON_1B=(--set run.output_dir="$OUT" "${DECODER_1B[@]/#model./model.tiny_llama.}" \
  --set model.attention=flash_varlen)
"$PY" -m hpref train recipes/quickstart.toml --set run.output_dir="$OUT" --set run.name="1b-fsdp-reward" \
  "${DECODER_1B[@]}" --set model.attention=flash_varlen --set launch.nproc=1 || echo "fsdp reward: hpref train failed"
"$PY" -c "import json; s=json.load(open('$OUT/1b-fsdp-reward/summary.json')); \
print('fsdp2 reward', f\"{s['tokens_per_s']:,.0f} tok/s, MFU {s['mfu']:.1%} of {s['peak']}, peak mem {s['peak_memory_gib']:.1f} GiB\")" || true
GPUS=$(nvidia-smi --list-gpus | wc -l)
for tp in 1 2; do
  if [ "$tp" -gt "$GPUS" ]; then echo "megatron tp=$tp: needs $tp GPUs, this machine has $GPUS"; continue; fi
  "$PY" -m hpref train recipes/megatron-quickstart.toml "${MEGATRON_1B[@]}" --set run.name="1b-megatron-tp$tp" \
    --set model.tensor_parallel=$tp --set launch.nproc=$tp || { echo "megatron tp=$tp: hpref train failed"; continue; }
  "$PY" -c "import json; s=json.load(open('$OUT/1b-megatron-tp$tp/summary.json')); \
print('megatron tp=$tp', f\"{s['tokens_per_s']:,.0f} tok/s, MFU {s['mfu']:.1%} of {s['peak']}, peak mem {s['peak_memory_gib']:.1f} GiB\")"
done
# TP = 2 with sequence parallelism (activations outside attention / MLP split by tokens): same
# tokens/s or better, and lower peak memory than tp=2 above
if [ "$GPUS" -ge 2 ]; then
  "$PY" -m hpref train recipes/megatron-quickstart.toml "${MEGATRON_1B[@]}" --set run.name="1b-megatron-tp2-sp" \
    --set model.tensor_parallel=2 --set model.sequence_parallel=true --set launch.nproc=2 \
    && "$PY" -c "import json; s=json.load(open('$OUT/1b-megatron-tp2-sp/summary.json')); \
print('megatron tp=2 + sequence parallel', f\"{s['tokens_per_s']:,.0f} tok/s, MFU {s['mfu']:.1%}, peak mem {s['peak_memory_gib']:.1f} GiB\")" \
    || echo "megatron tp=2 + sequence parallel: hpref train failed"
  # PP = 2 (hpref's GPipe schedule over NCCL point-to-point): the same losses as tp=1 above for the
  # first steps (compare metrics.jsonl), tokens/s and the peak memory of each stage
  "$PY" -m hpref train recipes/megatron-quickstart.toml "${MEGATRON_1B[@]}" --set run.name="1b-megatron-pp2" \
    --set model.pipeline_parallel=2 --set launch.nproc=2 \
    && "$PY" -c "import json; s=json.load(open('$OUT/1b-megatron-pp2/summary.json')); \
print('megatron pp=2', f\"{s['tokens_per_s']:,.0f} tok/s, MFU {s['mfu']:.1%}, peak mem {s['peak_memory_gib']:.1f} GiB\")" \
    || echo "megatron pp=2: hpref train failed"
fi

# 4. The vLLM rollout engine (#24) against the transformers engine on a ~1B policy: a Llama of the
#    DECODER_1B shape (random init: speed only) saved as a causal-LM folder, 8 HH-RLHF prompts x 4
#    answers of 64 tokens per rollout, bf16 vLLM (CUDA build: pip install -e '.[gpu,vllm]') vs
#    transformers `generate`. Needs ../shared for the prompts. Target: vLLM >= 4x the transformers
#    engine's generated tokens/s (it is ~7x on SmolLM2-135M on 2 CPU cores; benchmarks/README.md).
"$PY" - "$OUT/policy-1b" <<'PYEOF'
import sys
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from hpref.models.causal_lm import policy_folder
from hpref.recipe.rl import PolicyModelConfig

folder = sys.argv[1]
config = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=49152, max_position_embeddings=4096,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
# SmolLM2's tokenizer and chat template: the prompts get the same layout as on the CPU benchmark
AutoTokenizer.from_pretrained(policy_folder(PolicyModelConfig(name="smollm2"))).save_pretrained(folder)
PYEOF
"$PY" -m benchmarks.rl_engines --policy "$OUT/policy-1b" --contenders transformers,vllm-bf16 --rounds 2 \
  --out "$OUT/rl-engines-1b.json" || echo "rl engines: benchmark failed"

# 5. The RL half on one GPU (#36): a policy's trainer rank on the GPU Ray assigns (gpus_per_rank, bf16
#    autocast) beside its engine (vLLM when it imports with CUDA, else the transformers engine on CPU,
#    said in the output), SmolLM2-135M and the ~1B policy of section 4: trainer tokens/s and MFU
#    (against the datasheet bf16 peak, named in the line), engine tokens/s, one bucketed weight sync's
#    seconds, the trainer's peak CUDA memory (one JSON line each).
#    Target: both within 10 minutes on one H100.
timeout 300 "$PY" -m benchmarks.rl_gpu || echo "rl gpu (smollm2): failed"
timeout 300 "$PY" -m benchmarks.rl_gpu --policy "$OUT/policy-1b" --updates 2 || echo "rl gpu (1b): failed"

# 5c. The RL trainer's layouts on the GPU (#51): `benchmarks.rl_trainer_speed --gpu`: the shipped
#    SmolLM2 LoRA recipe's policy, GRPO with KL, bf16 autocast, the prompt-group layout against the
#    packed one (its prompt groups in one varlen kernel call a layer) on the same rollouts,
#    interleaved: trained tokens/s, MFU against the datasheet bf16 rate, each step's peak CUDA
#    memory; then the tool recipe's multi-turn episodes. On 2 CPU cores packed was 1.22x (GRPO) and
#    1.55x (episodes) of the group layout in fp32 (benchmarks/README.md); expect more here, where
#    padding is the work a GPU wastes and the CPU path's call per answer is gone.
timeout 300 "$PY" -m benchmarks.rl_trainer_speed --gpu --precision bf16 --steps 6 || echo "rl trainer speed (gpu): failed"
timeout 300 "$PY" -m benchmarks.rl_trainer_speed --gpu --precision bf16 --steps 6 --episodes \
  || echo "rl trainer speed (gpu, episodes): failed"

# 6. LoRA policies on one shared base on one GPU (#37): `benchmarks.rl_shared --gpu`: SmolLM2 LoRA
#    policies on vLLM (multi-LoRA: one LLM, an adapter per policy) with trainer ranks on the GPU, two
#    policies shared against the same two apart and against one alone; 2 rollouts each, one round.
#    Expect shared-2 well under 2 x alone (one engine batches both policies' prompts; the GPU is not
#    the bottleneck a 2-core CPU is) and its GPU memory near one policy's.
timeout 600 "$PY" -m benchmarks.rl_shared --gpu --rollouts 2 --rounds 1 --runs alone,shared-2,separate-2 \
  --once "" --engine-adapters "" --out "$OUT/rl-shared-gpu.json" || echo "rl shared (gpu): failed"

# 6b. Policies that meet on one GPU (#50): `benchmarks.rl_debate --gpu`: two SmolLM2 LoRA policies in
#    `debate` (recipes/rl-debate-smollm2.toml) on vLLM with trainer ranks on the GPU, shared base
#    (one vLLM engine, an adapter per policy, both policies' turns batched) against apart; 2 updates.
#    Needs runs/minilm-reward-helpful-f{0,1}-export (README, "Multi-policy RL"). Expect shared at or
#    under separate's seconds per update (on 2 CPU cores it was x1.49: one engine process on one core).
if [ -d runs/minilm-reward-helpful-f0-export ]; then
  timeout 900 "$PY" -m benchmarks.rl_debate --gpu --updates 2 --eval-prompts 4 --runs separate,shared \
    --out "$OUT/rl-debate-gpu.json" || echo "rl debate (gpu): failed"
fi

# 7. DPO on one GPU (#38). Not run yet.
#    a) Offline DPO of SmolLM2-135M (recipes/dpo-smollm2.toml: LoRA r 16, HH-RLHF helpful-base from
#       ../shared) in bf16 on nccl, packed pairs through flash_varlen / torch_varlen attention, 32 steps of
#       8 pairs: tokens/s and peak memory from the run's summary; then `hpref save` and vLLM loads the
#       merged export (the CPU test, tests/train/test_dpo_train.py, does the same on vLLM's CPU build).
#       Expect the first step's loss at exactly log 2 (policy = reference) and no truncated pair.
if [ -f ../shared/data/hh-rlhf-helpful-base-test.jsonl.gz ]; then
  timeout 600 hpref train dpo-smollm2 --set run.output_dir="\"$OUT/runs\"" --set train.max_steps=32 \
    --set train.precision='"bf16"' --set launch.backend='"nccl"' --set train.eval_interval=0 \
    --set train.eval_steps=0 || echo "dpo (offline, gpu): failed"
  timeout 300 hpref save "$OUT/runs/dpo-smollm2" --to "$OUT/dpo-smollm2-export" || echo "dpo save: failed"
  "$PY" - "$OUT/dpo-smollm2-export" <<'PYEOF' || echo "dpo export on vLLM: failed"
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True)
out = llm.generate(["Write one sentence about the sea."], SamplingParams(max_tokens=32, temperature=0))
print("vLLM loaded the DPO export:", repr(out[0].outputs[0].text))
PYEOF
#    b) Online DPO on the GPU: one SmolLM2 LoRA policy with `algorithm = "online-dpo"` (sigmoid, beta
#       0.1), 8 prompts x 2 answers per update, its trainer rank on the GPU (bf16 autocast) and vLLM
#       sampling beside it on the same GPU (colocated), the MiniLM reward export judging the pairs;
#       3 rollouts. Needs runs/minilm-reward-helpful-f{0,1}-export (README, "Multi-policy RL").
#       Expect seconds per update well under the CPU's (benchmarks/README.md, "Online DPO vs TRL").
  timeout 900 hpref rl rl-smollm2 --policies a --set run.output_dir="\"$OUT/runs\"" --set rl.num_rollouts=3 \
    --set rl.eval_interval=0 --set rl.save_interval=0 --set rl.rollout.eval_prompts=4 \
    --set rl.rollout.group_size=2 --set 'rl.defaults.algorithm={ name = "online-dpo", loss_type = "sigmoid" }' \
    --set rl.defaults.gpus_per_rank=0.5 --set rl.colocate=true --set rl.engine.name='"vllm"' \
    --set rl.engine.num_gpus=0.5 --set rl.engine.gpu_memory_utilization=0.3 || echo "online dpo (gpu): failed"
fi
