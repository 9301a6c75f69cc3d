"""What `edgespec info` reports: the machine, the llama.cpp build, cached models, the memory plan."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any


def machine_info() -> dict[str, Any]:
    import psutil

    from edgespec import backend
    from edgespec.devices import devices
    from edgespec.planning.budget import GiB, idle_gpu_note
    from edgespec.config import MAX_K, LoadConfig
    from edgespec.planning.plan import plan_memory
    from edgespec.errors import EdgespecError
    from edgespec.models import DEFAULT_MODEL, MODELS, PAIRS, cache_dir, cached_path

    vm = psutil.virtual_memory()
    features = backend.system_info()
    found = devices()
    data: dict[str, Any] = {
        "machine": f"{platform.system()} {platform.machine()}, {psutil.cpu_count(logical=False)} cores "
                   f"({psutil.cpu_count()} threads)",
        "memory": f"{vm.total / GiB:.1f} GiB total, {vm.available / GiB:.1f} GiB available",
        "llama.cpp backends": ", ".join(_backends(features)) + (" (GPU offload)" if any(  # not RPC: no local GPU
            d.kind in ("gpu", "igpu") and not d.name.startswith("RPC") for d in found) else ""),
        "devices": [f"{d.name}: {d.description} ({d.kind}), {d.free_bytes / GiB:.1f} GiB free of "
                    f"{d.total_bytes / GiB:.1f} GiB" for d in found] or ["none reported"],
        "llama.cpp features": features.strip(),
        "onnxruntime (ONNX drafts)": _onnxruntime(),
        "versions": [f"edgespec {_version('edgespec')}", f"llama-cpp-python {_version('llama-cpp-python')}",
                     f"numpy {_version('numpy')}", f"huggingface-hub {_version('huggingface-hub')}",
                     f"python {sys.version.split()[0]}"],
        "model cache": str(cache_dir()),
        **_user_files(),
        "cached models": [f"{n} ({p})" for n, m in MODELS.items() if (p := cached_path(m)) is not None] or ["none"],
    }
    if (idle := idle_gpu_note(found)) is not None:
        data["GPU"] = idle
    target, draft = MODELS[DEFAULT_MODEL], MODELS[PAIRS[DEFAULT_MODEL][0]]
    tp, dp = cached_path(target), cached_path(draft)
    if tp is None:
        data["memory plan"] = f"fetch {DEFAULT_MODEL} to see its plan (edgespec models fetch {DEFAULT_MODEL})"
        return data
    try:
        p = plan_memory(tp, dp, LoadConfig(), MAX_K)
        budget = p.budget
        data["memory plan"] = [f"{DEFAULT_MODEL}" + (f" + {draft.name}" if dp else "") +
                               f" on {budget.device}: {p.chosen.description if p.chosen else ''}, Kmax {p.k_max}, "
                               f"draft {'loaded' if p.load_draft else 'not loaded'}, {p.total_bytes / GiB:.2f} GiB of "
                               f"{(budget.gpu_bytes or budget.ram_bytes) / GiB:.2f} GiB ({p.reason})",
                               *(n for n in p.notes if n != data.get("GPU"))]
    except EdgespecError as e:
        data["memory plan"] = str(e)
    return data


def _user_files() -> dict[str, Any]:
    """The config file (whether it exists), the defaults it and the environment settle, the chat history."""
    from edgespec.errors import ConfigError
    from edgespec.cli.userconfig import settle
    from edgespec.paths import config_path, history_path

    path = config_path()
    try:
        defaults: Any = settle().describe()
    except ConfigError as e:  # info still reports the rest of the machine
        defaults = str(e)
    return {"config file": f"{path} ({'present' if path.exists() else 'absent'})", "defaults": defaults,
            "chat history": str(history_path())}


def _onnxruntime() -> str:
    from edgespec.onnx import runtime as ort

    v = ort.version()
    if v is None:
        return "not installed (pip install 'edgespec[onnx]')"
    return f"{v}, --draft-device {', '.join(ort.providers())}"


def _backends(features: str) -> list[str]:
    names = ["CPU"]
    for key, name in (("CUDA", "CUDA"), ("METAL", "Metal"), ("VULKAN", "Vulkan"), ("HIP", "ROCm"),
                      ("SYCL", "SYCL"), ("OPENCL", "OpenCL"), ("BLAS", "BLAS")):
        if key in features.upper():
            names.append(name)
    return names


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
