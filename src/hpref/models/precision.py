"""The compute dtype of a step: `precision = "auto" | "fp32" | "bf16"`, with `auto` measured.

Used by `hpref train` (the preference model's FSDP2 mixed precision, offline DPO), by `hpref rl` (a
policy trainer's autocast, an engine's prompt prefill) and by a scored export (the `judge` reward,
`hpref serve`), so all read one rule.

`auto` on CUDA is bf16 where the device supports it. On a CPU, which of fp32 and bf16 is faster
depends on the CPU and the model's width, and no flag predicts it: on an Intel Xeon with
AVX512-BF16 and no AMX, SmolLM2's RL step took 22.8 s under bf16 against 13.4 s in fp32, while on a
2-core AMD EPYC with the same flag bf16 ran a MiniLM train step at twice fp32's speed. So `auto`
measures (`probe_timings`): forward and backward of `PROBE_BLOCKS` Llama-shaped blocks of the
model's own hidden size, MLP width and heads, in fp32 and under bf16 autocast, alternating, best
round of each; bf16 wins only when it is at least `BF16_MARGIN` faster. The decision and both
timings are logged and cached in `$HPREF_CACHE/precision.json` (`~/.cache/hpref`), keyed by the
machine (CPU model and flags), the torch build, the thread count and the shape, so the probe runs
once per machine and model shape (`hpref doctor` lists what was measured).

No probe where its answer is known: a CPU without bf16 instructions (no AVX512-BF16 or AMX: bf16
is emulated) or a model narrower than `CPU_BF16_MIN_HIDDEN` (the casts cost more than the matmuls
save: `python -m benchmarks.precision_step`, 2-core Xeon with AMX, bf16 / fp32 tokens/s at hidden
64: 0.87x, 128: 0.94x) stays fp32. `HPREF_AUTO_PRECISION=fp32|bf16` pins what `auto` takes where it
would measure, without measuring (the test suite pins it so that no test's precision depends on a
probe's timing).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

if TYPE_CHECKING:
    import torch

#: Narrowest model for which `precision = "auto"` measures bf16 on a CPU (see the module docstring).
CPU_BF16_MIN_HIDDEN = 256
#: `auto` pins: what it takes where it would measure ("fp32" or "bf16"), without measuring.
PIN_ENV = "HPREF_AUTO_PRECISION"
#: The probe's blocks, tokens and rounds: 0.6-1.2 s in all for 384-576 wide models on one thread of
#: a 2-core AMD EPYC (a smaller probe, 64 tokens, flipped its decision under load: too few FLOPs)
PROBE_BLOCKS = 2
PROBE_TOKENS = 128
PROBE_ROUNDS = 3
#: bf16 must be this much faster (time ratio) to be chosen: within noise, fp32 keeps full precision.
BF16_MARGIN = 0.95
#: The shipped recipes' model shapes, which `hpref doctor` measures (through the cache).
SHIPPED_SHAPES = {
    "MiniLM-L6 (minilm-reward)": (384, 1536, 12),
    "SmolLM2-135M (rl, dpo)": (576, 1536, 9),
}
CACHE_FILE = "precision.json"
CACHE_VERSION = 1


@dataclass(frozen=True)
class ProbeShape:
    """The widths of a model's blocks the probe runs: hidden size, MLP width, attention heads."""

    hidden: int
    intermediate: int
    heads: int

    @classmethod
    def of(cls, config: Any) -> ProbeShape | None:
        """A transformers-style config's shape (`hidden_size`, `intermediate_size`,
        `num_attention_heads`); None when it has no hidden size."""
        hidden = getattr(config, "hidden_size", None)
        if not isinstance(hidden, int):
            return None
        intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
        heads = getattr(config, "num_attention_heads", None) or max(1, hidden // 64)
        if hidden % heads:
            heads = 1
        return cls(hidden, int(intermediate), int(heads))

    def describe(self) -> str:
        return f"hidden {self.hidden}, MLP {self.intermediate}, {self.heads} heads"


@dataclass(frozen=True)
class ProbeResult:
    """What `auto` decided for one shape on this machine, and the timings it decided from (seconds
    per forward + backward of the probe's blocks; None when nothing was measured)."""

    dtype_name: str
    fp32_s: float | None
    bf16_s: float | None
    reason: str

    def describe(self) -> str:
        if self.fp32_s is None or self.bf16_s is None:
            return f"{self.dtype_name} ({self.reason})"
        return (
            f"{self.dtype_name} (measured: fp32 {self.fp32_s * 1e3:.1f} ms, bf16 {self.bf16_s * 1e3:.1f} ms "
            f"per forward + backward of {PROBE_BLOCKS} blocks x {PROBE_TOKENS} tokens; {self.reason})"
        )


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first CPU's feature flags (Linux); empty elsewhere."""
    return set(_cpuinfo_field(cpuinfo, "flags").split())


def _cpuinfo_field(cpuinfo: Path, name: str) -> str:
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(name):
            return line.partition(":")[2].strip()
    return ""


def cpu_has_fast_bf16() -> bool:
    """True on x86 CPUs with bf16 instructions: AMX tiles (Intel Sapphire Rapids and later) or
    AVX512-BF16 (AMD Zen 4, Intel Cooper Lake). Whether bf16 is then faster is measured
    (`auto_precision`); without them bf16 is emulated, and never is."""
    import torch

    probes = [
        getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    ]
    try:
        return any(bool(probe()) for probe in probes if probe is not None)
    except Exception:  # an old build without the probes
        return False


def machine_key(shape: ProbeShape) -> str:
    """The cache key of a probe: CPU model and flags, torch version and build, threads, shape."""
    return f"{_machine()}|{shape.hidden}x{shape.intermediate}x{shape.heads}"


def _machine() -> str:
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    cpu = _cpuinfo_field(cpuinfo, "model name") or platform.processor() or platform.machine()
    flags = hashlib.sha256(" ".join(sorted(cpu_flags(cpuinfo))).encode()).hexdigest()[:12]
    build = torch.__config__.show() if hasattr(torch, "__config__") else ""
    torch_id = f"{torch.__version__}:{hashlib.sha256(build.encode()).hexdigest()[:12]}"
    return f"{cpu}|{flags}|torch {torch_id}|{torch.get_num_threads()} threads"


def measured_here() -> dict[ProbeShape, ProbeResult]:
    """Every shape probed on this machine, torch build and thread count, from the cache."""
    here, found = _machine() + "|", {}
    for key, entry in read_cache().items():
        dims = key.removeprefix(here).split("x") if key.startswith(here) else []
        if len(dims) == 3 and all(d.isdigit() for d in dims) and isinstance(entry, dict):
            shape = ProbeShape(*(int(d) for d in dims))
            found[shape] = ProbeResult(
                str(entry.get("dtype")), entry.get("fp32_s"), entry.get("bf16_s"), "cached"
            )
    return found


def cache_path() -> Path:
    """`$HPREF_CACHE/precision.json`, else `~/.cache/hpref/precision.json`."""
    from hpref.cache_root import cache_root

    return cache_root() / CACHE_FILE


def read_cache(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """The cached probes by key; an unreadable or foreign file counts as empty (it is rewritten)."""
    try:
        data = json.loads((path or cache_path()).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("probes")
    return entries if isinstance(entries, dict) else {}


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    path = cache_path()
    entries = read_cache(path)
    entries[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks and actors may write at once
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "probes": entries}, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:  # a read-only home: the decision still holds for this process
        logger.warning(f"precision auto: could not cache the probe in {path}: {exc}")


def _probe_blocks(shape: ProbeShape) -> Any:
    """`PROBE_BLOCKS` pre-norm Llama-style blocks (attention through SDPA, SiLU-gated MLP), fp32."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h, i = shape.hidden, shape.intermediate
            self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
            self.qkv, self.out = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
            self.gate_up, self.down = nn.Linear(h, 2 * i, bias=False), nn.Linear(i, h, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[1]
            q, k, v = self.qkv(self.norm1(x)).view(1, t, 3, shape.heads, -1).permute(2, 0, 3, 1, 4)
            attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(attn.transpose(1, 2).reshape(1, t, -1))
            gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
            return x + self.down(nn.functional.silu(gate) * up)

    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(PROBE_BLOCKS)))


def probe_timings(shape: ProbeShape) -> tuple[float, float]:
    """(fp32, bf16) seconds of one forward + backward of the probe's blocks on `PROBE_TOKENS` tokens,
    the best of `PROBE_ROUNDS` rounds after a warm-up each, the two precisions alternating so a
    noisy machine treats both alike. It leaves the caller's random state, grad mode and autocast as
    they were: a run's numbers never depend on whether its probe ran or was read from the cache."""
    import torch

    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
        return _timed_probe(shape)


def _timed_probe(shape: ProbeShape) -> tuple[float, float]:
    import torch

    blocks = _probe_blocks(shape)
    x = torch.randn(1, PROBE_TOKENS, shape.hidden)
    best = {False: float("inf"), True: float("inf")}

    def step(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = blocks(x).float().square().mean()
        loss.backward()
        blocks.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for bf16 in (False, True):
        step(bf16)  # oneDNN's first call per shape and dtype picks its kernels
    for _ in range(PROBE_ROUNDS):
        for bf16 in (False, True):
            best[bf16] = min(best[bf16], step(bf16))
    return best[False], best[True]


def auto_precision(shape: ProbeShape | None, *, measure: bool = True) -> ProbeResult:
    """`auto`'s CPU decision for `shape` (see the module docstring): a pin, a known answer, the
    cache, or (with `measure`) a probe, cached; without `measure` an unmeasured shape says so."""
    if shape is None:
        return ProbeResult("fp32", None, None, "no model shape to measure")
    if shape.hidden < CPU_BF16_MIN_HIDDEN:
        return ProbeResult("fp32", None, None, f"narrower than {CPU_BF16_MIN_HIDDEN}: casts cost more")
    if not cpu_has_fast_bf16():
        return ProbeResult("fp32", None, None, "no AVX512-BF16 or AMX: bf16 would be emulated")
    pinned = os.environ.get(PIN_ENV, "").strip()
    if pinned in ("fp32", "bf16"):
        return ProbeResult(pinned, None, None, f"pinned by {PIN_ENV}")
    key = machine_key(shape)
    cached = read_cache().get(key)
    if isinstance(cached, dict) and cached.get("dtype") in ("fp32", "bf16"):
        return ProbeResult(cached["dtype"], cached.get("fp32_s"), cached.get("bf16_s"), "cached")
    if not measure:
        return ProbeResult("fp32", None, None, "not measured on this machine yet")
    fp32_s, bf16_s = probe_timings(shape)
    name = "bf16" if bf16_s < BF16_MARGIN * fp32_s else "fp32"
    _write_cache(key, {"dtype": name, "fp32_s": fp32_s, "bf16_s": bf16_s, "measured": time.time()})
    return ProbeResult(name, fp32_s, bf16_s, f"probed now, cached in {cache_path()}")


def resolve_precision(precision: str, device: torch.device, shape: ProbeShape | None = None) -> torch.dtype:
    """The compute dtype of `precision` on `device` for a model of `shape` (`ProbeShape.of(config)`):
    `fp32` and `bf16` as named; `auto` bf16 on CUDA where supported, on a CPU what `auto_precision`
    measured faster (logged with its timings; in a process group, rank 0's decision for every rank:
    call it on every rank, as the trainers do)."""
    import torch

    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    # a process group's ranks must compute alike (FSDP2 shards one dtype): rank 0 decides, alone
    # on the cores, and the others take its answer (a rank on another machine included)
    result = auto_precision(shape) if not grouped or dist.get_rank() == 0 else None
    if grouped:
        shared = [result]
        dist.broadcast_object_list(shared, src=0)
        result = shared[0]
    assert result is not None
    where = f" for {shape.describe()}" if shape is not None else ""
    logger.info(f"precision auto{where}: {result.describe()}")
    return torch.bfloat16 if result.dtype_name == "bf16" else torch.float32


def precision_rows(*, measure: bool = True) -> dict[str, str]:
    """`hpref doctor`'s rows: `auto`'s CPU decision for each shipped model shape (measured once,
    cached) and for every other shape measured on this machine, with both timings."""
    import torch

    shipped = {ProbeShape(*dims): name for name, dims in SHIPPED_SHAPES.items()}
    rows = {}
    for shape, name in shipped.items():
        result = auto_precision(shape, measure=measure)
        rows[f"auto precision, {name}"] = f"{result.describe()}; {shape.describe()}"
    for shape, result in measured_here().items():
        if shape not in shipped:
            rows[f"auto precision, {shape.describe()}"] = result.describe()
    threads = torch.get_num_threads()
    rows["auto precision cache"] = f"{cache_path()} (measured at {threads} torch thread(s); {PIN_ENV} pins)"
    return rows
