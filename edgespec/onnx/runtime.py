"""ONNX Runtime: the one module that imports onnxruntime. An ONNX draft decoder whose KV cache is arrays.

The cache is the model's own present.N.key/value outputs, kept where the execution provider made them
(IO binding: on the GPU for CUDA) and fed back as the next pass's past; rollback slices every array to n
positions on the same device, and is checked after every trim, as the llama.cpp caches are.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edgespec.backend import KVSequence
from edgespec.config import DEFAULT_N_BATCH, DEFAULT_N_CTX, DRAFT_DEVICES, LoadConfig
from edgespec.decoding.loop import FirstSequence
from edgespec.errors import ContextOverflowError, EdgespecError, InvalidModelError, InvalidRequestError
from edgespec.onnx.files import OnnxDraftFiles, locate

# --draft-device names (config.DRAFT_DEVICES) and the execution providers behind them, in the order "auto" tries.
DEVICES = {"cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider", "coreml": "CoreMLExecutionProvider",
           "openvino": "OpenVINOExecutionProvider", "cpu": "CPUExecutionProvider"}
GPU_DEVICES = ("cuda", "dml", "coreml")  # where the draft's weights and cache leave RAM


@functools.cache
def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError as e:
        raise InvalidRequestError("ONNX drafts need onnxruntime; install it with pip install 'edgespec[onnx]'") from e
    onnxruntime.set_default_logger_severity(3)  # errors only: a provider that cannot start is reported by us
    return onnxruntime


def version() -> str | None:
    try:
        return _ort().__version__
    except InvalidRequestError:
        return None


def providers() -> list[str]:
    """The --draft-device names the installed onnxruntime offers (empty without onnxruntime)."""
    try:
        have = set(_ort().get_available_providers())
    except InvalidRequestError:
        return []
    return [name for name, ep in DEVICES.items() if ep in have]


def quantize_weights(model_path: str, bits: int, block_size: int) -> Any:
    """The model with its MatMul weights in `bits` (MatMulNBits), by onnxruntime's own quantizer."""
    _ort()
    import logging

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.setLevel(level)  # the quantizer's import configures the root logger at INFO; put it back
    root.handlers[:] = handlers
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # it logs every node at INFO
    # Accuracy level 4: activations in int8 on the CPU, as llama.cpp's Q8 activations for its quantized weights.
    q = MatMulNBitsQuantizer(model_path, bits=bits, block_size=block_size, is_symmetric=False, accuracy_level=4)
    q.process()
    return q.model.model


def planned_device(device: str) -> str:
    """The device an ONNX draft will run on for --draft-device `device`, before a session tries it."""
    if device not in DRAFT_DEVICES:
        raise InvalidRequestError(f"draft device {device!r} is not one of {', '.join(DRAFT_DEVICES)}")
    have = providers()
    if device != "auto" and device not in have:
        raise InvalidRequestError(f"draft device {device!r} is not in this onnxruntime build (it has "
                                  f"{', '.join(have) or 'none'}); pick one of those, or install onnxruntime-gpu "
                                  f"for cuda")
    wanted = [d for d in have if d != "cpu" and (d != "cuda" or _nvidia_driver())] if device == "auto" else [device]
    return wanted[0] if wanted else "cpu"


def _session(path: Path, device: str, n_threads: int) -> Any:
    ort = _ort()
    wanted = [planned_device(device)]
    if "cuda" in wanted and _nvidia_driver() and hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()  # CUDA and cuDNN from the nvidia-* wheels, where torch or the cuda extra put them
        except Exception:  # noqa: BLE001 - a missing library shows as the provider not starting, below
            pass
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = n_threads
    # Spinning threads would take the cores llama.cpp's next verify pass needs.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    opts.log_severity_level = 3
    try:
        eps = [DEVICES[d] for d in wanted if d != "cpu"] + ["CPUExecutionProvider"]
        sess = ort.InferenceSession(str(path), opts, providers=eps)
    except Exception as e:  # onnxruntime raises its own types for a bad file, a missing data file, a bad graph
        raise InvalidModelError(f"onnxruntime could not load {path} ({str(e).splitlines()[0][:300]}); the file is "
                                f"truncated, corrupt or lacks its external data: export it again "
                                f"(`edgespec models export-onnx NAME --force`) or copy the whole directory") from e
    got = next(d for d, ep in DEVICES.items() if ep == sess.get_providers()[0])
    if device != "auto" and got != device:
        raise InvalidRequestError(f"draft device {device!r} did not start (onnxruntime fell back to {got}); check "
                                  f"its drivers, or use --draft-device {got}")
    return sess, got


