"""The only package that imports llama_cpp: one GGUF model with its KV cache (its sequences: backend.kv).

`Model` holds one llama.cpp context with `LoadConfig.n_seq` KV sequences, each a `KVSequence` whose contents are
mirrored in its `tokens` (position i holds tokens[i]); the model's own decode/trim act on sequence 0. They share one
buffer of n_ctx cells a sequence (unified), as the parks do. Everything above speaks token ids and numpy arrays.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import llama_cpp.llama_grammar  # binds llama_cpp too
import numpy as np

from edgespec.config import DEFAULT_N_CTX, LoadConfig
from edgespec.backend.kv import KVSequence
from edgespec.decoding.loop import FirstSequence
from edgespec.decoding.rules import check_json_schema, pieces_of
from edgespec.errors import EdgespecError, InvalidModelError, InvalidRequestError, stderr_captured
from edgespec import gguf
from edgespec.gguf import ModelFacts, Vocab, check_gguf_file
from edgespec.text import to_utf8

log = logging.getLogger(__name__)
_llama_log = logging.getLogger("edgespec.llama_cpp")

# Spare KV sequences that hold the chunks of a cache being reused elsewhere while the text before them is evaluated:
# llama.cpp only appends to a sequence, so a chunk after an insertion waits outside it (KVSequence.evaluate).
PARKS = 8
_FLASH_ATTN = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
               "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}
# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation; info is load chatter, so DEBUG here.
_LEVELS = {3: logging.WARNING, 4: logging.ERROR}
# What llama.cpp says of a batch the abort callback ended (GGML_STATUS_ABORTED, llama_decode's 2).
_ABORTED = re.compile(r"failed with error 1$|compute status: 1$|ret = 2$|removing memory module entries")
# llama.cpp's last error lines, quoted in our own error messages.
_recent_errors: collections.deque[str] = collections.deque(maxlen=4)


@llama_cpp.llama_log_callback
def _on_llama_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp is chatty on stderr; route it to logging so the CLI decides what shows.
    msg = text.decode("utf-8", "replace").rstrip()
    level = 1 if _ABORTED.search(msg) else level  # a batch ended by Model.abort, as asked: no error
    if level == 4:
        _recent_errors.append(msg)
    if msg:
        _llama_log.log(_LEVELS.get(level, logging.DEBUG), "%s", msg)


llama_cpp.llama_log_set(_on_llama_log, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()


# llama.cpp asks an abort callback between the graph's nodes, on its compute thread. libc's atoi, given a one-byte
# string, answers there without Python (a Python callback would take the GIL per node): b"1" aborts the batch.
_libc = ctypes.cdll.msvcrt if sys.platform == "win32" else ctypes.CDLL(None)
_ATOI = llama_cpp.ggml_abort_callback(ctypes.cast(_libc.atoi, ctypes.c_void_p).value)


def _first_error() -> str:
    """The root cause: llama.cpp logs it first, then a generic 'failed to load'."""
    return _recent_errors[0] if _recent_errors else "no reason given"


@dataclass(frozen=True)
class RemoteLayers:
    """The target's last layers on other devices (RPC workers), in order: `layers[i]` units on `devices[i]`; the
    other units stay on this machine's CPU, and the last device computes the output layer."""

    devices: tuple[int, ...]  # ggml_backend_dev_t, as devices.rpc_devices gives them
    layers: tuple[int, ...]

    def apply(self, mparams: llama_cpp.llama_model_params) -> tuple:
        devices = (ctypes.c_void_p * (len(self.devices) + 1))(*self.devices, None)
        split = (ctypes.c_float * llama_cpp.llama_max_devices())(*map(float, self.layers))
        mparams.devices, mparams.tensor_split = ctypes.cast(devices, ctypes.c_void_p).value, split
        mparams.split_mode, mparams.n_gpu_layers = llama_cpp.LLAMA_SPLIT_MODE_LAYER, sum(self.layers)
        mparams.use_extra_bufts = False  # the workers do not repack either: the same kernels on both sides
        return devices, split


def _place_weights(mparams: llama_cpp.llama_model_params, path: Path, cfg: LoadConfig, facts_only: bool,
                   remote: RemoteLayers | None) -> object:
    """Where the load puts the weights; what it returns must outlive the load."""
    mparams.n_gpu_layers = cfg.n_gpu_layers if cfg.n_gpu_layers >= 0 else 999
    if not (cfg.mmap or facts_only):
        mparams.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE  # read into memory; the default maps the file
    if facts_only or not cfg.repack or amx_build():
        mparams.use_extra_bufts = False  # no repacking (of weights that will not run; AMX: amx_build)
    repack = cfg.repack and not facts_only and amx_build()
    return remote.apply(mparams) if remote is not None else repack_without_amx(mparams, path) if repack else None


