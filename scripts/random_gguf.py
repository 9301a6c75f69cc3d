"""Random-weight GGUF files with the exact layout of a real model.

Benchmarks of decode speed need a model of the right shape, not the right weights.
A GGUF's header (metadata, tokenizer, tensor infos) is a few MB; its weights are
the bulk.  This script keeps the first and regenerates the second:

    # where the real model is: keep only the header (+ a JSON sidecar)
    python scripts/random_gguf.py skeleton qwen2.5-coder-1.5b-instruct-q4_k_m.gguf q15.skel
    # anywhere else: a file of exactly the same size and layout, random weights
    python scripts/random_gguf.py fill q15.skel /tmp/q15-random.gguf --seed 0

    # a Qwen2.5-7B-shaped Q4_K_M-like model, tokenizer taken from a skeleton
    python scripts/random_gguf.py synth q15.skel q7b.skel
    python scripts/random_gguf.py fill q7b.skel /tmp/q7b-random.gguf

The filler keeps every quantised block's fp16 scale fields finite and small (the
other bytes stay random) so the model computes finite numbers; float tensors get
N(0, std^2) values, and norm weights 1.0.  The header is parsed with nothing but
`struct` (GGUF v2/v3) and written the same way: only numpy is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    30: ("BF16", 1, 2),
}
GGML_TYPE_IDS = {name: tid for tid, (name, _, _) in GGML_TYPES.items()}

# Quantised types the filler knows: (d byte offset, dmin/m byte offset or None,
# rms of the random part of a dequantised weight in units of d, centre in units of d).
# Weight = d * (random integer part) - dmin * (random min part); dmin/m is chosen to
# centre the weights near zero on average.
#   Q4_0 (18): d f16, qs[16]                        w = d*(q-8)
#   Q4_1 (20): d f16, m f16, qs[16]                 w = d*q + m
#   Q5_0 (22): d f16, qh[4], qs[16]                 w = d*(q-16)
#   Q5_1 (24): d f16, m f16, qh[4], qs[16]          w = d*q + m
#   Q8_0 (34): d f16, qs int8[32]                   w = d*q
#   Q4_K (144): d f16, dmin f16, scales[12], qs[128]            w = d*sc*q - dmin*mn (6-bit sc, mn)
#   Q5_K (176): d f16, dmin f16, scales[12], qh[32], qs[128]    same, 5-bit q
#   Q6_K (210): ql[128], qh[64], scales int8[16], d f16 (at the END)   w = d*sc*(q-32)
_QUANT_LAYOUT: dict[str, tuple[int, int | None, float, float]] = {
    "Q4_0": (0, None, 4.64, 0.0),
    "Q4_1": (0, 2, 4.61, -7.5),  # m = -7.5 d
    "Q5_0": (0, None, 9.25, 0.0),
    "Q5_1": (0, 2, 9.23, -15.5),  # m = -15.5 d
    "Q8_0": (0, None, 73.9, 0.0),
    "Q4_K": (0, 2, 36.5 * 4.61, 7.5),  # dmin = 7.5 d  (mean sc == mean mn)
    "Q5_K": (0, 2, 36.5 * 9.23, 15.5),  # dmin = 15.5 d
    "Q6_K": (208, None, 73.9 * 18.5, 0.0),
}
_FLOAT_TYPES = {"F32", "F16", "BF16"}


@dataclass
class TensorInfo:
    name: str
    shape: list[int]
    ggml_type: str
    offset: int  # within the data section
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Header:
    version: int
    alignment: int
    data_offset: int
    tensors: list[TensorInfo]
    metadata: dict[str, object]
    raw_kv: dict[str, bytes]  # key -> the KV entry's bytes as stored (key, type, value)


# --------------------------------------------------------------------------- parsing


class _Reader:
    def __init__(self, f: BinaryIO):
        self.f = f

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise ValueError("truncated GGUF header")
        return b

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool = True):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype = self.unpack("<I")
            n = self.unpack("<Q")
            if itype in _SCALAR and not keep:
                self.f.seek(n * struct.calcsize(_SCALAR[itype]), os.SEEK_CUR)
                return n
            if itype == _STRING and not keep:
                for _ in range(n):
                    self.f.seek(self.unpack("<Q"), os.SEEK_CUR)
                return n
            return [self.value(itype, keep) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def tensor_nbytes(ggml_type: str, n_elements: int) -> int:
    tid = GGML_TYPE_IDS[ggml_type]
    _, blk, size = GGML_TYPES[tid]
    if n_elements % blk:
        raise ValueError(f"{n_elements} elements is not a whole number of {ggml_type} blocks")
    return n_elements // blk * size


def read_header(path: str | Path) -> Header:
    """Parse a GGUF header (works on a full model or on a skeleton)."""
    with open(path, "rb") as f:
        r = _Reader(f)
        if r.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} not supported (2 or 3)")
        n_tensors = r.unpack("<Q")
        n_kv = r.unpack("<Q")
        metadata: dict[str, object] = {}
        raw_kv: dict[str, bytes] = {}
        for _ in range(n_kv):
            start = f.tell()
            key = r.string()
            vtype = r.unpack("<I")
            # keep small values; summarise big arrays (tokenizer) as their length
            metadata[key] = r.value(vtype, keep=not key.startswith("tokenizer.ggml."))
            end = f.tell()
            f.seek(start)
            raw_kv[key] = f.read(end - start)
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))  # type: ignore[arg-type]
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            shape = [r.unpack("<Q") for _ in range(n_dims)]
            tid = r.unpack("<I")
            offset = r.unpack("<Q")
            if tid not in GGML_TYPES:
                raise ValueError(f"tensor {name}: unknown ggml type id {tid}")
            tname = GGML_TYPES[tid][0]
            t = TensorInfo(name, shape, tname, offset, 0)
            t.nbytes = tensor_nbytes(tname, t.n_elements)
            tensors.append(t)
        data_offset = _align(f.tell(), alignment)
    return Header(version, alignment, data_offset, tensors, metadata, raw_kv)


# --------------------------------------------------------------------------- skeleton


def cmd_skeleton(real: str, out: str) -> None:
    h = read_header(real)
    file_size = os.path.getsize(real)
    with open(real, "rb") as src, open(out, "wb") as dst:
        dst.write(src.read(h.data_offset))
    side = _write_sidecar(out, h, os.path.basename(real), file_size - h.data_offset)
    end = max((t.offset + t.nbytes for t in h.tensors), default=0)
    print(
        f"{out}: {h.data_offset} header bytes, {len(h.tensors)} tensors, "
        f"data {side['data_size']} bytes (tensors end at {end}); sidecar {out}.json"
    )


# --------------------------------------------------------------------------- fill

_CHUNK = 32 << 20  # bytes of random data generated at a time


def _is_norm_weight(name: str) -> bool:
    return name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]


def _write_float(f: BinaryIO, t: TensorInfo, rng: np.random.Generator, std: float) -> None:
    n = t.n_elements
    per = max(1, _CHUNK // 4)
    for start in range(0, n, per):
        k = min(per, n - start)
        if _is_norm_weight(t.name):
            x = np.ones(k, dtype=np.float32)
        else:
            x = rng.standard_normal(k, dtype=np.float32) * np.float32(std)
        if t.ggml_type == "F32":
            f.write(x.astype("<f4").tobytes())
        elif t.ggml_type == "F16":
            f.write(x.astype("<f2").tobytes())
        else:  # BF16: upper half of the fp32 bit pattern
            f.write((x.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes())


def _write_quant(f: BinaryIO, t: TensorInfo, rng: np.random.Generator, std: float) -> None:
    d_off, m_off, rms, centre = _QUANT_LAYOUT[t.ggml_type]
    _, _, bsize = GGML_TYPES[GGML_TYPE_IDS[t.ggml_type]]
    d = np.float16(std / rms)
    d_bytes = np.frombuffer(d.astype("<f2").tobytes(), dtype=np.uint8)
    m_bytes = None
    if m_off is not None:
        m = np.float16(centre * float(d))
        m_bytes = np.frombuffer(m.astype("<f2").tobytes(), dtype=np.uint8)
    n_blocks = t.nbytes // bsize
    per = max(1, _CHUNK // bsize)
    for start in range(0, n_blocks, per):
        k = min(per, n_blocks - start)
        blocks = rng.integers(0, 256, size=(k, bsize), dtype=np.uint8)
        blocks[:, d_off : d_off + 2] = d_bytes
        if m_bytes is not None:
            blocks[:, m_off : m_off + 2] = m_bytes
        f.write(blocks.tobytes())


def supported(ggml_type: str) -> bool:
    return ggml_type in _FLOAT_TYPES or ggml_type in _QUANT_LAYOUT


def cmd_fill(skel: str, out: str, seed: int, std: float) -> None:
    h = read_header(skel)
    side_path = Path(skel + ".json")
    side = json.loads(side_path.read_text()) if side_path.exists() else None
    bad = sorted({t.ggml_type for t in h.tensors if not supported(t.ggml_type)})
    if bad:
        sys.exit(
            f"error: tensor types {', '.join(bad)} are not supported by fill "
            f"(supported: {', '.join(sorted(set(_FLOAT_TYPES) | set(_QUANT_LAYOUT)))})"
        )
    end = max((_align(t.offset + t.nbytes, h.alignment) for t in h.tensors), default=0)
    data_size = int(side["data_size"]) if side else end
    if data_size < end:
        raise ValueError(f"sidecar data_size {data_size} < end of tensors {end}")
    rng = np.random.default_rng(seed)
    with open(skel, "rb") as src:
        header = src.read(h.data_offset)
    if len(header) < h.data_offset:  # a skeleton cut right after the tensor infos
        header += b"\0" * (h.data_offset - len(header))
    with open(out, "wb") as f:
        f.write(header)
        pos = 0
        for t in sorted(h.tensors, key=lambda t: t.offset):
            if t.offset < pos:
                raise ValueError(f"tensor {t.name} overlaps the previous one")
            f.write(b"\0" * (t.offset - pos))
            if t.ggml_type in _QUANT_LAYOUT:
                _write_quant(f, t, rng, std)
            else:
                _write_float(f, t, rng, std)
            pos = t.offset + t.nbytes
        f.write(b"\0" * (data_size - pos))
    size = os.path.getsize(out)
    msg = f"{out}: {size} bytes, {len(h.tensors)} tensors, seed {seed}"
    if side and size != side["file_size"]:
        raise SystemExit(f"error: {msg}, but the source was {side['file_size']} bytes")
    print(msg + (" (same size as the source)" if side else ""))


# --------------------------------------------------------------------------- synth


def _kv(key: str, vtype: int, value: object) -> bytes:
    k = key.encode()
    out = struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype)
    if vtype == _STRING:
        v = str(value).encode()
        return out + struct.pack("<Q", len(v)) + v
    return out + struct.pack(_SCALAR[vtype], value)


def _synth_sidecar(out: str, source: str) -> dict:
    h = read_header(out)
    end = max((_align(t.offset + t.nbytes, h.alignment) for t in h.tensors), default=0)
    return _write_sidecar(out, h, source, end)


def _write_sidecar(out: str, h: Header, source: str, data_size: int) -> dict:
    """OUT.json: where each tensor's bytes go, for `fill`."""
    side = {
        "source": source,
        "file_size": h.data_offset + data_size,
        "data_offset": h.data_offset,
        "data_size": data_size,
        "alignment": h.alignment,
        "version": h.version,
        "architecture": h.metadata.get("general.architecture"),
        "tensors": [
            {"name": t.name, "type": t.ggml_type, "shape": t.shape, "offset": t.offset, "nbytes": t.nbytes}
            for t in h.tensors
        ],
    }
    Path(out + ".json").write_text(json.dumps(side, indent=1) + "\n")
    return side


