"""Memory accounting and placement: what target and draft need, what the machine has, and the plan.

`plan()` is a pure function of model facts and a budget, so it is tested with
literal numbers: it lists every layout of the two models' layers that fits, has
`placement` price each, and takes the fastest. `detect_budget()` reads the machine
(llama.cpp's own device list for GPU memory, psutil for RAM).
"""

from __future__ import annotations

import logging
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

from edgespec.planning import placement
from edgespec.config import DEFAULT_N_BATCH, DEFAULT_N_CTX, MAX_K
from edgespec.errors import InvalidRequestError, OutOfMemoryError
from edgespec.decoding.policy import DRAFT_ACCEPT_EXPECTED, DRAFT_MIN_GAIN

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
# Bytes per KV element by llama.cpp cache type.
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
MIN_CTX = 256  # llama.cpp pads smaller contexts up to this
HEADROOM = 0.9  # plan within 90% of what is free: the OS, Python and llama.cpp's own arrays need room
OVERHEAD_BYTES = 64 * MiB  # per context: graph metadata, sampler and Python-side arrays
MIN_TRADED_CTX = 2048  # the planner gives up context for speed (all layers on the GPU) down to this, not below


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

    @property
    def units(self) -> int:
        """What llama.cpp's n_gpu_layers counts: the repeating layers, then the output layer."""
        return self.n_layer + 1

    def _shares(self) -> tuple[float, float]:
        """Fractions of the weights in one layer and in one vocabulary matrix (embedding or output),
        from the shapes: attention (q, o, k, v) and three FFN matrices per layer."""
        layer = self.n_embd * (2 * self.n_embd + self.n_head_kv * (self.head_dim_k + self.head_dim_v)) \
            + 3 * self.n_embd * self.n_ff
        vocab = self.n_vocab * self.n_embd
        total = self.n_layer * layer + 2 * vocab
        return layer / total, vocab / total

    def gpu_weight_bytes(self, layers: int) -> int:
        """Weights on the GPU with `layers` offloaded: the last repeating layers, then the output layer."""
        layer, vocab = self._shares()
        return int(self.weights_bytes * (min(layers, self.n_layer) * layer + (vocab if layers > self.n_layer else 0)))

    def split(self, layers: int) -> placement.Split:
        """Bytes read per pass on each side; the token embedding is looked up, not read whole."""
        on_gpu = self.gpu_weight_bytes(layers)
        embedding = int(self.weights_bytes * self._shares()[1])
        return placement.Split(on_gpu, max(0, self.weights_bytes - on_gpu - embedding), min(layers, self.units))


@dataclass(frozen=True)
class Budget:
    device: str  # "cpu", "cuda", "metal"
    ram_bytes: int  # available host memory
    gpu_bytes: int = 0  # free VRAM, or Metal's working-set limit; 0 without a GPU
    source: str = "detected"
    gpu_name: str = ""  # as llama.cpp describes the device: placement reads its rated bandwidth from it

    @property
    def unified(self) -> bool:
        """The GPU's memory is the host's (Apple Silicon): what the GPU holds also leaves RAM."""
        return self.device == "metal"


@dataclass(frozen=True)
class Layout:
    target_gpu_layers: int  # of target.units; units means all, the output layer included
    draft_gpu_layers: int | None  # None: no draft
    n_ctx: int


@dataclass(frozen=True)
class Option:
    """A layout the planner considered: its memory, predicted speed and the K it would run at."""

    layout: Layout
    description: str
    gpu_bytes: int
    host_bytes: int
    tokens_per_second: float
    k: int
    measured: bool  # priced from a cached calibration rather than the speed model


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
    options: list[Option] = field(default_factory=list)  # every layout that fits, fastest first
    reason: str = ""  # why the chosen layout won
    chosen: Option | None = None

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.rows)

    def to_dict(self) -> dict:
        return {
            "device": self.budget.device, "gpu": self.budget.gpu_name or None,
            "budget_bytes": self.budget.gpu_bytes or self.budget.ram_bytes, "ram_bytes": self.budget.ram_bytes,
            "budget_source": self.budget.source, "n_ctx": self.n_ctx, "k_max": self.k_max,
            "load_draft": self.load_draft, "target_gpu_layers": self.target_gpu_layers,
            "draft_gpu_layers": self.draft_gpu_layers, "rows": [{"item": i, "bytes": b} for i, b in self.rows],
            "total_bytes": self.total_bytes, "notes": self.notes, "reason": self.reason,
            "layouts": [{"layout": o.description, "gpu_bytes": o.gpu_bytes, "host_bytes": o.host_bytes,
                         "predicted_tokens_per_second": round(o.tokens_per_second, 1), "k": o.k,
                         "priced_from": "calibration" if o.measured else "model"} for o in self.options],
        }


