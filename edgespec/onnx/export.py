"""Export a GGUF draft of the llama or qwen2 family to an ONNX decoder, from the GGUF's own tensors.

No framework: the `gguf` package dequantizes the tensors and the graph is written with `onnx.helper`.
Inputs and outputs follow Hugging Face optimum's text-generation-with-past layout (`input_ids`,
`position_ids`, `past_key_values.N.key/value` in; `logits`, `present.N.key/value` out), so one loader
(onnx/runtime.py) reads both; logits are for the last position only, the only one a draft samples from.
Weights are written to the external-data file one tensor at a time, so memory stays at about one tensor.
int8 and int4 are ONNX Runtime's MatMulNBits, through its own quantizer (ort.quantize_weights).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edgespec.errors import InvalidModelError, UnsupportedModelError
from edgespec.onnx.files import MANIFEST, MODEL_FILE, VOCAB_FILE

PRECISIONS = ("int8", "int4", "fp16", "fp32")
OPSET = 21
IR_VERSION = 10  # onnx 1.23 writes 14 by default, newer than onnxruntime 1.31 reads
DATA_FILE = "model.onnx.data"
FORMAT = 1
SUPPORTED = ("llama", "qwen2")
QUANT_BLOCK = 32  # as llama.cpp's blocks: the re-quantized weights keep the GGUF's granularity
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class Hyper:
    """The hyper-parameters the graph is built from, read from the GGUF's metadata."""

    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    eps: float
    n_vocab: int
    n_ctx_train: int


