"""Soak a real `edgespec serve` on 127.0.0.1: mixed routes and clients for a bounded time, then report.

Clients pick, from a seeded mix, OpenAI chat and completions (the `openai` package), llama.cpp's
/completion and /infill (httpx), streaming or not; some close a stream midway (cancellations) and some
give up on a request before it is answered (disconnects). Reported per mode (--modes runs one server
after the other, e.g. speculation `auto` then `none`):
- requests sent, completed, cancelled or disconnected on purpose, and lost (any other failure; goal 0);
- the server's RSS (process tree) after warm-up and at the end (goal: within 64 MiB);
- p50 and p99 decode time per token, from the server's own per-request figures, over the first and the
  last fifth of the run ("fresh" and "end"): speculation can widen the tail while it lowers the median.

    python scripts/soak.py --minutes 30 --modes auto,none --out bench-results/soak.json

Only ever talks to 127.0.0.1, and stops after --minutes or --max-requests, whichever comes first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_infill import editing_steps  # noqa: E402
from test_server import Server  # noqa: E402
from workloads import code_edits, spec_bench  # noqa: E402

ROUTES = ("chat", "chat-stream", "completions", "completions-stream", "completion", "completion-stream", "infill",
          "infill-stream")
CANCEL_SHARE = 0.10  # streams closed after a few events
DISCONNECT_SHARE = 0.05  # requests given up on after DISCONNECT_AFTER seconds
DISCONNECT_AFTER = 0.5
WARMUP_REQUESTS = 6


@dataclass
class Record:
    t: float  # seconds since the start of the run
    route: str
    outcome: str  # ok, cancelled, disconnected, lost
    ms_per_token: float | None = None  # decode time per token, as the server measured it
    detail: str = ""


@dataclass
class Report:
    mode: str
    seconds: float
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    disconnected: int = 0
    lost: int = 0
    lost_details: list[str] = field(default_factory=list)
    rss_start_mib: float = 0.0
    rss_end_mib: float = 0.0
    fresh_p50_ms: float | None = None
    fresh_p99_ms: float | None = None
    end_p50_ms: float | None = None
    end_p99_ms: float | None = None


class Soak:
    def __init__(self, url: str, prompts: dict[str, list], seed: int) -> None:
        self.url = url
        self.prompts = prompts
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def pick(self) -> tuple[str, str, object]:
        with self.lock:
            r = self.rng.random()
            action = "cancel" if r < CANCEL_SHARE else "disconnect" if r < CANCEL_SHARE + DISCONNECT_SHARE else "run"
            route = self.rng.choice(ROUTES)
            if action == "cancel" and not route.endswith("stream"):
                route += "-stream"
            if action == "disconnect" and route.endswith("stream"):
                route = route.removesuffix("-stream")
            kind = "infill" if route.startswith("infill") else "code" if route.startswith("completion") else "chat"
            return route, action, self.rng.choice(self.prompts[kind])

    def one(self, t0: float) -> Record:
        route, action, prompt = self.pick()
        start = time.monotonic() - t0
        try:
            if action == "disconnect":
                self._request(route, prompt, timeout=DISCONNECT_AFTER)
                return Record(start, route, "ok", None, "answered before the client gave up")
            ms = self._request(route, prompt, cancel_after=3 if action == "cancel" else None)
            return Record(start, route, "cancelled" if action == "cancel" else "ok", ms)
        except (httpx.TimeoutException, openai.APITimeoutError):
            if action == "disconnect":
                return Record(start, route, "disconnected")
            return Record(start, route, "lost", None, "timeout")
        except httpx.HTTPStatusError as e:
            return Record(start, route, "lost", None, f"HTTP {e.response.status_code}: {_body(e.response)}"[:300])
        except Exception as e:  # anything else is a lost request, reported
            return Record(start, route, "lost", None, f"{type(e).__name__}: {e}"[:300])

    def _request(self, route: str, prompt: object, timeout: float = 600, cancel_after: int | None = None
                 ) -> float | None:
        stream = route.endswith("-stream")
        base = route.removesuffix("-stream")
        if base in ("chat", "completions"):
            return self._openai(base, prompt, stream, timeout, cancel_after)
        if base == "completion":
            body = {"prompt": prompt, "n_predict": 64, "temperature": 0, "stream": stream}
        else:
            prefix, suffix = prompt  # type: ignore[misc]
            body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 32, "temperature": 0,
                    "stream": stream}
        if not stream:
            r = httpx.post(f"{self.url}/{base}", json=body, timeout=timeout)
            r.raise_for_status()
            return _ms_per_token(r.json()["timings"]["predicted_per_second"])
        with httpx.stream("POST", f"{self.url}/{base}", json=body, timeout=timeout) as r:
            r.raise_for_status()
            last = None
            for i, line in enumerate(x for x in r.iter_lines() if x):
                if cancel_after is not None and i >= cancel_after:
                    return None  # leaving the block closes the connection: the server must cancel
                last = json.loads(line.removeprefix("data: "))
                if "error" in last:
                    raise RuntimeError(f"error event: {last['error']}")
        if cancel_after is not None:
            return None  # finished before the client closed it
        if not last or not last.get("stop"):
            raise RuntimeError("stream ended without its final event")
        return _ms_per_token(last["timings"]["predicted_per_second"])

    def _openai(self, base: str, prompt: object, stream: bool, timeout: float, cancel_after: int | None
                ) -> float | None:
        c = self.oai.with_options(timeout=timeout)
        kw = {"model": "x", "temperature": 0, "stream": stream}
        if base == "chat":
            res = c.chat.completions.create(messages=[{"role": "user", "content": prompt}], max_tokens=96, **kw)
        else:
            res = c.completions.create(prompt=prompt, max_tokens=64, **kw)
        if not stream:
            return _ms_per_token(res.model_extra["speculative"]["tokens_per_second"])
        last, finished = None, False
        with res:
            for i, chunk in enumerate(res):
                if cancel_after is not None and i >= cancel_after:
                    return None
                last = chunk
                finished = finished or chunk.choices[0].finish_reason is not None
        if cancel_after is not None:
            return None
        if not finished or last is None or not last.model_extra.get("speculative"):
            raise RuntimeError("stream ended without a finish_reason and stats")
        return _ms_per_token(last.model_extra["speculative"]["tokens_per_second"])


def _body(response: httpx.Response) -> str:
    try:
        return response.read().decode("utf-8", "replace")
    except httpx.HTTPError:  # a stream already closed
        return "(body not read)"


def _ms_per_token(tokens_per_second: float) -> float | None:
    return 1000.0 / tokens_per_second if tokens_per_second else None


def rss_mib(pid: int) -> float:
    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def soak(args: argparse.Namespace, mode: str, prompts: dict[str, list]) -> tuple[Report, list[Record]]:
    server = Server(args.model, "--ctx", str(args.ctx), "--proposer", mode, *args.server_args)
    proc, url = server.proc, server.url
    try:
        s = Soak(url, prompts, args.seed)
        for _ in range(WARMUP_REQUESTS):
            s.one(time.monotonic())
        rss_start = rss_mib(proc.pid)
        records: list[Record] = []
        t0 = time.monotonic()
        deadline = t0 + args.minutes * 60
        budget = iter(range(args.max_requests))

        def client() -> None:
            while time.monotonic() < deadline:
                with s.lock:
                    if next(budget, None) is None:
                        return
                rec = s.one(t0)
                with s.lock:
                    records.append(rec)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - t0
        rss_end = rss_mib(proc.pid)
    finally:
        server.stop()
    if "unexpected error" in server.stderr():
        print(f"the {mode} server logged unexpected errors:\n{server.stderr()[-3000:]}", file=sys.stderr)
    return summarize(mode, seconds, records, rss_start, rss_end), records


def summarize(mode: str, seconds: float, records: list[Record], rss_start: float, rss_end: float) -> Report:
    rep = Report(mode, round(seconds, 1), sent=len(records), rss_start_mib=round(rss_start, 1),
                 rss_end_mib=round(rss_end, 1))
    for r in records:
        if r.outcome == "ok":
            rep.completed += 1
        elif r.outcome == "cancelled":
            rep.cancelled += 1
        elif r.outcome == "disconnected":
            rep.disconnected += 1
        else:
            rep.lost += 1
            rep.lost_details.append(f"{r.route} at {r.t:.0f}s: {r.detail}")
    timed = [r for r in records if r.outcome == "ok" and r.ms_per_token is not None]
    fresh = [r.ms_per_token for r in timed if r.t < seconds / 5]
    end = [r.ms_per_token for r in timed if r.t >= seconds * 4 / 5]
    rep.fresh_p50_ms, rep.fresh_p99_ms = _round(percentile(fresh, 50)), _round(percentile(fresh, 99))
    rep.end_p50_ms, rep.end_p99_ms = _round(percentile(end, 50)), _round(percentile(end, 99))
    return rep


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def load_prompts(n_infill: int) -> dict[str, list]:
    chat = [q for _, q in spec_bench(4)] + [p for _, p in code_edits(8)]
    code = [p.split("```python\n", 1)[1].split("\n    ")[0] + "\n    " for _, p in code_edits(8)]
    return {"chat": chat, "code": code, "infill": editing_steps(n_infill)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--modes", default="auto,none", help="proposers, one server each, one after the other")
    ap.add_argument("--minutes", type=float, default=30.0, help="per mode")
    ap.add_argument("--max-requests", type=int, default=5000, help="per mode")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the reports and every request as JSON")
    ap.add_argument("server_args", nargs="*", help="more `edgespec serve` options, after --")
    args = ap.parse_args()
    prompts = load_prompts(40)
    reports, all_records = [], {}
    for mode in args.modes.split(","):
        rep, records = soak(args, mode, prompts)
        reports.append(rep)
        all_records[mode] = [asdict(r) for r in records]
        print(json.dumps(asdict(rep)), flush=True)
    print(f"\n{'mode':<6} {'sent':>5} {'done':>5} {'cancel':>6} {'disc':>5} {'lost':>5} {'RSS start':>10} "
          f"{'RSS end':>8} {'fresh p50/p99 ms/tok':>21} {'end p50/p99 ms/tok':>19}")
    for r in reports:
        print(f"{r.mode:<6} {r.sent:>5} {r.completed:>5} {r.cancelled:>6} {r.disconnected:>5} {r.lost:>5} "
              f"{r.rss_start_mib:>9.0f}M {r.rss_end_mib:>7.0f}M {r.fresh_p50_ms!s:>10}/{r.fresh_p99_ms!s:<10} "
              f"{r.end_p50_ms!s:>9}/{r.end_p99_ms!s:<9}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "reports": [asdict(r) for r in reports], "records": all_records}, indent=1))


if __name__ == "__main__":
    main()