# A measured t(B) at CALIBRATION_BATCHES for ("target" | "draft", GPU layers), when one is cached; else None.
Measured = Callable[[str, int], "tuple[float, ...] | None"]


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
    aside: int = 0,
    target_gpu_layers: int | None = None,
    draft_gpu_layers: int | None = None,
    measured: Measured = lambda which, layers: None,
    accept: float = DRAFT_ACCEPT_EXPECTED,
    keep_draft: bool = False,
) -> Plan:
    """Choose the context size, whether the draft loads, where each model's layers go, and Kmax.

    Every layout that fits is priced (placement) at `accept` per drafted token and the fastest
    taken; one with the draft must beat the best without it by DRAFT_MIN_GAIN (unless `keep_draft`, or the
    draft's layers are given: then the draft loads wherever it fits). The layers are
    `target_gpu_layers` / `draft_gpu_layers` when given. A verify batch of Kmax+1 tokens is one
    llama_decode of at most `n_ubatch` tokens, with a logits row per token; Kmax shrinks before the
    target is refused. `n_seq`: KV sequences, each of the whole context; `aside`: cells of one more.
    """
    gpu = budget.gpu_bytes > 0
    if not gpu:  # a CPU build of llama.cpp offloads nothing, whatever it is asked
        target_gpu_layers = None if target_gpu_layers is None else 0
        draft_gpu_layers = None if draft_gpu_layers is None else 0
    want_ctx = max(n_ctx or min(target.n_ctx_train, DEFAULT_N_CTX), MIN_CTX)  # llama.cpp pads smaller ones up
    notes: list[str] = []
    k_max = _k_max(target, int(budget.ram_bytes * HEADROOM), k_max, n_ubatch, kv_type, notes)
    mem = _Memory(budget, k_max + 1, n_ubatch, kv_type, n_seq, aside)
    _check_target_fits(target, mem, gpu)
    floor = want_ctx if n_ctx else min(want_ctx, MIN_TRADED_CTX)  # a context the user set is not traded for speed
    layouts = _layouts(target, draft, mem, want_ctx, floor, target_gpu_layers, draft_gpu_layers)
    if not layouts:
        raise OutOfMemoryError(f"{target.name} with --gpu-layers {target_gpu_layers} (and the draft's "
                               f"{draft_gpu_layers}) does not fit {_gib(budget.gpu_bytes * HEADROOM)} of GPU memory "
                               f"at {MIN_CTX} tokens; use fewer layers, or leave them out to let the plan choose")
    options = sorted((_price(lay, target, draft, mem, measured, accept, k_max) for lay in layouts),
                     key=lambda o: -o.tokens_per_second)
    chosen, reason = _choose(options, draft, mem, notes, forced=keep_draft or draft_gpu_layers is not None)
    lay = chosen.layout
    if lay.n_ctx < want_ctx:
        slots = f" ({n_seq} slots of it)" if n_seq > 1 else ""
        where = f"{budget.device} memory" if not gpu else "GPU memory" if lay.target_gpu_layers else "RAM"
        notes.append(f"context reduced from {want_ctx} to {lay.n_ctx} tokens{slots} to fit the {where}")
    items = mem.items(target, lay.target_gpu_layers, lay.n_ctx)
    if draft is not None and lay.draft_gpu_layers is not None:
        items += mem.items(draft, lay.draft_gpu_layers, lay.n_ctx)
    return Plan(budget, lay.n_ctx, k_max, lay.draft_gpu_layers is not None, lay.target_gpu_layers,
                lay.draft_gpu_layers or 0, items, notes, options, reason, chosen)


