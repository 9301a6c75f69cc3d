"""Chunk reuse by KV shifting and the time-budgeted /infill, on a real server and real models: what an editor's next
request evaluates after the window slid, after an insertion, after a warm-up, and on a cold cache with a budget."""

from __future__ import annotations

import json
from dataclasses import replace
import os
import signal
import subprocess
import threading
import time

import httpx
import llama_cpp
import pytest

from edgespec import Engine, EngineConfig, GenerationConfig, LoadConfig
from edgespec.backend import Model
from edgespec.config import LoadConfig as Load
from edgespec.decoding import reuse
from edgespec.decoding.costs import PromptRate
from edgespec.engine.infill import NEAR_BUDGETS
from edgespec.prompts.fim import CUT_STEP, NEAR_LINES, Infill, accepted

SOURCE = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(80)]  # 80 two-line functions
LINES = "".join(SOURCE).splitlines(keepends=True)  # SOURCE line by line
HEAD = "<|fim_prefix|>"


@pytest.fixture
def server(coder_server):
    """The smallest FIM model; one slot, so every request finds the cache the one before it left."""
    return coder_server


def completion(server, prompt: str, **fields) -> dict:
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True, **fields}
    r = httpx.post(server.url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"content": text}, timeout=60).json()["tokens"]


def budget_buying(n: int, asked: dict, answer: dict, least: int) -> int:
    """A t_max_prompt_ms that buys about `n` new tokens at the price this CPU showed for `answer` (a budgeted /infill
    sent as `asked`), `least` at the least: a test's second budget, so a slow or busy machine still buys them."""
    return max(least, round(n * asked["t_max_prompt_ms"] / max(answer["infill"]["budget_tokens"], 1)))


def test_a_cold_request_with_a_budget_cuts_its_context_and_says_so(server):
    """First, while the cache is cold: 300 ms buys a few dozen tokens, so most of 160 lines are cut and reported."""
    body = {"input_prefix": "".join(SOURCE), "input_suffix": "\n".join(SOURCE[:20]), "prompt": "    ",
            "n_predict": 4, "temperature": 0, "t_max_prompt_ms": 300}
    out = httpx.post(server.url + "/infill", json=body, timeout=300).json()
    assert out["truncated"] is True
    kept, given = out["infill"]["prefix_tokens"]
    assert 0 <= kept < given
    # within the budget, or (a slow machine) over it with only the nearest lines: NEAR_LINES before the cursor and
    # the suffix's in proportion (here at most 2)
    near = tokens(server, "".join(body["input_prefix"].splitlines(keepends=True)[-NEAR_LINES:]) + body["prompt"] +
                  "".join(body["input_suffix"].splitlines(keepends=True)[:2]))
    assert out["timings"]["prompt_n"] <= max(out["infill"]["budget_tokens"] + 1, len(near) + 16), out  # + FIM tokens
    # asked again, it keeps what the cache now holds and spends its budget on more lines: the context widens (once
    # the cached lines make a run long enough to move, INFILL_CACHE_REUSE tokens: so with a second wider budget, one
    # that buys past MOVE_MIN_GAIN after a move)
    wider = {**body, "t_max_prompt_ms": budget_buying(160, body, out, least=1500)}
    first = httpx.post(server.url + "/infill", json=wider, timeout=300).json()
    again = httpx.post(server.url + "/infill", json=wider, timeout=300).json()
    if again["infill"]["budget_tokens"] >= 16:  # a line's worth at the least (not on a very slow machine)
        assert again["infill"]["prefix_tokens"][0] > first["infill"]["prefix_tokens"][0], (first, again)
    # without a budget the same request is cut as llama.cpp cuts it: 3/4 of the batch for the prefix
    out = httpx.post(server.url + "/infill", json={**body, "t_max_prompt_ms": -1}, timeout=300).json()
    assert out["infill"]["budget_tokens"] is None and out["infill"]["prefix_tokens"][0] == 3 * 512 // 4


def test_a_long_line_at_the_cursor_is_cut_to_what_is_next_to_it_and_said_so(server):
    """The cursor half-way through a long line (data, minified code): the typed text and the line's rest alone would
    take many budgets, so only the typed text's end and the rest's start are evaluated, each cut a whole number of
    steps (CUT_STEP characters) from its start, which stays while the user types; `typed_tokens` and
    `suffix_tokens` say how much."""
    numbers = [str(i * 7919 % 10007) for i in range(800)]
    typed = "TABLE = [" + ", ".join(numbers[:400]) + ","  # the comma is healed: the answer spells it
    suffix = " " + ", ".join(numbers[400:]) + "]\n" + "".join(SOURCE[:4])
    body = {"input_prefix": "".join(SOURCE[:10]), "input_suffix": suffix, "prompt": typed, "n_predict": 4,
            "temperature": 0, "t_max_prompt_ms": 300}
    out = httpx.post(server.url + "/infill", json=body, timeout=300).json()
    (kept, given), (kept_suffix, given_suffix) = out["infill"]["typed_tokens"], out["infill"]["suffix_tokens"]
    assert out["infill"]["healed"] == ",", out
    held = typed[:-1]
    assert given == len(tokens(server, held)) and 0 < kept < given // 4 and out["truncated"] is True, out
    assert given_suffix == len(tokens(server, suffix)) and kept_suffix < given_suffix // 4, out
    assert any(len(tokens(server, held[j:])) == kept for j in range(CUT_STEP, len(held), CUT_STEP)), out
    assert out["timings"]["prompt_n"] < given // 4, out


def test_a_sliding_window_evaluates_only_the_new_tokens(server):
    first = HEAD + "".join(SOURCE[0:60])
    completion(server, first, n_cache_reuse=32)
    slid = HEAD + "".join(SOURCE[1:61])  # the first function dropped, one added at the end
    out = completion(server, slid, n_cache_reuse=32)
    added = len(tokens(server, SOURCE[60]))
    assert out["timings"]["prompt_n"] <= added + 2
    assert out["timings"]["shifted_n"] >= len(tokens(server, "".join(SOURCE[1:60]))) - 2


def test_an_insertion_in_the_middle_reuses_the_chunk_after_it(server):
    before = HEAD + "".join(SOURCE[0:30]) + "".join(SOURCE[30:60])
    completion(server, before, n_cache_reuse=32)
    inserted = "# a comment typed in the middle\n"
    after = HEAD + "".join(SOURCE[0:30]) + inserted + "".join(SOURCE[30:60])
    out = completion(server, after, n_cache_reuse=32)
    assert out["timings"]["prompt_n"] <= len(tokens(server, inserted)) + 3
    assert out["timings"]["shifted_n"] >= len(tokens(server, "".join(SOURCE[30:60]))) - 3