class OnnxModel(FirstSequence):
    """An ONNX draft: the session, its vocabulary, and one KV sequence per slot (backend.Model's interface)."""

    can_shift = False  # see OnnxSequence

    def __init__(self, path: str | Path, cfg: LoadConfig | None = None, device: str = "auto") -> None:
        self.files: OnnxDraftFiles = locate(path)
        self.path = self.files.path
        self.session, self.device = _session(self.files.model, device, (cfg or LoadConfig()).n_threads)
        self.cfg = replace(cfg or LoadConfig(), n_gpu_layers=0)
        self.device_key = f"onnxruntime-{self.device}"  # calibrations are kept per execution provider
        self.vocab, self.n_vocab = self.files.vocab, self.files.n_vocab
        inputs = {i.name: i for i in self.session.get_inputs()}
        self._past = sorted((n for n in inputs if n.startswith("past_key_values.")), key=_layer_order)
        if not self._past or "input_ids" not in inputs:
            raise InvalidModelError(f"{self.files.model} has no past_key_values inputs: it is not a decoder with "
                                    f"a KV cache (optimum's text-generation-with-past); export it with one")
        first = inputs[self._past[0]]
        self._kv_dtype = np.float16 if first.type == "tensor(float16)" else np.float32
        self._kv_shape = [1 if not isinstance(s, int) else s for s in first.shape]
        self._inputs = set(inputs)
        self.n_ctx = min(self.cfg.n_ctx or DEFAULT_N_CTX, int(self.files.hyper.get("n_ctx_train") or DEFAULT_N_CTX))
        self.n_batch = DEFAULT_N_BATCH
        self._slicer = _Slicer(self)
        self.sequences = [OnnxSequence(self) for _ in range(self.cfg.n_seq)]

    def is_eog(self, token: int) -> bool:
        return self.files.is_eog(token)

    def token_text(self, token: int) -> str:
        return self.files.token_text(token)

    def close(self) -> None:
        self.sequences = []
        self.session = None


class OnnxSequence:
    """One KV sequence: the past arrays (OrtValues on the provider's device) and the tokens they hold."""

    def __init__(self, model: OnnxModel) -> None:
        self.model = model
        self.tokens: list[int] = []
        self._kv: list[Any] = model._slicer.empty()

    # These read only `model` and `tokens`: the llama.cpp sequence's own.
    n_ctx = KVSequence.n_ctx
    n_past = KVSequence.n_past
    is_eog = KVSequence.is_eog

    def decode(self, tokens: Sequence[int], n_outputs: int = 1) -> np.ndarray:
        """Append `tokens`; the logits of the last `n_outputs` of them (edgespec's export gives only the last)."""
        n, md = len(tokens), self.model
        if n == 0 or not 0 <= n_outputs <= 1:
            raise ValueError(f"decode of {n} tokens with {n_outputs} outputs (an ONNX draft gives at most 1)")
        if self.n_past + n > md.n_ctx:
            raise ContextOverflowError(f"{self.n_past + n} tokens do not fit the draft's context of {md.n_ctx}; "
                                       f"use a shorter prompt")
        logits = None
        for start in range(0, n, md.n_batch):
            logits = self._run(list(tokens[start:start + md.n_batch]))
        assert logits is not None
        return logits[-n_outputs:] if n_outputs else np.empty((0, md.n_vocab), np.float32)

    def _run(self, chunk: list[int]) -> np.ndarray:
        md = self.model
        io = md.session.io_binding()
        ids = np.asarray([chunk], dtype=np.int64)
        io.bind_cpu_input("input_ids", ids)
        if "position_ids" in md._inputs:
            io.bind_cpu_input("position_ids", np.arange(self.n_past, self.n_past + len(chunk), dtype=np.int64)[None])
        if "attention_mask" in md._inputs:
            io.bind_cpu_input("attention_mask", np.ones((1, self.n_past + len(chunk)), dtype=np.int64))
        for name, value in zip(md._past, self._kv):
            io.bind_ortvalue_input(name, value)
        io.bind_output("logits", "cpu")
        where = "cuda" if md.device == "cuda" else "cpu"
        for name in md._past:
            io.bind_output(name.replace("past_key_values.", "present."), where)
        try:
            md.session.run_with_iobinding(io)
        except Exception as e:  # noqa: BLE001 - onnxruntime's own exception types, one per status code
            raise EdgespecError(f"onnxruntime failed on {md.files.name} at position {self.n_past} "
                                f"({str(e).splitlines()[0][:300]}); try --draft-device cpu, or the GGUF draft") from e
        outs = io.get_outputs()
        self._kv = outs[1:]
        self.tokens.extend(chunk)
        return outs[0].numpy()[0].astype(np.float32, copy=False)  # an fp16 optimum export gives fp16 logits

    def trim(self, n_keep: int) -> int:
        """Keep the first `n_keep` cached tokens; every array is sliced to them, then checked."""
        n_keep = max(0, min(n_keep, self.n_past))
        dropped = self.n_past - n_keep
        if dropped == 0:
            return 0
        self._kv = self.model._slicer.slice(self._kv, n_keep)
        del self.tokens[n_keep:]
        bad = [s[2] for s in (v.shape() for v in self._kv) if s[2] != n_keep]
        if bad:
            raise EdgespecError(f"KV cache of {self.model.files.name} holds {bad[0]} positions after trimming to "
                                f"{n_keep}")
        return dropped

    # Both read only `tokens` and `trim`: the two caches agree on prefixes.
    shared_prefix = KVSequence.shared_prefix
    keep_prefix_of = KVSequence.keep_prefix_of
    can_shift = False  # the past arrays are sliced, never moved: a prefix is all that is reused

    def prompt_row(self, prompt: Sequence[int]) -> None:
        return None  # the past arrays keep no row: a prompt evaluated again decodes its last token

    def evaluate(self, prompt: Sequence[int], runs: Sequence[tuple[int, int, int]] = (), n_outputs: int = 1,
                 stop: Any = None, step: Any = None) -> np.ndarray:
        """As KVSequence.evaluate, for a prefix run only."""
        prefix = runs[0][2] if runs and runs[0][:2] == (0, 0) else 0
        self.trim(prefix)
        return self.decode(prompt[prefix:], n_outputs)