def _check_target_fits(target: ModelMemory, mem: _Memory, gpu: bool) -> None:
    """Refuse, with the numbers, a target that fits nowhere even at the smallest context."""
    if any(mem.fits([(target, g)], MIN_CTX) for g in (range(target.units + 1) if gpu else [0])):
        return
    need = mem.usage(target, 0, MIN_CTX)[1]
    kv = mem.kv_bytes(target, MIN_CTX)
    b = mem.budget
    usable = int(b.ram_bytes * HEADROOM) + (int(b.gpu_bytes * HEADROOM) if gpu and not b.unified else 0)
    raise OutOfMemoryError(
        f"{target.name} needs at least {_gib(need)} (weights {_gib(target.weights_bytes)}, "
        f"KV {_gib(kv)} at {MIN_CTX} tokens, buffers {_gib(need - target.weights_bytes - kv)}) "
        f"but {_gib(usable)} of {b.device} memory is usable: {_gib(need - usable)} missing; "
        f"try a smaller quantization (e.g. Q4_K_S or Q3_K_M), a smaller model, or --memory-budget if detection is wrong"
    )


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


@dataclass(frozen=True)
class _Memory:
    """Bytes a model takes on the GPU and in RAM with some of its layers offloaded, and whether a set fits."""

    budget: Budget
    rows: int  # logits rows of a verify batch
    n_ubatch: int
    kv_type: str
    n_seq: int
    aside: int = 0  # cells of the target's aside sequence (LoadConfig.aside); counted for a draft too, which has none

    def kv_bytes(self, m: ModelMemory, ctx: int) -> int:
        """`m`'s KV cache: `ctx` cells for each slot, and the aside's."""
        return m.kv_bytes_per_token(self.kv_type) * (self.n_seq * ctx + self.aside)

    def usage(self, m: ModelMemory, layers: int, ctx: int) -> tuple[int, int]:
        """(GPU bytes, host bytes): llama.cpp keeps an offloaded layer's KV beside it, logits on the host."""
        on_gpu = m.gpu_weight_bytes(layers)
        kv = self.kv_bytes(m, ctx)
        kv_gpu = kv * min(layers, m.n_layer) // m.n_layer
        compute = m.compute_bytes(self.n_ubatch)
        gpu = on_gpu + kv_gpu + (compute if layers else 0)
        return gpu, m.weights_bytes - on_gpu + kv - kv_gpu + (0 if layers else compute) + m.logits_bytes(self.rows)

    def fits(self, placed: Sequence[tuple[ModelMemory, int]], ctx: int) -> bool:
        gpu = host = 0
        for m, layers in placed:
            g, h = self.usage(m, layers, ctx)
            gpu, host = gpu + g, host + h
        ram = int(self.budget.ram_bytes * HEADROOM)
        if self.budget.gpu_bytes <= 0:
            return gpu == 0 and host <= ram
        vram = int(self.budget.gpu_bytes * HEADROOM)
        return gpu <= vram and (gpu + host if self.budget.unified else host) <= ram

    def max_ctx(self, placed: Sequence[tuple[ModelMemory, int]], want: int) -> int:
        """The largest context up to `want` at which `placed` fits; 0 if not even MIN_CTX does."""
        if not self.fits(placed, MIN_CTX):
            return 0
        lo, hi = MIN_CTX, want
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits(placed, mid) else (lo, mid - 1)
        return lo

    def items(self, m: ModelMemory, layers: int, ctx: int) -> list[tuple[str, int]]:
        seqs = (f" x {self.n_seq} slots" if self.n_seq > 1 else "") + (f" + {self.aside} aside" if self.aside else "")
        kv = self.kv_bytes(m, ctx)
        kv_item = (f"{m.name} KV cache ({ctx} tokens{seqs}, {self.kv_type})", kv)
        tail = [(f"{m.name} compute buffers", m.compute_bytes(self.n_ubatch)),
                (f"{m.name} logits ({self.rows} rows)", m.logits_bytes(self.rows))]
        if not layers:
            return [(f"{m.name} weights", m.weights_bytes), kv_item, *tail]
        on_gpu = m.gpu_weight_bytes(layers)
        return [(f"{m.name} weights on the GPU ({min(layers, m.units)} of {m.units} layers)", on_gpu),
                (f"{m.name} weights in RAM", m.weights_bytes - on_gpu), kv_item, *tail]