def test_n_cache_reuse_on_a_request_is_honoured(server):
    """The same slide with n_cache_reuse 0 keeps only the common prefix: everything after the dropped line again."""
    completion(server, HEAD + "".join(SOURCE[0:40]), n_cache_reuse=0)
    out = completion(server, HEAD + "".join(SOURCE[1:41]), n_cache_reuse=0)
    assert out["timings"]["shifted_n"] == 0
    assert out["timings"]["prompt_n"] >= len(tokens(server, "".join(SOURCE[1:41]))) - 2
    assert out["generation_settings"]["n_cache_reuse"] == 0


def test_a_ring_warm_up_pays_off_also_after_the_ring_drops_its_oldest_chunk(server):
    """llama.vim's ring warm-up (n_predict 0) leaves the extra chunks cached; when the ring drops its oldest chunk,
    the next completion shifts the rest instead of evaluating it again."""
    ring = [{"filename": f"m{i}.py", "text": "".join(SOURCE[10 * i:10 * i + 10])} for i in range(5)]
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": ring, "prompt": "", "n_predict": 0,
            "samplers": [], "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}
    assert httpx.post(server.url + "/infill", json=warm, timeout=300).json() == {}
    fim = {"input_prefix": "def g(y):\n", "input_suffix": "\n", "prompt": "    ", "n_predict": 4,
           "temperature": 0, "t_max_prompt_ms": 500, "t_max_predict_ms": 250}
    out = httpx.post(server.url + "/infill", json={**fim, "input_extra": ring}, timeout=300).json()
    extra_tokens = sum(len(tokens(server, c["text"])) for c in ring)
    assert out["tokens_cached"] >= extra_tokens and out["infill"]["extra_chunks"] == [5, 5]
    ring = ring[1:] + [{"filename": "m5.py", "text": "".join(SOURCE[50:60])}]
    warm = {k: v for k, v in warm.items() if k != "response_fields"}  # this time, read what it evaluated
    out = httpx.post(server.url + "/infill", json={**warm, "input_extra": ring}, timeout=300).json()
    assert out["timings"]["shifted_n"] >= sum(len(tokens(server, c["text"])) for c in ring[:-1]) - 8
    assert out["timings"]["prompt_n"] <= len(tokens(server, ring[-1]["text"])) + 24
    out = httpx.post(server.url + "/infill", json={**fim, "input_extra": ring}, timeout=300).json()
    assert out["tokens_cached"] >= sum(len(tokens(server, c["text"])) for c in ring)
    assert out["infill"]["extra_chunks"] == [5, 5]


def test_a_ring_warm_up_keeps_the_last_completions_lines_cached(server):
    """llama.vim's ring warm-up sends no prefix or suffix; evaluating it must not evict the lines of the completion
    before it, which the next completion (the same lines, the new chunk before them) wants again."""
    fim = {"input_prefix": "".join(SOURCE[:30]), "input_suffix": "\n" + "".join(SOURCE[30:40]), "prompt": "    ",
           "n_predict": 4, "temperature": 0, "t_max_prompt_ms": -1}
    httpx.post(server.url + "/infill", json=fim, timeout=300).raise_for_status()
    ring = [{"filename": "ring.py", "text": "".join(SOURCE[60:64])}]
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": ring, "prompt": "", "n_predict": 0,
            "samplers": []}
    httpx.post(server.url + "/infill", json=warm, timeout=300).raise_for_status()
    out = httpx.post(server.url + "/infill", json={**fim, "input_extra": ring}, timeout=300).json()
    assert out["infill"]["extra_chunks"] == [1, 1] and out["timings"]["prompt_n"] <= 4, out["timings"]


def test_a_ring_warm_up_keeps_the_lines_a_stopped_widening_left(server):
    """A widening that a ring warm-up preempts leaves its prefix lines and no <fim_middle> (the rest of its prompt
    was still to be evaluated); the warm-up must keep those lines for the next completion, not evict them."""
    lines = "".join(SOURCE[:30])
    completion(server, HEAD + lines, n_predict=0)  # the cache as such a widening leaves it
    ring = [{"filename": "ring.py", "text": "".join(SOURCE[60:64])}]
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": ring, "prompt": "", "n_predict": 0,
            "samplers": []}
    httpx.post(server.url + "/infill", json=warm, timeout=300).raise_for_status()
    fim = {"input_prefix": lines, "input_suffix": "\n" + "".join(SOURCE[30:32]), "prompt": "    ", "n_predict": 1,
           "temperature": 0, "input_extra": ring, "t_max_prompt_ms": -1}
    out = httpx.post(server.url + "/infill", json=fim, timeout=300).json()
    assert out["infill"]["extra_chunks"] == [1, 1], out["infill"]
    kept_lines, kept_suffix = out["infill"]["prefix_tokens"][0], out["infill"]["suffix_tokens"][0]
    # the kept lines come from the cache (shifted after the chunk); new: the suffix, the typed text, a line or two
    assert kept_lines > 100 and out["timings"]["prompt_n"] <= kept_suffix + 32, (out["infill"], out["timings"])


def test_llama_vim_speculative_request_costs_a_handful_of_prompt_tokens(server):
    """As soon as it shows a suggestion, llama.vim asks again as if it were accepted; the answer's own prompt and
    tokens serve that request, the suggestion starting the middle, so it finds them cached. A request that differs
    from it (typed on) is laid out afresh."""
    fim = {"input_prefix": "".join(SOURCE[:20]) + "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
           "prompt": "    return a", "n_predict": 16, "temperature": 0, "t_max_prompt_ms": 60000,
           "t_max_predict_ms": 250, "samplers": ["top_k", "top_p", "infill"]}
    # cut before the model's own end, which a continuation would only choose again (prompts.fim.continuation)
    first = httpx.post(server.url + "/infill", json={**fim, "n_predict": 2}, timeout=300).json()
    shown = accepted(Infill(fim["input_prefix"], fim["input_suffix"], fim["prompt"]), first["content"])
    kept, given = first["infill"]["prefix_tokens"]
    assert shown is not None and kept == given, first  # a budget that cuts no line before the cursor on any machine
    assert not first["infill"]["continued"]
    spec = httpx.post(server.url + "/infill", json={**fim, "input_prefix": shown.prefix, "prompt": shown.typed,
                                                    "t_max_predict_ms": 1000}, timeout=300).json()
    # the last token again, for its logits; nothing moved, which would re-rotate the whole context
    assert spec["infill"]["continued"] and spec["infill"]["prefix_tokens"] == first["infill"]["prefix_tokens"]
    assert spec["timings"]["prompt_n"] <= 2 and spec["timings"]["shifted_n"] == 0, (first, spec)
    other = httpx.post(server.url + "/infill", json={**fim, "input_prefix": shown.prefix, "prompt": shown.typed + "x",
                                                     "t_max_predict_ms": 1000}, timeout=300).json()
    # laid out afresh; in the middle layout (the default) that costs the tokens typed on, the rest is cached
    assert not other["infill"]["continued"] and other["infill"]["layout"] == "middle", other


