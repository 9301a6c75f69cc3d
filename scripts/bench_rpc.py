"""The target over llama.cpp RPC workers on loopback, with a link delay put in: plain decoding against `auto` on code
edits, at 0.5 ms and 2 ms round trips, side by side in one run; then the same outputs replayed under the calibrated
curves with the round trips added, to see which K `auto` bets there.

Two `edgespec worker` processes hold all of the target's layers (one thread each: they compute one after the other,
so one core does the work and the other runs this script and the delaying proxies). Each worker sits behind a
proxy on 127.0.0.1 that holds every piece of data for half the round trip each way (tc netem needs root). A pass of
the target crosses both workers, so it pays two round trips; verifying K tokens pays them once for all K.

    CMAKE_ARGS="-DGGML_RPC=on" pip install --no-cache-dir --force-reinstall llama-cpp-python==0.3.36   # once
    python scripts/bench_rpc.py --out bench-results/rpc.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from workloads import code_edits  # noqa: E402

from edgespec import Engine, EngineConfig, GenerationConfig, LoadConfig  # noqa: E402
from edgespec.errors import WorkerError  # noqa: E402
from edgespec.remote import probe  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DelayProxy:
    """127.0.0.1:port -> the worker, every piece of data held `rtt / 2` each way (in its own thread and loop)."""

    def __init__(self, target_port: int, rtt: float) -> None:
        self.port, self.target_port, self.half = free_port(), target_port, rtt / 2
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", self.port))
        started.set()
        self.loop.run_until_complete(server.serve_forever())

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Each piece goes on `half` after it arrived; pieces keep their order and overlap in flight."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - self.loop.time()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(deliver())
        while data := await reader.read(1 << 16):
            queue.put_nowait((self.loop.time() + self.half, data))
        queue.put_nowait(None)
        await sender


def start_worker(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli", "worker", "--port", str(port), "--threads", "1",
                             "--device", "CPU"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            probe.probe(f"127.0.0.1:{port}", timeout=1)
            return proc
        except WorkerError:
            if time.time() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.2)


def live(args: argparse.Namespace, rtt: float, prompts: list[str]) -> dict:
    """plain and auto over the same two workers behind proxies of `rtt`, prompt by prompt in lockstep."""
    ports = [free_port(), free_port()]
    workers = [start_worker(p) for p in ports]
    proxies = [DelayProxy(p, rtt) for p in ports]
    endpoints = tuple(f"127.0.0.1:{px.port}" for px in proxies)
    try:
        config = EngineConfig(args.model, proposer="auto", load=LoadConfig(n_ctx=4096, n_threads=1), memory=False,
                              rpc=endpoints, rpc_layers=tuple(args.layers))
        out: dict = {"rtt_ms": rtt * 1e3, "prompts": []}
        with Engine(config) as eng:
            out["calibrated"] = [round(t / eng.costs.target_seconds[0], 2) for t in eng.costs.target_seconds]
            out["t1_ms"] = eng.costs.target_seconds[0] * 1e3
            for prompt in prompts:
                tokens = eng.chat_tokens([{"role": "user", "content": prompt}])
                row = {}
                for mode in ("none", "auto"):
                    done = eng.generate(tokens, GenerationConfig(max_tokens=args.max_tokens, proposer=mode,
                                                                 memory=None, reuse_prefix=False))
                    s = done.stats
                    row[mode] = {"tokens": done.tokens, "decode_seconds": s.decode_seconds,
                                 "tokens_per_second": s.tokens_per_second, "cycles": s.cycles,
                                 "drafted": s.drafted, "accepted": s.accepted}
                row["prompt"] = tokens
                out["prompts"].append(row)
                print(f"rtt {rtt * 1e3:.1f} ms: plain {row['none']['tokens_per_second']:.1f} tok/s, auto "
                      f"{row['auto']['tokens_per_second']:.1f} tok/s", file=sys.stderr)
        return out
    finally:
        for w in workers:
            w.kill()


def replay(runs: list[dict], extra_rtts: list[float]) -> list[str]:
    """The plain outputs replayed through auto's loop under the first run's calibrated curve with the round trips
    replaced by others: the bets auto makes as a pass costs more (scripts/replay_auto.py's recorded target)."""
    from replay_auto import RecordedTarget, dense

    from edgespec.config import MAX_K
    from edgespec.decoding import loop
    from edgespec.decoding.costs import CALIBRATION_BATCHES, CostTracker
    from edgespec.decoding.policy import Costs
    from edgespec.proposers.auto import AutoProposer
    from edgespec.proposers.ngram import NgramProposer

    base = runs[0]
    traces = [{"prompt": p["prompt"], "output": p["none"]["tokens"]} for p in base["prompts"]]
    lines = ["| round trip (replayed) | t(1) | auto ÷ plain | tokens drafted per cycle |", "|---|---:|---:|---:|"]
    for rtt in extra_rtts:
        # the calibrated passes with two round trips of the run taken out and two of `rtt` put in
        seconds = [c * base["t1_ms"] / 1e3 - 2 * base["rtt_ms"] / 1e3 + 2 * rtt for c in base["calibrated"]]
        curve = dict(zip(CALIBRATION_BATCHES, (s / seconds[0] for s in seconds)))
        auto = AutoProposer(NgramProposer(lambda t: False), None, CostTracker(Costs(tuple(curve), tuple(seconds))))
        steps = tokens = drafted = cycles = 0
        for prompt, output in dense(traces):
            target, stats = RecordedTarget(prompt + output, curve, lambda: 1.0), loop.Stats()
            for _ in loop.steps(target, auto, prompt, GenerationConfig(max_tokens=len(output), memory=None), stats,
                                threading.Event(), MAX_K, clock=lambda: target.clock):
                pass
            steps, tokens = steps + target.cost, tokens + len(output) - 1
            drafted, cycles = drafted + stats.drafted, cycles + stats.cycles
        lines.append(f"| {rtt * 1e3:.1f} ms | {seconds[0] * 1e3:.0f} ms | {tokens / steps:.2f}× | "
                     f"{drafted / max(cycles, 1):.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument("--layers", type=int, nargs=2, default=[14, 15], help="layer units on each worker")
    ap.add_argument("--prompts", type=int, default=3, help="code-edit prompts")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--replay-rtt-ms", type=float, nargs="+", default=[0.0, 0.5, 2.0, 10.0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "rpc.json")
    args = ap.parse_args()
    prompts = [text for _, text in code_edits(args.prompts)]
    runs = [live(args, ms / 1e3, prompts) for ms in args.rtt_ms]
    table = ["| round trip | plain tok/s | auto tok/s | auto ÷ plain | drafted / accepted |", "|---|---:|---:|---:|---:|"]
    for run in runs:
        plain = sum(len(p["none"]["tokens"]) - 1 for p in run["prompts"]) / sum(
            p["none"]["decode_seconds"] for p in run["prompts"])
        auto = sum(len(p["auto"]["tokens"]) - 1 for p in run["prompts"]) / sum(
            p["auto"]["decode_seconds"] for p in run["prompts"])
        drafted = sum(p["auto"]["drafted"] for p in run["prompts"])
        accepted = sum(p["auto"]["accepted"] for p in run["prompts"])
        table.append(f"| {run['rtt_ms']:.1f} ms | {plain:.1f} | {auto:.1f} | {auto / plain:.2f}× | "
                     f"{drafted} / {accepted} |")
    table += [""] + replay(runs, [ms / 1e3 for ms in args.replay_rtt_ms])
    print("\n".join(table))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs, "table": table},
                                   indent=1, default=str))


if __name__ == "__main__":
    main()
