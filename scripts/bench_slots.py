"""Editor completions while a chat answer streams: one slot (FIFO) against two (interleaved by cycle).

Continue uses one server for its chat and its autocomplete. For each mode this starts a real
`edgespec serve` on 127.0.0.1, streams a chat answer of --chat-tokens tokens (greedy), and once it
is under way sends --infills /infill requests, one every --interval seconds (each on its own
connection, as an editor fires one per pause in typing); it records each infill's time to first
token (TTFT: request sent to first content event).
After the chat answer ends it sends the chat's next turn and records how many prompt tokens it
reused from the cache (the chat's prefix survives the infills only if the chat kept its own slot).

    python scripts/bench_slots.py [--model qwen2.5-coder-1.5b] [--out docs/bench/slots.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_server import Server  # noqa: E402

from edgespec.decoding.costs import cpu_model  # noqa: E402
from edgespec.paths import MEMORY_ENV  # noqa: E402

QUESTION = "Explain, with examples, how Python's asyncio event loop schedules coroutines and callbacks."
PREFIX = "import math\n\n\ndef area_of_circle(radius):\n    "
SUFFIX = "\n\n\ndef main():\n    print(area_of_circle(2.0))\n"


def stream_events(url: str, body: dict, on_event) -> None:
    with httpx.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                on_event(json.loads(line[6:]))


def infill_ttft(server: Server, i: int) -> tuple[float, float]:
    """(seconds to the first content event, seconds to the end) of one llama.vim-style infill."""
    body = {"input_prefix": PREFIX + "# step %d\n    " % i, "input_suffix": SUFFIX, "input_extra": [],
            "n_predict": 32, "n_indent": 4, "t_max_predict_ms": 500, "temperature": 0, "stream": True,
            "cache_prompt": True, "samplers": ["top_k", "top_p", "infill"]}
    t0 = time.perf_counter()
    first: list[float] = []

    def on_event(e: dict) -> None:
        if e.get("content") and not first:
            first.append(time.perf_counter() - t0)

    stream_events(server.url + "/infill", body, on_event)
    end = time.perf_counter() - t0
    return (first[0] if first else end), end


def run_mode(model: str, slots: int, chat_tokens: int, infills: int, interval: float) -> dict:
    # edgespec's memory starts empty in each mode: an earlier run's answer to the same question would draft it
    memory = tempfile.TemporaryDirectory(prefix="bench-slots-memory-")
    os.environ[MEMORY_ENV] = memory.name
    server = Server(model, "--ctx", "4096", "--slots", str(slots))
    try:
        messages = [{"role": "user", "content": QUESTION}]
        chat_body = {"messages": messages, "max_tokens": chat_tokens, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}}
        answer: list[str] = []
        started = threading.Event()
        chat_times: dict[str, float] = {}

        def chat() -> None:
            t0 = time.perf_counter()

            def on_event(e: dict) -> None:
                for c in e.get("choices", []):
                    if c["delta"].get("content"):
                        answer.append(c["delta"]["content"])
                        if len(answer) >= 8:
                            started.set()

            stream_events(server.url + "/v1/chat/completions", chat_body, on_event)
            chat_times["total"] = time.perf_counter() - t0

        t = threading.Thread(target=chat)
        t.start()
        started.wait(300)
        results: list[tuple[float, float]] = [(0.0, 0.0)] * infills
        sent_during = []

        def one(i: int) -> None:
            results[i] = infill_ttft(server, i)

        workers = []
        for i in range(infills):
            sent_during.append(t.is_alive())
            w = threading.Thread(target=one, args=(i,))
            w.start()
            workers.append(w)
            time.sleep(interval)
        for w in workers:
            w.join()
        t.join()
        follow = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
            "messages": [*messages, {"role": "assistant", "content": "".join(answer)},
                         {"role": "user", "content": "Now show a short example."}],
            "max_tokens": 8, "temperature": 0}).json()
        ttft = [r[0] for r in results]
        return {"slots": slots, "infill_ttft_s": [round(x, 3) for x in ttft],
                "infill_total_s": [round(r[1], 3) for r in results],
                "ttft_median_s": round(statistics.median(ttft), 3), "ttft_max_s": round(max(ttft), 3),
                "infill_sent_while_chat_streamed": sent_during, "chat_total_s": round(chat_times["total"], 2),
                "follow_up_prompt_tokens": follow["usage"]["prompt_tokens"],
                "follow_up_cached_prompt_tokens": follow["speculative"]["cached_prompt_tokens"]}
    finally:
        server.stop()
        memory.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--chat-tokens", type=int, default=256)
    ap.add_argument("--infills", type=int, default=5)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()}
    modes = [run_mode(a.model, slots, a.chat_tokens, a.infills, a.interval) for slots in (1, 2)]
    for m in modes:
        print(f"slots {m['slots']}: infill TTFT median {m['ttft_median_s']:.3f}s max {m['ttft_max_s']:.3f}s "
              f"({m['infill_ttft_s']}); chat {m['chat_total_s']}s; follow-up reused "
              f"{m['follow_up_cached_prompt_tokens']}/{m['follow_up_prompt_tokens']} prompt tokens")
    print(f"TTFT median ratio one slot / two slots: {modes[0]['ttft_median_s'] / modes[1]['ttft_median_s']:.1f}x")
    if a.out:
        Path(a.out).write_text(json.dumps({"machine": machine, "model": a.model, "chat_tokens": a.chat_tokens,
                                           "interval_s": a.interval, "command": " ".join(sys.argv),
                                           "modes": modes}, indent=2) + "\n")


if __name__ == "__main__":
    main()