def test_llama_cpps_layout_is_kept_on_request_and_moves_the_suffix_on_every_keystroke(qwen_draft_path):
    """--fim-layout prefix: the typed text ends the prefix, as llama.cpp lays it out; the editor's speculative request
    is served by the answer's prompt and tokens there too, and typing on moves the suffix, evaluated again."""
    from test_server import Server

    s = Server(qwen_draft_path, "--ctx", "2048", "--slots", "1", "--fim-layout", "prefix")
    try:
        fim = {"input_prefix": "".join(SOURCE[:20]) + "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n",
               "prompt": "    return a", "n_predict": 2, "temperature": 0, "t_max_prompt_ms": 60000,
               "t_max_predict_ms": 250}
        first = httpx.post(s.url + "/infill", json=fim, timeout=300).json()
        assert first["infill"]["layout"] == "prefix", first
        shown = accepted(Infill(fim["input_prefix"], fim["input_suffix"], fim["prompt"]), first["content"])
        spec = httpx.post(s.url + "/infill", json={**fim, "input_prefix": shown.prefix, "prompt": shown.typed},
                          timeout=300).json()
        assert spec["infill"]["continued"] and spec["timings"]["prompt_n"] <= 2, (first, spec)
        other = httpx.post(s.url + "/infill", json={**fim, "input_prefix": shown.prefix, "prompt": shown.typed + "x"},
                           timeout=300).json()
        suffix = len(httpx.post(s.url + "/tokenize", json={"content": fim["input_suffix"]}).json()["tokens"])
        assert not other["infill"]["continued"] and other["timings"]["prompt_n"] > suffix, other
    finally:
        s.stop()


def test_in_the_middle_layout_the_request_after_a_finished_line_is_served_at_the_next_line(qwen_path):
    """--fim-layout middle: the typed text after <fim_middle>, so with the line done the model would only end again.
    The answer it ended serves llama.vim's speculative request at the next line's start: its prompt and tokens and a
    line break, evaluated at a token or two; the answer (if any) starts with the line break the editor needs."""
    from test_server import Server

    s = Server(qwen_path, "--ctx", "2048", "--slots", "1", "--fim-layout", "middle")
    try:
        fim = {"input_prefix": "".join(SOURCE[:20]) + "def f20(x):\n",
               "input_suffix": "\n\n\nif __name__ == '__main__':\n    print(f20(1))\n",
               "prompt": "    return x * 20", "n_predict": 32, "temperature": 0, "t_max_prompt_ms": 60000,
               "t_max_predict_ms": 10000}  # llama.vim sends 1000: a 2-core CPU shared with other tests cut the line
        first = httpx.post(s.url + "/infill", json=fim, timeout=300).json()
        assert first["stop_type"] == "eos" and first["infill"]["layout"] == "middle", first
        shown = accepted(Infill(fim["input_prefix"], fim["input_suffix"], fim["prompt"]), first["content"])
        spec = httpx.post(s.url + "/infill", json={**fim, "input_prefix": shown.prefix, "prompt": shown.typed},
                          timeout=300).json()
        assert spec["infill"]["continued"] and spec["timings"]["prompt_n"] <= 2, (first, spec)
        assert spec["content"] == "" or spec["content"].startswith("\n"), spec
        # where the model writes a next line (its ends of text banned), the answer starts with the line break: whole,
        # and streamed in the first event with text
        ends = httpx.post(s.url + "/tokenize", json={"content": "<|endoftext|><|fim_pad|><|repo_name|><|file_sep|>"
                                                                "<|im_end|>", "parse_special": True}).json()["tokens"]
        nxt = {**fim, "input_prefix": shown.prefix, "prompt": shown.typed, "logit_bias": [[t, False] for t in ends]}
        for stream in (False, True):
            assert httpx.post(s.url + "/infill", json=fim, timeout=300).json()["content"] == first["content"]
            with httpx.stream("POST", s.url + "/infill", json={**nxt, "stream": stream}, timeout=300) as r:
                lines = list(r.iter_lines())
            events = [json.loads(line.removeprefix("data: ")) for line in lines if line.strip()]
            text = "".join(e["content"] for e in events)
            assert events[-1]["infill"]["continued"] and text.startswith("\n") and text.strip(), events
            assert stream or len(events) == 1
    finally:
        s.stop()


def test_an_answer_cut_past_its_line_break_serves_the_next_request_at_the_next_line(server):
    """The time limit cuts an answer at a line break, which the editor drops, and Qwen spells a line's end and its
    break as one token (`:\n`, `()\n`): the editor's next request, the answer taken as typed, ends inside that token.
    It is served from the answer's own tokens all the same, at the next line's start, its answer led by the break
    (cut here by n_predict at the first token holding a break: the same cut, not ended by the model)."""
    fim = {"input_prefix": "".join(SOURCE[:20]) + "def mean(values):\n",
           "input_suffix": "\n\n\nif __name__ == '__main__':\n    print(mean([1, 2]))\n", "prompt": "    total",
           "n_predict": 24, "temperature": 0, "t_max_prompt_ms": 60000, "return_tokens": True}
    pieces = lambda ids: [httpx.post(server.url + "/detokenize", json={"tokens": [t]}).json()["content"]  # noqa: E731
                          for t in ids]
    cut = httpx.post(server.url + "/infill", json=fim, timeout=300).json()
    for _ in range(4):  # a prompt served again from its kept row may break a near tie the other way: cut that one
        k = next(i for i, p in enumerate(pieces(cut["tokens"])) if "\n" in p) + 1
        cut = httpx.post(server.url + "/infill", json={**fim, "n_predict": k}, timeout=300).json()
        spelt = pieces(cut["tokens"])
        if len(spelt) == k and "\n" in spelt[-1] and not any("\n" in p for p in spelt[:-1]):
            break
    assert len(spelt) == k and cut["content"].endswith("\n") and cut["stop_type"] == "limit", (spelt, cut)
    assert not spelt[-1].split("\n", 1)[1].strip("\n"), spelt  # the break ends its token: the next line's apart
    shown = accepted(Infill(fim["input_prefix"], fim["input_suffix"], fim["prompt"]), cut["content"])
    spec = httpx.post(server.url + "/infill", json={**fim, "input_prefix": shown.prefix, "prompt": shown.typed},
                      timeout=300).json()
    assert spec["infill"]["continued"] and spec["timings"]["prompt_n"] <= 2, (cut, spec)
    assert spec["content"] == "" or spec["content"].startswith("\n"), spec


def test_a_request_preempts_a_warm_up_in_flight(server):
    """A long warm-up is background work: the next completion does not wait for all of it."""
    big = [{"filename": "big.py", "text": "".join(SOURCE) * 2}]
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": big, "prompt": "", "n_predict": 0,
            "samplers": [], "t_max_prompt_ms": 1}
    answers: list[dict] = []
    t = threading.Thread(target=lambda: answers.append(httpx.post(server.url + "/infill", json=warm,
                                                                  timeout=300).json()))
    t.start()
    time.sleep(1.5)  # the warm-up is under way
    out = completion(server, "x = 1\n")
    t.join(300)
    assert out["timings"]["prompt_n"] >= 1
    assert answers and answers[0]["cancelled"] is True  # preempted; what it evaluated stayed in the cache


