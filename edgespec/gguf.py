"""What edgespec knows of a GGUF file as plain data: its vocabulary's special tokens, the facts memory accounting
needs, and the check that a path holds a GGUF at all. backend.py fills these in from llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import InvalidModelError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"


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
