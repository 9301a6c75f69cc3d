"""ggml's devices, which llama-cpp-python does not bind: the device registry (what the plan places layers on).

It reaches the same shared libraries the installed llama-cpp-python loaded, through ctypes (backend.shared_library),
so the registry it reads is the one llama.cpp loads models with.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from edgespec import backend


@dataclass(frozen=True)
class Device:
    """A device llama.cpp's backends found: "CPU", "CUDA0", "Metal", "Vulkan0", ..."""

    name: str
    description: str  # "NVIDIA GeForce RTX 4090", "Apple M2 Pro"
    kind: str  # "cpu", "gpu", "igpu" (shares host memory), "accel"
    free_bytes: int
    total_bytes: int


_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


def _registry() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """libggml (the registry) and libggml-base (the device calls), with their signatures declared."""
    reg, dev = backend.shared_library("ggml"), backend.shared_library("ggml-base")
    reg.ggml_backend_dev_count.restype = ctypes.c_size_t
    reg.ggml_backend_dev_get.restype, reg.ggml_backend_dev_get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(dev, name).restype, getattr(dev, name).argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    dev.ggml_backend_dev_type.restype, dev.ggml_backend_dev_type.argtypes = ctypes.c_int, [ctypes.c_void_p]
    size_p = ctypes.POINTER(ctypes.c_size_t)
    dev.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    return reg, dev


def devices() -> list[Device]:
    """Every device of the llama.cpp build, with its free memory, through ggml's device registry."""
    try:
        reg, dev = _registry()
    except (OSError, RuntimeError, FileNotFoundError):  # a build laid out otherwise: report none rather than fail
        return []
    out = []
    for i in range(reg.ggml_backend_dev_count()):
        d = reg.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        dev.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        out.append(Device(dev.ggml_backend_dev_name(d).decode(errors="replace"),
                          dev.ggml_backend_dev_description(d).decode(errors="replace"),
                          _DEVICE_KINDS.get(dev.ggml_backend_dev_type(d), "other"), free.value, total.value))
    return out