def test_positions_stay_contiguous_after_every_shift(smollm_path):
    """After drops, insertions and moves the sequence holds exactly its tokens at 0..n-1 (as many cells as a fresh
    evaluation of them takes), and decoding goes on from there."""
    with Model(smollm_path, Load(n_ctx=1024, n_seq=2)) as m:
        s, fresh = m.sequences
        lines = [m.tokenize(f"line {i}: value = {i * i}\n", add_special=False) for i in range(40)]
        windows = [lines[0:30], lines[1:31], lines[1:15] + [lines[35]] + lines[15:31], lines[3:20] + lines[25:38]]
        for window in windows:
            prompt = [t for line in window for t in line]
            kept = reuse.plan(s.tokens, prompt, 8)
            s.evaluate(prompt, [(r.start, r.source, r.length) for r in kept.runs])
            assert s.tokens == prompt
            assert llama_cpp.llama_memory_seq_pos_min(m._mem, 0) == 0 and s.pos_max() == len(prompt) - 1
            fresh.trim(0)
            fresh.evaluate(prompt)
            assert llama_cpp.llama_state_seq_get_size(m._ctx, 0) == llama_cpp.llama_state_seq_get_size(m._ctx, 1)
        s.decode([lines[39][0]])
        assert s.pos_max() == len(s.tokens) - 1


def test_a_model_that_cannot_shift_reuses_its_prefix_only_and_says_so(gemma_path):
    """Gemma-3 keeps a sliding-window cache, which llama.cpp cannot shift: chunk reuse falls back to the prefix."""
    with Engine(EngineConfig(str(gemma_path), proposer="none", load=LoadConfig(n_ctx=2048),
                             memory=False)) as eng:
        assert not eng.target.can_shift
        assert any("cannot shift its KV cache" in n for n in eng.notes)
        body = "".join(SOURCE[:20])
        eng.generate(body, GenerationConfig(max_tokens=1, cache_reuse=32, memory=None))
        out = eng.generate("".join(SOURCE[1:21]), GenerationConfig(max_tokens=1, cache_reuse=32, memory=None))
        assert out.stats.shifted_prompt_tokens == 0 and out.stats.cached_prompt_tokens <= 4


def test_a_request_cancels_background_work_registered_while_it_waited_to_preempt():
    # The stall after a ring update: a completion and a warm-up both waited on the same background batch; the
    # warm-up, resuming first, registered its own evaluation; the completion must cancel that one too instead of
    # queueing behind all of it (pure asyncio logic; the real jobs are engine threads).
    import asyncio
    import types

    from edgespec.server.service import Pauses, Service

    async def scenario() -> bool:
        svc = types.SimpleNamespace(background={}, loaded=None, pauses=Pauses(lambda _: None))

        def background(cancel: threading.Event, then=None) -> None:
            async def job() -> None:
                while not cancel.is_set():
                    await asyncio.sleep(0.005)
                if then is not None:
                    then()
            svc.background[cancel] = task = asyncio.ensure_future(job())
            task.add_done_callback(lambda _: svc.background.pop(cancel, None))

        widening, warm_up = threading.Event(), threading.Event()
        background(widening, then=lambda: background(warm_up))
        await asyncio.wait_for(Service.preempt(svc), 10)
        return warm_up.is_set() and not svc.background

    assert asyncio.run(scenario())


def _run_fake():
    """Service.run's and stream_chunks' state as a namespace (its methods bound to it), an engine worker that
    answers every job at once with ["chunk"] (the jobs it got: `submitted`), and a request that stays connected:
    pure asyncio logic, the real jobs being engine threads."""
    import asyncio
    import functools
    import types

    from edgespec.server.service import Pauses, Service

    svc = types.SimpleNamespace(active=set(), background={}, aside_build=None, loaded=None,
                                pauses=Pauses(lambda _: None), submitted=[], engine=lambda: None, count=lambda c: None)
    svc._background = functools.partial(Service._background, svc)
    svc.preempt = functools.partial(Service.preempt, svc)

    def submit(job) -> asyncio.Future:
        svc.submitted.append(job)
        done = asyncio.get_running_loop().create_future()
        done.set_result(["chunk"])
        return done

    svc.submit = submit
    return svc, types.SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, False))


def test_a_warm_up_that_comes_during_a_completion_starts_after_it():
    # A warm-up whose handler registered its evaluation after the completion had preempted background work shared
    # the engine with it and held the answer back for all its chunks (docs/editors.md): it waits for the requests in
    # flight instead.
    import asyncio
    import types

    from edgespec.server.service import Service

    async def scenario() -> bool:
        svc, request = _run_fake()
        warm_up = types.SimpleNamespace(config=GenerationConfig(max_tokens=0), stop=())
        completion = threading.Event()
        svc.active.add(completion)
        task = asyncio.ensure_future(Service.run(svc, request, [1, 2], warm_up, threading.Event()))
        await asyncio.sleep(0.3)
        waited = not svc.submitted and not task.done()
        svc.active.discard(completion)  # the completion is answered
        return waited and await asyncio.wait_for(task, 5) == ["chunk"] and len(svc.submitted) == 1

    assert asyncio.run(scenario())