def supports_rpc() -> bool:
    """Whether the installed llama.cpp was built with RPC (CMAKE_ARGS=\"-DGGML_RPC=on\")."""
    return bool(llama_cpp.llama_supports_rpc())


def _context_params(cfg: LoadConfig, parks: int, aside: int) -> llama_cpp.llama_context_params:
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = (cfg.n_ctx or DEFAULT_N_CTX) * cfg.n_seq + aside
    # One buffer for every sequence (llama-server's default too): a chunk moves to a park sequence and back by
    # changing which sequences its cells belong to, with no copy.
    cparams.n_seq_max = cfg.n_seq + parks + (1 if aside else 0)
    cparams.n_batch = cparams.n_ubatch = max(cfg.n_batch, cparams.n_seq_max)  # else llama.cpp aborts (n_outputs_max)
    cparams.kv_unified = cparams.no_perf = True
    cparams.n_threads = cparams.n_threads_batch = cfg.n_threads
    cparams.flash_attn_type = _FLASH_ATTN[cfg.flash_attn]
    return cparams


class Model(FirstSequence):
    """A loaded GGUF and its one-sequence KV cache. `facts_only` maps the weights and makes no context (what tokenizing
    and grammars need, for a target that runs in another process); `remote` places the last layers on ggml devices
    (RPC workers: devices.rpc_devices), the first ones staying on this machine's CPU."""

    aside: KVSequence | None = None  # LoadConfig.aside's sequence (engine.slots.SlotPool); none without parks

    @staticmethod
    def padded(n: int) -> int:
        """How many tokens a batch of `n` is evaluated as, filler after them dropped once done: the engine sets
        the calibrated choice (decoding.costs.PromptRate.padded), since some sizes cost less than a smaller one."""
        return n

    def __init__(self, path: str | Path, cfg: LoadConfig | None = None, *, facts_only: bool = False,
                 remote: RemoteLayers | None = None) -> None:
        self.cfg = cfg = cfg or LoadConfig()
        self.path = path = Path(path)
        check_gguf_file(path)
        mparams = llama_cpp.llama_model_default_params()
        keep = _place_weights(mparams, path, cfg, facts_only, remote)  # the arrays live until the load returns
        _recent_errors.clear()
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        del keep
        if not self._model:
            raise InvalidModelError(
                f"llama.cpp could not load {path} ({_first_error()}); the file is truncated, corrupt or of an "
                f"unsupported architecture: fetch it again (`edgespec models fetch NAME`) or pick another GGUF"
            )
        self._ctx = self._batch = self._infill = None  # llama.cpp's infill sampler is made when first used
        try:
            self._vocab_p = llama_cpp.llama_model_get_vocab(self._model)
            self.facts = self._read_facts()
            self.vocab = self._read_vocab()
            self.n_vocab = self.vocab.n_tokens
            if facts_only:
                return
            # Recurrent state has nothing to park; a sliding-window cache would grow to the whole context with them
            # (llama.cpp sizes it by the sequences), so those models reuse a prefix only.
            windowed = self.facts.recurrent or llama_cpp.llama_model_n_swa(self._model) > 0
            self._parks = [] if windowed else list(range(cfg.n_seq, cfg.n_seq + PARKS))
            aside = cfg.aside if self._parks else 0  # a slot takes the aside by exchange, which needs parks
            cparams = _context_params(cfg, len(self._parks), aside)
            self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
            if not self._ctx:
                raise EdgespecError(f"llama.cpp could not create a context of {cparams.n_ctx} tokens for {path} "
                                    f"({_first_error()}); try a smaller context (--ctx)")
            self.n_ctx = (int(llama_cpp.llama_n_ctx(self._ctx)) - aside) // cfg.n_seq
            self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
            self._mem = llama_cpp.llama_get_memory(self._ctx)
            self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
            for i in range(self.n_batch):
                self._batch.n_seq_id[i] = 1
                self._batch.seq_id[i][0] = 0
            self._batch_seq = 0  # the seq id written in every batch row; rewritten only when it changes
            self._abort, self._armed = ctypes.create_string_buffer(b"0", 2), False  # read during abortable batches
            self._shifted = False  # entries moved since the last decode (KVSequence._move): it re-rotates them
            # token/pos/logits are written through numpy views.
            self._b_token = np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,))
            self._b_pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
            self._b_logits = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        except BaseException:
            self.close()
            raise
        # Recurrent state cannot be cut at an arbitrary position; speculation needs that.
        self.can_trim = not self.facts.recurrent
        # Chunk reuse moves cached entries to new positions (a K-shift); sliding-window caches and M-RoPE cannot.
        self.can_shift = bool(self._parks) and bool(llama_cpp.llama_memory_can_shift(self._mem))
        self.sequences = [KVSequence(self, i) for i in range(cfg.n_seq)]
        self.aside = KVSequence(self, cfg.n_seq + PARKS) if aside else None
        for s in [*self.sequences, *([self.aside] if self.aside else [])]:  # a slot and the aside trade sequences
            s.group_lines = cfg.fim_groups
        self._pieces: dict[int, bytes] = {}
        self._newline: np.ndarray | None = None

    # -- decoding: sequence 0 (FirstSequence) ---------------------------------------

    def _set_batch_seq(self, seq: int) -> None:
        if seq != self._batch_seq:
            for i in range(self.n_batch):
                self._batch.seq_id[i][0] = seq
            self._batch_seq = seq

    # -- vocabulary ---------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = to_utf8(text)
        cap = len(data) + 8
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab_p, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            buf = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(self._vocab_p, data, len(data), buf, len(buf), add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token; control tokens render as nothing."""
        if (piece := self._pieces.get(token)) is None:
            piece = self._pieces[token] = self._render(token, special=False)
        return piece

    def infill_keep(self, ids: np.ndarray, p: np.ndarray) -> np.ndarray:
        """The ids llama.cpp's infill sampler (llama_sampler_init_infill) keeps of a distribution over `ids`."""
        self._infill = self._infill or llama_cpp.llama_sampler_init_infill(self._vocab_p)
        data = (llama_cpp.llama_token_data * len(ids))(*[(int(t), float(np.log(q)), float(q)) for t, q in zip(ids, p)])
        cur = llama_cpp.llama_token_data_array(data, len(ids), -1, False)
        llama_cpp.llama_sampler_apply(self._infill, ctypes.byref(cur))
        return np.array([cur.data[i].id for i in range(cur.size)], dtype=np.int64)

    def token_piece(self, token: int) -> bytes:
        """The bytes of one token with control tokens written out (llama.cpp's /tokenize and /detokenize)."""
        return self._render(token, special=True)

    def _render(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab_p, token, buf, 64, 0, special)
        if n < 0:  # buffer too small: -n is the size needed
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab_p, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        """The vocabulary entry as stored in the GGUF (used to compare vocabularies)."""
        return llama_cpp.llama_vocab_get_text(self._vocab_p, token).decode("utf-8", "replace")

    @property
    def fim_marks(self) -> tuple[int, int, int] | None:
        """<fim_prefix>, <fim_suffix> and <fim_middle>; None where the vocabulary lacks one."""
        v = self.vocab
        return None if None in (v.fim_pre, v.fim_suf, v.fim_mid) else (v.fim_pre, v.fim_suf, v.fim_mid)

    def newline_ends(self) -> np.ndarray:
        """By token id: whether its text ends with a newline (where a line of a prompt ends: decoding.parts), read
        off the vocabulary's pieces token healing reads too (decoding.rules.pieces_of)."""
        if self._newline is None:
            self._newline = np.array([p.endswith(b"\n") for p in pieces_of(self).pieces], dtype=bool)
        return self._newline

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab_p, token))

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, 256)
        if n >= 256:
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, n + 1)
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def _read_vocab(self) -> Vocab:
        v = self._vocab_p
        ids = {name: int(getattr(llama_cpp, f"llama_vocab_{name}")(v))
               for name in ("bos", "eos", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")}
        special = {name: None if t == llama_cpp.LLAMA_TOKEN_NULL else t for name, t in ids.items()}
        return Vocab(n_tokens=int(llama_cpp.llama_vocab_n_tokens(v)), type=int(llama_cpp.llama_vocab_type(v)),
                     add_bos=bool(llama_cpp.llama_vocab_get_add_bos(v)), **special)

    def _read_facts(self) -> ModelFacts:
        m = self._model
        arch = self.meta("general.architecture") or "unknown"
        n_embd, n_head = int(llama_cpp.llama_model_n_embd(m)), int(llama_cpp.llama_model_n_head(m))
        default_dim = n_embd // max(n_head, 1)
        template = llama_cpp.llama_model_chat_template(m, None)
        return ModelFacts(
            path=self.path, architecture=arch, n_layer=int(llama_cpp.llama_model_n_layer(m)), n_head=n_head,
            n_head_kv=int(llama_cpp.llama_model_n_head_kv(m)), n_embd=n_embd,
            head_dim_k=int(self.meta(f"{arch}.attention.key_length") or default_dim),
            head_dim_v=int(self.meta(f"{arch}.attention.value_length") or default_dim),
            n_ff=int(self.meta(f"{arch}.feed_forward_length") or 4 * n_embd),
            n_vocab=int(llama_cpp.llama_vocab_n_tokens(self._vocab_p)),
            n_ctx_train=int(llama_cpp.llama_model_n_ctx_train(m)), weights_bytes=int(llama_cpp.llama_model_size(m)),
            chat_template=template.decode("utf-8", "replace") if template else None,
            recurrent=bool(llama_cpp.llama_model_is_recurrent(m) or llama_cpp.llama_model_is_hybrid(m)))

    # -- lifetime -------------------------------------------------------------

    def abort(self) -> None:
        """End the abortable batch in flight (background work: KVSequence.decode) within a graph node; thread-safe."""
        if getattr(self, "_abort", None) is not None:  # none without a context of its own (RemoteTarget)
            self._abort[0] = b"1"

    def _arm(self, abortable: bool) -> None:
        """Give the next batch the abort callback (its flag cleared) if it is abortable, else none."""
        self._abort[0] = b"0"
        if abortable != self._armed:
            llama_cpp.llama_set_abort_callback(self._ctx, _ATOI if abortable else llama_cpp.ggml_abort_callback(),
                                               ctypes.cast(self._abort, ctypes.c_void_p) if abortable else None)
            self._armed = abortable

    def close(self) -> None:
        for name, free in (("_infill", llama_cpp.llama_sampler_free), ("_batch", llama_cpp.llama_batch_free),
                           ("_ctx", llama_cpp.llama_free), ("_model", llama_cpp.llama_model_free)):
            if getattr(self, name, None):
                free(getattr(self, name))
                setattr(self, name, None)

    def __del__(self) -> None:
        self.close()


# llama_token_data as numpy lays it out, so a candidate array is built without a Python loop.
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


class Grammar:
    """llama.cpp's grammar sampler over a model's vocabulary: which tokens may come next, advanced token by token
    (`accept` only ever takes a token `allowed` admitted: llama.cpp aborts the process on a forbidden one)."""

    done = False  # it constrains every token to the end (rules.Grammar)

    def __init__(self, model: Model, gbnf: str, root: str = "root", *, what: str = "grammar",
                 trigger: str | None = None) -> None:
        """`trigger`: the grammar applies from this text on (fed to it too), the output before it is free,
        as llama.cpp's lazy grammars for tool calls; a trigger that is one token is matched as that token."""
        self.model, self.gbnf = model, gbnf
        _recent_errors.clear()
        g, r = gbnf.encode("utf-8"), root.encode("utf-8")
        if trigger is None:
            self._s = llama_cpp.llama_sampler_init_grammar(model._vocab_p, g, r)
        else:
            ids = model.tokenize(trigger, add_special=False, parse_special=True)
            one = len(ids) == 1
            tokens = (llama_cpp.llama_token * 1)(*ids[:1])
            patterns = (ctypes.c_char_p * 1)(f"[\\s\\S]*?({re.escape(trigger)}[\\s\\S]*)".encode("utf-8"))
            self._s = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
                model._vocab_p, g, r, patterns, 0 if one else 1, tokens, 1 if one else 0)
        if not self._s:  # llama.cpp prints the parser's reason on stderr, not to its log: parse again to read it
            with stderr_captured() as said:
                llama_cpp.llama_sampler_init_grammar(model._vocab_p, g, r)
            reason = next((line for line in said() if "error parsing grammar" in line), _first_error())
            raise InvalidRequestError(f"{what} does not parse as GBNF ({reason.split(': ', 1)[-1]}); fix it by "
                                      f"llama.cpp's grammar rules (grammars/README.md), with a rule named {root!r}")

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` the grammar admits next (a bool per id)."""
        data = np.zeros(len(ids), _TOKEN_DATA)
        data["id"] = ids
        cur = llama_cpp.llama_token_data_array(data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
                                               len(ids), -1, False)
        llama_cpp.llama_sampler_apply(self._s, ctypes.byref(cur))
        return data["logit"] != -np.inf

    def accept(self, token: int) -> None:
        llama_cpp.llama_sampler_accept(self._s, token)

    def clone(self) -> Grammar:
        other = object.__new__(Grammar)
        other.model, other.gbnf, other._s = self.model, self.gbnf, llama_cpp.llama_sampler_clone(self._s)
        return other

    def close(self) -> None:
        if getattr(self, "_s", None):
            llama_cpp.llama_sampler_free(self._s)
            self._s = None

    def __del__(self) -> None:
        self.close()


def json_schema_gbnf(schema: dict, what: str = "json_schema", rule: str = "root") -> str:
    """llama.cpp's own JSON-schema-to-GBNF conversion (the one llama-server uses), of a schema that is valid;
    `rule` names the schema's top rule, so the grammar can be part of a larger one."""
    check_json_schema(schema, what)
    try:
        converter = llama_cpp.llama_grammar.SchemaConverter(prop_order={}, allow_fetch=False, dotall=False,
                                                             raw_pattern=False)
        converter.visit(converter.resolve_refs(schema, "stdin"), "" if rule == "root" else rule)
        return converter.format_grammar()
    except (AssertionError, ValueError, KeyError, TypeError, AttributeError, NotImplementedError, RecursionError) as e:
        raise InvalidRequestError(
            f"{what} cannot be turned into a grammar: {type(e).__name__}: {e}; llama.cpp's converter handles "
            f"type, properties, required, items, enum, const, anyOf/oneOf/allOf, local $ref and patterns "
            f"written ^...$; simplify the schema or pass a GBNF grammar instead") from e


def system_info() -> str:
    """llama.cpp's build features (CPU flags, GPU backends)."""
    return llama_cpp.llama_print_system_info().decode("utf-8", "replace")


@functools.cache
def amx_build() -> bool:
    """Whether llama.cpp has its AMX kernels, which GCC 12 miscompiles: it drops the tile sizes' stores before the
    tile config's load, so the first matrix product dies (SIGSEGV). Weights then skip the extra buffer types."""
    if amx := "AMX_INT8 = 1" in system_info():
        log.info("llama.cpp's AMX kernels are off; weights are repacked by name (docs/robustness.md)")
    return amx


def repack_without_amx(mparams: llama_cpp.llama_model_params, path: Path) -> tuple | None:
    """Puts the weights llama.cpp repacks for AVX2, of the layers left on the CPU, in its CPU_REPACK buffer by name: an
    AMX build keeps those kernels without AMX (`use_extra_bufts` turns off both). Returns what must outlive the load."""
    # a backend besides the CPU's (system_info lists each but RPC) takes the last layers; safe if it finds no GPU
    on_gpu = mparams.n_gpu_layers if set(re.findall(r"(\w+) : ", system_info())) - {"CPU"} else 0
    pattern, buft = gguf.repack_pattern(gguf.tensors(path), on_gpu), _extra_buffer_type(b"CPU_REPACK")
    if pattern is None or buft is None or "AVX2 = 1" not in system_info():
        return None
    text = ctypes.create_string_buffer(pattern.encode())  # {pattern, buft} pairs to a NULL one (an untyped field)
    overrides = (ctypes.c_void_p * 4)(ctypes.addressof(text), buft, None, None)  # llama_model_tensor_buft_override
    mparams.tensor_buft_overrides = ctypes.addressof(overrides)
    return text, overrides


@functools.cache
def ggml_libraries() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """libggml (the device registry) and libggml-base as the installed llama-cpp-python ships them, for the calls its
    bindings leave out (here and in devices.py), with the signatures of those both modules make declared."""
    from llama_cpp._ctypes_extensions import load_shared_library

    llama_cpp.llama_backend_init()  # registers the backends; idempotent
    reg, dev = (load_shared_library(n, Path(llama_cpp.__file__).parent / "lib") for n in ("ggml", "ggml-base"))
    void, one = ctypes.c_void_p, [ctypes.c_void_p]
    for f, restype, args in ((reg.ggml_backend_dev_by_type, void, [ctypes.c_int]), (dev.ggml_backend_buft_name,
                             ctypes.c_char_p, one), (dev.ggml_backend_dev_backend_reg, void, one),
                             (dev.ggml_backend_reg_get_proc_address, void, [void, ctypes.c_char_p])):
        f.restype, f.argtypes = restype, args
    return reg, dev


@functools.cache
def _extra_buffer_type(name: bytes) -> int | None:
    """The CPU backend's extra buffer type of this name ("CPU_REPACK", "AMX"), if the build has it."""
    reg, dev = ggml_libraries()
    cpu = reg.ggml_backend_dev_by_type(0)
    get = dev.ggml_backend_reg_get_proc_address(dev.ggml_backend_dev_backend_reg(cpu),
                                                b"ggml_backend_dev_get_extra_bufts")
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(get)(cpu) if get else [None]
    return next((b for b in itertools.takewhile(bool, bufts) if dev.ggml_backend_buft_name(b) == name), None)