def export(gguf_path: Path, out_dir: Path, precision: str = "int4", progress: ProgressFn | None = None) -> Path:
    """Write the ONNX export of `gguf_path` to `out_dir` (replacing nothing: it appears complete or not at all)."""
    import gguf

    if precision not in PRECISIONS:
        raise UnsupportedModelError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}; pick one of them")
    try:
        reader = _reader(gguf)(str(gguf_path))
    except (ValueError, OSError, IndexError) as e:
        raise InvalidModelError(f"{gguf_path} is not a readable GGUF ({e}); fetch it again") from e
    hp = _hyper(reader, gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        dtype = np.float16 if precision == "fp16" else np.float32
        builder = _Graph(tmp / DATA_FILE, dtype, quantized=precision.startswith("int"))
        tensors = {t.name: t for t in reader.tensors}
        model = _build(builder, hp, tensors, progress)
        _save(model, tmp, precision)
        (tmp / VOCAB_FILE).write_text(json.dumps(_vocab(reader, hp)))
        manifest = {"format": FORMAT, "source": gguf_path.name, "source_sha256": _sha256(gguf_path),
                    "opset": OPSET, "precision": precision, "logits": "last", "hyper": asdict(hp),
                    "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: its presence marks a whole export
        tmp.chmod(0o755)  # mkdtemp made it private
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _reader(gguf: Any) -> type:
    """gguf's GGUFReader slicing a plain view of its memmap: each numpy.memmap slice runs Python hooks, and the
    reader slices once per vocabulary string (about 3x faster on Qwen2.5's 152k tokens and merges)."""

    class Reader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            if type(self.data) is not np.ndarray:
                self.data = self.data.view(np.ndarray)  # the same pages, sliced without memmap's hooks
            return super()._get(offset, dtype, count, override_order)

    return Reader


def _hyper(reader: Any, path: Path) -> Hyper:
    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        if f is None:
            if default is None:
                raise InvalidModelError(f"{path.name} lacks the metadata key {key}; it cannot be exported")
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch not in SUPPORTED:
        raise UnsupportedModelError(f"{path.name} is a {arch} model; the ONNX export supports "
                                    f"{' and '.join(SUPPORTED)} (SmolLM2, Qwen2.5): run this draft in llama.cpp "
                                    f"(--draft {path.name}) instead")
    scaling = field(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise UnsupportedModelError(f"{path.name} uses {scaling} rope scaling, which the ONNX export does not "
                                    f"implement; run this draft in llama.cpp instead")
    n_embd, n_head = int(field(f"{arch}.embedding_length")), int(field(f"{arch}.attention.head_count"))
    head_dim = int(field(f"{arch}.attention.key_length", n_embd // n_head))
    if int(field(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{path.name} rotates part of each head (partial rope), which the ONNX export "
                                    f"does not implement; run this draft in llama.cpp instead")
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return Hyper(arch, int(field(f"{arch}.block_count")), n_embd, int(field(f"{arch}.feed_forward_length")), n_head,
                 int(field(f"{arch}.attention.head_count_kv", n_head)), head_dim,
                 float(field(f"{arch}.rope.freq_base", 10000.0)),
                 float(field(f"{arch}.attention.layer_norm_rms_epsilon")), int(emb.shape[1]),
                 int(field(f"{arch}.context_length")))


class _Graph:
    """Nodes and initializers of one graph; initializer bytes stream to the external-data file."""

    def __init__(self, data_path: Path, dtype: type, quantized: bool = False) -> None:
        self.dtype, self.quantized = dtype, quantized
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._data = open(data_path, "wb")
        self._n = 0

    def tensor(self, name: str, array: np.ndarray) -> str:
        from onnx import TensorProto, helper

        array = np.ascontiguousarray(array)
        kind = helper.np_dtype_to_tensor_dtype(array.dtype)
        t = TensorProto(name=name, dims=array.shape, data_type=kind)
        if array.nbytes < 1024:
            t.raw_data = array.tobytes()
        else:
            offset = self._data.tell()
            self._data.write(array.tobytes())
            self._data.write(b"\0" * (-self._data.tell() % 64))  # aligned, so the runtime can map it
            for key, value in (("location", DATA_FILE), ("offset", offset), ("length", array.nbytes)):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            t.data_location = TensorProto.EXTERNAL
        self.inits.append(t)
        return name

    def const(self, array: Any, dtype: type | None = None) -> str:
        self._n += 1
        return self.tensor(f"const_{self._n}", np.asarray(array, dtype=dtype or self.dtype))

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs: Any) -> Any:
        from onnx import helper

        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{op_type}_{self._n}", **attrs))
        return outs[0] if n_out == 1 else outs

    def close(self) -> None:
        self._data.close()


def _build(g: _Graph, hp: Hyper, tensors: dict[str, Any], progress: ProgressFn | None) -> Any:
    from onnx import TensorProto, helper

    weight = _Weights(g, hp, tensors)
    kv_type = TensorProto.FLOAT16 if g.dtype == np.float16 else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1, hp.n_vocab])]
    cos, sin, mask = _rope_and_mask(g, hp)
    h = weight.embed("input_ids")
    for i in range(hp.n_layer):
        for io, name in ((inputs, "past_key_values"), (outputs, "present")):
            for kv in ("key", "value"):
                io.append(helper.make_tensor_value_info(f"{name}.{i}.{kv}", kv_type,
                                                        ["batch", hp.n_head_kv, "past" if io is inputs else "total",
                                                         hp.head_dim]))
        h = _layer(g, hp, weight, i, h, cos, sin, mask)
        if progress:
            progress(i + 1, hp.n_layer + 1)
    last = g.op("Slice", h, g.const([-1], np.int64), g.const([2**62], np.int64), g.const([1], np.int64))
    x = _rms(g, hp, last, weight.vector("output_norm.weight"))
    tied = "output.weight" not in tensors  # the output layer is the embedding, as in SmolLM2
    logits = g.op("MatMul", x, weight.matrix("token_embd.weight" if tied else "output.weight", "output.weight"))
    if g.dtype != np.float32:
        logits = g.op("Cast", logits, to=TensorProto.FLOAT)
    g.nodes.append(helper.make_node("Identity", [logits], ["logits"]))
    g.close()
    if progress:
        progress(hp.n_layer + 1, hp.n_layer + 1)
    graph = helper.make_graph(g.nodes, f"edgespec-{hp.arch}-draft", inputs, outputs, g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="edgespec",
                             ir_version=IR_VERSION)


class _Weights:
    """GGUF tensors, dequantized, in the layout the graph multiplies by."""

    def __init__(self, g: _Graph, hp: Hyper, tensors: dict[str, Any]) -> None:
        self.g, self.hp, self.tensors = g, hp, tensors

    def array(self, name: str) -> np.ndarray:
        import gguf

        t = self.tensors.get(name)
        if t is None:
            raise InvalidModelError(f"the GGUF lacks tensor {name}; it cannot be exported")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # llama.cpp's converter interleaves the two rotated halves of each llama head; undo it, so one rope
        # (the half-split one qwen2 uses) serves both families.
        if self.hp.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.hp.n_head if "attn_q" in name else self.hp.n_head_kv
            w = w.reshape(heads, self.hp.head_dim // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        return w

    def matrix(self, name: str, as_name: str | None = None) -> str:
        return self.g.tensor(as_name or name, self.array(name).T.astype(self.g.dtype))  # MatMul's B: (in, out)

    def vector(self, name: str) -> str:
        return self.g.tensor(name, self.array(name).reshape(-1).astype(self.g.dtype))

    def embed(self, ids: str) -> str:
        """The rows of `ids`; a quantized export keeps the table in fp16 (MatMulNBits covers only the matrices)."""
        from onnx import TensorProto

        g = self.g
        table = self.array("token_embd.weight").astype(np.float16 if g.quantized else g.dtype)
        rows = g.op("Gather", g.tensor("token_embd.weight", table), ids)
        return g.op("Cast", rows, to=TensorProto.FLOAT) if g.quantized else rows


def _rope_and_mask(g: _Graph, hp: Hyper) -> tuple[str, str, str]:
    """cos/sin of each position (1, 1, seq, head_dim/2) and the causal mask (1, 1, groups*seq, total),
    computed once from position_ids and shared by every layer."""
    from onnx import TensorProto

    inv_freq = hp.rope_base ** (-np.arange(0, hp.head_dim, 2, dtype=np.float64) / hp.head_dim)
    pos = g.op("Cast", "position_ids", to=TensorProto.FLOAT)
    angles = g.op("Mul", g.op("Unsqueeze", pos, g.const([2], np.int64)), g.const(inv_freq, np.float32))
    angles = g.op("Unsqueeze", angles, g.const([1], np.int64))
    cos, sin = g.op("Cos", angles), g.op("Sin", angles)
    if g.dtype != np.float32:
        cos, sin = g.op("Cast", cos, to=TensorProto.FLOAT16), g.op("Cast", sin, to=TensorProto.FLOAT16)
    # Positions of the cache are 0..total-1; a query at position p sees keys at positions <= p.
    past = g.op("Gather", g.op("Shape", "past_key_values.0.key"), g.const(2, np.int64))
    total = g.op("Add", past, g.op("Gather", g.op("Shape", "input_ids"), g.const(1, np.int64)))
    keys = g.op("Range", g.const(0, np.int64), total, g.const(1, np.int64))
    groups = hp.n_head // hp.n_head_kv
    query = g.op("Tile", g.op("Reshape", "position_ids", g.const([-1], np.int64)), g.const([groups], np.int64))
    seen = g.op("LessOrEqual", g.op("Unsqueeze", keys, g.const([0], np.int64)),
                g.op("Unsqueeze", query, g.const([1], np.int64)))
    mask = g.op("Where", seen, g.const(0.0, np.float32), g.const(-np.inf, np.float32))
    return cos, sin, g.op("Unsqueeze", mask, g.const([0, 1], np.int64))


def _rms(g: _Graph, hp: Hyper, x: str, w: str) -> str:
    from onnx import TensorProto

    x32 = x if g.dtype == np.float32 else g.op("Cast", x, to=TensorProto.FLOAT)
    var = g.op("ReduceMean", g.op("Mul", x32, x32), g.const([-1], np.int64))
    y = g.op("Mul", x32, g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const(hp.eps, np.float32)))))
    if g.dtype != np.float32:
        y = g.op("Cast", y, to=TensorProto.FLOAT16)
    return g.op("Mul", y, w)


