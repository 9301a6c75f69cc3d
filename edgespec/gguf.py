"""What edgespec knows of a GGUF file as plain data: its vocabulary's special tokens, the facts memory accounting
needs, the check that a path holds a GGUF at all, and its tensor directory. backend.py fills the first two in from
llama.cpp; the directory is read here, since llama.cpp's API does not list a model's tensors."""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import InvalidModelError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"
# GGUF metadata value types of a fixed size (struct formats); 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# ggml types llama.cpp's CPU_REPACK buffer takes on x86 with AVX2 (Q4_0, Q4_K, IQ4_NL; ggml-cpu/repack.cpp
# ggml_repack_get_optimal_repack_type), rows a multiple of 8; another type there fails llama.cpp's assertion.
REPACK_TYPES = frozenset({2, 12, 20})
# A layer's matrices, which only matrix products read (a repacked token embedding would be read as rows: wrong).
_MATRIX = re.compile(r"blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|attn_qkv|ffn_gate|ffn_up|ffn_down)\.weight")
_LAYER = re.compile(r"blk\.(\d+)\.")  # any tensor of a layer


@dataclass(frozen=True)
class Vocab:
    n_tokens: int
    type: int  # llama_vocab_type: 1 SPM, 2 BPE, ...
    bos: int | None
    eos: int | None
    add_bos: bool
    fim_pre: int | None
    fim_suf: int | None
    fim_mid: int | None
    fim_pad: int | None
    fim_rep: int | None
    fim_sep: int | None


@dataclass(frozen=True)
class ModelFacts:
    """What memory accounting and reports need from the GGUF."""

    path: Path
    architecture: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    weights_bytes: int
    chat_template: str | None
    recurrent: bool


def check_gguf_file(path: Path) -> None:
    """Fail early with a clear message; llama.cpp's own is a log line and a NULL."""
    if not path.exists():
        raise ModelNotFoundError(f"model file {path} does not exist; check the path or use a catalog name")
    if not path.is_file():
        raise InvalidModelError(f"{path} is not a file; pass the path of a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise InvalidModelError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); "
            f"convert it with llama.cpp's convert_hf_to_gguf.py or download a .gguf"
        )


@dataclass(frozen=True)
class Tensor:
    name: str
    ggml_type: int  # enum ggml_type: 2 Q4_0, 12 Q4_K, 14 Q6_K, ...
    shape: tuple[int, ...]  # ggml's ne: shape[0] is the length of a row


def tensors(path: Path) -> list[Tensor]:
    """The GGUF's tensor directory, read past its metadata (format version 2 or 3) without loading a weight."""
    try:
        return _tensors(path)
    except (struct.error, UnicodeDecodeError, ValueError) as e:
        raise InvalidModelError(f"{path} is truncated or corrupt: its tensor directory cannot be read ({e}); fetch "
                                f"it again (`edgespec models fetch NAME`) or pick another GGUF") from None


def _tensors(path: Path) -> list[Tensor]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        _, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        at = 24
        for _ in range(n_kv):
            key_end = _skip_value(data, at, 8)
            at = _skip_value(data, key_end + 4, struct.unpack_from("<I", data, key_end)[0])
        out = []
        for _ in range(n_tensors):
            (length,) = struct.unpack_from("<Q", data, at)
            name = bytes(data[at + 8:at + 8 + length]).decode("utf-8", "replace")
            (n_dims,) = struct.unpack_from("<I", data, at + 8 + length)
            shape = struct.unpack_from(f"<{n_dims}Q", data, at + 12 + length)
            (ggml_type,) = struct.unpack_from("<I", data, at + 12 + length + 8 * n_dims)
            out.append(Tensor(name, ggml_type, shape))
            at += 12 + length + 8 * n_dims + 4 + 8  # the type, then the data offset
        return out


def _skip_value(data: mmap.mmap, at: int, kind: int) -> int:
    """Where the metadata value of type `kind` at `at` ends."""
    if kind in _SCALARS:
        return at + struct.calcsize(_SCALARS[kind])
    if kind == 8:
        return at + 8 + struct.unpack_from("<Q", data, at)[0]
    if kind != 9:
        raise InvalidModelError(f"GGUF metadata value type {kind} at byte {at} is unknown; the file is corrupt")
    item, count = struct.unpack_from("<IQ", data, at)
    at += 12
    if item in _SCALARS:
        return at + count * struct.calcsize(_SCALARS[item])
    for _ in range(count):
        at = _skip_value(data, at, item)
    return at


def repack_pattern(listing: list[Tensor], gpu_layers: int = 0) -> str | None:
    """A regular expression of the layer matrices llama.cpp's CPU_REPACK buffer can hold on an AVX2 CPU
    (REPACK_TYPES), in the layers that stay on the CPU when `gpu_layers` go to a GPU (llama.cpp offloads the last
    ones, the output layer counting as one); None if there are none."""
    layers = [int(m.group(1)) for t in listing if (m := _LAYER.match(t.name))]
    on_cpu = max(layers, default=-1) + 2 - gpu_layers  # layers below this index stay on the CPU
    names = [t.name for t in listing if t.ggml_type in REPACK_TYPES and len(t.shape) == 2 and t.shape[1] % 8 == 0
             and (m := _MATRIX.fullmatch(t.name)) and int(m.group(1)) < on_cpu]
    return "^(" + "|".join(re.escape(n) for n in names) + ")$" if names else None
