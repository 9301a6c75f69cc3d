"""Memory accounting: what target and draft need, what the machine has, and the plan that fits.

`plan()` is a pure function of model facts and a budget, so it is tested with
literal numbers; `detect_budget()` reads the machine (psutil for RAM, NVML or
nvidia-smi for NVIDIA VRAM, Metal's working-set limit on Apple Silicon).
"""

from __future__ import annotations

import logging
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from edgespec.config import DEFAULT_N_BATCH, DEFAULT_N_CTX, MAX_K
from edgespec.errors import InvalidRequestError, OutOfMemoryError

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
# Bytes per KV element by llama.cpp cache type.
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
MIN_CTX = 256  # llama.cpp pads smaller contexts up to this
HEADROOM = 0.9  # plan within 90% of what is free: the OS, Python and llama.cpp's own arrays need room
OVERHEAD_BYTES = 64 * MiB  # per context: graph metadata, sampler and Python-side arrays


@dataclass(frozen=True)
class ModelMemory:
    """The facts of a GGUF that decide its memory use (from backend.ModelFacts)."""

    name: str
    weights_bytes: int
    n_layer: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_embd: int
    n_ff: int
    n_ctx_train: int

    def kv_bytes_per_token(self, kv_type: str = "f16") -> int:
        per = KV_TYPE_BYTES[kv_type]
        return int(self.n_layer * self.n_head_kv * (self.head_dim_k + self.head_dim_v) * per)

    def compute_bytes(self, n_ubatch: int) -> int:
        # llama.cpp's compute buffer is dominated by one ubatch of logits and FFN activations.
        return int(n_ubatch * (self.n_vocab + 2 * self.n_ff + 4 * self.n_embd) * 4) + OVERHEAD_BYTES

    def logits_bytes(self, rows: int) -> int:
        return rows * self.n_vocab * 4


@dataclass(frozen=True)
class Budget:
    device: str  # "cpu", "cuda", "metal"
    ram_bytes: int  # available host memory
    gpu_bytes: int = 0  # free VRAM, or Metal's working-set limit; 0 without a GPU
    source: str = "detected"


@dataclass
class Plan:
    budget: Budget
    n_ctx: int
    k_max: int
    load_draft: bool
    target_gpu_layers: int
    draft_gpu_layers: int
    rows: list[tuple[str, int]] = field(default_factory=list)  # (item, bytes)
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.rows)

    def to_dict(self) -> dict:
        return {
            "device": self.budget.device, "budget_bytes": self.budget.gpu_bytes or self.budget.ram_bytes,
            "budget_source": self.budget.source, "n_ctx": self.n_ctx, "k_max": self.k_max,
            "load_draft": self.load_draft, "target_gpu_layers": self.target_gpu_layers,
            "draft_gpu_layers": self.draft_gpu_layers, "rows": [{"item": i, "bytes": b} for i, b in self.rows],
            "total_bytes": self.total_bytes, "notes": self.notes,
        }