def test_a_completion_run_counts_no_pause_of_its_own():
    # The route that sent it ended the pause since the last answer; n_cmpl's alternatives run one after another, and
    # had each counted the no time since the one before as a pause, they would crowd the editor's real pauses out of
    # those that size background batches.
    import asyncio
    import types

    from edgespec.server.service import Service

    async def scenario() -> list[float]:
        svc, request = _run_fake()
        svc.pauses.answered()  # an answer ended
        completion = types.SimpleNamespace(config=GenerationConfig(max_tokens=4), stop=())
        for _ in range(2):  # two of n_cmpl's completions
            await Service.run(svc, request, [1, 2], completion, threading.Event())
        return list(svc.pauses.seen)

    assert asyncio.run(scenario()) == []


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="no SIGSTOP on Windows")
def test_a_pause_read_the_moment_the_process_resumes_does_not_count_the_stop():
    # A lockstep benchmark's freeze, Ctrl-Z then fg: an aside build's worker runs on the moment the server resumes,
    # before the pause's ticker does, and sizes its next batch by what it reads; the stopped seconds ran nothing.
    from edgespec.server.service import Pauses

    pauses = Pauses(lambda _: None)
    pauses.answered()
    waker = subprocess.Popen(["sh", "-c", f"sleep 3; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
    elapsed = pauses.elapsed
    waker.wait(10)
    assert elapsed < 1.0, elapsed


def test_an_aside_builds_batches_are_timed_in_the_time_the_server_ran():
    """Each batch of an aside build is timed for the background rate (decoding.costs.PromptRate.background), from its
    sizing to the next one's; a stop meanwhile (a lockstep benchmark's freeze, Ctrl-Z) ran nothing and counts at
    most a tick, so it does not price the next batches dear."""
    import types

    from edgespec.decoding.costs import PromptRate
    from edgespec.server.service import Pauses, Service

    rate = PromptRate((1, 16, 64), (0.1, 0.19, 0.6))
    svc = types.SimpleNamespace(loaded=types.SimpleNamespace(prompt_rate=rate), pauses=Pauses(lambda _: None))
    svc.pauses.answered()
    batch = Service.background_batches(svc)
    n = batch(1024)
    time.sleep(rate.seconds(n) / 2)  # the batch ran in half its price
    n = batch(1024 - n)
    assert rate.background < 1.0 and rate.scale == 1.0
    before = rate.background
    waker = subprocess.Popen(["sh", "-c", f"sleep 3; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)  # this batch held up by a 3 s stop
    waker.wait(10)
    batch(1024 - 2 * n)
    assert rate.background < before, (rate.background, before)


def test_a_batch_a_request_stopped_is_timed_up_to_the_stop():
    """The batch in flight when a request stops an aside build (Service.build_in_pause) is timed from its sizing to
    the stop, as a lower bound: past its price, the background scale rises. Not where the process was stopped
    meanwhile: the stop's tick is time the batch did not run."""
    import types

    from edgespec.decoding.costs import PromptRate
    from edgespec.server.service import Pauses, Service

    rate = PromptRate((1, 16, 64), (0.1, 0.19, 0.6))
    svc = types.SimpleNamespace(loaded=types.SimpleNamespace(prompt_rate=rate), pauses=Pauses(lambda _: None))
    svc.pauses.answered()
    batches = Service.background_batches(svc)
    n = batches(1024)
    batches.aborted()  # stopped at once: within any price
    assert rate.background == 1.0
    n = batches(1024)
    time.sleep(1.5 * rate.background_seconds(n))
    batches.aborted()
    assert rate.background > 1.0, rate.background
    raised = rate.background
    batches.aborted()  # no batch in flight: nothing more to time
    assert rate.background == raised
    n = batches(1024)
    waker = subprocess.Popen(["sh", "-c", f"sleep 1; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)  # a stop (a lockstep benchmark's freeze) during the batch
    waker.wait(10)
    time.sleep(rate.background_seconds(n))  # then as long as its price: with the stop's tick, past it
    batches.aborted()
    assert rate.background == raised


def test_a_streamed_completion_stops_a_warm_up_that_came_before_its_job():
    # As Service.run: a warm-up that registered its evaluation after the route's preempt would take the engine first
    # and hold the stream back for all its chunks; the stream preempts again as its job starts.
    import asyncio
    import types

    from edgespec.server.service import Service

    async def scenario() -> list[bool]:
        svc, _ = _run_fake()
        warm_up = threading.Event()

        async def evaluation() -> None:  # gives the engine back once cancelled, as a batch aborted would
            while not warm_up.is_set():
                await asyncio.sleep(0.01)

        job = asyncio.ensure_future(evaluation())
        svc._background(warm_up, job)
        submit = svc.submit
        svc.submit = lambda work: (svc.submitted.append(job.done()), submit(work))[1]
        req = types.SimpleNamespace(config=GenerationConfig(max_tokens=4), stop=())
        await asyncio.wait_for(Service.stream_chunks(svc, [1, 2], req, threading.Event()), 5)
        return svc.submitted[:1]

    assert asyncio.run(scenario()) == [True]


def test_a_warm_ups_prompt_is_read_after_the_aside_build_it_runs_first():
    # An editor's warm-up runs the aside build the last answer asked for before its own evaluation, and a build that
    # puts lines in front of the slot's changes what the slot holds. Laid out before it, the warm-up evaluated a
    # stale prompt, which dropped those lines (or a slot's parts): the route gives the layout as a function
    # (LlamaRoutes._again), which Service.run reads once the build is done.
    import asyncio
    import types

    from edgespec.server.service import Service

    async def scenario() -> list[list[int]]:
        svc, request = _run_fake()
        held, streamed = [1, 2], []
        svc.aside_build = lambda cancel: (held.__setitem__(slice(0, 0), [7, 8]), True)[1]  # lines in front
        svc.build_aside = lambda build, cancel: build is None or build(cancel)
        svc.engine = lambda: types.SimpleNamespace(stream=lambda prompt, *_: (streamed.append(prompt), ["c"])[1])

        def submit(job) -> asyncio.Future:  # the engine thread, at once
            done = asyncio.get_running_loop().create_future()
            done.set_result(job())
            return done

        svc.submit = submit
        warm_up = types.SimpleNamespace(config=GenerationConfig(max_tokens=0), stop=())
        await asyncio.wait_for(Service.run(svc, request, lambda: list(held), warm_up, threading.Event(), True), 5)
        return streamed

    assert asyncio.run(scenario()) == [[7, 8, 1, 2]]


def test_a_warm_request_takes_what_its_slot_serves_in_place_unless_a_move_buys_enough(qwen_draft_path):
    """Moving the slot's cached prompt re-rotates the whole cache: a request whose budget would buy fewer than
    MOVE_MIN_GAIN new tokens after that keeps the cached prompt as it is; one that buys more widens its context."""
    infill = Infill("".join(SOURCE), "\n" + "".join(SOURCE[:4]), "    ")
    prices = ((1, 64), (0.05, 0.4))  # a slow CPU's, the same on every machine: 0.5 s buys 74 new tokens

    def rate(shift: float) -> PromptRate:
        r = PromptRate(*prices)
        r.shift = shift
        return r

    with Engine(EngineConfig(str(qwen_draft_path), proposer="none", load=LoadConfig(n_ctx=4096))) as eng:
        eng.prompt_rate = rate(0.0)
        first = eng.infill_prompt(infill, 16, 0.5, cache_reuse=16)
        assert first.kept.cut
        eng.generate(first.tokens, GenerationConfig(max_tokens=1, cache_reuse=16, memory=None, slot=first.slot))
        eng.prompt_rate = rate(0.3)  # after a move 0.2 s would be left: 28 new tokens
        again = eng.infill_prompt(infill, 16, 0.5, cache_reuse=16)
        assert again.tokens == first.tokens and again.new_tokens <= 1
        eng.prompt_rate = rate(0.0)  # a free move: the budget's tokens go to more lines before the cursor
        wider = eng.infill_prompt(infill, 16, 0.5, cache_reuse=16)
        assert wider.kept.prefix_tokens[0] > first.kept.prefix_tokens[0], (first.kept, wider.kept)


def test_a_warm_request_lines_further_down_keeps_the_slots_start_in_place(qwen_draft_path):
    """The cursor two lines further down, where a move would buy fewer than MOVE_MIN_GAIN tokens: the prompt starts
    where the slot's cached lines do (any other start moves them), found though no step of fit's scan lands there,
    and evaluates only what follows them instead of widening with a re-rotation of the whole cache."""
    prices = ((1, 64), (0.05, 0.4))  # as above: 0.5 s buys 74 new tokens, 28 after a move
    here = Infill("".join(LINES[:101]), "\n" + "".join(LINES[102:106]), "    ")
    down = Infill("".join(LINES[:103]), "\n" + "".join(LINES[104:108]), "    ")
    with Engine(EngineConfig(str(qwen_draft_path), proposer="none", load=LoadConfig(n_ctx=4096))) as eng:
        eng.prompt_rate = PromptRate(*prices)
        first = eng.infill_prompt(here, 16, 0.5, cache_reuse=16)
        assert first.kept.cut
        eng.generate(first.tokens, GenerationConfig(max_tokens=1, cache_reuse=16, memory=None, slot=first.slot))
        eng.prompt_rate = PromptRate(*prices)  # not what the generation observed on this machine
        eng.prompt_rate.shift = 0.3
        again = eng.infill_prompt(down, 16, 0.5, cache_reuse=16)
        held = first.tokens.index(eng.target.vocab.fim_pre) + 1 + first.kept.prefix_tokens[0]
        assert again.tokens[:held] == first.tokens[:held], (first.kept, again.kept)
        assert again.kept.prefix_tokens[0] > first.kept.prefix_tokens[0]
        assert again.new_tokens <= again.budget_tokens


def test_a_line_start_past_its_budget_keeps_the_slots_lines_in_place_where_a_move_would_leave_none(qwen_draft_path):
    """The cursor at the next line's start on a slow CPU: the line just written and the suffix's nearest lines cost
    more than the budget, and a move's re-rotation would take all of twice the budget (NEAR_BUDGETS). The slot's
    lines stay in place and the new ones go after them, the suffix's lines first cut, within twice the budget (the
    prompt once fell to the repository header alone here, and the model wrote a file name)."""
    prices = ((1, 64), (0.05, 0.4))  # as above: 0.1 s buys 10 new tokens, 0.2 s 28 where nothing moves
    here = Infill("".join(LINES[:101]), "\n" + "".join(LINES[102:106]), "    ")
    down = Infill("".join(LINES[:102]), "".join(LINES[102:106]))  # the line written, the cursor at the next start
    with Engine(EngineConfig(str(qwen_draft_path), proposer="none", load=LoadConfig(n_ctx=4096))) as eng:
        eng.prompt_rate = PromptRate(*prices)
        first = eng.infill_prompt(here, 16, 0.5, cache_reuse=16, layout="middle")
        eng.generate(first.tokens, GenerationConfig(max_tokens=1, cache_reuse=16, memory=None, slot=first.slot))
        eng.prompt_rate = PromptRate(*prices)
        eng.prompt_rate.shift = 0.5  # a move leaves nothing of the floor's 0.2 s
        again = eng.infill_prompt(down, 16, 0.1, cache_reuse=16, layout="middle")
        held = first.tokens.index(eng.target.vocab.fim_pre) + 1 + first.kept.prefix_tokens[0]
        assert again.tokens[:held] == first.tokens[:held], (first.kept, again.kept)
        assert again.kept.prefix_tokens[0] > first.kept.prefix_tokens[0], (first.kept, again.kept)
        assert again.new_tokens <= eng.prompt_rate.tokens_within(NEAR_BUDGETS * 0.1), (first.kept, again.kept)


def test_a_line_written_above_a_suffix_that_stayed_costs_only_its_own_tokens(qwen_draft_path):
    """New code written above text that stays: at the next line's start the line written goes after <fim_middle>
    (prompts.fim.written_since) and is all that is evaluated, where in the prefix it would move the suffix after
    it, to be evaluated again; the prompt holds as much as that one would, and counts the line as the prefix's."""
    prices = ((1, 64), (0.05, 0.4))  # as above: 0.5 s buys 74 new tokens where nothing moves
    below = "\n" + "".join(LINES[140:150])  # the file's text after the lines being written
    here = Infill("".join(LINES[:101]), below, "    ")
    down = Infill("".join(LINES[:102]), below)  # the line written, the cursor at the next line's start
    with Engine(EngineConfig(str(qwen_draft_path), proposer="none", load=LoadConfig(n_ctx=4096))) as eng:
        eng.prompt_rate = PromptRate(*prices)
        first = eng.infill_prompt(here, 16, 0.5, cache_reuse=16, layout="middle")
        eng.generate(first.tokens, GenerationConfig(max_tokens=1, cache_reuse=16, memory=None, slot=first.slot))
        eng.prompt_rate = PromptRate(*prices)
        eng.prompt_rate.shift = 0.3  # a move would buy fewer than MOVE_MIN_GAIN tokens: both prompts stay in place
        again = eng.infill_prompt(down, 16, 0.5, cache_reuse=16, layout="middle")
        moved_up = eng.infill_prompt(replace(down, suffix="\n" + "".join(LINES[141:151])), 16, 0.5, cache_reuse=16,
                                     layout="middle")  # the line below became the cursor line: laid out afresh
        mid = first.tokens.index(eng.target.vocab.fim_mid) + 1
        assert again.tokens[:mid] == first.tokens[:mid], (first.kept, again.kept)
        line = len(eng.target.tokenize(LINES[101], add_special=False, parse_special=False))
        assert again.new_tokens <= line + 1 < moved_up.new_tokens, (again.new_tokens, line, moved_up.new_tokens)
        assert again.kept.prefix_tokens[0] >= first.kept.prefix_tokens[0] + line - 1, (first.kept, again.kept)


def test_the_nearest_lines_a_cold_request_left_out_are_priced_with_the_move_they_need(qwen_draft_path):
    """A cold request whose budget bought only some of the nearest lines (NEAR_LINES), then the same line typed on:
    the rest of them go before what the slot holds, which moves it, a re-rotation of the whole cache. The floor they
    raise the budget to (NEAR_BUDGETS) counts the re-rotation in, so the answer keeps its time."""
    prices = ((1, 64), (0.05, 0.4))  # as above: 0.4 s buys 64 new tokens, 1 s 156 where nothing moves
    here = Infill("".join(LINES[:101]), "\n" + "".join(LINES[102:106]), "    ")
    typed_on = Infill(here.prefix, here.suffix, "    return x")
    with Engine(EngineConfig(str(qwen_draft_path), proposer="none", load=LoadConfig(n_ctx=4096))) as eng:
        eng.prompt_rate = PromptRate(*prices)
        first = eng.infill_prompt(here, 16, 0.2, cache_reuse=16)
        near = len(eng.target.tokenize("".join(LINES[101 - NEAR_LINES:101]), add_special=False))
        assert 0 < first.kept.prefix_tokens[0] < near, first.kept
        eng.generate(first.tokens, GenerationConfig(max_tokens=1, cache_reuse=16, memory=None, slot=first.slot))
        eng.prompt_rate = PromptRate(*prices)
        eng.prompt_rate.shift = 0.9  # of the floor's 1 s, a move leaves 0.1 s: 10 new tokens
        again = eng.infill_prompt(typed_on, 16, 0.5, cache_reuse=16)
        assert again.new_tokens <= eng.prompt_rate.tokens_within(NEAR_BUDGETS * 0.5, True), (first.kept, again.kept)
        assert again.kept.prefix_tokens[0] >= first.kept.prefix_tokens[0]


def body_line(y: int) -> dict:
    """A budgeted completion typed at SOURCE's line `y` (a body line), after its indent."""
    return {"input_prefix": "".join(LINES[:y]), "input_suffix": "\n" + "".join(LINES[y + 1:y + 20]),
            "prompt": "    ", "n_predict": 4, "temperature": 0, "t_max_prompt_ms": 300, "t_max_predict_ms": 250}


def builds_done(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=60).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('edgespec_aside_builds_total{outcome="done"}'))


def test_a_cut_context_is_built_aside_afresh_and_the_next_line_starts_there(server):
    """After a budgeted /infill cut its context, the lines before the cursor line are evaluated afresh beside the
    slot while nobody waits (counted in edgespec_aside_builds). The request on the next line starts its prompt where
    those lines do: a prefix wider than its budget buys, for only the tokens the aside does not hold."""
    first = httpx.post(server.url + "/infill", json=body_line(121), timeout=300).json()
    assert first["truncated"] is True
    done = builds_done(server)  # earlier tests' builds ended when this request preempted them; its own takes a while
    for _ in range(600):  # the build runs once the answer is out; nothing else is sent meanwhile
        if builds_done(server) > done:
            break
        time.sleep(0.1)
    assert builds_done(server) > done
    # the next function's body line, with a budget for more than the aside leaves to evaluate (the lines written
    # since, the typed text, the suffix)
    budget = budget_buying(48, body_line(121), first, least=300)
    nxt = httpx.post(server.url + "/infill", json={**body_line(123), "t_max_prompt_ms": budget}, timeout=300).json()
    kept, cut = nxt["infill"]["prefix_tokens"][0], first["infill"]["prefix_tokens"][0]
    assert kept > max(cut, nxt["infill"]["budget_tokens"]), (first["infill"], nxt["infill"])
    # the cache held the kept lines but the two written since (+ a token where they join): not only the cut ones
    since = len(tokens(server, "".join(LINES[121:123])))
    assert nxt["tokens_cached"] > cut and nxt["tokens_cached"] + since + 1 >= kept, (nxt["infill"], nxt["timings"])


def test_an_editors_warm_up_finishes_the_aside_build_before_its_own_chunks(server):
    """llama.vim's ring warm-up comes in the pause after an answer and preempts the aside build the answer started;
    it runs that build to its end first, then evaluates its own chunks (which budgeted completions rarely carry)."""
    first = httpx.post(server.url + "/infill", json=body_line(41), timeout=300).json()  # lines no other test walks
    assert first["truncated"] is True
    done = builds_done(server)
    ring = [{"filename": "m.py", "text": "".join(SOURCE[:10])}]
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": ring, "prompt": "", "n_predict": 0,
            "samplers": [], "t_max_prompt_ms": 1, "t_max_predict_ms": 1}
    out = httpx.post(server.url + "/infill", json=warm, timeout=300).json()
    assert builds_done(server) > done  # done by the time the warm-up answers, not left stopped by it
    assert out["timings"]["prompt_n"] > 0, out["timings"]


def test_a_warm_up_of_chunks_the_last_completion_took_none_of_leaves_the_slot_be(server):
    """Where a completion's budget buys none of the extra chunks it is sent (a CPU's 0.5 s buys a few dozen tokens,
    llama.vim's ring holds a thousand or more), llama.vim's next ring warm-up is aborted by the next completion,
    having moved the slot's lines after the chunks for that completion to move back (a re-rotation of the cache in
    the request). So a warm-up of chunks the slot's last completion took none of evaluates nothing there."""
    ring = [{"filename": "declined.py", "text": "".join(SOURCE[64:70])}]  # chunks no other test sends
    fim = {**body_line(81), "input_extra": ring, "t_max_prompt_ms": 1}  # a budget that buys no chunk
    first = httpx.post(server.url + "/infill", json=fim, timeout=300).json()
    assert first["infill"]["extra_chunks"] == [0, 1], first["infill"]
    ring = ring + [{"filename": "new.py", "text": "".join(SOURCE[70:72])}]  # the ring as the next warm-up sends it
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": ring, "prompt": "", "n_predict": 0, "samplers": []}
    out = httpx.post(server.url + "/infill", json=warm, timeout=300).json()
    assert out["timings"]["prompt_n"] <= 1 and out["timings"]["shifted_n"] == 0, out["timings"]
    again = httpx.post(server.url + "/infill", json={**fim, "input_extra": ring}, timeout=300).json()
    assert again["timings"]["shifted_n"] == 0 and again["timings"]["prompt_n"] <= 2, again["timings"]


@pytest.mark.parametrize("shifts, reuse", [(True, 16), (False, 16), (True, 0)])
def test_once_the_slot_holds_an_aside_build_the_lines_before_it_go_in_front(qwen_draft_path, shifts, reuse):
    """A first aside build is narrow, so it is ready within a few of an editor's pauses; once the slot has taken it,
    the next answer asks the aside for the lines just before the slot's own (ASIDE_FRONT_TOKENS of them). Once built
    they go in front of the slot's lines, which move on: the slot holds the head, those lines and all it held, at
    contiguous positions, the aside nothing, and the next line's request keeps them all for its new tokens alone.
    Where the cache cannot shift, or the request asks for no chunk reuse (moved entries are not what a fresh
    evaluation gives), the next build is about ASIDE_GROWTH times as wide, afresh."""
    from edgespec.engine.infill import ASIDE_FIRST_TOKENS, ASIDE_FRONT_TOKENS, ASIDE_GROWTH, ASIDE_GROWTH_LEAST, \
        ASIDE_HEAD

    at = lambda y: Infill("".join(LINES[:y]), "\n" + "".join(LINES[y + 1:y + 5]), "    ")  # noqa: E731
    turn = lambda ip: GenerationConfig(max_tokens=1, cache_reuse=reuse, memory=None, slot=ip.slot)  # noqa: E731
    pause = lambda left: min(left, 64)  # noqa: E731
    with Engine(EngineConfig(str(qwen_draft_path), proposer="none", load=LoadConfig(n_ctx=4096, aside=1024))) as eng:
        eng.prompt_rate = PromptRate((1, 64), (0.05, 0.4))  # a slow CPU's: 0.5 s buys 74 new tokens
        eng.target.can_shift = shifts
        prefix = lambda t: len(t) - t.index(eng.target.vocab.fim_pre) - 1  # noqa: E731
        first = eng.infill_prompt(at(141), 16, 0.5, cache_reuse=reuse)
        eng.generate(first.tokens, turn(first))
        narrow = first.aside()
        assert narrow.slot is None and first.kept.prefix_tokens[0] < prefix(narrow.tokens) <= ASIDE_FIRST_TOKENS
        assert eng.build_aside(narrow, threading.Event(), pause)
        nxt = eng.infill_prompt(at(143), 16, 0.5, cache_reuse=reuse)  # two lines on: it starts where the aside does
        eng.generate(nxt.tokens, turn(nxt))
        took, slot = nxt.kept.prefix_tokens[0], eng.slots[nxt.slot].cache
        assert took > prefix(narrow.tokens) and slot.tokens[:len(narrow.tokens)] == narrow.tokens
        if not (shifts and reuse):
            wide = nxt.aside()
            assert wide.slot is None and at(143).prefix.endswith(wide.lines) and len(wide.lines) > len(narrow.lines)
            assert ASIDE_GROWTH_LEAST * took <= prefix(wide.tokens) <= min(ASIDE_GROWTH * took, 1024 - ASIDE_HEAD)
            return
        ahead = nxt.aside()  # the lines right before the slot's
        text = at(143).prefix
        assert ahead.slot == nxt.slot and 0 < prefix(ahead.tokens) <= ASIDE_FRONT_TOKENS
        assert text.index(narrow.lines) == text.index(ahead.lines) + len(ahead.lines)
        held = list(slot.tokens)
        assert eng.pool.join_front(nxt.slot, ahead.head, [t + 1 for t in ahead.follows]) is None  # not what it holds
        # a pause with no room for the re-rotation, which nothing aborts: built, held, and joined in the next one
        assert not eng.build_aside(ahead, threading.Event(), pause, lambda seconds: False)
        assert slot.tokens == held and eng.pool.aside.tokens == ahead.tokens
        eng.prompt_rate.shift = None  # the join's time teaches what a re-rotation costs
        assert eng.build_aside(ahead, threading.Event(), pause) and eng.prompt_rate.shift is not None
        slot = eng.slots[nxt.slot].cache
        assert slot.tokens == ahead.tokens + held[ahead.head:] and slot.pos_max() == slot.n_past - 1
        assert not eng.pool.aside.tokens and eng.pool.aside.pos_max() == -1

        last = eng.infill_prompt(at(144), 16, 0.5, cache_reuse=reuse)  # the next line keeps it all
        assert last.slot == nxt.slot and last.kept.prefix_tokens[0] > took + prefix(ahead.tokens), last.kept
        assert 0 < last.new_tokens <= last.budget_tokens
        out = eng.generate(last.tokens, turn(last))
        assert out.stats.cached_prompt_tokens >= len(ahead.tokens) + took


def test_a_typed_word_is_healed_and_the_answer_spells_it_in_the_models_own_tokens(server):
    """Typed text that ends inside a word ("os.listd") or after a bracket leaves the word with the mark before it
    (the bracket) out of the prompt; the answer's first tokens spell it again, as the model tokenizes it, and the
    answer goes out without it.
    token_healing false lays the typed text out whole, in llama.cpp's layout; anything but a boolean is refused by
    name."""
    fim = {"input_prefix": "import os\n\n\ndef list_files(root):\n    out = []\n", "input_suffix": "\n    return out\n",
           "prompt": "    for name in os.listd", "n_predict": 6, "temperature": 0, "return_tokens": True}
    out = httpx.post(server.url + "/infill", json=fim, timeout=300).json()
    spelled = httpx.post(server.url + "/detokenize", json={"tokens": out["tokens"]}, timeout=60).json()["content"]
    assert out["infill"]["healed"] == ".listd" and spelled == ".listd" + out["content"], out
    assert out["content"].startswith("ir("), out
    plain = httpx.post(server.url + "/infill", json={**fim, "token_healing": False}, timeout=300).json()
    spelled = httpx.post(server.url + "/detokenize", json={"tokens": plain["tokens"]}, timeout=60).json()["content"]
    assert plain["infill"]["healed"] == "" and spelled == plain["content"], plain
    # a bracket too, in the middle layout: the answer spells it again, in the model's own tokens
    after = {**fim, "prompt": "    for name in os.listdir("}
    bracket = httpx.post(server.url + "/infill", json=after, timeout=300).json()
    spelled = httpx.post(server.url + "/detokenize", json={"tokens": bracket["tokens"]}, timeout=60).json()["content"]
    assert bracket["infill"]["healed"] == "(" and spelled == "(" + bracket["content"], bracket
    # unhealed, the default middle layout completes far worse: such a request takes llama.cpp's
    assert (out["infill"]["layout"], plain["infill"]["layout"]) == ("middle", "prefix")
    bad = httpx.post(server.url + "/infill", json={**fim, "token_healing": "yes"}, timeout=60)
    assert bad.status_code == 400 and "'token_healing' must be true or false" in bad.json()["error"]["message"]


def test_an_answer_ends_before_a_line_that_repeats_the_text_below_the_cursor(server):
    """Where the prompt holds little of the text below the cursor (here llama.cpp's suffix size, which ends inside
    the second line below), the model writes on past the cursor line. Once a line it writes is one of the lines the
    file holds just below (prompts.fim.next_lines), the answer ends before it: the editor would drop it, after
    waiting for it. Lines below that differ past what the prompt holds let the same prompt write on."""
    rows = [f"row_{i} = ('the quick brown fox number {i} jumps over the lazy dog, then the dog wakes up, chases "
            f"the fox around the farm and back again until both of them fall asleep in the sun')" for i in range(40)]
    fim = {"input_prefix": "".join(r + "\n" for r in rows[:20]), "prompt": rows[20], "n_predict": 128,
           "temperature": 0, "cache_prompt": False}
    file = httpx.post(server.url + "/infill", json={**fim, "input_suffix": "\n" + "".join(r + "\n" for r in rows[21:])},
                      timeout=300).json()
    changed = "\n" + rows[21] + "\n" + "".join(r + "  # changed\n" for r in rows[22:])
    other = httpx.post(server.url + "/infill", json={**fim, "input_suffix": changed}, timeout=300).json()
    held = file["infill"]["suffix_tokens"][0]
    assert held == other["infill"]["suffix_tokens"][0] < len(tokens(server, rows[21] + "\n" + rows[22]))
    written = other["content"].split("\n")
    k = next((k for k in range(1, len(written) - 1) if written[k].strip()), None)
    assert k is not None and written[k] in rows[21:24], other  # a line of the file below, whole
    assert file["content"] == "".join(line + "\n" for line in written[:k]), (file, other)
    assert file["stop_type"] == "limit" and file["timings"]["predicted_n"] < other["timings"]["predicted_n"]