def _layouts(target: ModelMemory, draft: ModelMemory | None, mem: _Memory, want: int, floor: int,
             fixed_target: int | None, fixed_draft: int | None) -> list[Layout]:
    """Per place for the draft (none, the GPU, the CPU): the most target layers on the GPU at the wanted
    context, and, if that leaves some in RAM, the whole target on the GPU at a smaller context (down to `floor`)."""
    gpu = mem.budget.gpu_bytes > 0
    places: list[int | None] = [None]
    if draft is not None:
        places = [fixed_draft] if fixed_draft is not None else [None, draft.units, 0] if gpu else [None, 0]
    counts = [fixed_target] if fixed_target is not None else range(target.units, -1, -1) if gpu else [0]
    out: list[Layout] = []
    for d in places:
        extra = [] if d is None or draft is None else [(draft, d)]
        best: tuple[int, int] | None = None  # (context, target layers)
        for g in counts:
            ctx = mem.max_ctx([(target, g), *extra], want)
            if ctx and (best is None or ctx > best[0]):
                best = (ctx, g)
            if ctx == want:
                break
        if best is None:
            continue
        out.append(Layout(best[1], d, best[0]))
        if gpu and fixed_target is None and best[1] < target.units and floor < want:
            ctx = mem.max_ctx([(target, target.units), *extra], want)
            if ctx >= floor:
                out.append(Layout(target.units, d, ctx))
    return list(dict.fromkeys(out))


def _price(lay: Layout, target: ModelMemory, draft: ModelMemory | None, mem: _Memory, measured: Measured,
           accept: float, k_max: int) -> Option:
    b = mem.budget
    bandwidth = placement.gpu_bandwidth(b.device, b.gpu_name)
    placed = [(target, lay.target_gpu_layers)]
    t = measured("target", lay.target_gpu_layers)
    known = t is not None
    t = t or placement.modelled_seconds(target.split(lay.target_gpu_layers), b.device, bandwidth, b.gpu_name)
    d = None
    if draft is not None and lay.draft_gpu_layers is not None:
        placed.append((draft, lay.draft_gpu_layers))
        d = measured("draft", lay.draft_gpu_layers)
        known = known and d is not None
        d = d or placement.modelled_seconds(draft.split(lay.draft_gpu_layers), b.device, bandwidth, b.gpu_name)
    rate, k = placement.predicted_rate(placement.layout_costs(t, d), k_max, accept)
    use = [mem.usage(m, g, lay.n_ctx) for m, g in placed]
    return Option(lay, _describe(lay, target, draft), sum(u[0] for u in use), sum(u[1] for u in use), rate, k, known)


def _describe(lay: Layout, target: ModelMemory, draft: ModelMemory | None) -> str:
    def where(m: ModelMemory, layers: int) -> str:
        if layers == 0:
            return "on the CPU"
        return "on the GPU" if layers >= m.units else f"{layers}/{m.units} layers on the GPU"

    d = "no draft" if draft is None or lay.draft_gpu_layers is None else f"draft {where(draft, lay.draft_gpu_layers)}"
    return f"target {where(target, lay.target_gpu_layers)}, {d}, context {lay.n_ctx}"