def plan(
    target: ModelMemory,
    draft: ModelMemory | None,
    budget: Budget,
    *,
    n_ctx: int | None = None,
    k_max: int = MAX_K,
    n_ubatch: int = DEFAULT_N_BATCH,
    kv_type: str = "f16",
    n_seq: int = 1,
) -> Plan:
    """Choose the context size, whether the draft loads, where layers go, and Kmax (at most `k_max`).

    The whole model set lives in one pool: VRAM (or unified memory) when there
    is a GPU, else RAM. With a GPU too small for both, the draft goes to the CPU.
    A verify batch of Kmax+1 tokens is one llama_decode of at most `n_ubatch` tokens,
    with a logits row per token; Kmax shrinks before the target is refused. `n_seq`: KV sequences.
    """
    gpu = budget.gpu_bytes > 0
    pool = int((budget.gpu_bytes if gpu else budget.ram_bytes) * HEADROOM)
    want_ctx = max(n_ctx or min(target.n_ctx_train, DEFAULT_N_CTX), MIN_CTX)  # llama.cpp pads smaller ones up
    notes: list[str] = []
    k_max = _k_max(target, pool, k_max, n_ubatch, kv_type, notes)
    rows = k_max + 1

    def fixed(m: ModelMemory) -> int:
        return m.weights_bytes + m.compute_bytes(n_ubatch) + m.logits_bytes(rows)

    kv_t = target.kv_bytes_per_token(kv_type) * n_seq  # every slot holds the whole context
    need_min = fixed(target) + kv_t * MIN_CTX
    if need_min > pool:
        raise OutOfMemoryError(
            f"{target.name} needs at least {_gib(need_min)} (weights {_gib(target.weights_bytes)}, "
            f"KV {_gib(kv_t * MIN_CTX)} at {MIN_CTX} tokens, buffers {_gib(need_min - target.weights_bytes - kv_t * MIN_CTX)}) "
            f"but {_gib(pool)} of {budget.device} memory is usable: {_gib(need_min - pool)} missing; "
            f"try a smaller quantization (e.g. Q4_K_S or Q3_K_M), a smaller model, or --memory-budget if detection is wrong"
        )
    ctx = min(want_ctx, (pool - fixed(target)) // kv_t)
    if ctx < want_ctx:
        slots = f" ({n_seq} slots of it)" if n_seq > 1 else ""
        notes.append(f"context reduced from {want_ctx} to {ctx} tokens{slots} to fit {_gib(pool)}")

    load_draft = draft is not None
    draft_gpu_layers = 0
    if draft is not None:
        kv_d = draft.kv_bytes_per_token(kv_type) * n_seq
        need = fixed(target) + fixed(draft) + (kv_t + kv_d) * ctx
        if need <= pool:
            draft_gpu_layers = draft.n_layer if gpu else 0
        elif gpu and fixed(draft) + kv_d * ctx <= budget.ram_bytes * HEADROOM:
            notes.append(f"draft {draft.name} runs on the CPU: the GPU has room only for the target")
        else:
            load_draft = False
            notes.append(f"draft {draft.name} not loaded: it needs {_gib(fixed(draft) + kv_d * ctx)} more than the "
                         f"{_gib(pool - fixed(target) - kv_t * ctx)} left after the target")

    items = _items(target, ctx, rows, n_ubatch, kv_type, n_seq)
    if draft is not None and load_draft:
        items += _items(draft, ctx, rows, n_ubatch, kv_type, n_seq)
    return Plan(budget, int(ctx), k_max, load_draft, target.n_layer if gpu else 0, draft_gpu_layers, items, notes)


def _k_max(target: ModelMemory, pool: int, k_max: int, n_ubatch: int, kv_type: str, notes: list[str]) -> int:
    """The most tokens per cycle, at most `k_max`: a verify batch must fit one ubatch, its logits rows the pool."""
    k_max = max(0, min(k_max, MAX_K))
    if k_max + 1 > n_ubatch:
        notes.append(f"Kmax lowered from {k_max} to {n_ubatch - 1}: a verify batch must fit one batch of {n_ubatch}")
        k_max = n_ubatch - 1
    spare_rows = (pool - target.weights_bytes - target.compute_bytes(n_ubatch)
                  - target.kv_bytes_per_token(kv_type) * MIN_CTX) // target.logits_bytes(1)
    if 1 <= spare_rows < k_max + 1:
        notes.append(f"Kmax lowered from {k_max} to {spare_rows - 1}: logits rows for more do not fit {_gib(pool)}")
        k_max = int(spare_rows) - 1
    return k_max


def _items(m: ModelMemory, ctx: int, rows: int, n_ubatch: int, kv_type: str, n_seq: int) -> list[tuple[str, int]]:
    seqs = f" x {n_seq} slots" if n_seq > 1 else ""
    return [(f"{m.name} weights", m.weights_bytes),
            (f"{m.name} KV cache ({ctx} tokens{seqs}, {kv_type})", m.kv_bytes_per_token(kv_type) * ctx * n_seq),
            (f"{m.name} compute buffers", m.compute_bytes(n_ubatch)),
            (f"{m.name} logits ({rows} rows)", m.logits_bytes(rows))]


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'6GiB', '6 GB', '512MiB', '8g' -> bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise InvalidRequestError(f"memory size {text!r} not understood; write it like 6GiB, 6GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[unit])


def detect_budget(gpu_offload: bool, override: int | None = None) -> Budget:
    """What memory the models may use on this machine."""
    import psutil

    ram = psutil.virtual_memory().available
    if sys.platform == "darwin" and platform.machine() == "arm64":
        limit = _metal_working_set(psutil.virtual_memory().total)
        budget = Budget("metal", ram, min(limit, ram), "Metal working-set limit")
    elif gpu_offload and (free := _nvidia_free_bytes()) is not None:
        budget = Budget("cuda", ram, free, "NVIDIA free VRAM")
    else:
        budget = Budget("cpu", ram, 0, "psutil available RAM")
    if override is not None:  # the budget replaces whichever pool the models would live in
        gpu = budget.gpu_bytes > 0
        budget = Budget(budget.device, ram if gpu else override, override if gpu else 0, "--memory-budget")
    return budget


def _metal_working_set(total: int) -> int:
    # Metal's recommendedMaxWorkingSetSize is about 2/3 of RAM up to 36 GiB and 3/4 above;
    # `sysctl iogpu.wired_limit_mb` overrides it when a user has raised it.
    try:
        out = subprocess.run(["sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True, text=True, timeout=2)
        mb = int(out.stdout.strip() or 0)
        if mb > 0:
            return mb * MiB
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return int(total * (0.75 if total > 36 * GiB else 2 / 3))


def _nvidia_free_bytes() -> int | None:
    try:
        import pynvml  # nvidia-ml-py, when installed

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # not installed, no driver, no device: fall back to the CLI
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5)
        return int(out.stdout.splitlines()[0].strip()) * MiB if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None
