"""The machine a benchmark ran on, recorded next to its figures: the same prompts give other ratios on
another CPU (issue 22: a batch of 64 costs 16 single steps on the AVX-512 machines here, 38 on an AVX2 one).

`record(model, threads)` gives the CPU model, its vector extensions, the thread count, the llama.cpp build
(and which folder it came from: a second build for the other curve is used through PYTHONPATH) and the
target's calibrated t(B) curve (costs.calibrate: cached per model file, build and machine); `line(record)`
is the one-line form the scripts print above their tables.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from edgespec.decoding.costs import CALIBRATION_BATCHES, calibrate, cpu_model


def vector_extensions() -> str:
    """The widest x86 vector extension llama.cpp can use here (what decides its kernels), else the machine."""
    flags = set(cpu_model().split())
    if "avx512f" in flags:
        return "AVX-512" + (" VNNI" if "avx512_vnni" in flags else "")
    if "avx2" in flags:
        return "AVX2"
    return platform.machine()


def build_extensions() -> str:
    """What the loaded llama.cpp build was compiled to use (its own system info): a build without AVX-512
    on an AVX-512 CPU runs the AVX2 kernels."""
    from edgespec.backend import system_info

    info = system_info()
    return "AVX-512" if "AVX512 = 1" in info else "AVX2" if "AVX2 = 1" in info else "other"


def record(model, threads: int) -> dict[str, Any]:
    """`model`: a loaded backend.Model (the target); its t(B) is calibrated, or read from the cache."""
    import llama_cpp

    from edgespec.paths import calibration_dir

    c = calibrate(model, None, CALIBRATION_BATCHES[-1] - 1, calibration_dir())
    name = cpu_model().split(" fpu ")[0]
    return {"cpu": name, "cpu_vector": vector_extensions(), "build_vector": build_extensions(), "threads": threads,
            "llama_cpp": f"{llama_cpp.__version__} ({Path(llama_cpp.__file__).parent})",
            "batches": list(c.batches), "t1_ms": c.target_seconds[0] * 1e3,
            "t_ratio": [round(t / c.target_seconds[0], 2) for t in c.target_seconds]}


def line(r: dict[str, Any]) -> str:
    kernels = r["cpu_vector"] if r["build_vector"] in r["cpu_vector"] else f"{r['build_vector']} build on " \
                                                                         f"{r['cpu_vector']}"
    return (f"machine: {r['cpu']}, {kernels}, {r['threads']} threads; llama-cpp-python {r['llama_cpp']}; "
            f"t(1) {r['t1_ms']:.1f} ms, t(B)/t(1) {r['t_ratio']} for B = {r['batches']}")