def _choose(options: list[Option], draft: ModelMemory | None, mem: _Memory, notes: list[str],
            forced: bool) -> tuple[Option, str]:
    """The fastest option; one with the draft only if it beats the best without by DRAFT_MIN_GAIN (or is forced)."""
    plain = next((o for o in options if o.layout.draft_gpu_layers is None), None)
    drafted = next((o for o in options if o.layout.draft_gpu_layers is not None), None)
    pays = drafted is not None and (plain is None or
                                    drafted.tokens_per_second >= DRAFT_MIN_GAIN * plain.tokens_per_second)
    if drafted is not None and (forced or pays):
        chosen = drafted
        against = f", against {plain.tokens_per_second:.0f} without the draft" if plain else ""
        reason = f"predicted {chosen.tokens_per_second:.0f} tok/s with the draft at K={chosen.k}{against}"
        if draft is not None and chosen.layout.draft_gpu_layers == 0 and mem.budget.gpu_bytes > 0:
            notes.append(f"draft {draft.name} runs on the CPU: that layout is predicted fastest")
        return chosen, reason
    assert plain is not None
    if drafted is not None and draft is not None:
        notes.append(f"draft {draft.name} not loaded: the best layout with it ({drafted.description}) is predicted at "
                     f"{drafted.tokens_per_second:.0f} tok/s, against {plain.tokens_per_second:.0f} without it; "
                     f"it must win by {DRAFT_MIN_GAIN - 1:.0%}")
    elif draft is not None:
        lay = plain.layout
        need = sum(mem.usage(draft, 0, lay.n_ctx))
        notes.append(f"draft {draft.name} not loaded: it needs {_gib(need)} more than the memory left after the target")
    runner = next((o for o in options if o is not plain), None)
    reason = f"predicted {plain.tokens_per_second:.0f} tok/s" + (
        f", against {runner.tokens_per_second:.0f} for {runner.description}" if runner else "")
    return plain, reason


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


def detect_budget(devices: Sequence, override: int | None = None) -> Budget:
    """What memory the models may use on this machine. `devices`: backend.devices(), llama.cpp's view."""
    import psutil

    ram = psutil.virtual_memory().available
    gpu = next((d for d in devices if d.kind in ("gpu", "igpu")), None)
    if gpu is None:
        budget = Budget("cpu", ram, 0, "psutil available RAM")
    else:
        kind = gpu_kind(gpu.name)
        free = gpu.free_bytes or (_metal_working_set(psutil.virtual_memory().total) if kind == "metal" else 0)
        source = "Metal working-set limit" if kind == "metal" else f"{gpu.name} free memory"
        budget = Budget(kind, ram, free, source, gpu.description)
    if override is not None:  # the budget replaces whichever pool the models would live in
        gpu_pool = budget.gpu_bytes > 0
        budget = Budget(budget.device, ram if gpu_pool else override, override if gpu_pool else 0, "--memory-budget",
                        budget.gpu_name)
    return budget


def gpu_kind(device_name: str) -> str:
    """llama.cpp's device name ("CUDA0", "Metal", "Vulkan0", "ROCm0") -> the backend it runs on."""
    n = device_name.lower()
    return next((k for key, k in (("cuda", "cuda"), ("metal", "metal"), ("mtl", "metal"), ("vulkan", "vulkan"),
                                  ("rocm", "rocm"), ("hip", "rocm"), ("sycl", "sycl")) if n.startswith(key)), "gpu")


def idle_gpu_note(devices: Sequence) -> str | None:
    """When this machine has a GPU the installed llama.cpp cannot use: which, and the command that fixes it."""
    if any(d.kind in ("gpu", "igpu") for d in devices):
        return None
    reinstall = 'pip install --force-reinstall --no-cache-dir llama-cpp-python'
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return (f'this Mac\'s GPU is unused: llama-cpp-python was built without Metal; '
                f'CMAKE_ARGS="-DGGML_METAL=on" {reinstall}')
    name = _nvidia_gpu()
    if name:
        return f'{name} is unused: llama-cpp-python was built for the CPU only; CMAKE_ARGS="-DGGML_CUDA=on" {reinstall}'
    return None


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


def _nvidia_gpu() -> str | None:
    """The first NVIDIA GPU's name and free memory, as the driver reports them; None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.free", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=5)
        line = out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return None
    name, _, free = line.partition(",")
    return f"an NVIDIA {name.strip().removeprefix('NVIDIA ')} ({free.strip()} free)" if name else None
