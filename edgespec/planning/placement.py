"""What a layout of layers would cost per pass, before anything is loaded: the planner's speed model.

A decode pass reads every weight once, so a model's t(1) is the bytes each device
holds over that device's bandwidth, plus a launch cost per layer on a GPU; a batch
of B costs t(1) times the device's batch curve. These are priors from published
figures (docs/notes/published-gpu-figures.md) and this project's own measurements
(FACTS.md); a GPU measured by scripts/gpu_proof.py has its own curve in measured_curves.json,
by the name llama.cpp gives it. A calibration cached for the same files, layers and machine
replaces all of them (costs.measured), and the calibration at load corrects what was chosen.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from edgespec.decoding.costs import CALIBRATION_BATCHES
from edgespec.decoding.policy import Costs, choose_k

# t(B)/t(1) at CALIBRATION_BATCHES, as far as published. CPU: Qwen2.5-Coder-1.5B Q4_K_M on 2 AVX-512 cores (FACTS.md).
# CUDA: RTX 3090, Llama-3 8B Q4_0 (llama.cpp PR #15802). Metal: Qwen2.5-Coder-7B Q8_0 (llama.cpp PR #10581).
CURVES = {"cpu": (1.0, 1.59, 2.51, 4.30, 4.93, 8.66, 15.9),
          "cuda": (1.0, 1.119, 1.331, 2.146),
          "metal": (1.0, 1.112, 1.405, 2.160)}
# Curves measured on a named device (scripts/gpu_proof.py curves): {"devices": {name: {"batches", "ratio", ...}}}.
MEASURED_CURVES = Path(__file__).with_name("measured_curves.json")
CPU_BANDWIDTH = 40e9  # bytes/s: the 1.117 GB target decodes in 27.7 ms a token on this project's machines
# Decoding reads weights at about 60% of a GPU's rated bandwidth (published tg of an 8B Q4_K_M on an
# RTX 3090, RTX 4090 and M3 Max), and each layer adds about 110 us of launches (small models: TinyLlama
# on an M1 Ultra, Qwen2.5-0.5B on an RX 6900 XT). Sources and arithmetic in the note above.
GPU_EFFICIENCY = 0.6
GPU_LAYER_SECONDS = 110e-6
# Rated memory bandwidth, GB/s (manufacturers' specifications), by the name llama.cpp reports.
GPU_BANDWIDTH_GBS = {"RTX 4090": 1008, "RTX 4080": 717, "RTX 4070 Ti": 504, "RTX 4070": 504, "RTX 4060 Ti": 288,
                     "RTX 4060": 272, "RTX 3090": 936, "RTX 3080": 760, "RTX 3070": 448, "RTX 3060": 360,
                     "RTX 3050": 192, "A100": 1555, "H100": 2000, "H200": 4800, "L4": 300,
                     "M1": 68, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800, "M2": 100, "M2 Pro": 200,
                     "M2 Max": 400, "M2 Ultra": 800, "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M4": 120,
                     "M4 Pro": 273, "M4 Max": 546}
UNKNOWN_GPU_GBS = {"cuda": 360, "metal": 100}  # an RTX 3060, an M2: a modest part of its kind


def gpu_bandwidth(kind: str, name: str) -> float:
    """Bytes per second a GPU called `name` reads at, rated: the longest known name inside it."""
    key = max((k for k in GPU_BANDWIDTH_GBS if k.lower() in name.lower()), key=len, default=None)
    return 1e9 * (GPU_BANDWIDTH_GBS[key] if key else UNKNOWN_GPU_GBS.get(kind, 100))


def measured_curves(path: Path | None = None) -> Mapping[str, tuple[float, ...]]:
    """Device name (lower case) -> t(B)/t(1) at CALIBRATION_BATCHES, as far as measured; {} without the file."""
    return _read_curves(path or MEASURED_CURVES)


@functools.lru_cache(maxsize=4)
def _read_curves(path: Path) -> Mapping[str, tuple[float, ...]]:
    try:
        devices = json.loads(path.read_text())["devices"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    out = {}
    for name, entry in devices.items():
        at = dict(zip(entry["batches"], entry["ratio"]))
        curve = []
        for b in CALIBRATION_BATCHES:  # the sizes the chooser considers, up to the first one not measured
            if b not in at:
                break
            curve.append(float(at[b]))
        if len(curve) >= 2:
            out[name.strip().lower()] = tuple(curve)
    return out


def gpu_curve(kind: str, name: str = "", measured: Mapping[str, tuple[float, ...]] | None = None) -> tuple[float, ...]:
    """t(B)/t(1) of the GPU called `name`: measured on that very device where one was, else published for its kind."""
    known = measured_curves() if measured is None else measured
    return known.get(name.strip().lower()) or CURVES.get(kind, CURVES["cuda"])


@dataclass(frozen=True)
class Split:
    """Bytes a model reads per pass on each side, and its layers on the GPU."""

    gpu_bytes: int
    host_bytes: int
    gpu_layers: int


def modelled_seconds(split: Split, device: str, bandwidth: float, gpu_name: str = "") -> tuple[float, ...]:
    """t(B) at CALIBRATION_BATCHES (as far as the curves of the sides it runs on go) of a model split as `split`."""
    cpu, gpu = CURVES["cpu"], gpu_curve(device, gpu_name)
    out = []
    for i in range(min(len(cpu), len(gpu)) if split.gpu_layers else len(cpu)):
        t = split.host_bytes / CPU_BANDWIDTH * cpu[i]
        if split.gpu_layers:
            t += split.gpu_bytes / (bandwidth * GPU_EFFICIENCY) * gpu[i] + split.gpu_layers * GPU_LAYER_SECONDS
        out.append(t)
    return tuple(out)


def layout_costs(target: Sequence[float], draft: Sequence[float] | None) -> Costs:
    """Costs from the target's t(B) and the draft's (only its t(1) is used: it drafts one token a pass)."""
    return Costs(CALIBRATION_BATCHES[: len(target)], tuple(target), draft[0] if draft else None)


def predicted_rate(costs: Costs, k_max: int, accept: float) -> tuple[float, int]:
    """(tokens per second, K) of the best cycle at `accept` per drafted token; plain decoding without a draft."""
    t1 = costs.verify_seconds(1)
    if t1 <= 0:  # no layer of the target here (all on RPC workers): planning.remote prices it
        return 0.0, 0
    if costs.draft_seconds_per_token is None:
        return 1.0 / t1, 0
    k, rate = choose_k(costs, [accept] * k_max, k_max, costs.draft_seconds_per_token)
    return rate, k