def cmd_synth(
    tok_skel: str,
    out: str,
    n_layer: int,
    n_embd: int,
    n_ff: int,
    n_head: int,
    n_head_kv: int,
    n_ctx_train: int,
    name: str,
) -> None:
    """A qwen2-architecture skeleton of any size, tokenizer copied from `tok_skel`.

    Types follow llama.cpp's Q4_K_M recipe closely enough for speed work: Q4_K for
    most matrices; Q6_K for output.weight and for attn_v/ffn_down of the layers
    llama.cpp gives more bits (first and last eighth, every third in between);
    F32 norms and biases.  Written with `struct` (no `gguf` package needed).
    """
    src = read_header(tok_skel)
    if "tokenizer.ggml.tokens" not in src.raw_kv:
        sys.exit(f"error: {tok_skel} has no tokenizer metadata")
    n_vocab = int(src.metadata["tokenizer.ggml.tokens"])  # type: ignore[arg-type]  # (array length)
    arch = "qwen2"
    U32, F32V, STR = 4, 6, _STRING
    kvs = [
        _kv("general.architecture", STR, arch),
        _kv("general.name", STR, name),
        _kv("general.file_type", U32, 15),  # MOSTLY_Q4_K_M
        _kv("general.alignment", U32, DEFAULT_ALIGNMENT),
        _kv(f"{arch}.context_length", U32, n_ctx_train),
        _kv(f"{arch}.embedding_length", U32, n_embd),
        _kv(f"{arch}.block_count", U32, n_layer),
        _kv(f"{arch}.feed_forward_length", U32, n_ff),
        _kv(f"{arch}.attention.head_count", U32, n_head),
        _kv(f"{arch}.attention.head_count_kv", U32, n_head_kv),
        _kv(f"{arch}.rope.freq_base", F32V, 1000000.0),
        _kv(f"{arch}.attention.layer_norm_rms_epsilon", F32V, 1e-6),
    ]
    kvs += [raw for key, raw in src.raw_kv.items() if key.startswith("tokenizer.")]

    def more_bits(i: int) -> bool:  # llama.cpp's use_more_bits() for Q4_K_M
        return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2

    kv_dim = n_head_kv * (n_embd // n_head)
    # (name, (rows, cols), type); GGUF stores dims innermost first: [cols, rows]
    specs: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (n_vocab, n_embd), "Q4_K"),
        ("output_norm.weight", (n_embd,), "F32"),
        ("output.weight", (n_vocab, n_embd), "Q6_K"),
    ]
    for i in range(n_layer):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (n_embd,), "F32"),
            (p + "attn_q.weight", (n_embd, n_embd), "Q4_K"),
            (p + "attn_q.bias", (n_embd,), "F32"),
            (p + "attn_k.weight", (kv_dim, n_embd), "Q4_K"),
            (p + "attn_k.bias", (kv_dim,), "F32"),
            (p + "attn_v.weight", (kv_dim, n_embd), "Q6_K" if more_bits(i) else "Q4_K"),
            (p + "attn_v.bias", (kv_dim,), "F32"),
            (p + "attn_output.weight", (n_embd, n_embd), "Q4_K"),
            (p + "ffn_norm.weight", (n_embd,), "F32"),
            (p + "ffn_gate.weight", (n_ff, n_embd), "Q4_K"),
            (p + "ffn_up.weight", (n_ff, n_embd), "Q4_K"),
            (p + "ffn_down.weight", (n_embd, n_ff), "Q6_K" if more_bits(i) else "Q4_K"),
        ]
    infos = []
    offset = 0
    for tname, shape, ttype in specs:
        n = 1
        for dim in shape:
            n *= dim
        nb = tensor_nbytes(ttype, n)
        k = tname.encode()
        dims = list(reversed(shape))
        info = struct.pack("<Q", len(k)) + k + struct.pack("<I", len(dims))
        info += b"".join(struct.pack("<Q", dim) for dim in dims)
        info += struct.pack("<IQ", GGML_TYPE_IDS[ttype], offset)
        infos.append(info)
        offset = _align(offset + nb, DEFAULT_ALIGNMENT)
    with open(out, "wb") as f:
        f.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(infos), len(kvs)))
        for raw in kvs:
            f.write(raw)
        for info in infos:
            f.write(info)
        f.write(b"\0" * (_align(f.tell(), DEFAULT_ALIGNMENT) - f.tell()))
    side = _synth_sidecar(out, f"synth:{name}")
    print(
        f"{out}: {side['data_offset']} header bytes, {len(infos)} tensors, "
        f"filled size {side['file_size']} bytes; sidecar {out}.json"
    )


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("skeleton", help="copy a GGUF's header (everything before the tensor data)")
    s.add_argument("real")
    s.add_argument("out")
    s = sub.add_parser("fill", help="write skeleton + random tensor data of the right size")
    s.add_argument("skel")
    s.add_argument("out")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--std", type=float, default=0.02, help="target std of the weights (default 0.02)")
    s = sub.add_parser("synth", help="a Qwen2-shaped Q4_K_M-like skeleton (default: Qwen2.5-7B)")
    s.add_argument("tok_skel", help="skeleton (or GGUF) whose tokenizer metadata is copied")
    s.add_argument("out")
    s.add_argument("--n-layer", type=int, default=28)
    s.add_argument("--n-embd", type=int, default=3584)
    s.add_argument("--n-ff", type=int, default=18944)
    s.add_argument("--n-head", type=int, default=28)
    s.add_argument("--n-head-kv", type=int, default=4)
    s.add_argument("--n-ctx-train", type=int, default=32768)
    s.add_argument("--name", default="qwen2.5-7b-random")
    a = ap.parse_args(argv)
    if a.cmd == "skeleton":
        cmd_skeleton(a.real, a.out)
    elif a.cmd == "fill":
        cmd_fill(a.skel, a.out, a.seed, a.std)
    else:
        cmd_synth(a.tok_skel, a.out, a.n_layer, a.n_embd, a.n_ff, a.n_head, a.n_head_kv, a.n_ctx_train, a.name)


if __name__ == "__main__":
    main()
