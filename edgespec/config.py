"""The configuration schema shared by the Python API, the CLI and the server."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from edgespec.errors import InvalidRequestError

DEFAULT_MODEL = "qwen2.5-coder-1.5b"  # a catalog name (models/catalog.py)
DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512
DEFAULT_MAX_TOKENS = 256
DEFAULT_K = 4  # most tokens proposed per cycle by a fixed proposer
MAX_SEQ = 8  # most KV sequences (server slots) in one context
MAX_K = 63  # most tokens proposed per cycle by any proposer: a verify batch of 64
PROPOSERS = ("auto", "none", "ngram", "draft")
# Where an ONNX draft runs (onnx.runtime.DEVICES names the execution provider of each); auto: a GPU provider if one starts.
DRAFT_DEVICES = ("auto", "cuda", "dml", "coreml", "openvino", "cpu")
# llama.cpp's defaults for the filters; temperature 0 (greedy) as in mlx-lm,
# so a plain `edgespec generate` is reproducible.
DEFAULT_TEMPERATURE = 0.0
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
DEFAULT_REPEAT_LAST_N = 64  # llama.cpp's window for the repetition penalties (which default to off)
MAX_LOGPROBS = 20  # most alternatives reported per token (OpenAI's top_logprobs limit)
# The server. After SIGTERM it gives requests in flight this long, then cancels them (streams still end properly).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8012  # llama.vim's and llama.vscode's default endpoint
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_SSE_PING_SECONDS = 10.0  # a silent stream (a long CPU prefill) gets a comment this often
DEFAULT_SERVER_SLOTS = 2  # a chat and an editor's completions, each keeping its prompt cache
# Host memory for prompts the slots held before (engine.recall): llama-server's --cache-ram default, or an eighth of
# the machine's memory where that is less.
DEFAULT_CACHE_RAM_MIB = 8192
SHUTDOWN_GRACE_SECONDS = 10.0
# Per-route defaults, as each API documents its own: OpenAI's completions stop at 16 tokens and sample at
# temperature 1; a chat answer is bounded by the room left (and this); llama.cpp's routes sample at 0.8.
OPENAI_COMPLETIONS_MAX_TOKENS = 16
OPENAI_CHAT_MAX_TOKENS = 1024
OPENAI_TEMPERATURE = 1.0
LLAMA_N_PREDICT = 128
LLAMA_TEMPERATURE = 0.8
# /infill reuses cached chunks of at least this many tokens at their new position unless the request or --cache-reuse
# says otherwise; other routes reuse only a prefix. Small, because the few lines kept around a moving cursor
# (engine.infill) move as short chunks: the suffix's first lines, the prefix after a line was added.
INFILL_CACHE_REUSE = 16
FIM_LAYOUTS = ("prefix", "middle")  # where /infill puts the typed part of the cursor line (prompts.fim)
# After <fim_middle>: a keystroke then costs only its own tokens, the suffix stays cached, and healed (the typed
# text's trailing word or blanks) it completes as llama.cpp's layout does (docs/bench/editor.md).
DEFAULT_FIM_LAYOUT = "middle"
# Seconds past GenerationConfig.time_limit that a line may run before it is cut: as long again, at most this.
TIME_LIMIT_GRACE = 0.5
# Visible characters an answer's whole lines must hold before its time limit drops the line under way instead of
# waiting for its end (engine.generation.WholeLines): a closing bracket alone is no answer worth the next line.
WHOLE_LINES_MIN_CHARS = 4
# An /infill sent with both editor budgets (t_max_prompt_ms, t_max_predict_ms) is due this long after their sum,
# counted from its arrival (GenerationConfig.deadline; no cycle starts that would end past it, as long as the last
# one): the response fits in the second the editor's user is promised past the budgets, with 0.4 s of it left for
# the way to the handler and back and a last cycle longer than the one before (docs/bench/editor.md).
ANSWER_SLACK = 0.6
# Seconds of quiet after an /infill answer before its cut context is widened in the background: while the user
# types, the next request comes sooner and would pay for the widening's batch in flight and its moved cache.
WIDEN_DELAY = 2.0
# Tokens per batch of an evaluation nobody waits on (a warm-up): the next request aborts the batch in flight
# (backend.Model.abort) and loses it, so not the context's whole batch; larger ones cost less per token. An aside
# build sizes each batch to the pauses seen, this at most (decoding.costs.pause_batch).
BACKGROUND_BATCH = 64
PAUSES_KEPT = 16  # the last pauses between answers and requests that background batches are sized to (server.service)
# Cells `edgespec serve` sets apart for the aside sequence (LoadConfig.aside): a cut /infill context is built wider
# there, afresh, while nobody waits, and the editor's slot takes it whole when it is ready (engine.infill).
ASIDE_TOKENS = 1024
# Suffix lines a group holds where /infill's FIM prompts are held as parts (`edgespec serve --fim-groups`,
# decoding.parts): groups of one line cost completions, of four none, in replay (docs/bench/editor.md).
FIM_GROUP_LINES = 4
# Suffix lines such a slot is given in pauses, a group at a time: about llama-server's n_batch/4 tokens, the width
# that completed best in replay (docs/bench/editor.md).
GROUPED_SUFFIX_LINES = 24
# Seconds after an answer before background work starts: its compute threads take both cores of a small CPU, and the
# answer's delivery (the server's event loop, the editor reading it) and the editor's next request would wait on them.
ANSWER_QUIET = 0.05
QUIET_TICK_SECONDS = 0.1  # resolution of the quiet before background widening (server.service)
# The most a tick of a pause's clock counts (server.service.Pauses): a longer one is a stop (SIGSTOP, Ctrl-Z, a
# debugger, a lockstep benchmark's freeze), which ran no background work.
PAUSE_TICK_CAP = 0.25
# Cross-request memory (memory.py): the namespace of the machine's own user (CLI, Python API, a server without keys);
# a server's API keys each get one of their own. A namespace is also a file name, so it is kept to these characters.
MEMORY_LOCAL = "local"
MEMORY_NAMESPACE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def default_threads() -> int:
    """Physical cores this process may run on: llama.cpp gains nothing from hyper-threads on decode, and a thread
    beyond the cores a cpuset allows (taskset, docker --cpuset-cpus) stalls every barrier of the others."""
    import psutil

    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if not hasattr(os, "sched_getaffinity"):  # macOS and Windows: no affinity mask to honour
        return physical
    logical = psutil.cpu_count() or physical
    return max(1, min(physical, round(len(os.sched_getaffinity(0)) * physical / logical)))


FlashAttn = Literal["auto", "on", "off"]
FLASH_ATTN: tuple[str, ...] = ("auto", "on", "off")


@dataclass(frozen=True)
class LoadConfig:
    n_ctx: int | None = None  # None: the memory plan picks it (up to DEFAULT_N_CTX)
    n_threads: int = field(default_factory=default_threads)
    n_batch: int = DEFAULT_N_BATCH
    n_gpu_layers: int = -1  # layers on the GPU (llama.cpp's -ngl; layers + 1 includes the output); -1: the plan's
    # KV sequences, each of n_ctx: generations that can be under way at once, each keeping its own prefix
    # (the server's slots: a chat answer and an editor's completions).
    n_seq: int = 1
    # llama.cpp's own default: on where the backend has the kernels. It changes the arithmetic, so
    # outputs compare exactly only between runs with the same setting (llama-cpp-python's Llama defaults to off).
    flash_attn: FlashAttn = "auto"
    # Map the weights from the file (llama.cpp's default) or read them into memory. A mapped file that is
    # overwritten in place (truncated) kills the process with SIGBUS; a long-running server reads instead.
    mmap: bool = True
    # llama.cpp repacks quantized weights for this CPU's fastest kernels; RPC workers do not, so a run compared
    # token for token with one over workers turns it off.
    repack: bool = True
    # Cells of one more KV sequence beside the slots, the aside (engine.slots; 0: none). It holds at most this.
    aside: int = 0
    # FIM prompts held as parts, in groups of this many suffix lines (decoding.parts; 0: in one piece), where chunk
    # reuse is asked (n_cache_reuse > 0) and the cache can move entries.
    fim_groups: int = 0

    def __post_init__(self) -> None:
        if self.n_ctx is not None and self.n_ctx < 16:
            raise InvalidRequestError(f"context size {self.n_ctx} is too small; use at least 16 (e.g. --ctx 4096)")
        if self.n_threads < 1:
            raise InvalidRequestError(f"thread count {self.n_threads} must be >= 1; leave --threads out to use "
                                      f"the {default_threads()} physical cores")
        if self.flash_attn not in FLASH_ATTN:
            raise InvalidRequestError(f"flash attention {self.flash_attn!r} must be one of {', '.join(FLASH_ATTN)}")
        if not 1 <= self.n_seq <= MAX_SEQ:
            raise InvalidRequestError(f"{self.n_seq} slots: use 1 to {MAX_SEQ} (--slots)")
        if self.n_batch < 1:
            raise InvalidRequestError(f"batch size {self.n_batch} must be >= 1")
        if self.aside < 0:
            raise InvalidRequestError(f"aside of {self.aside} tokens must be >= 0 (0: none)")
        if self.fim_groups < 0:
            raise InvalidRequestError(f"FIM groups of {self.fim_groups} lines must be >= 0 (0: none; --fim-groups)")


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; the filters apply only when sampling."""

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K  # 0 disables
    top_p: float = DEFAULT_TOP_P  # 1 disables
    min_p: float = DEFAULT_MIN_P  # 0 disables
    seed: int | None = None  # None or -1 (llama.cpp's "random"): a fresh seed; any other int64 reproduces
    # llama.cpp's penalties over the last repeat_last_n tokens (prompt included; -1: all, 0: off):
    # a repeated token's logit divided by repeat_penalty (multiplied when negative), less
    # frequency_penalty per occurrence and presence_penalty once. They apply to greedy decoding too.
    repeat_penalty: float = 1.0
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -inf forbids the token
    infill: bool = False  # llama.cpp's infill sampler after the filters (decoding.sampling.infill); not when greedy

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature {self.temperature} must be in [0, 100]")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k {self.top_k} must be >= 0 (0 disables it)")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p {self.top_p} must be in [0, 1] (1 disables it, 0 keeps the top token)")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p {self.min_p} must be in [0, 1] (0 disables it)")
        if not 0.0 < self.repeat_penalty <= 100.0:
            raise InvalidRequestError(f"repeat_penalty {self.repeat_penalty} must be in (0, 100] (1 disables it)")
        if self.repeat_last_n < -1:
            raise InvalidRequestError(f"repeat_last_n {self.repeat_last_n} must be >= -1 (-1: the whole context, "
                                      f"0: off)")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -100.0 <= getattr(self, name) <= 100.0:
                raise InvalidRequestError(f"{name} {getattr(self, name)} must be in [-100, 100] (0 disables it)")
        for token, bias in self.logit_bias:
            if token < 0 or bias != bias or bias == np.inf:
                raise InvalidRequestError(f"logit_bias entry {token}: {bias} needs a token id >= 0 and a finite "
                                          f"bias (or -inf, false in JSON, to forbid the token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def rng(self) -> np.random.Generator:
        """The generator this config samples with; a negative seed is taken as its 64-bit two's complement."""
        return np.random.default_rng(None if self.seed in (None, -1) else self.seed % 2**64)


@dataclass(frozen=True)
class GenerationConfig:
    # None: until the context ends; 0: evaluate the prompt into the cache and generate nothing (llama.cpp's -1, 0).
    # More than the room the prompt leaves also means until the context ends, with finish reason "length".
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Keep the KV prefix this prompt shares with the previous one (llama.cpp's cache_prompt).
    reuse_prefix: bool = True
    # Also keep every later cached run of at least this many tokens at its new position (llama.cpp's n_cache_reuse;
    # 0: off). Close to a fresh evaluation, not identical: a moved entry was computed with other text before it.
    cache_reuse: int = 0
    # Evaluate the prompt in batches of at most this many tokens (None: the context's n_batch), so that a cancel
    # takes effect within one: background warm-ups use small ones.
    prompt_batch: int | None = None
    # llama.cpp's t_max_predict_ms, in seconds: once this much time has passed since the first token,
    # the next token holding a newline ends the generation ("length"), or at once, the line under way dropped, where
    # whole lines with WHOLE_LINES_MIN_CHARS came; no cycle starts that would end as long again later
    # (TIME_LIMIT_GRACE at most), since an editor waits on its answer, not on a line that runs on (llama.cpp waits
    # for the newline).
    time_limit: float | None = None
    # time.perf_counter() by which the answer is due (an editor's budgets from the request's arrival): a token after
    # which another cycle as long as the last would end past it ends the generation ("length"), whatever time_limit
    # allows. None: no such bound.
    deadline: float | None = None
    min_indent: int = 0  # llama.cpp's n_indent (text.IndentLimit)
    # Lines that end the answer where a line after its first repeats one (text.RepeatLimit): an infill's next lines
    # below the cursor (prompts.fim.next_lines). (): none.
    repeats: tuple[str, ...] = ()
    proposer: str | None = None  # this generation's proposer ("none" turns speculation off); None: the engine's
    k: int | None = None  # most tokens per cycle for this generation, at most the engine's; None: the engine's
    slot: int | None = None  # the KV slot to run in (llama.cpp's id_slot); None: the best free one
    # Constraints, checked on every row the target verifies (rules.py): a GBNF grammar, or a JSON schema
    # ({"type": "object"} for any JSON object), turned into one by llama.cpp's converter.
    grammar: str | None = None
    json_schema: dict | None = None
    grammar_trigger: str | None = None  # the grammar applies from this text on, the output before it is free
    # Token healing: text the prompt left out of its end (the typed word's end), so the model writes it in tokens of
    # its own choosing. The answer's first tokens must agree with it, and the answer goes out without it.
    heal: str = ""
    logprobs: int | None = None  # None: none; n >= 0: each token's log-probability and its row's n best
    # The memory namespace this generation is proposed from and added to, where the engine keeps a memory
    # (EngineConfig.memory); None: neither (the server's "memory": false).
    memory: str | None = MEMORY_LOCAL

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens {self.max_tokens} must be >= 0 (0 only evaluates the prompt), "
                                      f"or None for up to the context")
        if self.prompt_batch is not None and self.prompt_batch < 1:
            raise InvalidRequestError(f"prompt_batch {self.prompt_batch} must be >= 1, or None for the context's "
                                      f"batch size")
        if self.cache_reuse < 0:
            raise InvalidRequestError(f"cache_reuse {self.cache_reuse} must be >= 0 (the shortest chunk reused at a "
                                      f"new position; 0 reuses only the common prefix)")
        if self.time_limit is not None and self.time_limit <= 0:
            raise InvalidRequestError(f"time limit {self.time_limit} must be > 0 seconds, or None")
        if self.min_indent < 0:
            raise InvalidRequestError(f"min_indent {self.min_indent} must be >= 0 (0 disables it)")
        if self.proposer is not None and self.proposer not in PROPOSERS:
            raise InvalidRequestError(f"unknown proposer {self.proposer!r}; use one of {', '.join(PROPOSERS)}")
        if self.k is not None and not 0 <= self.k <= MAX_K:
            raise InvalidRequestError(f"k {self.k} must be in 0..{MAX_K} (0 turns speculation off)")
        if self.grammar is not None and self.json_schema is not None:
            raise InvalidRequestError("both a grammar and a json_schema were given; pass one of them")
        if self.heal and (self.grammar is not None or self.json_schema is not None):
            raise InvalidRequestError(f"heal {self.heal!r} with a grammar is not supported; pass heal='' and the "
                                      f"whole text in the prompt")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise InvalidRequestError(f"json_schema must be a JSON object (a schema), not {self.json_schema!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs {self.logprobs} must be in 0..{MAX_LOGPROBS} (alternatives per token)")
        if self.memory is not None and not (0 < len(self.memory) <= 64 and set(self.memory) <= MEMORY_NAMESPACE_CHARS):
            raise InvalidRequestError(f"memory namespace {self.memory!r} must be 1-64 letters, digits, '_' or '-'; "
                                      f"or None for no memory")


@dataclass(frozen=True)
class EngineConfig:
    """What an Engine loads: the one schema the Python API, the CLI and the server fill in."""

    model: str = DEFAULT_MODEL  # a catalog name or a GGUF path
    draft: str | None = None
    proposer: str = "auto"  # one of PROPOSERS
    k: int | None = None  # most tokens per cycle; None: the memory plan's Kmax for auto, DEFAULT_K otherwise
    load: LoadConfig = field(default_factory=LoadConfig)
    memory_budget: int | None = None  # bytes the models may use; None: detected
    source: str | None = None  # where catalog models come from (models.store.SOURCES); None: auto
    # The draft's layers on the GPU (llama.cpp's -ngld); None: the plan's. The target's: load.n_gpu_layers.
    draft_gpu_layers: int | None = None
    draft_device: str = "auto"  # an ONNX draft's execution provider (DRAFT_DEVICES)
    # Keep a memory of what this engine wrote (memory.py, beside the model cache) and let auto propose from it.
    # On for local use; `edgespec serve` turns it on only for a loopback bind unless --memory says so.
    memory: bool = True
    # llama.cpp RPC workers (host:port) that may hold the target's last layers; the proposer stays on this machine.
    rpc: tuple[str, ...] = ()
    rpc_layers: tuple[int, ...] | None = None  # layer units per worker; None: the plan's split
    # MiB of host memory for prompts the slots held before (llama.cpp's --cache-ram: -1 no limit, 0 none kept);
    # None: DEFAULT_CACHE_RAM_MIB, or an eighth of the machine's memory where that is less.
    cache_ram: int | None = None

    def __post_init__(self) -> None:
        if self.rpc_layers is not None and not self.rpc:
            raise InvalidRequestError("--rpc-layers places layers on RPC workers; give the workers with --rpc "
                                      "HOST:PORT,...")
        if self.proposer not in PROPOSERS:
            raise InvalidRequestError(f"unknown proposer {self.proposer!r}; use one of {', '.join(PROPOSERS)}")
        if self.proposer == "draft" and self.draft is None:
            raise InvalidRequestError("proposer 'draft' needs a draft model; pass --draft NAME|PATH")
        if self.k is not None and not 0 <= self.k <= MAX_K:
            raise InvalidRequestError(f"k {self.k} must be in 0..{MAX_K} (0 turns speculation off)")
        if self.draft_gpu_layers is not None and self.draft_gpu_layers < 0:
            raise InvalidRequestError(f"draft GPU layers {self.draft_gpu_layers} must be >= 0; leave "
                                      f"--draft-gpu-layers out to let the plan choose")
        if self.cache_ram is not None and self.cache_ram < -1:
            raise InvalidRequestError(f"cache RAM {self.cache_ram} MiB must be >= -1 (-1: no limit, 0: keep no "
                                      f"prompts); e.g. --cache-ram 2048")
        if self.draft_device not in DRAFT_DEVICES:
            raise InvalidRequestError(f"draft device {self.draft_device!r} must be one of {', '.join(DRAFT_DEVICES)}")

    @property
    def k_max(self) -> int:
        """The most tokens per cycle asked for: -k, else MAX_K for auto and DEFAULT_K for a fixed proposer."""
        return self.k if self.k is not None else MAX_K if self.proposer == "auto" else DEFAULT_K