def _linear(g: _Graph, weight: _Weights, x: str, name: str) -> str:
    y = g.op("MatMul", x, weight.matrix(f"{name}.weight"))
    if f"{name}.bias" in weight.tensors:
        y = g.op("Add", y, weight.vector(f"{name}.bias"))
    return y


def _heads(g: _Graph, x: str, n: int, d: int) -> str:
    """(1, seq, n*d) -> (1, n, seq, d)"""
    return g.op("Transpose", g.op("Reshape", x, g.const([0, 0, n, d], np.int64)), perm=[0, 2, 1, 3])


def _rotate(g: _Graph, x: str, cos: str, sin: str, d: int) -> str:
    half = d // 2
    x1 = g.op("Slice", x, g.const([0], np.int64), g.const([half], np.int64), g.const([3], np.int64))
    x2 = g.op("Slice", x, g.const([half], np.int64), g.const([d], np.int64), g.const([3], np.int64))
    return g.op("Concat", g.op("Sub", g.op("Mul", x1, cos), g.op("Mul", x2, sin)),
                g.op("Add", g.op("Mul", x2, cos), g.op("Mul", x1, sin)), axis=3)


def _layer(g: _Graph, hp: Hyper, weight: _Weights, i: int, h: str, cos: str, sin: str, mask: str) -> str:
    from onnx import TensorProto, helper

    p, d = f"blk.{i}", hp.head_dim
    x = _rms(g, hp, h, weight.vector(f"{p}.attn_norm.weight"))
    q = _rotate(g, _heads(g, _linear(g, weight, x, f"{p}.attn_q"), hp.n_head, d), cos, sin, d)
    k = _rotate(g, _heads(g, _linear(g, weight, x, f"{p}.attn_k"), hp.n_head_kv, d), cos, sin, d)
    v = _heads(g, _linear(g, weight, x, f"{p}.attn_v"), hp.n_head_kv, d)
    for name, new in (("key", k), ("value", v)):
        g.nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.{name}", new], [f"present.{i}.{name}"],
                                        axis=2))
    # The query heads sharing a KV head are stacked along the sequence axis: no copy of the cache per head.
    qg = g.op("Reshape", q, g.const([0, hp.n_head_kv, -1, d], np.int64))
    scores = g.op("MatMul", qg, g.op("Transpose", f"present.{i}.key", perm=[0, 1, 3, 2]))
    if g.dtype != np.float32:
        scores = g.op("Cast", scores, to=TensorProto.FLOAT)
    scores = g.op("Add", g.op("Mul", scores, g.const(1.0 / np.sqrt(d), np.float32)), mask)
    probs = g.op("Softmax", scores, axis=-1)
    if g.dtype != np.float32:
        probs = g.op("Cast", probs, to=TensorProto.FLOAT16)
    o = g.op("Reshape", g.op("MatMul", probs, f"present.{i}.value"), g.const([0, hp.n_head, -1, d], np.int64))
    o = g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]), g.const([0, 0, hp.n_head * d], np.int64))
    h = g.op("Add", h, _linear(g, weight, o, f"{p}.attn_output"))
    x = _rms(g, hp, h, weight.vector(f"{p}.ffn_norm.weight"))
    gate = _linear(g, weight, x, f"{p}.ffn_gate")
    up = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), _linear(g, weight, x, f"{p}.ffn_up"))
    return g.op("Add", h, _linear(g, weight, up, f"{p}.ffn_down"))