class _Slicer:
    """A graph of one Slice per cache array, run on the provider's device: rollback without a host copy."""

    def __init__(self, model: OnnxModel) -> None:
        from onnx import TensorProto, helper

        ort = _ort()
        self.model = model
        elem = TensorProto.FLOAT16 if model._kv_dtype == np.float16 else TensorProto.FLOAT
        names = model._past
        nodes = [helper.make_node("Slice", [f"x{i}", "zero", "n", "axis"], [f"y{i}"]) for i in range(len(names))]
        graph = helper.make_graph(
            nodes, "trim", [helper.make_tensor_value_info(f"x{i}", elem, None) for i in range(len(names))]
            + [helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
            [helper.make_tensor_value_info(f"y{i}", elem, None) for i in range(len(names))],
            [helper.make_tensor("zero", TensorProto.INT64, [1], [0]), helper.make_tensor("axis", TensorProto.INT64,
                                                                                          [1], [2])])
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        eps = [DEVICES[model.device], "CPUExecutionProvider"] if model.device == "cuda" else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(proto.SerializeToString(), providers=eps)
        self.where = "cuda" if model.device == "cuda" else "cpu"

    def empty(self) -> list[Any]:
        ort = _ort()
        shape = list(self.model._kv_shape)
        shape[2] = 0
        return [ort.OrtValue.ortvalue_from_shape_and_type(shape, self.model._kv_dtype, self.where, 0)
                for _ in self.model._past]

    def slice(self, values: list[Any], n: int) -> list[Any]:
        if n == 0:
            return self.empty()
        io = self.session.io_binding()
        for i, v in enumerate(values):
            io.bind_ortvalue_input(f"x{i}", v)
            io.bind_output(f"y{i}", self.where)
        io.bind_cpu_input("n", np.asarray([n], dtype=np.int64))
        self.session.run_with_iobinding(io)
        return io.get_outputs()


def _nvidia_driver() -> bool:
    """Whether an NVIDIA driver is installed: only then is CUDA worth trying (and its libraries worth loading)."""
    return sys.platform == "win32" or Path("/proc/driver/nvidia/version").exists()


def _layer_order(name: str) -> tuple[int, int]:
    """past_key_values.N.key / .value in layer order, key first: matched to present.N.* by name."""
    _, n, kind = name.split(".")
    return int(n), kind != "key"
