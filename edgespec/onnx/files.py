"""The files of an ONNX draft: edgespec's own export, or a directory in Hugging Face optimum's layout.

An export holds model.onnx, its external data, vocab.json and a manifest written last (source sha256,
opset, precision, file sizes): a directory without a manifest that matches its files is not a whole
export. An optimum / onnx-community directory holds model.onnx (or onnx/model.onnx) with tokenizer.json
and config.json. Either way the draft's vocabulary is read here, without onnxruntime, for the same check
GGUF drafts get.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgespec.gguf import Vocab
from edgespec.errors import InvalidModelError

# The files of an export: its manifest is written last, so its presence marks a whole export.
MANIFEST = "edgespec-onnx.json"
VOCAB_FILE = "vocab.json"
MODEL_FILE = "model.onnx"
# llama_vocab_type: what the GGUF converter writes for each tokenizer.json model type.
_HF_VOCAB_TYPES = {"BPE": 2, "Unigram": 4, "WordPiece": 3}


class OnnxDraftFiles:
    """An ONNX draft on disk: its model file, vocabulary (what check_compatible reads) and hyper-parameters."""

    def __init__(self, model: Path, vocab: dict[str, Any], manifest: dict[str, Any] | None,
                 config: dict[str, Any]) -> None:
        self.model, self.manifest = model, manifest  # manifest: edgespec's export only
        self.path = model.parent if model.name == MODEL_FILE else model
        if self.path.name == "onnx":
            self.path = self.path.parent
        self._tokens: list[str] = vocab["tokens"]
        self._eog = set(vocab["eog"])
        self.vocab = Vocab(len(self._tokens), vocab["type"], vocab["bos"], vocab["eos"], vocab["add_bos"],
                           None, None, None, None, None, None)
        self.n_vocab = self.vocab.n_tokens
        self.hyper = manifest["hyper"] if manifest else _hf_hyper(config, self.n_vocab)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def weights_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.model.parent.iterdir() if p.name.startswith(self.model.name))

    def token_text(self, token: int) -> str:
        return self._tokens[token] if 0 <= token < len(self._tokens) else ""

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def close(self) -> None:
        pass

    def __enter__(self) -> OnnxDraftFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def is_onnx(path: str | Path) -> bool:
    """Whether `path` names an ONNX draft (a .onnx file or a directory holding one) rather than a GGUF or a name."""
    p = Path(path)
    return p.suffix == ".onnx" or p.is_dir() and ((p / MODEL_FILE).exists() or (p / "onnx" / MODEL_FILE).exists())


def export_dir(gguf: Path, precision: str) -> Path:
    """Where the export of `gguf` at `precision` is cached: beside the GGUF."""
    return gguf.with_name(f"{gguf.stem}.onnx-{precision}")


def locate(path: str | Path) -> OnnxDraftFiles:
    """The model file and vocabulary of an ONNX draft, checked for completeness; InvalidModelError if not whole."""
    p = Path(path)
    if p.is_dir():
        p = p / MODEL_FILE if (p / MODEL_FILE).exists() else p / "onnx" / MODEL_FILE
    if not p.is_file():
        raise InvalidModelError(f"{path} holds no {MODEL_FILE}; pass an edgespec export (`edgespec models "
                                f"export-onnx NAME`) or a directory in optimum's layout")
    home = p.parent
    if (home / MANIFEST).exists():
        manifest = _read_json(home / MANIFEST)
        for name, size in manifest.get("files", {}).items():
            have = (home / name).stat().st_size if (home / name).exists() else None
            if have != size:
                state = "is missing" if have is None else f"has {have} bytes, the manifest says {size}"
                raise InvalidModelError(f"{home / name} {state}: the export is incomplete or damaged; export it "
                                        f"again (`edgespec models export-onnx {manifest.get('source', 'NAME')} "
                                        f"--force`)")
        return OnnxDraftFiles(p, _read_json(home / VOCAB_FILE), manifest, {})
    hf = home if (home / "tokenizer.json").exists() else home.parent
    config = _read_json(hf / "config.json") if (hf / "config.json").exists() else {}
    return OnnxDraftFiles(p, hf_vocab(hf), None, config)


def hf_vocab(home: Path) -> dict[str, Any]:
    """vocab.json's fields from an optimum directory's tokenizer.json, tokenizer_config.json and config.json."""
    if not (home / "tokenizer.json").exists():
        raise InvalidModelError(f"{home} has no tokenizer.json, so its vocabulary cannot be checked against the "
                                f"target's; copy the model's tokenizer files beside it")
    tok = _read_json(home / "tokenizer.json")
    config = _read_json(home / "config.json") if (home / "config.json").exists() else {}
    tconf = _read_json(home / "tokenizer_config.json") if (home / "tokenizer_config.json").exists() else {}
    model = tok.get("model", {})
    pieces = dict(model.get("vocab", {})) if isinstance(model.get("vocab"), dict) else {
        piece: i for i, (piece, _score) in enumerate(model.get("vocab", []))}
    for added in tok.get("added_tokens", []):
        pieces[added["content"]] = added["id"]
    n = max(int(config.get("vocab_size", 0)), max(pieces.values(), default=-1) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]  # llama.cpp's converter names the padding entries so
    for piece, i in pieces.items():
        tokens[i] = piece
    kind = _HF_VOCAB_TYPES.get(model.get("type"), 0)
    if kind == 2 and model.get("byte_fallback"):
        kind = 1  # a SentencePiece BPE: llama.cpp's "llama" vocabulary
    gen = _read_json(home / "generation_config.json") if (home / "generation_config.json").exists() else {}

    def ids(value: Any) -> list[int]:
        return value if isinstance(value, list) else [] if value is None else [value]

    eos = ids(config.get("eos_token_id"))
    return {"type": kind, "bos": config.get("bos_token_id"), "eos": eos[0] if eos else None,
            "add_bos": bool(tconf.get("add_bos_token", kind == 1)),
            "eog": sorted(set(eos) | set(ids(gen.get("eos_token_id")))), "tokens": tokens}


def _hf_hyper(config: dict[str, Any], n_vocab: int) -> dict[str, Any]:
    """export.Hyper's fields from a Hugging Face config.json (what the memory plan needs)."""
    n_embd, n_head = int(config.get("hidden_size", 0)), int(config.get("num_attention_heads", 1))
    return {"n_layer": int(config.get("num_hidden_layers", 0)), "n_embd": n_embd,
            "n_ff": int(config.get("intermediate_size", 4 * n_embd)), "n_head": n_head,
            "n_head_kv": int(config.get("num_key_value_heads", n_head)),
            "head_dim": int(config.get("head_dim") or n_embd // max(n_head, 1)),
            "n_vocab": int(config.get("vocab_size", n_vocab)),
            "n_ctx_train": int(config.get("max_position_embeddings", 4096))}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidModelError(f"{path} is unreadable ({e}); export or copy it again") from e

