"""ggml's devices, which llama-cpp-python does not bind: the device registry (what the plan places layers on).

It reaches the same shared libraries the installed llama-cpp-python loaded, through ctypes (backend.ggml_libraries),
so the registry it reads is the one llama.cpp loads models with.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from edgespec import backend
from edgespec.errors import WorkerError


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
    reg, dev = backend.ggml_libraries()
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


# -- llama.cpp's RPC backend: a worker serving this machine's device, and the devices of remote workers ----------

_START = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                          ctypes.POINTER(ctypes.c_void_p))
_ADD = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)


def require_rpc() -> None:
    if not backend.supports_rpc():
        raise WorkerError("the installed llama-cpp-python was built without RPC; reinstall it with "
                          "CMAKE_ARGS=\"-DGGML_RPC=on\" pip install --no-cache-dir --force-reinstall "
                          "llama-cpp-python==0.3.36")


def _rpc(name: str, proto: type) -> ctypes._CFuncPtr:
    """A function of ggml's RPC backend, found as llama.cpp's own tools find it: through the "RPC" registry."""
    require_rpc()
    reg, dev = _registry()
    reg.ggml_backend_reg_by_name.restype, reg.ggml_backend_reg_by_name.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    address = dev.ggml_backend_reg_get_proc_address(reg.ggml_backend_reg_by_name(b"RPC"), name.encode())
    return proto(address)


def device_handle(name: str | None) -> int:
    """The ggml device a worker serves: `name` ("CPU", "CUDA0", ...), else the first GPU, else the CPU (as llama.cpp's
    rpc-server picks)."""
    reg, dev = _registry()
    reg.ggml_backend_dev_by_name.restype, reg.ggml_backend_dev_by_name.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    if name is not None:
        handle = reg.ggml_backend_dev_by_name(name.encode())
        if not handle:
            known = ", ".join(d.name for d in devices())
            raise WorkerError(f"device {name!r} is not one llama.cpp found here; use one of {known}")
        return handle
    gpus = [d.name for d in devices() if d.kind == "gpu" and not d.name.startswith("RPC")]
    return reg.ggml_backend_dev_by_name(gpus[0].encode()) if gpus else reg.ggml_backend_dev_by_type(0)


def serve_rpc(endpoint: str, device: int, threads: int, cache_dir: str | None) -> None:
    """llama.cpp's RPC server on `endpoint` (an IPv4 address and port) for `device`; returns only if it failed."""
    handles = (ctypes.c_void_p * 1)(device)
    _rpc("ggml_backend_rpc_start_server", _START)(endpoint.encode(), cache_dir.encode() if cache_dir else None,
                                                  threads, 1, handles)


def rpc_devices(endpoint: str) -> tuple[int, ...]:
    """The ggml devices of the worker at `endpoint` (which must answer: remote.probe asks it first), unregistered, so
    that nothing but the model they are given to runs there."""
    reg = _rpc("ggml_backend_rpc_add_server", _ADD)(endpoint.encode())
    if not reg:
        raise WorkerError(f"RPC worker {endpoint} serves no device; start it with `edgespec worker --device NAME`")
    _, dev = _registry()
    dev.ggml_backend_reg_dev_count.restype, dev.ggml_backend_reg_dev_count.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    dev.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    dev.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return tuple(dev.ggml_backend_reg_dev_get(reg, i) for i in range(dev.ggml_backend_reg_dev_count(reg)))
