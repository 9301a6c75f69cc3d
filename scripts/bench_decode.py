"""Plain greedy decoding speed: edgespec vs llama-cpp-python's Llama vs llama.cpp's C++.

All runs are interleaved in one process (A B C A B C …) on the same machine, and
the ratios of medians are what to read; absolute tok/s drift from run to run.

    python scripts/bench_decode.py --build-llama-cpp      # builds llama-bench once (~6 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_tools  # noqa: E402
import machine  # noqa: E402

from edgespec import GenerationConfig, LoadConfig, SamplingConfig  # noqa: E402
from edgespec.backend import Model  # noqa: E402
from edgespec.engine import Engine  # noqa: E402
from edgespec.models import resolve  # noqa: E402
from edgespec.decoding.sampling import greedy  # noqa: E402

PROMPT = "Write a long, detailed tutorial on binary search trees in Python, with code for every operation."


def bench_backend(m: Model, prompt: list[int], n: int) -> float:
    """n single-token decodes with greedy picking: the backend's own loop."""
    m.trim(0)
    tok = greedy(m.decode(prompt)[-1])
    t0 = time.perf_counter()
    for _ in range(n):
        tok = greedy(m.decode([tok])[-1])
    return n / (time.perf_counter() - t0)


def bench_engine(engine: Engine, prompt: list[int], n: int) -> float:
    """The full `edgespec generate` path: engine loop, EOS checks, text streaming."""
    engine.target.trim(0)
    out = engine.generate(prompt, GenerationConfig(max_tokens=n + 1, sampling=SamplingConfig(temperature=0.0), memory=None))
    if out.stats.completion_tokens < n + 1:
        raise SystemExit(f"the model stopped after {out.stats.completion_tokens} tokens; use a longer-answer prompt")
    return out.stats.tokens_per_second


def bench_llama_python(llm, prompt: list[int], n: int) -> float:
    """llama-cpp-python's high-level generator, greedy, timed after the first token."""
    it = llm.generate(prompt, top_k=1, temp=0.0, reset=True)
    next(it)
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    return n / (time.perf_counter() - t0)


def bench_llama_cpp(binary: Path, model: Path, threads: int, n: int) -> float:
    out = subprocess.run([str(binary), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(n), "-r", "1",
                          "-o", "json"], check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128, help="tokens decoded per run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--build-llama-cpp", action="store_true", help="build llama-bench if it is missing")
    ap.add_argument("--out", type=Path, default=Path("bench-results/decode.json"))
    args = ap.parse_args()

    from llama_cpp import Llama  # the comparison itself, not part of edgespec

    path = resolve(args.model)
    load = LoadConfig(n_ctx=1024, n_threads=args.threads)
    engine = Engine(str(path), load=load)
    backend = engine.target
    llm = Llama(str(path), n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    prompt = backend.tokenize(PROMPT)
    bench = llama_tools.tool("llama-bench", build=args.build_llama_cpp)
    if bench is None:
        print("llama-bench not built; pass --build-llama-cpp for the C++ column", file=sys.stderr)

    runs: dict[str, list[float]] = {"llama.cpp (llama-bench)": [], "edgespec backend": [], "edgespec engine": [],
                                    "llama-cpp-python Llama": []}
    for r in range(args.repeats):
        if bench is not None:
            runs["llama.cpp (llama-bench)"].append(bench_llama_cpp(bench, path, args.threads, args.n))
        runs["edgespec backend"].append(bench_backend(backend, prompt, args.n))
        runs["edgespec engine"].append(bench_engine(engine, prompt, args.n))
        runs["llama-cpp-python Llama"].append(bench_llama_python(llm, prompt, args.n))
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items() if v),
              file=sys.stderr)

    medians = {k: statistics.median(v) for k, v in runs.items() if v}
    ref = medians.get("llama.cpp (llama-bench)") or medians["edgespec backend"]
    where = machine.record(backend, args.threads)
    print(f"\n{machine.line(where)}\nmodel {path.name}, {args.threads} threads, {args.n} tokens, "
          f"{args.repeats} interleaved repeats\n")
    print(f"| {'decoder':<26} | median tok/s | ÷ llama.cpp |")
    print(f"|{'-' * 28}|-------------:|------------:|")
    for k, v in medians.items():
        print(f"| {k:<26} | {v:12.1f} | {v / ref:11.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": where, "model": path.name, "threads": args.threads, "n": args.n, "runs": runs,
                                    "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