def _save(model: Any, tmp: Path, precision: str) -> None:
    import onnx

    path = tmp / MODEL_FILE
    onnx.save_model(model, str(path))  # the weights are already in DATA_FILE, referenced by offset
    if precision in ("int4", "int8"):
        from edgespec.onnx import runtime as ort

        quantized = ort.quantize_weights(str(path), int(precision[3:]), QUANT_BLOCK)
        (tmp / DATA_FILE).unlink()
        onnx.save_model(quantized, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=DATA_FILE, size_threshold=1024)


def _vocab(reader: Any, hp: Hyper) -> dict[str, Any]:
    """What the vocabulary check compares, so the export needs no GGUF to be used."""

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    tokens = field("tokenizer.ggml.tokens") or []
    types = field("tokenizer.ggml.token_type") or []
    kind = {"llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5}.get(field("tokenizer.ggml.model"), 0)
    eog = {t for t in (field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.eot_token_id"),
                       field("tokenizer.ggml.eom_token_id")) if t is not None}
    # llama.cpp also ends generation at control tokens named like these (its vocab's EOG heuristic).
    eog |= {i for i, (t, ty) in enumerate(zip(tokens, types))
            if ty == 3 and t in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")}
    add_bos = field("tokenizer.ggml.add_bos_token")
    return {"type": kind, "bos": field("tokenizer.ggml.bos_token_id"), "eos": field("tokenizer.ggml.eos_token_id"),
            "add_bos": bool(add_bos) if add_bos is not None else kind == 1, "eog": sorted(eog), "tokens": tokens}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
